"""Temporary and trash names in the image store, and the sweep of a dead writer's leftovers.

A writer creates `.tmp-<pid>-<random>` and renames it into place once complete; a deleter
renames to `.trash-*` before removing, so that a final name is never seen half-written or
half-deleted. The pid in a temporary name lets a later start tell a dead writer's leftovers
from those of a live one (`cri-shim images import` runs beside the daemon).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


def temp_name() -> str:
    return f"{TMP_PREFIX}{os.getpid()}-{os.urandom(8).hex()}"


def trash(path: Path) -> None:
    """Rename `path` aside, then delete it; a missing `path` is no error."""
    aside = path.with_name(f"{TRASH_PREFIX}{path.name}-{os.urandom(4).hex()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(directory: Path) -> None:
    """Delete the trash in `directory`, and the temporaries of writers that are gone."""
    for entry in directory.iterdir():
        name = entry.name
        if name.startswith(TRASH_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)
        elif name.startswith(TMP_PREFIX):
            pid_text = name[len(TMP_PREFIX) :].partition("-")[0]
            if pid_text.isdigit() and not _pid_alive(int(pid_text)):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
