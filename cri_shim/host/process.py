"""Attributes of the daemon's own process (prctl(2))."""

from __future__ import annotations

from cri_shim.host.libc import check, libc

PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper(enabled: bool = True) -> None:
    """Orphaned descendants are re-parented to this process rather than to PID 1, which
    on some nodes reaps only every few seconds (DESIGN §5), and their exit codes reach
    us. Raises OSError."""
    check(
        libc.prctl(PR_SET_CHILD_SUBREAPER, int(enabled), 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)"
    )
