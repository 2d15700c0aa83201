"""What the coordinator reports as it goes, and the figures Status verbose and metrics read.

The coordinator tells an observer about every event and stage change; it keeps no numbers
of its own. `CreationStatistics` is the observer the daemon uses: the counters and stage
timings that `CreationCoordinator.stats()` reports under these names.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Protocol, TypedDict

# Every event counted, present from the start so that a scrape sees zeros.
COUNTERS = (
    "reserved",  # a new name was reserved and its creation started
    "created",  # finished while its request waited: published and returned
    "handed_off",  # a duplicate that waited on the creation was given the finished object
    "timed_out",  # the request's deadline passed before its creation finished
    "client_gone",  # the request was cancelled before its creation finished
    "cached",  # finished after its request had gone: kept for the retry
    "claimed",  # a retry took a cached object
    "returned_existing",  # a retry found its object already visible
    "waiting",  # a duplicate request started watching a creation in flight
    "name_reserved",  # a duplicate request was answered `name is reserved`
    "failed",  # a creation failed (or was abandoned) and was rolled back
    "abandoned",  # keep_on_timeout=False: a creation cancelled because its request gave up
    "expired",  # a cached object was never claimed and was cleaned up
    "cleanup_failed",  # a cleanup raised or overran its budget; the name was released anyway
    "released",  # a name freed after a cleanup
)


class CreationFigures(TypedDict):
    counters: dict[str, int]
    stages_entered: dict[str, int]
    # Seconds spent in each stage by creations that have left it: with stages_entered,
    # the average duration of a stage.
    stage_seconds: dict[str, float]


class InFlightInfo(TypedDict):
    name: str
    object_id: str
    stage: str
    age_seconds: float  # since the name was reserved
    stage_seconds: float  # since the current stage was entered
    watchers: int
    requester_waiting: bool


class CreationStats(CreationFigures):
    kind: str
    stalled_by_stage: dict[str, int]  # in-flight creations, grouped by their current stage
    in_flight: list[InFlightInfo]
    cached: int
    visible: int
    cleaning: int


class CreationObserver(Protocol):
    """Told of each event (one of COUNTERS) and stage change, in the step it happens."""

    def counted(self, event: str) -> None: ...

    def stage_entered(self, stage: str) -> None: ...

    def stage_left(self, stage: str, seconds: float) -> None:
        """A creation left `stage` (for the next one, or by ending) after `seconds`."""

    def figures(self) -> CreationFigures: ...


class CreationStatistics:
    """The default observer: counts events and stages, and sums the time spent in each."""

    def __init__(self) -> None:
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._stages_entered: Counter[str] = Counter()
        self._stage_seconds: defaultdict[str, float] = defaultdict(float)

    def counted(self, event: str) -> None:
        self._counters[event] += 1

    def stage_entered(self, stage: str) -> None:
        self._stages_entered[stage] += 1

    def stage_left(self, stage: str, seconds: float) -> None:
        self._stage_seconds[stage] += seconds

    def figures(self) -> CreationFigures:
        return CreationFigures(
            counters=dict(self._counters),
            stages_entered=dict(self._stages_entered),
            stage_seconds={k: round(v, 6) for k, v in self._stage_seconds.items()},
        )
