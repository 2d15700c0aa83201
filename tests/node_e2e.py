"""Kubernetes' node conformance suite ([NodeConformance], the suite CRI-O's and containerd's
releases are gated on) against a real cri-shim daemon, offline: an exact gate.

The kit beside the repository (`../shared/node-e2e`: Kubernetes v1.28.4's e2e_node.test,
its kubelet, ginkgo and agnhost, and a builder of the images the specs pull) provides the
suite; `../shared/conformance` the base images. This unpacks the binaries (cached under
`.cache/node-e2e/`), builds the images (cached, rebuilt when a builder changes: the kit's
images.sh, then `tests/node_e2e_images.sh` on top for what its stand-ins lack), serves them
from Debian's docker-registry on 127.0.0.1, starts the daemon with its defaults plus only
the mirrors, its socket and roots, and a `test-handler` runtime handler (runc), gives the
node an address of its own (a /32 on a bridge with no ports: kube-apiserver's proxy to the
node dials only global-unicast addresses), pulls the images once through the CRI, and runs
the suite through ginkgo (it starts etcd, kube-apiserver and the kubelet itself) with a
JUnit report. Every spec that does not pass is expected by name, with its reason and the
message it fails with (EXPECTED): no runtime could pass it offline. Any other outcome fails
the run, as does anything left behind once the suite is done: pods (removed through the
CRI), mounts under /var/lib/kubelet and the directory itself, kubepods cgroups, the bridge
and its address, the registry, the daemon, or a kubelet, etcd or kube-apiserver.

    scripts/node-e2e [--runtime cri-shim|containerd] [--cgroup-driver cgroupfs|systemd]
                     [--subset ci|cgroup] [--serial] [--focus REGEX]... [--skip REGEX]...
                     [--nodes N] [--kit DIR]

Without --subset, --serial or --focus: the whole [NodeConformance] set without Flaky, Slow
and Serial (the 212 of the kit's nodeconformance-specs.txt), each of which must be in the
report. Options, for CI and for the cgroup v2 guest (scripts/guest, tests/guest/lane.sh):

- `--subset ci`: what CI runs, the whole set but the specs CI_LEFT_OUT names (the two
  private-registry pulls, 15 minutes each of showing a pull fail); `--subset cgroup`: the specs
  that exercise cgroups (resource limits, QoS, stats, OOM, the downward API's resource
  fields, pod resources), chosen by name (CGROUP_SUBSET), for the guest, where the whole
  set does not fit under emulation.
- `--cgroup-driver systemd`: kubelet's `cgroupDriver` systemd, the daemon's its default
  (`cgroup_manager = "auto"`: systemd's where systemd is PID 1, as in the guest); kubelet
  is then started through systemd-run, kept on PATH only with this driver.
- `--serial`: the three [NodeConformance] [Serial] specs, one at a time (--nodes=1, one
  ginkgo run each, SERIAL_SPECS). One ("MirrorPodWithGracePeriod ... the container runtime
  is temporarily down") stops and starts the runtime's systemd unit over D-Bus (the unit
  of the pid in --container-runtime-pid-file): the daemon this runner starts is no unit,
  so that spec is in the table as failing (RUNTIME_DOWN); it is for a lane whose daemon is
  the installed unit (scripts/install) to run it. With --focus, only the Serial specs it
  names.
- `--as-installed-unit`: the daemon installed by scripts/install as its systemd unit
  (socket-activated unless `--no-socket-activation`; tests/guest/node_e2e_site.py), not
  one started here: the cgroup v2 guest's (tests/guest/lane.sh, steps node-e2e and
  node-e2e-serial). `--kubelet-address 0.0.0.0`: kubelet's --address, for the specs that
  read kubelet's metrics at localhost:10255 (the two Serial ones that do) rather than at
  the node's address. `--prepare`: only unpack the binaries and build the images, where
  their tools are (scripts/guest runs it on the host before a node-e2e step); with the
  MirrorPod NFS spec selected (`--serial`, or a --focus naming it) also its NFS server's
  image, which a run pushes only where the kernel has NFS (the guest's).
- `--runtime containerd`: the same specs on the same harness against containerd 1.6
  (`../shared/peers/containerd`), for side-by-side figures: tallied, never gated.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from cri_shim.runtime.cgroup_driver import systemd_booted
from tests.conformance import (
    DEFAULT_KIT as CONFORMANCE_KIT,
)
from tests.conformance import (
    MIRRORED,
    Expected,
    Spec,
    Verdict,
    build_images,
    remove_leftovers,
    run_logged,
)
from tests.harness import REPO

KIT = REPO.parent / "shared" / "node-e2e"
CONTAINERD_PEER = REPO.parent / "shared" / "peers" / "containerd"
CACHE = REPO / ".cache" / "node-e2e"
IMAGES_EXTRA = REPO / "tests" / "node_e2e_images.sh"
KUBELET_ROOT = Path("/var/lib/kubelet")
# What any kubelet on the machine makes there whatever its --root-dir (its device manager's
# socket directory): another's may hold it while the suite runs.
SHARED_IN_ROOT = ("device-plugins",)
POD_LOGS = (Path("/var/log/pods"), Path("/var/log/containers"))
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The node's own address: global unicast (kube-apiserver proxies only to such), on a
# bridge of its own with no ports, so that traffic to it never leaves the machine.
NODE_BRIDGE = "cse2e0"
NODE_IP = "10.254.77.1"
FOCUS = r"\[NodeConformance\]"
SKIP = r"\[Flaky\]|\[Slow\]|\[Serial\]"
SUITE_TIMEOUT = 120 * 60
# A Serial spec's run. The one that stops and starts the runtime's unit waits for each of
# the two jobs without a bound in this suite (v1.28.4): its D-Bus connection lives 10 s,
# and a job that ends later is never reported (kubernetes/kubernetes#116872, bounded in
# 1.29 by #119197). ginkgo's timeout ends such a run with a report, and the node is
# cleaned; the spec itself takes 3-8 minutes in the emulated guest.
SERIAL_TIMEOUT = 20 * 60
# kubelet reads container and pod figures from the CRI (ContainerStats,
# ListPodSandboxStats) instead of cAdvisor, which knows only docker's, containerd's and
# CRI-O's cgroups.
FEATURE_GATES = "PodAndContainerStatsFromCRI=true"
# (layout tag, registry path) the runner pushes: images.sh's and tests/node_e2e_images.sh's.
PUSHED = (
    ("agnhost", "e2e-test-images/agnhost:2.45"),
    ("nonroot", "e2e-test-images/nonroot:1.4"),
    ("busybox-e2e", "e2e-test-images/busybox:1.29-4"),
    ("httpd", "e2e-test-images/httpd:2.4.38-4"),
    ("nonewprivs", "e2e-test-images/nonewprivs:1.3"),
    ("nginx", "e2e-test-images/nginx:1.14-4"),
    ("pause-3.9", "pause:3.9"),
)
# The images the specs pull, under their upstream names (pulled once before the suite;
# nginx is the mirror pod specs' static pods').
IMAGES = tuple(f"registry.k8s.io/{path}" for _, path in PUSHED)
# The NFS server of the MirrorPod Serial spec (e2e's volume/nfs:1.3): a Debian root file
# system of its own (tests/node_e2e_nfs.sh, ~30 s), so built and pushed only for that spec,
# and only where the kernel serves and mounts NFS (elsewhere the spec fails as tabled).
NFS_BUILDER = REPO / "tests" / "node_e2e_nfs.sh"
NFS_FIXTURES = REPO / "tests" / "fixtures" / "node-e2e-nfs"
NFS_PUSHED = (("volume-nfs", "e2e-test-images/volume/nfs:1.3"),)
NFS_IMAGE = f"registry.k8s.io/{NFS_PUSHED[0][1]}"

# The private registry specs: both pull gcr.io/authenticated-image-pulling/alpine:3.7,
# which needs Google's credentials, and wait 3 x 5 minutes for the container to run.
_PULL_NEVER_RUNS = re.escape(
    'All 3 attempts failed: expected container state: Running, got: "Waiting"'
)
_NEW_IMAGE = (
    "when running a container with a new image should be able to pull from private registry"
)


def dummy_links() -> bool:
    """Whether this kernel makes `dummy` links (in a network namespace of its own)."""
    probe = ["unshare", "--net", "ip", "link", "add", "probe0", "type", "dummy"]
    return subprocess.run(probe, capture_output=True).returncode == 0


_MEMORY_DROPPED = "".join(
    rf"\t\.{field}:\n\t\tExpected\n\t\t    <\*uint64 \| 0x0>: nil\n\t\tnot to be <nil>\n"
    for field in ("AvailableBytes", "UsageBytes", "RSSBytes", "PageFaults", "MajorPageFaults")
)
_CONTAINER_MEMORY = (
    r"\.Pods\[summary-test-\d+::stats-busybox-[01]\]\.Containers\[busybox-container\]\.Memory:\n"
    r"\tExpected\n\t    <string>: MemoryStats\n\tto match fields: \{\n"
    + _MEMORY_DROPPED
    + r"\t\}\n"
)
_BETWEEN = r"[\[\], \t\n]*"
SUMMARY_API = Expected(
    "[sig-node] Summary API [NodeConformance] when querying /stats/summary should report "
    "resource usage through the stats api",
    "kubelet 1.28 under PodAndContainerStatsFromCRI keeps only the working set of a "
    "container's CRI memory figures (usage, RSS, page faults and what is available, which "
    "the daemon serves, are dropped; later kubelets copy them), and its `misc` system "
    "container needs --system-cgroups, with which kubelet moves every process of the "
    "host's root cgroup into it: on a shared machine not the suite's to move (where systemd "
    "runs the host the spec expects no misc). Pod memory, processes, CPU, network, volumes "
    "and the kubelet, runtime and pods system containers must match",
    r"Timed out after \d+\.\d+s\.\nExpected\n    <string>: Summary\nto match fields: \{\n"
    # misc is missing only where systemd does not run the host (the guest's kubelet
    # expects none)
    r"(?:\[?\.Node\.SystemContainers:\n\tmissing expected element misc\]?\n)?"
    rf"(?:{_BETWEEN}{_CONTAINER_MEMORY}){{2}}{_BETWEEN}\}}",
    where="/opt/node-e2e/src/test/e2e_node/summary_test.go:336",
)

EXPECTED: tuple[Expected, ...] = (
    SUMMARY_API,
    Expected(
        f"[sig-node] Container Runtime blackbox test {_NEW_IMAGE} with secret [NodeConformance]",
        "pulls gcr.io/authenticated-image-pulling/alpine:3.7 with a secret of Google's "
        "credentials: not to be had offline",
        _PULL_NEVER_RUNS,
        where="/opt/node-e2e/src/test/e2e/common/node/runtime.go:366",
    ),
    Expected(
        "[sig-node] Container Runtime Conformance Test container runtime conformance blackbox "
        f"test {_NEW_IMAGE} with credential provider [NodeConformance]",
        "pulls gcr.io/authenticated-image-pulling/alpine:3.7 with Google's credential provider "
        "(GCE's metadata server): not to be had offline",
        _PULL_NEVER_RUNS,
        where="/opt/node-e2e/src/test/e2e_node/runtime_conformance_test.go:149",
    ),
    Expected(
        "[sig-node] PrivilegedPod [NodeConformance] should enable privileged commands [LinuxOnly]",
        "this kernel makes no `dummy` links (`ip link add dummy1 type dummy` fails on the "
        "host too)",
        re.escape(
            'cmd [ip link add dummy1 type dummy], stdout "", stderr "ip: RTNETLINK answers: '
            'Operation not supported": command terminated with exit code 2'
        ),
        where="/opt/node-e2e/src/test/e2e/common/node/privileged.go:76",
        applies=lambda: not dummy_links(),
    ),
)

# The three [NodeConformance] [Serial] specs, run one at a time with --serial.
SERIAL_SPECS = (
    "[sig-node] MirrorPodWithGracePeriod when create a mirror pod  and the container runtime "
    "is temporarily down during pod termination [NodeConformance] [Serial] [Disruptive] the "
    "mirror pod should terminate successfully",
    "[sig-node] MirrorPod when recreating a static pod it should launch successfully even if "
    "it temporarily failed termination due to volume failing to unmount [NodeConformance] "
    "[Serial]",
    "[sig-node] POD Resources [Serial] [Feature:PodResources][NodeFeature:PodResources] when "
    "querying /metrics [NodeConformance] should report the values for the podresources metrics",
)
# The one that stops the runtime through its systemd unit: only the installed unit passes.
RUNTIME_DOWN = SERIAL_SPECS[0]
SERIAL_EXPECTED_ELSEWHERE = Expected(
    RUNTIME_DOWN,
    "the spec stops and starts the runtime's systemd unit over D-Bus (the unit of the pid in "
    "--container-runtime-pid-file): the daemon this runner starts is no unit; it passes "
    "only where the daemon is the installed unit under systemd",
    # performContainerRuntimeUnitOp's two checks before it asks systemd (not yet seen here:
    # --serial has not run on this host)
    r"(Failed to setup dbus connection|Failed to find container runtime name).*",
)


def kernel_has_nfs() -> bool:
    """Whether this kernel mounts NFS (built in, or a module it could load)."""
    filesystems = Path("/proc/filesystems").read_text().split()
    modules = Path("/lib/modules") / os.uname().release
    return "nfs" in filesystems or any(modules.glob("kernel/fs/nfs/nfs.ko*"))


# The two other Serial specs, where this host keeps them from passing whatever the runtime.
SERIAL_EXPECTED_HERE = (
    Expected(
        SERIAL_SPECS[1],
        "its NFS server pod (volume/nfs:1.3) runs the kernel's NFS server and kubelet mounts "
        "the export with the kernel's NFS client: this kernel has neither (no nfs in "
        "/proc/filesystems, no modules to load), so the stand-in for its image "
        "(tests/node_e2e_nfs.sh) is pushed only where the kernel has them (the cgroup v2 "
        "guest's, where the spec passes)",
        r'Timed out after \d+\.\d+s\.\nExpected Pod to be in <v1\.PodPhase>: "Running".*',
        where="/opt/node-e2e/src/test/e2e/framework/volume/fixtures.go:363",
        applies=lambda: not kernel_has_nfs(),
    ),
    Expected(
        SERIAL_SPECS[2],
        "the spec changes kubelet's configuration and restarts kubelet as the systemd unit "
        "the suite started it in (`sudo systemctl list-units *kubelet*`, then `systemctl "
        "restart`): where systemd is not PID 1 there is no such unit",
        re.escape("exit status 1"),
        where="/opt/node-e2e/src/test/e2e_node/util.go:359",
        applies=lambda: not systemd_booted(),
    ),
)


# Specs that exercise cgroups, by name (a substring of the full name): resource limits,
# QoS, stats, OOM, the downward API's resource fields, pod resources.
CGROUP_SUBSET = (
    # stats
    "Summary API [NodeConformance] when querying /stats/summary should report resource usage",
    # QoS
    "Kubelet Cgroup Manager",  # the QoS cgroups, and each QoS class's pods in theirs
    "Swap [NodeConformance][LinuxOnly] with configuration QOS",
    # OOM
    "OOMKiller [LinuxOnly] [NodeConformance] single process container The containers "
    "terminated by OOM killer should have the reason set to OOMKilled",
    # memory-backed volumes count against the pod's memory
    "Kubelet Volume Manager Volume Manager On termination of pod with memory backed volume",
    # the downward API's resource fields (limits, requests, node allocatable)
    "Downward API should provide container's limits.cpu/memory and requests.cpu/memory as env vars",
    "Downward API should provide default limits.cpu/memory from node allocatable",
    "Downward API volume should provide container's",
    "Downward API volume should provide node allocatable",
    "Projected downwardAPI should provide container's",
    "Projected downwardAPI should provide node allocatable",
    # pod-level resources: a RuntimeClass's overhead sizes the pod's cgroup
    "RuntimeClass should schedule a Pod requesting a RuntimeClass and initialize its Overhead",
    "RuntimeClass should schedule a Pod requesting a RuntimeClass without PodOverhead",
)
# What CI leaves out of the whole set to fit its budget (the README has the whole set's
# figures): the two private-registry specs, which only show for 15 minutes each that an
# image needing Google's credentials is not pulled offline.
CI_LEFT_OUT = (
    "with a new image should be able to pull from private registry with secret",
    "with a new image should be able to pull from private registry with credential provider",
)


# --- the pure logic: spec lists, the JUnit report, the verdict -------------------------
def spec_name(text: str) -> str:
    """A spec's name with its runs of white space as one space: ginkgo's text of a spec
    keeps the doubled spaces of its containers' texts, the kit's list not always."""
    return " ".join(text.split())


def read_spec_list(path: Path) -> list[str]:
    """The kit's nodeconformance-specs.txt: one spec a line, `name<TAB>file:line`."""
    return [
        spec_name(line.split("\t", 1)[0])
        for line in path.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def select_subset(specs: Iterable[str], patterns: Iterable[str]) -> list[str]:
    """The specs whose name holds one of `patterns`; each pattern must name at least one
    spec (a pattern naming none is a subset gone stale with the suite)."""
    specs = list(specs)
    chosen: list[str] = []
    for pattern in patterns:
        found = [spec for spec in specs if pattern in spec]
        if not found:
            raise ValueError(f"no spec of the suite is named like {pattern!r}")
        chosen.extend(spec for spec in found if spec not in chosen)
    return chosen


def focus_of(names: Iterable[str]) -> str:
    """A ginkgo --focus regex (RE2) that selects these full spec names: each whole, to its
    end (ginkgo's text of a spec has more before its first container's)."""
    special = re.compile(r"([\\.+*?()|\[\]{}^$])")
    whole = (special.sub(r"\\\1", " ".join(name.split())).replace(" ", r"\s+") for name in names)
    return "(" + "|".join(whole) + ")$"


_LOCATION = re.compile(r"In \[[A-Za-z]+\] at: (\S+):(\d+)")


@dataclass(frozen=True)
class Junit:
    specs: list[Spec]
    succeeded: bool
    special_failure: str
    tests: int


def read_junit(path: Path) -> Junit | None:
    """ginkgo's JUnit report: its `[It]` specs (setup nodes that did not pass count as
    specs), each with its state, message and the file:line it failed at. Specs that were
    not selected show as skipped with the bare message `skipped`: left out. None for a
    report of no suite, which ginkgo writes when the suite's process died before it
    reported (killed, or crashed)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        return None
    if len(suites) != 1:
        raise ValueError(f"{len(suites)} suites in the JUnit report, not one")
    (suite,) = suites
    properties = {p.get("name"): p.get("value", "") for p in suite.iter("property")}
    specs = []
    for case in suite.findall("testcase"):
        name = case.get("name", "")
        state = case.get("status", "")
        if not name.startswith("[It] "):
            if state == "passed":
                continue
        else:
            name = name.removeprefix("[It] ")
        message, where = "", ""
        for tag in ("failure", "error"):
            if (node := case.find(tag)) is not None:
                message = node.get("message", "").strip()
                text = node.text or ""
                if match := _LOCATION.search(text):
                    where = f"{match.group(1)}:{match.group(2)}"
                break
        if (node := case.find("skipped")) is not None:
            message = node.get("message", "").strip()
            if message == "skipped":
                continue  # not selected
            message = message.removeprefix("skipped - ")
        specs.append(Spec(spec_name(name), state, message, where))
    return Junit(
        specs,
        properties.get("SuiteSucceeded") == "true",
        properties.get("SpecialSuiteFailureReason", ""),
        len(specs),
    )


def judge(report: Junit, expected: Iterable[Expected], wanted: list[str] | None) -> Verdict:
    """Hold the report to the table. `wanted`: the specs that must each be in the report
    (the whole set, or a subset by name); None where a free --focus chose them."""
    table = {spec_name(e.name): e for e in expected if e.applies()}
    verdict = Verdict()
    for spec in report.specs:
        expectation = table.get(spec.name)
        if spec.state == "passed":
            verdict.add_passed(spec, expectation)
        elif (
            expectation is not None
            and spec.state == expectation.state
            and (expectation.matches(spec))
        ):
            verdict.expected.append((spec, expectation))
        else:
            verdict.unexpected.append(spec)
    if verdict.unexpected:
        verdict.problems.append(f"{len(verdict.unexpected)} specs did not pass as expected")
    if wanted is not None:
        seen = {spec.name for spec in report.specs}
        if missing := [name for name in map(spec_name, wanted) if name not in seen]:
            verdict.problems.append(f"{len(missing)} specs not in the report: {missing[:5]}")
    if report.special_failure:
        verdict.problems.append(f"the suite failed: {report.special_failure}")
    failed = any(spec.state not in ("passed", "skipped") for spec in report.specs)
    if report.succeeded == failed:
        verdict.problems.append("the report's verdict disagrees with its specs")
    return verdict


def tally_lines(verdict: Verdict, report: Junit, seconds: float, label: str) -> list[str]:
    """The tally, then a table of every spec that did not pass: expected (with why), then
    the others with their messages."""
    skipped = sum(spec.state == "skipped" for spec in report.specs)
    failed = sum(spec.state not in ("passed", "skipped") for spec in report.specs)
    lines = [
        f"node-e2e tally ({label}): passed {len(verdict.passed)}, failed {failed}, "
        f"skipped {skipped} ({len(verdict.expected)} as expected), in {seconds:.0f} s"
    ]
    for spec, expectation in verdict.expected:
        lines.append(f"  expected {spec.state}: {spec.name}\n      why: {expectation.reason}")
    for spec in verdict.unexpected:
        message = spec.message.replace("\n", "\n      ")[:2000]
        lines.append(f"  UNEXPECTED {spec.state}: {spec.name} ({spec.where or 'no location'})")
        lines.append(f"      {message}")
    return lines


# --- the site: binaries, images, registry, node address, runtime -----------------------
def unpack_binaries(kit: Path) -> Path:
    """The kit's binaries, unpacked and checked (kept while the kit's are older)."""
    out = CACHE / "bin"
    run_logged([str(kit / "unpack"), str(out)], CACHE / "unpack.log")
    return out


def build_cached(
    kind: str,
    inputs: Iterable[Path],
    commands: Callable[[Path], list[list[str]]],
    *,
    seed: bytes = b"",
    env: dict[str, str] | None = None,
    unavailable: Callable[[], str | None] = lambda: None,
) -> Path:
    """The OCI layout `commands(out)` build into `out`/oci, built once per version of
    `inputs` (and `seed`) under CACHE/`kind`-<digest>; an older version goes when a new one
    is built. `unavailable()` says why it cannot be built here, if it cannot."""
    digest = hashlib.sha256(seed)
    for path in inputs:
        digest.update(path.name.encode() + path.read_bytes())
    out = CACHE / f"{kind}-{digest.hexdigest()[:16]}"
    if (out / "oci" / "index.json").exists():
        return out / "oci"
    if (why := unavailable()) is not None:
        raise SystemExit(why)
    for stale in CACHE.glob(f"{kind}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.monotonic()
    log = CACHE / f"{kind}.log"
    with log.open("wb") as sink:
        for command in commands(out):
            if subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=env).returncode:
                shutil.rmtree(out, ignore_errors=True)
                raise SystemExit(f"node-e2e: {command[0]} failed:\n{log.read_text()[-3000:]}")
    print(f"node-e2e: {kind} built in {time.monotonic() - started:.0f} s", flush=True)
    return out / "oci"


def build_node_images(kit: Path, binaries: Path, registry: str) -> Path:
    """The OCI layout of the stand-ins, built once per version of the builders (the
    conformance kit's, the node kit's images.sh and agnhost, tests/node_e2e_images.sh)."""
    base = build_images(CONFORMANCE_KIT)
    return build_cached(
        "images",
        [
            kit / "images.sh",
            binaries / "agnhost",
            IMAGES_EXTRA,
            *sorted((REPO / "tests" / "fixtures" / "node-e2e").glob("*")),
        ],
        lambda out: [[str(kit / "images.sh"), str(out)], [str(IMAGES_EXTRA), str(out / "oci")]],
        seed=base.name.encode(),
        env=dict(
            os.environ, CRITEST_IMAGES=str(base), NODE_E2E_BIN=str(binaries), REGISTRY=registry
        ),
    )


def runs_nfs_spec(runs: Iterable[Run]) -> bool:
    """Whether one of these runs is of the MirrorPod spec that needs an NFS server."""
    nfs = spec_name(SERIAL_SPECS[1])
    return any(nfs in map(spec_name, run.wanted or ()) for run in runs)


def build_nfs_image() -> Path:
    """The OCI layout of the NFS server's stand-in, built once per version of its builder
    and entrypoint: where mmdebstrap is (the guest has none: scripts/guest's host runs
    `--prepare --serial` first)."""
    return build_cached(
        "nfs",
        [NFS_BUILDER, *sorted(NFS_FIXTURES.glob("*"))],
        lambda out: [[str(NFS_BUILDER), str(out / "oci")]],
        unavailable=lambda: (
            None
            if shutil.which("mmdebstrap")
            else (
                "node-e2e: the NFS server's image is not built and there is no mmdebstrap here: "
                "run `python -m tests.node_e2e --prepare --serial` where it is first"
            )
        ),
    )


def push_images(
    layout: Path, registry: str, log: Path, pushed: Iterable[tuple[str, str]] = PUSHED
) -> None:
    with log.open("ab") as sink:
        for tag, path in pushed:
            command = [
                "skopeo",
                "copy",
                "--all",
                "--quiet",
                "--dest-tls-verify=false",
                f"oci:{layout}:{tag}",
                f"docker://{registry}/{path}",
            ]
            if subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"node-e2e: pushing {tag} failed (see {log})")


@contextmanager
def node_address() -> Iterator[str]:
    """The node's own address: a /32 on a bridge with no ports, removed afterwards."""
    subprocess.run(["ip", "link", "del", NODE_BRIDGE], capture_output=True, check=False)
    for command in (
        ["ip", "link", "add", NODE_BRIDGE, "type", "bridge"],
        ["ip", "addr", "add", f"{NODE_IP}/32", "dev", NODE_BRIDGE],
        ["ip", "link", "set", NODE_BRIDGE, "up"],
    ):
        subprocess.run(command, check=True, capture_output=True)
    try:
        yield NODE_IP
    finally:
        subprocess.run(["ip", "link", "del", NODE_BRIDGE], capture_output=True, check=False)


