"""Structured log lines: the three formats, the bound objects' fields on every line, secrets
redacted."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from cri_shim.logcontext import bind_object, object_bound, object_fields
from cri_shim.logsetup import REDACTED, logfmt_value, redact, setup_logging

SANDBOX_ID = "4f1c" * 16
CONTAINER_ID = "9a0b" * 16
POD = "k8s_POD_web_default_uid-1_0"
CTR = "k8s_app_web_default_uid-1_0"


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, put back as it was (pytest's own handlers included)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def emit(
    fmt: str, root_logger: logging.Logger, level: str = "debug"
) -> tuple[io.StringIO, logging.Logger]:
    stream = io.StringIO()
    setup_logging(level, fmt, stream)
    return stream, logging.getLogger("cri_shim.test")


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def parse_logfmt(line: str) -> dict[str, str]:
    """A small logfmt reader, enough to check what the formatter writes."""
    fields: dict[str, str] = {}
    i = 0
    while i < len(line):
        eq = line.index("=", i)
        key = line[i:eq]
        i = eq + 1
        if line[i] == '"':
            i += 1
            value = []
            while line[i] != '"':
                if line[i] == "\\":
                    i += 1
                    value.append({"n": "\n", "r": "\r"}.get(line[i], line[i]))
                else:
                    value.append(line[i])
                i += 1
            fields[key] = "".join(value)
            i += 2
        else:
            end = line.find(" ", i)
            end = len(line) if end == -1 else end
            fields[key] = line[i:end]
            i = end + 1
    return fields


# ---- formats ------------------------------------------------------------------------


def test_logfmt_line_has_time_level_logger_message_and_fields(root_logger: logging.Logger) -> None:
    stream, log = emit("logfmt", root_logger)
    log.info("pulled %s in %.1fs", "busybox", 1.25, extra={"image": "busybox", "bytes": 42})
    [line] = lines(stream)
    fields = parse_logfmt(line)
    assert fields["level"] == "info"
    assert fields["logger"] == "cri_shim.test"
    assert fields["msg"] == "pulled busybox in 1.2s"
    assert fields["image"] == "busybox"
    assert fields["bytes"] == "42"
    assert fields["ts"].endswith("Z") and "T" in fields["ts"]
    assert list(fields)[:4] == ["ts", "level", "logger", "msg"]


def test_each_line_is_stamped_with_its_own_second_and_millisecond(
    root_logger: logging.Logger,
) -> None:
    stream, log = emit("logfmt", root_logger)
    # Back and forth across second boundaries: a line never takes another's second.
    for created in (1700000000.999, 1700000001.0, 1700000000.5, 1700000061.25, 1700000061.75):
        record = log.makeRecord(log.name, logging.INFO, __file__, 1, "at %s", (created,), None)
        record.created, record.msecs = created, (created - int(created)) * 1000
        log.handle(record)
    stamps = [parse_logfmt(line)["ts"] for line in lines(stream)]
    assert stamps == [
        "2023-11-14T22:13:20.999Z",
        "2023-11-14T22:13:21.000Z",
        "2023-11-14T22:13:20.500Z",
        "2023-11-14T22:14:21.250Z",
        "2023-11-14T22:14:21.750Z",
    ]


def test_logfmt_quotes_what_needs_it_and_stays_on_one_line(root_logger: logging.Logger) -> None:
    stream, log = emit("logfmt", root_logger)
    try:
        raise ValueError('bad "value"\nsecond line')
    except ValueError:
        log.exception("it failed = badly")
    [line] = lines(stream)
    fields = parse_logfmt(line)
    assert fields["msg"] == "it failed = badly"
    assert fields["level"] == "error"
    assert "Traceback" in fields["exc"] and 'ValueError: bad "value"\nsecond line' in fields["exc"]


@pytest.mark.parametrize(
    ("value", "written"),
    [
        ("plain", "plain"),
        ("two words", '"two words"'),
        ("", '""'),
        ('a"b', '"a\\"b"'),
        ("k=v", '"k=v"'),
        (3, "3"),
        (True, "true"),
        (None, "null"),
    ],
)
def test_logfmt_values(value: object, written: str) -> None:
    assert logfmt_value(value) == written


def test_json_lines_are_objects_with_the_same_keys(root_logger: logging.Logger) -> None:
    stream, log = emit("json", root_logger)
    with object_bound("sandbox", SANDBOX_ID, POD):
        log.warning("stopped")
    log.debug('ünïcode and "quotes"', extra={"count": 3})
    first, second = (json.loads(line) for line in lines(stream))
    assert first["level"] == "warning"
    assert first["msg"] == "stopped"
    assert first["sandbox_id"] == SANDBOX_ID and first["sandbox_name"] == POD
    assert first["logger"] == "cri_shim.test"
    assert second["msg"] == 'ünïcode and "quotes"' and second["count"] == 3
    assert "sandbox_id" not in second


def test_text_lines_keep_the_classic_form_with_fields_after(root_logger: logging.Logger) -> None:
    stream, log = emit("text", root_logger)
    with object_bound("container", CONTAINER_ID, CTR):
        log.info("container %s (%s) started", CONTAINER_ID, CTR)
    [line] = lines(stream)
    assert f"INFO cri_shim.test: container {CONTAINER_ID} ({CTR}) started" in line
    assert line.endswith(f"[container_id={CONTAINER_ID} container_name={CTR}]")


def test_log_level_changes_what_is_written(root_logger: logging.Logger) -> None:
    stream, log = emit("logfmt", root_logger, level="warning")
    log.info("not shown")
    log.warning("shown")
    assert [parse_logfmt(line)["msg"] for line in lines(stream)] == ["shown"]
    stream, log = emit("logfmt", root_logger, level="debug")
    log.debug("now shown")
    assert [parse_logfmt(line)["msg"] for line in lines(stream)] == ["now shown"]
    # A chatty library's per-socket debug lines stay out even at debug.
    logging.getLogger("httpcore.connection").debug("connect_tcp.started")
    assert len(lines(stream)) == 1


def test_setting_up_again_replaces_the_handler(root_logger: logging.Logger) -> None:
    first, _ = emit("logfmt", root_logger)
    second, log = emit("json", root_logger)
    log.info("once")
    assert first.getvalue() == ""
    assert json.loads(second.getvalue())["msg"] == "once"


# ---- object fields ------------------------------------------------------------------


def test_every_line_of_a_bound_task_carries_the_objects_id_and_name(
    root_logger: logging.Logger,
) -> None:
    stream, log = emit("logfmt", root_logger)
    with object_bound("sandbox", SANDBOX_ID, POD):
        log.info("cached for %ds", 120)
        log.info("network ready")
        log.error("rollback left work for GC: %s", "x")
    for line in lines(stream):
        fields = parse_logfmt(line)
        assert fields["sandbox_id"] == SANDBOX_ID
        assert fields["sandbox_name"] == POD
        assert fields["logger"] == "cri_shim.test"


def test_the_wording_of_a_message_is_not_a_contract(root_logger: logging.Logger) -> None:
    """A message that names an object outside of its binding gets no fields from it."""
    stream, log = emit("logfmt", root_logger)
    log.info("sandbox %s (%s) stopped", SANDBOX_ID, POD)
    log.info(f"name '{POD}' is reserved for {SANDBOX_ID}")
    for line in lines(stream):
        assert "sandbox_id" not in parse_logfmt(line)


def test_a_container_line_carries_its_pod_too(root_logger: logging.Logger) -> None:
    stream, log = emit("json", root_logger)
    with object_bound("sandbox", SANDBOX_ID, POD), object_bound("container", CONTAINER_ID, CTR):
        log.info("started")
    log.info("after")
    first, after = (json.loads(line) for line in lines(stream))
    assert first["sandbox_id"] == SANDBOX_ID and first["sandbox_name"] == POD
    assert first["container_id"] == CONTAINER_ID and first["container_name"] == CTR
    assert not {"sandbox_id", "container_id"} & set(after)


def test_binding_another_object_of_a_kind_drops_the_first_ones_name(
    root_logger: logging.Logger,
) -> None:
    stream, log = emit("logfmt", root_logger)
    with object_bound("sandbox", "e" * 64, "k8s_POD_other_default_uid-2_0"):
        bind_object("sandbox", SANDBOX_ID)  # known by its ID only
        log.info("stopped")
    fields = parse_logfmt(lines(stream)[0])
    assert fields["sandbox_id"] == SANDBOX_ID and "sandbox_name" not in fields


def test_explicit_fields_win_over_bound_ones(root_logger: logging.Logger) -> None:
    stream, log = emit("logfmt", root_logger)
    with object_bound("container", CONTAINER_ID, CTR):
        log.info("about another", extra=object_fields("container", "c1", "n1"))
        log.info("about this one, by ID", extra=object_fields("container", CONTAINER_ID))
    other, same = (parse_logfmt(line) for line in lines(stream))
    assert other["container_id"] == "c1" and other["container_name"] == "n1"
    assert same["container_id"] == CONTAINER_ID and same["container_name"] == CTR


async def test_the_binding_follows_the_task_into_its_tasks_and_threads_and_no_further(
    root_logger: logging.Logger,
) -> None:
    stream, log = emit("logfmt", root_logger)

    async def started() -> None:
        log.info("in a task it started")

    async def request(object_id: str, name: str) -> None:
        bind_object("sandbox", object_id, name)
        await asyncio.sleep(0)  # the other request runs meanwhile
        log.info("in the request")
        await asyncio.create_task(started())
        await asyncio.to_thread(log.info, "in a worker thread")

    await asyncio.gather(request(SANDBOX_ID, POD), request("e" * 64, "k8s_POD_b_default_u_0"))
    log.info("outside")
    seen = [parse_logfmt(line) for line in lines(stream)]
    assert len(seen) == 7
    for fields in seen[:-1]:
        expected = POD if fields["sandbox_id"] == SANDBOX_ID else "k8s_POD_b_default_u_0"
        assert fields["sandbox_name"] == expected
    assert sorted(f["sandbox_id"] for f in seen[:-1]) == [SANDBOX_ID] * 3 + ["e" * 64] * 3
    assert "sandbox_id" not in seen[-1]


# ---- redaction ----------------------------------------------------------------------

PASSWORD = "s3cr3t-Pa55"
TOKEN = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJl"
BASIC = "YWxpY2U6czNjcjN0LVBhNTU="


@pytest.mark.parametrize(
    "text",
    [
        f"login with password={PASSWORD} failed",
        f"login with password: {PASSWORD}",
        f'{{"username": "alice", "password": "{PASSWORD} with spaces"}}',
        f"{{'password': '{PASSWORD}'}}",
        f'auth {{ username: "alice" password: "{PASSWORD}" }}',
        f'auth: "{BASIC}"',
        f"Authorization: Bearer {TOKEN}",
        f"headers={{'authorization': 'Basic {BASIC}'}}",
        f"sent Bearer {TOKEN} to the registry",
        f"identity_token={TOKEN}",
        f'"identitytoken": "{TOKEN}"',
        f"registry_token: {TOKEN}",
        f"refresh_token={TOKEN}&scope=repository:x:pull",
        f'{{"token": "{TOKEN}", "expires_in": 300}}',
        f"GET https://alice:{PASSWORD}@registry.example/v2/",
    ],
)
def test_credentials_are_redacted(text: str) -> None:
    cleaned = redact(text)
    for secret in (PASSWORD, TOKEN, BASIC):
        assert secret not in cleaned
    assert REDACTED in cleaned


@pytest.mark.parametrize(
    "text",
    [
        "pulled docker.io/library/busybox:latest (sha256:" + "ab" * 32 + ")",
        "username=alice",
        "registry requires Basic authentication",
        "auth config: 'auth' is not base64 of 'username:password'",
        f"sandbox '{POD}' ({SANDBOX_ID}): stage sandbox network",
        "token realm https://auth.example/token service=registry",
    ],
)
def test_what_is_not_a_secret_is_left_alone(text: str) -> None:
    assert redact(text) == text


def test_nothing_secret_reaches_the_output(root_logger: logging.Logger) -> None:
    for fmt in ("logfmt", "json", "text"):
        stream, log = emit(fmt, root_logger)
        log.info("pull with %s", {"username": "alice", "password": PASSWORD})
        log.info("header", extra={"password": PASSWORD, "note": f"Bearer {TOKEN}"})
        try:
            raise RuntimeError(f"registry said no to Authorization: Basic {BASIC}")
        except RuntimeError:
            log.exception("pull failed")
        log.info("stack", stack_info=True, extra={"detail": f"password={PASSWORD}"})
        out = stream.getvalue()
        for secret in (PASSWORD, TOKEN, BASIC):
            assert secret not in out, (fmt, out)
        assert "alice" in out and "pull failed" in out and "RuntimeError" in out
