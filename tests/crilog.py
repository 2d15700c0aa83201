"""The CRI container log format: `<RFC3339Nano timestamp> <stdout|stderr> <P|F> <content>`.

One record per line. `F` marks the last (or only) piece of a logical line and `P` a piece
that continues in the next record with the same stream, so a reader can rebuild lines
that were written in fragments or split because they were too long.

In production conmon writes these files and kubelet reads them; the daemon does neither,
so this lives with the tests: conmon-stub (a separate process, the test double) writes
with CriLogWriter, and the tests read what conmon or conmon-stub wrote. It needs nothing
beyond the standard library, because conmon-stub imports it.
"""

from __future__ import annotations

import enum
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

# A record longer than this is split into P pieces. kubelet reads lines with a 16 KiB
# buffer window in mind; conmon uses a similar bound so that one huge line never stalls
# a reader.
DEFAULT_MAX_RECORD_BYTES = 16 * 1024


class Stream(enum.StrEnum):
    STDOUT = "stdout"
    STDERR = "stderr"


@dataclass(frozen=True)
class LogRecord:
    """One parsed record. `content` excludes the trailing newline."""

    timestamp_ns: int
    stream: Stream
    partial: bool
    content: bytes


@dataclass(frozen=True)
class LogMessage:
    """A logical line rebuilt from its P pieces and the closing F record."""

    timestamp_ns: int  # of the first piece
    stream: Stream
    content: bytes
    complete: bool  # False when the log ended before the F record arrived


def format_timestamp(ns: int) -> str:
    """RFC 3339 in UTC with nine fractional digits, as Go's RFC3339Nano prints for UTC."""
    seconds, nanos = divmod(ns, 1_000_000_000)
    base = datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{base}.{nanos:09d}Z"


_TIMESTAMP = re.compile(
    r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2})$"
)


def parse_timestamp(text: str) -> int:
    """Nanoseconds since the epoch. Accepts `Z` or a `±hh:mm` offset (conmon writes
    `+00:00`) and 0 to 9 fractional digits (Go trims trailing zeros)."""
    match = _TIMESTAMP.match(text)
    if match is None:
        raise ValueError(f"not an RFC 3339 timestamp: {text!r}")
    whole, fraction, zone = match.groups()
    base = datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)
    if zone != "Z":
        sign = 1 if zone[0] == "+" else -1
        base -= sign * timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6]))
    nanos = int((fraction or "").ljust(9, "0"))
    return int(base.timestamp()) * 1_000_000_000 + nanos


def format_record(timestamp_ns: int, stream: Stream, partial: bool, content: bytes) -> bytes:
    tag = b"P" if partial else b"F"
    return b"%s %s %s %s\n" % (
        format_timestamp(timestamp_ns).encode(),
        stream.value.encode(),
        tag,
        content,
    )


def parse_record(line: bytes) -> LogRecord:
    """Parse one record (with or without its trailing newline). Raises ValueError."""
    if line.endswith(b"\n"):
        line = line[:-1]
    parts = line.split(b" ", 3)
    if len(parts) < 3:
        raise ValueError(f"not a CRI log record: {line[:80]!r}")
    stamp, stream, tags = parts[0], parts[1], parts[2]
    try:
        parsed_stream = Stream(stream.decode())
    except ValueError:
        raise ValueError(f"unknown stream {stream!r} in CRI log record") from None
    # Tags are colon-separated; the first is the P/F marker (kubelet reads it this way).
    marker = tags.split(b":", 1)[0]
    if marker not in (b"P", b"F"):
        raise ValueError(f"unknown tag {tags!r} in CRI log record")
    return LogRecord(
        timestamp_ns=parse_timestamp(stamp.decode()),
        stream=parsed_stream,
        partial=marker == b"P",
        content=parts[3] if len(parts) == 4 else b"",
    )


def read_records(path: Path) -> Iterator[LogRecord]:
    """Every record of a log file. A torn last line (writer mid-write) is skipped."""
    with open(path, "rb") as handle:
        for line in handle:
            if not line.endswith(b"\n"):
                return
            yield parse_record(line)


def join_partials(records: Iterable[LogRecord]) -> Iterator[LogMessage]:
    """Rebuild logical lines. Pieces are joined per stream, since stdout and stderr
    records interleave freely."""
    pending: dict[Stream, tuple[int, list[bytes]]] = {}
    for record in records:
        started, pieces = pending.pop(record.stream, (record.timestamp_ns, []))
        pieces.append(record.content)
        if record.partial:
            pending[record.stream] = (started, pieces)
        else:
            yield LogMessage(started, record.stream, b"".join(pieces), complete=True)
    for stream, (started, pieces) in pending.items():
        yield LogMessage(started, stream, b"".join(pieces), complete=False)


class CriLogWriter:
    """Writes container output as CRI log records.

    Output is written as soon as it arrives: a chunk without a newline becomes a P
    record at once rather than being held back, so `kubectl logs -f` never lags behind
    a process that prints a prompt or a progress bar.
    """

    def __init__(self, path: Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        if max_record_bytes < 1:
            raise ValueError("max_record_bytes must be positive")
        self.path = path
        self._max = max_record_bytes
        self._fd = self._open()

    def _open(self) -> int:
        # O_APPEND so that a rotated-then-reopened file and a concurrent reader never see
        # writes land at a stale offset.
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)

    def write(self, stream: Stream, data: bytes, *, now_ns: int | None = None) -> None:
        if not data:
            return
        stamp = time.time_ns() if now_ns is None else now_ns
        out = bytearray()
        lines = data.split(b"\n")
        for index, line in enumerate(lines):
            ends_line = index < len(lines) - 1
            if not ends_line and not line:
                break  # data ended with a newline; nothing left over
            for start in range(0, max(len(line), 1), self._max):
                piece = line[start : start + self._max]
                last_piece = start + self._max >= len(line)
                out += format_record(stamp, stream, not (ends_line and last_piece), piece)
        view = memoryview(bytes(out))
        while view:
            view = view[os.write(self._fd, view) :]

    def reopen(self) -> None:
        """Start writing to a fresh file at `path` (after kubelet renamed the old one)."""
        old = self._fd
        self._fd = self._open()
        os.close(old)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> CriLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
