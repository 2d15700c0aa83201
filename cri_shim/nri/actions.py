"""The undo steps NRI journals, by name, and what they do while NRI is off.

The lifecycle names them (a pod's stop runs POD_STOPPED first) and the journal must know
them whether NRI is on or not: a journal written while it was on is replayed after a
restart with it off. This module is all of NRI a daemon without it loads (nri/hooks.py
and the rest are imported only when `[nri] enable` is set).
"""

from __future__ import annotations

from typing import Any

from cri_shim.state.journal import Journal

POD_STOPPED = "nri_pod_stopped"
POD_REMOVED = "nri_pod_removed"
CONTAINER_REMOVED = "nri_container_removed"
CONTAINER_STOPPED = "nri_container_stopped"
ACTIONS = (POD_STOPPED, POD_REMOVED, CONTAINER_REMOVED, CONTAINER_STOPPED)


def register_inert(journal: Journal) -> None:
    """With NRI off, its steps in a journal inform nobody: each is done at once."""
    for action in ACTIONS:
        journal.register(action, _inform_nobody)


async def _inform_nobody(args: dict[str, Any]) -> None:
    return None
