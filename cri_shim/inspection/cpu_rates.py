"""CPU rates of pods and containers from successive samples of their CPU time."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

# Samples kept for CPU rates; a node runs a few hundred pods at most.
MAX_RATE_SAMPLES = 4096
# The shortest stretch of time a rate is measured over. kubelet asks for stats on its own
# schedule and again for each /stats/summary request, often a few milliseconds apart: over
# so short a stretch a container that sleeps between small bursts of work shows no CPU
# used at all (and Kubernetes' Summary API spec wants a rate above zero for such a one).
MIN_RATE_WINDOW_NS = 1_000_000_000


class CpuRates:
    """`usage_nano_cores` of each pod and container: the CPU time used since its reference
    sample, per second of wall time (kubelet takes the field as is when it is set, and
    computes nothing of its own then). A sample taken at least MIN_RATE_WINDOW_NS after the
    reference gives a new rate and becomes the reference; one taken sooner gives the last
    rate (or, before there is one, the rate over the shorter stretch) and leaves the
    reference as it is. The first sample of an object has no rate. At most `max_objects`
    objects are kept, the least recently sampled going first; `retain` drops those of
    removed objects."""

    def __init__(self, max_objects: int = MAX_RATE_SAMPLES) -> None:
        self._max = max_objects
        # object -> (reference timestamp, reference CPU time, the last rate)
        self._samples: OrderedDict[str, tuple[int, int, int | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._samples)

    def rate(self, object_id: str, timestamp_ns: int, usage_ns: int) -> int | None:
        previous = self._samples.pop(object_id, None)
        result, kept = self._next(previous, timestamp_ns, usage_ns)
        self._samples[object_id] = kept
        while len(self._samples) > self._max:
            self._samples.popitem(last=False)
        return result

    @staticmethod
    def _next(
        previous: tuple[int, int, int | None] | None, timestamp_ns: int, usage_ns: int
    ) -> tuple[int | None, tuple[int, int, int | None]]:
        """The rate to report, and what to keep for the next sample."""
        fresh = (timestamp_ns, usage_ns, None)
        if previous is None:
            return None, fresh
        since, used_before, last = previous
        elapsed, used = timestamp_ns - since, usage_ns - used_before
        if used < 0:  # a pod's sum falls when one of its containers is gone: start afresh
            return None, fresh
        if elapsed >= MIN_RATE_WINDOW_NS:
            rate = used * 1_000_000_000 // elapsed
            return rate, (timestamp_ns, usage_ns, rate)
        if last is not None:
            return last, previous
        return (used * 1_000_000_000 // elapsed if elapsed > 0 else None), previous

    def retain(self, live: Collection[str]) -> None:
        for object_id in [o for o in self._samples if o not in live]:
            del self._samples[object_id]
