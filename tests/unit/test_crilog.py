"""The CRI log format as kubelet reads it: timestamps, P/F records, long lines, reopen."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.crilog import (
    CriLogWriter,
    LogMessage,
    LogRecord,
    Stream,
    format_record,
    format_timestamp,
    join_partials,
    parse_record,
    parse_timestamp,
    read_records,
)

T0 = 1_700_000_000_123_456_789  # 2023-11-14T22:13:20.123456789Z


@pytest.mark.parametrize(
    ("text", "ns"),
    [
        ("2023-11-14T22:13:20.123456789Z", T0),
        ("2023-11-14T22:13:20.123456789+00:00", T0),  # conmon's form
        ("2023-11-15T00:13:20.123456789+02:00", T0),
        ("2023-11-14T21:43:20.123456789-00:30", T0),
        ("2023-11-14T22:13:20.1234Z", T0 - 56_789),  # Go trims trailing zeros
        ("2023-11-14T22:13:20Z", T0 - 123_456_789),
    ],
)
def test_parse_timestamp(text: str, ns: int) -> None:
    assert parse_timestamp(text) == ns


@pytest.mark.parametrize("bad", ["2023-11-14 22:13:20Z", "yesterday", "2023-11-14T22:13:20"])
def test_parse_timestamp_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_timestamp(bad)


def test_format_timestamp_is_rfc3339nano_utc_with_nine_digits() -> None:
    assert format_timestamp(T0) == "2023-11-14T22:13:20.123456789Z"
    assert format_timestamp(1_700_000_000_000_000_001) == "2023-11-14T22:13:20.000000001Z"
    assert parse_timestamp(format_timestamp(T0)) == T0


@pytest.mark.parametrize(
    ("line", "record"),
    [
        (
            b"2023-11-14T22:13:20.123456789Z stdout F hello world\n",
            LogRecord(T0, Stream.STDOUT, False, b"hello world"),
        ),
        (
            b"2023-11-14T22:13:20.123456789+00:00 stderr P part",
            LogRecord(T0, Stream.STDERR, True, b"part"),
        ),
        (b"2023-11-14T22:13:20.123456789Z stdout F \n", LogRecord(T0, Stream.STDOUT, False, b"")),
        (b"2023-11-14T22:13:20.123456789Z stdout F\n", LogRecord(T0, Stream.STDOUT, False, b"")),
        (
            b"2023-11-14T22:13:20.123456789Z stdout F:extra  two  spaces ",
            LogRecord(T0, Stream.STDOUT, False, b" two  spaces "),
        ),
    ],
)
def test_parse_record(line: bytes, record: LogRecord) -> None:
    assert parse_record(line) == record


@pytest.mark.parametrize(
    "line",
    [b"garbage", b"2023-11-14T22:13:20Z stdin F x", b"2023-11-14T22:13:20Z stdout X x"],
)
def test_parse_record_rejects(line: bytes) -> None:
    with pytest.raises(ValueError):
        parse_record(line)


def test_format_then_parse_round_trips() -> None:
    line = format_record(T0, Stream.STDERR, True, b"a b  c")
    assert line == b"2023-11-14T22:13:20.123456789Z stderr P a b  c\n"
    assert parse_record(line) == LogRecord(T0, Stream.STDERR, True, b"a b  c")


def _records(path: Path) -> list[tuple[str, str, bytes]]:
    return [(r.stream.value, "P" if r.partial else "F", r.content) for r in read_records(path)]


def test_writer_complete_lines_are_f_records(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    with CriLogWriter(log) as writer:
        writer.write(Stream.STDOUT, b"one\ntwo\n\n", now_ns=T0)
    assert _records(log) == [("stdout", "F", b"one"), ("stdout", "F", b"two"), ("stdout", "F", b"")]
    assert log.read_bytes().startswith(b"2023-11-14T22:13:20.123456789Z stdout F one\n")


def test_writer_emits_a_fragment_at_once_as_p_and_reader_joins(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    with CriLogWriter(log) as writer:
        writer.write(Stream.STDOUT, b"progress: 1", now_ns=T0)
        # Visible before the line is finished, so `kubectl logs -f` does not lag.
        assert _records(log) == [("stdout", "P", b"progress: 1")]
        writer.write(Stream.STDERR, b"boom\n", now_ns=T0 + 1)
        writer.write(Stream.STDOUT, b"0%\nnext", now_ns=T0 + 2)
    assert _records(log) == [
        ("stdout", "P", b"progress: 1"),
        ("stderr", "F", b"boom"),
        ("stdout", "F", b"0%"),
        ("stdout", "P", b"next"),
    ]
    assert list(join_partials(read_records(log))) == [
        LogMessage(T0 + 1, Stream.STDERR, b"boom", complete=True),
        LogMessage(T0, Stream.STDOUT, b"progress: 10%", complete=True),
        LogMessage(T0 + 2, Stream.STDOUT, b"next", complete=False),
    ]


@pytest.mark.parametrize(
    ("length", "newline", "expected_tags"),
    [
        (10, True, "F"),
        (16, True, "F"),  # exactly the limit stays one record
        (17, True, "PF"),
        (40, True, "PPF"),
        (40, False, "PPP"),
        (0, True, "F"),
    ],
)
def test_writer_splits_long_lines(
    tmp_path: Path, length: int, newline: bool, expected_tags: str
) -> None:
    log = tmp_path / "c.log"
    content = bytes(ord("a") + i % 26 for i in range(length))
    with CriLogWriter(log, max_record_bytes=16) as writer:
        writer.write(Stream.STDOUT, content + (b"\n" if newline else b""), now_ns=T0)
    records = list(read_records(log))
    assert "".join("P" if r.partial else "F" for r in records) == expected_tags
    assert all(len(r.content) <= 16 for r in records)
    assert b"".join(r.content for r in records) == content


def test_reopen_writes_to_a_new_file_after_rotation(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    with CriLogWriter(log) as writer:
        writer.write(Stream.STDOUT, b"before\n", now_ns=T0)
        log.rename(tmp_path / "c.log.1")  # what kubelet does before ReopenContainerLog
        writer.write(Stream.STDOUT, b"still old\n", now_ns=T0)
        writer.reopen()
        writer.write(Stream.STDOUT, b"after\n", now_ns=T0)
    assert _records(tmp_path / "c.log.1") == [
        ("stdout", "F", b"before"),
        ("stdout", "F", b"still old"),
    ]
    assert _records(log) == [("stdout", "F", b"after")]


def test_read_records_skips_a_torn_last_line(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    log.write_bytes(format_record(T0, Stream.STDOUT, False, b"whole") + b"2023-11-14T22:13")
    assert _records(log) == [("stdout", "F", b"whole")]
