"""runtime/apparmor.py: which profile a container gets, and the runtime's own profile
loaded where the host has AppArmor. The kernel's files and apparmor_parser are fakes here
(this host's kernel has no AppArmor); the profile itself is compiled by the real parser
where it is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition, InvalidArgument
from cri_shim.runtime.apparmor import DEFAULT_PROFILE, AppArmor, default_profile_text

Profile = api_pb2.SecurityProfile


def fake_host(
    tmp_path: Path, enabled: str, loaded: str = "", parser_exit: int = 0, loads_as: str = "enforce"
) -> AppArmor:
    """A host whose AppArmor is two files, and whose apparmor_parser (a fake) keeps the
    profile it is given and lists it (replacing its line) in mode `loads_as`, or fails."""
    (tmp_path / "enabled").write_text(enabled)
    profiles = tmp_path / "profiles"
    profiles.write_text(loaded)
    parser = tmp_path / "fake_apparmor_parser"
    parser.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/calls\n'
        f"cat > {tmp_path}/given\n"
        f'[ {parser_exit} -eq 0 ] || {{ echo "syntax error at line 3" >&2; exit {parser_exit}; }}\n'
        f'grep -v "^{DEFAULT_PROFILE} (" {profiles} > {profiles}.new\n'
        f'echo "{DEFAULT_PROFILE} ({loads_as})" >> {profiles}.new\n'
        f"mv {profiles}.new {profiles}\n"
    )
    parser.chmod(0o755)
    return AppArmor(enabled_file=tmp_path / "enabled", profiles_file=profiles, parser=str(parser))


def context(
    kind: int | None = None, name: str = "", **fields: object
) -> api_pb2.LinuxContainerSecurityContext:
    sc = api_pb2.LinuxContainerSecurityContext(**fields)  # type: ignore[arg-type]
    if kind is not None:
        sc.apparmor.CopyFrom(Profile(profile_type=kind, localhost_ref=name))  # type: ignore[arg-type]
    return sc


def test_runtime_default_loads_the_runtimes_profile_once(tmp_path: Path) -> None:
    host = fake_host(tmp_path, "Y\n")
    assert host.runtime_default() == f"{DEFAULT_PROFILE} (loaded when first needed)"
    assert host.profile_for(context(Profile.RuntimeDefault)) == DEFAULT_PROFILE
    assert (tmp_path / "given").read_text() == default_profile_text()
    assert (tmp_path / "calls").read_text().split() == ["-Kr"]
    # A container asking for nothing gets it too, and it is not loaded again.
    assert host.profile_for(context()) == DEFAULT_PROFILE
    assert len((tmp_path / "calls").read_text().splitlines()) == 1
    assert host.runtime_default() == f"{DEFAULT_PROFILE} (loaded)"


def test_a_runtime_profile_left_in_complain_mode_is_reloaded_enforcing(tmp_path: Path) -> None:
    # Complain mode logs what the profile would deny and denies nothing.
    host = fake_host(tmp_path, "Y\n", f"other (enforce)\n{DEFAULT_PROFILE} (complain)\n")
    assert "complain mode" in host.runtime_default()
    assert host.profile_for(context(Profile.RuntimeDefault)) == DEFAULT_PROFILE
    assert (tmp_path / "calls").read_text().split() == ["-Kr"]
    assert host.loaded() == {"other": "enforce", DEFAULT_PROFILE: "enforce"}
    assert host.runtime_default() == f"{DEFAULT_PROFILE} (loaded)"


def test_a_runtime_profile_that_stays_in_complain_mode_refuses_the_container(
    tmp_path: Path,
) -> None:
    host = fake_host(tmp_path, "Y\n", f"{DEFAULT_PROFILE} (complain)\n", loads_as="complain")
    with pytest.raises(FailedPrecondition, match=r"in complain mode after .* loaded it"):
        host.profile_for(context(Profile.RuntimeDefault))


def test_a_profile_that_cannot_be_loaded_refuses_the_container(tmp_path: Path) -> None:
    host = fake_host(tmp_path, "Y\n", parser_exit=1)
    with pytest.raises(FailedPrecondition, match=r"refused .*cri-shim-default.*syntax error"):
        host.profile_for(context(Profile.RuntimeDefault))
    missing = AppArmor(
        enabled_file=tmp_path / "enabled",
        profiles_file=tmp_path / "profiles",
        parser=str(tmp_path / "absent"),
    )
    with pytest.raises(FailedPrecondition, match="could not be loaded"):
        missing.profile_for(context())


def test_privileged_and_unconfined_run_unconfined(tmp_path: Path) -> None:
    host = fake_host(tmp_path, "Y\n")
    assert host.profile_for(context(Profile.Unconfined)) == "unconfined"
    assert host.profile_for(context(privileged=True)) == "unconfined"
    assert host.profile_for(context(apparmor_profile="unconfined")) == "unconfined"
    assert not (tmp_path / "calls").exists()


def test_a_named_profile_needs_the_host_and_the_profile(tmp_path: Path) -> None:
    host = fake_host(tmp_path, "Y\n", "k8s-deny-write (enforce)\ncri-default (enforce)\n")
    assert host.profile_for(context(Profile.Localhost, "k8s-deny-write")) == "k8s-deny-write"
    with pytest.raises(InvalidArgument, match="not loaded"):
        host.profile_for(context(Profile.Localhost, "other"))
    legacy = context(apparmor_profile="localhost/cri-default")
    assert host.profile_for(legacy) == "cri-default"
    # The field's reference as kubelet and critest send it, prefixed like the legacy one.
    prefixed = context(Profile.Localhost, "localhost/k8s-deny-write")
    assert host.profile_for(prefixed) == "k8s-deny-write"


def test_without_apparmor_only_a_named_profile_is_refused(tmp_path: Path) -> None:
    host = fake_host(tmp_path, "N\n")
    with pytest.raises(InvalidArgument, match="AppArmor is not enabled on this host"):
        host.profile_for(context(Profile.Localhost, "k8s-deny-write"))
    assert host.profile_for(context(Profile.RuntimeDefault)) is None
    assert host.runtime_default() == "unconfined: AppArmor is not enabled on this host"
    absent = AppArmor(enabled_file=tmp_path / "absent", profiles_file=tmp_path / "absent")
    assert absent.profile_for(context(Profile.RuntimeDefault)) is None


@pytest.mark.skipif(
    shutil.which("apparmor_parser") is None, reason="apparmor_parser is not installed"
)
def test_the_runtimes_profile_compiles(tmp_path: Path) -> None:
    # -Q: compile only, as this kernel has no AppArmor to load it into.
    done = subprocess.run(
        ["apparmor_parser", "-Q", "-K", "-o", str(tmp_path / "compiled")],
        input=default_profile_text().encode(),
        capture_output=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert (tmp_path / "compiled").stat().st_size > 0


def _apparmor_glob(pattern: str) -> re.Pattern[str]:
    """An AppArmor path glob (`*`, `**`, `?`, `[...]`, `[^...]`, `{a,b}`) as a regex."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.index("]", i)
            out.append(pattern[i : end + 1])
            i = end
        elif c == "{":
            out.append("(?:")
        elif c == "}":
            out.append(")")
        elif c == ",":
            out.append("|")
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def _denied(access: str) -> list[re.Pattern[str]]:
    """The path patterns the runtime's profile denies `access` (r or w) to."""
    rules = re.findall(r"^\s*deny (/\S+|@\{PROC\}\S*) (\w+),", default_profile_text(), re.M)
    return [
        _apparmor_glob(path.replace("@{PROC}/", "/proc/"))
        for path, modes in rules
        if access in modes
    ]


