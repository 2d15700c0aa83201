"""The one place that runs the OCI runtime CLI (runc, or any handler with runc's CLI).

Every call has a budget and every failure carries the runtime's own words: runc writes
its errors as JSON lines to a per-call `--log` file, which is read back and parsed. A
per-call file (not stderr) because during `runc exec` stderr is the exec'd process's.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cri_shim import tracing
from cri_shim.errors import DeadlineExceeded, FailedPrecondition, Internal, NotFound
from cri_shim.host import spawn
from cri_shim.runtime.kinds.base import KillInside

log = logging.getLogger(__name__)

DEFAULT_CALL_TIMEOUT = 30.0
# ExecSync output is returned in one gRPC message; kubelet's limit is 16 MiB.
MAX_EXEC_OUTPUT = 16 * 1024 * 1024
# After an exec'd process exited, how long to keep reading output that a background
# child of it may still hold open, when the request has no deadline of its own.
EXEC_OUTPUT_DRAIN = 2.0


# Told of every call: the tool, its verb, the seconds it took and whether it succeeded.
CallObserver = Callable[[str, str, float, bool], None]


@dataclass(frozen=True)
class ContainerState:
    id: str
    status: str  # creating | created | running | paused | stopped
    pid: int
    bundle: Path
    created: str


@dataclass(frozen=True)
class ExecResult:
    stdout: bytes
    stderr: bytes
    exit_code: int  # -1 when timed_out
    timed_out: bool


_LOGFMT_MSG = re.compile(r'msg="((?:[^"\\]|\\.)*)"')
_LOGFMT_LEVEL = re.compile(r"level=(\w+)")


def runtime_error_message(text: str) -> str:
    """The error and fatal messages in runc's output (JSON lines or logfmt), joined.
    All of them, not just the last: on an OOM-score failure the cause ("failed to update
    /proc/self/oom_score_adj") comes one line before the generic "can't get final child's
    PID from pipe"."""
    messages: list[str] = []
    plain: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        level, message = "", None
        if line.startswith("{"):
            try:
                entry = json.loads(line)
                level, message = str(entry.get("level", "")), str(entry.get("msg", ""))
            except ValueError:
                pass
        elif (found := _LOGFMT_MSG.search(line)) is not None:
            level_match = _LOGFMT_LEVEL.search(line)
            level = level_match.group(1) if level_match else ""
            try:
                message = json.loads(f'"{found.group(1)}"')
            except ValueError:
                message = found.group(1)
        if message is None:
            plain.append(line)
        elif level in ("error", "fatal", "panic") and message not in messages:
            messages.append(message)
    if messages:
        return "; ".join(messages)
    return "; ".join(plain)[-2000:]


class OciRuntime:
    """runc's CLI for one handler: `path` is the binary, `root` its state directory."""

    def __init__(
        self,
        path: Path,
        root: Path,
        *,
        log_dir: Path,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        extra_args: Sequence[str] = (),
        observe_call: CallObserver | None = None,
    ) -> None:
        self.path = path
        self.root = root
        self.log_dir = log_dir
        self.call_timeout = call_timeout
        # The handler's own global options (`runtime_args`), given to every call.
        self.extra_args = tuple(extra_args)
        # The daemon's metrics, when it exports them.
        self._observe_call = observe_call

    def conmon_runtime_args(self) -> list[str]:
        """Global options for conmon's `--runtime-arg`, so that the create it runs uses the
        same state root and writes errors in the same parseable form."""
        return [f"--root={self.root}", "--log-format=json", *self.extra_args]

    # Every call takes `timeout` (seconds; None = the handler's call_timeout) rather than
    # relying on callers to wrap it: a runc that hangs must be killed, not just abandoned.

    async def state(
        self,
        container_id: str,
        *,
        timeout: float | None = None,
    ) -> ContainerState:
        out = await self._call(["state", container_id], container_id, timeout, output=True)
        return _parse_state(json.loads(out))

    async def list(self, *, timeout: float | None = None) -> list[ContainerState]:
        out = await self._call(["list", "--format", "json"], "", timeout, output=True)
        return [_parse_state(entry) for entry in json.loads(out) or []]

    async def start(
        self,
        container_id: str,
        *,
        timeout: float | None = None,
        program: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`program` runs instead of the runtime, with the same arguments and `env` added
        to the environment (gVisor's containers start through a script)."""
        await self._call(["start", container_id], container_id, timeout, program=program, env=env)

    async def kill(
        self,
        container_id: str,
        sig: int,
        *,
        all: bool = False,
        timeout: float | None = None,
    ) -> None:
        args = ["kill", *(["--all"] if all else []), container_id, str(int(sig))]
        await self._call(args, container_id, timeout)

    async def delete(
        self,
        container_id: str,
        *,
        force: bool = False,
        timeout: float | None = None,
    ) -> None:
        """With force, a missing container is not an error (runc's own behaviour)."""
        args = ["delete", *(["--force"] if force else []), container_id]
        await self._call(args, container_id, timeout)

    async def update(
        self,
        container_id: str,
        resources: Mapping[str, Any],
        *,
        timeout: float | None = None,
    ) -> None:
        payload = json.dumps(dict(resources)).encode()
        await self._call(
            ["update", "--resources", "-", container_id], container_id, timeout, stdin=payload
        )

    async def exec_sync(
        self,
        container_id: str,
        cmd: Sequence[str],
        timeout: float | None,
        env: Mapping[str, str] | None = None,
        *,
        options: Sequence[str] = (),
        inside: KillInside | None = None,
    ) -> ExecResult:
        """Run `cmd` in the container and collect its output. On timeout the process and
        its group are killed and the call returns at once with `timed_out=True`.
        timeout None or 0 means no limit. `options` go to `exec` before the ID.
        `inside`: the command runs inside the runtime's own kernel (gVisor), where no host
        signal reaches it: it is killed with this, through the runtime, by its pid there."""
        if not cmd:
            raise FailedPrecondition("exec: no command given")
        log_name = self._new_log_file("exec")
        pid_file = Path(log_name).with_suffix(".pid")
        inner_pid_file = Path(log_name).with_suffix(".inner-pid")
        if inside is not None:
            options = ["--internal-pid-file", str(inner_pid_file), *options]
        env_args = [f"--env={key}={value}" for key, value in (env or {}).items()]
        args = [
            str(self.path),
            *self._global_args(log_name),
            "exec",
            "--pid-file",
            str(pid_file),
            *env_args,
            *options,
            container_id,
            *cmd,
        ]
        try:
            done = await spawn.run_capped(
                args,
                timeout=timeout or None,
                limit=MAX_EXEC_OUTPUT,
                # Output may still be in flight, or held open by a background child.
                drain=EXEC_OUTPUT_DRAIN,
                kill=_exec_killer(
                    pid_file,
                    self._inner_killer(container_id, inner_pid_file, inside) if inside else None,
                ),
                # A probe's command, as many at once as the pods have probes.
                tenant=True,
            )
            stdout, stderr, timed_out = done.stdout, done.stderr, done.timed_out
            if timed_out:
                note = f"\ncommand timed out after {timeout:g}s and was killed\n".encode()
                return ExecResult(bytes(stdout), bytes(stderr) + note, -1, True)
            code = done.returncode
            assert code is not None
            runc_error = runtime_error_message(_read_text(log_name))
            if code != 0 and runc_error:
                # runc itself failed (no such binary, container gone): not the command's
                # exit code, so say so rather than report 255.
                raise _classify(f"exec in {container_id}", container_id, runc_error)
            return ExecResult(
                bytes(stdout), bytes(stderr), code if code >= 0 else 128 - code, False
            )
        finally:
            for leftover in (log_name, pid_file, inner_pid_file):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)

    def _inner_killer(
        self, container_id: str, inner_pid_file: Path, inside: KillInside
    ) -> Callable[[], None]:
        """Kills an exec'd process and its descendants by their pids inside the runtime's
        kernel (`inside`, given by the kind); run on the spawn thread that waits for the exec."""

        def kill() -> None:
            inner = _read_pid(inner_pid_file)
            if inner <= 0:
                return
            runtime = [str(self.path), "--root", str(self.root), *self.extra_args]
            inside(runtime, container_id, inner, self.call_timeout)

        return kill

    def _new_log_file(self, verb: str) -> str:
        """A new empty file of the runtime's log directory, made as mkstemp(3) makes one
        (exclusive, 0600; tempfile and the random module it loads cost the idle daemon
        0.3 MiB)."""
        for _ in range(100):
            name = str(self.log_dir / f"runc-{verb}-{os.urandom(6).hex()}.log")
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            except FileNotFoundError:  # made at start; gone only if someone removed it
                self.log_dir.mkdir(parents=True, exist_ok=True)
                continue
            os.close(fd)
            return name
        raise FileExistsError(f"no new runtime log file could be made in {self.log_dir}")

    # `list` is a method of this class, so the builtin is spelled out below it.
    def _global_args(self, log_file: str) -> builtins.list[str]:
        return [
            "--root",
            str(self.root),
            "--log",
            log_file,
            "--log-format",
            "json",
            *self.extra_args,
        ]

    async def _call(
        self,
        args: builtins.list[str],
        container_id: str,
        timeout: float | None,
        *,
        stdin: bytes | None = None,
        output: bool = False,
        program: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> bytes:
        """Run one command; its stdout when `output`. Only then is stdout a pipe, and
        stderr is always a file: runsc's `start` leaves a process behind (the container's
        gofer) holding the streams it was given, so a pipe would never reach its end."""
        budget = timeout if timeout is not None else self.call_timeout
        log_name = self._new_log_file(args[0])
        err_name = log_name + ".stderr"
        started = time.monotonic()
        try:
            ok = False
            err_fd = os.open(err_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                with tracing.span(
                    f"{self.path.name} {args[0]}",
                    **{"oci.runtime": self.path.name, "oci.command": args[0]},
                ) as span:
                    done = await spawn.run(
                        [str(program or self.path), *self._global_args(log_name), *args],
                        input=stdin,
                        timeout=budget,
                        stdout=subprocess.PIPE if output else subprocess.DEVNULL,
                        stderr=err_fd,
                        env={**os.environ, **env} if env else None,
                    )
                    span.set_attribute("process.exit.code", done.returncode)
                ok = done.returncode == 0
            except spawn.TimedOut:
                raise DeadlineExceeded(
                    f"{self.path.name} {' '.join(args)} did not finish within {budget:g}s"
                ) from None
            finally:
                os.close(err_fd)
                if self._observe_call is not None:
                    self._observe_call(self.path.name, args[0], time.monotonic() - started, ok)
            returncode, out = done.returncode, done.stdout
            log.debug(
                "%s %s: rc=%s in %.1f ms",
                self.path.name,
                args[0],
                returncode,
                (time.monotonic() - started) * 1000,
            )
            if returncode != 0:
                message = (
                    runtime_error_message(_read_text(log_name))
                    or runtime_error_message(_read_text(err_name))
                    or f"exit status {returncode}"
                )
                raise _classify(f"{self.path.name} {args[0]}", container_id, message)
            return out
        finally:
            for leftover in (log_name, err_name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)


def _classify(what: str, container_id: str, message: str) -> Exception:
    if "does not exist" in message:
        return NotFound(f"container {container_id} does not exist in the runtime ({message})")
    if "stopped" in message or "not running" in message:
        return FailedPrecondition(f"{what}: {message}")
    return Internal(f"{what}: {message}")


def _parse_state(entry: Mapping[str, Any]) -> ContainerState:
    return ContainerState(
        id=str(entry["id"]),
        status=str(entry.get("status", "unknown")),
        pid=int(entry.get("pid") or 0),
        bundle=Path(entry.get("bundle") or ""),
        created=str(entry.get("created", "")),
    )


def _read_pid(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return 0


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


# How long runc has to reap a killed exec'd process and exit before it is killed too.
RUNC_REAP_GRACE = 5.0


def _exec_killer(pid_file: Path, inside: Callable[[], None] | None = None) -> spawn.Killer:
    """Kill the exec'd process and everything in its process group at once, then let runc
    reap it. runc makes the exec'd process a session leader, so its group is separate
    from runc's and must be killed by its own id.

    All at once, not children first: a parent whose child was killed runs on (a shell
    goes to its next command), and nothing of the command may run after its timeout.
    The price: a grandchild whose parent died with it is re-parented to the container's
    init, which may never reap it (the zombie goes when the container does).
    """

    def kill(runc: subprocess.Popen[bytes]) -> None:
        if inside is not None:
            inside()
        exec_pid = _read_pid(pid_file)  # 0: runc had not started it yet; killing runc is enough
        if exec_pid > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(exec_pid, signal.SIGKILL)
        # runc reaps the exec'd process and exits by itself; give it time to be scheduled
        # (seconds on a loaded node), then force it. Killed early, it leaves the dying
        # command to be re-parented and reaped later, still listed after the answer.
        try:
            runc.wait(RUNC_REAP_GRACE)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(runc.pid, signal.SIGKILL)

    return kill
