"""Start-up reconciliation: make the host agree with the state database before serving.

Restore has already rolled interrupted creations back through their journals. What is
left on the host under the daemon's own roots that no record explains (a namespace pin, a
sandbox or container directory with its mounts, a runc container) is an orphan from a
crash at a point where even the journal could not have known of it, or from a lost
database; it is removed and logged. Records whose host side vanished (a reboot clears
/run) are marked as such rather than reported as running.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from cri_shim.host import mounts
from cri_shim.lifecycle.containers import ContainerLifecycle
from cri_shim.lifecycle.sandboxes import SandboxLifecycle
from cri_shim.logcontext import object_bound, object_fields
from cri_shim.network.netns import NamespacePinner
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.mount_sources import release_staging
from cri_shim.state.containers import CREATED, RUNNING
from cri_shim.state.journal import Journal, UndoFailed

log = logging.getLogger("cri_shim.reconcile")


async def undo_orphan_journals(journal: Journal, known: set[str], budget: float) -> None:
    """Journal rows of objects whose row is gone (a crash between undo and forget)."""
    for object_id in journal.objects():
        if object_id in known:
            continue
        try:
            await journal.undo(object_id, budget=budget)
        except UndoFailed as exc:
            log.error("orphan journal of %s left work for GC: %s", object_id, exc)


async def reconcile_host(
    sandboxes: SandboxLifecycle,
    containers: ContainerLifecycle,
    pinner: NamespacePinner,
    root: Path,
) -> int:
    """Remove orphans, then check the records against the host; returns how many
    orphans and stale records were found."""
    sandbox_ids, container_ids = sandboxes.rows.ids(), containers.rows.ids()
    found = await _remove_orphan_pins(pinner, sandboxes.rows.pinned_paths())
    found += await _remove_orphan_directories(
        (
            ("sandboxes", sandbox_ids, root / "sandboxes"),
            ("containers", container_ids, root / "containers"),
        )
    )
    # A pod sharing its PID namespace has a runc container of its own (its pause process).
    # What runc says of each container, by handler, from one listing: the orphans among
    # them, and what the rows are checked against next.
    listed: dict[str, dict[str, str]] = {}
    for backend in containers.backends.values():
        listed[backend.handler_name] = await backend.states()
        found += await _delete_orphan_containers(
            backend, listed[backend.handler_name], container_ids | sandbox_ids
        )
        found += await _adopt_monitors(backend, listed[backend.handler_name])
    found += _check_containers(containers, listed)
    found += _check_sandboxes(sandboxes)
    return found


async def _remove_orphan_pins(pinner: NamespacePinner, known: set[str]) -> int:
    found = 0
    for pin in pinner.pinned():
        if str(pin) not in known:
            log.warning("orphan namespace pin %s: removing it", pin)
            await pinner.unpin(pin)
            found += 1
    return found


async def _remove_orphan_directories(
    directories: Iterable[tuple[str, set[str], Path]],
) -> int:
    found = 0
    for kind, known, directory in directories:
        if not directory.is_dir():
            continue
        for entry in directory.iterdir():
            if entry.name not in known:
                log.warning("orphan %s directory %s: unmounting and removing it", kind, entry)
                # A container's staging mounts, severed first (runtime/mount_sources.py).
                await asyncio.to_thread(release_staging, entry / "mounts")
                await asyncio.to_thread(mounts.unmount_below, entry)
                await asyncio.to_thread(shutil.rmtree, entry, True)
                found += 1
    return found


async def _delete_orphan_containers(
    backend: RuntimeBackend, states: dict[str, str], known: set[str]
) -> int:
    found = 0
    for container_id in states:
        if container_id not in known:
            log.warning("orphan %s container %s: deleting it", backend.handler_name, container_id)
            await backend.delete(container_id)
            found += 1
    return found


async def _adopt_monitors(backend: RuntimeBackend, states: dict[str, str]) -> int:
    """Every conmon still running is watched from now on; a container whose conmon died
    while the daemon was down is ended (its exit file written, read by the exit watcher
    when the daemon starts it)."""
    ended = await backend.adopt(states)
    for container_id in ended:
        log.warning(
            "%s %s: its monitor (conmon) died while the daemon was down",
            backend.handler_name,
            container_id,
        )
    return len(ended)


def _check_containers(containers: ContainerLifecycle, listed: dict[str, dict[str, str]]) -> int:
    """Rows that say less than runc knows: started before a crash, or gone unrecorded."""
    found = 0
    for container in containers.list():
        backend = containers.backend_of(container)
        state = listed.get(backend.handler_name, {}).get(container.id)
        if state is None:
            state = backend.unlisted_state(container.id)
        if container.state == CREATED and state in ("running", "stopped"):
            # Started just before a crash, before the row said so.
            log.warning(
                "container %s (%s) was started before the restart",
                container.id,
                container.name,
                extra=object_fields("container", container.id, container.name),
            )
            containers.refresh(containers.mark_started(container, time.time_ns()))
            found += 1
            continue
        if container.state != RUNNING:
            continue
        if backend.exit_status(container.id) is None and state in ("stopped", "unknown"):
            # Gone without an exit record (the node rebooted): report it exited, unknown code.
            with object_bound("container", container.id, container.name):
                containers.mark_lost(container)
            found += 1
    return found


def _check_sandboxes(sandboxes: SandboxLifecycle) -> int:
    """Ready pods whose network namespace is gone (a reboot clears /run)."""
    found = 0
    ready = [s for s in sandboxes.list() if s.ready and s.netns_path is not None]
    pinned = mounts.mounted(s.netns_path for s in ready if s.netns_path is not None)
    for sandbox in ready:
        if sandbox.netns_path not in pinned:
            log.warning(
                "sandbox %s (%s): its network namespace is gone; marking it not ready",
                sandbox.id,
                sandbox.name,
                extra=object_fields("sandbox", sandbox.id, sandbox.name),
            )
            sandboxes.mark_not_ready(sandbox.id)
            found += 1
    return found
