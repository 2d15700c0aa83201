"""The daemon's log output: logfmt, JSON or text lines with structured fields, and redaction.

Every line is one event: `ts`, `level`, `logger`, `msg`, then fields. A line about a
sandbox or a container carries `sandbox_id` and `sandbox_name`, or `container_id` and
`container_name` (the CRI name, `k8s_...`), so that `journalctl -u cri-shim | grep
sandbox_id=<id>` follows one pod through its life. (`name` itself is taken: it is the
logger's name on every LogRecord.) Those fields come from what the task bound
(`cri_shim.logcontext`), or from `extra=object_fields(...)` on the line itself; never
from the message's wording.

`RedactSecrets` is a safety net on every line: registry credentials must never be logged
in the first place, but a password, an `Authorization` header or a token that slips into a
message, an exception or a field is replaced by `<redacted>` before it is written.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Mapping
from typing import Any, Literal, TextIO

from cri_shim.logcontext import BoundObjectFilter

LogFormat = Literal["logfmt", "json", "text"]

REDACTED = "<redacted>"

# The attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD_ATTRS = frozenset(logging.LogRecord("", logging.INFO, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}

# Libraries whose debug output is one line per socket event or loop lookup (grpc): kept at
# INFO even when the daemon runs at debug, so that `--log-level debug` shows cri-shim's
# own steps.
_CHATTY_LIBRARIES = ("httpcore", "hpack", "grpc")


# ---- redaction ----------------------------------------------------------------------

# Keys whose value is a secret, in any spelling the daemon or a library might print:
# `password=x`, `"password": "x"`, `auth: "..."` (protobuf text), `Authorization: Bearer x`.
_SECRET_KEYS = (
    r"password|passwd|auth|identity_?token|identitytoken|registry_?token|registrytoken"
    r"|access_?token|refresh_?token|token|secret|client_?secret"
    r"|(?:proxy-)?authorization|x-registry-auth"
)
_SECRET_VALUE = re.compile(
    rf"""(?P<key>(?<![\w-])(?:{_SECRET_KEYS})(?![\w-]))
         (?P<sep>["']?\s*[:=]\s*)
         (?P<scheme>(?:basic|bearer|negotiate|digest)\s+)?
         (?P<value>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[^\s,;&)\]}}]+)""",
    re.IGNORECASE | re.VERBOSE,
)
# A bare header value without its name: `Bearer eyJ...`, `Basic YWxp...`. The value must
# look like a token (a digit, `+`, `/` or `=` in it), so that "Basic authentication" stays.
_BARE_CREDENTIAL = re.compile(
    r"\b(?P<scheme>Bearer|Basic)\s+(?=[\w.~+/=-]*[0-9+/=])(?P<value>[A-Za-z0-9._~+/=-]{8,})"
)
# user:password@ in a URL.
_URL_USERINFO = re.compile(r"(?P<prefix>://[^/\s:@]+:)[^/\s@]+@")
_SECRET_FIELD = re.compile(rf"^(?:{_SECRET_KEYS})$", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every credential-looking value replaced by `<redacted>`."""

    def value(match: re.Match[str]) -> str:
        raw = match.group("value")
        quote = raw[0] if raw[:1] in ('"', "'") and len(raw) > 1 else ""
        return (
            f"{match.group('key')}{match.group('sep')}{match.group('scheme') or ''}"
            f"{quote}{REDACTED}{quote}"
        )

    text = _SECRET_VALUE.sub(value, text)
    text = _BARE_CREDENTIAL.sub(lambda m: f"{m.group('scheme')} {REDACTED}", text)
    return _URL_USERINFO.sub(lambda m: f"{m.group('prefix')}{REDACTED}@", text)


class RedactSecrets(logging.Filter):
    """Rewrites a record so that no handler writes a secret: message, exception, fields."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        for key, value in extra_fields(record).items():
            if _SECRET_FIELD.match(key):
                setattr(record, key, REDACTED)
            elif isinstance(value, str):
                setattr(record, key, redact(value))
        return True


# ---- formatters ---------------------------------------------------------------------


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record carries beyond the standard ones (from `extra=` or filters)."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD_ATTRS and k[:1] != "_"}


# The last whole second formatted, and its text: a pod's start writes a dozen lines in a
# second, and gmtime with strftime costs more than the rest of the stamp.
_last_second: tuple[int, str] = (-1, "")


def _timestamp(record: logging.LogRecord) -> str:
    # RFC 3339 in UTC with milliseconds: sortable, and the same on every node.
    global _last_second
    whole = int(record.created)
    second, text = _last_second  # one read: another thread may replace it meanwhile
    if second != whole:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
        _last_second = (whole, text)
    return f"{text}.{int(record.msecs):03d}Z"


def _event(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, Any]:
    event: dict[str, Any] = {
        "ts": _timestamp(record),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for key, value in extra_fields(record).items():
        event.setdefault(key, value)
    if record.exc_info and not record.exc_text:
        record.exc_text = formatter.formatException(record.exc_info)
    if record.exc_text:
        event["exc"] = record.exc_text
    if record.stack_info:
        event["stack"] = formatter.formatStack(record.stack_info)
    return event


_BARE = re.compile(r"^[^\s\"=\\]+$")


def logfmt_value(value: object) -> str:
    """A logfmt value: bare when it can be, else double-quoted with escapes (one line)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text and _BARE.match(text):
        return text
    escaped = (
        text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    )
    return f'"{escaped}"'


class LogfmtFormatter(logging.Formatter):
    """`ts=... level=info logger=cri_shim.sandbox msg="..." sandbox_id=... name=...`"""

    def format(self, record: logging.LogRecord) -> str:
        event = _event(record, self)
        return " ".join(f"{key}={logfmt_value(value)}" for key, value in event.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the same keys as logfmt."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_event(record, self), default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """For a person at a terminal: the classic line, the fields in brackets after it."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = extra_fields(record)
        if fields:
            line += " [" + " ".join(f"{k}={logfmt_value(v)}" for k, v in fields.items()) + "]"
        return line


FORMATTERS: Mapping[str, type[logging.Formatter]] = {
    "logfmt": LogfmtFormatter,
    "json": JsonFormatter,
    "text": TextFormatter,
}


def make_handler(fmt: str, stream: TextIO | None = None) -> logging.Handler:
    """A stream handler with the formatter for `fmt`, redaction and object fields."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(FORMATTERS[fmt]())
    handler.addFilter(RedactSecrets())
    handler.addFilter(BoundObjectFilter())
    handler.set_name("cri-shim")
    return handler


def setup_logging(level: str, fmt: str = "logfmt", stream: TextIO | None = None) -> None:
    """Configure the root logger for the daemon; calling it again replaces the handler."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "cri-shim"]:
        root.removeHandler(old)
    root.addHandler(make_handler(fmt, stream))
    numeric = logging.getLevelName(level.upper())
    root.setLevel(numeric)
    for name in _CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(max(numeric, logging.INFO))
