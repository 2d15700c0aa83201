"""critest, the CRI conformance suite that containerd and CRI-O run in their CI, against a
real cri-shim daemon, offline.

The kit beside the repository (`../shared/conformance`: critest, crictl and a builder of
the images critest pulls) provides the client and the images. This builds the images
(cached under `.cache/conformance/`, rebuilt when the builder changes), serves them from
Debian's docker-registry on 127.0.0.1, starts the daemon with its own CNI network and
every registry critest names mirrored to that registry, runs the whole suite, and prints
the tally with the name of each failed and skipped spec (and why it was skipped).

It fails when a spec fails other than the two that cannot pass offline (the kit's README
says why), or when the daemon holds anything once critest has removed its pods.

    scripts/conformance [--focus REGEX] [--skip REGEX] [--kit DIR] [-- CRITEST-ARGS...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cri_shim.api.v1 import api_pb2
from cri_shim.host.mounts import unmount_below
from tests.harness import REPO, Daemon, make_test_network
from tests.registry import start_registry

DEFAULT_KIT = REPO.parent / "shared" / "conformance"
CACHE = REPO / ".cache" / "conformance"
MIRRORED = ("docker.io", "registry.k8s.io", "k8s.gcr.io", "gcr.io", "quay.io", "public.ecr.aws")
CRITEST_TIMEOUT = 30 * 60

# Specs that cannot pass offline whatever the runtime does (the kit's README).
KNOWN_OFFLINE = {
    "public image with digest should be pulled and removed": (
        "the digest is that of upstream's manifest, which cannot be rebuilt offline"
    ),
    "runtime should support MaskedPaths": (
        "Debian's busybox-static runs ls as a shell built-in: masking /bin/ls shows nothing"
    ),
}


@dataclass(frozen=True)
class Spec:
    name: str
    state: str  # passed, failed, skipped, pending, panicked, …
    message: str

    @property
    def known_offline(self) -> str | None:
        return next((why for leaf, why in KNOWN_OFFLINE.items() if leaf in self.name), None)


def read_report(path: Path) -> list[Spec]:
    """The `It` specs of ginkgo's JSON report (setup nodes that failed count as specs)."""
    specs = []
    for suite in json.loads(path.read_text()):
        for report in suite.get("SpecReports") or []:
            kind = report.get("LeafNodeType")
            state = report.get("State", "")
            if kind != "It" and state == "passed":
                continue
            hierarchy = report.get("ContainerHierarchyTexts") or []
            name = " ".join([*hierarchy, report["LeafNodeText"]])
            message = (report.get("Failure") or {}).get("Message", "")
            specs.append(Spec(name.strip() or kind, state, message.strip()))
    return specs


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
    _run([str(builder / "build.sh"), str(out)], CACHE / "build.log")
    print(f"conformance: images built in {time.monotonic() - started:.0f} s", flush=True)
    return out


def _run(command: list[str], log: Path, timeout: float = 600) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"conformance: {command[0]} failed ({result.returncode}):\n{tail}")


def remove_leftovers(daemon: Daemon) -> list[str]:
    """Pods critest left behind (a spec that failed half-way), removed; their names."""
    runtime = daemon.runtime()
    left = runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=30).items
    for sandbox in left:
        runtime.StopPodSandbox(
            api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=120
        )
        runtime.RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=120
        )
    return [sandbox.metadata.name for sandbox in left]


