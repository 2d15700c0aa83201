"""build_spec: seccomp, masked paths, namespaces, cgroups, resources, sysctls, hostname."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from runtime_spec_inputs import container_config

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.runtime.host_limits import HostLimits
from cri_shim.runtime.resources import _log_hugetlb_unenforced
from cri_shim.runtime.spec import DEFAULT_MASKED_PATHS, DEFAULT_READONLY_PATHS, SandboxContext

SpecOf = Callable[..., dict[str, Any]]


def _denied(spec: dict[str, Any]) -> set[str]:
    """The system calls refused whatever their arguments."""
    seccomp = spec["linux"]["seccomp"]
    assert seccomp["defaultAction"] == "SCMP_ACT_ALLOW"
    return {
        name
        for rule in seccomp["syscalls"]
        if rule["action"] == "SCMP_ACT_ERRNO" and not rule.get("args")
        for name in rule["names"]
    }


def _clone_flags_refused(spec: dict[str, Any]) -> int:
    """The clone flags any of which makes clone fail."""
    flags = 0
    for rule in spec["linux"]["seccomp"]["syscalls"]:
        if rule["names"] == ["clone"] and rule["action"] == "SCMP_ACT_ERRNO":
            (arg,) = rule["args"]
            assert arg["op"] == "SCMP_CMP_MASKED_EQ" and arg["value"] == arg["valueTwo"]
            flags |= arg["value"]
    return flags


# ---- seccomp --------------------------------------------------------------------------


def test_runtime_default_denies_dangerous_syscalls(spec_of: SpecOf) -> None:
    cfg = container_config()
    cfg.linux.security_context.seccomp.profile_type = api_pb2.SecurityProfile.RuntimeDefault
    denied = _denied(spec_of(cfg))
    assert {
        "kexec_load",
        "open_by_handle_at",
        "init_module",
        "mount",
        "unshare",
        "ptrace",
        "keyctl",
        "bpf",
        "reboot",
    } <= denied
    assert not {"read", "write", "clone", "execve", "openat"} & denied


def test_runtime_default_refuses_clone_into_new_namespaces(spec_of: SpecOf) -> None:
    cfg = container_config()
    cfg.linux.security_context.seccomp.profile_type = api_pb2.SecurityProfile.RuntimeDefault
    spec = spec_of(cfg)
    # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID and NEWNET; a thread or a
    # fork (CLONE_VM, CLONE_THREAD, SIGCHLD, ...) is not among them.
    assert _clone_flags_refused(spec) == 0x7E020000
    (clone3,) = [r for r in spec["linux"]["seccomp"]["syscalls"] if r["names"] == ["clone3"]]
    assert clone3["errnoRet"] == 38  # ENOSYS: the C library falls back to clone
    cfg.linux.security_context.capabilities.add_capabilities.append("SYS_ADMIN")
    admin = spec_of(cfg)
    assert _clone_flags_refused(admin) == 0
    assert not [r for r in admin["linux"]["seccomp"]["syscalls"] if "clone3" in r["names"]]


@pytest.mark.parametrize(
    ("capability", "now_allowed"),
    [
        ("SYS_ADMIN", {"mount", "unshare", "setns", "bpf"}),
        ("SYS_PTRACE", {"ptrace"}),
        ("SYS_MODULE", {"init_module", "finit_module"}),
        ("SYS_TIME", {"settimeofday"}),
    ],
)
def test_runtime_default_allows_what_an_added_capability_grants(
    spec_of: SpecOf, capability: str, now_allowed: set[str]
) -> None:
    cfg = container_config()
    cfg.linux.security_context.seccomp.profile_type = api_pb2.SecurityProfile.RuntimeDefault
    cfg.linux.security_context.capabilities.add_capabilities.append(capability)
    denied = _denied(spec_of(cfg))
    assert not now_allowed & denied
    assert "keyctl" in denied  # never allowed


@pytest.mark.parametrize(
    ("setup", "has_seccomp"),
    [
        (lambda sc: None, False),  # nothing requested: unconfined, as kubelet's default
        (lambda sc: sc.seccomp.__setattr__("profile_type", 1), False),  # Unconfined
        (lambda sc: sc.seccomp.__setattr__("profile_type", 0), True),  # RuntimeDefault
        (lambda sc: setattr(sc, "seccomp_profile_path", "runtime/default"), True),
        (lambda sc: setattr(sc, "seccomp_profile_path", "docker/default"), True),
        (lambda sc: setattr(sc, "seccomp_profile_path", "unconfined"), False),
    ],
)
def test_seccomp_choice(spec_of: SpecOf, setup: Callable[[Any], None], has_seccomp: bool) -> None:
    cfg = container_config()
    setup(cfg.linux.security_context)
    assert ("seccomp" in spec_of(cfg)["linux"]) is has_seccomp


def test_privileged_is_never_confined(spec_of: SpecOf) -> None:
    cfg = container_config()
    cfg.linux.security_context.privileged = True
    cfg.linux.security_context.seccomp.profile_type = api_pb2.SecurityProfile.RuntimeDefault
    assert (
        "seccomp" not in spec_of(cfg, sandbox=SandboxContext(pod_id="p", privileged=True))["linux"]
    )


def test_localhost_profile_is_loaded(spec_of: SpecOf, tmp_path: Path) -> None:
    profile = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86"]}],
        "syscalls": [
            {"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"},
            {
                "names": ["mount"],
                "action": "SCMP_ACT_ALLOW",
                "includes": {"caps": ["CAP_SYS_ADMIN"]},
            },
            {"names": ["chown"], "action": "SCMP_ACT_ALLOW", "excludes": {"caps": ["CAP_CHOWN"]}},
        ],
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    cfg = container_config()
    cfg.linux.security_context.seccomp.profile_type = api_pb2.SecurityProfile.Localhost
    cfg.linux.security_context.seccomp.localhost_ref = str(path)
    seccomp = spec_of(cfg)["linux"]["seccomp"]
    assert seccomp["defaultAction"] == "SCMP_ACT_ERRNO"
    assert seccomp["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"]
    # No CAP_SYS_ADMIN: the mount rule does not apply; CAP_CHOWN held: chown rule excluded.
    assert seccomp["syscalls"] == [{"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"}]

    cfg.linux.security_context.seccomp.localhost_ref = ""
    cfg.linux.security_context.seccomp_profile_path = f"localhost/{path}"
    cfg.linux.security_context.ClearField("seccomp")
    assert spec_of(cfg)["linux"]["seccomp"]["defaultAction"] == "SCMP_ACT_ERRNO"


@pytest.mark.parametrize(
    ("ref", "content", "message"),
    [
        ("/nonexistent/profile.json", None, "does not exist"),
        ("relative.json", None, "must be absolute"),
        ("{tmp}/bad.json", "{not json", "cannot load"),
        ("{tmp}/noaction.json", '{"syscalls": []}', "not a seccomp profile"),
    ],
)
def test_bad_localhost_profile_is_invalid(
    spec_of: SpecOf, tmp_path: Path, ref: str, content: str | None, message: str
) -> None:
    ref = ref.format(tmp=tmp_path)
    if content is not None:
        Path(ref).write_text(content)
    cfg = container_config()
    cfg.linux.security_context.seccomp.profile_type = api_pb2.SecurityProfile.Localhost
    cfg.linux.security_context.seccomp.localhost_ref = ref
    with pytest.raises(InvalidArgument, match=f"seccomp.localhost_ref.*{message}"):
        spec_of(cfg)


# ---- masked and read-only paths -------------------------------------------------------


def test_masked_and_readonly_paths(spec_of: SpecOf) -> None:
    linux = spec_of()["linux"]
    assert linux["maskedPaths"] == list(DEFAULT_MASKED_PATHS)
    assert "/proc/kcore" in linux["maskedPaths"]
    assert linux["readonlyPaths"] == list(DEFAULT_READONLY_PATHS)
    assert "/proc/sys" in linux["readonlyPaths"]

    cfg = container_config()
    cfg.linux.security_context.masked_paths.append("/proc/custom")
    cfg.linux.security_context.readonly_paths.append("/proc/other")
    linux = spec_of(cfg)["linux"]
    assert linux["maskedPaths"] == ["/proc/custom"]
    assert linux["readonlyPaths"] == ["/proc/other"]

    cfg.linux.security_context.privileged = True
    linux = spec_of(cfg, sandbox=SandboxContext(pod_id="p", privileged=True))["linux"]
    assert linux["maskedPaths"] == [] and linux["readonlyPaths"] == []


# ---- namespaces -----------------------------------------------------------------------


def _namespaces(spec: dict[str, Any]) -> dict[str, str | None]:
    return {ns["type"]: ns.get("path") for ns in spec["linux"]["namespaces"]}


def test_pod_namespaces_are_joined_by_path(spec_of: SpecOf) -> None:
    sandbox = SandboxContext(
        pod_id="p",
        netns_path=Path("/run/netns/p"),
        ipc_ns_path=Path("/run/ipc/p"),
        uts_ns_path=Path("/run/uts/p"),
        hostname="web-0",
    )
    spec = spec_of(sandbox=sandbox)
    assert _namespaces(spec) == {
        "mount": None,
        "network": "/run/netns/p",
        "ipc": "/run/ipc/p",
        "uts": "/run/uts/p",
        "pid": None,
    }
    assert spec["hostname"] == "web-0"


def test_host_namespaces_are_left_out(spec_of: SpecOf) -> None:
    spec = spec_of(sandbox=SandboxContext(pod_id="p", hostname="node1", host_pid=True))
    assert _namespaces(spec) == {"mount": None}
    # runc refuses a hostname without a UTS namespace of the container's own.
    assert "hostname" not in spec


@pytest.mark.parametrize(("cgroup_v2", "privileged"), [(False, False), (True, False), (True, True)])
def test_a_cgroup_namespace_of_its_own_on_cgroup_v2(
    spec_of: SpecOf, host: HostLimits, cgroup_v2: bool, privileged: bool
) -> None:
    cfg = container_config()
    cfg.linux.security_context.privileged = privileged
    sandbox = SandboxContext(pod_id="p", privileged=privileged)
    spec = spec_of(
        cfg, sandbox=sandbox, host=HostLimits(**{**host.__dict__, "cgroup_v2": cgroup_v2})
    )
    # Unprivileged on cgroup v2 only: a private namespace; v1 (and hybrid) and privileged
    # containers see the host's cgroups, as under containerd.
    assert ("cgroup" in _namespaces(spec)) == (cgroup_v2 and not privileged)
    assert _namespaces(spec).get("cgroup", "absent") in (None, "absent")


@pytest.mark.parametrize(
    ("mode", "pid_ns", "target", "expected"),
    [
        (api_pb2.CONTAINER, None, None, None),
        (api_pb2.NODE, None, None, "absent"),
        (api_pb2.POD, Path("/proc/42/ns/pid"), None, "/proc/42/ns/pid"),
        (api_pb2.TARGET, None, Path("/proc/77/ns/pid"), "/proc/77/ns/pid"),
    ],
)
def test_pid_namespace_modes(
    spec_of: SpecOf, mode: int, pid_ns: Path | None, target: Path | None, expected: str | None
) -> None:
    cfg = container_config()
    cfg.linux.security_context.namespace_options.pid = mode
    spec = spec_of(
        cfg, sandbox=SandboxContext(pod_id="p", pid_ns_path=pid_ns), target_pid_ns_path=target
    )
    namespaces = _namespaces(spec)
    if expected == "absent":
        assert "pid" not in namespaces
    else:
        assert namespaces["pid"] == expected


@pytest.mark.parametrize("mode", [api_pb2.POD, api_pb2.TARGET])
def test_pid_namespace_to_join_must_exist(spec_of: SpecOf, mode: int) -> None:
    cfg = container_config()
    cfg.linux.security_context.namespace_options.pid = mode
    with pytest.raises(InvalidArgument, match="namespace_options"):
        spec_of(cfg)


# ---- cgroups and resources ------------------------------------------------------------


@pytest.mark.parametrize(
    ("parent", "expected"),
    [
        ("", "/cri-shim/c1"),
        ("/kubepods/besteffort/pod123", "/kubepods/besteffort/pod123/cri-shim-c1"),
        ("/kubepods/", "/kubepods/cri-shim-c1"),
    ],
)
def test_cgroups_path(spec_of: SpecOf, parent: str, expected: str) -> None:
    spec = spec_of(sandbox=SandboxContext(pod_id="p", cgroup_parent=parent))
    assert spec["linux"]["cgroupsPath"] == expected


@pytest.mark.parametrize("parent", ["kubepods.slice", "relative/path"])
def test_non_cgroupfs_parent_is_invalid(spec_of: SpecOf, parent: str) -> None:
    with pytest.raises(InvalidArgument, match="cgroup_parent"):
        spec_of(sandbox=SandboxContext(pod_id="p", cgroup_parent=parent))


def test_resources(spec_of: SpecOf, host: HostLimits) -> None:
    cfg = container_config()
    res = cfg.linux.resources
    res.cpu_shares, res.cpu_quota, res.cpu_period = 512, 50000, 100000
    res.cpuset_cpus, res.cpuset_mems = "0-1", "0"
    res.memory_limit_in_bytes = 64 << 20
    res.hugepage_limits.append(api_pb2.HugepageLimit(page_size="2MB", limit=1 << 21))
    resources = spec_of(cfg, host=HostLimits(**{**host.__dict__, "hugetlb": True}))["linux"][
        "resources"
    ]
    assert resources["cpu"] == {
        "shares": 512,
        "quota": 50000,
        "period": 100000,
        "cpus": "0-1",
        "mems": "0",
    }
    assert resources["memory"] == {"limit": 64 << 20}  # no swap accounting here
    assert resources["hugepageLimits"] == [{"pageSize": "2MB", "limit": 1 << 21}]


def test_unset_resources_are_left_out(spec_of: SpecOf) -> None:
    assert spec_of()["linux"]["resources"] == {"devices": [{"allow": False, "access": "rwm"}]}


def test_swap_equals_memory_when_the_host_accounts_swap(spec_of: SpecOf, host: HostLimits) -> None:
    cfg = container_config()
    cfg.linux.resources.memory_limit_in_bytes = 64 << 20
    limits = HostLimits(**{**host.__dict__, "swap_accounting": True})
    assert spec_of(cfg, host=limits)["linux"]["resources"]["memory"] == {
        "limit": 64 << 20,
        "swap": 64 << 20,
    }


def test_unified_needs_cgroup_v2(spec_of: SpecOf, host: HostLimits) -> None:
    cfg = container_config()
    cfg.linux.resources.unified["memory.high"] = "1000000"
    with pytest.raises(InvalidArgument, match="unified"):
        spec_of(cfg)
    limits = HostLimits(**{**host.__dict__, "cgroup_v2": True})
    assert spec_of(cfg, host=limits)["linux"]["resources"]["unified"] == {"memory.high": "1000000"}


def test_hugepage_limits_left_out_without_a_hugetlb_controller(
    spec_of: SpecOf, caplog: pytest.LogCaptureFixture
) -> None:
    # kubelet's zero limit for every page size: runc would fail "cannot set hugetlb limit".
    cfg = container_config()
    for size in ("2MB", "1GB"):
        cfg.linux.resources.hugepage_limits.append(api_pb2.HugepageLimit(page_size=size))
    _log_hugetlb_unenforced.cache_clear()
    with caplog.at_level(logging.WARNING, "cri_shim.runtime.resources"):
        assert "hugepageLimits" not in spec_of(cfg)["linux"]["resources"]
        assert "hugepageLimits" not in spec_of(cfg)["linux"]["resources"]
    assert [r.message for r in caplog.records].count(
        "hugepage limits are not enforced: the cgroup hierarchy has no hugetlb controller"
    ) == 1


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"hugetlb/hugetlb.2MB.limit_in_bytes": "0"}, True),  # v1, its own hierarchy
        ({"cpu,hugetlb/hugetlb.1GB.limit_in_bytes": "0"}, True),  # v1, co-mounted
        ({"memory/memory.limit_in_bytes": "0"}, False),  # v1 hybrid without hugetlb
        ({"cgroup.controllers": "cpu memory hugetlb pids"}, True),  # v2
        ({"cgroup.controllers": "cpu memory pids"}, False),
    ],
)
def test_probe_finds_the_hugetlb_controller(
    tmp_path: Path, files: dict[str, str], expected: bool
) -> None:
    proc_self, cgroup_root = tmp_path / "proc", tmp_path / "cgroup"
    proc_self.mkdir()
    (proc_self / "status").write_text("CapBnd:\t000001ffffffffff\n")
    (proc_self / "oom_score_adj").write_text("0\n")
    for name, text in files.items():
        (cgroup_root / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroup_root / name).write_text(text)
    assert HostLimits.probe(proc_self, cgroup_root).hugetlb is expected


def test_negative_limits_are_invalid(spec_of: SpecOf) -> None:
    cfg = container_config()
    cfg.linux.resources.memory_limit_in_bytes = -5
    with pytest.raises(InvalidArgument, match="memory_limit_in_bytes"):
        spec_of(cfg)


# ---- sysctls --------------------------------------------------------------------------

PINNED = {"netns_path": Path("/n"), "ipc_ns_path": Path("/i"), "uts_ns_path": Path("/u")}


@pytest.mark.parametrize(
    ("sysctls", "pins", "expected"),
    [
        ({"net.ipv4.ip_forward": "1"}, PINNED, {"net.ipv4.ip_forward": "1"}),
        (
            {"net/ipv4/conf/eth0.100/forwarding": "1"},
            PINNED,
            {"net.ipv4.conf.eth0/100.forwarding": "1"},
        ),
        (
            {"kernel.shmmax": "1", "fs.mqueue.msg_max": "20"},
            PINNED,
            {"kernel.shmmax": "1", "fs.mqueue.msg_max": "20"},
        ),
        ({"net.ipv4.ip_forward": "1"}, {}, "host network"),
        ({"kernel.msgmax": "1"}, {"netns_path": Path("/n")}, "host IPC"),
        ({"vm.swappiness": "1"}, PINNED, "not a namespaced sysctl"),
    ],
)
def test_sysctls(
    spec_of: SpecOf, sysctls: dict[str, str], pins: dict[str, Path], expected: Any
) -> None:
    sandbox = SandboxContext(pod_id="p", sysctls=sysctls, **pins)
    if isinstance(expected, str):
        with pytest.raises(InvalidArgument, match=expected):
            spec_of(sandbox=sandbox)
    else:
        assert spec_of(sandbox=sandbox)["linux"]["sysctl"] == expected


def test_annotations_carry_the_request_and_the_pod(spec_of: SpecOf) -> None:
    cfg = container_config()
    cfg.annotations["team"] = "blue"
    annotations = spec_of(cfg, sandbox=SandboxContext(pod_id="pod-9"))["annotations"]
    assert annotations["team"] == "blue"
    assert annotations["io.kubernetes.cri.sandbox-id"] == "pod-9"
