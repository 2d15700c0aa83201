"""CPU rates from successive samples of a pod's or a container's CPU time."""

from __future__ import annotations

from cri_shim.inspection.cpu_rates import CpuRates


def test_cpu_rates_from_successive_samples() -> None:
    rates = CpuRates(max_objects=2)
    assert rates.rate("c1", 1_000_000_000, 5_000_000_000) is None  # nothing to compare with
    # half a core: 0.5 s of CPU time in one second
    assert rates.rate("c1", 2_000_000_000, 5_500_000_000) == 500_000_000
    # the same instant, or sooner than a second after: the last rate, the reference kept
    assert rates.rate("c1", 2_000_000_000, 5_600_000_000) == 500_000_000
    assert rates.rate("c1", 2_900_000_000, 5_500_000_000) == 500_000_000
    # measured from the reference (2 s, 5.5 s of CPU): 2.1 s of CPU in 2 s
    assert rates.rate("c1", 4_000_000_000, 7_600_000_000) == 1_050_000_000
    # a pod's sum falls when one of its containers is gone: no rate, a fresh start
    assert rates.rate("c1", 5_000_000_000, 1_000_000_000) is None
    assert rates.rate("c1", 6_000_000_000, 1_250_000_000) == 250_000_000


def test_a_sample_soon_after_another_keeps_the_rate_of_the_longer_stretch() -> None:
    # kubelet's own stats call, then a /stats/summary request 5 ms later: a container that
    # used CPU in the second before but none in those 5 ms still shows its rate
    rates = CpuRates()
    rates.rate("c1", 10_000_000_000, 1_000_000)
    assert rates.rate("c1", 11_000_000_000, 2_000_000) == 1_000_000
    assert rates.rate("c1", 11_005_000_000, 2_000_000) == 1_000_000
    # before any rate over a full stretch, the shorter one's
    rates.rate("c2", 10_000_000_000, 0)
    assert rates.rate("c2", 10_500_000_000, 1_000_000) == 2_000_000
    assert rates.rate("c2", 10_500_000_000, 1_000_000) == 2_000_000


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
