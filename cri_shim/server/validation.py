"""Request validation at the gRPC edge: every call is checked here before any
handler runs, so that a hostile or broken request is refused with INVALID_ARGUMENT naming
the field, and nothing is reserved, created or written for it.

Two layers:
- For every RPC, a walk over the whole message: no NUL byte in any string (paths, argv,
  environment and resolv.conf cannot hold one, and Python refuses them deep inside a
  creation otherwise), no string beyond a size any real caller needs, no enum value the
  API does not define (a number from a newer or hostile client).
- Per RPC, the fields whose meaning the host depends on: paths that must stay where they
  belong (log directory and log path, mounts, working directory, cgroup parent), names the
  kernel or a file format takes literally (hostname, DNS, sysctls), and sizes (labels,
  annotations). This module is pure: the rules that depend on the host or on live
  objects are the operation's that enforces them (sysctls a pod's namespaces isolate:
  pod_rules.py; resources within the kernel's ranges and the CPUs online:
  lifecycle/resource_rules.py; a mount's host path: lifecycle/container_rules.py; a
  sandbox's log directory: lifecycle/container_create.py).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import PurePosixPath
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument

# Kubernetes' own limit on the total size of an object's annotations: they go into the
# state database and the OCI spec of every container. Labels have no such limit.
MAX_MAP_BYTES = 256 * 1024
MAX_KEY_LENGTH = 253 + 1 + 63  # DNS prefix, "/", name
# The longest string any field may hold (an annotation value can use the whole budget).
MAX_STRING = MAX_MAP_BYTES
MAX_ARG = 128 * 1024  # the kernel's MAX_ARG_STRLEN: execve refuses a longer argument
MAX_PATH = 4096  # PATH_MAX
MAX_NAME = 253  # metadata names, namespaces, UIDs: DNS subdomains at most
MAX_ID = 128  # object IDs are 64 hex digits; prefixes are shorter
MAX_IMAGE_REF = 4096
MAX_HOSTNAME = 64  # HOST_NAME_MAX: sethostname refuses more bytes
# Nameservers and search domains: above kubelet's own limits (3 and 32); it sends no more.
MAX_DNS_ENTRIES = 64
# kubelet's limit on the whole search line (MaxDNSSearchListChars): no one domain is longer.
MAX_DNS_SEARCH_CHARS = 2048
MAX_ID_VALUE = 2**32 - 2  # the largest uid/gid; 2**32-1 is "no id"

# A hostname is one word on a line of /etc/hosts and /etc/hostname: no space, no control
# character. Anything else the kernel takes, so does the daemon: kubelet sends an FQDN whose
# cluster domain is its own configuration, and with an empty one ends it with a dot.
_NOT_IN_A_HOSTNAME = re.compile(r"[\s\x00-\x1f\x7f]")
# resolv.conf's search and options lines are words: one may hold anything but a space or a
# control character (the resolver reads the host's search domains, which kubelet passes on,
# and the pod's options, which Kubernetes leaves free, the same way).
_RESOLV_CONF_WORD = re.compile(r"^[^\s\x00-\x1f\x7f]+$")
# Kubernetes' sysctl name format (its SysctlContainSlashFmt), "/" or "." as the separator.
_SYSCTL_SEGMENT = r"[a-z0-9]([-_a-z0-9]*[a-z0-9])?"
_SYSCTL = re.compile(rf"^({_SYSCTL_SEGMENT}[./])*{_SYSCTL_SEGMENT}$")

Validator = Callable[[Any], None]
_VALIDATORS: dict[str, Validator] = {}
# Checks made before the walk over every message, each O(1) per field it looks at: what
# they refuse could be millions of sub-messages the walk would spend seconds on.
_BEFORE_THE_WALK: dict[str, Validator] = {}


def validate_request(rpc: str, request: Message) -> None:
    """Raise InvalidArgument, naming the field, for a request `rpc` must not act on."""
    first = _BEFORE_THE_WALK.get(rpc)
    if first is not None:
        first(request)
    check_message(request, type(request).__name__)
    validator = _VALIDATORS.get(rpc)
    if validator is not None:
        validator(request)


def _validates(
    *rpcs: str, table: dict[str, Validator] = _VALIDATORS
) -> Callable[[Validator], Validator]:
    def register(function: Validator) -> Validator:
        for rpc in rpcs:
            table[rpc] = function
        return function

    return register


# --- the walk over every message ------------------------------------------------------------
def check_message(message: Message, path: str) -> None:
    """NUL bytes, oversized strings and unknown enum values anywhere in `message`."""
    for field, value in message.ListFields():
        name = f"{path}.{field.name}"
        # A map's container, rather than its entry's options: reading options imports
        # protobuf's descriptor_pb2 (0.3 MiB resident) for this one flag.
        entry = field.message_type
        if entry is not None and isinstance(value, Mapping):
            key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
            for key, item in value.items():
                _check_scalar(key_field, key, f"{name} key {_short(key)}")
                _check_value(value_field, item, f"{name}[{_short(key)}]")
        elif _repeated(field):
            for index, item in enumerate(value):
                _check_value(field, item, f"{name}[{index}]")
        else:
            _check_value(field, value, name)


def _repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _check_value(field: FieldDescriptor, value: Any, path: str) -> None:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        check_message(value, path)
    else:
        _check_scalar(field, value, path)


def _check_scalar(field: FieldDescriptor, value: Any, path: str) -> None:
    if field.type == FieldDescriptor.TYPE_STRING:
        if "\x00" in value:
            raise InvalidArgument(f"{path}: contains a NUL byte")
        if len(value) > MAX_STRING:
            raise InvalidArgument(f"{path}: longer than {MAX_STRING} characters")
    elif field.type == FieldDescriptor.TYPE_ENUM:
        enum = field.enum_type
        assert enum is not None  # an enum field always has its enum
        if enum.values_by_number.get(value) is None:
            raise InvalidArgument(f"{path}: {value} is not a {enum.name} value")


def _short(text: str) -> str:
    return repr(text if len(text) <= 64 else text[:64] + "...")


# --- building blocks -------------------------------------------------------------------------
def _max_length(value: str, limit: int, field: str) -> None:
    if len(value) > limit:
        raise InvalidArgument(f"{field}: longer than {limit} characters")


def _has_dotdot(path: str) -> bool:
    return ".." in PurePosixPath(path).parts


def _absolute_path(
    value: str, field: str, *, allow_empty: bool = True, allow_dotdot: bool = False
) -> None:
    if not value:
        if allow_empty:
            return
        raise InvalidArgument(f"{field}: must not be empty")
    _max_length(value, MAX_PATH, field)
    if not value.startswith("/"):
        raise InvalidArgument(f"{field}: {_short(value)} must be an absolute path")
    if not allow_dotdot and _has_dotdot(value):
        raise InvalidArgument(f"{field}: {_short(value)} must not contain '..'")


def _id(value: str, field: str) -> None:
    _max_length(value, MAX_ID, field)


def _string_map(items: Mapping[str, str], field: str, *, total_limit: bool = True) -> None:
    total = 0
    for key, value in items.items():
        if not key:
            raise InvalidArgument(f"{field}: a key is empty")
        if len(key) > MAX_KEY_LENGTH:
            raise InvalidArgument(f"{field}: key {_short(key)} is longer than {MAX_KEY_LENGTH}")
        total += len(key.encode()) + len(value.encode())
    if total_limit and total > MAX_MAP_BYTES:
        raise InvalidArgument(
            f"{field}: {total} bytes of keys and values, more than the {MAX_MAP_BYTES} allowed"
        )


def _hostname(value: str, field: str) -> None:
    size = len(value.encode())
    if size > MAX_HOSTNAME:
        raise InvalidArgument(
            f"{field}: {_short(value)} is {size} bytes; the kernel takes at most "
            f"{MAX_HOSTNAME} (HOST_NAME_MAX)"
        )
    if _NOT_IN_A_HOSTNAME.search(value):
        raise InvalidArgument(
            f"{field}: {_short(value)} is not a valid hostname: it holds a space or a "
            "control character"
        )


def _argv(values: Iterable[str], field: str) -> None:
    for index, value in enumerate(values):
        if len(value.encode()) > MAX_ARG:
            raise InvalidArgument(f"{field}[{index}]: longer than {MAX_ARG} bytes")


def _ids(values: Iterable[int], field: str) -> None:
    for value in values:
        if not 0 <= value <= MAX_ID_VALUE:
            raise InvalidArgument(f"{field}: {value} is not a valid uid or gid")


# --- sandboxes -----------------------------------------------------------------------------
@_validates("RunPodSandbox")
def _run_pod_sandbox(request: api_pb2.RunPodSandboxRequest) -> None:
    _max_length(request.runtime_handler, MAX_NAME, "RunPodSandboxRequest.runtime_handler")
    check_pod_sandbox_config(request.config)


def check_pod_sandbox_config(config: api_pb2.PodSandboxConfig) -> None:
    where = "PodSandboxConfig"
    for name in ("name", "namespace", "uid"):
        _max_length(getattr(config.metadata, name), MAX_NAME, f"{where}.metadata.{name}")
    if config.hostname:
        _hostname(config.hostname, f"{where}.hostname")
    _absolute_path(config.log_directory, f"{where}.log_directory")
    _dns(config.dns_config, f"{where}.dns_config")
    for index, mapping in enumerate(config.port_mappings):
        field = f"{where}.port_mappings[{index}]"
        for name in ("container_port", "host_port"):
            value = getattr(mapping, name)
            if not 0 <= value <= 65535:
                raise InvalidArgument(f"{field}.{name}: {value} is not a port number")
        if mapping.host_ip:
            _ip(mapping.host_ip, f"{field}.host_ip")
    # Kubernetes bounds each label (a 317-byte key, a 63-byte value) but not their number:
    # only the message's limit bounds their sum (kubelet sends at most 16 MiB).
    _string_map(config.labels, f"{where}.labels", total_limit=False)
    _string_map(config.annotations, f"{where}.annotations")
    linux = config.linux
    if linux.cgroup_parent:
        _max_length(linux.cgroup_parent, MAX_PATH, f"{where}.linux.cgroup_parent")
        if _has_dotdot(linux.cgroup_parent):
            raise InvalidArgument(f"{where}.linux.cgroup_parent: must not contain '..'")
    sc = linux.security_context
    if sc.HasField("run_as_user"):
        _ids([sc.run_as_user.value], f"{where}.linux.security_context.run_as_user")
    if sc.HasField("run_as_group"):
        _ids([sc.run_as_group.value], f"{where}.linux.security_context.run_as_group")
    _ids(sc.supplemental_groups, f"{where}.linux.security_context.supplemental_groups")
    _sysctls(config, f"{where}.linux.sysctls")


def _ip(value: str, field: str) -> None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise InvalidArgument(f"{field}: {_short(value)} is not an IP address") from None


def _dns(dns: api_pb2.DNSConfig, field: str) -> None:
    """resolv.conf is written from these verbatim: a newline or space would add lines or
    words of the caller's choosing to every container's resolver configuration."""
    for name in ("servers", "searches"):
        if len(getattr(dns, name)) > MAX_DNS_ENTRIES:
            raise InvalidArgument(f"{field}.{name}: more than {MAX_DNS_ENTRIES} entries")
    for index, server in enumerate(dns.servers):
        _ip(server, f"{field}.servers[{index}]")
    for index, domain in enumerate(dns.searches):
        if len(domain) > MAX_DNS_SEARCH_CHARS:
            raise InvalidArgument(
                f"{field}.searches[{index}]: longer than {MAX_DNS_SEARCH_CHARS} characters"
            )
        if not _RESOLV_CONF_WORD.match(domain):
            raise InvalidArgument(
                f"{field}.searches[{index}]: {_short(domain)} is not a domain name: it is "
                "empty or holds a space or a control character"
            )
    for index, option in enumerate(dns.options):
        if not _RESOLV_CONF_WORD.match(option):
            raise InvalidArgument(
                f"{field}.options[{index}]: {_short(option)} is not a resolver option "
                "(such as ndots:5): it is empty or holds a space or a control character"
            )


def _sysctls(config: api_pb2.PodSandboxConfig, field: str) -> None:
    """Names a sysctl file has; which of them the pod's namespaces isolate is
    pod_rules.check_pod_sysctls', at the sandbox's creation. A value is written to its
    file as it is, whatever its size, and the kernel parses it, a newline being a space
    like any other (kernel.sem takes "250\n32000\n32\n128"): nothing to check here."""
    for name in config.linux.sysctls:
        if len(name) > MAX_NAME or not _SYSCTL.match(name):
            raise InvalidArgument(f"{field}[{_short(name)}]: not a sysctl name")
        # With both separators, one of them is part of a component (an interface such as
        # eth0.100): runc 1.1 writes every '.' of a name as a '/', so it would open the
        # wrong file at the pod's first container, after the pod was made.
        if "." in name and "/" in name:
            raise InvalidArgument(
                f"{field}[{_short(name)}]: a '.' inside a name's component (an interface "
                "name such as eth0.100) cannot be set: runc writes every '.' as a '/'"
            )


@_validates(
    "StopPodSandbox",
    "RemovePodSandbox",
    "PodSandboxStatus",
    "PodSandboxStats",
)
def _sandbox_id(request: Any) -> None:
    _id(request.pod_sandbox_id, f"{type(request).__name__}.pod_sandbox_id")


@_validates("UpdatePodSandboxResources")
def _update_pod_resources(request: api_pb2.UpdatePodSandboxResourcesRequest) -> None:
    _sandbox_id(request)


@_validates("PortForward")
def _port_forward(request: api_pb2.PortForwardRequest) -> None:
    _sandbox_id(request)
    for index, port in enumerate(request.port):
        if not 1 <= port <= 65535:
            raise InvalidArgument(f"PortForwardRequest.port[{index}]: {port} is not a port")


# --- containers ------------------------------------------------------------------------------
@_validates("CreateContainer")
def _create_container(request: api_pb2.CreateContainerRequest) -> None:
    _id(request.pod_sandbox_id, "CreateContainerRequest.pod_sandbox_id")
    check_container_config(request.config)


@_validates("CreateContainer", table=_BEFORE_THE_WALK)
def _unapplied_mount_fields(request: api_pb2.CreateContainerRequest) -> None:
    """A mount's own ID mappings are refused, not ignored: nothing applies them. A pod
    with a user namespace of its own has every mount idmapped through that namespace's
    mappings (runtime/mount_sources.py), which is what kubelet asks for; it sends none
    per mount. Counted, never walked: 1.3 million of them took 3 s of the daemon."""
    for index, mount in enumerate(request.config.mounts):
        for name in ("uidMappings", "gidMappings"):
            count = len(getattr(mount, name))
            if count:
                raise InvalidArgument(
                    f"ContainerConfig.mounts[{index}].{name}: {count} ID mappings; per-mount "
                    "ID mappings are not supported (a pod with a user namespace of its own "
                    "has its mounts idmapped through it: "
                    "linux.security_context.namespace_options.userns_options)"
                )


def check_container_config(config: api_pb2.ContainerConfig) -> None:
    where = "ContainerConfig"
    _max_length(config.metadata.name, MAX_NAME, f"{where}.metadata.name")
    _max_length(config.image.image, MAX_IMAGE_REF, f"{where}.image.image")
    _argv(config.command, f"{where}.command")
    _argv(config.args, f"{where}.args")
    # runc resolves the working directory inside the root filesystem, '..' and symlinks
    # in the image included (none leads out of it), and refuses a relative one.
    _absolute_path(config.working_dir, f"{where}.working_dir", allow_dotdot=True)
    for index, pair in enumerate(config.envs):
        field = f"{where}.envs[{index}]"
        if not pair.key or "=" in pair.key:
            raise InvalidArgument(f"{field}.key: {_short(pair.key)} is not a valid name")
        if b"\x00" in pair.value:  # bytes, which the generic string check does not see
            raise InvalidArgument(f"{field}.value: contains a NUL byte")
        if len(pair.key.encode()) + len(pair.value) + 1 > MAX_ARG:
            raise InvalidArgument(f"{field}: longer than {MAX_ARG} bytes")
    for index, mount in enumerate(config.mounts):
        _mount(mount, f"{where}.mounts[{index}]")
    for index, device in enumerate(config.devices):
        field = f"{where}.devices[{index}]"
        _absolute_path(device.host_path, f"{field}.host_path", allow_empty=False)
        # A directory is walked for the device nodes in it: "/" would walk the whole host.
        if not device.host_path.startswith("/dev/"):
            raise InvalidArgument(f"{field}.host_path: {_short(device.host_path)} is not in /dev")
        _absolute_path(device.container_path, f"{field}.container_path", allow_empty=False)
        if not set(device.permissions) <= set("rwm"):
            raise InvalidArgument(f"{field}.permissions: {_short(device.permissions)} is not rwm")
    _string_map(config.labels, f"{where}.labels", total_limit=False)
    _string_map(config.annotations, f"{where}.annotations")
    _log_path(config.log_path, f"{where}.log_path")
    sc = config.linux.security_context
    prefix = f"{where}.linux.security_context"
    if sc.HasField("run_as_user"):
        _ids([sc.run_as_user.value], f"{prefix}.run_as_user")
    if sc.HasField("run_as_group"):
        _ids([sc.run_as_group.value], f"{prefix}.run_as_group")
        # A group alone would pair with whatever user the image names, which is not what
        # was asked for; containerd and CRI-O refuse it too.
        if not sc.HasField("run_as_user") and not sc.run_as_username:
            raise InvalidArgument(
                f"{prefix}.run_as_group is set without run_as_user or run_as_username: "
                "name the user the group goes with"
            )
    _ids(sc.supplemental_groups, f"{prefix}.supplemental_groups")
    _max_length(sc.run_as_username, MAX_NAME, f"{prefix}.run_as_username")
    for name in ("masked_paths", "readonly_paths"):
        for index, path in enumerate(getattr(sc, name)):
            _absolute_path(path, f"{prefix}.{name}[{index}]", allow_empty=False)
    _resource_fields(config.linux.resources, f"{where}.linux.resources")


def _mount(mount: api_pb2.Mount, field: str) -> None:
    _absolute_path(mount.container_path, f"{field}.container_path", allow_empty=False)
    if mount.HasField("image") and mount.image.image:
        return  # an image volume: checked by lifecycle/image_volumes.py
    # Whether it exists is lifecycle/container_rules.py's check.
    _absolute_path(mount.host_path, f"{field}.host_path", allow_empty=False)


def _log_path(value: str, field: str) -> None:
    """Relative to the sandbox's log directory and naming a file there. Symlinks in that
    directory are resolved by the container service, which knows the directory."""
    if not value:
        return
    _max_length(value, MAX_PATH, field)
    if value.startswith("/"):
        raise InvalidArgument(
            f"{field}: {_short(value)} must be relative to the sandbox's log_directory"
        )
    parts = [p for p in PurePosixPath(value).parts if p != "."]
    if ".." in parts:
        raise InvalidArgument(f"{field}: {_short(value)} must not contain '..'")
    if not parts or value.endswith("/"):
        raise InvalidArgument(f"{field}: {_short(value)} does not name a file")


def _resource_fields(resources: api_pb2.LinuxContainerResources, field: str) -> None:
    for name in ("cpu_period", "cpu_shares", "memory_limit_in_bytes"):
        if getattr(resources, name) < 0:
            raise InvalidArgument(f"{field}.{name}: must not be negative")
    for name in ("cpu_quota", "memory_swap_limit_in_bytes"):
        if getattr(resources, name) < -1:  # -1: unlimited
            raise InvalidArgument(f"{field}.{name}: must be -1 (unlimited) or more")
    # Their ranges and the CPUs online: lifecycle/resource_rules.py.
    for key, value in resources.unified.items():
        # Written as a file of the container's cgroup: a name, never a path.
        if not key or "/" in key or key.startswith(".") or len(key) > MAX_NAME:
            raise InvalidArgument(f"{field}.unified: {_short(key)} is not a cgroup file name")
        if "\n" in value or len(value) > MAX_PATH:
            raise InvalidArgument(f"{field}.unified[{_short(key)}]: not a cgroup value")


@_validates(
    "StartContainer",
    "StopContainer",
    "RemoveContainer",
    "ContainerStatus",
    "ContainerStats",
    "ReopenContainerLog",
    "Attach",
    "CheckpointContainer",
)
def _container_id(request: Any) -> None:
    _id(request.container_id, f"{type(request).__name__}.container_id")


@_validates("UpdateContainerResources")
def _update_resources(request: api_pb2.UpdateContainerResourcesRequest) -> None:
    _container_id(request)
    _resource_fields(request.linux, "UpdateContainerResourcesRequest.linux")
    _string_map(request.annotations, "UpdateContainerResourcesRequest.annotations")


@_validates("ExecSync")
def _exec_sync(request: api_pb2.ExecSyncRequest) -> None:
    _container_id(request)
    _argv(request.cmd, "ExecSyncRequest.cmd")
    if request.cmd and not request.cmd[0]:
        raise InvalidArgument("ExecSyncRequest.cmd[0]: the command to run is empty")
    if request.timeout < 0:
        raise InvalidArgument(f"ExecSyncRequest.timeout: {request.timeout} is negative")


@_validates("Exec")
def _exec(request: api_pb2.ExecRequest) -> None:
    _container_id(request)
    _argv(request.cmd, "ExecRequest.cmd")
    if request.cmd and not request.cmd[0]:
        raise InvalidArgument("ExecRequest.cmd[0]: the command to run is empty")


# --- images ------------------------------------------------------------------------------------
@_validates("PullImage", "ImageStatus", "RemoveImage")
def _image(request: Any) -> None:
    _max_length(request.image.image, MAX_IMAGE_REF, f"{type(request).__name__}.image.image")
