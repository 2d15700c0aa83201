"""What tests read of this mount namespace's mounts, through the daemon's own parser."""

from __future__ import annotations

from pathlib import Path

from cri_shim.host.mounts import mounted, unescape_mountinfo


def mount_points() -> list[Path]:
    """Every mount point of this mount namespace, in mount order."""
    lines = Path("/proc/self/mountinfo").read_text(errors="surrogateescape").splitlines()
    return [Path(unescape_mountinfo(line.split(" ")[4])) for line in lines if line.strip()]


def is_mounted(target: Path) -> bool:
    return bool(mounted([target]))
