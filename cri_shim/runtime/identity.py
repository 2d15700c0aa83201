"""Who the container process runs as: uid, primary gid and additional gids.

Names are looked up in the image's own /etc/passwd and /etc/group, never the host's: the
same name can mean a different uid in every image.

The files are the image author's: they are streamed a line at a time, each lookup stops
at its first match, and no more than `MAX_ETC_BYTES` of a file is ever read (a 200 MiB
/etc/passwd, 200 KB gzipped, once took 5 GB and froze the daemon for 26 s). Reading
blocks on the disk: callers on an event loop run `resolve_identity` in a thread.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from cri_shim.config import format_size
from cri_shim.errors import InvalidArgument

# Reads a file of the container's root filesystem ("/etc/passwd"): its text, or its lines
# one at a time (what `read_in_root` gives), or None when it does not exist.
EtcReader = Callable[[str], "str | Iterable[str] | None"]

_MAX_SYMLINKS = 40  # as the kernel's ELOOP limit
# Far beyond any real image's file (tens of KB with thousands of users), small enough
# that a lookup costs milliseconds whatever the file holds.
MAX_ETC_BYTES = 1 << 20


def read_in_root(root: Path) -> EtcReader:
    """A reader that resolves symlinks as if `root` were `/`, so an image whose
    /etc/passwd is a link to `/../../etc/shadow` reads its own file, not the host's.
    It yields lines, and refuses a file past `MAX_ETC_BYTES` when a lookup gets there."""

    def read(path: str) -> Iterator[str] | None:
        resolved = resolve_in_root(root, path)
        try:
            # O_NONBLOCK: a FIFO planted there must not hang the open; only files are read.
            fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return None
            stream = os.fdopen(fd, "rb")
        except OSError:
            os.close(fd)
            return None
        return _capped_lines(stream, path)

    return read


def _capped_lines(stream: BinaryIO, path: str) -> Iterator[str]:
    with stream:
        room = MAX_ETC_BYTES
        while True:
            # readline with a limit: a file of one endless line is not read whole either.
            line = stream.readline(room + 1)
            if not line:
                return
            room -= len(line)
            if room < 0:
                raise InvalidArgument(
                    f"the image's {path} is larger than {format_size(MAX_ETC_BYTES)}; "
                    "refused rather than read (name the user and group by number)"
                )
            yield line.decode("utf-8", "replace")


def _lines(read_etc: EtcReader, path: str) -> Iterator[str]:
    content = read_etc(path)
    if content is None:
        return iter(())
    if isinstance(content, str):
        return iter(content.splitlines())
    return iter(content)


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


def parse_passwd(lines: str | Iterable[str] | None) -> Iterator[PasswdEntry]:
    """The entries of an /etc/passwd, lazily: a lookup stops at its match."""
    for line in (lines or "").splitlines() if isinstance(lines, str | None) else lines:
        line = line.rstrip("\n")
        fields = line.split(":", 7)
        if len(fields) < 4 or line.startswith("#"):
            continue
        try:
            yield PasswdEntry(
                name=fields[0],
                uid=int(fields[2]),
                gid=int(fields[3]),
                home=fields[5] if len(fields) > 5 else "/",
            )
        except ValueError:
            continue  # a malformed line must not hide the rest of the file


def parse_group(lines: str | Iterable[str] | None) -> Iterator[GroupEntry]:
    for line in (lines or "").splitlines() if isinstance(lines, str | None) else lines:
        line = line.rstrip("\n")
        fields = line.split(":", 4)
        if len(fields) < 3 or line.startswith("#"):
            continue
        try:
            gid = int(fields[2])
        except ValueError:
            continue
        members = tuple(m for m in (fields[3] if len(fields) > 3 else "").split(",") if m)
        yield GroupEntry(name=fields[0], gid=gid, members=members)


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

    # Each lookup streams the file anew and stops at its first match.
    def passwd() -> Iterator[PasswdEntry]:
        return parse_passwd(_lines(read_etc, "/etc/passwd"))

    def groups() -> Iterator[GroupEntry]:
        return parse_group(_lines(read_etc, "/etc/group"))

    entry: PasswdEntry | None
    if not user_part:
        uid, entry = 0, next((e for e in passwd() if e.uid == 0), None)
    elif user_part.isdigit():
        uid = int(user_part)
        entry = next((e for e in passwd() if e.uid == uid), None)
    else:
        entry = next((e for e in passwd() if e.name == user_part), None)
        if entry is None:
            raise InvalidArgument(f"{source}: user {user_part!r} is not in the image's /etc/passwd")
        uid = entry.uid

    if group_part.isdigit():
        gid = int(group_part)
    elif group_part:
        match = next((g for g in groups() if g.name == group_part), None)
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
        additional.extend(g.gid for g in groups() if entry.name in g.members)
    additional.extend(supplemental_groups)
    unique = tuple(dict.fromkeys(g for g in additional if g != gid))
    return ProcessIdentity(
        uid=uid, gid=gid, additional_gids=unique, home=entry.home if entry else "/"
    )