# The kernel's files that docker-default (and containerd's profile, made from it) keeps a
# container from writing; a few that matter more are named with why.
KERNEL_FILES = [
    "/proc/pressure/cpu",  # a PSI trigger is kernel memory and a poll wakeup per writer
    "/proc/pressure/memory",
    "/proc/sysrq-trigger",
    "/proc/timer_list",
    "/proc/bus/pci/00/00.0",
    "/proc/fs/nfsd/threads",
    "/proc/irq/1/smp_affinity",
    "/proc/driver/rtc",
    "/proc/tty/driver/serial",
    "/proc/acpi/wakeup",
    "/proc/scsi/scsi",
    "/proc/sysvipc/shm",
    "/proc/dynamic_debug/control",
    "/proc/sys/vm/drop_caches",
    "/proc/sys/kernel/core_pattern",
    "/proc/sys/fs/binfmt_misc/register",
]
# What a container may write: its own processes' files, namespaced sysctls.
OWN_FILES = [
    "/proc/1/oom_score_adj",
    "/proc/4242/attr/current",
    "/proc/12/task/13/comm",
    "/proc/sys/net/ipv4/ip_forward",
    "/proc/sys/kernel/shmmax",
]


def test_the_runtimes_profile_denies_writing_the_kernels_files_in_proc() -> None:
    denied = _denied("w")
    assert [f for f in KERNEL_FILES if not any(p.match(f) for p in denied)] == []
    assert [f for f in OWN_FILES if any(p.match(f) for p in denied)] == []


def test_the_runtimes_profile_denies_reading_the_energy_counters() -> None:
    counters = "/sys/devices/virtual/powercap/intel-rapl/intel-rapl:0/energy_uj"
    assert any(p.match(counters) for p in _denied("r"))
