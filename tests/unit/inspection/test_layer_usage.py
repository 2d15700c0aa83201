"""The writable layers' disk use, walked at most once per `max_age` each: what a figure
answered from the last walk says, when a layer is walked again, and what is forgotten."""

from __future__ import annotations

from pathlib import Path

from cri_shim.inspection.layer_usage import LayerUsageCache


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def layer(tmp_path: Path, name: str) -> Path:
    upper = tmp_path / name / "upper"
    upper.mkdir(parents=True)
    return upper


def test_a_figure_younger_than_max_age_is_the_last_walks_with_its_date(tmp_path: Path) -> None:
    clock = FakeClock()
    cache = LayerUsageCache(max_age=10, clock=clock)
    upper = layer(tmp_path, "a")
    first = cache.usage("a", upper)
    assert first.usage.inodes_used == 0
    (upper / "grown").write_bytes(b"x" * 8192)
    clock.now += 9.9
    assert cache.usage("a", upper) == first  # not walked: the same figure and timestamp
    clock.now += 0.1
    again = cache.usage("a", upper)
    assert again.usage.inodes_used == 1 and again.usage.used_bytes >= 8192
    assert again.read_at >= first.read_at


def test_each_container_has_its_own_figure_and_max_age_0_walks_every_time(
    tmp_path: Path,
) -> None:
    cache = LayerUsageCache(max_age=0, clock=FakeClock())
    a, b = layer(tmp_path, "a"), layer(tmp_path, "b")
    (b / "file").write_bytes(b"x")
    assert cache.usage("a", a).usage.inodes_used == 0
    assert cache.usage("b", b).usage.inodes_used == 1
    (a / "file").write_bytes(b"x")
    assert cache.usage("a", a).usage.inodes_used == 1


def test_retain_forgets_the_figures_of_removed_containers(tmp_path: Path) -> None:
    clock = FakeClock()
    cache = LayerUsageCache(max_age=10, clock=clock)
    for name in ("a", "b"):
        cache.usage(name, layer(tmp_path, name))
    cache.retain({"a"})
    assert len(cache) == 1
    # "b"'s figure is gone: a container of that ID would be walked, not answered stale.
    (tmp_path / "b" / "upper" / "file").write_bytes(b"x")
    assert cache.usage("b", tmp_path / "b" / "upper").usage.inodes_used == 1
