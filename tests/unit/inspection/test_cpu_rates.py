"""CPU rates from successive samples of a pod's or a container's CPU time."""

from __future__ import annotations

from cri_shim.inspection.cpu_rates import CpuRates


def test_cpu_rates_from_successive_samples() -> None:
    rates = CpuRates(max_objects=2)
    assert rates.rate("c1", 1_000_000_000, 5_000_000_000) is None  # nothing to compare with
    # half a core: 0.5 s of CPU time in one second
    assert rates.rate("c1", 2_000_000_000, 5_500_000_000) == 500_000_000
    assert rates.rate("c1", 2_000_000_000, 5_600_000_000) is None  # the same instant
    assert rates.rate("c1", 4_000_000_000, 7_600_000_000) == 1_000_000_000
    # a pod's sum falls when one of its containers is gone: no rate, a fresh start
    assert rates.rate("c1", 5_000_000_000, 1_000_000_000) is None
    assert rates.rate("c1", 6_000_000_000, 1_250_000_000) == 250_000_000


def test_cpu_rates_are_bounded_and_forget_removed_objects() -> None:
    rates = CpuRates(max_objects=2)
    rates.rate("a", 1, 1)
    rates.rate("b", 1, 1)
    rates.rate("a", 2, 2)  # "a" sampled last: "b" is the oldest
    rates.rate("c", 1, 1)
    assert len(rates) == 2
    assert rates.rate("b", 3, 3) is None  # its sample was dropped
    rates.retain({"c"})
    assert len(rates) == 1
    assert rates.rate("a", 3, 3) is None
