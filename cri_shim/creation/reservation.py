"""The held names: which object holds each name, in which phase, and the steps that take
a name and give it back, each persisted through the hooks in the same step.

`HeldNames` is the state every other part of the coordinator shares: the registrar and
the entry of each held name, the hooks, the clock, and the log and count of what happens
(`count`). A name is taken synchronously, before any slow work, so that no other request
can see it free in between (DESIGN §2, rule 1).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from cri_shim import logcontext, tracing
from cri_shim.creation.entry import STAGE_RESERVED, CreationHooks, Entry, NameInfo, Phase
from cri_shim.creation.registrar import NameRegistrar
from cri_shim.creation.statistics import CreationObserver
from cri_shim.errors import FailedPrecondition

log = logging.getLogger("cri_shim.creation")


class HeldNames:
    """Every held name's entry, kept in step with the registrar and the database."""

    def __init__(
        self,
        kind: str,
        hooks: CreationHooks,
        *,
        clock: Callable[[], float],
        new_id: Callable[[], str],
        observer: CreationObserver,
        tracer: tracing.Tracer,
    ) -> None:
        self.kind = kind
        self.hooks = hooks
        self.clock = clock
        self.observer = observer
        self._new_id = new_id
        self._tracer = tracer
        self._registrar = NameRegistrar()
        self._entries: dict[str, Entry] = {}
        # Set by the coordinator's shutdown: nothing is freed or restored from then on.
        self.closing = False

    def get(self, name: str) -> Entry | None:
        return self._entries.get(name)

    def entries(self) -> Iterable[Entry]:
        return self._entries.values()

    def holds(self, entry: Entry) -> bool:
        """Whether `entry` still holds its name (not released, not replaced)."""
        return self._entries.get(entry.name) is entry

    def reserve(self, name: str) -> Entry:
        """Take the free `name` for a new object whose creation starts now."""
        object_id = self._new_id()
        self._registrar.reserve(name, object_id)
        try:
            self.hooks.reserve(name, object_id)
        except BaseException:
            self._registrar.release(name)
            raise
        entry = self._hold(name, object_id, Phase.IN_FLIGHT, STAGE_RESERVED)
        entry.settled = asyncio.Event()
        entry.requester_waiting = True
        entry.trace = self._tracer.creation(self.kind, name, object_id)
        logcontext.bind_object(self.kind, object_id, name)
        self.count("reserved", entry, "reserved, creation started")
        return entry

    def restore(self, name: str, object_id: str, phase: Phase) -> Entry:
        """Hold `name` for an object the database says holds it; persists nothing."""
        self._registrar.reserve(name, object_id)  # NameTaken if the database holds it twice
        entry = self._hold(name, object_id, phase, "restored")
        log.info("%s %r (%s): restored as %s", self.kind, name, object_id, phase)
        return entry

    def _hold(self, name: str, object_id: str, phase: Phase, stage: str) -> Entry:
        now = self.clock()
        entry = Entry(name, object_id, phase, stage, reserved_at=now, stage_since=now)
        self._entries[name] = entry
        return entry

    def visible(self, name: str, object_id: str | None) -> Entry | None:
        """The entry of `name` when it holds `object_id` (any, if None) and is visible;
        None when the name is free or held by another object."""
        entry = self._entries.get(name)
        if entry is None or (object_id is not None and entry.object_id != object_id):
            return None
        if entry.phase is not Phase.VISIBLE:
            raise FailedPrecondition(
                f"{self.kind} {name!r} is {entry.phase} (stage: {entry.stage}), not visible; "
                "only a visible object can be removed"
            )
        return entry

    def release_removed(self, entry: Entry) -> None:
        """The domain removed the visible object: free its name, in memory only."""
        del self._entries[entry.name]
        self._registrar.release(entry.name)
        log.info("%s %r (%s): removed, name released", self.kind, entry.name, entry.object_id)

    def release_after_cleanup(self, entry: Entry) -> None:
        """Free the name (memory, then database) and wake whoever waits on it.

        Skipped at shutdown: a cleanup interrupted there must stay recorded as reserved, so
        that the restart finds it and runs the journal again.
        """
        if self.closing:
            return
        if self.holds(entry):
            del self._entries[entry.name]
        self._registrar.release(entry.name)
        self.count("released", entry, "name released")
        try:
            self.hooks.released(entry.name, entry.object_id)
        except Exception:
            # The name is free in memory; the stale row is found and dropped on restart.
            log.exception("%s %r: persisting the release failed", self.kind, entry.name)
        entry.settle()

    def lookup(self, name: str) -> NameInfo | None:
        entry = self._entries.get(name)
        if entry is None:
            return None
        return NameInfo(entry.name, entry.object_id, entry.phase, entry.stage, entry.expires_at)

    def identify(self, ref: str) -> tuple[str, str] | None:
        """(object ID, name) of the object whose ID is `ref` or starts with it, when one
        does; for the log context of a request that names an object by its ID."""
        name = self._registrar.name_of(ref)
        if name is not None:
            return ref, name
        found = [e for e in self._entries.values() if e.object_id.startswith(ref)] if ref else []
        if len(found) == 1:
            return found[0].object_id, found[0].name
        return None

    def count(self, counter: str, entry: Entry, message: str, level: int = logging.INFO) -> None:
        """Count an event of `entry`'s life, note it in its trace and log it."""
        self.observer.counted(counter)
        entry.trace.counted(counter, entry.stage)
        log.log(level, "%s %r (%s): %s", self.kind, entry.name, entry.object_id, message)
