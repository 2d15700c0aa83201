"""The creation contract of DESIGN §2, rule by rule, with fake creators and fake hooks.

Most tests run on a virtual-time loop (see creation_fakes): a 120-second claim grace costs
nothing and "returned at t=2.0, well before its deadline at t=100" is exact. Two tests run
on pytest-asyncio's ordinary loop with the default clock, to show nothing depends on the
virtual one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import pytest
from creation_fakes import (
    CleanupPlan,
    FakeCreationFailed,
    FakeCreator,
    FakeHooks,
    advance_to,
    in_virtual_time,
    now,
)

from cri_shim.creation.coordinator import CreationCoordinator, Phase, Stage
from cri_shim.creation.registrar import NameTaken
from cri_shim.creation.statistics import COUNTERS, CreationStatistics
from cri_shim.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    NameReserved,
    Unavailable,
)

NAME = "k8s_POD_nginx_default_uid-1_0"
GRACE = 120.0


def make(hooks: FakeHooks | None = None, **options: Any) -> tuple[CreationCoordinator, FakeHooks]:
    hooks = hooks if hooks is not None else FakeHooks()
    ids = (f"id{n}" for n in itertools.count(1))
    options.setdefault("claim_grace", GRACE)
    coordinator = CreationCoordinator("sandbox", hooks, new_id=lambda: next(ids), **options)
    return coordinator, hooks


async def outcome(call: Any) -> tuple[Any, float]:
    """The result or exception of an awaitable, and the (virtual) time it came back."""
    try:
        result: Any = await call
    except Exception as exc:
        result = exc
    return result, now()


# ---- 1. a new name: reserve, create detached, publish or cache -------------------------


@in_virtual_time
async def test_done_in_time_the_object_is_published_and_its_id_returned() -> None:
    coordinator, hooks = make()
    creator = FakeCreator(steps=[("sandbox storage", 1.0), ("sandbox network", 2.0)])

    object_id, at = await outcome(coordinator.create(NAME, 10.0, creator))

    assert (object_id, at) == ("id1", 3.0)
    assert [h for h, _, _ in hooks.calls] == [
        "reserve",
        "stage_changed",
        "stage_changed",
        "publish",
    ]
    assert hooks.rows["id1"].phase == "visible"
    info = coordinator.lookup(NAME)
    assert info is not None and info.phase is Phase.VISIBLE
    assert coordinator.stats()["counters"]["created"] == 1
    await coordinator.aclose()


@in_virtual_time
async def test_a_visible_object_keeps_no_event_however_it_became_visible() -> None:
    # Nothing waits on a visible name again: an event kept is ~1 KiB for each object held.
    coordinator, _ = make()
    slow = FakeCreator(steps=[("sandbox network", 2.0)])
    in_time, handed_off, claimed = (f"k8s_POD_p{n}_default_uid-{n}_0" for n in range(3))
    assert await coordinator.create(in_time, 10.0, FakeCreator()) == "id1"
    timed_out, _ = await outcome(coordinator.create(handed_off, 1.0, slow))
    assert isinstance(timed_out, DeadlineExceeded)
    assert await coordinator.create(handed_off, 10.0, slow) == "id2"  # waited, handed off
    timed_out, _ = await outcome(coordinator.create(claimed, 4.0, slow))
    assert isinstance(timed_out, DeadlineExceeded)
    await advance_to(10.0)  # finished meanwhile: in the cache
    assert coordinator.lookup(claimed).phase is Phase.CACHED  # type: ignore[union-attr]
    assert await coordinator.create(claimed, 20.0, slow) == "id3"
    for name in (in_time, handed_off, claimed):
        entry = coordinator._names.get(name)
        assert entry is not None
        assert entry.phase is Phase.VISIBLE
        assert (entry.settled, entry.claimed) == (None, None)
    await coordinator.aclose()


@in_virtual_time
async def test_the_name_is_reserved_before_the_request_first_yields() -> None:
    coordinator, hooks = make()
    creator = FakeCreator()
    task = asyncio.create_task(coordinator.create(NAME, 10.0, creator))
    await asyncio.sleep(0)  # one step of the request: up to its first await

    info = coordinator.lookup(NAME)
    assert info is not None and info.phase is Phase.IN_FLIGHT
    assert hooks.count("reserve") == 1
    assert creator.calls == []  # the slow work has not even started
    await task
    await coordinator.aclose()


@in_virtual_time
async def test_a_failing_reserve_hook_leaves_the_name_free() -> None:
    coordinator, hooks = make(FakeHooks(fail_reserve=RuntimeError("database is locked")))
    with pytest.raises(RuntimeError):
        await coordinator.create(NAME, 10.0, FakeCreator())
    assert coordinator.lookup(NAME) is None
    hooks.fail_reserve = None
    assert await coordinator.create(NAME, 10.0, FakeCreator()) == "id2"
    await coordinator.aclose()


@in_virtual_time
async def test_kubelet_retry_sequence_timeout_then_the_waiting_retry_gets_the_object() -> None:
    coordinator, hooks = make()
    creator = FakeCreator(steps=[("sandbox network", 6.0)])

    # 1st request: its deadline passes at t=4, the creation goes on.
    first, at = await outcome(coordinator.create(NAME, 4.0, creator))
    assert isinstance(first, DeadlineExceeded) and at == 4.0
    assert "continues in the background" in str(first)
    assert "stage: sandbox network" in str(first)

    # 2nd request (deadline t=8): waits; the creation finishes at t=6 and is handed to it
    # then, without going through the cache.
    second, at = await outcome(coordinator.create(NAME, 8.0, creator))
    assert (second, at) == ("id1", 6.0)
    assert hooks.count("publish", "id1") == 1 and hooks.count("cached") == 0
    assert hooks.rows["id1"].phase == "visible"

    # Its response lost on the way, the 3rd request gets the same object at once.
    third, at = await outcome(coordinator.create(NAME, 20.0, creator))
    assert (third, at) == ("id1", 6.0)
    assert creator.calls == ["id1"]
    assert hooks.count("publish") == 1
    counters = coordinator.stats()["counters"]
    assert (counters["timed_out"], counters["handed_off"], counters["name_reserved"]) == (1, 1, 0)
    assert (counters["cached"], counters["claimed"], counters["returned_existing"]) == (0, 0, 1)
    await advance_to(10_000.0)
    assert hooks.count("cleanup") == 0  # handed off: never expires
    await coordinator.aclose()


@in_virtual_time
async def test_without_hand_off_the_waiting_retry_is_refused_and_the_next_claims() -> None:
    coordinator, hooks = make(hand_off=False)
    creator = FakeCreator(steps=[("sandbox network", 6.0)])

    # 1st request: its deadline passes at t=4, the creation goes on.
    first, at = await outcome(coordinator.create(NAME, 4.0, creator))
    assert isinstance(first, DeadlineExceeded) and at == 4.0

    # 2nd request (deadline t=8): waits, and is refused even though the creation finished
    # at t=6 while it waited (CRI-O's answer); it comes back at once then, not at its deadline.
    second, at = await outcome(coordinator.create(NAME, 8.0, creator))
    assert isinstance(second, NameReserved) and at == 6.0
    assert "reserved for id1" in str(second) and "stage: sandbox network" in str(second)
    assert hooks.rows["id1"].phase == "cached"
    assert hooks.count("publish") == 0

    # 3rd request: claims the cached object immediately.
    third, at = await outcome(coordinator.create(NAME, 10.0, creator))
    assert (third, at) == ("id1", 6.0)
    assert creator.calls == ["id1"]
    assert hooks.count("publish", "id1") == 1
    assert hooks.rows["id1"].phase == "visible"
    counters = coordinator.stats()["counters"]
    assert (counters["timed_out"], counters["name_reserved"], counters["claimed"]) == (1, 1, 1)
    assert counters["handed_off"] == 0
    await coordinator.aclose()


@in_virtual_time
async def test_a_cancelled_request_leaves_its_creation_running_into_the_cache() -> None:
    coordinator, hooks = make()
    creator = FakeCreator(steps=[("sandbox network", 5.0)])
    request = asyncio.create_task(coordinator.create(NAME, 30.0, creator))
    await advance_to(1.0)
    request.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await request

    await advance_to(6.0)
    assert creator.cancelled == [] and creator.finished == ["id1"]
    assert hooks.rows["id1"].phase == "cached"
    # Its deadline (t=30) still counts: the expiry is 30 + grace, not 5 + grace.
    assert hooks.rows["id1"].expires_at == 30.0 + GRACE
    assert coordinator.stats()["counters"]["client_gone"] == 1
    assert await coordinator.create(NAME, 40.0, creator) == "id1"
    await coordinator.aclose()


# ---- 2. duplicates of a creation in flight -----------------------------------------------


@in_virtual_time
async def test_a_duplicate_waits_until_its_own_deadline_and_is_told_the_stage() -> None:
    coordinator, _ = make()
    creator = FakeCreator(steps=[("sandbox storage", 1.0), ("sandbox network", 60.0)])
    owner = asyncio.create_task(coordinator.create(NAME, 100.0, creator))
    await advance_to(2.0)

    refused, at = await outcome(coordinator.create(NAME, 7.0, creator))

    assert isinstance(refused, NameReserved) and at == 7.0
    assert str(refused) == (
        f"name {NAME!r} is reserved for id1: creation in progress (stage: sandbox network); "
        "retry to get it once done"
    )
    assert await owner == "id1"
    await coordinator.aclose()


@in_virtual_time
async def test_a_duplicate_whose_deadline_passes_first_is_refused_and_the_object_cached() -> None:
    coordinator, hooks = make()
    creator = FakeCreator(steps=[("sandbox network", 10.0)])
    with pytest.raises(DeadlineExceeded):
        await coordinator.create(NAME, 2.0, creator)

    refused, at = await outcome(coordinator.create(NAME, 6.0, creator))

    assert isinstance(refused, NameReserved) and at == 6.0
    await advance_to(11.0)
    assert hooks.rows["id1"].phase == "cached" and hooks.count("publish") == 0
    assert await coordinator.create(NAME, 20.0, creator) == "id1"  # claimed
    await coordinator.aclose()


@in_virtual_time
async def test_every_duplicate_waiting_at_the_finish_gets_the_object() -> None:
    coordinator, hooks = make()
    creator = FakeCreator(steps=[("sandbox network", 10.0)])
    with pytest.raises(DeadlineExceeded):
        await coordinator.create(NAME, 2.0, creator)
    early = asyncio.create_task(outcome(coordinator.create(NAME, 5.0, creator)))
    late = [asyncio.create_task(outcome(coordinator.create(NAME, d, creator))) for d in (30, 40)]
    endless = asyncio.create_task(outcome(coordinator.create(NAME, None, creator)))

    refused, at = await early
    assert isinstance(refused, NameReserved) and at == 5.0
    for waiter in (*late, endless):
        assert await waiter == ("id1", 10.0)
    assert hooks.count("publish") == 1 and hooks.count("cached") == 0
    assert coordinator.stats()["counters"]["handed_off"] == 3
    await coordinator.aclose()


class LosesTheHandOff(FakeHooks):
    """Cancels `victim` as the object is published: the response to the request it was
    handed to is lost on the way (its client gave up in that very instant)."""

    victim: asyncio.Task[Any] | None = None

    def publish(self, object_id: str) -> None:
        super().publish(object_id)
        if self.victim is not None:
            self.victim.cancel()


@in_virtual_time
async def test_a_hand_off_whose_response_is_lost_is_recovered_by_the_next_retry() -> None:
    hooks = LosesTheHandOff()
    coordinator, _ = make(hooks)
    creator = FakeCreator(steps=[("sandbox network", 10.0)])
    with pytest.raises(DeadlineExceeded):
        await coordinator.create(NAME, 2.0, creator)
    hooks.victim = asyncio.create_task(coordinator.create(NAME, 30.0, creator))
    with pytest.raises(asyncio.CancelledError):
        await hooks.victim

    # Nobody got the ID, but the object is visible, not cached: it cannot expire, and the
    # next retry gets it.
    assert hooks.rows["id1"].phase == "visible" and hooks.count("cached") == 0
    assert await coordinator.create(NAME, 40.0, creator) == "id1"
    await advance_to(10_000.0)
    assert hooks.count("cleanup") == 0
    assert creator.calls == ["id1"]
    await coordinator.aclose()


@in_virtual_time
async def test_a_cancelled_duplicate_does_not_keep_the_object_from_the_cache() -> None:
    coordinator, hooks = make()
    creator = FakeCreator(steps=[("sandbox network", 10.0)])
    with pytest.raises(DeadlineExceeded):
        await coordinator.create(NAME, 2.0, creator)
    watcher = asyncio.create_task(coordinator.create(NAME, 30.0, creator))
    await advance_to(3.0)
    watcher.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await watcher

    await advance_to(11.0)
    assert hooks.rows["id1"].phase == "cached" and hooks.count("publish") == 0
    assert hooks.rows["id1"].expires_at == 30.0 + GRACE  # its deadline still counts
    assert await coordinator.create(NAME, 40.0, creator) == "id1"
    await coordinator.aclose()


@in_virtual_time
async def test_twenty_concurrent_identical_requests_make_one_creation() -> None:
    coordinator, hooks = make()
    creator = FakeCreator(steps=[("sandbox network", 1.0)])

    results = await asyncio.gather(
        *(coordinator.create(NAME, 30.0, creator) for _ in range(20)), return_exceptions=True
    )

    assert creator.calls == ["id1"]
    assert hooks.count("reserve") == 1 and hooks.count("publish") == 1
    # The one that created it got it, and so did the 19 that waited on it.
    assert results == ["id1"] * 20
    assert coordinator.stats()["counters"]["handed_off"] == 19
    assert await coordinator.create(NAME, 40.0, creator) == "id1"
    await coordinator.aclose()


@in_virtual_time
async def test_without_hand_off_twenty_concurrent_requests_get_one_id_and_19_refusals() -> None:
    coordinator, hooks = make(hand_off=False)
    creator = FakeCreator(steps=[("sandbox network", 1.0)])

    results = await asyncio.gather(
        *(coordinator.create(NAME, 30.0, creator) for _ in range(20)), return_exceptions=True
    )

    assert creator.calls == ["id1"] and hooks.count("publish") == 1
    assert results.count("id1") == 1
    assert sum(isinstance(r, NameReserved) for r in results) == 19
    # The one that created it got it; anyone asking again gets the same object.
    assert await coordinator.create(NAME, 40.0, creator) == "id1"
    await coordinator.aclose()


@in_virtual_time
async def test_a_failure_wakes_waiting_duplicates_at_once_with_its_error() -> None:
    coordinator, hooks = make()
    error = FakeCreationFailed("CNI ADD failed: no IP addresses available")
    creator = FakeCreator(steps=[("sandbox network", 2.0)], error=error)
    owner = asyncio.create_task(outcome(coordinator.create(NAME, 100.0, creator)))
    await advance_to(1.0)

    woken, at = await outcome(coordinator.create(NAME, 100.0, creator))

    assert woken is error and at == 2.0  # not at its deadline, t=100
    assert await owner == (error, 2.0)
    # Undone and released before anyone was told: a retry on the error finds the name free.
    assert hooks.cleanup_ended["id1"] == 1
    assert hooks.released_names == [(NAME, "id1")]
    assert coordinator.lookup(NAME) is None
    assert await coordinator.create(NAME, 10.0, FakeCreator()) == "id2"
    await coordinator.aclose()


async def test_on_the_real_loop_a_failure_wakes_a_waiter_well_before_its_deadline() -> None:
    coordinator = CreationCoordinator("sandbox", FakeHooks())
    creator = FakeCreator(steps=[("sandbox network", 0.05)], error=FakeCreationFailed("boom"))
    loop = asyncio.get_running_loop()
    owner = asyncio.create_task(coordinator.create(NAME, loop.time() + 60.0, creator))
    await asyncio.sleep(0)

    started = time.monotonic()
    with pytest.raises(FakeCreationFailed):
        await coordinator.create(NAME, loop.time() + 60.0, creator)
    assert time.monotonic() - started < 10  # its deadline is a minute away
    with pytest.raises(FakeCreationFailed):
        await owner
    await coordinator.aclose()


async def test_on_the_real_loop_timeout_then_handed_off_well_before_the_deadline() -> None:
    coordinator = CreationCoordinator("sandbox", FakeHooks())
    creator = FakeCreator(steps=[("sandbox network", 0.2)])
    loop = asyncio.get_running_loop()
    with pytest.raises(DeadlineExceeded):
        await coordinator.create(NAME, loop.time() + 0.05, creator)
    started = time.monotonic()
    object_id = await coordinator.create(NAME, loop.time() + 60.0, creator)
    assert time.monotonic() - started < 10  # its deadline is a minute away
    assert creator.calls == [object_id]
    assert await coordinator.create(NAME, loop.time() + 60.0, creator) == object_id
    await coordinator.aclose()


async def test_on_the_real_loop_without_hand_off_timeout_then_reserved_then_claimed() -> None:
    coordinator = CreationCoordinator("sandbox", FakeHooks(), hand_off=False)
    release = asyncio.Event()
    calls: list[str] = []

    async def creator(object_id: str, stage: Stage) -> None:
        calls.append(object_id)
        stage.set("sandbox network")
        await release.wait()  # finishes when the test says, however slow the machine

    loop = asyncio.get_running_loop()
    with pytest.raises(DeadlineExceeded):
        await coordinator.create(NAME, loop.time() + 0.05, creator)
    duplicate = asyncio.create_task(coordinator.create(NAME, loop.time() + 60.0, creator))
    await asyncio.sleep(0)  # the duplicate waits on the creation
    release.set()
    with pytest.raises(NameReserved):
        await duplicate
    object_id = await coordinator.create(NAME, loop.time() + 60.0, creator)
    assert calls == [object_id]
    await coordinator.aclose()


# ---- 3./4. cached and visible names -----------------------------------------------------


@in_virtual_time
async def test_a_visible_object_is_returned_again_to_the_same_request() -> None:
    coordinator, hooks = make()
    creator = FakeCreator()
    first = await coordinator.create(NAME, 10.0, creator)
    again, at = await outcome(coordinator.create(NAME, 20.0, creator))
    assert again == first and at == 1.0  # at once
    assert creator.calls == [first]
    assert hooks.count("publish") == 1
    assert coordinator.stats()["counters"]["returned_existing"] == 1
    await coordinator.aclose()


@in_virtual_time
async def test_a_claimed_object_is_never_cleaned_up() -> None:
    coordinator, hooks = make()
    creator = FakeCreator(steps=[("sandbox network", 5.0)])
    with pytest.raises(DeadlineExceeded):
        await coordinator.create(NAME, 1.0, creator)
    await advance_to(50.0)
    assert await coordinator.create(NAME, 60.0, creator) == "id1"

    await advance_to(10_000.0)

    assert hooks.count("cleanup") == 0
    info = coordinator.lookup(NAME)
    assert info is not None and info.phase is Phase.VISIBLE
    await coordinator.aclose()


# ---- expiry --------------------------------------------------------------------------------


@in_virtual_time
async def test_expiry_starts_after_the_last_waiters_deadline_plus_grace() -> None:
    # Without the hand-off, so that a waiter can outlast the creation and still be refused
    # (with it, a waiter outlasting the creation is given the object; a cancelled one still
    # counts, as test_a_cancelled_duplicate_does_not_keep_the_object_from_the_cache shows).
    coordinator, hooks = make(hand_off=False)
    creator = FakeCreator(steps=[("sandbox network", 10.0)])
    owner = asyncio.create_task(outcome(coordinator.create(NAME, 2.0, creator)))
    await advance_to(2.0)
    early = asyncio.create_task(outcome(coordinator.create(NAME, 5.0, creator)))
    late = asyncio.create_task(outcome(coordinator.create(NAME, 40.0, creator)))
    assert isinstance((await owner)[0], DeadlineExceeded)
    assert isinstance((await early)[0], NameReserved)
    assert isinstance((await late)[0], NameReserved)

    # Finished at t=10, but the last waiter's deadline is t=40: expiry at 40 + 120.
    assert hooks.rows["id1"].expires_at == 160.0
    await advance_to(159.0)
    assert hooks.count("cleanup") == 0
    info = coordinator.lookup(NAME)
    assert info is not None and info.phase is Phase.CACHED and info.expires_at == 160.0

    await advance_to(161.0)
    assert hooks.first_time("cleanup", "id1") == 160.0
    assert hooks.cleanup_ended["id1"] == 1
    assert hooks.released_names == [(NAME, "id1")]
    assert coordinator.lookup(NAME) is None
    await advance_to(10_000.0)
    assert hooks.count("cleanup") == 1  # exactly once
    assert coordinator.stats()["counters"]["expired"] == 1
    await coordinator.aclose()


@in_virtual_time
async def test_an_object_finished_after_every_deadline_expires_grace_after_finishing() -> None:
    coordinator, hooks = make()
    with pytest.raises(DeadlineExceeded):
        await coordinator.create(NAME, 1.0, FakeCreator(steps=[("sandbox network", 30.0)]))
    await advance_to(31.0)
    assert hooks.rows["id1"].expires_at == 30.0 + GRACE
    await coordinator.aclose()


@in_virtual_time
async def test_a_request_during_expiry_cleanup_waits_for_the_name_to_be_free() -> None:
    hooks = FakeHooks(default_cleanup=CleanupPlan(seconds=3.0))
    coordinator, _ = make(hooks)
    with pytest.raises(DeadlineExceeded):
        await coordinator.create(NAME, 1.0, FakeCreator(steps=[("sandbox network", 2.0)]))
    # Finished at t=2, after its request's deadline: expiry at 2 + 120, cleanup until 125.
    await advance_to(123.0)

    refused, at = await outcome(coordinator.create(NAME, 200.0, FakeCreator()))

    assert isinstance(refused, NameReserved) and "stage: cleanup" in str(refused)
    assert at == 125.0
    assert await coordinator.create(NAME, 200.0, FakeCreator()) == "id2"
    await coordinator.aclose()


# ---- 5./6. failure and cleanup ---------------------------------------------------------------


@in_virtual_time
async def test_a_failed_creation_is_cleaned_up_then_released_and_the_requester_told() -> None:
    coordinator, hooks = make()
    error = FakeCreationFailed("runc create failed")
    failed, at = await outcome(coordinator.create(NAME, 10.0, FakeCreator(error=error)))
    assert failed is error and at == 1.0
    assert [h for h, _, _ in hooks.calls] == ["reserve", "stage_changed", "cleanup", "released"]
    assert hooks.rows == {}
    assert coordinator.stats()["counters"]["failed"] == 1


@in_virtual_time
async def test_a_failing_cleanup_still_releases_the_name(caplog: pytest.LogCaptureFixture) -> None:
    hooks = FakeHooks(default_cleanup=CleanupPlan(error=OSError("umount: target is busy")))
    coordinator, _ = make(hooks)
    error = FakeCreationFailed("CNI ADD failed")
    with caplog.at_level(logging.ERROR, logger="cri_shim.creation"):
        failed, _ = await outcome(coordinator.create(NAME, 10.0, FakeCreator(error=error)))
    assert failed is error  # the client hears of the creation's failure, not the cleanup's
    assert hooks.released_names == [(NAME, "id1")]
    assert coordinator.lookup(NAME) is None
    assert coordinator.stats()["counters"]["cleanup_failed"] == 1
    assert "umount: target is busy" in caplog.text and NAME in caplog.text
    await coordinator.aclose()


@in_virtual_time
async def test_a_hanging_cleanup_is_cut_off_by_its_budget_and_the_name_released() -> None:
    hooks = FakeHooks(default_cleanup=CleanupPlan(hangs=True))
    coordinator, _ = make(hooks, cleanup_timeout=30.0)
    error = FakeCreationFailed("boom")
    failed, at = await outcome(coordinator.create(NAME, 100.0, FakeCreator(error=error)))
    assert failed is error and at == 31.0
    assert hooks.released_names == [(NAME, "id1")]
    assert coordinator.stats()["counters"]["cleanup_failed"] == 1
    await coordinator.aclose()


@in_virtual_time
async def test_a_failing_expiry_cleanup_still_releases_the_name() -> None:
    hooks = FakeHooks(default_cleanup=CleanupPlan(error=OSError("netns busy")))
    coordinator, _ = make(hooks)
    with pytest.raises(DeadlineExceeded):
        await coordinator.create(NAME, 0.5, FakeCreator())
    await advance_to(1.0 + GRACE + 1.0)
    assert hooks.released_names == [(NAME, "id1")]
    assert coordinator.lookup(NAME) is None
    await coordinator.aclose()


@in_virtual_time
async def test_a_failing_publish_undoes_the_creation() -> None:
    hooks = FakeHooks(fail_publish=RuntimeError("disk I/O error"))
    coordinator, _ = make(hooks)
    with pytest.raises(RuntimeError, match="disk I/O error"):
        await coordinator.create(NAME, 10.0, FakeCreator())
    assert hooks.cleanup_ended["id1"] == 1
    assert coordinator.lookup(NAME) is None
    await coordinator.aclose()


@in_virtual_time
async def test_a_failing_release_hook_is_logged_and_waiters_still_woken(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hooks = FakeHooks(fail_released=RuntimeError("database is locked"))
    coordinator, _ = make(hooks)
    error = FakeCreationFailed("boom")
    with caplog.at_level(logging.ERROR, logger="cri_shim.creation"):
        failed, at = await outcome(coordinator.create(NAME, 10.0, FakeCreator(error=error)))
    assert failed is error and at == 1.0
    assert coordinator.lookup(NAME) is None
    assert "database is locked" in caplog.text
    await coordinator.aclose()


# ---- 7. keep_on_timeout=False (containerd-like) ----------------------------------------------


@in_virtual_time
async def test_without_keep_on_timeout_a_timed_out_creation_is_cancelled_and_undone() -> None:
    coordinator, hooks = make(keep_on_timeout=False)
    creator = FakeCreator(steps=[("sandbox network", 10.0)])

    failed, at = await outcome(coordinator.create(NAME, 3.0, creator))

    assert isinstance(failed, DeadlineExceeded) and at == 3.0
    assert "abandoned" in str(failed)
    await advance_to(4.0)
    assert creator.cancelled == ["id1"]
    assert hooks.cleanup_ended["id1"] == 1
    assert hooks.released_names == [(NAME, "id1")]
    assert hooks.count("cached") == 0
    assert coordinator.lookup(NAME) is None
    # The retry starts over.
    assert await coordinator.create(NAME, 100.0, creator) == "id2"
    assert creator.calls == ["id1", "id2"]
    await coordinator.aclose()


@in_virtual_time
async def test_without_keep_on_timeout_duplicates_are_refused_without_waiting() -> None:
    coordinator, _ = make(keep_on_timeout=False)
    creator = FakeCreator(steps=[("sandbox network", 10.0)])
    owner = asyncio.create_task(coordinator.create(NAME, 100.0, creator))
    await advance_to(1.0)

    refused, at = await outcome(coordinator.create(NAME, 50.0, creator))

    assert isinstance(refused, NameReserved) and at == 1.0
    assert await owner == "id1"
    await coordinator.aclose()


@in_virtual_time
async def test_without_keep_on_timeout_a_cancelled_request_cancels_its_creation() -> None:
    coordinator, hooks = make(keep_on_timeout=False)
    creator = FakeCreator(steps=[("sandbox network", 10.0)])
    request = asyncio.create_task(coordinator.create(NAME, None, creator))
    await advance_to(1.0)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    await advance_to(2.0)
    assert creator.cancelled == ["id1"]
    assert hooks.released_names == [(NAME, "id1")]
    await coordinator.aclose()


class CreatorFinishingDespiteCancel(FakeCreator):
    """Catches its cancellation and goes on: `after` more seconds, then returns."""

    def __init__(self, after: float) -> None:
        super().__init__(steps=[("sandbox network", 10.0)])
        self.after = after

    async def __call__(self, object_id: str, stage: Stage) -> None:
        try:
            await super().__call__(object_id, stage)
        except asyncio.CancelledError:
            await asyncio.sleep(self.after)
            self.finished.append(object_id)


@in_virtual_time
async def test_without_keep_on_timeout_a_creator_finishing_despite_its_cancel_is_undone() -> None:
    hooks = FakeHooks(default_cleanup=CleanupPlan(hangs=True))
    coordinator, _ = make(hooks, keep_on_timeout=False, cleanup_timeout=30.0)
    creator = CreatorFinishingDespiteCancel(after=1.0)

    failed, at = await outcome(coordinator.create(NAME, 3.0, creator))

    assert isinstance(failed, DeadlineExceeded) and at == 3.0
    await advance_to(5.0)
    assert creator.finished == ["id1"]
    assert hooks.count("publish") == 0
    # The cleanup's own budget still cuts it off: the cancel was taken back.
    await advance_to(40.0)
    assert hooks.released_names == [(NAME, "id1")]
    await coordinator.aclose()


@in_virtual_time
async def test_shutdown_during_an_abandoned_creators_cancel_ends_its_life() -> None:
    coordinator, hooks = make(keep_on_timeout=False)
    creator = CreatorFinishingDespiteCancel(after=100.0)
    failed, _ = await outcome(coordinator.create(NAME, 3.0, creator))
    assert isinstance(failed, DeadlineExceeded)
    await advance_to(4.0)

    await coordinator.aclose()

    assert creator.finished == []
    assert hooks.count("cleanup") == 0 and hooks.released_names == []
    assert asyncio.all_tasks() == {asyncio.current_task()}


# ---- release and restore ----------------------------------------------------------------------


@in_virtual_time
async def test_release_frees_a_visible_name_and_guards_the_rest() -> None:
    coordinator, hooks = make()
    first = await coordinator.create(NAME, 10.0, FakeCreator())

    coordinator.release(NAME, object_id="stale-id")  # a late release of an older object
    assert coordinator.lookup(NAME) is not None
    coordinator.release(NAME, object_id=first)
    coordinator.release(NAME)  # idempotent
    assert coordinator.lookup(NAME) is None
    assert hooks.count("cleanup") == 0  # removal is the domain's own work

    slow = asyncio.create_task(
        coordinator.create(NAME, 100.0, FakeCreator(steps=[("sandbox network", 5.0)]))
    )
    await asyncio.sleep(0)
    with pytest.raises(FailedPrecondition, match="not visible"):
        coordinator.release(NAME)
    assert await slow == "id2"
    await coordinator.aclose()


@in_virtual_time
async def test_a_retired_object_is_torn_down_in_the_background_and_its_name_held_until_then() -> (
    None
):
    coordinator, hooks = make(cleanup_timeout=60.0)
    first = await coordinator.create(NAME, 10.0, FakeCreator())
    hooks.published.discard(first)  # the domain hid it before retiring it
    hooks.cleanup_plans[first] = CleanupPlan(seconds=5.0)
    start = now()

    coordinator.retire(NAME, object_id=first)  # returns at once
    assert now() == start
    info = coordinator.lookup(NAME)
    assert info is not None and info.phase is Phase.CLEANING and info.stage == "removal"
    duplicate = asyncio.create_task(outcome(coordinator.create(NAME, start + 100.0, FakeCreator())))
    await coordinator.until_released(NAME, object_id=first)

    assert now() == start + 5.0
    assert coordinator.lookup(NAME) is None
    assert hooks.released_names[-1] == (NAME, first) and hooks.violations == []
    refused, _ = await duplicate  # it waited on the teardown, which made nothing for it
    assert isinstance(refused, NameReserved)
    assert await coordinator.create(NAME, now() + 10.0, FakeCreator()) == "id2"
    coordinator.retire(NAME, object_id="stale-id")  # a late retire of an older object
    assert coordinator.lookup(NAME) is not None
    await coordinator.aclose()


@in_virtual_time
async def test_shutdown_leaves_a_retired_objects_teardown_to_the_restart() -> None:
    coordinator, hooks = make()
    first = await coordinator.create(NAME, 10.0, FakeCreator())
    hooks.published.discard(first)
    hooks.cleanup_plans[first] = CleanupPlan(hangs=True)
    coordinator.retire(NAME, object_id=first)
    await asyncio.sleep(1.0)

    hooks.shutting_down = True
    await coordinator.aclose()

    assert hooks.cleanup_interrupted[first] == 1
    assert hooks.released_names == []  # still held in the database: the restart rolls it on


@in_virtual_time
async def test_restored_cached_objects_are_claimable_with_a_fresh_expiry() -> None:
    coordinator, hooks = make()
    await advance_to(1000.0)
    assert coordinator.restore_cached("cached-name", "id-cached") == 1000.0 + GRACE
    coordinator.restore_visible("visible-name", "id-visible")
    assert hooks.calls == []  # restore mirrors the database; it writes nothing

    info = coordinator.lookup("cached-name")
    assert info is not None and info.phase is Phase.CACHED and info.expires_at == 1000.0 + GRACE
    assert await coordinator.create("visible-name", 1010.0, FakeCreator()) == "id-visible"
    assert await coordinator.create("cached-name", 1010.0, FakeCreator()) == "id-cached"
    assert hooks.count("publish", "id-cached") == 1
    with pytest.raises(NameTaken):
        coordinator.restore_visible("cached-name", "id-other")
    await coordinator.aclose()


@in_virtual_time
async def test_an_unclaimed_restored_object_expires() -> None:
    coordinator, hooks = make()
    coordinator.restore_cached(NAME, "id-cached")
    await advance_to(GRACE + 1.0)
    assert hooks.cleanup_ended["id-cached"] == 1
    assert hooks.released_names == [(NAME, "id-cached")]
    await coordinator.aclose()


# ---- 8. logs and stats ---------------------------------------------------------------------------


@in_virtual_time
async def test_stats_show_creations_stalled_per_stage() -> None:
    coordinator, _ = make()
    slow_network = FakeCreator(steps=[("sandbox storage", 1.0), ("sandbox network", 100.0)])
    requests = [
        asyncio.create_task(outcome(coordinator.create(pod, None, slow_network)))
        for pod in ("a", "b")
    ]
    slow_storage = FakeCreator(steps=[("sandbox storage", 100.0)])
    requests.append(asyncio.create_task(outcome(coordinator.create("c", None, slow_storage))))
    await advance_to(5.0)
    duplicate = coordinator.create("a", 50.0, slow_network)
    requests.append(asyncio.create_task(outcome(duplicate)))
    await asyncio.sleep(0)

    stats = coordinator.stats()

    assert stats["stalled_by_stage"] == {"sandbox network": 2, "sandbox storage": 1}
    by_name = {f["name"]: f for f in stats["in_flight"]}
    assert by_name["a"]["stage"] == "sandbox network"
    assert by_name["a"]["age_seconds"] == 5.0 and by_name["a"]["stage_seconds"] == 4.0
    assert by_name["a"]["watchers"] == 1 and by_name["b"]["watchers"] == 0
    assert stats["stages_entered"] == {"sandbox storage": 3, "sandbox network": 2}
    assert stats["counters"]["reserved"] == 3 and stats["counters"]["waiting"] == 1
    await coordinator.aclose()
    await asyncio.gather(*requests)


@in_virtual_time
async def test_stats_count_from_zero_and_time_each_stage_left() -> None:
    coordinator, _ = make()
    assert coordinator.stats()["counters"] == dict.fromkeys(COUNTERS, 0)
    creator = FakeCreator(steps=[("sandbox storage", 1.0), ("sandbox network", 2.5)])

    await coordinator.create(NAME, 10.0, creator)

    stats = coordinator.stats()
    assert stats["stage_seconds"] == {
        "reserved": 0.0,
        "sandbox storage": 1.0,
        "sandbox network": 2.5,
    }
    assert stats["stages_entered"] == {"sandbox storage": 1, "sandbox network": 1}
    assert {k: v for k, v in stats["counters"].items() if v} == {"reserved": 1, "created": 1}
    await coordinator.aclose()


class RecordingObserver(CreationStatistics):
    """The default figures, and what the coordinator told, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[str, ...]] = []

    def counted(self, event: str) -> None:
        super().counted(event)
        self.told.append(("counted", event))

    def stage_entered(self, stage: str) -> None:
        super().stage_entered(stage)
        self.told.append(("entered", stage))

    def stage_left(self, stage: str, seconds: float) -> None:
        super().stage_left(stage, seconds)
        self.told.append(("left", stage, str(seconds)))


