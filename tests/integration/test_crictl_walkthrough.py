"""The README's crictl session, run with the real crictl against the real daemon.

The session is read from the README (its set-up lines, its files and its command lines)
and every command line the test runs is checked against it, so the README stays what a
user can type. The image and its registry come from the README's `scripts/demo-registry`,
run on a free port with a directory of the test's own; crictl's configuration is the file
the README installs. crictl comes from the conformance kit beside the repository
(`../shared/conformance/bin/crictl`); without it the tests skip.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from cri_shim.api.v1 import api_pb2
from tests.conformance import DEFAULT_KIT
from tests.harness import REPO, Daemon, wait_until
from tests.integration.cri_testkit import remove_pod, status
from tests.registry import free_port

CRICTL = DEFAULT_KIT / "bin" / "crictl"
COMMAND_TIMEOUT = 60.0

pytestmark = [
    pytest.mark.integration,
    pytest.mark.root,
    pytest.mark.skipif(
        not CRICTL.exists(),
        reason=f"crictl not found at {CRICTL} (the conformance kit beside the repository)",
    ),
]

# What the README's session names, and what the test puts in its place.
README_SOCKET = "/run/cri-shim/cri-shim.sock"
README_REGISTRY = "127.0.0.1:5000"
README_LOG_DIR = "/tmp/web-logs"
README_LOCAL_PORT = "8081:"
INDEX_HTML = b"hello from the pod\n"  # what scripts/demo-registry puts in /www/index.html
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


@dataclass
class ReadmeSession:
    """The shell block of the README's crictl section: the set-up lines before the
    session, its here-documents and the command lines that run crictl, in order (comments
    stripped)."""

    setup: list[str]
    files: dict[str, str]
    commands: list[str]

    def setup_line(self, pattern: str) -> re.Match[str]:
        """The set-up line matching `pattern` (a whole line)."""
        found = [m for line in self.setup if (m := re.fullmatch(pattern, line))]
        assert len(found) == 1, (pattern, self.setup)
        return found[0]


def readme_session() -> ReadmeSession:
    section = (REPO / "README.md").read_text().split("## Using it with crictl\n", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    setup: list[str] = []
    files: dict[str, str] = {}
    commands: list[str] = []
    lines = iter(block.splitlines())
    for line in lines:
        if heredoc := re.fullmatch(r"cat > (\S+) <<EOF", line):
            body = []
            for inner in lines:
                if inner == "EOF":
                    break
                body.append(inner)
            files[Path(heredoc[1]).name] = "\n".join(body) + "\n"
        elif "crictl " in line:
            commands.append(re.sub(r"\s+#\s.*$", "", line).strip())
        elif not files and not commands:
            setup.append(re.sub(r"\s+#\s.*$", "", line).strip())
    return ReadmeSession(setup, files, commands)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


@dataclass
class Session:
    """Runs the README's command lines with the real crictl, pointed at the test daemon
    by a config file of its own, and records them for the comparison with the README."""

    workdir: Path
    config: Path
    substitutions: dict[str, str]
    variables: dict[str, str] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)
    background: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def _argv(self, line: str) -> tuple[str | None, bytes | None, list[str]]:
        self.ran.append(line)
        assign, stdin = None, None
        if captured := re.fullmatch(r"(\w+)=\$\((.*)\)", line):
            assign, line = captured[1], captured[2]
        if piped := re.fullmatch(r"echo (\S+) \| (.*)", line):
            stdin, line = piped[1].encode() + b"\n", piped[2]
        line = line.removesuffix(" &")
        for old, new in {**self.substitutions, **self.variables}.items():
            line = line.replace(old, new)
        words = shlex.split(line)
        assert words[0] == "crictl", line
        return assign, stdin, [str(CRICTL), "--config", str(self.config), *words[1:]]

    def run(self, line: str) -> Result:
        """A command line, to its end; `VAR=$(…)` keeps the output as `$VAR`."""
        assign, stdin, argv = self._argv(line)
        done = subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            cwd=self.workdir,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
        result = Result(done.returncode, done.stdout.decode(), done.stderr.decode())
        if assign is not None:
            assert result.returncode == 0, (line, result)
            self.variables[f"${assign}"] = result.stdout.strip()
        return result

    def ok(self, line: str) -> Result:
        result = self.run(line)
        assert result.returncode == 0, (line, result)
        return result

    def start(self, line: str) -> subprocess.Popen[bytes]:
        """A command line ending in `&`: runs on until the session ends."""
        assert line.endswith(" &"), line
        _, _, argv = self._argv(line)
        proc = subprocess.Popen(
            argv,
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.background.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.background:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@dataclass
class DemoRegistry:
    """What the README's `scripts/demo-registry` made: a registry and web:1 in it."""

    host: str
    manifest_digest: str
    image_id: str


