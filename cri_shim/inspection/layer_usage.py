"""The disk use of containers' writable layers, walked at most once per `max_age` each.

Walking a layer stats every file in it, and kubelet asks for it twice a round (every
~10 s: ListPodSandboxStats, then ListContainerStats), for every container. containerd
refreshes its snapshots' usage every 10 s in the background and answers from that; here
a container's layer is walked when it is asked for and its figure is older than
`[metrics] layer_usage_max_age`, and answered from the last walk otherwise, dated by
that walk (kubelet dates the figure by its timestamp, so an older one is never passed
off as new).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from cri_shim.runtime.stats import LayerUsage, writable_layer_usage


@dataclass(frozen=True, slots=True)
class LayerFigure:
    usage: LayerUsage
    read_at: int  # nanoseconds since the epoch, when the walk began
    walked: float  # on `clock`, when the walk began


class LayerUsageCache:
    """Thread-safe as the worker threads use it: two that miss at once both walk, and
    the later walk's figure stays."""

    def __init__(
        self,
        max_age: float,
        clock: Callable[[], float] = time.monotonic,
        walk: Callable[[Path], LayerUsage] = writable_layer_usage,
    ) -> None:
        self.max_age = max_age
        self._clock = clock
        self._walk = walk
        self._figures: dict[str, LayerFigure] = {}

    def __len__(self) -> int:
        return len(self._figures)

    def usage(self, container_id: str, upper: Path) -> LayerFigure:
        """The container's layer figure, walked now if the last one is `max_age` old."""
        now = self._clock()
        figure = self._figures.get(container_id)
        if figure is not None and now - figure.walked < self.max_age:
            return figure
        read_at = time.time_ns()
        figure = LayerFigure(self._walk(upper), read_at, now)
        self._figures[container_id] = figure
        return figure

    def retain(self, live: Collection[str]) -> None:
        """Forget the figures of containers not in `live` (removed ones)."""
        for container_id in [c for c in list(self._figures) if c not in live]:
            self._figures.pop(container_id, None)
