"""critest, the CRI conformance suite that containerd and CRI-O run in their CI, against a
real cri-shim daemon, offline: an exact gate.

The kit beside the repository (`../shared/conformance`: critest, crictl and a builder of
the images critest pulls) provides the client and the images. This builds the images
(cached under `.cache/conformance/`, rebuilt when the builder changes), serves them from
Debian's docker-registry on 127.0.0.1, starts the daemon with its own CNI network, the
runtime handler under test and every registry critest names mirrored to that registry,
runs the whole suite, and prints the tally with the name of each spec that did not pass.

Every spec that does not pass is expected by name, with its reason and the message it
fails or skips with (EXPECTED, and per runtime handler HANDLERS): any other outcome fails
the gate, and so does an expected failure with another message (a regression in a spec
that cannot pass offline is still a regression). A skip whose message starts with
"spec discrepancy" always fails it. A whole run must show every spec of the kit with at
least the passes the table allows for; critest's exit code and its report's verdict must
agree with the outcome. Pods or containers critest leaves behind fail the gate (they are
removed), as does anything the daemon or the runtime still holds once they are gone.

    scripts/conformance [--runtime-handler NAME] [--cgroup-manager DRIVER] [--focus REGEX]
                        [--skip REGEX] [--kit DIR] [--no-nri] [--as-installed]
                        [-- CRITEST-ARGS...]

With --focus, --skip or critest arguments only the specs run are held to the table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from cri_shim.host.mounts import unmount_below
from cri_shim.runtime.features import kernel_version
from cri_shim.runtime.userns import IDMAP_KERNEL
from tests.harness import (
    INSTALLED_FLAGS,
    REPO,
    CniTestNetwork,
    Daemon,
    make_test_network,
    runtime_leaks,
)
from tests.registry import start_registry

DEFAULT_KIT = REPO.parent / "shared" / "conformance"
CACHE = REPO / ".cache" / "conformance"
MIRRORED = ("docker.io", "registry.k8s.io", "k8s.gcr.io", "gcr.io", "quay.io", "public.ecr.aws")
CRITEST_TIMEOUT = 30 * 60
# The specs of the kit's critest (ba03eabc): a whole run shows each of them. Another
# critest changes this, and the table below is to be read again.
KIT_SPECS = 142
# critest's skip for a runtime that broke what the spec holds it to (NRI's specs say it
# of a container lost between events): a failure whatever the table says.
DISCREPANCY = "spec discrepancy"
NRI_SPECS = "[k8s.io] NRI "


def host_has_apparmor() -> bool:
    """What critest (runc's libcontainer) asks: is AppArmor enabled in this kernel?"""
    try:
        return Path("/sys/module/apparmor/parameters/enabled").read_text().startswith("Y")
    except OSError:
        return False


@dataclass(frozen=True)
class Expected:
    """A spec that does not pass, by its full name, and why.

    `state` is ginkgo's (failed or skipped); `message` a regular expression the whole
    failure or skip message must match (dots match newlines); `where` the file:line in
    critest's source where it fails. `applies` says whether the expectation holds on this
    host (else the spec must pass); `may_pass`: the spec passes where the outside world
    is reachable.
    """

    name: str
    reason: str
    message: str
    state: str = "failed"
    where: str = ""
    applies: Callable[[], bool] = lambda: True
    may_pass: bool = False

    def matches(self, spec: Spec) -> bool:
        return re.fullmatch(self.message, spec.message, re.DOTALL) is not None and (
            not self.where or spec.where == self.where
        )


def _apparmor_skip(context: str, leaf: str) -> Expected:
    return Expected(
        f"[k8s.io] AppArmor runtime {context} {leaf}",
        "the host has no AppArmor: critest skips its AppArmor specs",
        re.escape("AppArmor is disabled on this host"),
        state="skipped",
        applies=lambda: not host_has_apparmor(),
    )


def _userns_skips(reason: str, applies: Callable[[], bool] = lambda: True) -> tuple[Expected, ...]:
    """critest's user namespace specs, skipped where no handler supports them."""
    leaves = (
        "when Host idmap mount support is needed runtime should support NamespaceMode_POD",
        *(
            f"when Host idmap mount support is not needed runtime {leaf}"
            for leaf in (
                "should support NamespaceMode_NODE",
                "should fail if more than one mapping provided",
                "should fail if container ID 0 is not mapped",
                "should fail with NamespaceMode_CONTAINER",
                "should fail with NamespaceMode_TARGET",
            )
        ),
    )
    return tuple(
        Expected(
            f"[k8s.io] Security Context UserNamespaces {leaf}",
            reason,
            re.escape("no runtime handler found which supports user namespaces"),
            state="skipped",
            applies=applies,
        )
        for leaf in leaves
    )


def _benchmarks(*names: str) -> tuple[Expected, ...]:
    return tuple(
        Expected(name, "critest runs its benchmarks only with -benchmark", "", state="skipped")
        for name in names
    )


def _nri_skips(spec: Spec) -> Expected:
    return Expected(spec.name, "--no-nri: the daemon serves no NRI socket", ".*", state="skipped")


# Whatever the handler: the outcomes of the kit's images and of the host.
EXPECTED: tuple[Expected, ...] = (
    Expected(
        "[k8s.io] Image Manager public image with digest should be pulled and removed "
        "[Conformance]",
        "the digest is that of upstream's manifest, which cannot be rebuilt offline",
        r"failed to pull image\nUnexpected error:.*image gcr\.io/k8s-staging-cri-tools/"
        r"test-image-digest@sha256:9700f9a2f5bf2c45f2f605a0bd3bce7cf37420ec9d3ed50ac2758413308766bf"
        r" not found at http://127\.0\.0\.1:\d+ \(MANIFEST_UNKNOWN: manifest unknown\).*",
        where="sigs.k8s.io/cri-tools/pkg/framework/util.go:406",
        may_pass=True,
    ),
    Expected(
        "[k8s.io] Security Context bucket runtime should support MaskedPaths",
        "Debian's busybox-static runs ls as a shell built-in: masking /bin/ls shows nothing "
        "(tests/integration/test_cri_masked_paths.py shows the mask)",
        re.escape("Expected an error to have occurred.  Got:\n    <nil>: nil"),
        where="sigs.k8s.io/cri-tools/pkg/validate/security_context_linux.go:621",
    ),
    *(
        _apparmor_skip(context, leaf)
        for context in (
            "should support deprecated apparmor_profile field",
            "should support apparmor field",
            "should prefer new apparmor field",
        )
        for leaf in (
            "should fail with an unloaded apparmor_profile",
            "should enforce a apparmor_profile blocking writes",
        )
    ),
    _apparmor_skip(
        "should support deprecated apparmor_profile field",
        "should enforce a permissive deprecated profile",
    ),
    _apparmor_skip(
        "should support apparmor field", "should enforce a permissive deprecated profile"
    ),
    _apparmor_skip("should prefer new apparmor field", "should work with apparmor profile"),
    *_benchmarks(
        "[k8s.io] PodSandbox benchmark about operations on PodSandbox "
        "benchmark about lifecycle of PodSandbox",
        "[k8s.io] PodSandbox benchmark about start a container from scratch "
        "benchmark about start a container from scratch",
        "[k8s.io] Container benchmark about operations on Container "
        "benchmark about basic operations on Container",
        "[k8s.io] Image benchmark about operations on Image "
        "benchmark about basic operations on Image",
        "[k8s.io] Image benchmark about operations on Image benchmark about listing Image",
    ),
    *_userns_skips(
        "the kernel is older than 6.3 (Debian 12's is 6.1): tmpfs has no idmapped mounts, "
        "so runc is offered no user namespaces (runtime/features.py)",
        applies=lambda: kernel_version() < IDMAP_KERNEL,
    ),
)


@dataclass(frozen=True)
class Handler:
    """A runtime handler under test: its `[runtime.handlers.NAME]` table and what critest
    shows against it beyond EXPECTED (a spec the handler cannot pass, with why)."""

    runtime: dict[str, Any]
    expected: tuple[Expected, ...] = ()


# gVisor's: what the daemon refuses under runsc (naming the handler, before anything is
# made), and what gVisor's kernel does otherwise than Linux's.
_RUNSC_REFUSED = "refused: "
_PRIVILEGED = (
    "privileged pods are not supported by runtime handler 'runsc' (gVisor kernel gives no "
    "host devices or capabilities)"
)


def _runsc_privileged(name: str) -> Expected:
    return Expected(
        name,
        _RUNSC_REFUSED + "a privileged pod (gVisor gives a pod no host devices or "
        "capabilities; the spec makes its pod privileged)",
        r"failed to create PodSandbox\n.*" + re.escape(_PRIVILEGED) + ".*",
    )


def _runsc_host_namespace(name: str, option: str) -> Expected:
    return Expected(
        name,
        _RUNSC_REFUSED + f"the host's {option} namespace (the pod runs in gVisor's own kernel)",
        r"failed to create PodSandbox\n.*"
        + re.escape(
            f"namespace_options.{option}: NODE (the host's namespace) is not supported by "
            "runtime handler 'runsc'"
        )
        + ".*",
    )


_SECCOMP = "[k8s.io] Security Context SeccompProfilePath "
_NO_SECCOMP = (
    "runsc applies no OCI seccomp profile to the pod's containers (with --oci-seccomp "
    "neither), and its /proc shows no Seccomp mode"
)
_READONLY_MOUNTS = (
    "[k8s.io] Container Mount Readonly runtime should support readonly mounts should "
)
_PROPAGATION = "[k8s.io] Container Mount Propagation runtime should support mount propagation "
RUNSC: tuple[Expected, ...] = (
    *(
        _runsc_privileged(name)
        for name in (
            "[k8s.io] Security Context bucket runtime should support Privileged is true",
            "[k8s.io] Container OOM runtime should output OOMKilled reason should terminate "
            "with exitCode 137 and reason OOMKilled",
            _READONLY_MOUNTS + "support non-recursive readonly mounts",
            _READONLY_MOUNTS + "support recursive readonly mounts",
            _READONLY_MOUNTS
            + "reject a recursive readonly mount with PROPAGATION_HOST_TO_CONTAINER",
            _READONLY_MOUNTS + "reject a recursive readonly mount with PROPAGATION_BIDIRECTIONAL",
            _READONLY_MOUNTS + "reject a recursive readonly mount with ReadOnly: false",
            _PROPAGATION + "mount with 'rprivate' should not support propagation",
            _PROPAGATION + "mount with 'rshared' should support propagation from host to "
            "container and vice versa",
            _PROPAGATION + "mount with 'rslave' should support propagation from host to container",
            _SECCOMP + "runtime should ignore a seccomp profile that blocks setting hostname "
            "when privileged",
        )
    ),
    _runsc_host_namespace(
        "[k8s.io] Security Context NamespaceOption runtime should support HostPID", "pid"
    ),
    _runsc_host_namespace(
        "[k8s.io] Security Context NamespaceOption runtime should support HostIpc is true", "ipc"
    ),
    _runsc_host_namespace(
        "[k8s.io] Security Context NamespaceOption runtime should support HostNetwork is true",
        "network",
    ),
    _runsc_host_namespace(
        "[k8s.io] Streaming runtime should support streaming interfaces runtime should "
        "support portforward in host network",
        "network",
    ),
    Expected(
        "[k8s.io] PodSandbox runtime should support sysctls should support safe sysctls",
        "gVisor's /proc/sys has no kernel.shm_rmid_forced",
        ".*" + re.escape("can't open '/proc/sys/kernel/shm_rmid_forced'") + ".*",
    ),
    Expected(
        "[k8s.io] PodSandbox runtime should support sysctls should support unsafe sysctls",
        "gVisor's /proc/sys has no fs.mqueue",
        ".*" + re.escape("can't open '/proc/sys/fs/mqueue/msg_max'") + ".*",
    ),
    Expected(
        "[k8s.io] PodSandbox runtime should support metrics operations runtime should "
        "support listing pod sandbox metrics [Conformance]",
        "a container's processes live in gVisor's kernel, not the host's: no file "
        "descriptor, socket or memory-limit figures per container",
        re.escape(
            "Expected container_file_descriptors container_sockets "
            "container_spec_memory_limit_bytes container_spec_memory_swap_limit_bytes "
            "metrics to be present and they were not"
        )
        + ".*",
    ),
    Expected(
        "[k8s.io] Security Context bucket runtime should support adding capability",
        "gVisor has no bridge ioctls (`brctl addbr`)",
        ".*" + re.escape("brctl: bridge foobar: Inappropriate ioctl for device") + ".*",
    ),
    Expected(
        "[k8s.io] Security Context bucket runtime should support dropping capability",
        "gVisor has no raw sockets unless runsc runs with --net-raw (`ping`)",
        ".*" + re.escape("ping: can't create raw socket: Address family not supported") + ".*",
    ),
    Expected(
        "[k8s.io] Security Context bucket runtime should support ReadonlyPaths",
        "runsc leaves the spec's readonlyPaths writable",
        re.escape("Expected an error to have occurred.  Got:\n    <nil>: nil"),
    ),
    Expected(
        "[k8s.io] Security Context SupplementalGroupsPolicy when SupplementalGroupsPolicy="
        "Merge (Default) if the container's primary UID belongs to some groups in the image, "
        "runtime should add SupplementalGroups to them",
        "gVisor lists the supplementary groups in another order (1000 50000 1234)",
        re.escape('expected log "1000 1234 50000\\n"') + ".*log:1000 50000 1234.*",
    ),
    Expected(
        "[k8s.io] Security Context NoNewPrivs should allow privilege escalation when false",
        "gVisor does not honour the image's set-user-ID file",
        re.escape('expected log "Effective uid: 0\\n"') + ".*log:Effective uid: 1000.*",
    ),
    Expected(
        _SECCOMP + "should support seccomp localhost profile on the container",
        _NO_SECCOMP,
        re.escape("cmd [chmod 400 /]") + ".*Expected an error to have occurred.*",
    ),
    Expected(
        _SECCOMP + "should support seccomp default on the container",
        _NO_SECCOMP,
        r"Expected\n\s*<string>: Seccomp:\s*0.*to contain substring.*",
    ),
    Expected(
        _SECCOMP + "runtime should support an seccomp profile that blocks setting hostname "
        "with SYS_ADMIN",
        _NO_SECCOMP,
        re.escape("cmd [hostname ANewHostName]") + ".*Expected an error to have occurred.*",
    ),
    *_userns_skips(
        "runsc maps no user namespace: no handler of the daemon under test supports them"
    ),
)

HANDLERS: dict[str, Handler] = {
    "runc": Handler({"path": "runc"}),
    # gVisor (Debian's runsc, 2022-12-19): `--network=host`, as that runsc cannot start
    # its own network stack on Linux 6.11 and newer (it mistakes every namespace for the
    # host's). 94 pass, 28 fail (2 of them EXPECTED's), 20 are skipped (14 EXPECTED's), counting
    # exec with a terminal as passing: its own integration test passes under runsc.
    "runsc": Handler({"path": "/usr/bin/runsc", "runtime_args": ["--network=host"]}, RUNSC),
}
DEFAULT_HANDLER = "runc"


@dataclass(frozen=True)
class Spec:
    name: str
    state: str  # passed, failed, skipped, pending, panicked, …
    message: str
    where: str = ""  # file:line of the failure


@dataclass(frozen=True)
class Report:
    specs: list[Spec]
    succeeded: bool  # ginkgo's SuiteSucceeded
    special_failures: list[str]  # ginkgo's SpecialSuiteFailureReasons (a timeout, …)
    total: int  # PreRunStats.TotalSpecs


def read_report(path: Path) -> Report:
    """ginkgo's JSON report: its `It` specs (setup nodes that did not pass count as specs)."""
    suites = json.loads(path.read_text())
    if len(suites) != 1:
        raise SystemExit(f"conformance: {len(suites)} suites in critest's report, not one")
    (suite,) = suites
    specs = []
    for report in suite.get("SpecReports") or []:
        kind = report.get("LeafNodeType")
        state = report.get("State", "")
        if kind != "It" and state == "passed":
            continue
        hierarchy = report.get("ContainerHierarchyTexts") or []
        name = " ".join([*hierarchy, report["LeafNodeText"]])
        failure = report.get("Failure") or {}
        location = failure.get("Location") or {}
        where = f"{location['FileName']}:{location['LineNumber']}" if location else ""
        specs.append(Spec(name.strip() or kind, state, failure.get("Message", "").strip(), where))
    return Report(
        specs,
        bool(suite.get("SuiteSucceeded")),
        list(suite.get("SpecialSuiteFailureReasons") or []),
        int((suite.get("PreRunStats") or {}).get("TotalSpecs", 0)),
    )


@dataclass
class Verdict:
    """What the gate found: each spec's outcome against the table, and the problems."""

    passed: list[Spec] = field(default_factory=list)
    expected: list[tuple[Spec, Expected]] = field(default_factory=list)
    unexpected: list[Spec] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def add_passed(self, spec: Spec, expectation: Expected | None) -> None:
        """A spec that passed: one the table expects not to is a problem (the table is
        to be read again), unless it may pass where the outside world is reachable."""
        self.passed.append(spec)
        if expectation is not None and not expectation.may_pass:
            self.problems.append(
                f"{spec.name}: passed, though expected not to ({expectation.reason}): "
                "the table is to be updated"
            )


def judge(
    report: Report,
    expected: Iterable[Expected],
    *,
    whole_run: bool,
    critest_exit: int,
) -> Verdict:
    """Hold critest's report to the expectations. `whole_run`: no spec was left out on
    purpose, so each expectation must be met and the kit's every spec be there."""
    table = {e.name: e for e in expected if e.applies()}
    verdict = Verdict()
    seen: set[str] = set()
    for spec in report.specs:
        seen.add(spec.name)
        expectation = table.get(spec.name)
        if spec.state == "passed":
            verdict.add_passed(spec, expectation)
        elif spec.state == "skipped" and spec.message.startswith(DISCREPANCY):
            verdict.unexpected.append(spec)
        elif spec.state == "skipped" and not spec.message and not whole_run:
            continue  # not selected for this run
        elif (
            expectation is not None
            and spec.state == expectation.state
            and expectation.matches(spec)
        ):
            verdict.expected.append((spec, expectation))
        else:
            verdict.unexpected.append(spec)
    if verdict.unexpected:
        verdict.problems.append(f"{len(verdict.unexpected)} specs did not pass as expected")
    if whole_run:
        if missing := sorted(set(table) - seen):
            verdict.problems.append(f"expected specs not in the report: {missing}")
        if report.total != KIT_SPECS or len(report.specs) < KIT_SPECS:
            verdict.problems.append(
                f"critest has {report.total} specs and reported {len(report.specs)}, "
                f"the kit's has {KIT_SPECS}"
            )
        least = KIT_SPECS - len(table)
        if len(verdict.passed) < least:
            verdict.problems.append(f"{len(verdict.passed)} specs passed, fewer than {least}")
    if report.special_failures:
        verdict.problems.append(f"critest's suite failed: {report.special_failures}")
    failed = any(spec.state not in ("passed", "skipped") for spec in report.specs)
    if report.succeeded == failed:
        verdict.problems.append(
            f"critest's report says the suite {'succeeded' if report.succeeded else 'failed'}, "
            f"its specs say otherwise"
        )
    if (critest_exit == 0) != report.succeeded:
        verdict.problems.append(
            f"critest exited with {critest_exit} for a suite that "
            f"{'succeeded' if report.succeeded else 'failed'}"
        )
    return verdict


def print_tally(verdict: Verdict, report: Report, seconds: float) -> None:
    """The tally, then each spec that did not pass: expected (with why), then the others."""
    skipped = sum(spec.state == "skipped" for spec in report.specs)
    failed = sum(spec.state not in ("passed", "skipped") for spec in report.specs)
    print(
        f"critest tally: passed {len(verdict.passed)}, failed {failed}, skipped {skipped} "
        f"({len(verdict.expected)} as expected), in {seconds:.0f} s",
        flush=True,
    )
    reasons: dict[str, list[Spec]] = {}
    for spec, expectation in verdict.expected:
        reasons.setdefault(f"{spec.state}, {expectation.reason}", []).append(spec)
    for reason, specs in sorted(reasons.items()):
        print(f"  {reason} ({len(specs)}):")
        for spec in specs:
            print(f"    {spec.name}")
    for spec in verdict.unexpected:
        message = spec.message.replace("\n", "\n      ")
        print(f"  UNEXPECTED ({spec.state}): {spec.name} ({spec.where or 'no location'})")
        print(f"      {message[:3000]}")


def build_images(kit: Path) -> Path:
    """The stand-in images as an OCI layout, built once per version of the builder."""
    builder = kit / "images"
    digest = hashlib.sha256()
    for path in sorted(builder.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    out = CACHE / f"images-{digest.hexdigest()[:16]}"
    if (out / "oci" / "index.json").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    for stale in CACHE.glob("images-*"):
        shutil.rmtree(stale, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.monotonic()
    run_logged([str(builder / "build.sh"), str(out)], CACHE / "build.log")
    print(f"conformance: images built in {time.monotonic() - started:.0f} s", flush=True)
    return out


def run_logged(command: list[str], log: Path, timeout: float = 600) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{command[0]} failed ({result.returncode}):\n{tail}")


def remove_leftovers(runtime: api_pb2_grpc.RuntimeServiceStub) -> list[str]:
    """Pods and containers a suite left behind, removed through the CRI; what they were."""
    pods = runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=30).items
    containers = runtime.ListContainers(api_pb2.ListContainersRequest(), timeout=30).containers
    for container in containers:
        runtime.RemoveContainer(
            api_pb2.RemoveContainerRequest(container_id=container.id), timeout=120
        )
    for sandbox in pods:
        runtime.StopPodSandbox(
            api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=120
        )
        runtime.RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=120
        )
    return [f"pod {pod.metadata.name}" for pod in pods] + [
        f"container {container.metadata.name}" for container in containers
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/conformance", description=__doc__.split("\n")[0])
    parser.add_argument("--kit", type=Path, default=DEFAULT_KIT, help="the conformance kit")
    parser.add_argument(
        "--runtime-handler",
        choices=sorted(HANDLERS),
        help="run critest's pods under this handler (configured in the daemon), held to "
        f"its expectations; without it, the daemon's default handler ({DEFAULT_HANDLER})",
    )
    parser.add_argument(
        "--cgroup-manager",
        choices=("cgroupfs", "systemd"),
        help="the daemon's cgroup driver (without it, the daemon's default: systemd's where "
        "systemd runs the host)",
    )
    parser.add_argument("--focus", action="append", default=[], help="run only matching specs")
    parser.add_argument("--skip", action="append", default=[], help="leave matching specs out")
    parser.add_argument(
        "--no-nri",
        dest="nri",
        action="store_false",
        help="leave [nri] off, and critest's NRI specs skipped",
    )
    parser.add_argument(
        "--as-installed",
        action="store_true",
        help="run the daemon with the installed unit's interpreter options "
        f"({' '.join(INSTALLED_FLAGS)})",
    )
    parser.add_argument("critest_args", nargs="*", help="more critest arguments, after --")
    args = parser.parse_args(argv)
    critest = args.kit / "bin" / "critest"
    if not critest.exists():
        print(f"conformance: no critest at {critest} (the kit is not beside this clone)")
        return 2
    handler_name = args.runtime_handler or DEFAULT_HANDLER
    with critest_site(args.kit, handler_name) as (work, network, settings):
        return run_critest(args, critest, handler_name, work, network, settings)


@contextmanager
def critest_site(
    kit: Path, handler_name: str
) -> Iterator[tuple[Path, CniTestNetwork, dict[str, object]]]:
    """A work directory (its paths short: the daemon's socket path must stay under 108
    bytes), the stand-in images served from a local registry, a CNI network, and the
    daemon's settings: every registry critest names mirrored to that one, the handler."""
    images = build_images(kit)
    work = Path(tempfile.mkdtemp(prefix="cs-conf-", dir="/tmp"))
    work.chmod(0o711)
    registry = network = None
    try:
        registry = start_registry(work / "registry")
        run_logged([str(kit / "images" / "push.sh"), str(images), registry.host], work / "push.log")
        network = make_test_network(work, 0, slow=False)
        mirrors = {name: [registry.url] for name in MIRRORED}
        settings: dict[str, object] = {
            "log_level": "info",
            "images": {"insecure_registries": [registry.host], "mirrors": mirrors},
            "runtime": {
                "default_handler": handler_name,
                "handlers": {handler_name: HANDLERS[handler_name].runtime},
            },
        }
        yield work, network, settings
    finally:
        if registry is not None:
            registry.stop()
        if network is not None:
            network.remove()
        unmount_below(work)
        shutil.rmtree(work, ignore_errors=True)


def run_critest(
    args: argparse.Namespace,
    critest: Path,
    handler_name: str,
    work: Path,
    network: CniTestNetwork,
    settings: dict[str, object],
) -> int:
    handler = HANDLERS[handler_name]
    daemon = None
    try:
        if args.cgroup_manager:
            settings["cgroup_manager"] = args.cgroup_manager
        nri_socket = work / "nri.sock"
        if args.nri:
            # critest's NRI specs connect their own plugin to this socket. NRI's budgets
            # are the defaults, as everywhere in this gate: only paths and the mirrors of
            # the test registry differ from what a user runs.
            settings["nri"] = {"enable": True, "socket_path": str(nri_socket)}
        flags = INSTALLED_FLAGS if args.as_installed else []
        daemon = Daemon(work, network, settings=settings, interpreter_flags=flags)
        daemon.start()
        endpoint = f"unix://{daemon.socket}"
        report_path = work / "report.json"
        command = [
            str(critest),
            f"--runtime-endpoint={endpoint}",
            f"--image-endpoint={endpoint}",
            "--ginkgo.no-color",
            f"--ginkgo.json-report={report_path}",
            *([f"--runtime-handler={args.runtime_handler}"] if args.runtime_handler else []),
            *([f"-nri-socket={nri_socket}"] if args.nri else []),
            *(f"--ginkgo.focus={focus}" for focus in args.focus),
            *(f"--ginkgo.skip={skip}" for skip in args.skip),
            *args.critest_args,
        ]
        log = CACHE / "critest.log"
        print(
            f"conformance: {' '.join(command[:1])} against {endpoint}, handler {handler_name}, "
            f"cgroup driver {args.cgroup_manager or 'the default'} (log: {log})",
            flush=True,
        )
        started = time.monotonic()
        with log.open("wb") as out:
            # critest's own temp files go to the work directory, which is removed after.
            env = dict(os.environ, TMPDIR=str(work))
            critest_exit = subprocess.run(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=CRITEST_TIMEOUT,
                cwd=work,
                env=env,
                check=False,
            ).returncode
        seconds = time.monotonic() - started
        if not report_path.exists():
            print(log.read_text(errors="replace")[-5000:])
            print(f"conformance: critest exited with {critest_exit} and wrote no report")
            return 1
        shutil.copy(report_path, CACHE / "report.json")
        report = read_report(report_path)
        expected = [*EXPECTED, *handler.expected]
        if not args.nri:
            expected += [_nri_skips(s) for s in report.specs if s.name.startswith(NRI_SPECS)]
        whole_run = not (args.focus or args.skip or args.critest_args)
        verdict = judge(report, expected, whole_run=whole_run, critest_exit=critest_exit)
        print_tally(verdict, report, seconds)
        problems = verdict.problems
        if left := remove_leftovers(daemon.runtime()):
            problems.append(f"critest left {len(left)} objects behind: {', '.join(left)}")
        daemon.stop()
        shutil.copy(daemon.log_path, CACHE / "daemon.log")
        if leaks := {**daemon.leaks(), **runtime_leaks(daemon)}:
            problems.append(f"the daemon held, with no pods left: {leaks}")
        for problem in problems:
            print(f"conformance: FAILED: {problem}")
        if not problems:
            held = "every spec" if whole_run else "the specs run"
            print(
                f"conformance: passed ({held} as expected, handler {handler_name}, cgroup "
                f"driver {args.cgroup_manager or 'the default'})"
            )
        return 1 if problems else 0
    finally:
        if daemon is not None:
            daemon.stop()


if __name__ == "__main__":
    sys.exit(main())
