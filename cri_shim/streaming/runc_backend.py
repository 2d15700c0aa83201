"""The real streaming backend: `runc exec`, conmon's attach socket, and dials into a pod netns.

- exec: `runc --root <root> exec --pid-file <f> <id> cmd...` with pipes; with a TTY,
  `--detach --tty --console-socket <sock>` and runc hands us the pty master over that
  socket (SCM_RIGHTS); resizing is TIOCSWINSZ on the master. The command is killed by its host
  PID (from the pid file): runc exec only forwards signals it can catch, so SIGKILL sent
  to runc itself would leave the command running in the container. gVisor's `runsc exec`
  has no `--tty`: its console socket alone asks for a terminal (a host pty whose replica
  the Sentry takes as the command's controlling terminal); and its command lives in
  gVisor's kernel, where no host signal reaches it, so it is killed by its pid there
  (`--internal-pid-file`, then runtime/gvisor.py's kill_process_tree).
- Every process started here is a tenant's (an exec, a port-forward's relay per
  connection): it runs without the daemon's OOM protection (host/spawn.py tenant_argv).
- attach: conmon's `attach` socket (SOCK_SEQPACKET; each packet from conmon starts with
  the pipe it came from; what we send is the container's stdin) and its `ctl` FIFO for
  terminal size (`1 <height> <width>`).
- port-forward: a TCP connection to 127.0.0.1:PORT made inside the pod's network
  namespace, from a dedicated thread that enters the namespace and leaves it again. A
  socket stays in the namespace it was created in, so the daemon then uses it as usual.
  A host-network pod has no namespace of its own: it shares the daemon's, dialled as is.

The daemon wires two resolvers: container ID to `ContainerEndpoint`, sandbox ID to the
path of its pinned network namespace (None for a host-network pod). Both may be plain or
async callables and raise `cri_shim.errors.NotFound` for an unknown ID.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import logging
import os
import select
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from cri_shim.errors import FailedPrecondition, Internal
from cri_shim.host import spawn
from cri_shim.host.namespaces import netns_entered
from cri_shim.host.process import set_child_subreaper
from cri_shim.runtime.kinds.base import KillInside
from cri_shim.streaming.backend import ContainerEndpoint
from cri_shim.streaming.chunks import ChunkQueue
from cri_shim.streaming.terminal import EOT, PtyMaster

log = logging.getLogger("cri_shim.streaming.runc")

CONSOLE_TIMEOUT = 10.0
DIAL_TIMEOUT = 5.0
KILL_TIMEOUT = 5.0
# conmon tags each packet on the attach socket with the pipe it read it from.
CONMON_STDOUT = 2
CONMON_STDERR = 3
CONMON_PACKET = 8192 + 1
# Attach output held for a client that reads slowly, per stream.
ATTACH_BUFFERED = 1024 * 1024
CONMON_RESIZE = 1

T = TypeVar("T")


ContainerResolver = Callable[[str], ContainerEndpoint | Awaitable[ContainerEndpoint]]
NetnsResolver = Callable[[str], Path | Awaitable[Path | None] | None]
RelayResolver = Callable[[str, int], list[str] | None]


async def _resolve(value: T | Awaitable[T]) -> T:
    if inspect.isawaitable(value):
        return await value
    return value


class RuncStreamingBackend:
    """Implements `StreamingBackend` for containers run by runc under conmon."""

    def __init__(
        self,
        resolve_container: ContainerResolver,
        resolve_netns: NetnsResolver,
        *,
        work_dir: Path | None = None,
        resolve_relay: RelayResolver | None = None,
    ) -> None:
        self._resolve_container = resolve_container
        self._resolve_netns = resolve_netns
        # A command whose stdio is a connection to the port inside the pod, for a pod
        # whose network stack a dial from the node cannot reach (gVisor's); else None.
        self._resolve_relay = resolve_relay
        # Console sockets go here; unix socket paths are limited to 108 bytes, so short.
        self._work_dir = work_dir

    async def _running(self, container_id: str) -> ContainerEndpoint:
        endpoint = await _resolve(self._resolve_container(container_id))
        if not endpoint.running:
            raise FailedPrecondition(f"container {container_id} is not running")
        return endpoint

    async def exec(
        self, container_id: str, cmd: list[str], tty: bool, stdin: bool
    ) -> RuncExecProcess:
        endpoint = await self._running(container_id)
        return await RuncExecProcess.start(
            endpoint, container_id, cmd, tty=tty, stdin=stdin, work_dir=self._work_dir
        )

    async def attach(self, container_id: str, tty: bool, stdin: bool) -> ConmonAttachSession:
        endpoint = await self._running(container_id)
        return await ConmonAttachSession.connect(
            endpoint.attach_socket, endpoint.control_fifo, tty=tty
        )

    async def port_forward(
        self, sandbox_id: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        netns = await _resolve(self._resolve_netns(sandbox_id))
        relay = self._resolve_relay(sandbox_id, port) if self._resolve_relay else None
        if relay is not None:
            log.debug("port-forward to pod %s port %d through its sandbox", sandbox_id, port)
            process = await asyncio.create_subprocess_exec(
                *spawn.tenant_argv(relay),  # one per connection a client opens
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
            assert process.stdout is not None and process.stdin is not None
            return process.stdout, process.stdin
        sock = await dial_in_netns(netns, port)
        return await asyncio.open_connection(sock=sock)


# -- exec ----------------------------------------------------------------------------------


class RuncExecProcess:
    """One `runc exec`; implements `ExecProcess`.

    Without a TTY, runc stays in the foreground: it reaps the command and exits with its
    code. With a TTY, runc can only hand the terminal over a console socket when it
    detaches (`--detach`), so runc exits at once and the command is re-parented to the
    daemon, which is a child subreaper; we then wait for it and reap it through a pidfd.
    """

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        pid_file: Path,
        scratch: Path,
        pty: PtyMaster | None = None,
        pidfd: int = -1,
        inside: _InsideKiller | None = None,
    ) -> None:
        self._process = process
        self._pid_file = pid_file
        self._scratch = scratch
        self._pty = pty
        self._pidfd = pidfd
        self._inside = inside
        self._exit: asyncio.Task[int] | None = None

    @classmethod
    async def start(
        cls,
        endpoint: ContainerEndpoint,
        container_id: str,
        cmd: list[str],
        *,
        tty: bool,
        stdin: bool,
        work_dir: Path | None = None,
    ) -> RuncExecProcess:
        scratch = Path(tempfile.mkdtemp(prefix="cs-exec-", dir=work_dir or "/tmp"))
        pid_file = scratch / "pid"
        argv = [str(endpoint.runtime_path), "--root", str(endpoint.runtime_root), "exec"]
        argv += ["--pid-file", str(pid_file), *endpoint.exec_options]
        inside = (
            _InsideKiller(endpoint, endpoint.inside, container_id, scratch)
            if endpoint.inside is not None
            else None
        )
        if inside is not None:
            argv += ["--internal-pid-file", str(inside.pid_file)]
        try:
            if not tty:
                process = await asyncio.create_subprocess_exec(
                    *spawn.tenant_argv([*argv, container_id, *cmd]),
                    stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )  # fmt: skip
                return cls(process, pid_file, scratch, inside=inside)
            argv += ["--detach", *endpoint.tty_options]
            return await cls._start_tty(argv, container_id, cmd, pid_file, scratch, inside)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise

    @classmethod
    async def _start_tty(
        cls,
        argv: list[str],
        container_id: str,
        cmd: list[str],
        pid_file: Path,
        scratch: Path,
        inside: _InsideKiller | None,
    ) -> RuncExecProcess:
        set_child_subreaper()
        console = scratch / "console.sock"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(console))
            listener.listen(1)
            listener.setblocking(False)
            process = await asyncio.create_subprocess_exec(
                *spawn.tenant_argv([*argv, "--console-socket", str(console), container_id, *cmd]),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            try:
                master = await _receive_console(listener, process)
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
                raise
        pty = PtyMaster(master)
        try:
            code = await asyncio.wait_for(process.wait(), CONSOLE_TIMEOUT)
            assert process.stderr is not None
            if code != 0:
                message = (await process.stderr.read()).decode(errors="replace").strip()
                raise Internal(f"runc exec failed: {message or f'exit code {code}'}")
            pidfd = os.pidfd_open(_read_pid(pid_file))
        except BaseException:
            pty.close()
            raise
        return cls(process, pid_file, scratch, pty, pidfd, inside)

    async def write_stdin(self, data: bytes) -> None:
        if self._pty is not None:
            await self._pty.write(data)
            return
        if self._process.stdin is None:
            raise BrokenPipeError("stdin was not requested")
        self._process.stdin.write(data)
        await self._process.stdin.drain()

    async def close_stdin(self) -> None:
        if self._pty is not None:
            # A terminal has no end of input of its own; the EOF character is what a shell
            # or `cat` reading it in canonical mode takes as one.
            await self._pty.write(EOT)
        elif self._process.stdin is not None:
            self._process.stdin.close()

    async def read_stdout(self) -> bytes:
        if self._pty is not None:
            return await self._pty.read()
        assert self._process.stdout is not None
        return await self._process.stdout.read(32 * 1024)

    async def read_stderr(self) -> bytes:
        if self._pty is not None:
            return b""
        assert self._process.stderr is not None
        return await self._process.stderr.read(32 * 1024)

    async def resize(self, width: int, height: int) -> None:
        if self._pty is not None:
            self._pty.resize(width, height)

    async def wait(self) -> int:
        if self._exit is None:
            self._exit = asyncio.ensure_future(self._wait_exit())
        return await asyncio.shield(self._exit)

    async def _wait_exit(self) -> int:
        if self._pidfd < 0:
            code = await self._process.wait()
            return 128 - code if code < 0 else code
        await _readable(self._pidfd)
        try:
            result = _reap_pidfd(self._pidfd)
        except ChildProcessError:
            log.warning("an exec'd command was not re-parented to us (not a subreaper?)")
            return 255
        if result is None:
            return 255
        if result.si_code == os.CLD_EXITED:
            return result.si_status
        return 128 + result.si_status

    async def kill(self) -> None:
        try:
            if self._inside is not None and not self._runtime_exited():
                # While `runsc exec` waits, the command's pid in the sandbox is its own.
                await self._inside.kill()
            if self._pidfd >= 0:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            elif self._process.returncode is None:
                await self._kill_command()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wait(), KILL_TIMEOUT)
            if self._process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self._process.kill()
                await self._process.wait()
        finally:
            if self._pty is not None:
                self._pty.close()
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
            shutil.rmtree(self._scratch, ignore_errors=True)

    async def _kill_command(self) -> None:
        # The pid file appears once runc started the command; a kill that races the
        # start waits a moment for it.
        for _ in range(20):
            if self._pid_file.exists() or self._process.returncode is not None:
                break
            await asyncio.sleep(0.05)
        try:
            pid = _read_pid(self._pid_file)
        except (OSError, ValueError):
            # No command yet: runc forwards the signals it can catch, not SIGKILL; take
            # runc down, which stops the start.
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            return
        # runc waits for the command, so while runc lives the PID cannot be reused.
        if self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _runtime_exited(self) -> bool:
        """Whether the runtime's exec (the one holding the command) has exited."""
        if self._pidfd >= 0:
            return bool(select.select([self._pidfd], [], [], 0)[0])
        return self._process.returncode is not None


