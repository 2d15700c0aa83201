"""gVisor's handler: the script conmon runs, the waiter it finds, what is refused."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition, InvalidArgument
from cri_shim.runtime import gvisor
from cri_shim.runtime.features import (
    HandlerFeatures,
    require_features,
    require_pod_features,
)
from cri_shim.runtime.gvisor import (
    conmon_runtime,
    joining_waiter,
    process_tree,
    relay_argv,
)
from cri_shim.runtime.kinds.base import HandlerKind
from cri_shim.runtime.kinds.gvisor import GVISOR, GVisorKind


def test_the_script_is_valid_shell_and_names_its_runsc(tmp_path: Path) -> None:
    script = conmon_runtime(Path("/usr/bin/runsc"), tmp_path, "runsc")
    assert script.stat().st_mode & 0o111
    assert "runsc=/usr/bin/runsc\n" in script.read_text()
    subprocess.run(["sh", "-n", str(script)], check=True)


def test_commands_other_than_create_go_to_runsc_unchanged(tmp_path: Path) -> None:
    fake = tmp_path / "fake-runsc"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    script = conmon_runtime(fake, tmp_path, "runsc")
    done = subprocess.run(
        [str(script), "--root=/r", "state", "abc"], capture_output=True, text=True, check=True
    )
    assert done.stdout == "--root=/r state abc\n"


def _bundle(tmp_path: Path, kind: str, pid: str = "4242") -> Path:
    spec = {"annotations": {"io.kubernetes.cri.container-type": kind}}
    (tmp_path / "config.json").write_text(json.dumps(spec))
    (tmp_path / "pidfile").write_text(pid)
    return tmp_path


def test_only_a_container_joining_a_sandbox_has_a_waiter(tmp_path: Path) -> None:
    assert joining_waiter(_bundle(tmp_path, "container")) == 4242
    assert joining_waiter(_bundle(tmp_path, "sandbox")) == 0
    assert joining_waiter(tmp_path / "missing") == 0


def test_port_forward_without_the_relay_needs_the_kernels_network_stack(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(gvisor, "RELAY_PROGRAM", tmp_path / "no-busybox")
    with pytest.raises(FailedPrecondition, match="'gv'"):
        GVisorKind(Path("runsc")).check_port_forward("gv", [])
    GVisorKind(Path("runsc")).check_port_forward("gv", ["--network=host"])
    GVisorKind(Path("runsc")).check_port_forward("gv", ["--network", "host"])
    HandlerKind(Path("runc")).check_port_forward("runc", [])


def _pod(**options: int) -> api_pb2.PodSandboxConfig:
    return api_pb2.PodSandboxConfig(
        linux=api_pb2.LinuxPodSandboxConfig(
            security_context=api_pb2.LinuxSandboxSecurityContext(
                namespace_options=api_pb2.NamespaceOption(**options)
            )
        )
    )


@pytest.mark.parametrize("field", ["network", "pid", "ipc"])
def test_host_namespaces_are_refused_under_gvisor_only(field: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"namespace_options.{field}.*'gv'"):
        require_pod_features(None, "gv", GVISOR, _pod(**{field: api_pb2.NODE}))
    require_pod_features(None, "runc", HandlerFeatures(), _pod(**{field: api_pb2.NODE}))
    require_pod_features(None, "gv", GVISOR, _pod(**{field: api_pb2.POD}))


def test_privileged_is_refused_under_gvisor() -> None:
    privileged = api_pb2.ContainerConfig(
        linux=api_pb2.LinuxContainerConfig(
            security_context=api_pb2.LinuxContainerSecurityContext(privileged=True)
        )
    )
    with pytest.raises(InvalidArgument, match=r"privileged.*'gv'"):
        require_features(privileged, "gv", GVISOR)
    require_features(privileged, "runc", HandlerFeatures())


def test_the_relay_runs_busyboxs_nc_in_the_sandbox_container() -> None:
    argv = relay_argv(Path("/usr/bin/runsc"), Path("/run/r"), ["--network=host"], "pod1", 8080)
    assert argv[:4] == ["/usr/bin/runsc", "--root", "/run/r", "--network=host"]
    # busybox picks its applet by the name it runs as: the mount point is named busybox.
    assert argv[4:] == [
        "exec",
        "--user",
        "65535:65535",
        "pod1",
        "/busybox",
        "nc",
        "127.0.0.1",
        "8080",
    ]


def test_a_deleted_containers_locks_go_and_its_gone_sandboxs_too(tmp_path: Path) -> None:
    for name in ("c_sandbox:s.lock", "s_sandbox:s.lock", "other_sandbox:o.lock"):
        (tmp_path / name).touch()
    (tmp_path / "c_sandbox:s.state").touch()
    sandboxes = gvisor.sandboxes_of(tmp_path, "c")
    assert sandboxes == {"s"}
    (tmp_path / "c_sandbox:s.state").unlink()  # runsc's delete
    gvisor.remove_locks(tmp_path, "c", sandboxes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_sandbox:o.lock"]


def test_a_gone_sandboxs_delete_sweeps_the_locks_its_stop_made_again(tmp_path: Path) -> None:
    # The pod's stop listed container b before b's delete, and locked it after: runsc made
    # b's lock again. Deleting the sandbox's own container sweeps it; a container of the
    # sandbox that still has its state keeps its lock.
    for name in ("s_sandbox:s.lock", "b_sandbox:s.lock", "a_sandbox:s.lock", "a_sandbox:s.state"):
        (tmp_path / name).touch()
    (tmp_path / "x_sandbox:other.lock").touch()
    gvisor.remove_locks(tmp_path, "s", {"s"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a_sandbox:s.lock",
        "a_sandbox:s.state",
        "x_sandbox:other.lock",
    ]


def test_a_running_sandboxs_lock_stays(tmp_path: Path) -> None:
    for name in ("c_sandbox:s.lock", "s_sandbox:s.lock", "s_sandbox:s.state"):
        (tmp_path / name).touch()
    gvisor.remove_locks(tmp_path, "c", {"s"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s_sandbox:s.lock", "s_sandbox:s.state"]


def test_an_exec_process_tree_is_read_from_runsc_ps() -> None:
    listing = (
        "UID       PID       PPID      C         TTY       STIME     TIME      CMD\n"
        "0         1         0         0         ?         16:40     0s        pause\n"
        "0         2         0         0         ?         16:40     10ms      sleep\n"
        "0         3         0         0         ?         16:40     0s        sh\n"
        "0         4         3         0         ?         16:40     10ms      sh\n"
        "0         5         4         0         ?         16:40     10ms      sleep\n"
        "0         6         2         0         ?         16:40     10ms      sleep\n"
    )
    assert sorted(process_tree(listing, 3)) == [3, 4, 5]
    assert process_tree(listing, 5) == [5]
    assert process_tree(listing, 9) == []  # gone: nothing of it to kill
    assert process_tree("", 3) == []


def _fake_runsc(tmp_path: Path, members: int) -> tuple[list[str], Path]:
    """A runsc whose `ps` lists an exec (pid 3) with `members - 1` children and whose
    `kill` takes a moment; no state file names the container's sandbox, so nothing is run
    in it. Each call records its arguments, its oom_score_adj and how many ran beside it."""
    calls = tmp_path / "calls"
    running = tmp_path / "running"
    running.mkdir()
    children = "".join(f"0 {pid} 3 0 ? 16:40 0s sleep\n" for pid in range(4, 3 + members))
    script = tmp_path / "runsc"
    script.write_text(f"""#!/bin/sh
