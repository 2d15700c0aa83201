"""RuntimeBackend's create (runtime/create.py) over the test doubles: the id claimed, the
container created under conmon, and everything undone when the create fails.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cri_shim.errors import DeadlineExceeded, FailedPrecondition, Internal
from cri_shim.runtime.conmon import RuntimeBackend
from tests.crilog import Stream
from tests.unit.runtime.conftest import alive, create, lines, spec_for


async def test_lifecycle_exit_code_and_log(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    pid = await create(stub_backend, tmp_path, 'echo "$GREETING"; echo oops >&2; exit 3')
    assert pid > 0
    assert (tmp_path / "bundles" / "c1" / "config.json").exists()
    assert int((tmp_path / "bundles" / "c1" / "pidfile").read_text()) == pid
    assert await stub_backend.state("c1") == "created"
    assert stub_backend.exit_status("c1") is None
    assert stub_backend.recorded_exits() == set()

    before = time.time_ns()
    await stub_backend.start("c1")
    code, finished = await stub_backend.wait_exit("c1", 10)
    assert code == 3
    assert before <= finished <= time.time_ns()
    assert stub_backend.exit_status("c1") == (3, finished)
    assert stub_backend.recorded_exits() == {"c1"}
    assert await stub_backend.state("c1") == "stopped"
    assert lines(tmp_path / "logs" / "c1.log") == [
        (Stream.STDOUT, b"hello"),
        (Stream.STDERR, b"oops"),
    ]


async def test_create_failure_carries_the_runtime_message_and_leaves_nothing(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    spec = spec_for(tmp_path, "true")
    spec["process"]["args"] = ["no-such-binary"]
    with pytest.raises(Internal, match='exec: "no-such-binary": executable file not found'):
        await stub_backend.create("c1", tmp_path / "b", spec, tmp_path / "c1.log", False, False)
    assert list((tmp_path / "state" / "containers").iterdir()) == []
    assert list((tmp_path / "state" / "exits").iterdir()) == []
    assert list((tmp_path / "runtime-root").iterdir()) == []
    # The id is free again.
    await create(stub_backend, tmp_path, "true")


async def test_create_of_an_existing_id_never_touches_the_live_container(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    pid = await create(stub_backend, tmp_path, "sleep 30")
    await stub_backend.start("c1")
    with pytest.raises(FailedPrecondition, match="already exists"):
        await create(stub_backend, tmp_path, "true")
    assert alive(pid)
    assert await stub_backend.state("c1") == "running"


async def test_create_timeout_kills_the_monitor_and_cleans_up(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    # A "conmon" that never reports: the create budget must end it.
    slow = tmp_path / "slow-conmon"
    monitor = tmp_path / "monitor.pid"
    slow.write_text(f"#!/bin/sh\nsleep 30 &\necho $$ > {monitor}\nexec sleep 30\n")
    slow.chmod(0o755)
    backend = RuntimeBackend(
        "slow",
        stub_backend.runtime_path,
        tmp_path / "r2",
        slow,
        tmp_path / "s2",
        create_timeout=0.5,
    )
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"longer than 0\.5s"):
        await create(backend, tmp_path, "true")
    assert time.monotonic() - started < 10  # not waited on for its 30 s
    assert list((tmp_path / "s2" / "containers").iterdir()) == []
    if monitor.exists():  # it may have been killed before the shell got that far
        assert not alive(int(monitor.read_text()))


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".hidden"])
async def test_ids_that_could_escape_the_state_dir_are_refused(
    stub_backend: RuntimeBackend, tmp_path: Path, bad: str
) -> None:
    with pytest.raises(FailedPrecondition, match="invalid container id"):
        await create(stub_backend, tmp_path, "true", cid=bad)
