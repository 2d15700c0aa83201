"""What each runtime handler can really do, for `Status.runtime_handlers` and for refusing a
request that a handler would silently get wrong.

An OCI runtime says what it supports through `<runtime> features` (runc >= 1.1; crun
1.8 has no such command, and is then assumed to support nothing optional). A handler's
kind (runtime/kinds/) gives the features of runtimes that have no such command (gVisor,
Kata). kubelet trusts what Status advertises: a handler that advertises recursive
read-only mounts and then mounts a volume writable underneath breaks a security promise,
so a feature is advertised only when the runtime lists it and the kernel can do it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.host.idmap import UserNamespaceMappings
from cri_shim.runtime.userns import IDMAP_KERNEL

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 10.0
# mount_setattr(2), which runc's "rro" uses, arrived in Linux 5.12.
_MOUNT_SETATTR_KERNEL = (5, 12)


@dataclass(frozen=True)
class HandlerFeatures:
    recursive_read_only_mounts: bool = False
    # The runtime joins a user namespace by path; the daemon idmaps the mounts itself
    # (see runtime/userns.py), which needs the kernel's idmapped mounts for tmpfs too.
    user_namespaces: bool = False
    # The pod may share the host's PID, IPC or network namespace (false for a runtime
    # with its own kernel: the host's would not be what the pod sees).
    host_namespaces: bool = True
    # A privileged container gets the host's devices and every capability.
    privileged: bool = True
    # What runs the pod, for messages: "runtime", "gVisor kernel", "Kata VM".
    engine: str = "runtime"


def kernel_version(release: str | None = None) -> tuple[int, int]:
    """(major, minor) of a release string such as "6.18.44-fc" or "5.12rc1"."""
    match = re.match(r"(\d+)\.(\d+)", release or os.uname().release)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def features_from_json(text: str, kernel: tuple[int, int]) -> HandlerFeatures:
    """Read `runtime features` output (the OCI runtime-spec features document)."""
    try:
        document = json.loads(text)
    except ValueError:
        return HandlerFeatures()
    if not isinstance(document, dict):
        return HandlerFeatures()
    options = document.get("mountOptions") or []
    linux = document.get("linux") or {}
    namespaces = (linux.get("namespaces") or []) if isinstance(linux, dict) else []
    return HandlerFeatures(
        recursive_read_only_mounts="rro" in options and kernel >= _MOUNT_SETATTR_KERNEL,
        user_namespaces="user" in namespaces and kernel >= IDMAP_KERNEL,
    )


def ask_runtime(runtime_path: Path, argument: str) -> subprocess.CompletedProcess[str]:
    """`<runtime> <argument>`, within the probe's budget."""
    return subprocess.run(
        [str(runtime_path), argument],
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT,
        check=False,
    )


@functools.cache
def probe_features(runtime_path: Path) -> HandlerFeatures:
    """`<runtime> features`, asked once per runtime binary (a few milliseconds)."""
    try:
        result = ask_runtime(runtime_path, "features")
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("%s features: %s; assuming no optional features", runtime_path, err)
        return HandlerFeatures()
    if result.returncode != 0:
        log.info("%s has no `features` command; assuming no optional features", runtime_path)
        return HandlerFeatures()
    features = features_from_json(result.stdout, kernel_version())
    if features.user_namespaces and not user_namespaces_allowed():
        log.info("user namespaces are disabled on this host (user.max_user_namespaces is 0)")
        features = dataclasses.replace(features, user_namespaces=False)
    log.info("runtime %s: %s", runtime_path, features)
    return features


def user_namespaces_allowed(limit_file: Path = Path("/proc/sys/user/max_user_namespaces")) -> bool:
    """False where the administrator turned user namespaces off (the sysctl is 0)."""
    try:
        return int(limit_file.read_text()) > 0
    except (OSError, ValueError):
        return False


def require_pod_features(
    userns: UserNamespaceMappings | None,
    handler: str,
    features: HandlerFeatures,
    config: api_pb2.PodSandboxConfig | None = None,
) -> None:
    """Refuse a pod whose namespaces its handler cannot give it, rather than run it in
    the host's user namespace while it believes itself isolated, or in a sandbox's own
    PID namespace while it asked for the host's. `userns` is the pod's user namespace
    (pod_mappings), None for the host's."""
    if userns is not None and not features.user_namespaces:
        raise InvalidArgument(
            "linux.security_context.namespace_options.userns_options: user namespaces are "
            f"not supported by runtime handler {handler!r} (Status advertises "
            "user_namespaces: false)"
        )
    if config is None:
        return
    security = config.linux.security_context
    if not features.host_namespaces:
        options = security.namespace_options
        for field in ("network", "pid", "ipc"):
            if getattr(options, field) == api_pb2.NODE:
                raise InvalidArgument(
                    f"linux.security_context.namespace_options.{field}: NODE (the host's "
                    f"namespace) is not supported by runtime handler {handler!r}, whose "
                    f"{features.engine} runs the pod in namespaces of its own"
                )
    if security.privileged and not features.privileged:
        raise InvalidArgument(
            "linux.security_context.privileged: privileged pods are not supported by runtime "
            f"handler {handler!r} ({features.engine} gives no host devices or "
            "capabilities)"
        )


def require_features(
    config: api_pb2.ContainerConfig, handler: str, features: HandlerFeatures
) -> None:
    """Refuse what the pod's runtime handler cannot do, naming the field and the handler,
    before anything is created."""
    if config.linux.security_context.privileged and not features.privileged:
        raise InvalidArgument(
            "linux.security_context.privileged: privileged containers are not supported by "
            f"runtime handler {handler!r} ({features.engine} gives no host devices "
            "or capabilities)"
        )
    for index, mount in enumerate(config.mounts):
        if mount.recursive_read_only and not features.recursive_read_only_mounts:
            raise InvalidArgument(
                f"mounts[{index}].recursive_read_only: runtime handler {handler!r} does not "
                "support recursive read-only mounts (see Status.runtime_handlers)"
            )
