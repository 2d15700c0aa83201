"""Containers run under conmon, as CRI-O runs them: one RuntimeBackend per runtime handler.

conmon holds the container's stdio, writes the CRI log, records the exit code in a file
and outlives the daemon, so a restart loses nothing: every fact this module needs is a
file under `state_dir`, and nothing is kept in memory. Layout:

    state_dir/exits/<id>                      exit code written by conmon; mtime = finish time
    state_dir/sockets/                        attach-socket links of earlier versions
    state_dir/runc-logs/                      per-call runc logs (removed after each call)
    state_dir/containers/<id>/meta.json       bundle, log path, cgroup, conmon's identity
    state_dir/containers/<id>/conmon.pid      written by conmon
    state_dir/containers/<id>/conmon.log      conmon's own diagnostics
    state_dir/containers/<id>/persist/        conmon's persist dir (its `oom` marker)
    state_dir/containers/<id>/monitor-died    conmon died without recording an exit
    state_dir/containers/<id>/oom-killed      the OOM killer killed a process of it
                                              (cgroup v2: written by oom_watch.py)

Each conmon is watched (monitors.py) from its container's creation, or from a restart,
until its container is deleted. One that dies without writing the exit file leaves its
container unmonitored: end_unmonitored() kills and deletes it in the runtime, as
containerd does for a task whose shim died, and writes the exit file in conmon's place
(255, the code containerd and CRI-O report for an exit nobody recorded), so that the exit
is recorded as any other. The `monitor-died` marker, written first, tells why, and lets a
restart finish what a crash interrupted.

ExecSync uses `runc exec` directly: conmon's exec mode adds a process and a protocol for
nothing that ExecSync needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cri_shim import tracing
from cri_shim.api.v1 import api_pb2
from cri_shim.errors import DeadlineExceeded, FailedPrecondition, Internal, NotFound
from cri_shim.faults import fault_point
from cri_shim.host import spawn
from cri_shim.runtime.cgroup_driver import cgroup_dir, is_systemd_path
from cri_shim.runtime.cgroup_layout import CgroupLayout, cgroup_layout
from cri_shim.runtime.conmon_scope import ConmonScopes
from cri_shim.runtime.host_limits import HostLimits, current_host_limits
from cri_shim.runtime.kinds.base import CONTAINER_TYPE, SANDBOX_ID, HandlerKind
from cri_shim.runtime.kinds.probe import kind_of
from cri_shim.runtime.monitors import MonitorWatch, ProcessRef, alive, process_stat
from cri_shim.runtime.oci import CallObserver, ExecResult, OciRuntime, runtime_error_message
from cri_shim.runtime.oom_watch import OOM_MARKER, OomWatch
from cri_shim.runtime.resources import linux_resources
from cri_shim.runtime.sandbox_cgroups import (
    merged_resources,
    pod_total,
    read_spec,
    recorded_overhead,
    unappliable,
    write_cgroup,
)
from cri_shim.runtime.stop_signal import discarded_by_init, send_again_once_caught

log = logging.getLogger(__name__)

CREATE_TIMEOUT = 60.0  # conmon + runc create; a large rootfs or a busy host is slow
KILL_GRACE = 10.0  # after SIGKILL, how long until the exit must be recorded
MONITOR_EXIT_GRACE = 2.0  # after runc delete, how long conmon gets to exit by itself
REOPEN_TIMEOUT = 2.0
# The exit code of a container whose monitor died: nobody saw it exit.
MONITOR_DIED_EXIT_CODE = 255
_MONITOR_DIED = "monitor-died"

# A runtime's answer to a kill whose process exited after the runtime found it running:
# runc's "unable to signal init: os: process already finished", crun's and runsc's
# ESRCH ("No such process").
_EXITED_MEANWHILE = re.compile(r"process already finished|no such process|\besrch\b", re.I)

# conmon's control FIFO message: "<type> <height> <width>\n"; type 2 reopens the log.
_REOPEN_LOG_MESSAGE = b"2 0 0\n"
# Files conmon (or runc through it) leaves in the bundle.
_BUNDLE_ARTIFACTS = ("pidfile", "attach", "ctl", "winsz")
_CONTAINER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class _Meta:
    bundle: str
    log_path: str
    cgroups_path: str
    conmon_pid: int = 0
    conmon_start_time: int = 0


# runc's statuses as state() reports them.
_STATES = {
    "creating": "created",
    "created": "created",
    "running": "running",
    "pausing": "running",
    "paused": "running",
    "stopped": "stopped",
}


class RuntimeBackend:
    """Create, start, stop, delete and inspect containers of one runtime handler."""

    def __init__(
        self,
        handler_name: str,
        runtime_path: Path,
        runtime_root: Path,
        conmon_path: Path,
        state_dir: Path,
        *,
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        host: HostLimits | None = None,
        call_timeout: float = 30.0,
        create_timeout: float = CREATE_TIMEOUT,
        conmon_log_level: str = "info",
        runtime_args: Sequence[str] = (),
        observe_call: CallObserver | None = None,
        monitors: MonitorWatch | None = None,
        scopes: ConmonScopes | None = None,
        kind: HandlerKind | None = None,
        pod_sandbox: bool | None = None,
        oom_watch: OomWatch | None = None,
    ) -> None:
        self.handler_name = handler_name
        # The systemd cgroup driver's: conmon's scope, and the units a delete may leave.
        self._scopes = scopes
        # None: conmon is not watched (tests of the runtime layer that need no watch).
        self._monitors = monitors
        # None: OOM kills are read from the cgroup when an exit is recorded, if it is there.
        self._oom_watch = oom_watch
        self.runtime_path = _executable(runtime_path, "runtime")
        # What differs with the runtime (runtime/kinds/): probed once per binary if not given.
        self.kind = kind or kind_of(self.runtime_path)
        # Whether pods get a sandbox container their containers join: the configuration's
        # `pod_sandbox`, else the kind's.
        self.pod_sandbox = self.kind.pod_sandbox if pod_sandbox is None else pod_sandbox
        self.conmon_path = _executable(conmon_path, "conmon")
        self.state_dir = state_dir
        self.cgroup_root = cgroup_root
        self._host = host
        self.create_timeout = create_timeout
        self.conmon_log_level = conmon_log_level
        self._exits = state_dir / "exits"
        self._sockets = state_dir / "sockets"
        self._containers = state_dir / "containers"
        for directory in (self._exits, self._sockets, self._containers, runtime_root):
            directory.mkdir(parents=True, exist_ok=True)
        self.oci = OciRuntime(
            self.runtime_path,
            runtime_root,
            log_dir=state_dir / "runc-logs",
            call_timeout=call_timeout,
            extra_args=runtime_args,
            observe_call=observe_call,
        )
        self.oci.log_dir.mkdir(parents=True, exist_ok=True)
        # Limits on the pod's cgroup: one lock per pod sandbox over each read-sum-write of
        # the pod's total, taken when first needed and dropped when the sandbox is deleted.
        self._pod_locks: dict[str, asyncio.Lock] = {}
        # What conmon runs (gVisor's containers need a process it can wait for).
        self.conmon_runtime = self.kind.conmon_runtime(state_dir, handler_name)

    @property
    def exits_dir(self) -> Path:
        """Where conmon writes `<id>` with the exit code when a container exits."""
        return self._exits

    # ---- create / start -------------------------------------------------------------

    async def create(
        self,
        container_id: str,
        bundle: Path,
        spec: Mapping[str, Any],
        log_path: Path,
        tty: bool,
        stdin: bool,
        stdin_once: bool = True,
    ) -> int:
        """Write config.json, start conmon (which runs `runc create`), and return the
        container's pid once conmon reports it. On any failure, including cancellation,
        everything started is taken down again (conmon, runc state, files) and the error
        carries the runtime's own message."""
        _check_id(container_id)
        cdir = self._containers / container_id
        try:
            cdir.mkdir()  # the claim on this id: atomic, so two creates cannot both win
        except FileExistsError:
            # Never "clean up" an id in use: that would destroy a live container.
            raise FailedPrecondition(
                f"container {container_id} already exists in runtime handler "
                f"{self.handler_name}; delete it first"
            ) from None
        started = time.monotonic()
        try:
            (cdir / "persist").mkdir()
            pid = await self._create(
                container_id, cdir, bundle, spec, log_path, tty, stdin, stdin_once
            )
            if self.kind.limits_on_pod_cgroup:
                # The pod's sandbox grows by what the container may use.
                sandbox_id = (spec.get("annotations") or {}).get(SANDBOX_ID, "")
                await self._in_pod(sandbox_id, self._resize_sandbox, spec)
        except BaseException:
            await self._discard(container_id)
            raise
        self._watch(container_id)
        log.debug(
            "created %s (pid %d) in %.1f ms", container_id, pid, (time.monotonic() - started) * 1000
        )
        return pid

    async def _create(
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
        meta = self._prepare(container_id, cdir, bundle, spec, log_path, tty)
        args = self._conmon_args(container_id, cdir, bundle, log_path, tty, stdin, stdin_once)
        report = await self._run_conmon(container_id, cdir, args)
        conmon = self._record_conmon(cdir, meta)
        pid = _pid_from_report(container_id, cdir, report)
        if self._scopes is not None and conmon is not None:
            await self._scopes.place(container_id, meta.cgroups_path, conmon.pid)
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
            str(self._exits),
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
        for runtime_arg in self.oci.conmon_runtime_args():
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
                    f"{_tail(cdir / 'conmon.log')}"
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

    def _record_conmon(self, cdir: Path, meta: _Meta) -> ProcessRef | None:
        """Add conmon's identity (pid and start time) to the container's meta.json, so that
        a later stop or restart can tell conmon from a process that reused its pid."""
        conmon = self._read_conmon_ref(cdir)
        if conmon is not None:
            meta = _Meta(
                **{**asdict(meta), "conmon_pid": conmon.pid, "conmon_start_time": conmon.start_time}
            )
            _write_atomic(cdir / "meta.json", json.dumps(asdict(meta)).encode())
        return conmon

    def _prepare(
        self,
        container_id: str,
        cdir: Path,
        bundle: Path,
        spec: Mapping[str, Any],
        log_path: Path,
        tty: bool,
    ) -> _Meta:
        """Write config.json and meta.json (small local files: not worth a thread)."""
        config = self.kind.prepare_spec(dict(spec))  # the caller's spec is left as it was
        # The tty flag is conmon's and the spec's at once; one source so they cannot differ.
        config["process"] = {**config.get("process", {}), "terminal": tty}
        bundle.mkdir(parents=True, exist_ok=True)
        _write_atomic(bundle / "config.json", json.dumps(config).encode())
        with contextlib.suppress(FileNotFoundError):
            (self._exits / container_id).unlink()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        meta = _Meta(
            bundle=str(bundle),
            log_path=str(log_path),
            cgroups_path=str(config.get("linux", {}).get("cgroupsPath", "")),
        )
        _write_atomic(cdir / "meta.json", json.dumps(asdict(meta)).encode())
        return meta

    @property
    def mounts_at_start(self) -> bool:
        """Whether the runtime makes a container's mounts when it starts it rather than
        when it creates it, so that the bind-mount sources staged for it must stay until
        its bundle goes."""
        return self.kind.mounts_at_start

    async def start(self, container_id: str) -> None:
        meta = self._read_meta(container_id)
        env = self.kind.start_env(Path(meta.bundle)) if meta is not None else {}
        if env:
            await self.oci.start(container_id, program=self.conmon_runtime, env=env)
        else:
            await self.oci.start(container_id)

    # ---- stop / delete --------------------------------------------------------------

    async def stop(
        self,
        container_id: str,
        timeout: float,
        stop_signal: int,
    ) -> None:
        """Send `stop_signal`, wait up to `timeout` seconds, then SIGKILL every process
        of the container. Stopping a stopped or unknown container does nothing."""
        if self.exit_status(container_id) is not None:
            return
        if timeout > 0:
            if not await self._signal(container_id, stop_signal, all_processes=False):
                return
            if await self._wait_stopping(container_id, timeout, stop_signal):
                return
            log.info(
                "%s did not stop within %gs after signal %d; killing it",
                container_id,
                timeout,
                stop_signal,
            )
        if not await self._signal(container_id, signal.SIGKILL, all_processes=True):
            return
        if not await self._wait_monitor(container_id, KILL_GRACE):
            raise DeadlineExceeded(
                f"container {container_id} did not exit within {KILL_GRACE:g}s of SIGKILL"
            )

    async def _wait_stopping(self, container_id: str, timeout: float, sig: int) -> bool:
        """_wait_monitor() after the stop signal; a signal the container's init discarded
        (it had no handler yet) is sent again once it has one (runtime/stop_signal.py)."""
        pid = self._init_pid(container_id)
        if pid is None or not await asyncio.to_thread(discarded_by_init, pid, sig):
            return await self._wait_monitor(container_id, timeout)
        log.info(
            "%s: its init had no handler for signal %d yet; sending it again once it has",
            container_id,
            sig,
        )
        again = asyncio.create_task(
            send_again_once_caught(
                pid, sig, lambda: self._signal(container_id, sig, all_processes=False)
            )
        )
        try:
            return await self._wait_monitor(container_id, timeout)
        finally:
            again.cancel()
            await asyncio.gather(again, return_exceptions=True)

    def _init_pid(self, container_id: str) -> int | None:
        """The container's first process, from the pidfile the runtime wrote."""
        meta = self._read_meta(container_id)
        if meta is None:
            return None
        try:
            return int((Path(meta.bundle) / "pidfile").read_text().strip())
        except (OSError, ValueError):
            return None

    async def _signal(self, container_id: str, sig: int, *, all_processes: bool) -> bool:
        """False when there is nothing left to signal."""
        try:
            await self.oci.kill(container_id, sig, all=all_processes)
        except NotFound:
            return False
        except Internal as err:
            if _EXITED_MEANWHILE.search(str(err)) and await self._stopped(container_id):
                # It exited between the runtime's look and its signal (a stop beside a
                # removal, or its own end): stopped, which is what was asked.
                log.info("%s exited before it was signalled: %s", container_id, err)
                return False
            # Some runtimes cannot signal a container before it is started (runsc, of
            # one joining a sandbox): the kind ends it otherwise, or the error stands.
            meta = self._read_meta(container_id)
            if meta is None or not self.kind.end_unstarted(Path(meta.bundle), err):
                raise
        except FailedPrecondition:
            # "container not running": it exited after our check; conmon records it.
            await self._wait_monitor(container_id, KILL_GRACE)
            return False
        return True

    async def _stopped(self, container_id: str) -> bool:
        """Whether a container the runtime could not signal is in fact stopped, its exit
        recorded (or its conmon gone too, which ends it)."""
        if await self.state(container_id) not in ("stopped", "unknown"):
            return False
        return await self._wait_monitor(container_id, KILL_GRACE)

    async def delete(self, container_id: str) -> None:
        """Remove the container from the runtime (killing it if it still runs), make sure
        its conmon is gone, and remove the files this backend made. Idempotent."""
        _check_id(container_id)
        # Its conmon's exit from here on is this deletion's doing, not a death to handle.
        await self._forget(container_id)
        self._pod_locks.pop(container_id, None)  # the pod's, when this is its sandbox
        cdir = self._containers / container_id
        meta = self._read_meta(container_id)
        conmon = self._conmon_ref(container_id)
        await self._delete_from_runtime(container_id, meta)
        if conmon is not None and alive(conmon):
            await _wait_process_exit(conmon, MONITOR_EXIT_GRACE)
            if alive(conmon):
                log.warning(
                    "conmon %d for %s outlived its container; killing it", conmon.pid, container_id
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(conmon.pid, signal.SIGKILL)
                await _wait_process_exit(conmon, MONITOR_EXIT_GRACE)
        if conmon is not None:
            _reap(conmon)
        # (A link in sockets/ is there for containers started by an earlier version.)
        for leftover in (self._exits / container_id, self._sockets / container_id):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
        if meta is not None:
            for name in _BUNDLE_ARTIFACTS:
                with contextlib.suppress(FileNotFoundError):
                    (Path(meta.bundle) / name).unlink()
        shutil.rmtree(cdir, ignore_errors=True)

    async def _delete_from_runtime(self, container_id: str, meta: _Meta | None) -> None:
        """`<runtime> delete --force` (killing it if it still runs); a missing container
        is fine. What the runtime leaves is removed here too: what the kind knows of (runsc's
        lock files), and the container's empty cgroups (see remove_cgroups)."""
        await self.kind.delete(self.oci, container_id, Path(meta.bundle) if meta else None)
        if meta is not None:
            if self._scopes is not None:
                await self._scopes.remove(container_id, meta.cgroups_path)
            await asyncio.to_thread(remove_cgroups, meta.cgroups_path, self.cgroup_layout)

    async def _discard(self, container_id: str) -> None:
        """Undo a failed create. Errors are logged, not raised: the create's own error
        is the one the caller must see."""
        await self._forget(container_id)
        conmon = self._conmon_ref(container_id)
        if conmon is None:
            conmon = self._read_conmon_ref(self._containers / container_id)
        if conmon is not None and alive(conmon):
            # conmon leads its own process group, which holds a runc create in flight.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(conmon.pid, signal.SIGKILL)
            await _wait_process_exit(conmon, MONITOR_EXIT_GRACE)
        try:
            await asyncio.shield(self.delete(container_id))
        except Exception as err:  # reported; the create's own error is the one raised
            log.error("cleaning up failed create of %s: %s", container_id, err)

    # ---- the monitor ----------------------------------------------------------------

    def _watch(self, container_id: str) -> None:
        self._watch_oom(container_id)
        conmon = self._conmon_ref(container_id)
        if self._monitors is None or conmon is None:
            return

        async def exited() -> None:
            await self._monitor_exited(container_id)

        self._monitors.watch((self.handler_name, container_id), conmon, exited)

    def _watch_oom(self, container_id: str) -> None:
        meta = self._read_meta(container_id)
        if self._oom_watch is None or meta is None:
            return
        events = self.cgroup_layout.oom_events_file(cgroup_dir(meta.cgroups_path))
        if events is not None:
            marker = self._containers / container_id / OOM_MARKER
            self._oom_watch.watch((self.handler_name, container_id), events, marker)

    async def _forget(self, container_id: str) -> None:
        if self._oom_watch is not None:
            self._oom_watch.forget((self.handler_name, container_id))
        if self._monitors is not None:
            await self._monitors.forget((self.handler_name, container_id))

    async def _monitor_exited(self, container_id: str) -> None:
        # conmon writes the exit file before it exits: none now means it died first.
        if self.exit_status(container_id) is None and self._read_meta(container_id):
            await self.end_unmonitored(container_id)

    async def end_unmonitored(self, container_id: str) -> None:
        """conmon died without recording the container's exit (see the module's
        docstring): the marker, the container killed and deleted in the runtime, then
        the exit file (255) in conmon's place. The container's files stay, as for any
        exited container, until delete(). Idempotent: a restart that finds the marker
        without the exit file runs it again."""
        cdir = self._containers / container_id
        marker = cdir / _MONITOR_DIED
        if not marker.exists():
            _write_atomic(marker, str(time.time_ns()).encode())
        log.warning(
            "the monitor (conmon) of %s died without recording its exit: deleting the "
            "container from %s and recording exit code %d",
            container_id,
            self.handler_name,
            MONITOR_DIED_EXIT_CODE,
        )
        try:
            await self._delete_from_runtime(container_id, self._read_meta(container_id))
        except Exception as err:  # recorded all the same; its removal deletes it again
            log.error("deleting %s, whose monitor died: %s", container_id, err)
        fault_point("container:unmonitored-deleted")
        _write_atomic(self._exits / container_id, str(MONITOR_DIED_EXIT_CODE).encode())

    def monitor_died(self, container_id: str) -> bool:
        """Whether the container's exit was recorded by end_unmonitored(), not conmon."""
        return (self._containers / container_id / _MONITOR_DIED).exists()

    def monitor_gone(self, container_id: str) -> bool:
        """Whether the container's conmon has exited, noticed by its watch or not yet."""
        conmon = self._conmon_ref(container_id)
        return conmon is not None and not alive(conmon)

    async def adopt(self, states: Mapping[str, str]) -> list[str]:
        """After a restart: watch every conmon still running, and end the containers
        whose conmon died while the daemon was down. `states` is what the runtime lists
        (states()). Returns the IDs of the containers ended."""
        ended = []
        for container_id in sorted(os.listdir(self._containers)):
            if self.exit_status(container_id) is not None:
                continue  # exited, recorded by conmon (or by us, before the restart)
            conmon = self._conmon_ref(container_id)
            if conmon is None:
                continue  # never reached conmon: a creation that restore rolled back
            if alive(conmon):
                self._watch(container_id)
            elif container_id in states or self.monitor_died(container_id):
                # The runtime still has it (or a crash interrupted its ending): a reboot
                # would have taken both conmon and the runtime's state.
                await self.end_unmonitored(container_id)
                ended.append(container_id)
        return ended

    # ---- exit and state -------------------------------------------------------------

    def recorded_exits(self) -> set[str]:
        """The containers conmon has written an exit file for (maybe not all of it yet:
        exit_status() reads it)."""
        try:
            return set(os.listdir(self._exits))
        except FileNotFoundError:
            return set()

    def exit_status(self, container_id: str) -> tuple[int, int] | None:
        """(exit code, finished_at in ns since the epoch) once conmon recorded the exit.
        The finish time is the exit file's mtime: conmon writes it when the process ends,
        and it survives a daemon restart."""
        path = self._exits / container_id
        try:
            text = path.read_text().strip()
            finished = path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        try:
            code = int(text)
        except ValueError:
            return None  # being written
        conmon = self._conmon_ref(container_id)
        if conmon is not None:
            _reap(conmon)
        return code, finished

    async def wait_exit(
        self,
        container_id: str,
        timeout: float | None,
    ) -> tuple[int, int]:
        """Wait until the container has exited; return exit_status(). Raises
        DeadlineExceeded after `timeout` seconds (None waits for ever), and Internal when
        conmon is gone without recording an exit (killed, or the host rebooted)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.exit_status(container_id)
            if status is not None:
                return status
            conmon = self._conmon_ref(container_id)
            if conmon is None or not alive(conmon):
                status = self.exit_status(container_id)  # written just before it exited
                if status is not None:
                    return status
                raise Internal(
                    f"the monitor of container {container_id} is gone without recording "
                    "an exit code"
                )
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(f"container {container_id} is still running")
            await _wait_process_exit(conmon, remaining)

    async def _wait_monitor(self, container_id: str, timeout: float) -> bool:
        """True once the exit is recorded or conmon is gone; False on timeout."""
        try:
            await self.wait_exit(container_id, timeout)
        except DeadlineExceeded:
            return False
        except Internal:
            return True
        return True

    async def state(self, container_id: str) -> str:
        """created | running | stopped | unknown."""
        try:
            current = await self.oci.state(container_id)
        except NotFound:
            return self.unlisted_state(container_id)
        return _STATES.get(current.status, "unknown")

    async def states(self) -> dict[str, str]:
        """state() of every container runc knows, by ID, from one `runc list`: one
        `runc state` each made a node's start wait for a process per container."""
        return {s.id: _STATES.get(s.status, "unknown") for s in await self.oci.list()}

    def unlisted_state(self, container_id: str) -> str:
        """state() of a container runc does not know."""
        return "stopped" if self.exit_status(container_id) is not None else "unknown"

    def oom_killed(self, container_id: str) -> bool:
        """Whether the kernel's OOM killer killed a process of this container. Ask before
        delete(): the evidence is the watch's marker, conmon's, and the container's cgroup
        (under the systemd driver, gone once its last process is)."""
        if self._oom_watch is not None:
            self._oom_watch.drain()  # a kill queued before the exit was written
        cdir = self._containers / container_id
        if (cdir / OOM_MARKER).exists() or (cdir / "persist" / "oom").exists():
            return True
        meta = self._read_meta(container_id)
        if meta is None or not meta.cgroups_path:
            return False
        return self.cgroup_layout.oom_kills(cgroup_dir(meta.cgroups_path)) > 0

    def cgroups_path(self, container_id: str) -> str | None:
        """The container's cgroup, relative to each hierarchy's root (its spec's
        cgroupsPath, a systemd one resolved to its scope's directory)."""
        meta = self._read_meta(container_id)
        return (cgroup_dir(meta.cgroups_path) or None) if meta is not None else None

    @property
    def cgroup_layout(self) -> CgroupLayout:
        """The host's cgroup layout (v1 or v2), through which its cgroups are read."""
        return cgroup_layout(self.cgroup_root, v2=self._host_limits().cgroup_v2)

    def attach_socket(self, container_id: str) -> Path:
        """conmon's attach socket for the container: `attach` in its bundle. The path may
        exceed the 108 bytes of a unix socket address; connect through the directory."""
        meta = self._read_meta(container_id)
        if meta is None:
            raise NotFound(f"container {container_id} has no monitor")
        return Path(meta.bundle) / "attach"

    # ---- exec, logs, resources ------------------------------------------------------

    async def exec_sync(
        self,
        container_id: str,
        cmd: Sequence[str],
        timeout: float | None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        with tracing.span("exec", **{"cri.container_id": container_id}) as span:
            result = await self.oci.exec_sync(
                container_id,
                cmd,
                timeout,
                env,
                options=self.exec_options(container_id),
                inside=self.kind.inside,
            )
            span.set_attribute("process.exit.code", result.exit_code)
            return result

    def exec_options(self, container_id: str) -> list[str]:
        """Options of `<runtime> exec` that make the process the container's (runsc's
        exec needs the user spelled out)."""
        meta = self._read_meta(container_id)
        return self.kind.exec_options(Path(meta.bundle)) if meta is not None else []

    async def reopen_log(self, container_id: str) -> None:
        """Ask conmon to reopen the log file (kubelet renamed it to rotate), and return
        once the new file exists, so that kubelet never compresses a file still written."""
        meta = self._read_meta(container_id)
        if meta is None:
            raise NotFound(
                f"container {container_id} is not known to runtime handler {self.handler_name}"
            )
        log_path = Path(meta.log_path)
        if not log_path.parent.is_dir():
            # conmon cannot open a file there: it would exit without recording the
            # container's exit, and the container be killed as unmonitored.
            raise FailedPrecondition(
                f"the log directory {log_path.parent} of container {container_id} no longer "
                "exists (removed since the container started): its log cannot be reopened "
                "there; the container goes on writing to the file it has open"
            )
        try:
            # Non-blocking: with no reader (conmon gone) open fails with ENXIO instead of
            # hanging for ever.
            fd = os.open(Path(meta.bundle) / "ctl", os.O_WRONLY | os.O_NONBLOCK)
        except OSError as err:
            if err.errno in (errno.ENXIO, errno.ENOENT):
                raise FailedPrecondition(
                    f"container {container_id} is not running; its log is not open"
                ) from None
            raise Internal(f"reopening the log of {container_id}: {err}") from None
        try:
            os.write(fd, _REOPEN_LOG_MESSAGE)
        finally:
            os.close(fd)
        deadline = time.monotonic() + REOPEN_TIMEOUT
        while not _exists(log_path):
            if time.monotonic() > deadline:
                raise Internal(f"conmon did not reopen {log_path} within {REOPEN_TIMEOUT:g}s")
            await asyncio.sleep(0.002)

    async def update_resources(
        self,
        container_id: str,
        resources: api_pb2.LinuxContainerResources | Mapping[str, Any],
    ) -> None:
        if isinstance(resources, api_pb2.LinuxContainerResources):
            oci_resources = linux_resources(resources, self._host_limits())
        else:
            oci_resources = dict(resources)
        if not oci_resources:
            return
        if self.kind.limits_on_pod_cgroup:
            # No `update` in the runtime (runsc): the host cgroups, where its limits apply.
            sandbox_id = await asyncio.to_thread(self._sandbox_of, container_id)
            await self._in_pod(sandbox_id, self._update_on_pod_cgroup, container_id, oci_resources)
            return
        await self.oci.update(container_id, oci_resources)

    async def _in_pod(self, sandbox_id: str, work: Callable[..., None], *args: Any) -> None:
        """Run `work` on a thread under the pod's lock: each update reads every
        container's limits, sums them and writes the sandbox's cgroup, and two at once
        would each sum the other's old limits (the pod left below its containers' total,
        OOM-killed inside its limits). A cancelled caller leaves the lock held until the
        thread has written: it cannot be stopped half-way."""
        if not sandbox_id:
            await asyncio.to_thread(work, *args)
            return
        lock = self._pod_locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            job = asyncio.ensure_future(asyncio.to_thread(work, *args))
            try:
                await asyncio.shield(job)
            except asyncio.CancelledError:
                await asyncio.wait([job])
                raise

    def _sandbox_of(self, container_id: str) -> str:
        """The pod sandbox a container joins ("" where its spec cannot be read)."""
        meta = self._read_meta(container_id)
        spec = read_spec(Path(meta.bundle)) if meta is not None else None
        return str(((spec or {}).get("annotations") or {}).get(SANDBOX_ID) or "")

    def _update_on_pod_cgroup(self, container_id: str, update: Mapping[str, Any]) -> None:
        """New limits of a container whose limits are on its pod's cgroup
        (runtime/sandbox_cgroups.py): the pod's new total on the sandbox's cgroup first
        (where the kernel may refuse a lower memory limit), then the container's own cgroup,
        then its spec, the record of both."""
        meta = self._read_meta(container_id)
        spec = read_spec(Path(meta.bundle)) if meta is not None else None
        if meta is None or spec is None:
            raise NotFound(
                f"container {container_id} is not known to runtime handler {self.handler_name}"
            )
        refused = unappliable(update)
        if refused:
            raise FailedPrecondition(
                f"runtime handler {self.handler_name!r} (gVisor) cannot apply "
                f"{', '.join(refused)} to a running container: its limits apply to the pod's "
                "sandbox as a whole, summed over the pod's containers, which these cannot be"
            )
        linux = spec.setdefault("linux", {})
        resources = merged_resources(linux.get("resources") or {}, update)
        self._resize_sandbox(spec, {container_id: resources})
        self._write_cgroup(meta.cgroups_path, resources)
        linux["resources"] = resources
        _write_atomic(Path(meta.bundle) / "config.json", json.dumps(spec).encode())

    def _resize_sandbox(
        self, spec: Mapping[str, Any], changed: Mapping[str, Mapping[str, Any]] | None = None
    ) -> None:
        """Give the sandbox a container joins the total of the limits of its
        containers (`changed` overrides what their specs say)."""
        annotations = spec.get("annotations") or {}
        if annotations.get(CONTAINER_TYPE) != "container":
            return
        sandbox_id = annotations.get(SANDBOX_ID, "")
        sandbox = self._read_meta(sandbox_id) if sandbox_id else None
        if sandbox is None:
            return
        members = dict(changed or {})
        for cdir in self._containers.iterdir():
            meta = self._read_meta(cdir.name)
            if cdir.name in members or meta is None:
                continue
            # Only the pod's specs are parsed: every container of the handler is read.
            member = read_spec(Path(meta.bundle), mentioning=sandbox_id)
            if member is None:
                continue
            marks = member.get("annotations") or {}
            if marks.get(CONTAINER_TYPE) == "container" and marks.get(SANDBOX_ID) == sandbox_id:
                members[cdir.name] = (member.get("linux") or {}).get("resources") or {}
        overhead = recorded_overhead(read_spec(Path(sandbox.bundle)) or {})
        self._write_cgroup(sandbox.cgroups_path, pod_total(members.values(), overhead))

    def _write_cgroup(self, cgroups_path: str, resources: Mapping[str, Any]) -> None:
        host = self._host_limits()
        write_cgroup(
            cgroup_dir(cgroups_path),
            resources,
            v2=host.cgroup_v2,
            swap_accounting=host.swap_accounting,
            cgroup_root=self.cgroup_root,
        )

    # ---- files ----------------------------------------------------------------------

    def _host_limits(self) -> HostLimits:
        return self._host or current_host_limits()

    def _read_meta(self, container_id: str) -> _Meta | None:
        try:
            raw = json.loads((self._containers / container_id / "meta.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return _Meta(**raw)

    def _conmon_ref(self, container_id: str) -> ProcessRef | None:
        meta = self._read_meta(container_id)
        if meta is None or meta.conmon_pid <= 0:
            return None
        return ProcessRef(meta.conmon_pid, meta.conmon_start_time)

    @staticmethod
    def _read_conmon_ref(cdir: Path) -> ProcessRef | None:
        try:
            pid = int((cdir / "conmon.pid").read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        start = process_stat(pid)
        return ProcessRef(pid, start[2]) if start is not None else None


def remove_cgroups(cgroups_path: str, layout: CgroupLayout) -> None:
    """The empty cgroups of a deleted container, which its runtime's `delete` could not
    find: a runtime killed inside its `create` (a create past its budget, a daemon
    stopping while one was in flight: runc makes the cgroups, cpuset first on cgroup v1,
    before it writes the state that names them), and runsc on cgroup v1 for a container
    it never started or whose sandbox was gone. One still in use (not empty) stays. A
    systemd cgroup (`slice:prefix:name`) is systemd's to remove, with its scope (which a
    delete stops where it is left: runtime/conmon_scope.py)."""
    relative = cgroups_path.strip("/")
    if not relative or is_systemd_path(relative):
        return
    for group in layout.directories(relative):
        with contextlib.suppress(OSError):
            group.rmdir()


def _check_id(container_id: str) -> None:
    # The id becomes a file name in several directories; refuse anything that could escape.
    if not _CONTAINER_ID.match(container_id):
        raise FailedPrecondition(f"invalid container id {container_id!r}")


def _executable(path: Path, what: str) -> Path:
    found = shutil.which(str(path))
    if found is None:
        raise FailedPrecondition(f"{what} {path} not found or not executable")
    return Path(found).resolve()


def _pid_from_report(container_id: str, cdir: Path, report: bytes) -> int:
    """The container's pid from conmon's sync-pipe report; a failure names runc's reason."""
    if not report:
        raise Internal(
            f"conmon for {container_id} exited without reporting the container's pid: "
            f"{_tail(cdir / 'conmon.log')}"
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


def _reap(ref: ProcessRef) -> None:
    """conmon double-forks away from us, but with the daemon as child subreaper the
    monitor is re-parented to the daemon, and an exited one stays a zombie until
    reaped. Only this exact process (pid and start time) is reaped, never a pid that
    asyncio is waiting for."""
    found = process_stat(ref.pid)
    if found is None or found[2] != ref.start_time or found[0] != "Z":
        return
    if found[1] != os.getpid():
        return
    with contextlib.suppress(ChildProcessError):
        os.waitpid(ref.pid, os.WNOHANG)


async def _wait_process_exit(ref: ProcessRef, timeout: float | None) -> None:
    """Wait for any process (not only a child) to exit, through a pidfd."""
    try:
        pidfd = os.pidfd_open(ref.pid)
    except ProcessLookupError:
        return
    try:
        if not alive(ref):  # checked after opening, so the pidfd is the right process
            return
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(pidfd, on_exit)
        try:
            await asyncio.wait_for(exited, timeout)
        except TimeoutError:
            return
        finally:
            loop.remove_reader(pidfd)
    finally:
        os.close(pidfd)


def _exists(path: Path) -> bool:
    return path.exists()


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except FileNotFoundError:
        return "no diagnostics"
    return text[-limit:] or "no diagnostics"


def _write_atomic(path: Path, data: bytes) -> None:
    """Written 0600: the spec holds the container's environment, which carries secrets."""
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(temporary, path)
