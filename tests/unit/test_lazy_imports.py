"""Optional subsystems load on first use: importing what `cri-shim serve` imports loads
none of them. What a started daemon holds, with the defaults and with NRI on, is read
from inside one in tests/integration/test_optional_subsystems.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from cri_shim.streaming.backend import StreamingBackend
from cri_shim.streaming.on_demand import StreamingOnDemand

# Each with what first needs it.
LAZY = {
    "cri_shim.config.reference": "`cri-shim config`",
    "cri_shim.config.handlers_doc": "`cri-shim config --reference`",
    "tomli_w": "`cri-shim config`",
    "cri_shim.streaming.server": "the first Exec, Attach or PortForward",
    "cri_shim.streaming.runc_backend": "the first Exec, Attach or PortForward",
    "cri_shim.images.pull": "the first PullImage",
    "httpx": "the first PullImage",
    "google.protobuf.json_format": "the first UpdatePodSandboxResources",
    "cri_shim.nri.hooks": "[nri] enable",
    "cri_shim.nri.adaptation": "[nri] enable",
    "cri_shim.runtime.cdi": "the first container that names a CDI device",
    "cri_shim.runtime.gvisor": "a gVisor handler (runsc)",
    "cri_shim.runtime.kinds.gvisor": "a gVisor handler (runsc)",
    "cri_shim.runtime.kinds.kata": "a Kata handler",
    "cri_shim.tracing.otel": "[tracing] endpoint",
    "tempfile": "the first image unpacked (with the random module it loads)",
    "cri_shim.server.metrics_messages": "the first ListMetricDescriptors or ListPodSandboxMetrics",
    # OpenSSL (host/ssl_on_demand.py): asyncio is imported without it.
    "ssl": "the first TLS connection (a pull, streams or traces over TLS)",
    "_hashlib": "the first image stored (its digests)",
    "anyio": "the first PullImage (httpx's)",
}


@pytest.mark.parametrize("flags", [[], ["-OO"]], ids=["plain", "as installed"])
def test_serving_imports_no_optional_subsystem(flags: list[str]) -> None:
    # As `cri-shim serve` imports them: the command first, OpenSSL deferred, the daemon.
    probe = (
        "import sys, cri_shim.cli\n"
        "from cri_shim.host.ssl_on_demand import load_ssl_on_first_use\n"
        "if 'asyncio' in sys.modules or not load_ssl_on_first_use(): sys.exit(3)\n"
        "import cri_shim.daemon; print('\\n'.join(sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, *flags, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "cri_shim.daemon" in loaded  # the probe saw the daemon's modules
    early = {name: LAZY[name] for name in LAZY if name in loaded}
    assert early == {}, "imported before what needs them"


class _FakeBackend:
    """Stands for the runc backend; the server is never started here."""


async def test_the_streaming_backend_is_made_by_the_first_streaming_request() -> None:
    made: list[StreamingBackend] = []

    def make_backend() -> StreamingBackend:
        made.append(_FakeBackend())  # type: ignore[arg-type]
        return made[-1]

    streaming = StreamingOnDemand("127.0.0.1:0", None, None, make_backend)
    await asyncio.sleep(0)
    assert made == []
    server = await streaming.server()
    try:
        assert len(made) == 1
        assert await streaming.server() is server  # made once, with the server
        assert len(made) == 1
    finally:
        await streaming.aclose()
