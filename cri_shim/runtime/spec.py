"""The OCI runtime spec (1.0.2) for a container, built from a CRI ContainerConfig.

Everything that decides what a container may do is here, in one pure function that only
reads files (the image's /etc/passwd, host devices, seccomp profiles). Defaults follow
CRI-O where Kubernetes users depend on them (capabilities, masked paths, mounts); limits
of this host are applied here, not discovered by runc failing (see host_limits).
"""

from __future__ import annotations

import logging
import os
import signal
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.host.idmap import UserNamespaceMappings
from cri_shim.pod_rules import namespaced_sysctls
from cri_shim.runtime.apparmor import AppArmor
from cri_shim.runtime.capabilities import CapabilitySet, resolve_capabilities
from cri_shim.runtime.cdi_on_demand import CdiOnDemand
from cri_shim.runtime.cgroup_driver import CGROUPFS_DRIVER, CgroupDriver
from cri_shim.runtime.host_limits import HostLimits, current_host_limits
from cri_shim.runtime.identity import EtcReader, ProcessIdentity, read_in_root, resolve_identity
from cri_shim.runtime.resources import clamp_oom_score_adj, linux_resources
from cri_shim.runtime.seccomp import default_profile, load_localhost_profile

log = logging.getLogger(__name__)

OCI_VERSION = "1.0.2"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A process may want many files; 1Mi is what containerd and CRI-O give. It is clamped to
# the daemon's hard limit because raising a hard limit needs CAP_SYS_RESOURCE.
DEFAULT_NOFILE = 1_048_576

DEFAULT_MASKED_PATHS: tuple[str, ...] = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)
DEFAULT_READONLY_PATHS: tuple[str, ...] = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
)

_PROPAGATION = {
    api_pb2.PROPAGATION_PRIVATE: "rprivate",
    api_pb2.PROPAGATION_HOST_TO_CONTAINER: "rslave",
    api_pb2.PROPAGATION_BIDIRECTIONAL: "rshared",
}


