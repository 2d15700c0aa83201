"""conmon started for a container: its bundle and files written, conmon run with the
arguments that make it run `<runtime> create`, and the container's pid read from the
report conmon writes on its sync pipe.

conmon holds the container's stdio, writes the CRI log, records the exit code in a file
and outlives the daemon (runtime/container_files.py has the files it leaves).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cri_shim import tracing
from cri_shim.errors import DeadlineExceeded, Internal
from cri_shim.host import spawn
from cri_shim.runtime.container_files import Meta, read_conmon_ref, tail, write_atomic
from cri_shim.runtime.handler_runtime import HandlerRuntime
from cri_shim.runtime.monitors import ProcessRef
from cri_shim.runtime.oci import runtime_error_message


class ConmonLauncher:
    """Start conmon, which creates the container in the runtime and then monitors it."""

    def __init__(
        self,
        runtime: HandlerRuntime,
        conmon_path: Path,
        conmon_runtime: Path,
        create_timeout: float,
        conmon_log_level: str,
    ) -> None:
        self._runtime = runtime
        self._files = runtime.files
        self.conmon_path = conmon_path
        # What conmon runs (gVisor's containers need a process it can wait for).
        self.conmon_runtime = conmon_runtime
        self.create_timeout = create_timeout
        self.conmon_log_level = conmon_log_level

    async def launch(
        self,
        container_id: str,
        cdir: Path,
        bundle: Path,
        spec: Mapping[str, Any],
        log_path: Path,
        tty: bool,
        stdin: bool,
        stdin_once: bool,
    ) -> int:
        """The container created under a new conmon; its pid."""
        meta = self._prepare(container_id, cdir, bundle, spec, log_path, tty)
        args = self._conmon_args(container_id, cdir, bundle, log_path, tty, stdin, stdin_once)
        report = await self._run_conmon(container_id, cdir, args)
        conmon = self._record_conmon(cdir, meta)
        pid = _pid_from_report(container_id, cdir, report)
        if self._runtime.scopes is not None and conmon is not None:
            await self._runtime.scopes.place(container_id, meta.cgroups_path, conmon)
        return pid

    def _conmon_args(
        self,
        container_id: str,
        cdir: Path,
        bundle: Path,
        log_path: Path,
        tty: bool,
        stdin: bool,
        stdin_once: bool,
    ) -> list[str]:
        args = [
            str(self.conmon_path),
            "--api-version",
            "1",
            "-c",
            container_id,
            "-u",
            container_id,
            "-n",
            container_id,
            "-r",
            str(self.conmon_runtime),
            "-b",
            str(bundle),
            "-p",
            str(bundle / "pidfile"),
            "--conmon-pidfile",
            str(cdir / "conmon.pid"),
            "--persist-dir",
            str(cdir / "persist"),
            "--exit-dir",
            str(self._files.exits),
            # The attach socket in the bundle, whatever its path's length: without this,
            # conmon links it as <socket dir>/<id> and cuts the id short when that path
            # exceeds sun_path's 108 bytes, so nobody could find it. Clients connect
            # through an fd of the bundle (/proc/self/fd/N/attach), as CRI-O does.
            "--full-attach",
            "-l",
            f"k8s-file:{log_path}",
            "--log-level",
            self.conmon_log_level,
        ]
        for runtime_arg in self._runtime.oci.conmon_runtime_args():
            args += ["--runtime-arg", runtime_arg]
        if tty:
            args.append("--terminal")
        if stdin:
            args.append("--stdin")
            if not stdin_once:
                # kubelet's stdinOnce=false: stdin stays open across attach sessions.
                args.append("--leave-stdin-open")
        return args

    async def _run_conmon(self, container_id: str, cdir: Path, args: list[str]) -> bytes:
        """Start conmon and wait, within the create budget, for its first process to exit
        and for the report on the sync pipe (empty when conmon closed it without one)."""
        deadline = time.monotonic() + self.create_timeout
        sync_read, sync_write = os.pipe()
        diagnostics = os.open(cdir / "conmon.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        # conmon finds the sync pipe by the fd number in _OCI_SYNCPIPE. Its stdout and
        # stderr go to a file, never a pipe to us: conmon outlives the daemon, and a write
        # to a pipe whose reader died would kill it with SIGPIPE. It forks its monitor and
        # the first process exits at once; killed on timeout or cancellation.
        launch = spawn.run(
            args,
            timeout=_remaining(deadline),
            stdout=diagnostics,
            stderr=diagnostics,
            pass_fds=(sync_write,),
            env={**os.environ, "_OCI_SYNCPIPE": str(sync_write)},
            # conmon writes some files (an `oom` marker) relative to its working dir.
            cwd=cdir,
            new_session=False,
        )
        try:
            try:
                with tracing.span("conmon", **{"cri.container_id": container_id}):
                    done = await launch
            finally:
                os.close(sync_write)
                os.close(diagnostics)
            if done.returncode != 0:
                raise Internal(
                    f"conmon for {container_id} failed (exit status {done.returncode}): "
                    f"{tail(cdir / 'conmon.log')}"
                )
            report = await _read_sync_line(sync_read, _remaining(deadline))
        except (TimeoutError, spawn.TimedOut):
            raise DeadlineExceeded(
                f"creating container {container_id} took longer than {self.create_timeout:g}s"
            ) from None
        finally:
            with contextlib.suppress(OSError):
                os.close(sync_read)
        return report

    def _record_conmon(self, cdir: Path, meta: Meta) -> ProcessRef | None:
        """Add conmon's identity (pid and start time) to the container's meta.json, so that
        a later stop or restart can tell conmon from a process that reused its pid."""
        conmon = read_conmon_ref(cdir)
        if conmon is not None:
            meta = Meta(
                **{**asdict(meta), "conmon_pid": conmon.pid, "conmon_start_time": conmon.start_time}
            )
            write_atomic(cdir / "meta.json", json.dumps(asdict(meta)).encode())
        return conmon

    def _prepare(
        self,
        container_id: str,
        cdir: Path,
        bundle: Path,
        spec: Mapping[str, Any],
        log_path: Path,
        tty: bool,
    ) -> Meta:
        """Write config.json and meta.json (small local files: not worth a thread)."""
        config = self._runtime.kind.prepare_spec(dict(spec))  # the caller's is left as it was
        # The tty flag is conmon's and the spec's at once; one source so they cannot differ.
        config["process"] = {**config.get("process", {}), "terminal": tty}
        bundle.mkdir(parents=True, exist_ok=True)
        write_atomic(bundle / "config.json", json.dumps(config).encode())
        with contextlib.suppress(FileNotFoundError):
            (self._files.exits / container_id).unlink()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        meta = Meta(
            bundle=str(bundle),
            log_path=str(log_path),
            cgroups_path=str(config.get("linux", {}).get("cgroupsPath", "")),
        )
        write_atomic(cdir / "meta.json", json.dumps(asdict(meta)).encode())
        return meta


def _pid_from_report(container_id: str, cdir: Path, report: bytes) -> int:
    """The container's pid from conmon's sync-pipe report; a failure names runc's reason."""
    if not report:
        raise Internal(
            f"conmon for {container_id} exited without reporting the container's pid: "
            f"{tail(cdir / 'conmon.log')}"
        )
    try:
        message = json.loads(report)
        pid = int(message["data"])
    except (ValueError, KeyError, TypeError):
        raise Internal(f"conmon for {container_id} sent an unreadable report: {report!r}") from None
    if pid <= 0:
        text = str(message.get("message", ""))
        reason = runtime_error_message(text) or text or "no message"
        raise Internal(f"creating container {container_id} failed: {reason}")
    return pid


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


async def _read_sync_line(fd: int, timeout: float) -> bytes:
    """conmon writes one JSON line when runc create finished, and keeps the pipe open for
    the container's lifetime: read that line (what came before EOF, if it came without
    one), never wait for EOF. Read by the loop when the pipe is readable: a transport and
    a stream reader per container cost more than the line."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    received = bytearray()
    line: asyncio.Future[bytes] = loop.create_future()

    def readable() -> None:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError as err:
            if not line.done():
                line.set_exception(err)
            return
        received.extend(chunk)
        end = received.find(b"\n")
        if (end >= 0 or not chunk) and not line.done():
            line.set_result(bytes(received[: end + 1] if end >= 0 else received))

    loop.add_reader(fd, readable)
    try:
        return await asyncio.wait_for(line, timeout)
    finally:
        loop.remove_reader(fd)
