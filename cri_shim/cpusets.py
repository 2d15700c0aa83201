"""CPU and memory-node lists ("0-3,6", the kernel's cpuset format) as intervals, and
the check of a requested list against what the host has online.

A list is kept as sorted, disjoint (low, high) intervals, never as its numbers: a
13-byte "0-99999999999" would be a hundred billion of them. Parsing is linear in the
text's length and every operation linear in the number of intervals.

The kernel refuses a cpuset naming a CPU or node that is not online (EINVAL, or ERANGE
past its bitmap, when the cgroup file is written, after the container was made); a
request naming one is refused up front instead, saying which number and what is online.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from cri_shim.errors import InvalidArgument

Intervals = list[tuple[int, int]]

# Where the host lists its online CPUs and memory nodes; a kernel without NUMA has no
# node directory and one node, 0.
ONLINE_CPUS = Path("/sys/devices/system/cpu/online")
ONLINE_NODES = Path("/sys/devices/system/node/online")
# No host has more CPUs than this has digits (the kernel's NR_CPUS is at most 8192);
# longer numbers are refused before int() reads them.
_MAX_DIGITS = 10
# Longer than any list a host could need (PATH_MAX, as the request's other strings).
MAX_LIST = 4096


class BadList(ValueError):
    """A list the kernel would not parse; the message says what is wrong with it."""


def parse(text: str) -> Intervals:
    """A cpuset list as sorted, disjoint intervals ("" is the empty list)."""
    if not text:
        return []
    found: Intervals = []
    for item in text.split(","):
        low_text, dash, high_text = item.partition("-")
        low = _number(low_text, item)
        high = _number(high_text, item) if dash else low
        if high < low:
            raise BadList(f"range {item} is reversed")
        found.append((low, high))
    return union(found)


def _number(text: str, item: str) -> int:
    if not text:
        raise BadList(f"{item!r} is not a number or a range" if item else "an item is empty")
    if not text.isdigit() or not text.isascii():
        raise BadList(f"{text!r} is not a number")
    if len(text) > _MAX_DIGITS:
        raise BadList(f"{text} is out of range")
    return int(text)


def union(*lists: Iterable[tuple[int, int]]) -> Intervals:
    """The intervals of every list together, merged where they touch or overlap."""
    merged: Intervals = []
    for low, high in sorted(interval for intervals in lists for interval in intervals):
        if merged and low <= merged[-1][1] + 1:
            if high > merged[-1][1]:
                merged[-1] = (merged[-1][0], high)
        else:
            merged.append((low, high))
    return merged


def first_missing(wanted: Intervals, available: Intervals) -> int | None:
    """The lowest number of `wanted` that `available` does not hold (both sorted and
    disjoint, as parse() makes them); None when it holds them all."""
    index = 0
    for low, high in wanted:
        at = low
        while at <= high:
            while index < len(available) and available[index][1] < at:
                index += 1
            if index == len(available) or available[index][0] > at:
                return at
            at = available[index][1] + 1
    return None


def format_list(intervals: Iterable[tuple[int, int]]) -> str:
    """Intervals as a cpuset list, single numbers alone ("0-3,6")."""
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in intervals)


def online(path: Path) -> Intervals:
    """The host's online CPUs or memory nodes, as listed in sysfs (read at each check:
    CPUs can be taken on- and offline)."""
    try:
        return parse(path.read_text().strip())
    except FileNotFoundError:
        return [(0, 0)] if path == ONLINE_NODES else []
    except (OSError, BadList):
        return []


def check(text: str, field: str, *, nodes: bool = False) -> None:
    """Refuse a cpuset list (CPUs, or memory nodes with `nodes`) the kernel would not
    take: malformed, or naming one this host does not have online. `field` names the
    request's field in the message."""
    what = "memory node" if nodes else "CPU"
    if len(text) > MAX_LIST:
        raise InvalidArgument(f"{field}: {_short(text)} is longer than {MAX_LIST} bytes")
    try:
        wanted = parse(text)
    except BadList as err:
        raise InvalidArgument(f"{field}: {_short(text)} is not a {what} list: {err}") from None
    available = online(ONLINE_NODES if nodes else ONLINE_CPUS)
    if not available:
        return  # not told by this host's sysfs: the kernel checks it when it is written
    missing = first_missing(wanted, available)
    if missing is not None:
        raise InvalidArgument(
            f"{field}: {what} {missing} is not online on this host "
            f"(online: {format_list(available)})"
        )


def _short(text: str, limit: int = 64) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
