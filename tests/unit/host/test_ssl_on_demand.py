"""OpenSSL on first use: asyncio imported without ssl, and TLS over asyncio working once
something imports ssl. Each case runs in a fresh interpreter (this one has asyncio)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.collectors import self_signed

# An echo over TLS through asyncio's streams, after ssl was loaded by an `import ssl`.
TLS_ECHO = """
import sys
from cri_shim.host.ssl_on_demand import load_ssl_on_first_use
assert load_ssl_on_first_use()
import asyncio
import cri_shim.daemon
assert [m for m in ("ssl", "_ssl", "hashlib", "_hashlib") if m in sys.modules] == []
import ssl
cert, key = sys.argv[1:3]

async def echo(reader, writer):
    writer.write(await reader.readline())
    await writer.drain()
    writer.close()

async def main():
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=served)
    port = server.sockets[0].getsockname()[1]
    trusted = ssl.create_default_context(cafile=cert)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=trusted)
    writer.write(b"over tls\\n")
    print((await reader.readline()).decode().strip())
    writer.close()
    server.close()

asyncio.run(asyncio.wait_for(main(), 20))
"""


def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )


def test_asyncio_serves_tls_once_ssl_is_imported(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    done = run(TLS_ECHO, str(cert), str(key))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "over tls"


def test_too_late_once_asyncio_is_imported() -> None:
    code = (
        "import asyncio\n"
        "from cri_shim.host.ssl_on_demand import load_ssl_on_first_use\n"
        "assert not load_ssl_on_first_use()\n"
        "assert asyncio.base_events.ssl is not None\n"
    )
    done = run(code)
    assert done.returncode == 0, done.stderr