@dataclass(frozen=True)
class SandboxContext:
    """What a container takes from its pod. A namespace path of None means the host's."""

    pod_id: str
    hostname: str = ""
    netns_path: Path | None = None
    ipc_ns_path: Path | None = None
    uts_ns_path: Path | None = None
    # A pod with a user namespace of its own: its pin and its mappings.
    userns_path: Path | None = None
    userns: UserNamespaceMappings | None = None
    # Only for pods that share one PID namespace (shareProcessNamespace): the infra
    # process's /proc/<pid>/ns/pid. Otherwise each container gets its own.
    pid_ns_path: Path | None = None
    host_pid: bool = False
    resolv_conf_path: Path | None = None
    hostname_path: Path | None = None
    hosts_path: Path | None = None
    shm_path: Path | None = None
    cgroup_parent: str = ""
    # The daemon's driver, which reads cgroup_parent (a path, or a slice for systemd's).
    cgroup_driver: CgroupDriver = CGROUPFS_DRIVER
    privileged: bool = False
    run_as_user: int | None = None
    supplemental_groups: tuple[int, ...] = ()
    # The pod's SupplementalGroupsPolicy (api_pb2.Merge or api_pb2.Strict).
    supplemental_groups_policy: int = 0
    sysctls: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ImageConfigView:
    """The parts of an image's config that shape a container."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ()  # "KEY=value"
    working_dir: str = ""
    user: str = ""  # "", "name", "uid", "uid:gid", "name:group"
    stop_signal: str = ""  # "SIGTERM", "15", "" for the default
    # Reads a file of the image's root filesystem; None reads it from `rootfs`.
    read_etc: EtcReader | None = None


def build_spec(
    cfg: api_pb2.ContainerConfig,
    sandbox: SandboxContext,
    image: ImageConfigView,
    rootfs: Path,
    *,
    container_id: str,
    host: HostLimits | None = None,
    target_pid_ns_path: Path | None = None,
    host_dev: Path = Path("/dev"),
    mountinfo: Callable[[], str] | None = None,
    image_mounts: Mapping[int, Path] | None = None,
    cdi: CdiOnDemand | None = None,
    apparmor: AppArmor | None = None,
) -> dict[str, Any]:
    """The config.json for `container_id`. Raises InvalidArgument, naming the field, for
    a request that cannot be run. `target_pid_ns_path` is the PID namespace of the target
    container for NamespaceMode.TARGET (ephemeral debug containers). `image_mounts` are
    the host directories of the request's image volumes (see container_mounts). `cdi`
    resolves the CDI devices the request asks for; their edits are applied last."""
    host = host or current_host_limits()
    linux_cfg = cfg.linux if cfg.HasField("linux") else api_pb2.LinuxContainerConfig()
    sc = linux_cfg.security_context
    name = cfg.metadata.name or container_id
    # A stop signal that cannot be sent is refused now, not at the first StopContainer.
    resolve_stop_signal(cfg, image)
    privileged = sc.privileged
    if privileged and not sandbox.privileged:
        raise InvalidArgument(
            "security_context.privileged: a privileged container needs a privileged pod"
        )
    caps = resolve_capabilities(
        add=sc.capabilities.add_capabilities,
        drop=sc.capabilities.drop_capabilities,
        add_ambient=sc.capabilities.add_ambient_capabilities,
        privileged=privileged,
        bounding_set=host.capability_bounding_set,
        container=name,
    )
    identity = _container_identity(sc, sandbox, image, rootfs)
    process = _process(cfg, image, sandbox, identity, caps, host, name)
    if sandbox.userns is not None:
        _require_mapped(sandbox.userns, identity.uid, identity.gid, identity.additional_gids)
    linux = _linux(cfg, sandbox, caps, host, container_id, privileged, target_pid_ns_path, host_dev)
    profile = (apparmor or AppArmor()).profile_for(sc)
    if profile is not None:
        process["apparmorProfile"] = profile
    mounts, rootfs_propagation = container_mounts(
        cfg, sandbox, privileged=privileged, mountinfo=mountinfo, image_mounts=image_mounts
    )
    if rootfs_propagation:
        linux["rootfsPropagation"] = rootfs_propagation

    spec: dict[str, Any] = {
        "ociVersion": OCI_VERSION,
        "process": process,
        "root": {"path": str(rootfs), "readonly": sc.readonly_rootfs},
        "mounts": mounts,
        "annotations": {
            **dict(cfg.annotations),
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.container-name": cfg.metadata.name,
            "io.kubernetes.cri.sandbox-id": sandbox.pod_id,
        },
        "linux": linux,
    }
    # The pod's hostname, where the pod has a UTS namespace of its own.
    if sandbox.uts_ns_path is not None and sandbox.hostname:
        spec["hostname"] = sandbox.hostname
    if cdi is not None:
        cdi.inject(spec, cfg)
    return spec


def _container_identity(
    sc: api_pb2.LinuxContainerSecurityContext,
    sandbox: SandboxContext,
    image: ImageConfigView,
    rootfs: Path,
) -> ProcessIdentity:
    """The user, group and supplementary groups the process runs as."""
    # kubelet copies the pod's policy into each container; either one saying Strict wins.
    policies = (sc.supplemental_groups_policy, sandbox.supplemental_groups_policy)
    return resolve_identity(
        run_as_user=sc.run_as_user.value if sc.HasField("run_as_user") else None,
        run_as_username=sc.run_as_username,
        run_as_group=sc.run_as_group.value if sc.HasField("run_as_group") else None,
        image_user=image.user,
        supplemental_groups=[*sandbox.supplemental_groups, *sc.supplemental_groups],
        read_etc=image.read_etc or read_in_root(rootfs),
        strict_groups=api_pb2.Strict in policies,
    )


def _process(
    cfg: api_pb2.ContainerConfig,
    image: ImageConfigView,
    sandbox: SandboxContext,
    identity: ProcessIdentity,
    caps: CapabilitySet,
    host: HostLimits,
    name: str,
) -> dict[str, Any]:
    """The spec's `process`: what runs, as whom, with which capabilities and limits."""
    linux_cfg = cfg.linux
    process: dict[str, Any] = {
        "terminal": cfg.tty,
        "user": {"uid": identity.uid, "gid": identity.gid},
        "args": container_args(cfg, image),
        "env": container_env(cfg, image, hostname=sandbox.hostname, home=identity.home),
        "cwd": container_working_dir(cfg, image),
        "capabilities": {
            "bounding": list(caps.granted),
            "effective": list(caps.granted),
            "permitted": list(caps.granted),
            # Inheritable stays empty unless ambient capabilities need it (CVE-2022-27652).
            "inheritable": list(caps.ambient),
            "ambient": list(caps.ambient),
        },
        "rlimits": [
            {
                "type": "RLIMIT_NOFILE",
                "hard": min(DEFAULT_NOFILE, host.nofile_hard),
                "soft": min(DEFAULT_NOFILE, host.nofile_hard),
            }
        ],
        "noNewPrivileges": linux_cfg.security_context.no_new_privs,
        "oomScoreAdj": clamp_oom_score_adj(linux_cfg.resources.oom_score_adj, host, name),
    }
    if identity.additional_gids:
        process["user"]["additionalGids"] = list(identity.additional_gids)
    return process


