"""Helper processes run on worker threads: their output and exit status, and a timeout or
a cancelled caller killing the whole session and reaping it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest

from cri_shim.host import spawn
from tests.waiting import until


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


async def test_exit_status_output_and_input() -> None:
    done = await spawn.run(
        ["sh", "-c", "read line; echo out:$line; echo err >&2; exit 3"],
        input=b"hello\n",
        timeout=10,
    )
    assert done == spawn.Finished(3, b"out:hello\n", b"err\n")
    assert spawn.owned() == frozenset()


async def test_a_timeout_kills_the_whole_session_and_keeps_what_it_wrote(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = f"echo started; sleep 60 & echo $! > {pids}; echo $$ >> {pids}; wait"
    with pytest.raises(spawn.TimedOut) as raised:
        await spawn.run(["sh", "-c", script], timeout=0.5)
    assert raised.value.finished.stdout == b"started\n"
    assert raised.value.finished.returncode == -9
    background, shell = (int(line) for line in pids.read_text().split())
    await until(lambda: not _alive(background))  # the shell's child went with it
    assert not _alive(shell)
    assert spawn.owned() == frozenset()


async def test_a_cancelled_caller_leaves_no_process(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    task = asyncio.create_task(
        spawn.run(["sh", "-c", f"echo $$ > {pid_file}; exec sleep 60"], timeout=None)
    )
    await until(lambda: pid_file.exists() and pid_file.read_text().strip() != "")
    pid = int(pid_file.read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Killed and reaped by the time the cancellation reaches the caller.
    assert not _alive(pid)
    assert spawn.owned() == frozenset()


async def test_a_missing_program_raises_oserror() -> None:
    with pytest.raises(FileNotFoundError):
        await spawn.run(["/nonexistent/program"], timeout=5)


async def test_capped_output_is_read_on_and_a_held_pipe_is_left_after_the_drain() -> None:
    # 1 MiB written, 1 KiB kept; then a background sleep holds stdout open past the exit.
    script = "head -c 1048576 /dev/zero; (sleep 30 &); exit 4"
    done = await spawn.run_capped(
        ["sh", "-c", script], timeout=20, limit=1024, drain=0.3, kill=lambda proc: None
    )
    assert (done.returncode, len(done.stdout), done.timed_out) == (4, 1024, False)
    assert spawn.owned() == frozenset()


async def test_capped_run_calls_its_killer_at_the_timeout(tmp_path: Path) -> None:
    killed: list[int] = []

    def kill(proc: subprocess.Popen[bytes]) -> None:
        killed.append(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)

    done = await spawn.run_capped(
        ["sh", "-c", "echo partial; exec sleep 60"], timeout=0.3, limit=1024, drain=1, kill=kill
    )
    assert done == spawn.Captured(None, b"partial\n", b"", True)
    assert len(killed) == 1 and not _alive(killed[0])


async def test_a_capped_run_waits_for_a_process_that_closed_its_output() -> None:
    done = await spawn.run_capped(
        ["sh", "-c", "exec >&- 2>&-; sleep 0.5; exit 6"],
        timeout=20,
        limit=1024,
        drain=0.1,
        kill=lambda proc: None,
    )
    assert (done.returncode, done.timed_out) == (6, False)


async def test_a_process_without_pipes_is_waited_for_by_its_exit_not_by_polling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Popen.wait(timeout) sleeps between looks (up to 50 ms each); every runc start and
    # conmon launch would wait that on top of its own time.
    slept: list[float] = []
    real_sleep = subprocess.time.sleep  # type: ignore[attr-defined]
    monkeypatch.setattr(
        subprocess.time,  # type: ignore[attr-defined]
        "sleep",
        lambda seconds: slept.append(seconds) or real_sleep(seconds),
    )
    log = tmp_path / "out"
    with log.open("wb") as out:
        done = await spawn.run(
            ["sh", "-c", "sleep 0.2; echo done; exit 5"],
            timeout=20,
            stdout=out.fileno(),
            stderr=out.fileno(),
        )
    assert done == spawn.Finished(5, b"", b"")
    assert log.read_bytes() == b"done\n"
    assert slept == []
    with pytest.raises(spawn.TimedOut) as raised:
        await spawn.run(["sleep", "60"], timeout=0.2, stdout=spawn.DEVNULL, stderr=spawn.DEVNULL)
    assert raised.value.finished.returncode == -9
    assert spawn.owned() == frozenset()