def print_tally(specs: list[Spec], seconds: float) -> list[Spec]:
    """Print the tally and each failed and skipped spec; return the unexpected failures."""
    by_state: dict[str, list[Spec]] = {}
    for spec in specs:
        by_state.setdefault(spec.state, []).append(spec)
    passed = by_state.pop("passed", [])
    skipped = by_state.pop("skipped", [])
    failed = [spec for specs_ in by_state.values() for spec in specs_]
    known = [spec for spec in failed if spec.known_offline]
    unexpected = [spec for spec in failed if not spec.known_offline]
    print(
        f"critest tally: passed {len(passed)}, failed {len(failed)} "
        f"({len(known)} that cannot pass offline), skipped {len(skipped)}, "
        f"in {seconds:.0f} s",
        flush=True,
    )
    for spec in known:
        print(f"  failed, cannot pass offline: {spec.name}\n      ({spec.known_offline})")
    for spec in unexpected:
        message = spec.message.replace("\n", "\n      ")
        print(f"  FAILED ({spec.state}): {spec.name}\n      {message[:3000]}")
    reasons: dict[str, list[str]] = {}
    for spec in skipped:
        reason = spec.message.splitlines()[0] if spec.message else "not selected for this run"
        reasons.setdefault(reason, []).append(spec.name)
    for reason, names in sorted(reasons.items()):
        print(f"  skipped, {reason} ({len(names)}):")
        for name in names:
            print(f"    {name}")
    return unexpected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/conformance", description=__doc__.split("\n")[0])
    parser.add_argument("--kit", type=Path, default=DEFAULT_KIT, help="the conformance kit")
    parser.add_argument("--focus", action="append", default=[], help="run only matching specs")
    parser.add_argument("--skip", action="append", default=[], help="leave matching specs out")
    parser.add_argument(
        "--no-nri",
        dest="nri",
        action="store_false",
        help="leave [nri] off, and critest's NRI specs skipped",
    )
    parser.add_argument("critest_args", nargs="*", help="more critest arguments, after --")
    args = parser.parse_args(argv)
    critest = args.kit / "bin" / "critest"
    if not critest.exists():
        print(f"conformance: no critest at {critest} (the kit is not beside this clone)")
        return 2
    images = build_images(args.kit)
    # Short paths: the daemon's socket path must stay under 108 bytes.
    work = Path(tempfile.mkdtemp(prefix="cs-conf-", dir="/tmp"))
    work.chmod(0o711)
    registry = daemon = network = None
    try:
        registry = start_registry(work / "registry")
        _run([str(args.kit / "images" / "push.sh"), str(images), registry.host], work / "push.log")
        network = make_test_network(work, 0, slow=False)
        mirrors = {name: [registry.url] for name in MIRRORED}
        settings: dict[str, object] = {
            "log_level": "info",
            "images": {"insecure_registries": [registry.host], "mirrors": mirrors},
        }
        nri_socket = work / "nri.sock"
        if args.nri:
            # critest's NRI specs connect their own plugin to this socket. Two of them hold
            # a plugin's Synchronize open for 2s, the default request timeout: a plugin
            # refused for it would see none of the containers they count.
            settings["nri"] = {
                "enable": True,
                "socket_path": str(nri_socket),
                "plugin_request_timeout": "5s",
            }
        daemon = Daemon(work, network, settings=settings)
        daemon.start()
        endpoint = f"unix://{daemon.socket}"
        report = work / "report.json"
        command = [
            str(critest),
            f"--runtime-endpoint={endpoint}",
            f"--image-endpoint={endpoint}",
            "--ginkgo.no-color",
            f"--ginkgo.json-report={report}",
            *([f"-nri-socket={nri_socket}"] if args.nri else []),
            *(f"--ginkgo.focus={focus}" for focus in args.focus),
            *(f"--ginkgo.skip={skip}" for skip in args.skip),
            *args.critest_args,
        ]
        log = CACHE / "critest.log"
        print(f"conformance: {' '.join(command[:1])} against {endpoint} (log: {log})", flush=True)
        started = time.monotonic()
        with log.open("wb") as out:
            # critest's own temp files go to the work directory, which is removed after.
            env = dict(os.environ, TMPDIR=str(work))
            subprocess.run(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=CRITEST_TIMEOUT,
                cwd=work,
                env=env,
                check=False,
            )
        seconds = time.monotonic() - started
        if not report.exists():
            print(log.read_text(errors="replace")[-5000:])
            print("conformance: critest wrote no report")
            return 1
        unexpected = print_tally(read_report(report), seconds)
        problems = []
        if left := remove_leftovers(daemon):
            print(f"  critest left {len(left)} pods behind: {', '.join(left)}")
        daemon.stop()
        shutil.copy(daemon.log_path, CACHE / "daemon.log")
        if leaks := daemon.leaks():
            problems.append(f"the daemon still holds, with no pods left: {leaks}")
        if unexpected:
            problems.append(f"{len(unexpected)} specs failed that should pass")
        for problem in problems:
            print(f"conformance: FAILED: {problem}")
        if not problems:
            print("conformance: passed (only specs that cannot pass offline failed)")
        return 1 if problems else 0
    finally:
        if daemon is not None:
            daemon.stop()
        if registry is not None:
            registry.stop()
        if network is not None:
            network.remove()
        unmount_below(work)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
