"""OpenSSL loaded with the first TLS connection, not with asyncio.

asyncio imports the ssl module when it is itself imported (`base_events`,
`selector_events` and `sslproto` each bind it), and with it libssl and libcrypto: about
4 MiB of a daemon that serves the CRI on a unix socket and needs TLS only to pull an
image, to serve streams over TLS or to export traces. Installed before asyncio is
imported, `load_ssl_on_first_use` makes asyncio's own modules find no ssl module (asyncio
then runs as on a Python built without it); the first `import ssl` from anywhere else
loads the real module and hands it to asyncio's modules, so that asyncio's TLS works from
then on as if the module had been there from the start.
"""

from __future__ import annotations

import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

# asyncio's modules that import ssl at their own import (3.11 to 3.13).
ASYNCIO_MODULES = ("asyncio.base_events", "asyncio.selector_events", "asyncio.sslproto")


def load_ssl_on_first_use() -> bool:
    """From now on asyncio imports without ssl; False (nothing done) where it is too late:
    asyncio or ssl is imported already."""
    if "asyncio" in sys.modules or "ssl" in sys.modules:
        return False
    if not any(isinstance(finder, _SslOnDemand) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SslOnDemand())
    return True


def give_to_asyncio(ssl: ModuleType) -> None:
    """What asyncio's modules bind at their import when ssl is there, bound now."""
    for name in ASYNCIO_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "ssl", None) is None:
            module.ssl = ssl  # type: ignore[attr-defined]
    sslproto = sys.modules.get("asyncio.sslproto")
    if sslproto is not None and not hasattr(sslproto, "SSLAgainErrors"):
        sslproto.SSLAgainErrors = (ssl.SSLWantReadError, ssl.SSLSyscallError)  # type: ignore[attr-defined]


# Plain classes, not importlib.abc's: that module loads tempfile and random (0.3 MiB).
class _SslOnDemand:
    """Refuses ssl to asyncio's modules; finds it for anyone else, once, and then leaves."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "ssl":
            return None
        if _imported_by_asyncio():
            raise ModuleNotFoundError("ssl is loaded on first use", name=fullname)
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _HandOver(spec.loader)  # type: ignore[assignment]
        return spec


def _imported_by_asyncio() -> bool:
    """Whether the module whose code runs the import statement is one of asyncio's."""
    frame = sys._getframe(1)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if not name.startswith(("importlib", "_frozen_importlib")) and name != __name__:
            return name == "asyncio" or name.startswith("asyncio.")
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _HandOver:
    """The ssl module's own loader, handing the module to asyncio once it is loaded."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        give_to_asyncio(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)  # get_source and the like, for tracebacks