@pytest.fixture
def registry(short_tmp: Path) -> Iterator[DemoRegistry]:
    """The README's `scripts/demo-registry` line, on a free port and a directory of the
    test's own (the README's 127.0.0.1:5000 may be taken on this machine)."""
    command = readme_session().setup_line(r"scripts/demo-registry")[0]
    host = f"127.0.0.1:{free_port()}"
    own = ["--address", host, "--dir", str(short_tmp / "demo-registry")]
    run = [str(REPO / command), *own]
    subprocess.run(run, check=True, cwd=REPO, capture_output=True, timeout=120)
    try:
        # The image as the registry serves it: the manifest's digest and its config's.
        manifest = httpx.get(
            f"http://{host}/v2/web/manifests/1", headers={"Accept": OCI_MANIFEST}, timeout=10
        ).raise_for_status()
        config_digest = manifest.json()["config"]["digest"]
        yield DemoRegistry(host, manifest.headers["Docker-Content-Digest"], config_digest)
    finally:
        subprocess.run([*run, "stop"], check=True, cwd=REPO, capture_output=True, timeout=60)


def _remove_everything(daemon: Daemon) -> None:
    """After a failed step: what the session made must not outlive the test."""
    runtime = daemon.runtime()
    for sandbox in runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=10).items:
        remove_pod(daemon, sandbox.id)


def start_session(daemon: Daemon, workdir: Path, substitutions: dict[str, str]) -> Session:
    """A session in `workdir` (made here) with the README's files, pointed at `daemon`
    by the crictl configuration the README installs (into the workdir, not /etc)."""
    substitutions = {README_SOCKET: str(daemon.socket), **substitutions}
    workdir.mkdir()
    readme = readme_session()
    installed = readme.setup_line(r"\[ -e /etc/crictl\.yaml \] \|\| cp (\S+) /etc/crictl\.yaml")
    files = {"crictl.yaml": (REPO / installed[1]).read_text(), **readme.files}
    for name, content in files.items():
        for old, new in substitutions.items():
            content = content.replace(old, new)
        (workdir / name).write_text(content)
    return Session(workdir, workdir / "crictl.yaml", substitutions)


@pytest.fixture
def session(
    make_daemon: Any, registry: DemoRegistry, short_tmp: Path
) -> Iterator[tuple[Session, Daemon]]:
    daemon: Daemon = make_daemon(settings={"images": {"insecure_registries": [registry.host]}})
    daemon.start()
    made = start_session(
        daemon,
        short_tmp / "session",
        {
            README_REGISTRY: registry.host,
            README_LOG_DIR: str(short_tmp / "web-logs"),
            README_LOCAL_PORT: f"{free_port()}:",
        },
    )
    try:
        yield made, daemon
    finally:
        made.close()
        _remove_everything(daemon)


def _http_get(url: str) -> bytes | None:
    try:
        return httpx.get(url, timeout=2).content
    except httpx.HTTPError:
        return None


