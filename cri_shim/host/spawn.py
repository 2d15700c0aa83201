"""Short-lived helper processes (runc's verbs, CNI plugins, conmon's launcher), started and
waited for on worker threads rather than on the event loop.

asyncio forks on the event loop: with vfork the calling thread stays suspended until the
child has exec'd, and on a node whose CPUs are busy (pods starting, runc and CNI plugins
running) the child may wait milliseconds to be scheduled, which the loop, and every Status
and List call queued on it, waits too; Python 3.11's child watcher then starts a thread
per child on the loop as well. Popen on a worker thread gives up the interpreter while it
waits, so the loop goes on serving.

A process started here is killed (its whole session when it leads one) when its caller
is cancelled or its time is up, and reaped before run() returns. owned() names the
processes in flight, which the orphan reaper leaves to the thread that waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# More than the node ever runs at once (creations are bounded by [requests]); a call past
# it waits for a thread rather than failing.
MAX_THREADS = 64
# After SIGKILL a process is gone within this, unless it is stuck in the kernel (D state);
# output still held open by a process that left the session is not waited for longer.
KILL_GRACE = 2.0

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_owned: set[int] = set()


@dataclass(frozen=True)
class Finished:
    returncode: int  # negative: killed by that signal
    stdout: bytes
    stderr: bytes


class TimedOut(Exception):
    """The process outlived its timeout and was killed; what it wrote is kept."""

    def __init__(self, finished: Finished) -> None:
        super().__init__(f"killed after its timeout (exit status {finished.returncode})")
        self.finished = finished


def owned() -> frozenset[int]:
    """The pids of the processes started here and not yet reaped."""
    return frozenset(_owned)


async def run(
    argv: Sequence[str],
    *,
    timeout: float | None,
    input: bytes | None = None,
    stdout: int = PIPE,
    stderr: int = PIPE,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    pass_fds: Sequence[int] = (),
    new_session: bool = True,
) -> Finished:
    """Run `argv` to its end and return its exit status and output (empty for a stream
    not piped). `input` is written to its stdin (None: /dev/null). With `new_session`
    it leads a session of its own, so that a kill takes the helpers it started too and
    cannot reach the daemon's group. Raises TimedOut after `timeout` seconds (None: no
    limit), OSError when it cannot be started."""
    job = _Job(new_session)
    loop = asyncio.get_running_loop()
    done = loop.run_in_executor(
        _executor(),
        job.run,
        list(argv),
        input,
        timeout,
        {"stdout": stdout, "stderr": stderr, "env": env, "cwd": cwd, "pass_fds": tuple(pass_fds)},
    )
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        # The caller is gone: the process must not outlive it. The thread reaps it.
        job.cancel()
        await asyncio.wait([done], timeout=KILL_GRACE * 2)
        raise


class _Job:
    """One process, between the thread that waits for it and the loop that may cancel it."""

    def __init__(self, new_session: bool) -> None:
        self.new_session = new_session
        self.proc: subprocess.Popen[bytes] | None = None
        self.cancelled = False

    def cancel(self) -> None:
        # Set before looking at proc, as run() sets proc before looking at cancelled:
        # whichever comes second sees the other's write and kills.
        self.cancelled = True
        if self.proc is not None:
            self._kill(self.proc)

    def run(
        self,
        argv: list[str],
        input: bytes | None,
        timeout: float | None,
        options: dict[str, Any],
    ) -> Finished:
        proc = subprocess.Popen(
            argv,
            stdin=PIPE if input is not None else DEVNULL,
            close_fds=True,
            start_new_session=self.new_session,
            **options,
        )
        _owned.add(proc.pid)
        try:
            self.proc = proc
            if self.cancelled:
                self._kill(proc)
            try:
                out, err = proc.communicate(input, timeout)
            except subprocess.TimeoutExpired:
                self._kill(proc)
                out, err = self._drain(proc)
                raise TimedOut(Finished(proc.returncode, out, err)) from None
            except BaseException:
                self._kill(proc)
                self._drain(proc)
                raise
            return Finished(proc.returncode, out or b"", err or b"")
        finally:
            _owned.discard(proc.pid)

    def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.returncode is not None:
            return  # reaped: its pid may belong to another process by now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.new_session:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.send_signal(signal.SIGKILL)

    @staticmethod
    def _drain(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
        """What a killed process wrote, and its exit status reaped. A descendant that left
        its session may hold the pipes open: past the grace their output is dropped."""
        try:
            out, err = proc.communicate(timeout=KILL_GRACE)
        except subprocess.TimeoutExpired:
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            proc.wait()
            return b"", b""
        return out or b"", err or b""


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="spawn")
        return _pool
