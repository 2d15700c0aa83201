"""How a container stops (runtime/stop.py), over the test doubles: the stop signal, the
grace period, SIGKILL.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from cri_shim.runtime.conmon import RuntimeBackend
from tests.unit.runtime.conftest import alive, create, lines
from tests.waiting import until


async def test_stop_escalates_to_sigkill(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    trapped = tmp_path / "trapped"
    pid = await create(
        stub_backend, tmp_path, f"trap '' TERM; : > {trapped}; while :; do sleep 0.05; done"
    )
    await stub_backend.start("c1")
    await until(trapped.exists)  # the shell has installed its trap
    started = time.monotonic()
    await stub_backend.stop("c1", 0.5, signal.SIGTERM)
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 10  # the grace was waited out, the loop was not
    assert stub_backend.exit_status("c1")[0] == 137  # type: ignore[index]
    assert not alive(pid)
    # Idempotent: stopping again, or stopping something unknown, is fine.
    await stub_backend.stop("c1", 5, signal.SIGTERM)
    await stub_backend.stop("never-created", 5, signal.SIGTERM)


async def test_stop_with_a_signal_the_process_honours(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    started = time.monotonic()
    await stub_backend.stop("c1", 60, signal.SIGTERM)
    assert time.monotonic() - started < 10  # the grace was not waited out
    assert stub_backend.exit_status("c1")[0] == 128 + signal.SIGTERM  # type: ignore[index]


async def test_a_container_that_exits_before_its_stop_signal_lands_is_stopped(
    stub_backend: RuntimeBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The runtime finds it running, then answers ESRCH: its process exited meanwhile.
    monkeypatch.setenv("FAKE_OCI_KILL_LATE", "1")
    await create(stub_backend, tmp_path, "sleep 0.3")
    await stub_backend.start("c1")
    await stub_backend.stop("c1", 5, signal.SIGTERM)
    status = stub_backend.exit_status("c1")
    assert status is not None and status[0] == 0


async def test_stop_of_a_created_container(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    pid = await create(stub_backend, tmp_path, "echo never")
    await stub_backend.stop("c1", 0, signal.SIGKILL)
    assert stub_backend.exit_status("c1")[0] == 137  # type: ignore[index]
    assert not alive(pid)
    assert lines(tmp_path / "logs" / "c1.log") == []
