"""The node e2e runner's own logic: ginkgo's JUnit report read, the expected-failure table
held to it, the named subsets chosen from the kit's spec list, the focus that selects
exactly them. Each way a run can go wrong fails the verdict."""

from __future__ import annotations

import re
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

import pytest

from tests import node_e2e
from tests.conformance import Expected, Spec
from tests.node_e2e import (
    CGROUP_SUBSET,
    EXPECTED,
    SERIAL_SPECS,
    focus_of,
    judge,
    plan_runs,
    read_junit,
    read_spec_list,
    select_subset,
)

KIT_LIST = node_e2e.KIT / "nodeconformance-specs.txt"
needs_kit = pytest.mark.skipif(not KIT_LIST.exists(), reason="no node e2e kit beside the clone")

PASSING = "[sig-node] Pods should get a host IP [NodeConformance] [Conformance]"
PRIVATE = EXPECTED[0]
PRIVATE_MESSAGE = 'Failed to pull image "gcr.io/authenticated-image-pulling/alpine:3.7": rpc error'


def case_xml(name: str, status: str, *, failure: str = "", where: str = "", skip: str = "") -> str:
    body = ""
    if failure:
        text = f"[FAILED] {failure}\nIn [It] at: {where} @ 12/07/26 14:52:31.526\n"
        body = f"<failure message={quoteattr(failure)} type='failed'>{escape(text)}</failure>"
    if skip:
        body = f"<skipped message={quoteattr(skip)}></skipped>"
    return (
        f"<testcase name={quoteattr(name)} classname='E2eNode Suite' status='{status}' "
        f"time='1'>{body}</testcase>"
    )


def junit(tmp_path: Path, cases: list[str], *, succeeded: bool, special: str = "") -> Path:
    path = tmp_path / "junit.xml"
    path.write_text(
        "<?xml version='1.0' encoding='UTF-8'?><testsuites tests='3'>"
        "<testsuite name='E2eNode Suite' tests='3'><properties>"
        f"<property name='SuiteSucceeded' value='{str(succeeded).lower()}'></property>"
        f"<property name='SpecialSuiteFailureReason' value={quoteattr(special)}></property>"
        "</properties>" + "".join(cases) + "</testsuite></testsuites>"
    )
    return path


def test_the_report_gives_each_spec_its_state_message_and_place(tmp_path: Path) -> None:
    report = read_junit(
        junit(
            tmp_path,
            [
                case_xml("[SynchronizedBeforeSuite]", "passed"),
                case_xml(f"[It] {PASSING}", "passed"),
                case_xml(
                    f"[It] {PRIVATE.name}",
                    "failed",
                    failure=PRIVATE_MESSAGE,
                    where="/opt/node-e2e/src/test/e2e/common/node/runtime.go:344",
                ),
                case_xml("[It] not selected", "skipped", skip="skipped"),
                case_xml("[It] skipped on purpose", "skipped", skip="skipped - no dummy"),
            ],
            succeeded=False,
        )
    )
    assert report is not None
    assert report.specs == [
        Spec(PASSING, "passed", ""),
        Spec(
            PRIVATE.name,
            "failed",
            PRIVATE_MESSAGE,
            "/opt/node-e2e/src/test/e2e/common/node/runtime.go:344",
        ),
        Spec("skipped on purpose", "skipped", "no dummy"),
    ]
    assert not report.succeeded


def test_a_failed_setup_node_is_a_spec_that_did_not_pass(tmp_path: Path) -> None:
    report = read_junit(
        junit(
            tmp_path,
            [case_xml("[SynchronizedBeforeSuite]", "failed", failure="system validation")],
            succeeded=False,
        )
    )
    assert report is not None
    assert [(s.name, s.state) for s in report.specs] == [("[SynchronizedBeforeSuite]", "failed")]
    verdict = judge(report, EXPECTED, None)
    assert verdict.unexpected and verdict.problems


def test_a_report_of_no_suite_is_none(tmp_path: Path) -> None:
    # What ginkgo writes when the suite's process died before it reported.
    path = tmp_path / "junit.xml"
    path.write_text("<?xml version='1.0' encoding='UTF-8'?><testsuites></testsuites>")
    assert read_junit(path) is None


def report_of(specs: list[Spec], *, succeeded: bool | None = None) -> node_e2e.Junit:
    if succeeded is None:
        succeeded = all(s.state in ("passed", "skipped") for s in specs)
    return node_e2e.Junit(specs, succeeded, "", len(specs))