class _InsideKiller:
    """Kills an exec'd command and its descendants in the runtime's own kernel (runsc),
    by their pids there (runtime/gvisor.py): a SIGKILL to the host's `runsc exec` would
    leave them running in the sandbox."""

    def __init__(
        self, endpoint: ContainerEndpoint, kill: KillInside, container_id: str, scratch: Path
    ) -> None:
        self.pid_file = scratch / "inner-pid"
        self._kill = kill
        self._runtime = [str(endpoint.runtime_path), "--root", str(endpoint.runtime_root)]
        self._container_id = container_id

    async def kill(self) -> None:
        try:
            pid = _read_pid(self.pid_file)
        except (OSError, ValueError):
            return  # not started in the sandbox yet: killing `runsc exec` stops the start
        await asyncio.to_thread(self._kill, self._runtime, self._container_id, pid, KILL_TIMEOUT)


def _read_pid(path: Path) -> int:
    return int(path.read_text().strip())


def _reap_pidfd(pidfd: int) -> os.waitid_result | None:
    """The exit status of the (exited: its pidfd is readable) child, which this reaps."""
    return os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def _receive_console(listener: socket.socket, process: asyncio.subprocess.Process) -> int:
    """Accept runc's connection on the console socket and take the pty master it sends."""
    loop = asyncio.get_running_loop()
    accept = asyncio.ensure_future(loop.sock_accept(listener))
    exited = asyncio.ensure_future(process.wait())
    try:
        done, _ = await asyncio.wait(
            [accept, exited], timeout=CONSOLE_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        exited.cancel()
    if accept not in done:
        accept.cancel()
        message = b""
        if process.stderr is not None and process.returncode is not None:
            message = await process.stderr.read()
        raise Internal(
            "runc exec did not hand over a terminal: "
            + (message.decode(errors="replace").strip() or "timed out")
        )
    conn, _ = accept.result()
    with conn:
        conn.settimeout(CONSOLE_TIMEOUT)
        _, fds, _, _ = await asyncio.to_thread(socket.recv_fds, conn, 4096, 1)
    if not fds:
        raise Internal("runc exec sent no terminal over the console socket")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0]


