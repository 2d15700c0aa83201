"""The log reopened after kubelet's rotation (runtime/log_reopen.py), over the test
doubles.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from cri_shim.errors import FailedPrecondition, NotFound
from cri_shim.runtime.conmon import RuntimeBackend
from tests.unit.runtime.conftest import alive, create, lines
from tests.waiting import until


async def test_reopen_log_after_rotation(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    await create(
        stub_backend,
        tmp_path,
        "i=0; while [ $i -lt 200 ]; do echo line $i; i=$((i+1)); sleep 0.02; done",
    )
    await stub_backend.start("c1")
    log = tmp_path / "logs" / "c1.log"
    await until(lambda: log.exists() and lines(log))
    log.rename(tmp_path / "logs" / "c1.log.1")
    await stub_backend.reopen_log("c1")
    assert log.exists()  # returned only once the new file is there
    await until(lambda: lines(log))
    await stub_backend.stop("c1", 0, signal.SIGKILL)
    old = [c for _, c in lines(tmp_path / "logs" / "c1.log.1")]
    new = [c for _, c in lines(log)]
    assert old and new
    numbers = [int(c.split()[1]) for c in old + new]
    assert numbers == list(range(len(numbers)))  # nothing lost, nothing twice


async def test_reopen_log_of_an_exited_container(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "true")
    await stub_backend.start("c1")
    await stub_backend.wait_exit("c1", 5)
    # The monitor closes its control FIFO as it exits, just after the container.
    conmon_pid = int((tmp_path / "state" / "containers" / "c1" / "conmon.pid").read_text())
    await until(lambda: not alive(conmon_pid))
    with pytest.raises(FailedPrecondition, match="not running"):
        await stub_backend.reopen_log("c1")
    with pytest.raises(NotFound):
        await stub_backend.reopen_log("nope")
