"""AppArmor: what process.apparmorProfile a container gets, and the runtime's own profile.

Where the host has AppArmor, RuntimeDefault (and a container that asks for nothing)
runs under `cri-shim-default`, the runtime's profile below, as containerd and CRI-O
confine theirs: loaded with `apparmor_parser` the first time a container needs it (and
again if someone unloaded it, or put it in complain mode, where it would deny nothing),
never overwritten when loaded already and enforcing. A container that
cannot get its profile is refused, never run unconfined in silence. Privileged
containers and `Unconfined` run unconfined; a Localhost profile must be loaded already.
Where the host has no AppArmor, only a named profile is an error (Status says so).
"""

from __future__ import annotations

import logging
import subprocess
import threading
from pathlib import Path

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

ENABLED_FILE = Path("/sys/module/apparmor/parameters/enabled")
PROFILES_FILE = Path("/sys/kernel/security/apparmor/profiles")
PARSER = "apparmor_parser"
DEFAULT_PROFILE = "cri-shim-default"
PARSER_TIMEOUT = 60.0

PROFILE_TEMPLATE = """\
abi <abi/3.0>,
#include <tunables/global>

# cri-shim's RuntimeDefault: what a containerized process normally does, less what
# reaches past its container (mounting, the kernel's own knobs in /proc and /sys, raw
# memory, firmware and security interfaces).
profile {name} flags=(attach_disconnected,mediate_deleted) {{
  #include <abstractions/base>

  network,
  capability,
  file,
  umount,

  # Signals and tracing: between the container's own processes, and from the runtime.
  signal (receive) peer=unconfined,
  signal (send,receive) peer={name},
  ptrace (trace,read,tracedby,readby) peer={name},

  deny mount,

  # /proc: a process's own directories stay writable; the kernel's files do not: none
  # directly in /proc, none in a directory that is not a process's (/proc/NUMBER) or
  # /proc/sys (docker-default's pattern, which misses three-letter names ending in s
  # such as bus; the list after it names the directories known to matter).
  deny @{{PROC}}/* w,
  deny @{{PROC}}/{{[^1-9/],[^1-9/][^0-9/]}}/** w,
  deny @{{PROC}}/{{[^1-9s/][^0-9y/][^0-9s/],[^1-9/][^0-9/][^0-9/][^0-9/]*}}/** w,
  deny @{{PROC}}/{{acpi,bus,driver,fs,irq,pressure,scsi,sysvipc,tty}}/** w,
  deny @{{PROC}}/sysrq-trigger rwklx,
  deny @{{PROC}}/kcore rwklx,
  deny @{{PROC}}/kmem rwklx,
  deny @{{PROC}}/mem rwklx,
  # sysctls: only the namespaced ones under net/ and kernel/shm* may be written.
  deny @{{PROC}}/sys/[^kn]** w,
  deny @{{PROC}}/sys/n[^e]** w,
  deny @{{PROC}}/sys/k[^e]** w,
  deny @{{PROC}}/sys/kernel/[^s]** w,
  deny @{{PROC}}/sys/kernel/s[^h]** w,
  deny @{{PROC}}/sys/kernel/sh[^m]** w,

  # /sys: read-only, but for the container's cgroup.
  deny /sys/[^f]*/** wklx,
  deny /sys/f[^s]*/** wklx,
  deny /sys/fs/[^c]*/** wklx,
  deny /sys/fs/c[^g]*/** wklx,
  deny /sys/fs/cg[^r]*/** wklx,
  deny /sys/firmware/** rwklx,
  # The energy counters: reading them closely enough tells what another process computes.
  deny /sys/devices/virtual/powercap/** rwklx,
  deny /sys/kernel/security/** rwklx,
  deny /sys/kernel/debug/** rwklx,
}}
"""


def default_profile_text(name: str = DEFAULT_PROFILE) -> str:
    return PROFILE_TEMPLATE.format(name=name)


def enabled(enabled_file: Path = ENABLED_FILE) -> bool:
    try:
        return enabled_file.read_text().strip() == "Y"
    except OSError:
        return False


def loaded_profiles(profiles_file: Path = PROFILES_FILE) -> dict[str, str]:
    """The profiles the kernel has, name to mode (from lines such as `name (enforce)`)."""
    try:
        lines = profiles_file.read_text().splitlines()
    except OSError:
        return {}
    loaded = {}
    for line in lines:
        name, _, mode = line.rpartition(" (")
        if name:
            loaded[name] = mode.removesuffix(")")
    return loaded


