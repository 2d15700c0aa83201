"""loop_monitor.py: a stall of the event loop is seen and counted in its bucket."""

from __future__ import annotations

import asyncio
import time

from cri_shim.loop_monitor import LoopMonitor
from tests.waiting import until


def test_lags_are_counted_by_bucket() -> None:
    monitor = LoopMonitor(0.01)
    for lag in (0.0002, 0.003, 0.003, 0.02, 0.25, 2.0, -0.001):
        monitor.record(lag)
    assert monitor.samples == 7
    assert monitor.longest == 2.0
    assert monitor.stalls_over(0.001) == 5
    assert monitor.stalls_over(0.1) == 2
    assert monitor.stalls_over(1.0) == 1
    buckets = dict(monitor.cumulative())
    assert buckets["0.001"] == 2 and buckets["0.005"] == 4 and buckets["+Inf"] == 7
    report = monitor.report()
    assert report["longestStallMs"] == 2000.0
    assert report["stallsOverMs"] == {"1": 5, "10": 3, "100": 2, "1000": 1}
    # Given no CPU figure, a lag is all busy.
    assert report["busyStallsOverMs"] == report["stallsOverMs"]


def test_a_lag_the_loop_did_not_spend_on_the_cpu_is_not_busy() -> None:
    monitor = LoopMonitor(0.01)
    monitor.record(0.3, 0.002)  # descheduled, or waiting for another thread
    monitor.record(0.2, 0.5)  # busy is at most the lag
    assert monitor.stalls_over(0.1) == 2
    assert monitor.stalls_over(0.1, busy=True) == 1
    assert monitor.longest_busy == 0.2


def test_a_callback_that_holds_the_loop_is_a_stall() -> None:
    async def scenario() -> LoopMonitor:
        monitor = LoopMonitor(0.005, quiet_interval=0.005)
        task = asyncio.create_task(monitor.run())
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # noqa: ASYNC251 - holds the loop, as blocking work on it would
        await asyncio.sleep(0.05)
        task.cancel()
        return monitor

    monitor = asyncio.run(scenario())
    assert monitor.samples >= 3
    # The sample due during the hold ran at least 0.2 s less one interval late.
    assert monitor.longest >= 0.19
    # One stall, not one per sample it held back (40); a busy host may add one of its own.
    assert 1 <= monitor.stalls_over(0.1) <= 3
    # Sleeping holds the loop without the CPU: a lag, but not a busy one.
    assert monitor.stalls_over(0.1, busy=True) == 0


def test_work_on_the_loop_is_a_busy_stall() -> None:
    async def scenario() -> LoopMonitor:
        monitor = LoopMonitor(0.005, quiet_interval=0.005)
        task = asyncio.create_task(monitor.run())
        await asyncio.sleep(0.05)
        spin_until = time.thread_time() + 0.15
        while time.thread_time() < spin_until:  # 150 ms of the loop thread's own CPU
            pass
        await asyncio.sleep(0.05)
        task.cancel()
        return monitor

    monitor = asyncio.run(scenario())
    assert monitor.stalls_over(0.1, busy=True) == 1
    assert monitor.longest_busy >= 0.14


def test_sampling_pauses_without_calls_and_the_next_call_resumes_it() -> None:
    async def scenario() -> None:
        monitor = LoopMonitor(0.002, idle_after=0.2, quiet_interval=0.002)
        task = asyncio.create_task(monitor.run())
        try:
            await until(lambda: not monitor.sampling)  # no call: it stops after idle_after
            assert monitor.pauses == 1
            paused_at = monitor.samples
            await asyncio.sleep(0.05)
            assert monitor.samples == paused_at  # no wakeups while paused
            monitor.note_call()
            await until(lambda: monitor.samples >= paused_at + 3)
            # Calls keep it sampling: it pauses again only once they stop.
            for _ in range(60):  # 0.24 s and more, a call every 4 ms
                monitor.note_call()
                await asyncio.sleep(0.004)
            assert monitor.pauses == 1
            await until(lambda: not monitor.sampling)
            assert monitor.pauses == 2
            assert monitor.report()["pausedWithoutCalls"] == 2
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_samples_come_at_the_quiet_pace_between_calls_and_often_while_one_is_served() -> None:
    async def scenario() -> None:
        monitor = LoopMonitor(0.005, quiet_interval=0.5)
        task = asyncio.create_task(monitor.run())
        try:
            monitor.note_call()
            await asyncio.sleep(0.2)
            assert monitor.samples == 0  # the first quiet sample is not due yet
            with monitor.serving():  # brought forward: every 5 ms from now on
                await until(lambda: monitor.samples >= 5, timeout=5)
                time.sleep(0.15)  # noqa: ASYNC251 - a stall while a call is served
                await asyncio.sleep(0.02)
            assert monitor.stalls_over(0.1) >= 1
            served = monitor.samples
            await asyncio.sleep(0.2)
            assert monitor.samples <= served + 1  # quiet again
            report = monitor.report()
            assert report["sampleIntervalMs"] == 5 and report["quietSampleIntervalMs"] == 500
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
