"""critest's lifecycle benchmarks (`critest -benchmark`), cri-shim and containerd in one
sitting: the medians of each operation, the status reads (ContainerStatus and
PodSandboxStatus, verbose, asked right after the object is made while the other
lifecycles run beside) with their ratio to containerd's.

Usage: sudo flock /tmp/critest.lock .venv/bin/python benchmarks/critest_reads.py
           [--runs 2] [--number 40] [--parallel 4] [--plain] [--containerd]
           [--mode relay|bound|both]

The daemon runs as the installed unit runs it (`python -OO -X no_debug_ranges`, bytecode
compiled so) unless --plain is given, with the conformance gate's set-up
(tests/conformance.py). `--mode relay` hands it its listening socket as systemd's socket
activation does (the unit scripts/install writes by default), so that every call passes
through the relay; `bound` (the default) lets it bind its own; `both` runs the two, one
after the other, run for run, with the relay's ratio to the bound socket. --containerd
also runs the same client against containerd 1.6 (`../shared/peers/containerd`, its images
from the same local registry), after cri-shim, run for run. The figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common import BYTECODE, activation_socket, compile_as_installed, run_critest_benchmark

from tests.conformance import CACHE, DEFAULT_HANDLER, DEFAULT_KIT, critest_site
from tests.harness import INSTALLED_FLAGS, REPO, Daemon

PEER = REPO.parent / "shared" / "peers" / "containerd"
FOCUS = "benchmark about (operations on Container|lifecycle of PodSandbox)"
# The files critest writes, and the name each of its operations is printed under.
RESULTS = {
    "pod_benchmark_data.json": "pod",
    "container_benchmark_data.json": "container",
}


def run_critest(critest: Path, endpoint: str, work: Path, params: Path, out: Path) -> int:
    out.mkdir(parents=True)
    args = [
        f"--ginkgo.focus={FOCUS}",
        f"-benchmarking-params-file={params}",
        f"-benchmarking-output-dir={out}",
    ]
    log = CACHE / "critest-reads.log"
    return run_critest_benchmark(critest, endpoint, work, log, args, append=True)


def medians(out: Path) -> dict[str, float]:
    """Each operation's median in ms, from critest's result files in `out`."""
    found: dict[str, float] = {}
    for name in RESULTS:
        path = out / name
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        names = data["operationsNames"]
        for index, operation in enumerate(names):
            durations = [p["operationsDurationsNs"][index] for p in data["datapoints"]]
            found[operation] = statistics.median(durations) / 1e6
    return found


@contextmanager
def started(
    base: Path, network: object, settings: dict, flags: list[str], activated: bool
) -> Iterator[Daemon]:
    """The daemon on its own roots under `base`, its state kept from run to run; with
    `activated`, given its listening socket as systemd's socket activation gives it."""
    (base / "run").mkdir(parents=True, exist_ok=True)
    held = activation_socket(base / "run" / "cri-shim.sock") if activated else None
    daemon = Daemon(
        base,
        network,  # type: ignore[arg-type]
        settings=settings,
        env=BYTECODE,
        interpreter_flags=flags,
        pass_fds=(held.fileno(),) if held else (),
    )
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        shutil.copy(daemon.log_path, CACHE / f"critest-reads-daemon-{base.name}.log")
        if held is not None:
            held.close()
            (base / "run" / "cri-shim.sock").unlink(missing_ok=True)


def start_containerd(state: Path, registry: str) -> str:
    done = subprocess.run(
        [str(PEER / "start.sh"), str(state), registry], capture_output=True, text=True, check=True
    )
    return done.stdout.strip().splitlines()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--kit", type=Path, default=DEFAULT_KIT, help="the conformance kit")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--number", type=int, default=40, help="lifecycles of each kind")
    parser.add_argument("--parallel", type=int, default=4, help="lifecycles at once")
    parser.add_argument("--plain", action="store_true", help="the interpreter's defaults")
    parser.add_argument("--containerd", action="store_true", help="containerd 1.6 beside")
    parser.add_argument(
        "--mode",
        choices=("bound", "relay", "both"),
        default="bound",
        help="the daemon's own socket, systemd's through the relay, or both",
    )
    args = parser.parse_args()
    critest = args.kit / "bin" / "critest"
    if not critest.exists():
        print(f"critest_reads: no critest at {critest}")
        return 2
    flags = [] if args.plain else INSTALLED_FLAGS
    if flags:
        compile_as_installed()
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "critest-reads.log").write_bytes(b"")
    modes = ("bound", "relay") if args.mode == "both" else (args.mode,)
    results: dict[str, list[dict[str, float]]] = {
        **{f"cri-shim {mode}": [] for mode in modes},
        "containerd": [],
    }
    with critest_site(args.kit, DEFAULT_HANDLER) as (work, network, settings):
        params = work / "params.yaml"
        params.write_text(
            f"containersNumber: {args.number}\ncontainersNumberParallel: {args.parallel}\n"
            f"podsNumber: {args.number}\npodsNumberParallel: {args.parallel}\n"
        )
        registry = settings["images"]["insecure_registries"][0]  # type: ignore[index]
        peer_state = work / "containerd"  # removed with the work directory
        try:
            peer = start_containerd(peer_state, registry) if args.containerd else None
            for run in range(args.runs):
                for mode in modes:
                    base = work / f"daemon-{mode}"
                    with started(base, network, settings, flags, mode == "relay") as daemon:
                        out = work / f"cri-shim-{mode}-{run}"
                        code = run_critest(critest, f"unix://{daemon.socket}", work, params, out)
                        results[f"cri-shim {mode}"].append(medians(out))
                        if code:
                            print(
                                f"critest against cri-shim ({mode}) exited with {code}", flush=True
                            )
                if peer is not None:
                    out = work / f"containerd-{run}"
                    code = run_critest(critest, peer, work, params, out)
                    results["containerd"].append(medians(out))
                    if code:
                        print(f"critest against containerd exited with {code}", flush=True)
        finally:
            if args.containerd:
                subprocess.run([str(PEER / "stop.sh"), str(peer_state)], check=False)
    report(results, args)
    return 0


def report(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    how = " ".join([] if args.plain else INSTALLED_FLAGS) or "the interpreter's defaults"
    print(
        f"critest -benchmark, {args.number} lifecycles {args.parallel} at once, {args.runs} "
        f"runs; median ms of each run (cri-shim under {how}; relay: its socket as systemd's "
        "socket activation hands it, bound: its own)"
    )
    ours_by_mode = {name: runs for name, runs in results.items() if name.startswith("cri-shim")}
    theirs = results["containerd"]
    operations = sorted({op for runs in ours_by_mode.values() for run in runs for op in run})
    for operation in operations:
        figures = {
            name: [run[operation] for run in runs if operation in run]
            for name, runs in ours_by_mode.items()
        }
        line = f"{operation:<18}"
        for name, values in figures.items():
            line += f" {name} {_runs(values):<16}"
        relay, bound = figures.get("cri-shim relay"), figures.get("cri-shim bound")
        if relay and bound:
            line += f" relay/bound {_runs([a / b for a, b in zip(relay, bound, strict=False)])}"
        peer = [run[operation] for run in theirs if operation in run]
        if peer:
            line += f" containerd {_runs(peer):<16}"
            for name, values in figures.items():
                ratios = [a / b for a, b in zip(values, peer, strict=False)]
                line += f" {name.split()[1]}/containerd {_runs(ratios)}"
        print(line)


def _runs(values: list[float], form: str = ".2f") -> str:
    return " ".join(format(v, form) for v in values)


if __name__ == "__main__":
    sys.exit(main())
