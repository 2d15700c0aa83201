"""Helper processes (runc's verbs and ExecSync's `runc exec`, CNI plugins, conmon's
launcher), started and waited for on worker threads rather than on the event loop.

asyncio forks on the event loop: with vfork the calling thread stays suspended until the
child has exec'd, and on a node whose CPUs are busy (pods starting, runc and CNI plugins
running) the child may wait milliseconds to be scheduled, which the loop, and every Status
and List call queued on it, waits too; Python 3.11's child watcher then starts a thread
per child on the loop as well. Popen on a worker thread gives up the interpreter while it
waits, so the loop goes on serving.

A process started here is killed (its whole session when it leads one) when its caller
is cancelled or its time is up, and reaped before run() returns. owned() names the
processes in flight, which the orphan reaper leaves to the thread that waits for them.

The daemon runs protected from the OOM killer (the unit's OOMScoreAdjust=-999), and its
children inherit that. A process started on a tenant's behalf (an exec and what ends it,
a port-forward's relay: work whose amount a pod decides) gets a normal score instead
(`tenant=True`, tenant_argv()): the OOM killer weighs it as any process, rather than
choosing the pods before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import select
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# More than the node ever runs at once (creations are bounded by [requests]); a call past
# it waits for a thread rather than failing.
MAX_THREADS = 64
# After SIGKILL a process is gone within this, unless it is stuck in the kernel (D state);
# output still held open by a process that left the session is not waited for longer.
KILL_GRACE = 2.0

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL

# Kills a process started here (and what it started), in place of SIGKILL to its session.
Killer = Callable[["subprocess.Popen[bytes]"], None]

# What a process started on a tenant's behalf gets: the kernel's default, unless the
# daemon's own is higher (no process goes below the daemon's).
TENANT_OOM_SCORE_ADJ = 0

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


def daemon_oom_score_adj() -> int:
    """The daemon's own oom_score_adj."""
    with open("/proc/self/oom_score_adj") as handle:
        return int(handle.read())


def tenant_argv(argv: Sequence[str]) -> list[str]:
    """`argv` to start on a tenant's behalf: through util-linux's choom, which sets its own
    oom_score_adj to TENANT_OOM_SCORE_ADJ and execs `argv` (the same process, so nothing
    of it runs protected, and its pid is the one started). Unchanged when the daemon's own
    score is no lower (raising a score needs no privilege; lowering one would), or where
    choom is missing (logged once)."""
    if daemon_oom_score_adj() >= TENANT_OOM_SCORE_ADJ:
        return list(argv)
    choom = _choom()
    if choom is None:
        return list(argv)
    return [choom, "-n", str(TENANT_OOM_SCORE_ADJ), "--", *argv]


@functools.cache
def _choom() -> str | None:
    found = shutil.which("choom")
    if found is None:
        log.warning("choom (util-linux) is missing: exec's helpers keep the daemon's oom_score_adj")
    return found


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
    options = {"stdout": stdout, "stderr": stderr, "env": env, "cwd": cwd, "pass_fds": pass_fds}
    finished: Finished = await _on_thread(job, job.run, list(argv), input, timeout, options)
    return finished


def call(argv: Sequence[str], *, timeout: float | None, tenant: bool = False) -> Finished:
    """run() for a caller already on a worker thread (stdin /dev/null, stderr dropped).
    `tenant`: started on a tenant's behalf (tenant_argv())."""
    job = _Job(True, tenant=tenant)
    return job.run(list(argv), None, timeout, {"stdout": PIPE, "stderr": DEVNULL})


async def _on_thread(job: _Job, work: Callable[..., Any], *args: Any) -> Any:
    """work(*args) on a spawn thread, for a caller that may be cancelled meanwhile."""
    done = asyncio.get_running_loop().run_in_executor(_executor(), work, *args)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        # The caller is gone: the process must not outlive it. The thread reaps it.
        job.cancel()
        await asyncio.wait([done], timeout=KILL_GRACE * 2)
        raise


