"""runtime/apparmor.py: which profile a container gets, and the runtime's own profile
loaded where the host has AppArmor. The kernel's files and apparmor_parser are fakes here
(this host's kernel has no AppArmor); the profile itself is compiled by the real parser
where it is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition, InvalidArgument
from cri_shim.runtime.apparmor import DEFAULT_PROFILE, AppArmor, default_profile_text

Profile = api_pb2.SecurityProfile


def fake_host(tmp_path: Path, enabled: str, loaded: str = "", parser_exit: int = 0) -> AppArmor:
    """A host whose AppArmor is two files, and whose apparmor_parser (a fake) keeps the
    profile it is given and adds its name to the loaded list, or fails."""
    (tmp_path / "enabled").write_text(enabled)
    profiles = tmp_path / "profiles"
    profiles.write_text(loaded)
    parser = tmp_path / "fake_apparmor_parser"
    parser.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/calls\n'
        f"cat > {tmp_path}/given\n"
        f'[ {parser_exit} -eq 0 ] || {{ echo "syntax error at line 3" >&2; exit {parser_exit}; }}\n'
        f'echo "{DEFAULT_PROFILE} (enforce)" >> {profiles}\n'
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