def kubelet_config(kit: Path, work: Path, driver: str) -> Path:
    """The kit's KubeletConfiguration with the cgroup driver asked for."""
    text = kit.joinpath("kubelet-config.yaml").read_text()
    text, found = re.subn(r"(?m)^cgroupDriver: \S+", f"cgroupDriver: {driver}", text)
    if found != 1:
        raise SystemExit("node-e2e: the kit's kubelet-config.yaml names no cgroupDriver")
    path = work / "kubelet-config.yaml"
    path.write_text(text)
    return path


def pull_images(runtime_images: object, images: Iterable[str]) -> None:
    """Each image once through the CRI before the suite: the specs' pulls then find it."""
    from cri_shim.api.v1 import api_pb2

    for image in images:
        runtime_images.PullImage(  # type: ignore[attr-defined]
            api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image)), timeout=600
        )


def path_without_systemd_run(farm: Path) -> str:
    """A PATH with every command of this one but systemd-run: where systemd-run is on
    PATH the suite starts the kubelet through it, which fails where systemd is not PID 1.
    `farm` gets a link to each command (systemd-run shares its directory with the rest)."""
    farm.mkdir(parents=True, exist_ok=True)
    for directory in os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(":"):
        if not directory or not Path(directory).is_dir():
            continue
        for command in Path(directory).iterdir():
            link = farm / command.name
            if command.name != "systemd-run" and not link.exists() and os.access(command, os.X_OK):
                link.symlink_to(command)
    return str(farm)