def _linux(
    cfg: api_pb2.ContainerConfig,
    sandbox: SandboxContext,
    caps: CapabilitySet,
    host: HostLimits,
    container_id: str,
    privileged: bool,
    target_pid_ns_path: Path | None,
    host_dev: Path,
) -> dict[str, Any]:
    """The spec's `linux`: namespaces, cgroup and resources, devices, masked paths, id
    mappings, sysctls and seccomp (mounts' propagation is added by the caller)."""
    linux_cfg = cfg.linux
    sc = linux_cfg.security_context
    resources = linux_resources(
        linux_cfg.resources if linux_cfg.HasField("resources") else None, host
    )
    devices, device_rules = container_devices(cfg, privileged=privileged, host_dev=host_dev)
    resources["devices"] = device_rules
    namespaces = container_namespaces(cfg, sandbox, target_pid_ns_path)
    if host.cgroup_v2 and not privileged:
        # On cgroup v2, as containerd and CRI-O do: a cgroup namespace of the container's
        # own, rooted at its cgroup, so that it sees `0::/` and a /sys/fs/cgroup of its
        # own subtree, not the host's tree. A privileged container keeps the host's.
        namespaces.append({"type": "cgroup"})
    linux: dict[str, Any] = {
        "namespaces": namespaces,
        "cgroupsPath": cgroups_path(sandbox.cgroup_parent, container_id, sandbox.cgroup_driver),
        "resources": resources,
        "devices": devices,
        "maskedPaths": [] if privileged else list(sc.masked_paths or DEFAULT_MASKED_PATHS),
        "readonlyPaths": [] if privileged else list(sc.readonly_paths or DEFAULT_READONLY_PATHS),
    }
    if sandbox.userns is not None:
        linux.update(sandbox.userns.oci())
    sysctls = container_sysctls(sandbox)
    if sysctls:
        linux["sysctl"] = sysctls
    seccomp = container_seccomp(sc, caps.granted)
    if seccomp is not None:
        linux["seccomp"] = seccomp
    return linux


def _require_mapped(
    userns: UserNamespaceMappings, uid: int, gid: int, additional_gids: Iterable[int]
) -> None:
    """An id outside the pod's mappings cannot be taken inside its user namespace (runc
    would fail with a bare EINVAL); say which one, before anything is created."""
    if userns.host_uid(uid) is None:
        raise InvalidArgument(
            f"security_context.run_as_user: uid {uid} is outside the pod's user namespace "
            "mappings (userns_options.uids)"
        )
    for what, group in (("gid", gid), *(("supplemental group", g) for g in additional_gids)):
        if userns.host_gid(group) is None:
            raise InvalidArgument(
                f"security_context: {what} {group} is outside the pod's user namespace "
                "mappings (userns_options.gids)"
            )


def container_args(cfg: api_pb2.ContainerConfig, image: ImageConfigView) -> list[str]:
    """kubelet's rules: `command` replaces the entrypoint and drops the image's cmd;
    `args` alone replace the cmd; neither runs entrypoint + cmd."""
    if cfg.command:
        args = [*cfg.command, *cfg.args]
    elif cfg.args:
        args = [*image.entrypoint, *cfg.args]
    else:
        args = [*image.entrypoint, *image.cmd]
    if not args:
        raise InvalidArgument(
            "command: no command to run; neither the request (command, args) nor the image "
            "(Entrypoint, Cmd) names one"
        )
    return args


