"""Cpuset lists as intervals, and their check against what the host has online."""

from __future__ import annotations

from pathlib import Path

import pytest

from cri_shim import cpusets
from cri_shim.cpusets import BadList, first_missing, format_list, parse, union
from cri_shim.errors import InvalidArgument


def test_lists_parse_into_sorted_merged_intervals() -> None:
    assert parse("") == []
    assert parse("7-8,0-2,5,3") == [(0, 3), (5, 5), (7, 8)]
    assert parse("0-9999999999") == [(0, 9_999_999_999)]
    assert format_list(parse("8,0,1,2,5,7")) == "0-2,5,7-8"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("3-1", "range 3-1 is reversed"),
        ("0,,1", "an item is empty"),
        ("1,", "an item is empty"),
        ("-1", "'-1' is not a number or a range"),
        ("1-", "'1-' is not a number or a range"),
        ("1-2-3", "'2-3' is not a number"),
        ("0-99999999999999999999", "99999999999999999999 is out of range"),
        ("٣", "'٣' is not a number"),
    ],
)
def test_what_the_kernel_would_not_parse_is_refused_saying_why(text: str, reason: str) -> None:
    with pytest.raises(BadList) as refused:
        parse(text)
    assert str(refused.value) == reason


def test_union_and_membership_never_count_the_numbers() -> None:
    assert union([(0, 4)], [(5, 9), (20, 30)], [(2, 3)]) == [(0, 9), (20, 30)]
    online = [(0, 3), (8, 11)]
    assert first_missing(parse("0-3,9"), online) is None
    assert first_missing(parse("2-9"), online) == 4
    assert first_missing(parse("0-8000000"), [(0, 1)]) == 2
    assert first_missing(parse("12"), online) == 12
    # Linear in the intervals, whatever they span.
    assert first_missing([(0, 10**12)], [(0, 10**12)]) is None


def host_with_two_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose CPUs 0-1 are online, without NUMA (one memory node, 0)."""
    (tmp_path / "cpus").write_text("0-1\n")
    monkeypatch.setattr(cpusets, "ONLINE_CPUS", tmp_path / "cpus")
    monkeypatch.setattr(cpusets, "ONLINE_NODES", tmp_path / "no-numa")


def test_a_cpu_not_online_is_refused_naming_the_field_and_what_is_online(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host_with_two_cpus(tmp_path, monkeypatch)
    cpusets.check("0-1", "r.cpuset_cpus")
    cpusets.check("0", "r.cpuset_mems", nodes=True)  # no node directory: node 0 alone
    with pytest.raises(InvalidArgument) as refused:
        cpusets.check("0-8000000", "r.cpuset_cpus")
    assert str(refused.value) == ("r.cpuset_cpus: CPU 2 is not online on this host (online: 0-1)")
    with pytest.raises(InvalidArgument) as refused:
        cpusets.check("1", "r.cpuset_mems", nodes=True)
    assert str(refused.value) == (
        "r.cpuset_mems: memory node 1 is not online on this host (online: 0)"
    )
    with pytest.raises(InvalidArgument) as refused:
        cpusets.check("1-0", "r.cpuset_cpus")
    assert str(refused.value) == "r.cpuset_cpus: '1-0' is not a CPU list: range 1-0 is reversed"
