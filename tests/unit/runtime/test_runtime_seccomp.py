"""Localhost seccomp profiles are read from a path a request names: a device,
a FIFO or a huge file is refused at once instead of read forever or waited on."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cri_shim.errors import InvalidArgument
from cri_shim.runtime.seccomp import MAX_PROFILE_BYTES, default_profile, load_localhost_profile


@pytest.mark.parametrize("kind", ["device", "fifo", "huge", "directory"])
def test_only_a_regular_file_of_sane_size_is_read(tmp_path: Path, kind: str) -> None:
    path = {"device": Path("/dev/zero"), "directory": tmp_path}.get(kind, tmp_path / kind)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        path.write_bytes(b" " * (MAX_PROFILE_BYTES + 1))
    started = time.monotonic()
    with pytest.raises(InvalidArgument, match="localhost_ref"):
        load_localhost_profile(str(path), [])
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deep"),
        ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["kill"]}]}', "KeyError"),
        ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": ["kill"]}', "AttributeError"),
        ('{"defaultAction": "SCMP_ACT_ALLOW", "archMap": 5}', "TypeError"),
    ],
)
def test_a_malformed_profile_is_refused_naming_the_file(
    tmp_path: Path, content: str, problem: str
) -> None:
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(InvalidArgument, match=f"localhost_ref: .*{path}.*{problem}"):
        load_localhost_profile(str(path), [])


def test_a_real_profile_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text('{"defaultAction": "SCMP_ACT_ALLOW"}')
    assert load_localhost_profile(str(path), [])["defaultAction"] == "SCMP_ACT_ALLOW"


def test_io_uring_is_refused_whatever_the_capabilities() -> None:
    every = [f"CAP_{name}" for name in ("SYS_ADMIN", "SYS_PTRACE", "SYS_MODULE", "BPF")]
    for held in ([], every):
        denied = {
            name
            for rule in default_profile(held, "x86_64")["syscalls"]
            if rule["action"] == "SCMP_ACT_ERRNO" and "args" not in rule
            for name in rule["names"]
        }
        assert {"io_uring_setup", "io_uring_enter", "io_uring_register"} <= denied