def container_env(
    cfg: api_pb2.ContainerConfig, image: ImageConfigView, *, hostname: str, home: str
) -> list[str]:
    """Image env first, then the request's; a key set twice keeps the later value in the
    earlier position. PATH, HOME and TERM get defaults only if nobody set them."""
    merged: dict[str, str] = {}
    if hostname:
        merged["HOSTNAME"] = hostname
    for entry in image.env:
        key, _, value = entry.partition("=")
        if key:
            merged[key] = value
    for index, pair in enumerate(cfg.envs):
        if not pair.key or "=" in pair.key:
            raise InvalidArgument(f"envs[{index}].key: {pair.key!r} is not a valid name")
        # Bytes since CRI 1.36; config.json is JSON, where runc would see U+FFFD for
        # bytes that are not UTF-8 anyway (as with containerd and CRI-O).
        merged[pair.key] = pair.value.decode("utf-8", "replace")
    merged.setdefault("PATH", DEFAULT_PATH)
    merged.setdefault("HOME", home or "/")
    if cfg.tty:
        merged.setdefault("TERM", "xterm")
    return [f"{key}={value}" for key, value in merged.items()]


def container_working_dir(cfg: api_pb2.ContainerConfig, image: ImageConfigView) -> str:
    cwd = cfg.working_dir or image.working_dir or "/"
    if not cwd.startswith("/"):
        field = "working_dir" if cfg.working_dir else "image WorkingDir"
        raise InvalidArgument(f"{field}: {cwd!r} must be an absolute path")
    return cwd


def cgroups_path(
    cgroup_parent: str, container_id: str, driver: CgroupDriver = CGROUPFS_DRIVER
) -> str:
    """`<parent>/cri-shim-<id>` for the cgroupfs driver, `<slice>:cri-shim:<id>` for
    systemd's (runtime/cgroup_driver.py)."""
    return driver.cgroups_path(cgroup_parent, container_id)


def container_namespaces(
    cfg: api_pb2.ContainerConfig, sandbox: SandboxContext, target_pid_ns_path: Path | None
) -> list[dict[str, str]]:
    """User (a pod with its own), network, IPC and UTS are the pod's (joined by their
    pinned paths) or the host's (left out). PID is the container's own unless the pod or
    request says otherwise."""
    namespaces: list[dict[str, str]] = [{"type": "mount"}]
    for kind, path in (
        ("user", sandbox.userns_path),
        ("network", sandbox.netns_path),
        ("ipc", sandbox.ipc_ns_path),
        ("uts", sandbox.uts_ns_path),
    ):
        if path is not None:
            namespaces.append({"type": kind, "path": str(path)})

    sc = cfg.linux.security_context
    if sc.HasField("namespace_options"):
        mode = sc.namespace_options.pid
    else:
        mode = api_pb2.CONTAINER
    if sandbox.host_pid or mode == api_pb2.NODE:
        return namespaces
    if mode == api_pb2.POD:
        if sandbox.pid_ns_path is None:
            raise InvalidArgument(
                "security_context.namespace_options.pid: POD requested, but the pod has no "
                "shared PID namespace"
            )
        namespaces.append({"type": "pid", "path": str(sandbox.pid_ns_path)})
    elif mode == api_pb2.TARGET:
        if target_pid_ns_path is None:
            raise InvalidArgument(
                "security_context.namespace_options.target_id: target container "
                f"{sc.namespace_options.target_id!r} has no PID namespace to join"
            )
        namespaces.append({"type": "pid", "path": str(target_pid_ns_path)})
    else:
        namespaces.append({"type": "pid"})
    return namespaces


def container_sysctls(sandbox: SandboxContext) -> dict[str, str]:
    """Only sysctls that the container's own namespaces isolate (pod_rules.py)."""
    return namespaced_sysctls(
        sandbox.sysctls,
        own_network=sandbox.netns_path is not None,
        own_ipc=sandbox.ipc_ns_path is not None,
        own_uts=sandbox.uts_ns_path is not None,
    )


def container_seccomp(
    sc: api_pb2.LinuxContainerSecurityContext, capabilities: Iterable[str]
) -> dict[str, Any] | None:
    if sc.privileged:
        return None
    if sc.HasField("seccomp"):
        kind = sc.seccomp.profile_type
        if kind == api_pb2.SecurityProfile.Unconfined:
            return None
        if kind == api_pb2.SecurityProfile.Localhost:
            return load_localhost_profile(sc.seccomp.localhost_ref, capabilities)
        return default_profile(capabilities)
    # The deprecated string field, still sent by older kubelets.
    legacy = sc.seccomp_profile_path
    if legacy in ("", "unconfined"):
        return None
    if legacy in ("runtime/default", "docker/default"):
        return default_profile(capabilities)
    if legacy.startswith("localhost/"):
        return load_localhost_profile(legacy.removeprefix("localhost"), capabilities)
    raise InvalidArgument(f"security_context.seccomp_profile_path: unknown profile {legacy!r}")


