"""The event bus and the exit watcher on their own: bounded queues, order, inotify."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from cri_shim.errors import ResourceExhausted
from cri_shim.lifecycle.events import (
    CONTAINER_CREATED,
    CONTAINER_DELETED,
    CONTAINER_STARTED,
    CONTAINER_STOPPED,
    ContainerEvent,
    EventBus,
    ExitWatcher,
)


async def test_a_full_queue_drops_its_oldest_event_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus = EventBus(max_queue=3)
    with caplog.at_level(logging.WARNING), bus.subscribe() as slow, bus.subscribe() as fast:
        for index in range(5):
            bus.emit(f"c{index}", "pod", CONTAINER_CREATED)
            if index < 4:
                assert (await fast.get()).container_id == f"c{index}"
        # The slow one keeps the newest three; the fast one lost nothing.
        assert [(await slow.get()).container_id for _ in range(3)] == ["c2", "c3", "c4"]
        assert slow.dropped == 2 and fast.dropped == 0
        assert (await fast.get()).container_id == "c4"
    assert "dropped its 1 oldest event(s)" in caplog.text


async def test_emit_never_waits_for_a_subscriber() -> None:
    bus = EventBus(max_queue=10)
    with bus.subscribe() as never_read:
        for index in range(10_000):
            bus.emit(f"c{index}", "pod", CONTAINER_STARTED)  # returns at once every time
        assert never_read.pending() == 10


async def test_events_emitted_while_rendering_keep_their_order() -> None:
    """Rendering reads statuses, which may notice another exit and emit again."""
    bus = EventBus()

    def render(event: ContainerEvent) -> str:
        if event.container_id == "a":
            bus.emit("b", "pod", CONTAINER_STOPPED)
        return f"{event.container_id}:{event.kind}"

    bus.render = render
    with bus.subscribe() as sub:
        bus.emit("a", "pod", CONTAINER_STOPPED)
        assert [await sub.get(), await sub.get()] == ["a:2", "b:2"]


async def test_a_broken_renderer_loses_the_event_not_the_transition(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus = EventBus()
    calls: list[str] = []

    def render(event: ContainerEvent) -> str:
        calls.append(event.container_id)
        if event.kind == CONTAINER_DELETED:
            raise RuntimeError("boom")
        return event.container_id

    bus.render = render
    bus.emit("nobody-listens", "pod", CONTAINER_CREATED)
    assert calls == []  # nothing rendered without subscribers
    with bus.subscribe() as sub:
        bus.emit("gone", "pod", CONTAINER_DELETED)  # must not raise
        bus.emit("next", "pod", CONTAINER_CREATED)
        assert await sub.get() == "next"
    assert "rendering the deleted event of gone failed" in caplog.text
    assert bus.subscribers == 0


async def test_a_subscriber_waits_for_the_next_event() -> None:
    bus = EventBus()
    with bus.subscribe() as sub:
        waiter = asyncio.create_task(sub.get())
        await asyncio.sleep(0)  # one step: the waiter runs up to its wait
        assert not waiter.done()
        bus.emit("c", "pod", CONTAINER_CREATED)
        event = await asyncio.wait_for(waiter, 1)
        assert isinstance(event, ContainerEvent) and event.kind_name == "created"


async def test_exit_watcher_reports_exit_files_as_they_appear(tmp_path: Path) -> None:
    exits = tmp_path / "exits"
    seen: asyncio.Queue[str | None] = asyncio.Queue()
    watcher = ExitWatcher([exits], seen.put_nowait)
    task = asyncio.create_task(watcher.run())
    try:
        (exits / ".hidden").write_text("x")  # temporary files are not exits
        (exits / "container-1").write_text("137")
        assert await asyncio.wait_for(seen.get(), 2) == "container-1"
        assert seen.empty()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_closing_ends_every_stream_after_what_is_queued() -> None:
    bus = EventBus()
    with bus.subscribe() as sub:
        bus.emit("last", "pod", CONTAINER_DELETED)
        bus.close()
        assert [event.container_id async for event in sub] == ["last"]


async def test_a_subscriber_behind_by_more_than_its_backlog_is_dropped() -> None:
    bus = EventBus(render=lambda event: b"x" * 40, max_backlog_bytes=100)
    told: list[str] = []
    with bus.subscribe() as slow, bus.subscribe() as fast:
        slow.on_fell_behind = lambda: told.append("dropped")
        for index in range(3):
            bus.emit(f"c{index}", "pod", CONTAINER_CREATED)
            assert await fast.get() == b"x" * 40
        # Two fit (80 bytes), the third does not: the slow one is dropped, its queue freed.
        assert told == ["dropped"] and slow.pending() == 0 and slow.pending_bytes() == 0
        with pytest.raises(ResourceExhausted, match=r"\[events\] max_backlog_bytes"):
            await slow.get()
        bus.emit("c3", "pod", CONTAINER_CREATED)
        assert slow.pending() == 0 and fast.pending() == 1


async def test_every_subscriber_queues_the_same_rendered_bytes() -> None:
    rendered: list[bytes] = []

    def render(event: ContainerEvent) -> bytes:
        rendered.append(event.container_id.encode() * 1000)
        return rendered[-1]

    bus = EventBus(render=render)
    with bus.subscribe() as first, bus.subscribe() as second:
        bus.emit("c", "pod", CONTAINER_CREATED)
        assert len(rendered) == 1
        assert (await first.get()) is (await second.get()) is rendered[0]


async def test_subscribers_beyond_the_cap_are_refused_by_name() -> None:
    bus = EventBus(max_subscribers=2)
    with bus.subscribe(), bus.subscribe():
        with pytest.raises(ResourceExhausted, match=r"\[events\] max_subscribers"):
            with bus.subscribe():
                pass
    with bus.subscribe():
        assert bus.subscribers == 1
