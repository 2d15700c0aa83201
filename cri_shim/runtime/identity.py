"""Who the container process runs as: uid, primary gid and additional gids.

Names are looked up in the image's own /etc/passwd and /etc/group, never the host's: the
same name can mean a different uid in every image.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cri_shim.errors import InvalidArgument

# Reads a file of the container's root filesystem ("/etc/passwd") or returns None when it
# does not exist.
EtcReader = Callable[[str], "str | None"]

_MAX_SYMLINKS = 40  # as the kernel's ELOOP limit


def read_in_root(root: Path) -> EtcReader:
    """A reader that resolves symlinks as if `root` were `/`, so an image whose
    /etc/passwd is a link to `/../../etc/shadow` reads its own file, not the host's."""

    def read(path: str) -> str | None:
        resolved = resolve_in_root(root, path)
        try:
            return resolved.read_text(errors="replace") if resolved.is_file() else None
        except OSError:
            return None

    return read


def resolve_in_root(root: Path, path: str) -> Path:
    parts = list(PurePosixPath(path).parts[1:])
    current = PurePosixPath("/")
    hops = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        host = root / candidate.relative_to("/")
        if host.is_symlink():
            hops += 1
            if hops > _MAX_SYMLINKS:
                break
            target = PurePosixPath(os.readlink(host))
            if target.is_absolute():
                current = PurePosixPath("/")
                parts = list(target.parts[1:]) + parts
            else:
                parts = list(target.parts) + parts
            continue
        current = candidate
    return root / current.relative_to("/")


@dataclass(frozen=True)
class PasswdEntry:
    name: str
    uid: int
    gid: int
    home: str


@dataclass(frozen=True)
class GroupEntry:
    name: str
    gid: int
    members: tuple[str, ...]


def parse_passwd(text: str | None) -> list[PasswdEntry]:
    entries = []
    for line in (text or "").splitlines():
        fields = line.split(":")
        if len(fields) < 4 or line.startswith("#"):
            continue
        try:
            entries.append(
                PasswdEntry(
                    name=fields[0],
                    uid=int(fields[2]),
                    gid=int(fields[3]),
                    home=fields[5] if len(fields) > 5 else "/",
                )
            )
        except ValueError:
            continue  # a malformed line must not hide the rest of the file
    return entries


def parse_group(text: str | None) -> list[GroupEntry]:
    entries = []
    for line in (text or "").splitlines():
        fields = line.split(":")
        if len(fields) < 3 or line.startswith("#"):
            continue
        try:
            members = tuple(m for m in (fields[3] if len(fields) > 3 else "").split(",") if m)
            entries.append(GroupEntry(name=fields[0], gid=int(fields[2]), members=members))
        except ValueError:
            continue
    return entries


@dataclass(frozen=True)
class ProcessIdentity:
    uid: int
    gid: int
    additional_gids: tuple[int, ...]
    home: str  # for HOME when neither the image nor the request sets it


def resolve_identity(
    *,
    run_as_user: int | None,
    run_as_username: str,
    run_as_group: int | None,
    image_user: str,
    supplemental_groups: Iterable[int],
    read_etc: EtcReader,
    strict_groups: bool = False,
) -> ProcessIdentity:
    """Follow kubelet's precedence: run_as_user, then run_as_username, then the image's
    `User` ("name", "uid", "uid:gid", "name:group"). run_as_group overrides the group.

    The additional groups are the request's `supplemental_groups`, plus (the CRI's Merge
    policy, the default) the groups the image's /etc/group lists the user in. With
    `strict_groups` (the Strict policy) the image's /etc/group adds nothing: a group
    membership an image smuggles in cannot reach files the pod never granted."""
    if run_as_user is not None:
        user_part, group_part = str(run_as_user), ""
        source = "run_as_user"
    elif run_as_username:
        user_part, group_part = run_as_username, ""
        source = "run_as_username"
    else:
        user_part, _, group_part = image_user.partition(":")
        source = "image user"
    if run_as_group is not None:
        group_part = str(run_as_group)

    passwd = parse_passwd(read_etc("/etc/passwd"))
    groups = parse_group(read_etc("/etc/group"))

    entry: PasswdEntry | None
    if not user_part:
        uid, entry = 0, next((e for e in passwd if e.uid == 0), None)
    elif user_part.isdigit():
        uid = int(user_part)
        entry = next((e for e in passwd if e.uid == uid), None)
    else:
        entry = next((e for e in passwd if e.name == user_part), None)
        if entry is None:
            raise InvalidArgument(f"{source}: user {user_part!r} is not in the image's /etc/passwd")
        uid = entry.uid

    if group_part.isdigit():
        gid = int(group_part)
    elif group_part:
        match = next((g for g in groups if g.name == group_part), None)
        if match is None:
            raise InvalidArgument(
                f"{source}: group {group_part!r} is not in the image's /etc/group"
            )
        gid = match.gid
    else:
        # A uid without a passwd entry gets group 0, as runc and Docker do.
        gid = entry.gid if entry is not None else 0

    additional: list[int] = []
    if entry is not None and not strict_groups:
        additional.extend(g.gid for g in groups if entry.name in g.members)
    additional.extend(supplemental_groups)
    unique = tuple(dict.fromkeys(g for g in additional if g != gid))
    return ProcessIdentity(
        uid=uid, gid=gid, additional_gids=unique, home=entry.home if entry else "/"
    )
