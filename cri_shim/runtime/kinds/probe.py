"""Which kind a runtime binary is, decided once per binary path.

Kata Containers is known by its binary's name (Kata 2's `kata-runtime` answers no OCI
command, `containerd-shim-kata-v2` speaks shim v2), gVisor by its `--version`; any other
binary is an OCI runtime driven by its command line (runc, crun, youki). A kind's module
is imported only when a handler of that kind is configured.
"""

from __future__ import annotations

import functools
import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cri_shim.runtime.features import ask_runtime
from cri_shim.runtime.kinds.base import HandlerKind

log = logging.getLogger(__name__)


def _kata() -> type[HandlerKind]:
    from cri_shim.runtime.kinds.kata import KataKind

    return KataKind


def _gvisor() -> type[HandlerKind]:
    from cri_shim.runtime.kinds.gvisor import GVisorKind

    return GVisorKind


@dataclass(frozen=True)
class KnownKind:
    load: Callable[[], type[HandlerKind]]  # imports the kind's module
    binaries: frozenset[str] = frozenset()  # known by the binary's file name
    version_prefix: str = ""  # or by what `<binary> --version` starts with


KNOWN_KINDS = (
    KnownKind(_kata, binaries=frozenset({"kata-runtime", "containerd-shim-kata-v2"})),
    KnownKind(_gvisor, version_prefix="runsc version"),
)


def _version(runtime_path: Path) -> str:
    try:
        return ask_runtime(runtime_path, "--version").stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _recognised(runtime_path: Path) -> KnownKind | None:
    for known in KNOWN_KINDS:
        if runtime_path.name in known.binaries:
            return known
    version = _version(runtime_path)
    for known in KNOWN_KINDS:
        if known.version_prefix and version.startswith(known.version_prefix):
            return known
    return None


@functools.cache
def kind_of(runtime_path: Path) -> HandlerKind:
    """The kind of the runtime at `runtime_path` (asked once, then remembered)."""
    known = _recognised(runtime_path)
    if known is None:
        return HandlerKind(runtime_path)
    kind = known.load()(runtime_path)
    log.info("runtime %s: %s", runtime_path, type(kind).__name__)
    return kind