TABLE = (Expected(PRIVATE.name, "needs credentials", r".*gcr\.io/authenticated-image-pulling.*"),)


def test_an_expected_failure_with_its_message_passes_the_verdict() -> None:
    specs = [Spec(PASSING, "passed", ""), Spec(PRIVATE.name, "failed", PRIVATE_MESSAGE)]
    verdict = judge(report_of(specs), TABLE, [PASSING, PRIVATE.name])
    assert not verdict.problems
    assert [spec.name for spec, _ in verdict.expected] == [PRIVATE.name]


def test_an_expected_spec_failing_otherwise_fails_the_verdict() -> None:
    specs = [Spec(PRIVATE.name, "failed", "Timed out after 300s: pod Pending")]
    verdict = judge(report_of(specs), TABLE, [PRIVATE.name])
    assert verdict.unexpected == specs and verdict.problems


def test_a_failure_not_in_the_table_fails_the_verdict() -> None:
    specs = [Spec(PASSING, "failed", "boom")]
    verdict = judge(report_of(specs), TABLE, [PASSING])
    assert verdict.unexpected == specs
    assert verdict.problems == ["1 specs did not pass as expected"]


def test_an_expected_failure_that_passes_asks_for_the_table_to_be_updated() -> None:
    verdict = judge(report_of([Spec(PRIVATE.name, "passed", "")]), TABLE, [PRIVATE.name])
    assert any("the table is to be updated" in p for p in verdict.problems)


def test_a_spec_missing_from_the_report_fails_the_verdict() -> None:
    verdict = judge(report_of([Spec(PASSING, "passed", "")]), TABLE, [PASSING, "another"])
    assert verdict.problems == ["1 specs not in the report: ['another']"]


def test_a_report_whose_verdict_disagrees_with_its_specs_fails() -> None:
    report = report_of([Spec(PASSING, "passed", "")], succeeded=False)
    assert judge(report, TABLE, [PASSING]).problems


def test_a_subset_pattern_that_names_no_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="no spec of the suite"):
        select_subset([PASSING], ["a spec renamed upstream"])


def test_a_subset_keeps_the_suites_order_and_each_spec_once() -> None:
    specs = ["a x", "b y", "c x y"]
    assert select_subset(specs, ["y", "x"]) == ["b y", "c x y", "a x"]


def test_the_focus_selects_exactly_the_names_given() -> None:
    names = [
        "[sig-node] Downward API volume should provide container's cpu limit "
        "[NodeConformance] [Conformance]",
        "[sig-node] Probing container should *not* be restarted (a.b) [NodeConformance]",
    ]
    focus = re.compile(focus_of(names))
    # ginkgo matches the focus against its text of each spec, which may carry more before
    for name in names:
        assert focus.search(f"prefix {name}")
    assert not focus.search(names[0] + " and more")
    assert not focus.search(names[1].replace("*not*", "xnotx"))
    assert not focus.search("[sig-node] Downward API volume should provide container's cpu")


def test_serial_specs_run_one_at_a_time() -> None:
    args = node_e2e.argparse.Namespace(serial=True, subset=None, focus=[], skip=[], nodes=4)
    runs = plan_runs(args, [PASSING])
    assert [(run.wanted, run.nodes, run.skip) for run in runs] == [
        ([name], 1, "") for name in SERIAL_SPECS
    ]
    # Each bounded well below the whole set's run: one spec can wait for ever.
    assert all(run.timeout == node_e2e.SERIAL_TIMEOUT < node_e2e.SUITE_TIMEOUT for run in runs)


def test_the_ci_subset_is_the_whole_set_but_what_it_names() -> None:
    specs = [PASSING, *(f"x {left} y" for left in node_e2e.CI_LEFT_OUT)]
    args = node_e2e.argparse.Namespace(serial=False, subset="ci", focus=[], skip=[], nodes=4)
    (run,) = plan_runs(args, specs)
    assert run.wanted == [PASSING]
    assert re.search(run.focus, PASSING) and not re.search(run.focus, specs[1])


