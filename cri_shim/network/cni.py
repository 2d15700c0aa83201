"""CNI runner: picks the network configuration and runs its plugins per the CNI spec.

Owns every CNI plugin process the daemon starts (the one place for those subprocess calls).
Speaks spec versions 0.3.x, 0.4.0 and 1.0.0: ADD runs the plugins of the list in order,
each handed the previous one's result; DEL runs them in reverse and tries every one of them;
CHECK runs them in order against the result of the ADD. A plugin is killed when its time is
up, and its own error message (stdout JSON and stderr) goes into the raised error.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import logging
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cri_shim import tracing
from cri_shim.errors import (
    CriError,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    Unavailable,
)
from cri_shim.host import spawn
from cri_shim.host.routes import Route, host_routes

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = frozenset({"0.3.0", "0.3.1", "0.4.0", "1.0.0"})
# CHECK and a prevResult on DEL only exist from 0.4.0 on.
_CHECK_VERSIONS = frozenset({"0.4.0", "1.0.0"})
CONFIG_SUFFIXES = (".conflist", ".conf", ".json")
IFNAME = "eth0"
# The reason string kubelet itself uses for this condition.
NOT_READY_REASON = "NetworkPluginNotReady"
# The network's subnet is routed through another interface (subnet_conflict).
SUBNET_IN_USE_REASON = "NetworkSubnetInUse"
# The bridge plugin's bridge when its config names none.
DEFAULT_BRIDGE = "cni0"
# Plugin stderr can be a whole Go panic; a message a person reads needs its start only.
_STDERR_LIMIT = 2000


@dataclass
class PodNetworkRequest:
    """What the plugins need to know about one pod's attachment."""

    pod_id: str
    netns: Path
    name: str
    namespace: str
    uid: str
    # CRI port mappings as {hostPort, containerPort, protocol, hostIP}; DEL needs the same
    # list as ADD, because portmap only removes the rules it is told about.
    port_mappings: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class CniResult:
    """The outcome of an ADD: pod IPs (IPv4 first), the final result and the config used.

    Keep `raw` and `config` with the pod: DEL wants the result as `prevResult`, and must run
    the plugins that did the ADD even if the config directory has changed since.
    """

    ips: list[str]
    raw: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NetworkConfigList:
    """One usable network configuration list, as read from `source`."""

    name: str
    cni_version: str
    plugins: list[dict[str, Any]]
    disable_check: bool
    source: Path | None

    def as_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "cniVersion": self.cni_version,
            "name": self.name,
            "plugins": copy.deepcopy(self.plugins),
        }
        if self.disable_check:
            data["disableCheck"] = True
        return data


class ConfigProblem(ValueError):
    """A configuration file that cannot be used; the message names the file and the fault."""


def parse_network_config(data: object, source: Path | None = None) -> NetworkConfigList:
    """Validate a network configuration list, or a single network config wrapped into one."""
    where = str(source) if source is not None else "network config"
    if not isinstance(data, dict):
        raise ConfigProblem(f"{where}: expected a JSON object")
    if "plugins" in data:
        plugins = data["plugins"]
        if not isinstance(plugins, list) or not plugins:
            raise ConfigProblem(f"{where}: 'plugins' must be a non-empty list")
    elif "type" in data:
        # A single plugin config (.conf); the list around it takes its name and version.
        plugins = [{k: v for k, v in data.items() if k not in ("name", "cniVersion")}]
    else:
        raise ConfigProblem(f"{where}: neither a 'plugins' list nor a plugin 'type'")

    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigProblem(f"{where}: missing network 'name'")
    version = data.get("cniVersion")
    if version not in SUPPORTED_VERSIONS:
        raise ConfigProblem(
            f"{where}: cniVersion {version!r} is not supported "
            f"(supported: {', '.join(sorted(SUPPORTED_VERSIONS))})"
        )
    for index, plugin in enumerate(plugins):
        if not isinstance(plugin, dict):
            raise ConfigProblem(f"{where}: plugin {index} is not a JSON object")
        kind = plugin.get("type")
        # The type names a binary in the bin dirs; a path would escape them.
        if not isinstance(kind, str) or not kind or "/" in kind or kind in (".", ".."):
            raise ConfigProblem(f"{where}: plugin {index} has no valid 'type'")
    return NetworkConfigList(
        name=name,
        cni_version=version,
        plugins=copy.deepcopy(plugins),
        disable_check=bool(data.get("disableCheck", False)),
        source=source,
    )


