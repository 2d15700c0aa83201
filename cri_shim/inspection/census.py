"""The daemon's own counts, read when asked: creation counters and stalled creations
per kind, visible objects by state, and the event loop's lag. Status (verbose), the
admission of creations and the Prometheus endpoint all read them here."""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

from cri_shim.creation.statistics import CreationStats
from cri_shim.loop_monitor import LoopMonitor


class Coordinator(Protocol):
    def stats(self) -> CreationStats: ...


class Objects(Protocol):
    """A lifecycle as counted here: its creation coordinator and its visible objects."""

    @property
    def coordinator(self) -> Coordinator: ...

    def list(self) -> list[Any]: ...


class Census:
    def __init__(
        self, sandboxes: Objects, containers: Objects, loop_monitor: LoopMonitor | None = None
    ) -> None:
        self._sandboxes = sandboxes
        self._containers = containers
        # None with `[metrics] event_loop_sample_interval = 0`.
        self.loop_monitor = loop_monitor

    def creation_stats(self) -> dict[str, CreationStats]:
        """Each kind's coordinator statistics (counters, stages, in flight, cached)."""
        return {
            "sandbox": self._sandboxes.coordinator.stats(),
            "container": self._containers.coordinator.stats(),
        }

    def creations_in_flight(self) -> int:
        return sum(len(stats["in_flight"]) for stats in self.creation_stats().values())

    def sandboxes_by_state(self) -> Counter[str]:
        return Counter(s.state for s in self._sandboxes.list())

    def containers_by_state(self) -> Counter[str]:
        # list() picks up exits conmon recorded since the last look, so the states are now's.
        return Counter(c.state for c in self._containers.list())