@needs_kit
def test_every_named_spec_is_one_of_the_kits() -> None:
    specs = read_spec_list(KIT_LIST)
    assert len(specs) == 212
    assert len(select_subset(specs, CGROUP_SUBSET)) >= len(CGROUP_SUBSET)
    assert len(select_subset(specs, node_e2e.CI_LEFT_OUT)) == len(node_e2e.CI_LEFT_OUT)
    for expectation in EXPECTED:
        assert expectation.name in specs or expectation.name in SERIAL_SPECS


DROPPED = ("AvailableBytes", "UsageBytes", "RSSBytes", "PageFaults", "MajorPageFaults")


def summary_message(missing: str | None = "misc", dropped: tuple[str, ...] = DROPPED) -> str:
    """The Summary API spec's message as kubelet 1.28 makes it fail on this host."""

    def container(pod: int) -> str:
        fields = "".join(
            f"\t.{f}:\n\t\tExpected\n\t\t    <*uint64 | 0x0>: nil\n\t\tnot to be <nil>\n"
            for f in dropped
        )
        return (
            f".Pods[summary-test-2269::stats-busybox-{pod}].Containers[busybox-container]."
            "Memory:\n\tExpected\n\t    <string>: MemoryStats\n\tto match fields: {\n"
            f"{fields}\t}}\n"
        )

    return (
        "Timed out after 180.000s.\nExpected\n    <string>: Summary\nto match fields: {\n"
        + (f".Node.SystemContainers:\n\tmissing expected element {missing}\n" if missing else "")
        + f"[{container(0)}\t, {container(1)}\t]\n}}"
    )


SUMMARY_WHERE = "/opt/node-e2e/src/test/e2e_node/summary_test.go:336"


def test_the_summary_api_row_holds_only_what_no_runtime_passes_here() -> None:
    row = node_e2e.SUMMARY_API
    assert row.matches(Spec(row.name, "failed", summary_message(), SUMMARY_WHERE))
    # where systemd runs the host (the guest) kubelet expects no misc: the rest fails alike
    assert row.matches(Spec(row.name, "failed", summary_message(None), SUMMARY_WHERE))
    # the runtime's or kubelet's system container missing, a pod figure missing or a
    # container's working set missing are failures of the node under test
    for message in (
        summary_message("runtime"),
        summary_message("kubelet"),
        summary_message(dropped=(*DROPPED, "WorkingSetBytes")),
        summary_message().replace("}\n\t, ", "}\n\t, .Pods[x].ProcessStats: nil, "),
    ):
        assert not row.matches(Spec(row.name, "failed", message, SUMMARY_WHERE))