class AppArmor:
    """The host's AppArmor as containers meet it; files and parser are parameters so
    that tests can stand fakes in for the kernel's."""

    def __init__(
        self,
        *,
        enabled_file: Path = ENABLED_FILE,
        profiles_file: Path = PROFILES_FILE,
        parser: str = PARSER,
    ) -> None:
        self._enabled_file = enabled_file
        self._profiles_file = profiles_file
        self._parser = parser
        self._loading = threading.Lock()

    def enabled(self) -> bool:
        return enabled(self._enabled_file)

    def runtime_default(self) -> str:
        """What RuntimeDefault means on this host, for Status."""
        if not self.enabled():
            return "unconfined: AppArmor is not enabled on this host"
        mode = self.loaded().get(DEFAULT_PROFILE)
        if mode == "enforce":
            state = "loaded"
        elif mode:
            state = f"loaded in {mode} mode: reloaded enforcing when first needed"
        else:
            state = "loaded when first needed"
        return f"{DEFAULT_PROFILE} ({state})"

    def loaded(self) -> dict[str, str]:
        return loaded_profiles(self._profiles_file)

    def profile_for(self, sc: api_pb2.LinuxContainerSecurityContext) -> str | None:
        """process.apparmorProfile for a container with this security context, or None
        to leave it out. Blocking (it may run apparmor_parser): off the event loop."""
        if sc.HasField("apparmor"):
            kind = sc.apparmor.profile_type
            # kubelet and critest name a localhost profile as the deprecated field did,
            # `localhost/<name>`; the kernel lists it as `<name>` (containerd trims too).
            ref = sc.apparmor.localhost_ref.removeprefix("localhost/")
            name = ref if kind == api_pb2.SecurityProfile.Localhost else ""
            unconfined = kind == api_pb2.SecurityProfile.Unconfined
        else:  # the deprecated string field
            legacy = sc.apparmor_profile
            name = legacy.removeprefix("localhost/") if legacy.startswith("localhost/") else ""
            unconfined = legacy == "unconfined"
        field = "security_context.apparmor"
        if not self.enabled():
            if name:
                raise InvalidArgument(
                    f"{field}: profile {name!r} requested, but AppArmor is not enabled on this host"
                )
            return None
        if name:
            if name not in self.loaded():
                raise InvalidArgument(
                    f"{field}: AppArmor profile {name!r} is not loaded on this host "
                    "(apparmor_parser)"
                )
            return name
        if unconfined or sc.privileged:
            return "unconfined"
        self._ensure_default()
        return DEFAULT_PROFILE

    def _ensure_default(self) -> None:
        with self._loading:
            mode = self.loaded().get(DEFAULT_PROFILE)
            if mode == "enforce":
                return
            if mode:
                # A profile in complain mode only logs what it would deny: containers
                # under it would run as good as unconfined.
                log.warning(
                    "the AppArmor profile %s is loaded in %s mode: reloading it enforcing",
                    DEFAULT_PROFILE,
                    mode,
                )
            # -K: no cache of ours in the host's; -r: replace a stale copy.
            command = [self._parser, "-Kr"]
            try:
                done = subprocess.run(
                    command,
                    input=default_profile_text().encode(),
                    capture_output=True,
                    timeout=PARSER_TIMEOUT,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise FailedPrecondition(
                    f"AppArmor is enabled but its RuntimeDefault profile {DEFAULT_PROFILE} "
                    f"could not be loaded: {exc} (install apparmor_parser, or ask for "
                    "Unconfined)"
                ) from None
            if done.returncode != 0:
                detail = done.stderr.decode(errors="replace").strip()[-500:]
                raise FailedPrecondition(
                    f"AppArmor is enabled but {self._parser} refused the RuntimeDefault "
                    f"profile {DEFAULT_PROFILE} (exit {done.returncode}): {detail}"
                )
            mode = self.loaded().get(DEFAULT_PROFILE)
            if mode != "enforce":
                raise FailedPrecondition(
                    f"AppArmor is enabled but its RuntimeDefault profile {DEFAULT_PROFILE} "
                    f"is {f'in {mode} mode' if mode else 'not listed'} after {self._parser} "
                    "loaded it; a container needs it enforcing (check the host's AppArmor "
                    "settings, or ask for Unconfined)"
                )
            log.info("loaded the AppArmor profile %s (enforce)", DEFAULT_PROFILE)
