"""Operating cri-shim: the metrics endpoint, SIGHUP, structured logs, the unit and the install.

The daemon tests run the real `cri-shim serve` (tests/harness.py) and look at it from the
outside, as an operator would: scrape its endpoint, signal it, read its log.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cri_shim.api.v1 import api_pb2
from tests.harness import (
    INSTALLED_FLAGS,
    REPO,
    CniTestNetwork,
    Daemon,
    pod_config,
    refused_as_reserved,
    wait_until,
)

pytestmark = pytest.mark.integration

UNIT = REPO / "contrib" / "systemd" / "cri-shim.service"
# What the unit runs after its venv's python.
INSTALLED_PYTHON = " ".join([*INSTALLED_FLAGS, "-m", "cri_shim.cli"])
SOCKET_UNIT = REPO / "contrib" / "systemd" / "cri-shim.socket"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def get(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def event(found: Samples, name: str) -> float:
    return get(found, "cri_shim_creation_events_total", kind="sandbox", event=name)


def rpcs(found: Samples, code: str) -> float:
    return get(found, "cri_shim_rpc_requests_total", method="RunPodSandbox", code=code)


def run_pod(daemon: Daemon, name: str, timeout: float) -> str:
    request = api_pb2.RunPodSandboxRequest(config=pod_config(name))
    return daemon.runtime().RunPodSandbox(request, timeout=timeout).pod_sandbox_id


def remove_pod(daemon: Daemon, sandbox_id: str) -> None:
    request = api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id)
    daemon.runtime().RemovePodSandbox(request, timeout=30)


LOGFMT_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')


def logfmt_lines(text: str) -> list[dict[str, str]]:
    """The daemon's logfmt lines as dicts (other output, e.g. gRPC's C core, is skipped)."""
    events = []
    for line in text.splitlines():
        if line.startswith("ts="):
            events.append(
                {k: json.loads(v) if v.startswith('"') else v for k, v in LOGFMT_PAIR.findall(line)}
            )
    return events


# ---- metrics ------------------------------------------------------------------------


@pytest.mark.root
@pytest.mark.slow
def test_metrics_follow_the_three_request_protocol(
    make_daemon,  # type: ignore[no-untyped-def]
    test_network: CniTestNetwork,
) -> None:
    port = free_port()
    daemon: Daemon = make_daemon(settings={"metrics": {"listen": f"127.0.0.1:{port}"}})
    daemon.start()
    before = scrape(port)
    assert event(before, "name_reserved") == 0 and event(before, "claimed") == 0

    with test_network.held():
        with pytest.raises(grpc.RpcError) as first:
            run_pod(daemon, "metered", timeout=1.5)
        assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The creation is held at the network stage, and a scrape says so.
        wait_until(lambda: test_network.adds() == 1, timeout=30)
        stalled = scrape(port)
        assert (
            get(stalled, "cri_shim_creation_stalled", kind="sandbox", stage="sandbox network") == 1
        )
        # The daemon answers a little before a client's deadline; on a busy machine the
        # client's can come first, and the daemon then sees the request cancelled.
        assert event(stalled, "timed_out") + event(stalled, "client_gone") == 1

        _, tries = refused_as_reserved(lambda: run_pod(daemon, "metered", timeout=1.5))
        reserved = scrape(port)
        refused = event(reserved, "name_reserved")  # the tries the daemon answered itself
        assert 1 <= refused <= tries
        assert get(reserved, "cri_shim_creation_objects", kind="sandbox", phase="in_flight") == 1
    wait_until(lambda: event(scrape(port), "cached") == 1, timeout=30)
    sandbox_id = run_pod(daemon, "metered", timeout=30)

    after = scrape(port)
    for name, count in [
        ("reserved", 1),
        ("name_reserved", refused),
        ("cached", 1),
        ("claimed", 1),
        ("expired", 0),
        ("failed", 0),
    ]:
        assert event(after, name) == count, name
    assert refused <= event(after, "waiting") <= tries
    assert rpcs(after, "ALREADY_EXISTS") == refused
    assert rpcs(after, "DEADLINE_EXCEEDED") + rpcs(after, "CANCELLED") == 1 + tries - refused
    assert rpcs(after, "OK") == 1
    assert get(after, "cri_shim_sandboxes", state="ready") == 1
    assert get(after, "cri_shim_creation_objects", kind="sandbox", phase="visible") == 1
    assert get(after, "cri_shim_creation_stalled", kind="sandbox", stage="sandbox network") == 0
    # The slow plugin ran once, and the time it was held (through each 1.5 s duplicate
    # request at least) shows in the CNI latency.
    slow = {"tool": "cni", "op": "ADD slow-cni"}
    assert get(after, "cri_shim_host_calls_total", **slow, result="ok") == 1
    assert get(after, "cri_shim_host_call_duration_seconds_sum", **slow) >= 1.4 * tries
    assert get(after, "cri_shim_host_calls_total", tool="cni", op="ADD bridge", result="ok") == 1

    remove_pod(daemon, sandbox_id)
    assert get(scrape(port), "cri_shim_sandboxes", state="ready") == 0
    assert daemon.leaks() == {}
    # The endpoint stops with the daemon.
    daemon.stop()
    with pytest.raises(OSError):
        scrape(port)


@pytest.mark.root
def test_metrics_are_off_by_default(daemon: Daemon) -> None:
    assert "serving metrics" not in daemon.log()
    assert "serving CRI on" in daemon.log()


# ---- SIGHUP -------------------------------------------------------------------------


@pytest.mark.root
def test_sighup_rereads_the_cni_configuration(daemon: Daemon, test_network: CniTestNetwork) -> None:
    assert daemon.proc is not None
    current = json.loads((test_network.config_dir / "10-test.conflist").read_text())
    # Lexically first, so it takes over: what a CNI daemonset installing its config does.
    replacement = dict(current, name="crishim-reloaded")
    (test_network.config_dir / "05-reloaded.conflist").write_text(json.dumps(replacement))
    daemon.proc.send_signal(signal.SIGHUP)
    # No RPC in between: it is the signal, not a Status call, that makes it re-read.
    wait_until(lambda: "crishim-reloaded" in daemon.log(), timeout=10)
    assert "SIGHUP" in daemon.log()
    assert daemon.proc.poll() is None, "SIGHUP must not stop the daemon"
    assert daemon.runtime().Version(api_pb2.VersionRequest(), timeout=5).runtime_name == "cri-shim"


# ---- logs ---------------------------------------------------------------------------


@pytest.mark.root
def test_log_lines_about_a_pod_carry_its_id_and_name(daemon: Daemon) -> None:
    sandbox_id = run_pod(daemon, "logged", timeout=30)
    daemon.runtime().StopPodSandbox(
        api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
    )
    remove_pod(daemon, sandbox_id)
    events = logfmt_lines(daemon.log_path.read_text())
    assert events, daemon.log()
    assert all({"ts", "level", "logger", "msg"} <= e.keys() for e in events)
    about = [e for e in events if sandbox_id in e["msg"]]
    # reserved, each stage, created, stopped, removed: every one is tagged.
    assert len(about) >= 5, about
    for e in about:
        assert e.get("sandbox_id") == sandbox_id, e
        assert e.get("sandbox_name") == "k8s_POD_logged_default_uid-1_0", e


@pytest.mark.root
def test_json_log_format(make_daemon) -> None:  # type: ignore[no-untyped-def]
    daemon: Daemon = make_daemon(settings={"log_format": "json"})
    daemon.start()
    daemon.stop()
    log = daemon.log_path.read_text().splitlines()
    messages = [json.loads(line)["msg"] for line in log if line.startswith("{")]
    assert any(m.startswith("serving CRI on") for m in messages)
    assert not any(line.startswith("ts=") for line in log)


# ---- the systemd unit ---------------------------------------------------------------


def systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd; scripts/setup)")
    return tool


def verify_unit(unit: Path) -> None:
    """`systemd-analyze verify` with nothing to say about this unit."""
    result = subprocess.run(
        [systemd_analyze(), "verify", str(unit)], capture_output=True, text=True, check=False
    )
    complaints = [
        line for line in (result.stdout + result.stderr).splitlines() if unit.name in line
    ]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr


def read_unit(path: Path) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(path.read_text())
    return unit


def test_the_unit_file_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart exists: point it at this checkout's binary.
    unit = tmp_path / "cri-shim.service"
    binary = REPO / ".venv" / "bin" / "python"
    unit.write_text(UNIT.read_text().replace("/opt/cri-shim/venv/bin/python", str(binary)))
    shutil.copy(SOCKET_UNIT, tmp_path)  # which the service requires
    verify_unit(unit)
    verify_unit(tmp_path / SOCKET_UNIT.name)


def test_the_socket_unit_hands_the_cri_socket_to_the_service() -> None:
    socket_unit = read_unit(SOCKET_UNIT)
    assert socket_unit["Socket"]["ListenStream"] == "/run/cri-shim/cri-shim.sock"  # `listen`
    assert socket_unit["Socket"]["SocketMode"] == "0660"
    assert socket_unit["Socket"]["Service"] == "cri-shim.service"
    service = read_unit(UNIT)
    assert service["Unit"]["Requires"] == "cri-shim.socket"
    # A stop of the service stops the socket too, a restart does not (tests/guest/
    # test_socket_activation.py runs both under systemd).
    assert service["Unit"]["PropagatesStopTo"] == "cri-shim.socket"
    assert "cri-shim.socket" in service["Unit"]["After"].split()
    assert service["Install"]["Also"] == "cri-shim.socket"


def test_the_unit_keeps_pods_running_across_restarts() -> None:
    service = read_unit(UNIT)["Service"]
    assert service["Type"] == "notify"  # READY=1 once the socket is answered
    assert service["KillMode"] == "process"  # conmon and containers survive a restart
    assert service["Delegate"] == "yes"
    assert service["Restart"] == "on-failure"
    assert service["LimitNOFILE"] == "1048576"
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["ExecStart"] == (
        f"/opt/cri-shim/venv/bin/python {INSTALLED_PYTHON} serve --config /etc/cri-shim/config.toml"
    )
    # The daemon pins namespaces and mounts rootfs that the host must see.
    for isolating in ("PrivateMounts", "PrivateTmp", "ProtectSystem", "ProtectHome", "MountFlags"):
        assert isolating not in service


# ---- scripts/install ----------------------------------------------------------------


def run_install(prefix: Path, *args: str) -> str:
    result = subprocess.run(
        [str(REPO / "scripts" / "install"), "--prefix", str(prefix), *args],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow
def test_install_into_a_temporary_prefix(tmp_path: Path) -> None:
    prefix = tmp_path / "node"
    had_build_dir = (REPO / "build").exists()
    out = run_install(prefix)
    assert "systemd not reloaded" in out  # never for a prefix other than /
    assert (REPO / "build").exists() == had_build_dir, "install wrote into the checkout"

    venv = prefix / "opt" / "cri-shim" / "venv"
    version = subprocess.run(
        [venv / "bin" / "cri-shim", "version"], capture_output=True, text=True, check=True
    )
    assert version.stdout.startswith("cri-shim ")
    # The bytecode the unit's interpreter options load, there before the first start.
    assert list(venv.glob("lib/python3*/site-packages/cri_shim/__pycache__/daemon.*.opt-2.pyc"))
    config = prefix / "etc" / "cri-shim" / "config.toml"
    assert config.read_text() == (REPO / "contrib" / "config.toml").read_text()
    # The installed binary accepts the installed config.
    subprocess.run(
        [venv / "bin" / "cri-shim", "config", "--config", config], check=True, capture_output=True
    )
    crictl = prefix / "etc" / "crictl.yaml"
    assert "unix:///run/cri-shim/cri-shim.sock" in crictl.read_text()
    cni = prefix / "etc" / "cni" / "net.d"
    assert sorted(p.name for p in cni.iterdir()) == ["10-cri-shim-bridge.conflist"]

    unit = prefix / "etc" / "systemd" / "system" / "cri-shim.service"
    service = read_unit(unit)["Service"]
    assert service["ExecStart"] == f"{venv}/bin/python {INSTALLED_PYTHON} serve --config {config}"
    assert service["KillMode"] == "process"
    if shutil.which("systemd-analyze"):
        verify_unit(unit)  # the installed unit, with its binary really there

    # Again, after an operator edited the config, crictl.yaml, and replaced the network:
    # their files stay, the network is not brought back, the package is reinstalled.
    config.write_text(config.read_text() + '\nlog_format = "json"\n')
    crictl.write_text("runtime-endpoint: unix:///somewhere/else.sock\n")
    (cni / "10-cri-shim-bridge.conflist").unlink()
    (cni / "05-calico.conflist").write_text('{"cniVersion": "1.0.0", "name": "k8s-pod-network"}')
    package = next(venv.glob("lib/python*/site-packages/cri_shim/__init__.py"))
    os.utime(package, (0, 0))
    out = run_install(prefix)
    assert package.stat().st_mtime > 0, "the package was not reinstalled from the checkout"
    assert config.read_text().endswith('log_format = "json"\n')
    assert crictl.read_text() == "runtime-endpoint: unix:///somewhere/else.sock\n"
    assert sorted(p.name for p in cni.iterdir()) == ["05-calico.conflist"]
    assert read_unit(unit)["Service"]["ExecStart"] == service["ExecStart"]
    assert f"kept {config}" in out


# What a daemon that has only started and answered a call has no use for, with what each
# costs resident (measured in the project's venv): imported by the code path that needs it.
_NOT_AT_IDLE = {
    "zstandard": "layer decompression, ~0.5 MiB with tarfile",
    "tarfile": "layer unpacking",
    "httpx": "the registry client, ~4 MiB",
    "prometheus_client": "the metrics exporter, ~2 MiB",
    "h11": "the streaming server",
    "websockets": "the streaming server",
    "pyroute2": "netlink, ~11 MiB (not used at all)",
    "secrets": "hmac and random along with it",
    "opentelemetry": "the tracing stack, only with [tracing] endpoint",
    "hypothesis": "the tests' property checks, never the daemon's",
    "pytest": "the tests' runner, never the daemon's",
}


@pytest.mark.root
def test_an_idle_daemon_imports_only_what_serving_needs(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d = make_daemon()
    d.env = {"PYTHONPROFILEIMPORTTIME": "1"}  # each import, to stderr (the daemon's log)
    d.start()
    d.runtime().Version(api_pb2.VersionRequest(), timeout=10)
    d.runtime().ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=10)
    imported = {
        line.split("|")[2].strip()
        for line in d.log_path.read_text().splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert "cri_shim.daemon" in imported  # the log does list the daemon's imports
    loaded = {name: why for name, why in _NOT_AT_IDLE.items() if name in imported}
    assert loaded == {}


def test_install_with_an_existing_environment(tmp_path: Path) -> None:
    """--venv: the unit runs the given environment's binary; no package is built."""
    prefix = tmp_path / "node"
    venv = REPO / ".venv"
    out = run_install(prefix, "--venv", str(venv))
    assert "using cri-shim" in out
    assert not (prefix / "opt" / "cri-shim" / "venv").exists()
    config = prefix / "etc" / "cri-shim" / "config.toml"
    units = prefix / "etc" / "systemd" / "system"
    service = read_unit(units / "cri-shim.service")["Service"]
    assert service["ExecStart"] == f"{venv}/bin/python {INSTALLED_PYTHON} serve --config {config}"
    assert (units / "cri-shim.socket").read_text() == SOCKET_UNIT.read_text()

    # Without socket activation: the service alone, which then binds the socket itself.
    out = run_install(prefix, "--venv", str(venv), "--no-socket-activation")
    assert "removed" in out and not (units / "cri-shim.socket").exists()
    alone = read_unit(units / "cri-shim.service")
    assert "Requires" not in alone["Unit"] and "Also" not in alone["Install"]
    assert "PropagatesStopTo" not in alone["Unit"]
    assert alone["Unit"]["After"] == "network-online.target local-fs.target"
    verify_unit(units / "cri-shim.service")