def path_with_sudo(path: str, shims: Path) -> str:
    """`path`, with a `sudo` before it where it has none. The suite runs as root, as the
    node images it is written for do, yet calls some commands through sudo (kubelet's
    restart by `sudo systemctl`, for the specs that change kubelet's configuration):
    there sudo only runs its command, and so does this one."""
    if shutil.which("sudo", path=path):
        return path
    shims.mkdir(parents=True, exist_ok=True)
    sudo = shims / "sudo"
    sudo.write_text('#!/bin/sh\n# The suite runs as root: run the command as it is.\nexec "$@"\n')
    sudo.chmod(0o755)
    return f"{shims}:{path}"


def kubelet_state() -> list[str]:
    """What a kubelet keeps in /var/lib/kubelet (its pods, plugins, state files), beyond
    the directories any kubelet shares there."""
    if not KUBELET_ROOT.exists():
        return []
    return sorted(p.name for p in KUBELET_ROOT.iterdir() if p.name not in SHARED_IN_ROOT)


def kubepods_cgroups() -> list[str]:
    """kubelet's cgroups (cgroupfs: kubepods/…, systemd: kubepods.slice/…), top ones."""
    found = []
    for controller in (CGROUP_ROOT, *CGROUP_ROOT.iterdir()):  # v2's one, v1's each
        for name in ("kubepods", "kubepods.slice"):
            if (controller / name).is_dir():
                found.append(str(controller / name))
    return found


