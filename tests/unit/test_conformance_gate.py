"""The conformance gate's judgement of critest's report: each way a run can go wrong fails it."""

from __future__ import annotations

import dataclasses

import pytest

from tests import conformance
from tests.conformance import EXPECTED, HANDLERS, KIT_SPECS, Report, Spec, judge

MASKED = "[k8s.io] Security Context bucket runtime should support MaskedPaths"
DIGEST = (
    "[k8s.io] Image Manager public image with digest should be pulled and removed [Conformance]"
)
NRI_SPEC = "[k8s.io] NRI plugin synchronization should synchronize a newly connected plugin"
# What the kit's critest reported for the specs that do not pass, offline, without AppArmor.
REPORTED = {
    MASKED: Spec(
        MASKED,
        "failed",
        "Expected an error to have occurred.  Got:\n    <nil>: nil",
        "sigs.k8s.io/cri-tools/pkg/validate/security_context_linux.go:621",
    ),
    DIGEST: Spec(
        DIGEST,
        "failed",
        "failed to pull image\nUnexpected error:\n    rpc error: code = Unavailable desc = "
        "registry endpoint https://gcr.io is unreachable (mirrors tried first: "
        "http://127.0.0.1:5000: image gcr.io/k8s-staging-cri-tools/test-image-digest@"
        "sha256:9700f9a2f5bf2c45f2f605a0bd3bce7cf37420ec9d3ed50ac2758413308766bf not found "
        "at http://127.0.0.1:5000 (MANIFEST_UNKNOWN: manifest unknown))\noccurred",
        "sigs.k8s.io/cri-tools/pkg/framework/util.go:406",
    ),
}
MASKED_AS_OFFLINE = REPORTED[MASKED]


def as_expected() -> list[Spec]:
    """A whole run as the kit's critest shows it on a host without AppArmor (the AppArmor
    specs skip with critest's message, the benchmarks with none), every other spec
    passing."""
    specs = [
        REPORTED.get(e.name)
        or Spec(e.name, e.state, "AppArmor is disabled on this host" if e.message else "")
        for e in EXPECTED
        if e.applies()
    ]
    specs.append(Spec(NRI_SPEC, "passed", ""))
    return specs + [Spec(f"spec {i}", "passed", "") for i in range(KIT_SPECS - len(specs))]


def verdict(specs: list[Spec], *, exit_code: int = 1, whole_run: bool = True, **report: object):  # type: ignore[no-untyped-def]
    fields: dict[str, object] = {
        "succeeded": False,
        "special_failures": [],
        "total": KIT_SPECS,
        **report,
    }
    return judge(
        Report(specs, **fields),  # type: ignore[arg-type]
        EXPECTED,
        whole_run=whole_run,
        critest_exit=exit_code,
    )


def replaced(specs: list[Spec], name: str, **changes: str) -> list[Spec]:
    return [dataclasses.replace(s, **changes) if s.name == name else s for s in specs]


def test_a_run_as_expected_passes() -> None:
    found = verdict(as_expected())
    assert found.problems == [] and found.unexpected == []


def test_a_spec_that_fails_fails_the_gate() -> None:
    found = verdict(replaced(as_expected(), NRI_SPEC, state="failed", message="lost"))
    assert [s.name for s in found.unexpected] == [NRI_SPEC]


def test_a_spec_that_skips_fails_the_gate() -> None:
    found = verdict(replaced(as_expected(), NRI_SPEC, state="skipped", message="no NRI"))
    assert [s.name for s in found.unexpected] == [NRI_SPEC]


def test_a_discrepancy_skip_fails_the_gate_even_when_a_skip_is_expected() -> None:
    skip = next(e for e in EXPECTED if e.state == "skipped" and e.applies())
    specs = replaced(as_expected(), skip.name, message="spec discrepancy: lost a container")
    assert [s.name for s in verdict(specs).unexpected] == [skip.name]
    specs = replaced(as_expected(), NRI_SPEC, state="skipped", message="spec discrepancy: x")
    assert [s.name for s in verdict(specs, whole_run=False).unexpected] == [NRI_SPEC]


@pytest.mark.parametrize(
    "changes",
    [
        {"message": "failed to create container: runc create failed"},
        {"where": "sigs.k8s.io/cri-tools/pkg/validate/security_context_linux.go:600"},
    ],
)
def test_an_offline_failure_with_another_failure_fails_the_gate(changes: dict[str, str]) -> None:
    found = verdict(replaced(as_expected(), MASKED, **changes))
    assert [s.name for s in found.unexpected] == [MASKED]


def test_a_spec_missing_from_a_whole_run_fails_the_gate() -> None:
    specs = [s for s in as_expected() if s.name != MASKED]
    assert any("not in the report" in p for p in verdict(specs).problems)
    fewer = [s for s in as_expected() if s.name != "spec 0"]
    assert any("reported" in p for p in verdict(fewer).problems)


def test_an_expected_failure_that_passes_fails_the_gate_unless_it_may() -> None:
    assert verdict(replaced(as_expected(), MASKED, state="passed")).problems
    assert not verdict(replaced(as_expected(), DIGEST, state="passed")).problems


def test_critest_exit_and_verdict_must_agree_with_the_specs() -> None:
    assert verdict(as_expected(), exit_code=0).problems
    assert verdict(as_expected(), exit_code=1, succeeded=True).problems
    assert verdict(as_expected(), special_failures=["Interrupted by Timeout"]).problems


def test_a_selected_run_holds_only_the_specs_run() -> None:
    specs = [
        MASKED_AS_OFFLINE,
        Spec(NRI_SPEC, "passed", ""),
        Spec("not selected", "skipped", ""),
    ]
    assert verdict(specs, whole_run=False).problems == []
    assert verdict(specs).problems  # a whole run misses the rest


def test_every_handler_names_a_runtime() -> None:
    assert all(handler.runtime.get("path") for handler in HANDLERS.values())


@pytest.mark.parametrize(("kernel", "expected"), [((6, 1), True), ((6, 18), False)])
def test_user_namespace_specs_skip_as_expected_only_without_idmapped_tmpfs(
    monkeypatch: pytest.MonkeyPatch, kernel: tuple[int, int], expected: bool
) -> None:
    # Debian 12's 6.1: the daemon offers runc no user namespaces, and critest skips.
    monkeypatch.setattr(conformance, "kernel_version", lambda: kernel)
    names = [e.name for e in EXPECTED if "UserNamespaces" in e.name and e.applies()]
    assert len(names) == (6 if expected else 0)
    skipped = Spec(
        "[k8s.io] Security Context UserNamespaces when Host idmap mount support is not "
        "needed runtime should support NamespaceMode_NODE",
        "skipped",
        "no runtime handler found which supports user namespaces",
    )
    assert (verdict([skipped], whole_run=False).unexpected == []) == expected
