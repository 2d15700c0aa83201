"""ExecSync through `<runtime> exec` (runtime/exec_sync.py), over the test doubles."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cri_shim.errors import FailedPrecondition, Internal, NotFound
from cri_shim.runtime.conmon import RuntimeBackend
from tests.unit.runtime.conftest import alive, create


async def test_exec_sync(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    result = await stub_backend.exec_sync(
        "c1", ["/bin/sh", "-c", 'echo "out $X"; echo err >&2; exit 4'], 10, {"X": "42"}
    )
    assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == (
        b"out 42\n",
        b"err\n",
        4,
        False,
    )


async def test_exec_sync_timeout_returns_promptly_and_kills_the_process(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    marker = tmp_path / "exec.pid"
    started = time.monotonic()
    result = await stub_backend.exec_sync(
        "c1", ["/bin/sh", "-c", f"echo $$ > {marker}; echo partial; sleep 30; echo never"], 0.5
    )
    elapsed = time.monotonic() - started
    assert result.timed_out and result.exit_code == -1
    assert 0.5 <= elapsed < 10  # not waited on for its 30 s
    assert result.stdout == b"partial\n"
    assert b"timed out" in result.stderr
    assert not alive(int(marker.read_text()))


async def test_exec_sync_of_a_missing_binary_is_an_error_not_an_exit_code(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    with pytest.raises(Internal, match="executable file not found"):
        await stub_backend.exec_sync("c1", ["no-such-tool"], 5)


async def test_exec_sync_in_a_stopped_container(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "true")
    await stub_backend.start("c1")
    await stub_backend.wait_exit("c1", 5)
    with pytest.raises(FailedPrecondition, match="stopped"):
        await stub_backend.exec_sync("c1", ["true"], 5)
    with pytest.raises(NotFound):
        await stub_backend.exec_sync("nope", ["true"], 5)