# kubelet's summary API reports the runtime's and its own cgroups as system containers
# ("runtime", "kubelet"; the Summary API spec expects both): the runner puts the runtime
# into --runtime-cgroups and the suite, whose child the kubelet is, into --kubelet-cgroups.
RUNTIME_CGROUP = "/node-e2e-runtime"
KUBELET_CGROUP = "/node-e2e-kubelet"


def cgroup_dirs(name: str) -> list[Path]:
    """A cgroup's directory in each hierarchy (one on cgroup v2)."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT / name.lstrip("/")]
    return [
        h / name.lstrip("/")
        for h in CGROUP_ROOT.iterdir()
        if h.is_dir() and not h.is_symlink() and (h / "cgroup.procs").exists()
    ]


def move_into_cgroup(name: str, pid: int) -> None:
    """`pid` (a runtime the runner started) into the cgroup `name`, made in each hierarchy."""
    for directory in cgroup_dirs(name):
        directory.mkdir(exist_ok=True)
        for inherited in ("cpuset.cpus", "cpuset.mems"):  # v1's cpuset starts empty
            if (directory / inherited).exists() and not (directory / inherited).read_text().strip():
                (directory / inherited).write_text((directory.parent / inherited).read_text())
        (directory / "cgroup.procs").write_text(f"{pid}\n")


def remove_system_cgroups() -> list[str]:
    """The runner's and kubelet's system cgroups removed (what of the runtime's is still
    in them goes back to the root first); those that could not be."""
    left = []
    for name in (RUNTIME_CGROUP, KUBELET_CGROUP):
        for directory in cgroup_dirs(name):
            if not directory.exists():
                continue
            procs = directory / "cgroup.procs"
            for pid in procs.read_text().split():
                try:
                    (directory.parent / "cgroup.procs").write_text(f"{pid}\n")
                except OSError:
                    pass
            try:
                directory.rmdir()
            except OSError:
                left.append(str(directory))
    return left


def remove_cgroups(tops: Iterable[str]) -> None:
    for top in tops:
        for directory, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
            try:
                os.rmdir(directory)
            except OSError:
                pass


def suite_processes(binaries: Path) -> list[int]:
    """Processes run from the unpacked binaries (the suite, its kubelet)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.readlink(proc / "exe").startswith(os.path.realpath(binaries)):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def other_kubelets(binaries: Path) -> set[int]:
    """kubelets on the machine other than the suite's. Each removes the /var/log/pods
    directories of the pods it does not know (its log garbage collection), the suite's
    too: a spec then reads no container log ("failed to try resolving symlinks")."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            exe = os.readlink(proc / "exe") if proc.name.isdigit() else ""
        except OSError:
            continue
        if Path(exe).name == "kubelet" and not exe.startswith(os.path.realpath(binaries)):
            found.add(int(proc.name))
    return found


@contextmanager
def watching_other_kubelets(binaries: Path, seen: set[int]) -> Iterator[None]:
    """Add to `seen` every other kubelet that runs while the block does (every 5 s)."""
    import threading

    done = threading.Event()

    def watch() -> None:
        while not done.wait(5):
            seen.update(other_kubelets(binaries))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# --- the runtimes under test -----------------------------------------------------------
@dataclass
class Runtime:
    """The runtime the suite runs against: its socket, pid file and process name."""

    name: str
    socket: Path
    pid_file: Path
    stop: object  # () -> list[str]: stops it, returns what it still held
    cgroup: str = RUNTIME_CGROUP  # kubelet's --runtime-cgroups


def channel_to(socket: Path) -> object:
    import grpc

    return grpc.insecure_channel(f"unix://{socket}")


@contextmanager
def cri_shim_runtime(work: Path, registry: object) -> Iterator[Runtime]:
    from tests.harness import Daemon, make_test_network, runtime_leaks

    network = make_test_network(work, 0, slow=False)
    settings: dict[str, object] = {
        "log_level": "info",
        "images": {
            "insecure_registries": [registry.host],  # type: ignore[attr-defined]
            "mirrors": {name: [registry.url] for name in MIRRORED},  # type: ignore[attr-defined]
        },
        # RuntimeClass specs ask for `test-handler`.
        "runtime": {"handlers": {"runc": {"path": "runc"}, "test-handler": {"path": "runc"}}},
    }
    daemon = Daemon(work, network, settings=settings)
    stopped = False

    def stop() -> list[str]:
        nonlocal stopped
        daemon.stop()
        stopped = True
        shutil.copy(daemon.log_path, CACHE / "daemon.log")
        leaks = {**daemon.leaks(), **runtime_leaks(daemon)}
        return [f"the daemon held {kind}: {what}" for kind, what in leaks.items()]

    try:
        daemon.start()
        assert daemon.proc is not None
        pid_file = work / "cri-shim.pid"
        pid_file.write_text(str(daemon.proc.pid))  # the suite's Atoi takes no newline
        move_into_cgroup(RUNTIME_CGROUP, daemon.proc.pid)
        yield Runtime("cri-shim", daemon.socket, pid_file, stop)
    finally:
        if not stopped:
            daemon.stop()
        network.remove()


@contextmanager
def installed_cri_shim_runtime(
    work: Path, registry: object, socket_activation: bool = True
) -> Iterator[Runtime]:
    """The daemon the system runs: installed as its unit (tests/guest/node_e2e_site.py)."""
    from tests.guest.node_e2e_site import SOCKET, UNIT, installed_unit

    host = registry.host  # type: ignore[attr-defined]
    with installed_unit(work, host, MIRRORED, socket_activation) as pid_file:
        yield Runtime("cri-shim", SOCKET, pid_file, list, f"/system.slice/{UNIT}.service")


@contextmanager
def containerd_runtime(work: Path, registry: object) -> Iterator[Runtime]:
    state = work / "containerd"
    host = registry.host  # type: ignore[attr-defined]
    run_logged([str(CONTAINERD_PEER / "start.sh"), str(state), host], work / "containerd-start.log")

    def stop() -> list[str]:
        run_logged([str(CONTAINERD_PEER / "stop.sh"), str(state)], work / "containerd-stop.log")
        shutil.copy(state / "containerd.log", CACHE / "containerd.log")
        return []

    try:
        move_into_cgroup(RUNTIME_CGROUP, int((state / "pid").read_text()))
        yield Runtime("containerd", state / "containerd.sock", state / "pid", stop)
    finally:
        subprocess.run([str(CONTAINERD_PEER / "stop.sh"), str(state)], capture_output=True)
        subprocess.run(["ip", "link", "del", "ctd0"], capture_output=True, check=False)
        unmount_below(state)


def unmount_below(path: Path) -> None:
    from cri_shim.host.mounts import unmount_below as unmount

    if path.exists():
        unmount(path)


# --- a run -----------------------------------------------------------------------------
@dataclass
class Run:
    """One ginkgo run: its specs (a focus, the specs it must show) and its nodes."""

    label: str
    focus: str
    skip: str
    wanted: list[str] | None
    nodes: int
    timeout: int = SUITE_TIMEOUT  # ginkgo's --timeout, in seconds


def ginkgo_command(
    binaries: Path,
    run: Run,
    artifacts: Path,
    runtime: Runtime,
    config: Path,
    node_ip: str,
    address: str | None = None,
) -> list[str]:
    kubelet_flags = (
        f"--cgroups-per-qos=true --cgroup-root=/ --node-ip={node_ip} "
        f"--address={address or node_ip} "
        f"--runtime-cgroups={runtime.cgroup} --kubelet-cgroups={KUBELET_CGROUP} "
        # Not --system-cgroups: kubelet would move every process of the host's root
        # cgroup into it (the Summary API spec's "misc" system container).
        "--system-cgroups= --fail-swap-on=false"
    )
    return [
        str(binaries / "ginkgo"),
        f"--nodes={run.nodes}",
        f"--timeout={run.timeout // 60}m",
        "--no-color",
        # A Serial spec's steps as they happen: it runs alone, for minutes.
        *(["-v"] if run.label.startswith("serial") else []),
        f"--focus={run.focus}",
        *([f"--skip={run.skip}"] if run.skip else []),
        "--junit-report=junit.xml",
        f"--output-dir={artifacts}",
        str(binaries / "e2e_node.test"),
        "--",
        f"--k8s-bin-dir={binaries}",
        f"--container-runtime-endpoint=unix://{runtime.socket}",
        f"--image-service-endpoint=unix://{runtime.socket}",
        f"--container-runtime-process-name={runtime.name}",
        f"--container-runtime-pid-file={runtime.pid_file}",
        "--prepull-images=false",
        f"--node-name={os.uname().nodename}",
        f"--report-dir={artifacts}",
        f"--kubelet-config-file={config}",
        f"--feature-gates={FEATURE_GATES}",
        f"--kubelet-flags={kubelet_flags}",
    ]


def run_suite(
    binaries: Path,
    run: Run,
    work: Path,
    runtime: Runtime,
    config: Path,
    node_ip: str,
    systemd: bool,
    address: str | None = None,
) -> tuple[Junit | None, float, list[str]]:
    """One ginkgo run; its report (None where it wrote none), wall time and problems."""
    artifacts = work / f"artifacts-{run.label}"
    artifacts.mkdir(parents=True, exist_ok=True)
    command = ginkgo_command(binaries, run, artifacts, runtime, config, node_ip, address)
    log = CACHE / f"ginkgo-{run.label}.log"
    env = dict(os.environ, TMPDIR=str(work))
    if not systemd:
        env["PATH"] = path_without_systemd_run(work / "path")
    env["PATH"] = path_with_sudo(env.get("PATH", os.defpath), work / "shims")
    print(
        f"node-e2e: {run.label}: ginkgo --nodes={run.nodes} against {runtime.name} (log: {log})",
        flush=True,
    )
    started = time.monotonic()
    others: set[int] = set()
    with log.open("wb") as out, watching_other_kubelets(binaries, others):
        try:
            subprocess.run(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=work,
                env=env,
                timeout=run.timeout + 600,
                check=False,
                # The suite and the kubelet it starts in the kubelet's system cgroup: this
                # kubelet cannot move itself where it cannot read PID 1's namespaces.
                # Under systemd the suite starts kubelet in a unit of its own instead.
                preexec_fn=None
                if systemd
                else lambda: move_into_cgroup(KUBELET_CGROUP, os.getpid()),
            )
        except subprocess.TimeoutExpired:
            pass
    seconds = time.monotonic() - started
    if others:
        print(
            f"node-e2e: {run.label}: other kubelets ran on this machine meanwhile "
            f"(pids {sorted(others)}): each removes the log directories of pods it does not "
            "know, this node's too; a spec that then reads no container log failed for that",
            flush=True,
        )
    problems = []
    if left := suite_processes(binaries):
        problems.append(f"the suite left processes running: {left} (killed)")
        for pid in left:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    # The suite's own logs (kubelet's, the API server's) beside ginkgo's.
    kept = CACHE / f"artifacts-{run.label}"
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(artifacts, kept, ignore=shutil.ignore_patterns("junit*.xml"))
    junit = artifacts / "junit.xml"
    if not junit.exists():
        print(log.read_text(errors="replace")[-5000:])
        return None, seconds, [*problems, f"{run.label}: ginkgo wrote no JUnit report"]
    shutil.copy(junit, CACHE / f"junit-{run.label}.xml")
    if (report := read_junit(junit)) is None:
        print(log.read_text(errors="replace")[-5000:])
        problems.append(f"{run.label}: the suite's process ended without reporting its specs")
    return report, seconds, problems


def clean_node(runtime: Runtime, pod_logs_before: dict[Path, bool]) -> list[str]:
    """Remove what the suite's kubelet left (pods through the CRI, mounts under and then
    /var/lib/kubelet, kubepods cgroups, pod logs); what was still there."""
    from cri_shim.api.v1 import api_pb2_grpc

    found = []
    channel = channel_to(runtime.socket)
    try:
        if left := remove_leftovers(api_pb2_grpc.RuntimeServiceStub(channel)):
            print(
                f"node-e2e: removed {len(left)} objects the suite's kubelet left: "
                f"{', '.join(left[:10])}",
                flush=True,
            )
    finally:
        channel.close()  # type: ignore[attr-defined]
    unmount_below(KUBELET_ROOT)
    if KUBELET_ROOT.exists():
        for entry in KUBELET_ROOT.iterdir():
            if entry.name not in SHARED_IN_ROOT:
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink()
        if not any(KUBELET_ROOT.iterdir()):
            KUBELET_ROOT.rmdir()
    if KUBELET_ROOT.exists() and (left := kubelet_state()):
        found.append(f"{KUBELET_ROOT} still holds {left}")
    remove_cgroups(kubepods_cgroups())
    if cgroups := kubepods_cgroups():
        found.append(f"kubepods cgroups could not be removed: {cgroups}")
    for path, existed in pod_logs_before.items():
        if not existed:
            shutil.rmtree(path, ignore_errors=True)
    return found


def prepare_images(kit: Path, binaries: Path) -> Path:
    """The images built (their builder pushes them to a registry of its own), cached."""
    from tests.registry import start_registry

    with tempfile.TemporaryDirectory(prefix="cs-e2e-prepare-") as work:
        registry = start_registry(Path(work))
        try:
            return build_node_images(kit, binaries, registry.host)
        finally:
            registry.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/node-e2e", description=__doc__.split("\n")[0])
    parser.add_argument("--kit", type=Path, default=KIT, help="the node e2e kit")
    parser.add_argument("--runtime", choices=("cri-shim", "containerd"), default="cri-shim")
    parser.add_argument("--cgroup-driver", choices=("cgroupfs", "systemd"), default="cgroupfs")
    parser.add_argument("--subset", choices=("ci", "cgroup"), help="a named subset")
    parser.add_argument("--serial", action="store_true", help="the 3 Serial specs, one at a time")
    parser.add_argument("--focus", action="append", default=[], help="only matching specs")
    parser.add_argument("--skip", action="append", default=[], help="leave matching specs out")
    parser.add_argument("--nodes", type=int, default=4, help="ginkgo's parallel processes")
    parser.add_argument(
        "--as-installed-unit",
        action="store_true",
        help="the daemon installed as its systemd unit (scripts/install), not one started here",
    )
    parser.add_argument(
        "--no-socket-activation",
        action="store_true",
        help="with --as-installed-unit: installed without cri-shim.socket",
    )
    parser.add_argument(
        "--kubelet-address",
        help="kubelet's --address (default the node's): 0.0.0.0 for the specs that read "
        "kubelet's metrics at localhost:10255",
    )
    parser.add_argument(
        "--prepare", action="store_true", help="unpack the binaries, build the images, stop"
    )
    args = parser.parse_args(argv)
    if not (args.kit / "unpack").exists():
        print(f"node-e2e: no node e2e kit at {args.kit}")
        return 2
    CACHE.mkdir(parents=True, exist_ok=True)
    binaries = unpack_binaries(args.kit)
    specs = read_spec_list(args.kit / "nodeconformance-specs.txt")
    runs = plan_runs(args, specs)
    if args.prepare:  # where the image tools are (the guest has none): scripts/guest
        prepare_images(args.kit, binaries)
        if runs_nfs_spec(runs):  # for a kernel with NFS, whatever this one has
            build_nfs_image()
        return 0
    nfs = runs_nfs_spec(runs) and kernel_has_nfs()
    # The runtime-down spec can pass only with the installed unit.
    expected = [
        *EXPECTED,
        *SERIAL_EXPECTED_HERE,
        *([] if args.as_installed_unit else [SERIAL_EXPECTED_ELSEWHERE]),
    ]
    if kubelet_state() or kubepods_cgroups():
        print(
            f"node-e2e: {KUBELET_ROOT} holds a kubelet's state, or kubepods cgroups exist: "
            "is a kubelet running?"
        )
        return 2
    pod_logs_before = {path: path.exists() for path in POD_LOGS}
    from tests.registry import start_registry

    problems: list[str] = []
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="cs-e2e-", dir="/tmp"))
    work.chmod(0o711)
    outcomes: list[tuple[Run, Junit, Verdict, float]] = []
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        stack.callback(unmount_below, work)
        stack.callback(
            lambda: problems.extend(f"{c} could not be removed" for c in remove_system_cgroups())
        )
        registry = start_registry(work / "registry")
        stack.callback(registry.stop)
        layout = build_node_images(args.kit, binaries, registry.host)
        push_images(layout, registry.host, CACHE / "push.log")
        images = IMAGES
        if nfs:
            push_images(build_nfs_image(), registry.host, CACHE / "push.log", NFS_PUSHED)
            images += (NFS_IMAGE,)
        node_ip = stack.enter_context(node_address())
        site = cri_shim_runtime if args.runtime == "cri-shim" else containerd_runtime
        if args.as_installed_unit:
            site = partial(
                installed_cri_shim_runtime, socket_activation=not args.no_socket_activation
            )
        runtime = stack.enter_context(site(work, registry))
        config = kubelet_config(args.kit, work, args.cgroup_driver)
        channel = channel_to(runtime.socket)
        from cri_shim.api.v1 import api_pb2_grpc

        pull_images(api_pb2_grpc.ImageServiceStub(channel), images)
        channel.close()  # type: ignore[attr-defined]
        print(f"node-e2e: site ready in {time.monotonic() - started:.0f} s", flush=True)
        try:
            for run in runs:
                report, seconds, found = run_suite(
                    binaries,
                    run,
                    work,
                    runtime,
                    config,
                    node_ip,
                    systemd=args.cgroup_driver == "systemd",
                    address=args.kubelet_address,
                )
                problems += found
                if report is not None:
                    verdict = judge(report, expected, run.wanted)
                    outcomes.append((run, report, verdict, seconds))
                    print("\n".join(tally_lines(verdict, report, seconds, run.label)), flush=True)
                    problems += verdict.problems
                problems += clean_node(runtime, pod_logs_before)
        finally:
            problems += runtime.stop()  # type: ignore[operator]
    if subprocess.run(["ip", "link", "show", NODE_BRIDGE], capture_output=True).returncode == 0:
        problems.append(f"the node's bridge {NODE_BRIDGE} is still there")
    if registry.proc is not None and registry.proc.poll() is None:  # type: ignore[attr-defined]
        problems.append("the registry still runs")
    print(
        f"node-e2e: {args.runtime}, cgroup driver {args.cgroup_driver}, "
        f"{time.monotonic() - started:.0f} s in all",
        flush=True,
    )
    for problem in problems:
        print(f"node-e2e: FAILED: {problem}")
    if args.runtime != "cri-shim":
        return 0  # a peer's figures: tallied, never gated
    if not problems:
        print("node-e2e: passed (every spec run as expected, nothing left behind)")
    return 1 if problems else 0


def plan_runs(args: argparse.Namespace, specs: list[str]) -> list[Run]:
    """The ginkgo runs the options ask for."""
    if args.serial:  # each, or those --focus names
        return [
            Run(f"serial-{index}", focus_of([name]), "", [name], 1, SERIAL_TIMEOUT)
            for index, name in enumerate(SERIAL_SPECS, 1)
            if not args.focus or any(re.search(f, name) for f in args.focus)
        ]
    if args.subset == "cgroup":
        names = select_subset(specs, CGROUP_SUBSET)
        return [Run("cgroup", focus_of(names), SKIP, names, args.nodes)]
    if args.subset == "ci":
        left_out = select_subset(specs, CI_LEFT_OUT)
        names = [name for name in specs if name not in left_out]
        return [Run("ci", focus_of(names), SKIP, names, args.nodes)]
    if args.focus or args.skip:
        names = [
            name
            for name in specs
            if (not args.focus or any(re.search(f, name) for f in args.focus))
            and not any(re.search(s, name) for s in args.skip)
        ]
        if not names:
            raise SystemExit("node-e2e: no spec of the set matches --focus and --skip")
        return [Run("focus", focus_of(names), SKIP, names, args.nodes)]
    return [Run("all", FOCUS, SKIP, specs, args.nodes)]


if __name__ == "__main__":
    sys.exit(main())
