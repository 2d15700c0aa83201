"""A handler's containers as files (runtime/container_files.py): the meta a restart reads,
conmon's identity, the ids that may become file names, and files written whole."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from cri_shim.errors import FailedPrecondition
from cri_shim.runtime.container_files import (
    ContainerFiles,
    Meta,
    check_id,
    read_conmon_ref,
    tail,
    write_atomic,
)
from cri_shim.runtime.monitors import process_stat


def test_the_meta_a_restart_reads(tmp_path: Path) -> None:
    files = ContainerFiles(tmp_path)
    assert files.read_meta("c1") is None and files.conmon_ref("c1") is None
    (files.containers / "c1").mkdir(parents=True)
    meta = {"bundle": "/b", "log_path": "/l", "cgroups_path": "/pods/c1"}
    (files.containers / "c1" / "meta.json").write_text(json.dumps(meta))
    assert files.read_meta("c1") == Meta("/b", "/l", "/pods/c1")
    assert files.conmon_ref("c1") is None  # conmon not recorded yet
    (files.containers / "c1" / "meta.json").write_text(
        json.dumps({**meta, "conmon_pid": 42, "conmon_start_time": 7})
    )
    ref = files.conmon_ref("c1")
    assert ref is not None and (ref.pid, ref.start_time) == (42, 7)
    (files.containers / "c1" / "meta.json").write_text("{")  # torn: as if absent
    assert files.read_meta("c1") is None


def test_conmons_identity_is_its_pid_and_start_time(tmp_path: Path) -> None:
    assert read_conmon_ref(tmp_path) is None
    (tmp_path / "conmon.pid").write_text(f"{os.getpid()}\n")
    ref = read_conmon_ref(tmp_path)
    found = process_stat(os.getpid())
    assert ref is not None and found is not None
    assert (ref.pid, ref.start_time) == (os.getpid(), found[2])


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".hidden", "x" * 129])
def test_an_id_that_could_escape_its_directory_is_refused(bad: str) -> None:
    with pytest.raises(FailedPrecondition, match="invalid container id"):
        check_id(bad)
    check_id("a" * 64)


def test_a_file_is_replaced_whole_and_readable_by_root_only(tmp_path: Path) -> None:
    target = tmp_path / "config.json"
    target.write_text("old")
    write_atomic(target, b'{"env": ["TOKEN=secret"]}')
    assert target.read_bytes() == b'{"env": ["TOKEN=secret"]}'
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_diagnostics_are_the_end_of_the_file(tmp_path: Path) -> None:
    assert tail(tmp_path / "conmon.log") == "no diagnostics"
    (tmp_path / "conmon.log").write_text("a" * 10 + "the reason\n")
    assert tail(tmp_path / "conmon.log", limit=10) == "the reason"