class _Job:
    """One process, between the thread that waits for it and the loop that may cancel it."""

    def __init__(
        self, new_session: bool, kill: Killer | None = None, *, tenant: bool = False
    ) -> None:
        self.new_session = new_session
        self.kill_hook = kill
        self.tenant = tenant
        self.proc: subprocess.Popen[bytes] | None = None
        self.cancelled = False
        self.killed = False

    def cancel(self) -> None:
        # Set before looking at proc, as run() sets proc before looking at cancelled:
        # whichever comes second sees the other's write and kills.
        self.cancelled = True
        if self.proc is not None:
            if self.kill_hook is None:
                self._kill(self.proc)
            else:  # the hook may wait (for runc to reap what it killed): not on the loop
                _executor().submit(self._kill, self.proc)

    @contextlib.contextmanager
    def _started(self, argv: list[str], **popen: Any) -> Iterator[subprocess.Popen[bytes]]:
        """The process, known to cancel() and to the orphan reaper until it is reaped."""
        if self.tenant:
            argv = tenant_argv(argv)
        proc = subprocess.Popen(argv, close_fds=True, start_new_session=self.new_session, **popen)
        _owned.add(proc.pid)
        try:
            self.proc = proc
            if self.cancelled:
                self._kill(proc)
            yield proc
        finally:
            _owned.discard(proc.pid)

    def run(
        self,
        argv: list[str],
        input: bytes | None,
        timeout: float | None,
        options: dict[str, Any],
    ) -> Finished:
        with self._started(argv, stdin=PIPE if input is not None else DEVNULL, **options) as proc:
            try:
                if proc.stdin is None and proc.stdout is None and proc.stderr is None:
                    _wait(proc, timeout)  # nothing to talk to it about
                    out, err = b"", b""
                else:
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

    def run_capped(
        self, argv: list[str], timeout: float | None, limit: int, drain: float
    ) -> Captured:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._started(argv, stdin=DEVNULL, stdout=PIPE, stderr=PIPE) as proc:
            try:
                out, err, timed_out = _read_capped(
                    proc, deadline, limit, drain, lambda: self._kill(proc)
                )
            except BaseException:
                self._kill(proc)
                raise
            finally:
                if proc.poll() is None:
                    self._kill(proc)
                proc.wait()
            return Captured(None if timed_out else proc.returncode, out, err, timed_out)

    def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.returncode is not None or self.killed:
            return  # reaped (its pid may belong to another process by now), or done
        self.killed = True
        if self.kill_hook is not None:
            self.kill_hook(proc)
            return
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


@dataclass(frozen=True)
class Captured:
    returncode: int | None  # None: killed at its timeout (still reaped)
    stdout: bytes
    stderr: bytes
    timed_out: bool


async def run_capped(
    argv: Sequence[str],
    *,
    timeout: float | None,
    limit: int,
    drain: float,
    kill: Killer,
    tenant: bool = False,
) -> Captured:
    """Run `argv` (stdin /dev/null, a session of its own) and keep at most `limit` bytes of
    each of its stdout and stderr, reading on so that it never blocks on a full pipe.
    Once it has exited, output still held open (a background child) is read for `drain`
    seconds more. At `timeout` (None: none) or when the caller is cancelled, `kill(proc)`
    is called; it must leave the process exited or about to be. `tenant`: started on a
    tenant's behalf (tenant_argv())."""
    job = _Job(True, kill, tenant=tenant)
    captured: Captured = await _on_thread(job, job.run_capped, list(argv), timeout, limit, drain)
    return captured


def _read_capped(
    proc: subprocess.Popen[bytes],
    deadline: float | None,
    limit: int,
    drain: float,
    on_timeout: Callable[[], None],
) -> tuple[bytes, bytes, bool]:
    """Until the process has exited and both pipes are at EOF (or `drain` has passed since
    the exit), keeping at most `limit` bytes of each. A process that closed its output
    and runs on is waited for: only its timeout ends it."""
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    kept = {out_fd: bytearray(), err_fd: bytearray()}
    timed_out = False
    exited_at: float | None = None
    # Readable once the process has exited (not reaped: the pid stays ours till then).
    exit_fd = os.pidfd_open(proc.pid)
    try:
        with selectors.DefaultSelector() as selector:
            for fd in (out_fd, err_fd, exit_fd):
                os.set_blocking(fd, False)
                selector.register(fd, selectors.EVENT_READ)
            while True:
                now = time.monotonic()
                if exited_at is not None:
                    held = out_fd in selector.get_map() or err_fd in selector.get_map()
                    if not held or now - exited_at >= drain:
                        break
                if not timed_out and deadline is not None and now >= deadline:
                    timed_out = True
                    on_timeout()
                waits = []
                if exited_at is not None:
                    waits.append(drain - (now - exited_at))
                if deadline is not None and not timed_out:
                    waits.append(deadline - now)
                wait = max(0.0, min(waits)) if waits else None
                for key, _ in selector.select(wait):
                    if key.fd == exit_fd:
                        exited_at = time.monotonic()
                        selector.unregister(exit_fd)
                        continue
                    try:
                        chunk = os.read(key.fd, 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    into = kept[key.fd]
                    room = limit - len(into)
                    if room > 0:
                        into += chunk[:room]
    finally:
        os.close(exit_fd)
    proc.stdout.close()
    proc.stderr.close()
    return bytes(kept[out_fd]), bytes(kept[err_fd]), timed_out


def _wait(proc: subprocess.Popen[bytes], timeout: float | None) -> None:
    """proc.wait(timeout), woken by the exit itself: Popen's own wait with a timeout
    polls, sleeping up to 50 ms between looks, which every runc start, kill and delete and
    every conmon launch would wait on top of its own time (and wake the thread for)."""
    if timeout is None:
        proc.wait()
        return
    # Not reaped till proc.wait(): the pid is still this child's, and readable once it exits.
    pidfd = os.pidfd_open(proc.pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if not poller.poll(max(0, math.ceil(timeout * 1000))):
            raise subprocess.TimeoutExpired(proc.args, timeout)
    finally:
        os.close(pidfd)
    proc.wait()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="spawn")
        return _pool
