"""benchmarks/density.py under runsc: which host processes are a gVisor pod's."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from runtime_cost import gvisor_sandbox_processes

ROOT = Path("/tmp/csd-1/run/runtime/runsc")
SCRIPT = Path("/tmp/csd-1/run/conmon/runsc/runsc-under-conmon")


def test_the_sentry_gofers_and_waiters_of_this_daemon_are_found() -> None:
    argvs = {
        10: ["runsc-sandbox", f"--root={ROOT}", "--network=host", "boot", "pod1"],
        11: ["runsc-gofer", f"--root={ROOT}", "gofer", "--bundle", "/b"],
        12: ["/bin/sh", str(SCRIPT), f"--root={ROOT}", "create", "c1"],
        13: ["/usr/bin/runsc", "--root", str(ROOT), "wait", "c1"],
        # The daemon's own calls and conmon are not the pod's sandbox.
        14: ["/usr/bin/runsc", "--root", str(ROOT), "state", "c1"],
        15: ["/usr/bin/conmon", "--api-version", "1", "-c", "c1"],
        # Another daemon's gVisor pods, and kernel threads.
        16: ["runsc-sandbox", "--root=/tmp/other/runsc", "boot", "pod9"],
        17: ["runsc-gofer", "--root=/tmp/other/runsc", "gofer"],
        18: [],
    }
    assert gvisor_sandbox_processes(argvs, ROOT, SCRIPT) == {
        10: "sandbox",
        11: "gofer",
        12: "waiter",
        13: "waiter",
    }