# -- attach --------------------------------------------------------------------------------


class ConmonAttachSession:
    """A client of conmon's attach socket; implements `AttachSession`."""

    def __init__(self, sock: socket.socket, control_fifo: Path, tty: bool) -> None:
        self._sock = sock
        self._control_fifo = control_fifo
        self._tty = tty
        # Output the client has not taken yet: reading conmon's socket stops while full.
        self._stdout = ChunkQueue(ATTACH_BUFFERED)
        self._stderr = ChunkQueue(ATTACH_BUFFERED)
        self._reader = asyncio.create_task(self._read_packets())
        self._stdin_closed = False

    @classmethod
    async def connect(
        cls, attach_socket: Path, control_fifo: Path, *, tty: bool
    ) -> ConmonAttachSession:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        # The socket's path can exceed the 108 bytes of sun_path; going through an fd of its
        # directory keeps it short whatever the state directory is.
        dir_fd = os.open(attach_socket.parent, os.O_PATH)
        try:
            await asyncio.get_running_loop().sock_connect(
                sock, f"/proc/self/fd/{dir_fd}/{attach_socket.name}"
            )
        except OSError as exc:
            sock.close()
            raise FailedPrecondition(f"cannot attach: {attach_socket}: {exc.strerror}") from exc
        finally:
            os.close(dir_fd)
        return cls(sock, control_fifo, tty)

    async def _read_packets(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while packet := await loop.sock_recv(self._sock, CONMON_PACKET + 1):
                pipe, data = packet[0], packet[1:]
                if data:
                    await (self._stderr if pipe == CONMON_STDERR else self._stdout).put(data)
        except OSError as exc:
            log.debug("attach socket ended: %s", exc)
        finally:
            self._stdout.end()
            self._stderr.end()

    async def write_stdin(self, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        # Packets larger than conmon's buffer would be cut, so send its size at most.
        for start in range(0, len(data), CONMON_PACKET - 1):
            await loop.sock_sendall(self._sock, data[start : start + CONMON_PACKET - 1])

    async def close_stdin(self) -> None:
        if self._stdin_closed:
            return
        self._stdin_closed = True
        if self._tty:
            await self.write_stdin(EOT)
        else:
            # conmon closes the container's stdin on a half-closed attach connection
            # (unless the container asked to keep it open); output keeps flowing.
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)

    async def read_stdout(self) -> bytes:
        return await self._stdout.get() or b""

    async def read_stderr(self) -> bytes:
        return await self._stderr.get() or b""

    async def resize(self, width: int, height: int) -> None:
        message = f"{CONMON_RESIZE} {height} {width}\n".encode()
        await asyncio.to_thread(_write_fifo, self._control_fifo, message)

    async def detach(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._sock.close()


def _write_fifo(path: Path, message: bytes) -> None:
    # Non-blocking: a FIFO nobody reads (conmon gone) must not hang the daemon.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise FailedPrecondition("the container's monitor is not running") from exc
        raise
    try:
        os.write(fd, message)
    finally:
        os.close(fd)


# -- port-forward --------------------------------------------------------------------------


def _connect_in_netns(netns: Path | None, port: int, timeout: float) -> socket.socket:
    """Runs in a thread of its own (see dial_in_netns): setns only changes the caller thread."""
    if netns is None:
        return _connect_loopback(port, timeout)
    # Should the way back fail, the thread stays in the pod's namespace, which is
    # harmless: it is this dial's own thread and it ends right after.
    with netns_entered(netns):
        return _connect_loopback(port, timeout)


def _connect_loopback(port: int, timeout: float) -> socket.socket:
    last: OSError | None = None
    for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect((address, port))
        except OSError as exc:
            sock.close()
            last = last or exc
            continue
        sock.setblocking(False)
        return sock
    assert last is not None
    raise last


async def dial_in_netns(
    netns: Path | None, port: int, connect_timeout: float = DIAL_TIMEOUT
) -> socket.socket:
    """A connected, non-blocking socket to localhost:port inside the namespace at `netns`
    (None: the daemon's own, which host-network pods share)."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future[socket.socket] = loop.create_future()

    def deliver(sock: socket.socket | None, error: BaseException | None) -> None:
        if result.cancelled():
            if sock is not None:
                sock.close()  # nobody waits for it any more
        elif error is not None:
            result.set_exception(error)
        else:
            result.set_result(sock)  # type: ignore[arg-type]

    def body() -> None:
        try:
            sock = _connect_in_netns(netns, port, connect_timeout)
        except BaseException as exc:
            loop.call_soon_threadsafe(deliver, None, exc)
        else:
            loop.call_soon_threadsafe(deliver, sock, None)

    # A fresh thread per dial rather than a pool: a pooled thread that failed to return to
    # the host namespace would carry the pod's namespace into unrelated work.
    threading.Thread(target=body, name=f"netns-dial-{port}", daemon=True).start()
    return await result
