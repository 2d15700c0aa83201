"""benchmarks/runtime_cost.py's PSS of a runtime alone on the node: a page that a process
outside the runtime also maps (the benchmark's own, which imports the same libraries) is
divided only among the runtime's processes."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from runtime_cost import alone_pss, pss_mib

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="page frame numbers need root")

SIZE = 8 * 2**20
# Maps the file read-only, touches every page, says so and waits.
HOLDER = """
import mmap, sys
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    sum(m[i] for i in range(0, len(m), mmap.PAGESIZE))
    print("mapped", flush=True)
    sys.stdin.read()
"""


def holder(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "mapped\n"
    return proc


def test_pages_shared_with_a_process_outside_the_runtime_count_whole(tmp_path: Path) -> None:
    data = tmp_path / "library"
    data.write_bytes(os.urandom(SIZE))
    with open(data, "rb") as f:
        outside = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    sum(outside[i] for i in range(0, SIZE, mmap.PAGESIZE))  # this process maps them too
    inside = holder(data)
    try:
        share = alone_pss([inside.pid])[inside.pid]
        # The kernel gives this process half of the file's 8 MiB; alone it has all of it.
        assert share.mib - pss_mib(inside.pid) >= SIZE / 2**20 / 2 - 0.5
    finally:
        inside.communicate("")
        outside.close()


def test_pages_shared_within_the_runtime_are_divided_among_it(tmp_path: Path) -> None:
    data = tmp_path / "library"
    data.write_bytes(os.urandom(SIZE))
    first, second = holder(data), holder(data)
    try:
        shares = alone_pss([first.pid, second.pid])
        apart = alone_pss([first.pid])[first.pid].mib + alone_pss([second.pid])[second.pid].mib
        # Apart, each has the file's 8 MiB; together they have them once (and the
        # interpreter's and the C library's pages once too).
        assert apart - sum(share.mib for share in shares.values()) >= SIZE / 2**20 - 0.5
        assert shares[first.pid].system_libraries_mib > 0  # the C library, at least
    finally:
        first.communicate("")
        second.communicate("")