def config_files(directory: Path) -> list[Path]:
    """Candidate config files in lexical order, the order kubelet documents."""
    try:
        entries = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(
        (p for p in entries if p.suffix in CONFIG_SUFFIXES and p.is_file()),
        key=lambda p: p.name,
    )


def load_first_config(directory: Path) -> NetworkConfigList | None:
    """The first config file of `directory`, or None if it holds none.

    The first file decides even when it is broken: skipping it would silently attach pods
    to another network (say, while a CNI daemonset is still writing its file).
    """
    files = config_files(directory)
    if not files:
        return None
    source = files[0]
    try:
        data = json.loads(source.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigProblem(f"{source}: cannot be read as JSON: {exc}") from exc
    return parse_network_config(data, source)


def cni_args(req: PodNetworkRequest) -> str:
    """CNI_ARGS as kubelet-era runtimes pass it; IgnoreUnknown lets plugins skip the rest."""
    pairs = {
        "K8S_POD_NAMESPACE": req.namespace,
        "K8S_POD_NAME": req.name,
        "K8S_POD_INFRA_CONTAINER_ID": req.pod_id,
        "K8S_POD_UID": req.uid,
    }
    for key, value in pairs.items():
        if ";" in value or "=" in value:
            raise InvalidArgument(f"{key} {value!r} cannot be passed in CNI_ARGS")
    return "IgnoreUnknown=1;" + ";".join(f"{k}={v}" for k, v in pairs.items())


def normalize_port_mappings(mappings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Port mappings in the shape the portmap plugin reads.

    Mappings without a host port are dropped: they only document a container port.
    """
    out: list[dict[str, Any]] = []
    for mapping in mappings:
        host_port = mapping.get("hostPort", 0) or 0
        container_port = mapping.get("containerPort", 0) or 0
        if not isinstance(host_port, int) or not isinstance(container_port, int):
            raise InvalidArgument(f"port mapping {mapping!r}: ports must be integers")
        if host_port == 0:
            continue
        if not (0 < host_port < 65536 and 0 < container_port < 65536):
            raise InvalidArgument(f"port mapping {mapping!r}: ports must be within 1-65535")
        protocol = str(mapping.get("protocol") or "tcp").lower()
        if protocol not in ("tcp", "udp", "sctp"):
            raise InvalidArgument(f"port mapping {mapping!r}: unknown protocol {protocol!r}")
        entry: dict[str, Any] = {
            "hostPort": host_port,
            "containerPort": container_port,
            "protocol": protocol,
        }
        if mapping.get("hostIP"):
            entry["hostIP"] = str(mapping["hostIP"])
        out.append(entry)
    return out


def runtime_config(plugin: dict[str, Any], req: PodNetworkRequest) -> dict[str, Any]:
    """The runtimeConfig for one plugin: only what it declared among its capabilities."""
    capabilities = plugin.get("capabilities")
    if not isinstance(capabilities, dict):
        return {}
    available: dict[str, Any] = {}
    mappings = normalize_port_mappings(req.port_mappings)
    if mappings:
        available["portMappings"] = mappings
    return {key: value for key, value in available.items() if capabilities.get(key) is True}


def plugin_stdin(
    conf: NetworkConfigList,
    plugin: dict[str, Any],
    req: PodNetworkRequest,
    prev_result: dict[str, Any] | None,
) -> dict[str, Any]:
    """The JSON a plugin reads: its own config plus the list's name/version and context."""
    data = copy.deepcopy(plugin)
    data["name"] = conf.name
    data["cniVersion"] = conf.cni_version
    if prev_result is not None:
        data["prevResult"] = prev_result
    else:
        data.pop("prevResult", None)
    extra = runtime_config(plugin, req)
    if extra:
        data["runtimeConfig"] = {**(data.get("runtimeConfig") or {}), **extra}
    return data


def result_ips(result: dict[str, Any]) -> list[str]:
    """Pod IPs of a 0.3/0.4/1.0 result, without prefix length, IPv4 first.

    Addresses a result puts on a host-side interface (one without `sandbox`) are not the
    pod's, so they are left out.
    """
    interfaces = result.get("interfaces") or []
    v4: list[str] = []
    v6: list[str] = []
    for entry in result.get("ips") or []:
        if not isinstance(entry, dict):
            raise Internal(f"CNI result has a malformed ips entry: {entry!r}")
        index = entry.get("interface")
        if (
            isinstance(index, int)
            and 0 <= index < len(interfaces)
            and isinstance(interfaces[index], dict)
            and not interfaces[index].get("sandbox")
        ):
            continue
        try:
            address = ipaddress.ip_interface(entry["address"]).ip
        except (KeyError, ValueError) as exc:
            raise Internal(f"CNI result has an invalid address in {entry!r}") from exc
        bucket = v4 if address.version == 4 else v6
        if str(address) not in bucket:
            bucket.append(str(address))
    return v4 + v6


def bridge_subnets(
    conf: NetworkConfigList,
) -> list[tuple[str, ipaddress.IPv4Network | ipaddress.IPv6Network]]:
    """(bridge, subnet) for every subnet the IPAM of a `bridge` plugin hands out from
    (`ranges`, or the older single `subnet`). What is malformed is left to the plugin."""
    found: list[tuple[str, ipaddress.IPv4Network | ipaddress.IPv6Network]] = []
    for plugin in conf.plugins:
        if plugin.get("type") != "bridge":
            continue
        bridge = plugin.get("bridge") or DEFAULT_BRIDGE
        ipam = plugin.get("ipam")
        if not isinstance(ipam, dict):
            continue
        subnets = [ipam.get("subnet")]
        for range_set in ipam.get("ranges") or []:
            if isinstance(range_set, list):
                subnets += [r.get("subnet") for r in range_set if isinstance(r, dict)]
        for subnet in subnets:
            if not isinstance(subnet, str):
                continue
            try:
                found.append((str(bridge), ipaddress.ip_network(subnet, strict=False)))
            except ValueError:
                continue
    return found


def subnet_conflict(conf: NetworkConfigList, routes: list[Route]) -> str:
    """Why the host could not reach this network's pods, or "".

    A bridge network's pods are reached through the route to its subnet on its bridge.
    Where the host already routes that subnet, or a part of it, through another interface
    (containerd's and podman's default network is 10.88.0.0/16 too, on `cni0` or
    `podman0`), that route wins or ties, and pods, kubelet's probes included, cannot be
    reached. A wider route (10.0.0.0/8 through eth0) loses to the bridge's: no conflict.
    """
    where = f" ({conf.source})" if conf.source is not None else ""
    for bridge, subnet in bridge_subnets(conf):
        for route in routes:
            if route.interface == bridge or route.network.version != subnet.version:
                continue
            if route.network.subnet_of(subnet):  # type: ignore[arg-type]  # same version
                return (
                    f"CNI network {conf.name!r}{where}: its subnet {subnet} is already routed "
                    f"through {route.interface} ({route.network}), not through the network's "
                    f"bridge {bridge}: the host could not reach its pods. Give the network a "
                    f"subnet no other interface uses, or remove {route.network} from "
                    f"{route.interface}"
                )
    return ""


class CniNetwork:
    """The pod network as the CNI config directory describes it."""

    def __init__(
        self,
        config_dir: Path,
        bin_dirs: list[Path],
        fallback_dir: Path | None,
        *,
        plugin_timeout: float | None = None,
        cleanup_timeout: float = 120.0,
        routes: Callable[[Collection[int]], list[Route]] = host_routes,
        observe_call: Callable[[str, str, float, bool], None] | None = None,
    ) -> None:
        """`plugin_timeout` caps a single plugin call within the budget of an operation
        (None: the whole remaining budget). `cleanup_timeout` is the budget of the DEL that
        undoes a failed ADD, whose own budget may be spent by then. `routes` reads the
        host's routes of the IP versions given (a fake in unit tests). `observe_call` is
        told of every plugin call (the daemon's metrics, when it exports them).
        """
        self.config_dir = Path(config_dir)
        self.bin_dirs = [Path(d) for d in bin_dirs]
        self.fallback_dir = Path(fallback_dir) if fallback_dir is not None else None
        self.plugin_timeout = plugin_timeout
        self.cleanup_timeout = cleanup_timeout
        self._routes = routes
        self._observe_call = observe_call
        self._conf: NetworkConfigList | None = None
        self._problem = "CNI config not loaded yet"
        self._fingerprint: object = None
        self._conflict_logged = ""

    # ---- configuration ----------------------------------------------------------------

    def reload(self) -> None:
        """Read the configuration again (on SIGHUP, or when the directories changed)."""
        self._fingerprint = self._scan_fingerprint()
        previous = self._conf
        self._conf, self._problem = self._load()
        if self._conf is None:
            log.warning("CNI network not ready: %s", self._problem)
        elif previous is None or previous.as_json() != self._conf.as_json():
            log.info("CNI network %r loaded from %s", self._conf.name, self._conf.source)

    def status(self) -> tuple[bool, str, str]:
        """(ready, reason, message) for the CRI NetworkReady condition."""
        ready, message = self._runnable()
        if not ready or self._conf is None:
            return False, NOT_READY_REASON, message
        # Read each time: routes change without the configuration changing.
        conflict = self._subnet_conflict(self._conf)
        if conflict:
            return False, SUBNET_IN_USE_REASON, conflict
        return True, "", ""

    def _runnable(self) -> tuple[bool, str]:
        """Whether the plugins can run at all: a configuration and its binaries."""
        self._refresh()
        if self._conf is None:
            return False, self._problem
        missing = self._missing_binaries(self._conf)
        if missing:
            return False, missing
        return True, ""

    def _subnet_conflict(self, conf: NetworkConfigList) -> str:
        versions = {subnet.version for _, subnet in bridge_subnets(conf)}
        conflict = subnet_conflict(conf, self._routes(versions)) if versions else ""
        # Said once when it appears or changes, not at every Status call.
        if conflict and conflict != self._conflict_logged:
            log.warning("CNI network not ready: %s", conflict)
        elif not conflict and self._conflict_logged:
            log.info("CNI network %r: its subnet is no longer routed elsewhere", conf.name)
        self._conflict_logged = conflict
        return conflict

    def _load(self) -> tuple[NetworkConfigList | None, str]:
        searched = [self.config_dir]
        try:
            conf = load_first_config(self.config_dir)
            if conf is None and self.fallback_dir is not None:
                searched.append(self.fallback_dir)
                conf = load_first_config(self.fallback_dir)
        except ConfigProblem as exc:
            return None, f"CNI config cannot be used: {exc}"
        if conf is None:
            where = " or ".join(str(d) for d in searched)
            return None, f"no CNI network config (*.conflist, *.conf, *.json) found in {where}"
        return conf, ""

    def _scan_fingerprint(self) -> object:
        # Cheap enough for every Status call: a listing and a stat per config file. A file
        # rewritten in place changes its own mtime but not its directory's, hence both.
        marks: list[object] = []
        for directory in (self.config_dir, self.fallback_dir):
            if directory is None:
                continue
            for path in config_files(directory):
                try:
                    st = path.stat()
                except OSError:
                    continue
                marks.append((str(path), st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(marks)

    def _refresh(self) -> None:
        if self._scan_fingerprint() != self._fingerprint:
            self.reload()

    def _find_binary(self, kind: str) -> Path | None:
        for directory in self.bin_dirs:
            candidate = directory / kind
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
        return None

    def _missing_binaries(self, conf: NetworkConfigList) -> str:
        missing = [p["type"] for p in conf.plugins if self._find_binary(p["type"]) is None]
        if not missing:
            return ""
        dirs = ", ".join(str(d) for d in self.bin_dirs)
        return f"CNI plugin(s) {', '.join(missing)} of network {conf.name!r} not found in {dirs}"

    def _usable(
        self, config: dict[str, Any] | None = None, *, add: bool = False
    ) -> NetworkConfigList:
        if config is not None:
            try:
                return parse_network_config(config)
            except ConfigProblem as exc:
                raise InvalidArgument(f"stored CNI config cannot be used: {exc}") from exc
        # Only an ADD needs the whole NetworkReady: a DEL must still undo what a pod holds
        # (or the nothing a refused ADD left) while its subnet is routed elsewhere.
        if add:
            ready, _, message = self.status()
        else:
            ready, message = self._runnable()
        if not ready or self._conf is None:
            raise Unavailable(f"network is not ready: {message}")
        return self._conf

    # ---- operations -------------------------------------------------------------------

    # The budgets are parameters rather than the caller's asyncio.timeout: a timeout must kill
    # the plugin and name it, and the DEL after a failed ADD must still get to run.
    async def add(self, req: PodNetworkRequest, timeout: float) -> CniResult:
        """Attach the pod to the network within `timeout` seconds and return its IPs.

        A failed ADD runs DEL for the whole list before raising, because any plugin,
        including the failing one, may have allocated (an IP, a veth, iptables rules).
        If the caller is cancelled, the running plugin is killed and no DEL is run: the
        caller's undo journal must hold the DEL before the ADD starts.
        """
        _validate_request(req)
        conf = self._usable(add=True)
        deadline = time.monotonic() + timeout
        result: dict[str, Any] | None = None
        try:
            for plugin in conf.plugins:
                output = await self._invoke("ADD", conf, plugin, req, result, deadline)
                if output is None:
                    raise Internal(
                        f"CNI plugin {plugin['type']} (network {conf.name}) returned no result "
                        f"on ADD for pod {req.namespace}/{req.name}"
                    )
                result = output
            assert result is not None
            ips = result_ips(result)
        except CriError as exc:
            cleanup_errors = await self._delete_all(conf, req, self.cleanup_timeout, result)
            if cleanup_errors:
                note = "; ".join(cleanup_errors)
                raise type(exc)(f"{exc}; the cleanup DEL also failed: {note}") from exc
            raise
        return CniResult(ips=ips, raw=result, config=conf.as_json())

    async def delete(
        self,
        req: PodNetworkRequest,
        timeout: float,
        prev_result: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        """Detach the pod: DEL every plugin in reverse order, even past a failing one.

        Per the CNI spec a DEL of something already gone succeeds, so this is idempotent.
        `config` is `CniResult.config` of the ADD; without it the current config is used.
        """
        _validate_request(req)
        conf = self._usable(config)
        errors = await self._delete_all(conf, req, timeout, prev_result)
        if errors:
            raise Internal("; ".join(errors))

    async def check(
        self,
        req: PodNetworkRequest,
        timeout: float,
        prev_result: dict[str, Any],
        config: dict[str, Any] | None = None,
    ) -> None:
        """Ask every plugin whether the attachment is still as ADD left it (CNI CHECK)."""
        _validate_request(req)
        conf = self._usable(config)
        if conf.disable_check or conf.cni_version not in _CHECK_VERSIONS:
            return
        deadline = time.monotonic() + timeout
        for plugin in conf.plugins:
            await self._invoke("CHECK", conf, plugin, req, prev_result, deadline)

    async def _delete_all(
        self,
        conf: NetworkConfigList,
        req: PodNetworkRequest,
        budget: float,
        prev_result: dict[str, Any] | None,
    ) -> list[str]:
        deadline = time.monotonic() + budget
        # prevResult on DEL exists from 0.4.0; older plugins would reject it.
        if conf.cni_version not in _CHECK_VERSIONS:
            prev_result = None
        errors: list[str] = []
        for plugin in reversed(conf.plugins):
            try:
                await self._invoke("DEL", conf, plugin, req, prev_result, deadline)
            except CriError as exc:
                errors.append(str(exc))
        return errors

    # ---- one plugin call --------------------------------------------------------------

    def _environment(self, command: str, req: PodNetworkRequest) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CNI_")}
        netns = str(req.netns)
        # DEL may run after the netns is gone; the spec lets CNI_NETNS be empty then, and
        # plugins handle that, whereas a stale path (or a leftover unmounted pin file)
        # would make them fail and the DEL would never succeed.
        if command == "DEL" and not os.path.ismount(netns):
            netns = ""
        env.update(
            CNI_COMMAND=command,
            CNI_CONTAINERID=req.pod_id,
            CNI_NETNS=netns,
            CNI_IFNAME=IFNAME,
            CNI_PATH=os.pathsep.join(str(d) for d in self.bin_dirs),
            CNI_ARGS=cni_args(req),
        )
        return env

    async def _invoke(
        self,
        command: str,
        conf: NetworkConfigList,
        plugin: dict[str, Any],
        req: PodNetworkRequest,
        prev_result: dict[str, Any] | None,
        deadline: float,
    ) -> dict[str, Any] | None:
        kind = plugin["type"]
        what = (
            f"CNI plugin {kind} (network {conf.name}) {command} for pod {req.namespace}/{req.name}"
        )
        binary = self._find_binary(kind)
        if binary is None:
            dirs = ", ".join(str(d) for d in self.bin_dirs)
            raise Internal(f"{what}: plugin binary not found in {dirs}")
        limit = deadline - time.monotonic()
        if self.plugin_timeout is not None:
            limit = min(limit, self.plugin_timeout)
        if limit <= 0:
            raise DeadlineExceeded(f"{what}: not started, the time budget is spent")

        stdin = json.dumps(plugin_stdin(conf, plugin, req, prev_result)).encode()
        started = time.monotonic()
        ok = False
        try:
            # Its own session (spawn's default), so that a kill on timeout also takes the
            # helpers it started (iptables, ...) that would otherwise hold its pipes open.
            # Cancelled, the plugin is killed: it must not outlive the request.
            with tracing.span(
                f"CNI {command} {kind}",
                **{"cni.plugin": kind, "cni.command": command, "cni.network": conf.name},
            ) as span:
                done = await spawn.run(
                    [str(binary)],
                    input=stdin,
                    timeout=limit,
                    env=self._environment(command, req),
                    cwd="/",
                )
                span.set_attribute("process.exit.code", done.returncode)
            ok = done.returncode == 0
        except spawn.TimedOut:
            raise DeadlineExceeded(
                f"{what}: no answer within {limit:.1f}s; the plugin was killed"
            ) from None
        except OSError as exc:
            raise Internal(f"{what}: cannot start {binary}: {exc}") from exc
        finally:
            # Latency and result per plugin and command, timeouts included (metrics).
            if self._observe_call is not None:
                self._observe_call("cni", f"{command} {kind}", time.monotonic() - started, ok)
        stdout, stderr = done.stdout, done.stderr
        elapsed = (time.monotonic() - started) * 1000
        log.debug("%s: exit %s in %.1f ms", what, done.returncode, elapsed)

        if done.returncode != 0:
            raise Internal(f"{what} failed: {_describe_failure(done.returncode, stdout, stderr)}")
        if command != "ADD":
            return None
        try:
            output = json.loads(stdout) if stdout.strip() else None
        except ValueError as exc:
            raise Internal(f"{what}: result is not JSON: {_snippet(stdout)}") from exc
        if output is not None and not isinstance(output, dict):
            raise Internal(f"{what}: result is not a JSON object: {_snippet(stdout)}")
        return output


def _validate_request(req: PodNetworkRequest) -> None:
    # Fail on bad input before any plugin runs, not half-way through the list.
    cni_args(req)
    normalize_port_mappings(req.port_mappings)


def _snippet(data: bytes, limit: int = _STDERR_LIMIT) -> str:
    text = data.decode(errors="replace").strip()
    return text if len(text) <= limit else text[:limit] + "…"


def _describe_failure(returncode: int | None, stdout: bytes, stderr: bytes) -> str:
    """The plugin's own words: its error JSON ({code, msg, details}) and its stderr."""
    parts: list[str] = []
    try:
        error = json.loads(stdout) if stdout.strip() else None
    except ValueError:
        error = None
    if isinstance(error, dict) and ("msg" in error or "code" in error):
        text = str(error.get("msg") or "no message")
        if error.get("details"):
            text += f": {error['details']}"
        parts.append(f"{text} (CNI error code {error.get('code')})")
    elif stdout.strip():
        parts.append(_snippet(stdout))
    if stderr.strip():
        parts.append(f"stderr: {_snippet(stderr)}")
    if not parts:
        parts.append(f"exit status {returncode} without a message")
    return "; ".join(parts)
