"""After a restart: the names the database says are held, taken again before anything is
served (DESIGN §3). Visible objects keep their names; cached ones stay claimable with a
fresh expiry (CRI-O loses its cache on restart). Interrupted creations are not restored:
the domain rolls them back from their journal and their names are free.
"""

from __future__ import annotations

from cri_shim.creation.cache import UnclaimedCache
from cri_shim.creation.entry import Entry, Phase
from cri_shim.creation.reservation import HeldNames
from cri_shim.errors import Unavailable


def restore_visible(names: HeldNames, name: str, object_id: str) -> None:
    """`name` belongs to a visible object. Persists nothing."""
    _restore(names, name, object_id, Phase.VISIBLE)


def restore_cached(names: HeldNames, cache: UnclaimedCache, name: str, object_id: str) -> Entry:
    """A cached object, claimable again; its expiry restarts at now + claim_grace. Calls no
    hook (the row already says `cached`); the caller starts its wait for a claim."""
    entry = _restore(names, name, object_id, Phase.CACHED)
    entry.expires_at = cache.fresh_expiry()
    return entry


def _restore(names: HeldNames, name: str, object_id: str, phase: Phase) -> Entry:
    if names.closing:
        raise Unavailable("cri-shim is shutting down")
    return names.restore(name, object_id, phase)
