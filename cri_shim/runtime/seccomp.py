"""Seccomp profiles: the runtime default, and Localhost profiles loaded from the node.

The default is a deny-list: everything is allowed except system calls that reach past the
container (kernel modules, kexec, keyrings, handle-based opens, clock and swap changes,
new mounts and namespaces) and io_uring. A call whose capability the container holds is
allowed again, so that adding CAP_SYS_ADMIN or CAP_SYS_PTRACE works as users expect (not
io_uring, which no capability makes safe). A deny-list cannot break a workload by missing
a new harmless system call, which an allow-list kept by hand here would.

New namespaces are refused on every path without CAP_SYS_ADMIN, as in Docker's and
containerd's default profiles: `unshare` and `setns` outright, `clone` when its flags ask
for a namespace (a user namespace needs no capability, so only seccomp stops it), and
`clone3`, whose flags sit in memory a filter cannot read, with ENOSYS so that the C
library falls back to `clone`.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cri_shim.errors import InvalidArgument
from cri_shim.host.files import read_small_file

EPERM = 1
ENOSYS = 38

# The CLONE_NEW* flags: mount, cgroup, UTS, IPC, user, PID and network namespaces.
_CLONE_NAMESPACE_FLAGS = (
    0x00020000,
    0x02000000,
    0x04000000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)

# Always refused: no capability makes these safe inside a container.
_ALWAYS_DENIED = (
    "add_key",
    "keyctl",
    "request_key",  # the keyring is not namespaced
    "uselib",
    "nfsservctl",
    "create_module",
    "get_kernel_syms",
    "query_module",
    "vm86",
    "vm86old",
    "_sysctl",
    "sysfs",
    "ustat",
    # io_uring's ring reaches a large, fast-moving part of the kernel beside the system
    # call table, and has been the way out of containers again and again; Docker and
    # containerd refuse it by default too.
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
)

# Refused unless the container holds the capability that the kernel checks anyway.
_DENIED_WITHOUT: dict[str, tuple[str, ...]] = {
    "CAP_SYS_ADMIN": (
        "mount",
        "umount",
        "umount2",
        "pivot_root",
        "unshare",
        "setns",
        "fsopen",
        "fsconfig",
        "fsmount",
        "fspick",
        "move_mount",
        "open_tree",
        "mount_setattr",
        "quotactl",
        "quotactl_fd",
        "lookup_dcookie",
        "swapon",
        "swapoff",
        "fanotify_init",
    ),
    "CAP_SYS_MODULE": ("init_module", "finit_module", "delete_module"),
    "CAP_SYS_BOOT": ("reboot", "kexec_load", "kexec_file_load"),
    "CAP_SYS_TIME": (
        "settimeofday",
        "stime",
        "clock_settime",
        "clock_settime64",
        "adjtimex",
        "clock_adjtime",
        "clock_adjtime64",
    ),
    "CAP_SYS_PTRACE": (
        "ptrace",
        "process_vm_readv",
        "process_vm_writev",
        "kcmp",
        "userfaultfd",
        "process_madvise",
    ),
    "CAP_SYS_PACCT": ("acct",),
    "CAP_SYS_RAWIO": ("iopl", "ioperm"),
    "CAP_DAC_READ_SEARCH": ("open_by_handle_at", "name_to_handle_at"),
    "CAP_SYSLOG": ("syslog",),
    "CAP_BPF": ("bpf",),
    "CAP_PERFMON": ("perf_event_open",),
}

_ARCHITECTURES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
    "ppc64le": ["SCMP_ARCH_PPC64LE"],
    "s390x": ["SCMP_ARCH_S390X", "SCMP_ARCH_S390"],
}


def default_profile(capabilities: Iterable[str], machine: str | None = None) -> dict[str, Any]:
    held = set(capabilities)
    denied = list(_ALWAYS_DENIED)
    for capability, calls in _DENIED_WITHOUT.items():
        # bpf and perf_event_open were CAP_SYS_ADMIN's before their own capabilities.
        if capability in held or (
            capability in ("CAP_BPF", "CAP_PERFMON") and "CAP_SYS_ADMIN" in held
        ):
            continue
        denied.extend(calls)
    machine = machine or platform.machine()
    rules: list[dict[str, Any]] = [
        {"names": sorted(denied), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
    ]
    if "CAP_SYS_ADMIN" not in held:
        rules.extend(_clone_rules(machine))
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": _ARCHITECTURES.get(machine, []),
        "syscalls": rules,
    }


def _clone_rules(machine: str) -> list[dict[str, Any]]:
    # s390x passes the stack first and the flags second.
    index = 1 if machine == "s390x" else 0
    # Conditions in one rule are all required, so each flag is a rule of its own.
    rules: list[dict[str, Any]] = [
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": EPERM,
            "args": [{"index": index, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        }
        for flag in _CLONE_NAMESPACE_FLAGS
    ]
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS})
    return rules


# Real profiles are tens of KiB; the path comes from a request, so it may name anything
# (a FIFO, /dev/zero): only a regular file of at most this size is read.
MAX_PROFILE_BYTES = 1 << 20


def load_localhost_profile(path: str, capabilities: Iterable[str]) -> dict[str, Any]:
    """Load a profile file as kubelet names it (an absolute path on the node). Docker's
    profile format is accepted as well as the OCI one: `archMap` is flattened and entries
    with `includes`/`excludes` on capabilities are kept only where they apply."""
    field = "security_context.seccomp.localhost_ref"
    if not path or not Path(path).is_absolute():
        raise InvalidArgument(f"{field}: the profile path must be absolute, got {path!r}")
    try:
        raw = json.loads(read_small_file(path, MAX_PROFILE_BYTES))
    except FileNotFoundError:
        raise InvalidArgument(f"{field}: seccomp profile {path} does not exist") from None
    except (OSError, ValueError) as err:
        raise InvalidArgument(f"{field}: cannot load seccomp profile {path}: {err}") from None
    except RecursionError:
        raise InvalidArgument(f"{field}: seccomp profile {path} is nested too deep") from None
    if not isinstance(raw, dict) or "defaultAction" not in raw:
        raise InvalidArgument(f"{field}: {path} is not a seccomp profile (no defaultAction)")
    try:
        return _converted(raw, set(capabilities))
    except (KeyError, TypeError, AttributeError) as err:
        # The file is the node's, not ours: a malformed entry is the request's problem.
        raise InvalidArgument(
            f"{field}: {path} is not a seccomp profile runc takes: {type(err).__name__}: {err}"
        ) from None


def _converted(raw: dict[str, Any], held: set[str]) -> dict[str, Any]:
    """A profile in Docker's or the OCI format as the OCI spec takes it."""
    profile: dict[str, Any] = {"defaultAction": raw["defaultAction"]}
    for key in ("defaultErrnoRet", "flags", "listenerPath", "listenerMetadata"):
        if key in raw:
            profile[key] = raw[key]
    architectures = list(raw.get("architectures") or [])
    for entry in raw.get("archMap") or []:
        architectures.append(entry["architecture"])
        architectures.extend(entry.get("subArchitectures") or [])
    if architectures:
        profile["architectures"] = list(dict.fromkeys(architectures))

    syscalls = []
    for entry in raw.get("syscalls") or []:
        includes = set((entry.get("includes") or {}).get("caps") or [])
        excludes = set((entry.get("excludes") or {}).get("caps") or [])
        if not includes <= held or excludes & held:
            continue
        names = entry.get("names") or ([entry["name"]] if "name" in entry else [])
        rule: dict[str, Any] = {"names": names, "action": entry["action"]}
        for key in ("errnoRet", "args"):
            if entry.get(key) is not None:
                rule[key] = entry[key]
        syscalls.append(rule)
    if syscalls:
        profile["syscalls"] = syscalls
    return profile
