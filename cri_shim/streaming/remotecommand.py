"""Exec and attach, independent of the wire: pump stdio between client streams and a backend.

The SPDY and WebSocket front ends each turn their connection into `CommandStreams` (one
reader or writer per standard stream, plus the error and resize streams) and call
`serve_exec` or `serve_attach`. What goes on the error stream follows kubelet: protocol
v4 and later carry a JSON `Status` (Success, or NonZeroExitCode with the code as a cause);
older protocols carry a plain message, and nothing on success.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cri_shim.errors import CriError
from cri_shim.streaming.backend import ExecProcess, StdioSession, StreamingBackend
from cri_shim.streaming.tokens import AttachTarget, ExecTarget

log = logging.getLogger("cri_shim.streaming")

# After the command exited, output still in its pipes is forwarded as long as it keeps
# flowing; a pump that makes no progress for this long is given up (a background child
# that inherited the pipe would otherwise hold the exec open for ever).
OUTPUT_DRAIN_IDLE = 2.0
KILL_WAIT = 10.0


class InStream(Protocol):
    async def read(self) -> bytes:
        """The next chunk from the client, or b"" once it closed the stream."""


class OutStream(Protocol):
    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


@dataclass
class CommandStreams:
    error: OutStream | None
    stdin: InStream | None = None
    stdout: OutStream | None = None
    stderr: OutStream | None = None
    resize: InStream | None = None


# -- the error stream's payload ------------------------------------------------------------


def success_status() -> dict[str, Any]:
    return {"metadata": {}, "status": "Success"}


def exit_code_status(code: int) -> dict[str, Any]:
    return {
        "metadata": {},
        "status": "Failure",
        "message": f"command terminated with non-zero exit code: exit status {code}",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
    }


def internal_error_status(message: str) -> dict[str, Any]:
    return {
        "metadata": {},
        "status": "Failure",
        "message": f"Internal error occurred: {message}",
        "reason": "InternalError",
        "details": {"causes": [{"message": message}]},
        "code": 500,
    }


def encode_status(status: dict[str, Any], *, json_status: bool) -> bytes:
    """What goes on the error stream: JSON for v4+, the bare message (or nothing) before."""
    if json_status:
        return json.dumps(status, separators=(",", ":")).encode()
    if status["status"] == "Success":
        return b""
    return str(status["message"]).encode()


# -- terminal size -------------------------------------------------------------------------


class TerminalSizeDecoder:
    """Splits the resize stream, a sequence of `{"Width":..,"Height":..}` JSON objects."""

    MAX_PENDING = 4096

    def __init__(self) -> None:
        self._pending = ""
        self._decoder = json.JSONDecoder()

    def feed(self, data: bytes) -> list[tuple[int, int]]:
        self._pending += data.decode("utf-8", "replace")
        sizes: list[tuple[int, int]] = []
        while True:
            text = self._pending.lstrip()
            if not text:
                self._pending = ""
                return sizes
            try:
                value, end = self._decoder.raw_decode(text)
            except json.JSONDecodeError:
                # Most likely an object cut between two frames; wait for the rest, but do
                # not let garbage grow without bound.
                self._pending = text if len(text) < self.MAX_PENDING else ""
                return sizes
            self._pending = text[end:]
            if isinstance(value, dict):
                width, height = value.get("Width"), value.get("Height")
                if isinstance(width, int) and isinstance(height, int):
                    sizes.append((width, height))


# -- pumps ---------------------------------------------------------------------------------


@dataclass
class _Progress:
    bytes_out: int = 0


async def _pump_output(
    read: Callable[[], Awaitable[bytes]], sink: OutStream | None, progress: _Progress
) -> None:
    """Copy a process output to the client until EOF; without a client stream, discard."""
    client_ok = sink is not None
    while chunk := await read():
        progress.bytes_out += len(chunk)
        if client_ok and sink is not None:
            try:
                await sink.write(chunk)
            except (ConnectionError, OSError):
                client_ok = False  # keep draining so the process does not block on a full pipe
    if client_ok and sink is not None:
        with contextlib.suppress(ConnectionError, OSError):
            await sink.close()


async def _pump_stdin(source: InStream, session: StdioSession, client_gone: asyncio.Event) -> None:
    while chunk := await source.read():
        try:
            await session.write_stdin(chunk)
        except (ConnectionError, OSError):
            return  # the process closed its stdin or exited; nothing more to deliver
    if client_gone.is_set():
        # The connection dropped: that is a detach, not the end of the input. Closing
        # stdin would end a `cat` or a shell that another attach could still talk to.
        return
    with contextlib.suppress(ConnectionError, OSError):
        await session.close_stdin()


async def _pump_resize(source: InStream, session: StdioSession) -> None:
    decoder = TerminalSizeDecoder()
    while chunk := await source.read():
        for width, height in decoder.feed(chunk):
            try:
                await session.resize(width, height)
            except OSError as exc:
                log.debug("resize to %sx%s failed: %s", width, height, exc)


async def _drain(pumps: list[asyncio.Task[None]], progress: _Progress) -> None:
    """Let the output pumps finish while they make progress (see OUTPUT_DRAIN_IDLE)."""
    while True:
        seen = progress.bytes_out
        _, pending = await asyncio.wait(pumps, timeout=OUTPUT_DRAIN_IDLE)
        if not pending:
            return
        if progress.bytes_out == seen:
            log.info(
                "output still open %.0fs after the command exited; closing it", OUTPUT_DRAIN_IDLE
            )
            return


async def _write_status(streams: CommandStreams, status: dict[str, Any], json_status: bool) -> None:
    if streams.error is None:
        return
    payload = encode_status(status, json_status=json_status)
    with contextlib.suppress(ConnectionError, OSError):
        if payload:
            await streams.error.write(payload)
        await streams.error.close()


async def _close_outputs(streams: CommandStreams) -> None:
    for sink in (streams.stdout, streams.stderr):
        if sink is not None:
            with contextlib.suppress(ConnectionError, OSError):
                await sink.close()


def _start_pumps(
    session: StdioSession,
    streams: CommandStreams,
    want_stdin: bool,
    progress: _Progress,
    client_gone: asyncio.Event,
) -> tuple[list[asyncio.Task[None]], list[asyncio.Task[None]]]:
    outputs = [
        asyncio.create_task(_pump_output(session.read_stdout, streams.stdout, progress)),
        asyncio.create_task(_pump_output(session.read_stderr, streams.stderr, progress)),
    ]
    inputs = []
    if want_stdin and streams.stdin is not None:
        inputs.append(asyncio.create_task(_pump_stdin(streams.stdin, session, client_gone)))
    if streams.resize is not None:
        inputs.append(asyncio.create_task(_pump_resize(streams.resize, session)))
    return outputs, inputs


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, Exception):
            log.debug("stream pump failed: %r", result)


async def serve_exec(
    backend: StreamingBackend,
    target: ExecTarget,
    streams: CommandStreams,
    *,
    json_status: bool,
    client_gone: asyncio.Event,
) -> None:
    """Run the command; the error stream gets its exit status. Killed if the client leaves."""
    try:
        process = await backend.exec(
            target.container_id, list(target.cmd), target.tty, target.stdin
        )
    except (CriError, OSError) as exc:
        await _close_outputs(streams)
        await _write_status(streams, internal_error_status(str(exc)), json_status)
        return
    progress = _Progress()
    outputs, inputs = _start_pumps(process, streams, target.stdin, progress, client_gone)
    try:
        exit_code = await _wait_or_gone(process, client_gone)
        if exit_code is None:
            return  # the client left: nobody to report to
        await _drain(outputs, progress)
        await _cancel(outputs + inputs)
        await _close_outputs(streams)
        status = success_status() if exit_code == 0 else exit_code_status(exit_code)
        await _write_status(streams, status, json_status)
    finally:
        await _cancel(outputs + inputs)
        await _kill_quietly(process)


async def _wait_or_gone(process: ExecProcess, client_gone: asyncio.Event) -> int | None:
    exited = asyncio.create_task(process.wait())
    gone = asyncio.create_task(client_gone.wait())
    try:
        await asyncio.wait([exited, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if exited.done():
        return exited.result()
    exited.cancel()
    log.info("exec client went away; killing the command")
    return None


async def _kill_quietly(process: ExecProcess) -> None:
    # Shielded: this runs in `finally` blocks, also when the connection task is cancelled
    # at daemon shutdown, and a command must not outlive the client that started it.
    async def kill_and_reap() -> None:
        try:
            await process.kill()
            await asyncio.wait_for(process.wait(), KILL_WAIT)
        except (TimeoutError, OSError, CriError) as exc:
            log.warning("could not stop an exec'd command: %s", exc)

    await asyncio.shield(asyncio.ensure_future(kill_and_reap()))


async def serve_attach(
    backend: StreamingBackend,
    target: AttachTarget,
    streams: CommandStreams,
    *,
    json_status: bool,
    client_gone: asyncio.Event,
) -> None:
    """Attach until the container's output ends (it exited) or the client detaches."""
    try:
        session = await backend.attach(target.container_id, target.tty, target.stdin)
    except (CriError, OSError) as exc:
        await _close_outputs(streams)
        await _write_status(streams, internal_error_status(str(exc)), json_status)
        return
    progress = _Progress()
    outputs, inputs = _start_pumps(session, streams, target.stdin, progress, client_gone)
    try:
        ended = asyncio.create_task(asyncio.wait(outputs))
        gone = asyncio.create_task(client_gone.wait())
        try:
            await asyncio.wait([ended, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            ended.cancel()
        if client_gone.is_set() and not all(task.done() for task in outputs):
            return
        await _cancel(inputs)
        await _close_outputs(streams)
        await _write_status(streams, success_status(), json_status)
    finally:
        await _cancel(outputs + inputs)
        with contextlib.suppress(OSError, CriError):
            await session.detach()