def test_the_readme_session_with_crictl(
    session: tuple[Session, Daemon], registry: DemoRegistry
) -> None:
    crictl, daemon = session
    reference = f"{registry.host}/web:1"

    # The pod.
    crictl.run("POD=$(crictl runp pod.json)")
    pod_id = crictl.variables["$POD"]
    assert re.fullmatch(r"[0-9a-f]{64}", pod_id), pod_id
    [listed] = crictl.ok("crictl pods -o json").json()["items"]
    assert listed["id"] == pod_id and listed["state"] == "SANDBOX_READY"
    assert listed["metadata"] == {
        "name": "web",
        "namespace": "default",
        "uid": "web-1",
        "attempt": 0,
    }
    inspected = crictl.ok("crictl inspectp $POD").json()
    assert inspected["status"]["id"] == pod_id
    assert inspected["status"]["state"] == "SANDBOX_READY"
    assert daemon.network is not None
    prefix = daemon.network.subnet.rsplit(".", 1)[0] + "."
    assert inspected["status"]["network"]["ip"].startswith(prefix), inspected["status"]
    assert inspected["info"], inspected

    # The image.
    assert registry.image_id in crictl.ok(f"crictl pull {README_REGISTRY}/web:1").stdout
    [listed_image] = crictl.ok("crictl images -o json").json()["images"]
    assert listed_image["id"] == registry.image_id
    assert listed_image["repoTags"] == [reference]
    assert listed_image["repoDigests"] == [f"{registry.host}/web@{registry.manifest_digest}"]
    assert int(listed_image["size"]) > 1_000_000

    # The container.
    crictl.run("CTR=$(crictl create $POD container.json pod.json)")
    container_id = crictl.variables["$CTR"]
    assert re.fullmatch(r"[0-9a-f]{64}", container_id), container_id
    assert crictl.ok("crictl start $CTR").stdout.strip() == container_id
    [running] = crictl.ok("crictl ps -o json").json()["containers"]
    assert running["id"] == container_id and running["podSandboxId"] == pod_id
    assert running["state"] == "CONTAINER_RUNNING"
    assert running["metadata"]["name"] == "app"
    container = crictl.ok("crictl inspect $CTR").json()
    assert container["status"]["state"] == "CONTAINER_RUNNING"
    assert container["status"]["image"]["image"] == reference
    assert container["status"]["logPath"] == str(crictl.workdir.parent / "web-logs" / "app.log")
    assert container["info"]["pid"] > 0, container["info"]

    logs = crictl.ok("crictl logs $CTR")
    assert logs.stdout == "started\n", logs

    # crictl exits with 1 whatever the command's code, and names the code.
    synced = crictl.run("crictl exec -s $CTR sh -c 'exit 3'")
    assert synced.returncode == 1 and "exited with 3" in synced.stderr, synced
    streamed = crictl.run("crictl exec $CTR sh -c 'exit 4'")
    assert streamed.returncode == 1 and "exit code 4" in streamed.stderr, streamed
    streamed = crictl.ok("echo hello | crictl exec -i $CTR tr a-z A-Z")
    assert streamed.stdout == "HELLO\n", streamed

    forward = crictl.start("crictl port-forward $POD 8081:8080 &")
    local = crictl.substitutions[README_LOCAL_PORT].rstrip(":")
    served = wait_until(lambda: _http_get(f"http://127.0.0.1:{local}/"), timeout=20)
    assert served == INDEX_HTML
    assert forward.poll() is None, "crictl port-forward ended"

    # A MiB written into the container's writable layer (not through crictl: the
    # session stays the README's) must show in its filesystem use, and the image's
    # layers below it must not.
    written = daemon.runtime().ExecSync(
        api_pb2.ExecSyncRequest(
            container_id=container_id,
            cmd=["dd", "if=/dev/urandom", "of=/written", "bs=4096", "count=256"],
            timeout=30,
        ),
        timeout=60,
    )
    assert written.exit_code == 0, written
    [stats] = crictl.ok("crictl stats -o json $CTR").json()["stats"]
    assert stats["attributes"]["id"] == container_id
    assert int(stats["memory"]["workingSetBytes"]["value"]) > 0, stats
    assert "usageCoreNanoSeconds" in stats["cpu"], stats
    used = int(stats["writableLayer"]["usedBytes"]["value"])
    assert 1 << 20 <= used < (1 << 20) + int(listed_image["size"]), stats
    assert int(stats["writableLayer"]["inodesUsed"]["value"]) >= 1, stats

    # And all of it away again.
    assert crictl.ok("crictl stop $CTR").stdout.strip() == container_id
    assert status(daemon, container_id).state == api_pb2.CONTAINER_EXITED
    assert crictl.ok("crictl rm $CTR").stdout.strip() == container_id
    assert crictl.ok("crictl stopp $POD").stdout.strip() == f"Stopped sandbox {pod_id}"
    assert crictl.ok("crictl rmp $POD").stdout.strip() == f"Removed sandbox {pod_id}"
    assert crictl.ok(f"crictl rmi {README_REGISTRY}/web:1").stdout.strip() == (
        f"Deleted: {reference}"
    )

    assert crictl.ran == readme_session().commands
    assert daemon.leaks() == {}
    assert daemon.runc_containers() == []
    assert list(daemon.images().ListImages(api_pb2.ListImagesRequest(), timeout=10).images) == []
