"""An image's /etc/passwd and /etc/group are the image author's: they are streamed a line
at a time, a lookup stops at its match, and a file past the cap is refused, not read, so
that its size costs neither memory nor time."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from cri_shim.errors import InvalidArgument
from cri_shim.runtime.identity import ProcessIdentity, read_in_root, resolve_identity

CAP = 1 << 20  # identity.CAP
HUGE = 128 << 20  # a sparse file: 128 MiB of NUL bytes, a few KB gzipped in a layer


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    (tmp_path / "etc").mkdir()
    return tmp_path


def identity(rootfs: Path, username: str = "", image_user: str = "") -> ProcessIdentity:
    return resolve_identity(
        run_as_user=None,
        run_as_username=username,
        run_as_group=None,
        image_user=image_user,
        supplemental_groups=[],
        read_etc=read_in_root(rootfs),
    )


def bytes_read() -> int:
    """What this process has read so far through read(2) and its kin (/proc's rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def measured(call: object) -> tuple[int, int, BaseException | None]:
    """Bytes read and peak traced bytes of `call()`, and what it raised."""
    tracemalloc.start()
    before = bytes_read()
    error: BaseException | None = None
    try:
        call()  # type: ignore[operator]
    except InvalidArgument as exc:
        error = exc
    finally:
        read = bytes_read() - before
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return read, peak, error


def test_a_huge_passwd_is_refused_without_being_read(rootfs: Path) -> None:
    with (rootfs / "etc" / "passwd").open("wb") as f:
        f.truncate(HUGE)
    read, peak, error = measured(lambda: identity(rootfs, username="app"))
    assert isinstance(error, InvalidArgument)
    assert "/etc/passwd is larger than 1MiB" in str(error)
    assert peak < 4 * CAP, peak
    assert read < 4 * CAP, read  # of 128 MiB


def test_a_lookup_stops_at_its_match_in_a_huge_file(rootfs: Path) -> None:
    passwd = rootfs / "etc" / "passwd"
    passwd.write_text("root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n")
    with passwd.open("r+b") as f:
        f.truncate(HUGE)
    group = rootfs / "etc" / "group"
    group.write_text("root:x:0:\nstaff:x:50:app\n" + "g:x:7:\n" * 1000)
    read, peak, error = measured(lambda: identity(rootfs, image_user="app:staff"))
    assert error is None
    assert read < 4 * CAP, read  # of 128 MiB
    assert identity(rootfs, image_user="app:staff") == ProcessIdentity(1000, 50, (), "/home/app")
    assert peak < 4 * CAP, peak


def test_a_huge_group_file_is_refused_naming_it(rootfs: Path) -> None:
    (rootfs / "etc" / "passwd").write_text("app:x:1000:1000::/home/app:/bin/sh\n")
    # Many ordinary lines, past the cap: memberships need the whole file.
    line = "grp:x:7:someone,else\n"
    (rootfs / "etc" / "group").write_text(line * (2 * CAP // len(line)))
    with pytest.raises(InvalidArgument, match="/etc/group is larger than 1MiB"):
        identity(rootfs, username="app")
