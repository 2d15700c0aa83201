"""Test-only fault injection: die at a named step, as a `kill -9` would.

`CRI_SHIM_FAULT=sandbox:network` makes the daemon `os._exit(137)` when a creation reaches
that point. Several points may be given, separated by commas. Restart tests use it to
prove that a crash at any step leaves nothing behind. Unset in production: the check is
one set lookup.

This module is also the registry of every point: a point the code reaches must be declared
here, and the crash tests kill the daemon at each declared point
(tests/unit/test_faults.py holds both to it). Every undo step of the journal is a point,
`undo:<action>`, reached when the journal runs that step.
"""

from __future__ import annotations

import logging
import os

ENV = "CRI_SHIM_FAULT"
EXIT_CODE = 137

_points = frozenset(p.strip() for p in os.environ.get(ENV, "").split(",") if p.strip())

# Every point the daemon has, by the call that reaches it, so tests can iterate over them.
SANDBOX_CREATE = (
    "sandbox:row",
    "sandbox:files",
    "sandbox:shm",
    "sandbox:namespaces",
    "sandbox:network-journaled",
    "sandbox:network-added",
    "sandbox:ready",
)
# The pause container's creation: reached by pods whose handler runs a sandbox container
# (runsc, Kata), and by pods that share their PID namespace.
POD_SANDBOX_CREATE = (
    "sandbox:pod-sandbox-journaled",
    "sandbox:pod-sandbox-created",
    "sandbox:pod-sandbox-started",
)
CONTAINER_CREATE = (
    "container:row",
    "container:rootfs",
    "container:log-journaled",
    "container:runtime-journaled",
    "container:runtime-created",
)
CONTAINER_START = ("container:started",)
# A conmon died without recording its container's exit: the container is deleted from
# the runtime, and its exit file not yet written in conmon's place.
MONITOR_DIED = ("container:unmonitored-deleted",)
# RemoveContainer has answered; its teardown is about to run from the journal.
CONTAINER_REMOVE = ("container:teardown",)
# Reached only with [nri] enable: after plugins heard of the object, before it is done.
NRI_CREATE = ("sandbox:nri-run", "container:nri-created")
UNDO = "undo:"
# The journal's undo steps (an interrupted creation, a removal, an expiry run them).
TEARDOWN = (
    "undo:nri_pod_stopped",
    "undo:cni_del",
    "undo:unpin",
    "undo:pause_delete",
    "undo:unmount",
    "undo:nri_pod_removed",
    "undo:remove_dir",
    "undo:nri_container_stopped",
    "undo:runtime_delete",
    "undo:container_log",
    "undo:rootfs_unmount",
    "undo:container_dir",
    "undo:nri_container_removed",
)
ALL = (
    SANDBOX_CREATE
    + POD_SANDBOX_CREATE
    + CONTAINER_CREATE
    + CONTAINER_START
    + MONITOR_DIED
    + CONTAINER_REMOVE
    + NRI_CREATE
    + TEARDOWN
)


def undo_point(action: str) -> str:
    """The point reached before the journal runs an `action` step."""
    return UNDO + action


def fault_point(name: str) -> None:
    if name in _points:
        logging.getLogger("cri_shim.faults").critical("fault injected at %s: exiting", name)
        logging.shutdown()
        os._exit(EXIT_CODE)
