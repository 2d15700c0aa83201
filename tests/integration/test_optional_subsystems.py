"""Optional subsystems load on first use: a daemon started with the defaults serves
without importing NRI, CDI, the gVisor and Kata handler kinds, the OpenTelemetry exporter,
the streaming server and its backend, the registry client, protobuf's JSON conversion or
the configuration's reference, and NRI's modules come with `[nri] enable`.

What the daemon has imported is read from inside it: a `sitecustomize` module, put on
its PYTHONPATH, starts a thread that writes `sys.modules` to a file when asked.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import INSTALLED_FLAGS, Daemon

pytestmark = [pytest.mark.integration, pytest.mark.root]

PROBE = """
import os, sys, threading, time

def _answer(directory):
    asked = os.path.join(directory, "ask")
    while not os.path.exists(asked):
        time.sleep(0.05)
    with open(os.path.join(directory, "modules.tmp"), "w") as f:
        f.write("\\n".join(sorted(sys.modules)))
    os.rename(os.path.join(directory, "modules.tmp"), os.path.join(directory, "modules"))

if os.environ.get("CRI_SHIM_TEST_PROBE"):
    threading.Thread(target=_answer, args=(os.environ["CRI_SHIM_TEST_PROBE"],), daemon=True).start()
"""

# Loaded only when configured or first used.
OPTIONAL = (
    "cri_shim.nri.hooks",
    "cri_shim.nri.adaptation",
    "cri_shim.nri.api.api_pb2",
    "cri_shim.nri.objects",
    "cri_shim.nri.adjust",
    "cri_shim.runtime.cdi",
    "cri_shim.runtime.gvisor",
    "cri_shim.runtime.kinds.gvisor",
    "cri_shim.runtime.kinds.kata",
    "cri_shim.tracing.otel",
    "opentelemetry",
    "cri_shim.config.reference",
    "tomli_w",
    "cri_shim.streaming.server",
    "cri_shim.streaming.runc_backend",
    "cri_shim.images.pull",
    "httpx",
    "google.protobuf.json_format",
    # OpenSSL, loaded by the first TLS connection or image stored (host/ssl_on_demand.py).
    "ssl",
    "_ssl",
    "_hashlib",
    "anyio",
)


def loaded_modules(daemon: Daemon, probe: Path) -> set[str]:
    daemon.runtime().Status(api_pb2.StatusRequest(), timeout=30)
    (probe / "ask").touch()
    deadline = time.monotonic() + 10
    while not (probe / "modules").exists():
        assert time.monotonic() < deadline, "the daemon did not answer the probe"
        time.sleep(0.05)
    return set((probe / "modules").read_text().split())


def probed_daemon(
    short_tmp: Path, make_daemon: type, settings: dict[str, object], flags: list[str] | None = None
) -> Daemon:
    probe = short_tmp / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    daemon: Daemon = make_daemon(
        settings=settings,
        env={"PYTHONPATH": str(probe), "CRI_SHIM_TEST_PROBE": str(probe)},
        interpreter_flags=flags or [],
    )
    daemon.start()
    return daemon


@pytest.mark.parametrize("flags", [[], INSTALLED_FLAGS], ids=["plain", "as installed"])
def test_a_daemon_with_the_defaults_imports_no_optional_subsystem(
    short_tmp: Path, make_daemon: type, flags: list[str]
) -> None:
    daemon = probed_daemon(short_tmp, make_daemon, {}, flags)
    modules = loaded_modules(daemon, short_tmp / "probe")
    assert "cri_shim.daemon" in modules  # the probe reads the daemon's own modules
    optional = [m for m in modules if any(m == o or m.startswith(f"{o}.") for o in OPTIONAL)]
    assert sorted(optional) == []


def test_nri_is_imported_when_enabled(short_tmp: Path, make_daemon: type) -> None:
    nri = {"enable": True, "socket_path": str(short_tmp / "nri.sock")}
    daemon = probed_daemon(short_tmp, make_daemon, {"nri": nri})
    modules = loaded_modules(daemon, short_tmp / "probe")
    assert {"cri_shim.nri.hooks", "cri_shim.nri.adaptation"} <= modules
