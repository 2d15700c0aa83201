"""The log lines of a creation are about its object, after its request has gone too."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from creation_fakes import CleanupPlan, FakeCreator, FakeHooks, in_virtual_time

from cri_shim import logcontext
from cri_shim.creation.coordinator import CreationCoordinator, Stage
from cri_shim.errors import DeadlineExceeded, NameReserved
from cri_shim.logcontext import BoundObjectFilter, bound_fields

NAME = "k8s_POD_nginx_default_uid-1_0"
log = logging.getLogger("cri_shim.test.creator")


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.addFilter(BoundObjectFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def about(self, message: str) -> dict[str, str]:
        [record] = [r for r in self.records if message in r.getMessage()]
        return {k: getattr(record, k) for k in ("sandbox_id", "sandbox_name") if hasattr(record, k)}


@pytest.fixture
def captured() -> Iterator[Captured]:
    handler = Captured()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


def make(**options: Any) -> tuple[CreationCoordinator, FakeHooks]:
    hooks = FakeHooks()
    ids = (f"id{n}" for n in itertools.count(1))
    return CreationCoordinator("sandbox", hooks, new_id=lambda: next(ids), **options), hooks


OBJECT = {"sandbox_id": "id1", "sandbox_name": NAME}


@in_virtual_time
async def test_a_creation_that_outlives_its_request_logs_about_its_object(
    captured: Captured,
) -> None:
    coordinator, _ = make(claim_grace=10.0)

    async def slow(object_id: str, stage: Stage) -> None:
        stage.set("sandbox network")
        await asyncio.sleep(5.0)
        log.info("network ready")  # the request gave up at t=1

    async def request() -> None:
        with pytest.raises(DeadlineExceeded):
            await coordinator.create(NAME, 1.0, slow)

    await asyncio.create_task(request())
    await asyncio.sleep(60.0)  # finished, cached, expired, cleaned up
    assert captured.about("network ready") == OBJECT
    assert captured.about("cached for") == OBJECT
    assert captured.about("never claimed; cleaning up") == OBJECT
    assert captured.about("name released") == OBJECT
    await coordinator.aclose()


@in_virtual_time
async def test_a_refused_duplicate_request_is_bound_to_the_object_it_waited_on(
    captured: Captured,
) -> None:
    coordinator, _ = make(hand_off=False)
    first = asyncio.create_task(coordinator.create(NAME, 10.0, FakeCreator([("x", 5.0)])))
    await asyncio.sleep(1.0)

    async def duplicate() -> dict[str, str]:
        with pytest.raises(NameReserved):
            await coordinator.create(NAME, 2.0, FakeCreator())
        return dict(bound_fields())  # what the gRPC edge's error line carries

    assert await asyncio.create_task(duplicate()) == OBJECT
    assert dict(bound_fields()) == {}  # the test's own task never bound anything
    await first
    await coordinator.aclose()


@in_virtual_time
async def test_a_failed_creations_rollback_logs_about_its_object(captured: Captured) -> None:
    hooks = FakeHooks(default_cleanup=CleanupPlan(error=RuntimeError("veth busy")))
    coordinator = CreationCoordinator("sandbox", hooks, new_id=lambda: "id1")
    with pytest.raises(RuntimeError):
        await coordinator.create(NAME, 10.0, FakeCreator(error=RuntimeError("plugin failed")))
    assert captured.about("rolling back") == OBJECT
    assert captured.about("cleanup failed") == OBJECT
    await coordinator.aclose()


@in_virtual_time
async def test_a_creation_keeps_what_its_request_bound_besides_its_object(
    captured: Captured,
) -> None:
    """A container's creation logs about its pod too, which the gRPC edge bound."""
    ids = (f"c{n}" for n in itertools.count(1))
    coordinator = CreationCoordinator("container", FakeHooks(), new_id=lambda: next(ids))

    async def creator(object_id: str, stage: Stage) -> None:
        await asyncio.sleep(1.0)
        log.info("created %s", object_id)

    async def request(pod: str, name: str) -> None:
        logcontext.bind_object("sandbox", pod)
        await coordinator.create(name, 10.0, creator)

    # The first starts the coordinator's task group, the second joins it.
    await asyncio.gather(
        asyncio.create_task(request("pod1", "k8s_a_nginx_default_uid-1_0")),
        asyncio.create_task(request("pod2", "k8s_b_nginx_default_uid-2_0")),
    )
    for object_id, pod in (("c1", "pod1"), ("c2", "pod2")):
        [record] = [r for r in captured.records if r.getMessage() == f"created {object_id}"]
        assert (record.container_id, record.sandbox_id) == (object_id, pod)  # type: ignore[attr-defined]
    await coordinator.aclose()