def container_devices(
    cfg: api_pb2.ContainerConfig, *, privileged: bool, host_dev: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Device nodes to create and the device-cgroup rules. runc adds the standard nodes
    (/dev/null, /dev/zero, ...) and their rules by itself."""
    devices: list[dict[str, Any]] = []
    rules: list[dict[str, Any]] = [{"allow": False, "access": "rwm"}]
    if privileged:
        rules = [{"allow": True, "access": "rwm"}]
        for node in _device_nodes(host_dev, skip={"pts", "shm", "mqueue"}):
            devices.append(_device_entry(node, "/dev" / node.relative_to(host_dev)))
    for index, request in enumerate(cfg.devices):
        field = f"devices[{index}]"
        access = request.permissions or "rwm"
        if not set(access) <= set("rwm"):
            raise InvalidArgument(f"{field}.permissions: {access!r} is not a subset of 'rwm'")
        host_path = Path(request.host_path)
        if not host_path.is_absolute() or not request.container_path.startswith("/"):
            raise InvalidArgument(f"{field}: host_path and container_path must be absolute")
        if not host_path.exists():
            raise InvalidArgument(f"{field}.host_path: {host_path} does not exist")
        nodes = [host_path] if not host_path.is_dir() else list(_device_nodes(host_path, set()))
        if not nodes or not _is_device(nodes[0]):
            raise InvalidArgument(f"{field}.host_path: {host_path} is not a device")
        for node in nodes:
            inside = PurePosixPath(request.container_path)
            if node != host_path:
                inside = inside / node.relative_to(host_path).as_posix()
            entry = _device_entry(node, inside)
            devices.append(entry)
            rules.append(
                {
                    "allow": True,
                    "type": entry["type"],
                    "major": entry["major"],
                    "minor": entry["minor"],
                    "access": access,
                }
            )
    # A device requested explicitly replaces the same path from the privileged set.
    unique: dict[str, dict[str, Any]] = {d["path"]: d for d in devices}
    return list(unique.values()), rules


def _is_device(path: Path) -> bool:
    mode = path.stat().st_mode
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


def _device_nodes(root: Path, skip: set[str]) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d not in skip]
        for filename in filenames:
            node = Path(dirpath, filename)
            try:
                if not node.is_symlink() and _is_device(node):
                    yield node
            except OSError:
                continue  # a node that vanished while walking


def _device_entry(node: Path, inside: PurePosixPath | Path) -> dict[str, Any]:
    info = node.stat()
    return {
        "path": str(inside),
        "type": "c" if stat.S_ISCHR(info.st_mode) else "b",
        "major": os.major(info.st_rdev),
        "minor": os.minor(info.st_rdev),
        "fileMode": stat.S_IMODE(info.st_mode),
        "uid": 0,
        "gid": 0,
    }


def container_mounts(
    cfg: api_pb2.ContainerConfig,
    sandbox: SandboxContext,
    *,
    privileged: bool,
    mountinfo: Callable[[], str] | None = None,
    image_mounts: Mapping[int, Path] | None = None,
) -> tuple[list[dict[str, Any]], str]:
    """The kernel filesystems every container needs, the pod's files, then the request's
    bind mounts. A request mount replaces a default one at the same destination (kubelet
    mounts its own /etc/hosts). Returns the mounts and the rootfs propagation they need.
    `image_mounts` maps the index of each image volume in `cfg.mounts` to the host
    directory that holds it (the image mounted read-only, its sub path resolved)."""
    readonly_rootfs = cfg.linux.security_context.readonly_rootfs
    defaults = _kernel_mounts(sandbox, privileged) + _pod_file_mounts(sandbox, readonly_rootfs)
    requested, propagation_needed = _requested_mounts(cfg, mountinfo, image_mounts or {})
    # Parents before children, so a mount inside another volume is not hidden by it.
    requested.sort(key=lambda m: len(PurePosixPath(m["destination"]).parts))
    taken = {m["destination"].rstrip("/") or "/" for m in requested}
    mounts = [m for m in defaults if m["destination"] not in taken] + requested
    rootfs_propagation = {"rshared": "rshared", "rslave": "rslave"}.get(propagation_needed, "")
    return mounts, rootfs_propagation


def _kernel_mounts(sandbox: SandboxContext, privileged: bool) -> list[dict[str, Any]]:
    """/proc, /dev and its pts, shm and mqueue, /sys and the cgroup tree."""
    sys_options = ["nosuid", "noexec", "nodev"] + ([] if privileged else ["ro"])
    return [
        {
            "destination": "/proc",
            "type": "proc",
            "source": "proc",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        },
        _shm_mount(sandbox.shm_path),
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": sys_options},
        {
            "destination": "/sys/fs/cgroup",
            "type": "cgroup",
            "source": "cgroup",
            "options": [*sys_options, "relatime"],
        },
    ]


def _pod_file_mounts(sandbox: SandboxContext, readonly_rootfs: bool) -> list[dict[str, Any]]:
    """The pod's resolv.conf, hostname and hosts files, those it has."""
    pod_files = (
        ("/etc/resolv.conf", sandbox.resolv_conf_path),
        ("/etc/hostname", sandbox.hostname_path),
        ("/etc/hosts", sandbox.hosts_path),
    )
    return [
        {
            "destination": destination,
            "type": "bind",
            "source": str(source),
            "options": ["rbind", "rprivate"] + (["ro"] if readonly_rootfs else []),
        }
        for destination, source in pod_files
        if source is not None
    ]


def _requested_mounts(
    cfg: api_pb2.ContainerConfig,
    mountinfo: Callable[[], str] | None,
    image_mounts: Mapping[int, Path],
) -> tuple[list[dict[str, Any]], str]:
    """The request's mounts, checked, and the strongest propagation they need of the root
    ("rshared" over "rslave"; "" for none)."""
    requested: list[dict[str, Any]] = []
    propagation_needed = ""
    for index, mount in enumerate(cfg.mounts):
        field = f"mounts[{index}]"
        if not mount.container_path.startswith("/"):
            raise InvalidArgument(
                f"{field}.container_path: {mount.container_path!r} must be an absolute path"
            )
        if mount.HasField("image") and mount.image.image:
            requested.append(_image_mount(field, mount, image_mounts.get(index)))
            continue
        bind, propagation = _bind_mount(field, mount, mountinfo)
        if propagation != "rprivate":
            # The container's root must pass events on too, or they stop there.
            if propagation == "rshared" or not propagation_needed:
                propagation_needed = propagation
        requested.append(bind)
    return requested, propagation_needed


def _bind_mount(
    field: str, mount: api_pb2.Mount, mountinfo: Callable[[], str] | None
) -> tuple[dict[str, Any], str]:
    """A request's host-path mount, checked, and its propagation."""
    if mount.recursive_read_only:
        _check_recursive_read_only(field, mount)
    if not mount.host_path.startswith("/"):
        raise InvalidArgument(f"{field}.host_path: {mount.host_path!r} must be an absolute path")
    if not os.path.exists(mount.host_path):
        raise InvalidArgument(f"{field}.host_path: {mount.host_path} does not exist")
    propagation = _PROPAGATION.get(mount.propagation)
    if propagation is None:
        raise InvalidArgument(f"{field}.propagation: unknown value {mount.propagation}")
    if propagation != "rprivate":
        _check_host_propagation(field, mount.host_path, propagation, mountinfo)
    options = ["rbind", propagation] + (["ro"] if mount.readonly else [])
    if mount.recursive_read_only:
        # runc applies it with mount_setattr(AT_RECURSIVE): sub-mounts become
        # read-only too, where "ro" alone leaves them writable.
        options.append("rro")
    bind = {
        "destination": mount.container_path,
        "type": "bind",
        "source": mount.host_path,
        "options": options,
    }
    return bind, propagation


def _check_recursive_read_only(field: str, mount: api_pb2.Mount) -> None:
    # The CRI's contract: kubelet sends readonly and private propagation with it; anything
    # else is a request that cannot mean what it says.
    if not mount.readonly:
        raise InvalidArgument(
            f"{field}.recursive_read_only: a recursive read-only mount must also be readonly"
        )
    if mount.propagation != api_pb2.PROPAGATION_PRIVATE:
        raise InvalidArgument(
            f"{field}.recursive_read_only: needs private propagation (got "
            f"{api_pb2.MountPropagation.Name(mount.propagation)}): a propagated mount could "
            "appear below it writable"
        )


def _image_mount(field: str, mount: api_pb2.Mount, source: Path | None) -> dict[str, Any]:
    """An image volume: the image's files, read-only (KEP 4639). Not noexec: Kubernetes
    lets a container run binaries from an image volume."""
    if source is None:
        raise InvalidArgument(f"{field}.image: image volumes are not supported here")
    if mount.host_path:
        raise InvalidArgument(f"{field}: host_path and image are mutually exclusive")
    if not mount.readonly:
        raise InvalidArgument(f"{field}.readonly: an image volume is always mounted read-only")
    options = ["rbind", "rprivate", "ro", "nosuid", "nodev"]
    if mount.recursive_read_only:
        _check_recursive_read_only(field, mount)
        options.append("rro")
    return {
        "destination": mount.container_path,
        "type": "bind",
        "source": str(source),
        "options": options,
    }


def _shm_mount(shm_path: Path | None) -> dict[str, Any]:
    if shm_path is not None:
        return {
            "destination": "/dev/shm",
            "type": "bind",
            "source": str(shm_path),
            "options": ["rbind", "rprivate", "nosuid", "noexec", "nodev"],
        }
    return {
        "destination": "/dev/shm",
        "type": "tmpfs",
        "source": "shm",
        "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
    }


def _check_host_propagation(
    field: str, host_path: str, wanted: str, mountinfo: Callable[[], str] | None
) -> None:
    """Bidirectional needs the host mount to be shared and host-to-container needs it
    shared or a slave; otherwise the setting silently does nothing, and a CSI driver
    that depends on it hangs later in a way nobody can diagnose."""
    text = (mountinfo or (lambda: Path("/proc/self/mountinfo").read_text()))()
    best: tuple[str, list[str]] | None = None
    real = os.path.realpath(host_path)
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) < 7:
            continue
        mount_point = fields[4].replace("\\040", " ")
        optional = fields[6 : fields.index("-")] if "-" in fields else []
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= len(best[0])):
            best = (mount_point, optional)
    if best is None:
        return
    mount_point, optional = best
    shared = any(tag.startswith("shared:") for tag in optional)
    slave = any(tag.startswith("master:") for tag in optional)
    if wanted == "rshared" and not shared:
        raise InvalidArgument(
            f"{field}.propagation: bidirectional needs {mount_point} (holding {host_path}) "
            "to be a shared mount on the host (mount --make-rshared)"
        )
    if wanted == "rslave" and not (shared or slave):
        raise InvalidArgument(
            f"{field}.propagation: host-to-container needs {mount_point} (holding "
            f"{host_path}) to be a shared or slave mount on the host"
        )