def test_the_suite_finds_a_sudo_that_runs_its_command(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    (empty / "sh").symlink_to("/bin/sh")
    path = node_e2e.path_with_sudo(str(empty), tmp_path / "shims")
    sudo = node_e2e.shutil.which("sudo", path=path)
    assert sudo == str(tmp_path / "shims" / "sudo")
    ran = node_e2e.subprocess.run(
        [sudo, "sh", "-c", "echo $0 ran", "it"], capture_output=True, text=True, env={"PATH": path}
    )
    assert (ran.returncode, ran.stdout) == (0, "it ran\n")
    # one on PATH already is the one the suite uses
    assert node_e2e.path_with_sudo(path, tmp_path / "other") == path


def test_the_serial_rows_hold_only_where_the_host_lacks_what_they_need(monkeypatch) -> None:
    nfs, restart = node_e2e.SERIAL_EXPECTED_HERE
    assert (nfs.name, restart.name) == SERIAL_SPECS[1:]
    monkeypatch.setattr(node_e2e, "kernel_has_nfs", lambda: True)
    monkeypatch.setattr(node_e2e, "systemd_booted", lambda: True)
    assert not nfs.applies() and not restart.applies()
    monkeypatch.setattr(node_e2e, "kernel_has_nfs", lambda: False)
    monkeypatch.setattr(node_e2e, "systemd_booted", lambda: False)
    assert nfs.applies() and restart.applies()
    timed_out = 'Timed out after 300.001s.\nExpected Pod to be in <v1.PodPhase>: "Running"\nGot'
    assert nfs.matches(
        Spec(
            nfs.name,
            "failed",
            timed_out,
            "/opt/node-e2e/src/test/e2e/framework/volume/fixtures.go:363",
        )
    )
    # the static pod not coming back is the node's failure, not the host's
    assert not nfs.matches(Spec(nfs.name, "failed", timed_out, "/opt/node-e2e/src/x.go:1"))
    assert restart.matches(
        Spec(restart.name, "failed", "exit status 1", "/opt/node-e2e/src/test/e2e_node/util.go:359")
    )
    assert not restart.matches(
        Spec(
            restart.name,
            "failed",
            "metrics not found",
            "/opt/node-e2e/src/test/e2e_node/util.go:359",
        )
    )


def test_only_runs_of_the_mirror_pod_nfs_spec_need_its_nfs_server() -> None:
    def runs(**options: object) -> list[node_e2e.Run]:
        args = dict(serial=False, subset=None, focus=[], skip=[], nodes=4) | options
        specs = [PASSING, *(f"x {left} y" for left in node_e2e.CI_LEFT_OUT)]
        return plan_runs(node_e2e.argparse.Namespace(**args), specs)

    assert node_e2e.runs_nfs_spec(runs(serial=True))
    assert node_e2e.runs_nfs_spec(runs(serial=True, focus=["MirrorPod when recreating"]))
    assert not node_e2e.runs_nfs_spec(runs(serial=True, focus=["MirrorPodWithGracePeriod"]))
    assert not node_e2e.runs_nfs_spec(runs(subset="ci"))
    assert not node_e2e.runs_nfs_spec(runs())


def fake_nfs_builder(tmp_path: Path, monkeypatch) -> Path:
    """A stand-in for tests/node_e2e_nfs.sh that makes an empty layout and counts its runs,
    with the cache in tmp_path."""
    builder = tmp_path / "fake_node_e2e_nfs.sh"
    builder.write_text('#!/bin/sh\nmkdir -p "$1" && echo {} > "$1/index.json"\necho >> "$0.runs"\n')
    builder.chmod(0o755)
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    (fixtures / "run_nfs").write_text("#!/bin/bash\n")
    monkeypatch.setattr(node_e2e, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(node_e2e, "NFS_BUILDER", builder)
    monkeypatch.setattr(node_e2e, "NFS_FIXTURES", fixtures)
    return builder


def test_the_nfs_servers_image_is_built_once_per_version_of_its_builder(
    tmp_path: Path, monkeypatch
) -> None:
    builder = fake_nfs_builder(tmp_path, monkeypatch)
    monkeypatch.setattr(node_e2e.shutil, "which", lambda name: f"/usr/bin/{name}")
    first = node_e2e.build_nfs_image()
    assert (first / "index.json").exists()
    assert node_e2e.build_nfs_image() == first
    assert Path(f"{builder}.runs").read_text().count("\n") == 1
    # another entrypoint is another image, and the stale one goes
    (tmp_path / "fixtures" / "run_nfs").write_text("#!/bin/bash\nexit 0\n")
    second = node_e2e.build_nfs_image()
    assert second != first and not first.exists()
    assert Path(f"{builder}.runs").read_text().count("\n") == 2


def test_where_the_nfs_servers_image_cannot_be_built_the_run_says_how(
    tmp_path: Path, monkeypatch
) -> None:
    builder = fake_nfs_builder(tmp_path, monkeypatch)
    monkeypatch.setattr(node_e2e.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match=r"--prepare --serial"):
        node_e2e.build_nfs_image()
    assert not Path(f"{builder}.runs").exists()


@pytest.mark.parametrize(
    ("options", "nfs"),
    [([], False), (["--serial"], True), (["--serial", "--focus", "WithGracePeriod"], False)],
)
def test_prepare_builds_the_nfs_servers_image_only_for_its_spec(
    tmp_path: Path, monkeypatch, options: list[str], nfs: bool
) -> None:
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "unpack").touch()
    (kit / "nodeconformance-specs.txt").write_text(f"{PASSING}\tx.go:1\n")
    built: list[str] = []
    monkeypatch.setattr(node_e2e, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(node_e2e, "unpack_binaries", lambda kit: tmp_path / "bin")
    monkeypatch.setattr(node_e2e, "prepare_images", lambda kit, bin: built.append("images"))
    monkeypatch.setattr(node_e2e, "build_nfs_image", lambda: built.append("nfs"))
    # whatever this kernel has: the image is for the guest's
    monkeypatch.setattr(node_e2e, "kernel_has_nfs", lambda: False)
    assert node_e2e.main(["--kit", str(kit), "--prepare", *options]) == 0
    assert built == ["images", "nfs"] if nfs else ["images"]