@in_virtual_time
async def test_an_injected_observer_is_told_each_event_and_stats_report_its_figures() -> None:
    observer = RecordingObserver()
    coordinator, _ = make(observer=observer)
    creator = FakeCreator(steps=[("sandbox network", 6.0)])

    with pytest.raises(DeadlineExceeded):
        await coordinator.create(NAME, 4.0, creator)
    await advance_to(7.0)  # finished at t=6 with nobody waiting: cached
    assert await coordinator.create(NAME, 10.0, creator) == "id1"  # claimed

    assert observer.told == [
        ("counted", "reserved"),
        ("left", "reserved", "0.0"),
        ("entered", "sandbox network"),
        ("counted", "timed_out"),
        ("left", "sandbox network", "6.0"),
        ("counted", "cached"),
        ("counted", "claimed"),
    ]
    assert coordinator.stats()["counters"] == observer.figures()["counters"]
    await coordinator.aclose()


@in_virtual_time
async def test_every_decision_is_logged_with_the_name(caplog: pytest.LogCaptureFixture) -> None:
    coordinator, _ = make()
    creator = FakeCreator(steps=[("sandbox network", 6.0)])
    with caplog.at_level(logging.INFO, logger="cri_shim.creation"):
        await outcome(coordinator.create(NAME, 4.0, creator))  # reserved, timed out
        await outcome(coordinator.create(NAME, 8.0, creator))  # waiting, handed off
        await coordinator.create(NAME, 10.0, creator)  # returned existing
        await outcome(coordinator.create("other", 10.0, FakeCreator(error=Internal("x"))))
        with pytest.raises(DeadlineExceeded):
            await coordinator.create("third", 6.5, creator)
        await outcome(coordinator.create("third", 7.0, creator))  # refused
        await advance_to(1000.0)  # cached, expired, released
        with pytest.raises(DeadlineExceeded):
            await coordinator.create("fourth", 1001.0, creator)
        await advance_to(1010.0)
        await coordinator.create("fourth", 1020.0, creator)  # claimed

    messages = [r.getMessage() for r in caplog.records if r.name == "cri_shim.creation"]

    def logged(name: str, fragment: str) -> bool:
        return any(repr(name) in m and fragment in m for m in messages)

    assert logged(NAME, "reserved")
    assert logged(NAME, "stage sandbox network")
    assert logged(NAME, "deadline passed")
    assert logged(NAME, "waits")
    assert logged(NAME, "handed to them")
    assert logged(NAME, "gets the finished object")
    assert logged(NAME, "already visible")
    assert logged("other", "failed")
    assert logged("other", "released")
    assert logged("third", "refused")
    assert logged("third", "cached")
    assert logged("third", "never claimed")
    assert logged("fourth", "claimed")
    assert logged("third", "released")
    await coordinator.aclose()