def resolve_stop_signal(cfg: api_pb2.ContainerConfig, image: ImageConfigView) -> int:
    """The signal StopContainer sends first: the request's, else the image's, else TERM."""
    if cfg.stop_signal != api_pb2.RUNTIME_DEFAULT:
        return signal_number(api_pb2.Signal.Name(cfg.stop_signal), "stop_signal")
    if not image.stop_signal.strip():
        return int(signal.SIGTERM)
    return signal_number(image.stop_signal, "image config StopSignal")


def signal_number(text: str, field: str) -> int:
    """ "15", "TERM", "SIGTERM", "SIGRTMIN+3" and CRI's "SIGRTMINPLUS3" all work."""
    name = text.strip().upper()
    if name.isdigit():
        if not 1 <= int(name) <= signal.SIGRTMAX:
            raise InvalidArgument(
                f"{field}: {text!r} is not a signal number (1 to {signal.SIGRTMAX})"
            )
        return int(name)
    if not name.startswith("SIG"):
        name = f"SIG{name}"
    name = name.replace("PLUS", "+").replace("MINUS", "-")
    for base in ("SIGRTMIN", "SIGRTMAX"):
        if name.startswith(base) and name != base:
            offset = name[len(base) :]
            if offset[:1] in "+-" and offset[1:].isdigit():
                number = int(getattr(signal, base)) + int(offset)
                if signal.SIGRTMIN <= number <= signal.SIGRTMAX:
                    return number
                raise InvalidArgument(f"{field}: {text!r} is outside SIGRTMIN..SIGRTMAX")
    if not hasattr(signal, name) or not isinstance(getattr(signal, name), signal.Signals):
        raise InvalidArgument(f"{field}: unknown signal {text!r}")
    return int(getattr(signal, name))
