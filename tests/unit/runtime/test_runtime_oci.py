"""OciRuntime: runc's own words in every error, a budget on every call."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cri_shim.errors import DeadlineExceeded, FailedPrecondition, Internal, NotFound
from cri_shim.runtime.oci import OciRuntime, runtime_error_message


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (
            '{"level":"error","msg":"container does not exist","time":"2024-01-01T00:00:00Z"}\n',
            "container does not exist",
        ),
        # Both lines of runc's OOM-score failure: the first one is the cause.
        (
            '{"level":"fatal","msg":"nsexec[17051]: failed to update /proc/self/oom_score_adj: '
            'Permission denied","time":"t"}\n'
            '{"level":"error","msg":"runc run failed: unable to start container process: '
            'can\'t get final child\'s PID from pipe: EOF","time":"t"}\n',
            "nsexec[17051]: failed to update /proc/self/oom_score_adj: Permission denied; "
            "runc run failed: unable to start container process: can't get final child's PID "
            "from pipe: EOF",
        ),
        ('{"level":"warning","msg":"ignored"}\n{"level":"error","msg":"real"}\n', "real"),
        (
            'time="2024-01-01T00:00:00Z" level=error msg="runc create failed: exec: '
            '\\"/x\\": stat /x: no such file or directory"\n',
            'runc create failed: exec: "/x": stat /x: no such file or directory',
        ),
        ("plain text failure\n", "plain text failure"),
        ('{"level":"error","msg":"same"}\n{"level":"error","msg":"same"}\n', "same"),
        ("", ""),
    ],
)
def test_runtime_error_message(output: str, message: str) -> None:
    assert runtime_error_message(output) == message


def fake_runc(tmp_path: Path, body: str) -> OciRuntime:
    """A one-off runtime script; `$LOG` is the --log file runc would write to."""
    script = tmp_path / "fake-runc"
    script.write_text(
        "#!/bin/sh\n"
        'while [ $# -gt 0 ]; do case "$1" in\n'
        '  --log) LOG="$2"; shift 2;; --root|--log-format) shift 2;; *) break;; esac; done\n' + body
    )
    script.chmod(0o755)
    return OciRuntime(script, tmp_path / "root", log_dir=tmp_path / "logs", call_timeout=5)


async def test_failure_carries_the_log_files_message(tmp_path: Path) -> None:
    runtime = fake_runc(
        tmp_path,
        """
echo '{"level":"error","msg":"unable to apply caps: operation not permitted"}' >> "$LOG"
echo 'unable to apply caps: operation not permitted' >&2
exit 1
""",
    )
    with pytest.raises(Internal, match="fake-runc start: unable to apply caps: operation not"):
        await runtime.start("c1")
    assert list((tmp_path / "logs").iterdir()) == []  # per-call logs are removed


async def test_failure_without_a_log_uses_stderr_then_the_status(tmp_path: Path) -> None:
    runtime = fake_runc(tmp_path, 'echo "went wrong" >&2; exit 2\n')
    with pytest.raises(Internal, match="went wrong"):
        await runtime.kill("c1", 15)
    runtime = fake_runc(tmp_path, "exit 3\n")
    with pytest.raises(Internal, match="exit status 3"):
        await runtime.kill("c1", 15)


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ("container does not exist", NotFound),
        ("container not running", FailedPrecondition),
        ("cannot exec in a stopped container", FailedPrecondition),
        ("cgroup busy", Internal),
    ],
)
async def test_errors_are_classified(tmp_path: Path, message: str, error: type[Exception]) -> None:
    runtime = fake_runc(
        tmp_path,
        f"""echo '{{"level":"error","msg":"{message}"}}' >> "$LOG"
exit 1
""",
    )
    with pytest.raises(error, match=message):
        await runtime.kill("c1", 9)


async def test_every_call_has_a_budget(tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    runtime = fake_runc(tmp_path, f"echo $$ > {marker}; exec sleep 30\n")
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"state c1 did not finish within 0\.3s"):
        await runtime.state("c1", timeout=0.3)
    assert time.monotonic() - started < 10  # not waited on for its 30 s
    with pytest.raises(ProcessLookupError):  # the hung runtime was killed, not abandoned
        os.kill(int(marker.read_text()), 0)


async def test_arguments_and_outputs(tmp_path: Path) -> None:
    args_file = tmp_path / "args"
    runtime = fake_runc(
        tmp_path,
        f"""echo "$@" >> {args_file}
case "$1" in
  state) echo '{{"id":"c1","pid":42,"status":"running","bundle":"/b","created":"t"}}';;
  list) echo 'null';;
  update) cat >> {args_file};;
esac
""",
    )
    state = await runtime.state("c1")
    assert (state.id, state.pid, state.status, state.bundle) == ("c1", 42, "running", Path("/b"))
    assert await runtime.list() == []
    await runtime.kill("c1", 9, all=True)
    await runtime.delete("c1", force=True)
    await runtime.update("c1", {"cpu": {"shares": 2}})
    assert args_file.read_text().splitlines() == [
        "state c1",
        "list --format json",
        "kill --all c1 9",
        "delete --force c1",
        "update --resources - c1",
        '{"cpu": {"shares": 2}}',
    ]
    assert runtime.conmon_runtime_args() == [f"--root={tmp_path / 'root'}", "--log-format=json"]


async def test_exec_output_is_capped_but_drained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cri_shim.runtime.oci as oci

    monkeypatch.setattr(oci, "MAX_EXEC_OUTPUT", 1000)
    runtime = fake_runc(tmp_path, 'shift 4; exec "$@"\n')  # drops: exec --pid-file <f> c1
    result = await runtime.exec_sync("c1", ["sh", "-c", "head -c 100000 /dev/zero; exit 0"], 5)
    assert len(result.stdout) == 1000 and result.exit_code == 0


@pytest.mark.usefixtures("protected_daemon")
async def test_an_exec_runs_without_the_daemons_oom_protection(tmp_path: Path) -> None:
    # A probe's command, in as many copies as the pods have probes: under memory pressure
    # it must weigh as any process does, not be spared as the daemon is.
    runtime = fake_runc(tmp_path, 'shift 4; exec "$@"\n')  # drops: exec --pid-file <f> c1
    result = await runtime.exec_sync("c1", ["cat", "/proc/self/oom_score_adj"], 5)
    assert result.stdout == b"0\n"