touch {running}/$$
echo "$(ls {running} | wc -l) $(cat /proc/self/oom_score_adj) $*" >> {calls}
case " $* " in
*" ps "*) printf "UID PID PPID C TTY STIME TIME CMD\\n0 3 0 0 ? 16:40 0s sh\\n{children}" ;;
*) sleep 0.1 ;;
esac
rm -f {running}/$$
""")
    script.chmod(0o755)
    return [str(script), "--root", str(tmp_path)], calls


def _calls(calls: Path) -> list[tuple[int, str, str]]:
    rows = [line.split(" ", 2) for line in calls.read_text().splitlines()]
    return [(int(beside), score, args) for beside, score, args in rows]


@pytest.mark.usefixtures("protected_daemon")
def test_the_fallback_signals_a_few_members_at_a_time_outside_the_daemons_protection(
    tmp_path: Path,
) -> None:
    runsc, calls = _fake_runsc(tmp_path, members=12)
    gvisor.kill_process_tree(runsc, "c1", 3, 10)
    made = _calls(calls)
    kills = [args for _, _, args in made if " kill --pid " in f" {args} "]
    assert sorted(kills) == sorted(
        f"--root {tmp_path} kill --pid {pid} c1 {sig}" for pid in range(3, 15) for sig in (19, 9)
    )
    assert max(beside for beside, _, _ in made) <= gvisor.SIGNALS_AT_ONCE
    assert {score for _, score, _ in made} == {"0"}


def test_a_tree_past_the_fallbacks_cap_costs_the_container_and_no_call_per_member(
    tmp_path: Path,
) -> None:
    runsc, calls = _fake_runsc(tmp_path, members=gvisor.MAX_SIGNALLED + 1)
    gvisor.kill_process_tree(runsc, "c1", 3, 10)
    made = [args.split(" ", 2)[2] for _, _, args in _calls(calls)]
    assert made == ["ps c1", "kill --all c1 9"]


@pytest.mark.skipif(gvisor.relay_program() is None, reason="busybox-static is not installed")
def test_a_node_ends_few_trees_at_once_each_with_one_runsc(tmp_path: Path) -> None:
    # Probes of many pods time out together: each tree is ended by one `runsc exec`
    # in its sandbox (a state file names it), and only TREE_KILLS of them run at once.
    (tmp_path / "c1_sandbox:s1.state").touch()
    running = tmp_path / "running"
    running.mkdir()
    script = tmp_path / "runsc"
    script.write_text(f"""#!/bin/sh
touch {running}/$$
echo "$(ls {running} | wc -l) $3" >> {tmp_path / "calls"}
sleep 0.2
rm -f {running}/$$
echo ended
""")
    script.chmod(0o755)
    with ThreadPoolExecutor(6) as pool:
        for pid in range(3, 9):
            pool.submit(
                gvisor.kill_process_tree, [str(script), "--root", str(tmp_path)], "c1", pid, 10
            )
    calls = [line.split() for line in (tmp_path / "calls").read_text().splitlines()]
    assert [verb for _, verb in calls] == ["exec"] * 6
    assert max(int(beside) for beside, _ in calls) <= gvisor.TREE_KILLS
