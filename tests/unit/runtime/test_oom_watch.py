"""The OOM watch over real inotify, on temporary files laid out as cgroup v2's: a pod's
`memory.events` with a container's below it. Writing a file is the kernel's change of a
counter; removing the container's directory is systemd removing the scope."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cri_shim.host.inotify import FileWatch
from cri_shim.runtime.cgroup_layout import CgroupV1, CgroupV2
from cri_shim.runtime.oom_watch import OOM_MARKER, OomWatch

KEY = ("runc", "c1")


def events(oom_kill: int, max_events: int = 0) -> str:
    return f"low 0\nhigh 0\nmax {max_events}\noom {oom_kill}\noom_kill {oom_kill}\n"


@pytest.fixture
def cgroup(tmp_path: Path) -> Path:
    """A container's cgroup (its pod's beside it), with nothing counted yet."""
    pod = tmp_path / "cgroup" / "pod.slice"
    container = pod / "cri-shim-c1.scope"
    container.mkdir(parents=True)
    (pod / "memory.events").write_text(events(0))
    (container / "memory.events").write_text(events(0))
    return container


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    (tmp_path / "state").mkdir()
    return tmp_path / "state" / OOM_MARKER


@pytest.fixture
async def watch() -> AsyncIterator[OomWatch]:
    oom_watch = OomWatch()
    yield oom_watch
    oom_watch.close()


def kernel_watches(watch: OomWatch) -> int:
    """The watches the kernel holds on the watch's inotify descriptor."""
    if watch._inotify is None:
        return 0
    fdinfo = Path(f"/proc/self/fdinfo/{watch._inotify.fileno()}").read_text()
    return sum(line.startswith("inotify wd:") for line in fdinfo.splitlines())


def marked(marker: Path) -> bool:
    return marker.exists()


def kill(cgroup: Path, *, parent_too: bool = True) -> None:
    (cgroup / "memory.events").write_text(events(1, max_events=5))
    if parent_too:  # the kernel counts a child's kill in each ancestor
        (cgroup.parent / "memory.events").write_text(events(1, max_events=5))


async def test_a_kill_leaves_the_marker_as_the_loop_reads_it(
    watch: OomWatch, cgroup: Path, marker: Path
) -> None:
    watch.watch(KEY, cgroup / "memory.events", marker)
    await asyncio.sleep(0)
    assert not marked(marker)
    kill(cgroup)
    # The descriptor is readable once the write returned; the loop's next turn reads it.
    for _ in range(3):
        await asyncio.sleep(0)
    assert marked(marker)
    assert len(watch) == 0 and kernel_watches(watch) == 0  # nothing more to learn


async def test_a_change_without_a_kill_leaves_no_marker(
    watch: OomWatch, cgroup: Path, marker: Path
) -> None:
    watch.watch(KEY, cgroup / "memory.events", marker)
    (cgroup / "memory.events").write_text(events(0, max_events=3))  # reclaimed at its limit
    watch.drain()
    assert not marked(marker)
    assert len(watch) == 1


async def test_drain_reads_a_kill_queued_before_the_exit_is_judged(
    watch: OomWatch, cgroup: Path, marker: Path
) -> None:
    watch.watch(KEY, cgroup / "memory.events", marker)
    kill(cgroup)
    watch.drain()  # what RuntimeBackend.oom_killed does, without a turn of the loop
    assert marked(marker)


async def test_a_scope_removed_before_its_change_was_read_is_judged_by_its_parent(
    watch: OomWatch, cgroup: Path, marker: Path
) -> None:
    watch.watch(KEY, cgroup / "memory.events", marker)
    kill(cgroup)
    shutil.rmtree(cgroup)  # systemd removed the scope when its last process died
    watch.drain()
    assert marked(marker)
    assert len(watch) == 0 and kernel_watches(watch) == 0


async def test_a_removed_scope_whose_parent_counted_no_kill_leaves_no_marker(
    watch: OomWatch, cgroup: Path, marker: Path
) -> None:
    watch.watch(KEY, cgroup / "memory.events", marker)
    (cgroup / "memory.events").write_text(events(0, max_events=3))
    shutil.rmtree(cgroup)
    watch.drain()
    assert not marked(marker)
    assert len(watch) == 0


async def test_a_kill_counted_before_the_watch_began_is_recorded(
    watch: OomWatch, cgroup: Path, marker: Path
) -> None:
    """After a restart: the kill happened while the daemon was down."""
    kill(cgroup)
    watch.watch(KEY, cgroup / "memory.events", marker)
    assert marked(marker)
    assert len(watch) == 0


async def test_a_missing_file_is_not_watched(watch: OomWatch, cgroup: Path, marker: Path) -> None:
    watch.watch(KEY, cgroup / "gone" / "memory.events", marker)
    assert len(watch) == 0 and kernel_watches(watch) == 0


async def test_watches_end_with_their_containers(tmp_path: Path, watch: OomWatch) -> None:
    """Created and deleted containers leave no watch behind, in the daemon or the kernel."""
    pod = tmp_path / "pod.slice"
    pod.mkdir()
    (pod / "memory.events").write_text(events(0))
    for round_ in range(3):
        for n in range(20):
            scope = pod / f"c{n}.scope"
            scope.mkdir(exist_ok=True)
            (scope / "memory.events").write_text(events(0))
            watch.watch(("runc", f"c{n}"), scope / "memory.events", tmp_path / f"m{n}")
        assert len(watch) == 20 and kernel_watches(watch) == 20
        for n in range(20):
            if n % 2:  # half of them gone from the host first, as a removed scope is
                shutil.rmtree(pod / f"c{n}.scope")
            watch.forget(("runc", f"c{n}"))
        watch.drain()
        assert len(watch) == 0 and kernel_watches(watch) == 0, round_
    assert not any(marked(tmp_path / f"m{n}") for n in range(20))


async def test_watching_a_key_again_replaces_its_watch(
    watch: OomWatch, cgroup: Path, marker: Path
) -> None:
    watch.watch(KEY, cgroup / "memory.events", marker)
    watch.watch(KEY, cgroup / "memory.events", marker)
    assert len(watch) == 1 and kernel_watches(watch) == 1


async def test_close_ends_every_watch(watch: OomWatch, cgroup: Path, marker: Path) -> None:
    watch.watch(KEY, cgroup / "memory.events", marker)
    fd = watch._inotify.fileno() if watch._inotify is not None else -1
    watch.close()
    assert len(watch) == 0
    with pytest.raises(OSError):
        os.fstat(fd)


def test_file_watch_reports_modification_and_removal(tmp_path: Path) -> None:
    watched = tmp_path / "memory.events"
    watched.write_text(events(0))
    with FileWatch() as inotify:
        inotify.add(watched)
        assert inotify.read() == []
        watched.write_text(events(1))
        (modified,) = {(e.path, e.gone) for e in inotify.read()}
        assert modified == (watched, False)
        watched.unlink()
        assert (watched, True) in {(e.path, e.gone) for e in inotify.read()}
        assert len(inotify) == 0
        inotify.remove(watched)  # already ended by the kernel: nothing to do


def test_only_cgroup_v2_has_an_events_file_to_watch(tmp_path: Path) -> None:
    assert CgroupV2(tmp_path).oom_events_file("/pod.slice/c1.scope") == (
        tmp_path / "pod.slice" / "c1.scope" / "memory.events"
    )
    assert CgroupV1(tmp_path).oom_events_file("/pod/c1") is None
