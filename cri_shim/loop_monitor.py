"""How long the event loop is held: the daemon's one thread answers every RPC, so any
piece of work that runs on it for long delays every call served beside it.

A task sleeps `[metrics] event_loop_sample_interval` at a time (the interval; see below
for between calls) and records how late it wakes: the lag, which is how long a request
arriving at that moment would have waited for the loop. A stall longer than the interval
is always seen (its length, less at most one interval); shorter ones are sampled.
Reported in Status (verbose) as `eventLoop` and, when the exporter runs, as the histogram
`cri_shim_event_loop_lag_seconds`.

It samples every `interval` while a CRI call is being served, once every
`QUIET_INTERVAL` (a second) between calls, and not at all after `IDLE_AFTER` seconds
without one: the next call (server/rpc.py tells it) starts it again. A lag is what a
request waited, and with none arriving there is nobody to wait. Each sample is a wakeup
of the loop, which on a virtual machine costs the kernel 0.1-0.3 ms: ten a second were a
tenth of what a daemon with 50 pods spent while kubelet polled it (its calls take a
millisecond or two, so they are rarely in flight when a sample is due), and most of what
an idle daemon did. A stall longer than the quiet interval is still always seen; one
between calls and shorter than that, sampled.

A lag has three causes: work on the loop itself (a long callback), a worker thread of
the daemon holding the interpreter, and a machine too busy to run the daemon. The first
is told apart: the loop thread's own CPU time over the late sample, at most the lag, is
its *busy* lag (`longestBusyStallMs`, `busyStallsOverMs`), which a loaded machine does not
inflate.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections.abc import Iterator
from typing import Any

# Upper bounds of the histogram's buckets, seconds.
BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
# Seconds without a CRI call after which sampling stops until the next one.
IDLE_AFTER = 10.0
# Seconds between two samples while no call is being served (at least the interval).
QUIET_INTERVAL = 1.0


class LoopMonitor:
    def __init__(
        self,
        interval: float,
        idle_after: float = IDLE_AFTER,
        quiet_interval: float = QUIET_INTERVAL,
    ) -> None:
        self.interval = interval
        self.idle_after = idle_after
        self.quiet_interval = max(quiet_interval, interval)
        self.pauses = 0  # times sampling stopped for want of calls
        self._called = False
        self._paused: asyncio.Event | None = None  # set by the call that ends the pause
        self._serving = 0  # calls being served now
        # The sample being waited for: its timer, when it is due, the loop thread's CPU
        # time when its wait began.
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._due = 0.0
        self._cpu = 0.0
        self.samples = 0
        self.total_lag = 0.0
        self.longest = 0.0
        # counts[i]: samples with a lag of at most BOUNDS[i] (and over BOUNDS[i-1]); the
        # last one counts those over every bound.
        self.counts = [0] * (len(BOUNDS) + 1)
        self.longest_busy = 0.0
        self.busy_counts = [0] * (len(BOUNDS) + 1)

    def record(self, lag: float, busy: float | None = None) -> None:
        """One sample: the lag, and how much of it the loop thread spent on the CPU
        (None: all of it)."""
        lag = max(lag, 0.0)
        busy = lag if busy is None else min(max(busy, 0.0), lag)
        self.samples += 1
        self.total_lag += lag
        self.longest = max(self.longest, lag)
        self.counts[bisect.bisect_left(BOUNDS, lag)] += 1
        self.longest_busy = max(self.longest_busy, busy)
        self.busy_counts[bisect.bisect_left(BOUNDS, busy)] += 1

    def note_call(self) -> None:
        """A CRI call arrived (called by every one: an attribute and a test)."""
        self._called = True
        if self._paused is not None:
            self._paused.set()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """A call is being served (on the loop's thread): samples come every `interval`
        meanwhile. A sample due later than that is brought forward, its wait begun now."""
        self._serving += 1
        try:
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                loop = asyncio.get_running_loop()
                due = loop.time() + self.interval
                if due < self._due:
                    assert self._timer is not None
                    self._timer.cancel()
                    self._due, self._cpu = due, time.thread_time()
                    self._timer = loop.call_at(due, _wake, waiter)
            yield
        finally:
            self._serving -= 1

    @property
    def sampling(self) -> bool:
        return self._paused is None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        last_call = loop.time()
        while True:
            pace = self.interval if self._serving else self.quiet_interval
            self._due = loop.time() + pace
            self._cpu = time.thread_time()
            self._waiter = waiter = loop.create_future()
            self._timer = loop.call_at(self._due, _wake, waiter)
            try:
                await waiter
            finally:
                self._timer.cancel()
                self._timer = self._waiter = None
            now = loop.time()
            self.record(now - self._due, time.thread_time() - self._cpu)
            if self._called:
                self._called = False
                last_call = now
            elif now - last_call >= self.idle_after and not self._serving:
                self.pauses += 1
                self._paused = asyncio.Event()
                await self._paused.wait()
                self._paused = None
                self._called = False
                last_call = loop.time()

    def stalls_over(self, bound: float, *, busy: bool = False) -> int:
        """Samples whose lag (busy lag) was over `bound` (one of BOUNDS)."""
        counts = self.busy_counts if busy else self.counts
        return sum(counts[BOUNDS.index(bound) + 1 :])

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, samples at or under it) as a Prometheus histogram has them."""
        buckets = []
        running = 0
        for bound, count in zip(BOUNDS, self.counts, strict=False):
            running += count
            buckets.append((str(bound), running))
        buckets.append(("+Inf", self.samples))
        return buckets

    def report(self) -> dict[str, Any]:
        """What Status (verbose) shows, in milliseconds."""
        shown = (0.001, 0.01, 0.1, 1.0)
        return {
            "sampleIntervalMs": round(self.interval * 1000, 3),
            "quietSampleIntervalMs": round(self.quiet_interval * 1000, 3),
            "samples": self.samples,
            "pausedWithoutCalls": self.pauses,
            "longestStallMs": round(self.longest * 1000, 3),
            "stallsOverMs": {f"{bound * 1000:g}": self.stalls_over(bound) for bound in shown},
            "longestBusyStallMs": round(self.longest_busy * 1000, 3),
            "busyStallsOverMs": {
                f"{bound * 1000:g}": self.stalls_over(bound, busy=True) for bound in shown
            },
        }


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
