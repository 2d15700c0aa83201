"""Security settings against the real daemon with real containers: seccomp profiles,
AppArmor (where the host has it), recursive read-only mounts and the supplemental groups
policy, each as kubelet sends it and as Status advertises it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import REPO, Daemon
from tests.imagebuild import build_oci_layout
from tests.integration.cri_testkit import (
    container_config,
    create,
    import_image,
    output,
    pod,
    run_to_exit,
    status,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]

APPARMOR_ENABLED = Path("/sys/module/apparmor/parameters/enabled")
GROUPS_IMAGE = "docker.io/library/busybox:groups"
PROGRAMS = REPO / "tests" / "fixtures" / "programs"


def _security(**fields: object) -> api_pb2.LinuxContainerConfig:
    return api_pb2.LinuxContainerConfig(
        security_context=api_pb2.LinuxContainerSecurityContext(**fields)  # type: ignore[arg-type]
    )


def _seccomp(kind: int, localhost_ref: str = "") -> api_pb2.LinuxContainerConfig:
    return _security(
        seccomp=api_pb2.SecurityProfile(profile_type=kind, localhost_ref=localhost_ref)
    )


@pytest.fixture
def image(daemon: Daemon, busybox_layout: Path) -> None:
    import_image(daemon, busybox_layout)


@pytest.fixture
def p(daemon: Daemon, image: None, short_tmp: Path) -> Iterator[tuple[str, object]]:
    with pod(daemon, "sec", short_tmp) as created:
        yield created


# ---- seccomp ---------------------------------------------------------------------------


def test_a_localhost_profile_that_forbids_mkdir_makes_it_fail(
    daemon: Daemon, p: tuple[str, api_pb2.PodSandboxConfig], short_tmp: Path
) -> None:
    profile = short_tmp / "no-mkdir.json"
    profile.write_text(
        json.dumps(
            {
                "defaultAction": "SCMP_ACT_ALLOW",
                "syscalls": [
                    {"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}
                ],
            }
        )
    )
    script = "mkdir /tmp/made && echo made || echo refused"
    denied = run_to_exit(
        daemon,
        p,
        container_config(
            "localhost",
            script,
            linux=_seccomp(api_pb2.SecurityProfile.Localhost, str(profile)),
        ),
    )
    assert output(denied) == ["refused"]
    assert output(denied, "stderr") == [
        "mkdir: can't create directory '/tmp/made': Operation not permitted"
    ]
    allowed = run_to_exit(
        daemon,
        p,
        container_config("unconfined", script, linux=_seccomp(api_pb2.SecurityProfile.Unconfined)),
    )
    assert output(allowed) == ["made"]


def test_runtime_default_refuses_what_unconfined_allows(
    daemon: Daemon, p: tuple[str, api_pb2.PodSandboxConfig]
) -> None:
    """A new user namespace needs no capability, so only seccomp stops it."""
    script = "unshare -U true && echo allowed || echo refused"
    default = run_to_exit(
        daemon,
        p,
        container_config("default", script, linux=_seccomp(api_pb2.SecurityProfile.RuntimeDefault)),
    )
    assert output(default) == ["refused"]
    unconfined = run_to_exit(
        daemon,
        p,
        container_config("unconfined2", script, linux=_seccomp(api_pb2.SecurityProfile.Unconfined)),
    )
    assert output(unconfined) == ["allowed"]


def probe_runner(
    daemon: Daemon, p: tuple[str, api_pb2.PodSandboxConfig], short_tmp: Path, program: str
) -> Callable[[str, api_pb2.LinuxContainerConfig], list[str]]:
    """run(name, linux): the output of `tests/fixtures/programs/<program>.c`, built static,
    run in a container of pod `p` with `linux`."""
    binary = short_tmp / program
    source = PROGRAMS / f"{program}.c"
    subprocess.run(["gcc", "-static", "-O", "-o", str(binary), str(source)], check=True)
    layout = build_oci_layout(
        short_tmp / f"{program}-layout",
        tag=program,
        extra_files={f"bin/{program}": binary.read_bytes()},
    )
    image = f"docker.io/library/busybox:{program.replace('_', '-')}"
    import_image(daemon, layout, image)

    def run(name: str, linux: api_pb2.LinuxContainerConfig) -> list[str]:
        script = f"chmod +x /bin/{program} && /bin/{program}"
        config = container_config(name, script, image=image, linux=linux)
        return output(run_to_exit(daemon, p, config))

    return run


def test_runtime_default_refuses_clone_into_a_new_namespace(
    daemon: Daemon, p: tuple[str, api_pb2.PodSandboxConfig], short_tmp: Path
) -> None:
    probe_in = probe_runner(daemon, p, short_tmp, "clone_probe")
    default = _seccomp(api_pb2.SecurityProfile.RuntimeDefault)
    assert probe_in("cloner", default) == [
        "clone(CLONE_NEWUSER): Operation not permitted",
        "fork: ok",
        "clone3: Function not implemented",
    ]
    unconfined = probe_in("cloner-unconfined", _seccomp(api_pb2.SecurityProfile.Unconfined))
    assert unconfined[:2] == ["clone(CLONE_NEWUSER): ok", "fork: ok"]
    assert unconfined[2] != "clone3: Function not implemented"


def test_runtime_default_refuses_io_uring(
    daemon: Daemon, p: tuple[str, api_pb2.PodSandboxConfig], short_tmp: Path
) -> None:
    """io_uring's calls reach kernel code that has been the way out of containers again
    and again; Docker and containerd refuse them by default too."""
    probe_in = probe_runner(daemon, p, short_tmp, "io_uring_probe")
    assert probe_in("uring", _seccomp(api_pb2.SecurityProfile.RuntimeDefault)) == [
        "io_uring_setup: Operation not permitted",
        "io_uring_enter: Operation not permitted",
        "io_uring_register: Operation not permitted",
    ]
    # Even CAP_SYS_ADMIN does not bring them back: no capability makes them safe.
    admin = _seccomp(api_pb2.SecurityProfile.RuntimeDefault)
    admin.security_context.capabilities.add_capabilities.append("SYS_ADMIN")
    assert probe_in("uring-admin", admin)[0] == "io_uring_setup: Operation not permitted"
    # Unconfined, the kernel answers: a ring, and EBADF or EINVAL for the bogus calls.
    unconfined = probe_in("uring-unconfined", _seccomp(api_pb2.SecurityProfile.Unconfined))
    assert unconfined[0] == "io_uring_setup: ok", unconfined
    assert not any("Operation not permitted" in line for line in unconfined), unconfined


@pytest.mark.parametrize(
    "content",
    [
        None,  # missing
        "[" * 100_000 + "]" * 100_000,  # too deep for the decoder
        '{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["kill"]}]}',  # no action
    ],
    ids=["missing", "deep", "no-action"],
)
def test_a_missing_or_malformed_localhost_profile_is_refused_by_name(
    daemon: Daemon, p: tuple[str, api_pb2.PodSandboxConfig], short_tmp: Path, content: str | None
) -> None:
    profile = short_tmp / "profile.json"
    if content is not None:
        profile.write_text(content)
    with pytest.raises(grpc.RpcError) as failure:
        create(
            daemon,
            p,
            container_config(
                "refused", "true", linux=_seccomp(api_pb2.SecurityProfile.Localhost, str(profile))
            ),
        )
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value.details()
    assert str(profile) in failure.value.details()


# ---- AppArmor --------------------------------------------------------------------------


@pytest.mark.skipif(
    APPARMOR_ENABLED.exists() and APPARMOR_ENABLED.read_text().strip() == "Y",
    reason="the host has AppArmor: covered where it has not (profiles are not loaded here)",
)
def test_without_apparmor_on_the_host_a_named_profile_is_refused_and_default_runs(
    daemon: Daemon, p: tuple[str, api_pb2.PodSandboxConfig]
) -> None:
    named = _security(
        apparmor=api_pb2.SecurityProfile(
            profile_type=api_pb2.SecurityProfile.Localhost, localhost_ref="k8s-deny-write"
        )
    )
    with pytest.raises(grpc.RpcError) as failure:
        create(daemon, p, container_config("named", "true", linux=named))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "AppArmor is not enabled on this host" in failure.value.details()
    default = _security(
        apparmor=api_pb2.SecurityProfile(profile_type=api_pb2.SecurityProfile.RuntimeDefault)
    )
    assert run_to_exit(daemon, p, container_config("aa", "true", linux=default)).exit_code == 0
    # Status says what RuntimeDefault means here.
    verbose = daemon.runtime().Status(api_pb2.StatusRequest(verbose=True), timeout=10)
    apparmor = json.loads(verbose.info["info"])["apparmor"]
    assert apparmor == {
        "enabled": False,
        "runtime_default": "unconfined: AppArmor is not enabled on this host",
    }


# ---- recursive read-only mounts -----------------------------------------------------------


@pytest.fixture
def volume_with_submount(short_tmp: Path) -> Iterator[Path]:
    """A host directory with a tmpfs mounted inside it (as a CSI volume under a hostPath)."""
    volume = short_tmp / "volume"
    sub = volume / "sub"
    sub.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(sub)], check=True)
    try:
        yield volume
    finally:
        subprocess.run(["umount", "-l", str(sub)], check=True)


def test_status_advertises_recursive_read_only_for_runc(daemon: Daemon) -> None:
    response = daemon.runtime().Status(api_pb2.StatusRequest(), timeout=10)
    features = {h.name: h.features for h in response.runtime_handlers}
    assert features["runc"].recursive_read_only_mounts
    assert features["runc"].user_namespaces


def test_a_recursive_read_only_mount_makes_a_sub_mount_read_only_too(
    daemon: Daemon, p: tuple[str, api_pb2.PodSandboxConfig], volume_with_submount: Path
) -> None:
    script = (
        "touch /v/top 2>/dev/null && echo top-written || echo top-refused; "
        "touch /v/sub/file 2>/dev/null && echo sub-written || echo sub-refused"
    )

    def run(name: str, recursive: bool) -> list[str]:
        mount = api_pb2.Mount(
            container_path="/v",
            host_path=str(volume_with_submount),
            readonly=True,
            recursive_read_only=recursive,
        )
        return output(run_to_exit(daemon, p, container_config(name, script, mounts=[mount])))

    # "ro" alone leaves what is mounted below writable: the reason rro exists.
    assert run("plain-ro", recursive=False) == ["top-refused", "sub-written"]
    assert run("rro", recursive=True) == ["top-refused", "sub-refused"]
    mount_status = status(daemon, daemon_last_container(daemon, "rro")).mounts[0]
    assert mount_status.recursive_read_only


def daemon_last_container(daemon: Daemon, name: str) -> str:
    listed = daemon.runtime().ListContainers(api_pb2.ListContainersRequest(), timeout=10)
    return next(c.id for c in listed.containers if c.metadata.name == name)


@pytest.mark.parametrize(
    ("readonly", "propagation", "complaint"),
    [
        (False, api_pb2.PROPAGATION_PRIVATE, "must also be readonly"),
        (True, api_pb2.PROPAGATION_HOST_TO_CONTAINER, "needs private propagation"),
    ],
)
def test_a_recursive_read_only_mount_that_cannot_hold_is_refused(
    daemon: Daemon,
    p: tuple[str, api_pb2.PodSandboxConfig],
    short_tmp: Path,
    readonly: bool,
    propagation: int,
    complaint: str,
) -> None:
    mount = api_pb2.Mount(
        container_path="/v",
        host_path=str(short_tmp),
        readonly=readonly,
        recursive_read_only=True,
        propagation=propagation,
    )
    with pytest.raises(grpc.RpcError) as failure:
        create(daemon, p, container_config("bad-rro", "true", mounts=[mount]))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert complaint in failure.value.details()
    assert "mounts[0].recursive_read_only" in failure.value.details()


# ---- supplemental groups policy ----------------------------------------------------------


@pytest.fixture
def groups_image(daemon: Daemon, short_tmp: Path) -> None:
    """The busybox image whose /etc/group puts `app` in group 50000."""
    layout = build_oci_layout(
        short_tmp / "groups-layout",
        tag="groups",
        extra_files={"etc/group": b"root:x:0:\napp:x:1000:\nextra:x:50000:app\n"},
    )
    import_image(daemon, layout, GROUPS_IMAGE)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [(api_pb2.Merge, [3000, 4000, 50000]), (api_pb2.Strict, [3000, 4000])],
)
def test_supplemental_groups_policy_decides_what_the_image_adds(
    daemon: Daemon,
    groups_image: None,
    short_tmp: Path,
    policy: int,
    expected: list[int],
) -> None:
    """As the Kubernetes e2e test does: runAsUser 1000 (in group 50000 by the image's
    /etc/group), runAsGroup 3000, supplementalGroups [4000]."""
    pod_security = api_pb2.LinuxSandboxSecurityContext(
        supplemental_groups=[4000], supplemental_groups_policy=policy
    )
    linux = api_pb2.LinuxPodSandboxConfig(security_context=pod_security)
    with pod(daemon, f"groups{policy}", short_tmp, linux=linux) as p:
        config = container_config(
            "ids",
            "id -G",
            image=GROUPS_IMAGE,
            linux=_security(
                run_as_user=api_pb2.Int64Value(value=1000),
                run_as_group=api_pb2.Int64Value(value=3000),
                supplemental_groups=[4000],
                supplemental_groups_policy=policy,
            ),
        )
        st = run_to_exit(daemon, p, config)
        assert sorted(int(g) for g in output(st)[0].split()) == expected
        user = st.user.linux
        assert (user.uid, user.gid) == (1000, 3000)
        assert sorted(user.supplemental_groups) == expected
        # Status reads who it runs as from the state, not from the bundle's spec.
        (spec,) = daemon.root.glob(f"containers/{st.id}/config.json")
        spec.rename(spec.with_name("config.json.moved"))
        again = (
            daemon.runtime()
            .ContainerStatus(api_pb2.ContainerStatusRequest(container_id=st.id), timeout=30)
            .status.user.linux
        )
        assert again == user


def test_status_advertises_the_supplemental_groups_policy(daemon: Daemon) -> None:
    response = daemon.runtime().Status(api_pb2.StatusRequest(), timeout=10)
    assert response.features.supplemental_groups_policy
