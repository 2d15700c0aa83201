"""Which sandbox or container a log line is about, bound to the task doing the work.

The gRPC edge binds the objects a request names (its `pod_sandbox_id`, `container_id`),
the creation coordinator binds the object it reserves and the tasks it starts for it (a
creation outlives its request), and start-up binds each object it restores. Every line
logged meanwhile, in that task, in the tasks it starts and in `asyncio.to_thread`
workers, carries `<kind>_id` and `<kind>_name`: the wording of a message is not part of
the contract.

A contextvar and a logging.Filter rather than structlog's contextvars: the output stays
stdlib logging's (formatters, redaction), and `contextvars` is already loaded by asyncio,
so binding costs no memory, where importing structlog costs 0.3 MiB resident in the
daemon (2.2 MiB on its own) and a dependency.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping

KINDS = ("sandbox", "container")

_EMPTY: Mapping[str, str] = {}
_bound: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "cri_shim_log_objects", default=_EMPTY
)


def object_fields(kind: str, object_id: str, name: str = "") -> dict[str, str]:
    """The `extra=` fields of a line about a sandbox or a container."""
    fields = {f"{kind}_id": object_id} if object_id else {}
    if name:
        fields[f"{kind}_name"] = name
    return fields


def bind_object(kind: str, object_id: str, name: str = "") -> None:
    """From now on, every line of the current task (and of the tasks and threads it
    starts) is about this object. Replaces what was bound for `kind` before: a name is
    never left on another object's ID."""
    fields = {k: v for k, v in _bound.get().items() if not k.startswith(f"{kind}_")}
    fields.update(object_fields(kind, object_id, name))
    _bound.set(fields)


# The trace a line belongs to, when tracing is on: logs and traces join on these.
TRACE_FIELDS = ("trace_id", "span_id")


def bind_trace(trace_id: str, span_id: str) -> None:
    """From now on, lines of the current task carry the span's `trace_id` and `span_id`."""
    fields = dict(_bound.get())
    fields.update(trace_id=trace_id, span_id=span_id)
    _bound.set(fields)


def bound_fields() -> Mapping[str, str]:
    return _bound.get()


class scope:
    """Whatever is bound inside the block is unbound when it ends.

    A class, not a @contextmanager: every CRI call enters one, and the generator costs
    three times as much."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _bound.set(_bound.get())

    def __exit__(self, *exc_info: object) -> None:
        _bound.reset(self._token)


@contextlib.contextmanager
def object_bound(kind: str, object_id: str, name: str = "") -> Iterator[None]:
    """Lines logged inside the block are about this object."""
    with scope():
        bind_object(kind, object_id, name)
        yield


def context_for(kind: str, object_id: str, name: str = "") -> contextvars.Context:
    """A copy of the current context with the object bound, for a task that works on
    it (`loop.create_task(..., context=...)`)."""
    context = contextvars.copy_context()
    context.run(bind_object, kind, object_id, name)
    return context


class BoundObjectFilter(logging.Filter):
    """Adds the bound objects' fields to each record.

    Fields a line passes itself (`extra=`) win: a line about another object of the same
    kind keeps its own, and takes the bound name only when its ID is the bound one.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _bound.get()
        if not bound:
            return True
        for kind in KINDS:
            id_key, name_key = f"{kind}_id", f"{kind}_name"
            own_id = getattr(record, id_key, None)
            if own_id is None and getattr(record, name_key, None) is None:
                for key in (id_key, name_key):
                    if key in bound:
                        setattr(record, key, bound[key])
            elif own_id == bound.get(id_key) and name_key in bound:
                if getattr(record, name_key, None) is None:
                    setattr(record, name_key, bound[name_key])
        for key in TRACE_FIELDS:
            if key in bound and getattr(record, key, None) is None:
                setattr(record, key, bound[key])
        return True