@in_virtual_time
async def test_stage_reports_after_the_creation_ended_are_ignored() -> None:
    coordinator, hooks = make()
    stages: list[Stage] = []

    async def leaky_creator(object_id: str, stage: Stage) -> None:
        stages.append(stage)

    await coordinator.create(NAME, 10.0, leaky_creator)
    stages[0].set("too late")
    info = coordinator.lookup(NAME)
    assert info is not None and info.stage != "too late"
    assert hooks.count("stage_changed") == 0
    await coordinator.aclose()


# ---- 9. shutdown ---------------------------------------------------------------------------------


@in_virtual_time
async def test_aclose_stops_everything_without_cleanup_and_leaves_rows_for_restart() -> None:
    coordinator, hooks = make()
    slow = FakeCreator(steps=[("sandbox network", 100.0)])
    owner = asyncio.create_task(outcome(coordinator.create("in-flight", None, slow)))
    await asyncio.sleep(0)
    watcher = asyncio.create_task(outcome(coordinator.create("in-flight", None, slow)))
    with pytest.raises(DeadlineExceeded):
        await coordinator.create("cached", 0.5, FakeCreator())
    await advance_to(2.0)
    assert hooks.rows["id2"].phase == "cached"

    await coordinator.aclose()

    for request in (owner, watcher):
        result, at = await request
        assert isinstance(result, Unavailable) and at == 2.0
    assert slow.cancelled == ["id1"]
    await advance_to(10_000.0)  # no expiry timer left behind
    assert hooks.count("cleanup") == 0 and hooks.released_names == []
    assert {r.phase for r in hooks.rows.values()} == {"in_flight", "cached"}
    assert asyncio.all_tasks() == {asyncio.current_task()}
    with pytest.raises(Unavailable):
        await coordinator.create("new", 10.0, FakeCreator())
    await coordinator.aclose()  # idempotent


@in_virtual_time
async def test_aclose_interrupts_a_running_cleanup_without_releasing_the_name() -> None:
    hooks = FakeHooks(default_cleanup=CleanupPlan(seconds=50.0))
    coordinator, _ = make(hooks)
    failing = FakeCreator(error=Internal("x"))
    request = asyncio.create_task(outcome(coordinator.create(NAME, 100.0, failing)))
    await advance_to(10.0)
    hooks.shutting_down = True
    await coordinator.aclose()
    assert isinstance((await request)[0], Unavailable)
    assert hooks.cleanup_interrupted["id1"] == 1
    assert hooks.released_names == []
    assert hooks.rows["id1"].phase == "cleaning"  # the restart rolls it back
