"""CPU rates of pods and containers from successive samples of their CPU time."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

# Samples kept for CPU rates; a node runs a few hundred pods at most.
MAX_RATE_SAMPLES = 4096


class CpuRates:
    """`usage_nano_cores` of each pod and container: the CPU time used between its
    previous sample and this one, per second of wall time (kubelet takes the field as is
    when it is set, and computes nothing of its own then). The first sample of an object
    has no rate. At most `max_objects` samples are kept, the least recently sampled going
    first; `retain` drops those of removed objects."""

    def __init__(self, max_objects: int = MAX_RATE_SAMPLES) -> None:
        self._max = max_objects
        self._samples: OrderedDict[str, tuple[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._samples)

    def rate(self, object_id: str, timestamp_ns: int, usage_ns: int) -> int | None:
        previous = self._samples.pop(object_id, None)
        self._samples[object_id] = (timestamp_ns, usage_ns)
        while len(self._samples) > self._max:
            self._samples.popitem(last=False)
        if previous is None:
            return None
        elapsed, used = timestamp_ns - previous[0], usage_ns - previous[1]
        if elapsed <= 0 or used < 0:  # the same instant, or a container of the pod gone
            return None
        return used * 1_000_000_000 // elapsed

    def retain(self, live: Collection[str]) -> None:
        for object_id in [o for o in self._samples if o not in live]:
            del self._samples[object_id]
