"""Daemon configuration: typed dataclasses, loaded from TOML, printed back as TOML.

Every key is optional. An unknown key or a value of the wrong kind stops the start with a
message that names the key, so that a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

DEFAULT_CONFIG_PATH = Path("/etc/cri-shim/config.toml")
# The default bridge network shipped with the source tree (used when config_dir is empty).
BUNDLED_CNI_DIR = Path(__file__).resolve().parent.parent / "cni"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key."""


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object, key: str) -> float:
    """Seconds from `"90s"`, `"5m"`, `"1h"`, `"250ms"` or a plain number of seconds."""
    if isinstance(value, bool):
        raise ConfigError(f'{key}: expected a duration such as "90s" or "5m", got {value!r}')
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise ConfigError(f'{key}: expected a duration such as "90s" or "5m", got {value!r}')
    if seconds < 0:
        raise ConfigError(f"{key}: a duration cannot be negative, got {value!r}")
    return seconds


_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|TiB)?\s*$")
_SIZE_UNITS = {"TiB": 1 << 40, "GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1, None: 1}


def parse_size(value: object, key: str, minimum: int = 1) -> int:
    """Bytes from an integer or a string such as `"16MiB"`, `"64GiB"`, `"512KiB"`."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        size = int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    else:
        raise ConfigError(f'{key}: expected a size such as "16MiB" or "64GiB", got {value!r}')
    if size < minimum:
        raise ConfigError(f"{key}: must be at least {minimum} bytes, got {value!r}")
    return size


def format_size(size: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size and size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit}"
    return f"{size}B"


def _positive_int(value: object, key: str) -> int:
    number = _expect(value, int, key, "a positive integer")
    if number < 1:
        raise ConfigError(f"{key}: expected a positive integer, got {value!r}")
    return int(number)


def format_duration(seconds: float) -> str:
    if seconds and seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{round(seconds * 1000)}ms"


@dataclass
class NetworkConfig:
    config_dir: Path = Path("/etc/cni/net.d")
    bin_dirs: list[Path] = field(
        default_factory=lambda: [Path("/usr/lib/cni"), Path("/opt/cni/bin")]
    )
    # A minute more than kubelet's longest request, so a slow plugin's work can be reused.
    setup_timeout: float = 300.0
    teardown_timeout: float = 120.0


@dataclass
class CreationConfig:
    claim_grace: float = 120.0
    keep_on_timeout: bool = True
    hand_off: bool = True
    cleanup_timeout: float = 120.0


@dataclass
class RuntimeHandler:
    path: Path = Path("runc")
    root: Path | None = None


@dataclass
class RuntimeConfig:
    default_handler: str = "runc"
    conmon: Path = Path("conmon")
    handlers: dict[str, RuntimeHandler] = field(
        default_factory=lambda: {"runc": RuntimeHandler(path=Path("runc"))}
    )
    stop_timeout_grace: float = 10.0


@dataclass
class ImagesConfig:
    insecure_registries: list[str] = field(default_factory=list)
    mirrors: dict[str, list[str]] = field(default_factory=dict)
    # Limits on one layer as it is unpacked (issue 9): a decompression bomb stops here,
    # with a message naming the key. Generous: real layers reach tens of GiB.
    max_layer_bytes: int = 64 << 30
    max_layer_entries: int = 1_000_000
    # Device nodes in a layer can open host devices to whoever may use the image's
    # files; overlay whiteouts (0/0 character devices) are always kept.
    allow_device_nodes: bool = False
    # Layer downloads (issue "Hardening, round two"): the daemon runs at most
    # max_concurrent_downloads at once, one registry at most max_downloads_per_registry of
    # them, each within download_timeout, and one slower than download_min_rate bytes a
    # second over download_rate_window is cut off, so no registry can hold the others up.
    max_concurrent_downloads: int = 4
    max_downloads_per_registry: int = 2
    download_timeout: float = 3600.0
    download_min_rate: int = 10 << 10
    download_rate_window: float = 30.0

    def __repr__(self) -> str:
        # A mirror may be written http://user:password@host; reprs reach logs and tracebacks.
        mirrors = {k: [redact_userinfo(url) for url in v] for k, v in self.mirrors.items()}
        rest = (f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"ImagesConfig({', '.join(r for r in rest if not r.startswith('mirrors='))}, " + (
            f"mirrors={mirrors!r})"
        )


_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")


def redact_userinfo(url: str) -> str:
    """`url` without its `user:password@`, for messages and reprs; any text works."""
    return _USERINFO.sub("", url)


@dataclass
class RequestsConfig:
    """Admission of CRI calls (issue 9): a flood is queued or refused, never unbounded."""

    # Calls that do host work (create, stop, remove, exec, pull) running at once...
    max_in_flight: int = 32
    # ...and waiting for a slot; a call beyond both is refused with RESOURCE_EXHAUSTED.
    max_queued: int = 256
    # Calls answered from memory and the database (list, status, stats, version).
    max_reads_in_flight: int = 1024


@dataclass
class StreamingSection:
    # Loopback on a free port: kubelet proxies exec/attach/port-forward from the node.
    address: str = "127.0.0.1:0"
    tls_cert: Path | None = None
    tls_key: Path | None = None


@dataclass
class MetricsConfig:
    listen: str = ""


@dataclass
class Config:
    listen: str = "unix:///run/cri-shim/cri-shim.sock"
    root: Path = Path("/var/lib/cri-shim")
    run_root: Path = Path("/run/cri-shim")
    log_level: str = "info"
    log_format: str = "logfmt"
    cgroup_manager: str = "cgroupfs"
    # gRPC refuses bigger requests with RESOURCE_EXHAUSTED before any handler sees them.
    max_message_bytes: int = 16 << 20
    # The socket is created 0660; this group (name or number) may connect. "" keeps root's.
    socket_group: str = ""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    creation: CreationConfig = field(default_factory=CreationConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    streaming: StreamingSection = field(default_factory=StreamingSection)
    requests: RequestsConfig = field(default_factory=RequestsConfig)

    @property
    def socket_path(self) -> Path:
        return Path(self.listen.removeprefix("unix://"))

    @property
    def state_db(self) -> Path:
        return self.root / "state.db"


_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("logfmt", "json", "text")
_CGROUP_MANAGERS = ("cgroupfs", "systemd")


def _expect(value: object, kind: type | tuple[type, ...], key: str, what: str) -> Any:
    if isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"{key}: expected {what}, got {value!r}")
    if not isinstance(value, kind):
        raise ConfigError(f"{key}: expected {what}, got {value!r}")
    return value


def _str_list(value: object, key: str) -> list[str]:
    items = _expect(value, list, key, "a list of strings")
    for item in items:
        _expect(item, str, key, "a list of strings")
    return list(items)


def _unknown(table: dict[str, Any], known: set[str], prefix: str) -> None:
    for key in table:
        if key not in known:
            name = f"{prefix}{key}"
            raise ConfigError(f"{name}: unknown configuration key")


def _load_network(table: dict[str, Any]) -> NetworkConfig:
    _unknown(table, {"config_dir", "bin_dirs", "setup_timeout", "teardown_timeout"}, "network.")
    net = NetworkConfig()
    if "config_dir" in table:
        net.config_dir = Path(_expect(table["config_dir"], str, "network.config_dir", "a path"))
    if "bin_dirs" in table:
        net.bin_dirs = [Path(p) for p in _str_list(table["bin_dirs"], "network.bin_dirs")]
    for key in ("setup_timeout", "teardown_timeout"):
        if key in table:
            setattr(net, key, parse_duration(table[key], f"network.{key}"))
    return net


def _load_creation(table: dict[str, Any]) -> CreationConfig:
    _unknown(table, {"claim_grace", "keep_on_timeout", "hand_off", "cleanup_timeout"}, "creation.")
    creation = CreationConfig()
    for key in ("claim_grace", "cleanup_timeout"):
        if key in table:
            setattr(creation, key, parse_duration(table[key], f"creation.{key}"))
    for key in ("keep_on_timeout", "hand_off"):
        if key in table:
            setattr(creation, key, _expect(table[key], bool, f"creation.{key}", "true or false"))
    return creation


def _load_runtime(table: dict[str, Any]) -> RuntimeConfig:
    _unknown(table, {"default_handler", "conmon", "handlers", "stop_timeout_grace"}, "runtime.")
    runtime = RuntimeConfig()
    if "default_handler" in table:
        runtime.default_handler = _expect(
            table["default_handler"], str, "runtime.default_handler", "a handler name"
        )
    if "conmon" in table:
        runtime.conmon = Path(_expect(table["conmon"], str, "runtime.conmon", "a path"))
    if "stop_timeout_grace" in table:
        runtime.stop_timeout_grace = parse_duration(
            table["stop_timeout_grace"], "runtime.stop_timeout_grace"
        )
    handlers = _expect(table.get("handlers", {}), dict, "runtime.handlers", "a table")
    for name, spec in handlers.items():
        prefix = f"runtime.handlers.{name}"
        spec = _expect(spec, dict, prefix, "a table")
        _unknown(spec, {"path", "root"}, prefix + ".")
        handler = RuntimeHandler(
            path=Path(_expect(spec.get("path", name), str, prefix + ".path", "a path"))
        )
        if "root" in spec:
            handler.root = Path(_expect(spec["root"], str, prefix + ".root", "a path"))
        runtime.handlers[name] = handler
    if runtime.default_handler not in runtime.handlers:
        raise ConfigError(
            f"runtime.default_handler: {runtime.default_handler!r} is not a configured handler "
            f"(known: {', '.join(sorted(runtime.handlers))})"
        )
    return runtime


def _load_images(table: dict[str, Any]) -> ImagesConfig:
    _unknown(
        table,
        {
            "insecure_registries",
            "mirrors",
            "max_layer_bytes",
            "max_layer_entries",
            "allow_device_nodes",
            "max_concurrent_downloads",
            "max_downloads_per_registry",
            "download_timeout",
            "download_min_rate",
            "download_rate_window",
        },
        "images.",
    )
    images = ImagesConfig()
    for key in ("max_concurrent_downloads", "max_downloads_per_registry"):
        if key in table:
            setattr(images, key, _positive_int(table[key], f"images.{key}"))
    for key in ("download_timeout", "download_rate_window"):
        if key in table:
            seconds = parse_duration(table[key], f"images.{key}")
            if seconds <= 0:
                raise ConfigError(f"images.{key}: must be longer than 0s, got {table[key]!r}")
            setattr(images, key, seconds)
    if "download_min_rate" in table:
        # 0 turns the check off: a size per second, "0B" allowed.
        images.download_min_rate = parse_size(
            table["download_min_rate"], "images.download_min_rate", minimum=0
        )
    if "max_layer_bytes" in table:
        images.max_layer_bytes = parse_size(table["max_layer_bytes"], "images.max_layer_bytes")
    if "max_layer_entries" in table:
        images.max_layer_entries = _positive_int(
            table["max_layer_entries"], "images.max_layer_entries"
        )
    if "allow_device_nodes" in table:
        images.allow_device_nodes = _expect(
            table["allow_device_nodes"], bool, "images.allow_device_nodes", "true or false"
        )
    if "insecure_registries" in table:
        images.insecure_registries = _str_list(
            table["insecure_registries"], "images.insecure_registries"
        )
    mirrors = _expect(table.get("mirrors", {}), dict, "images.mirrors", "a table")
    for registry, endpoints in mirrors.items():
        images.mirrors[registry] = _str_list(endpoints, f"images.mirrors.{registry}")
    return images


def _load_requests(table: dict[str, Any]) -> RequestsConfig:
    keys = {f.name for f in dataclasses.fields(RequestsConfig)}
    _unknown(table, keys, "requests.")
    requests = RequestsConfig()
    for key in sorted(keys):
        if key in table:
            setattr(requests, key, _positive_int(table[key], f"requests.{key}"))
    return requests


def _load_metrics(table: dict[str, Any]) -> MetricsConfig:
    _unknown(table, {"listen"}, "metrics.")
    metrics = MetricsConfig()
    if "listen" in table:
        metrics.listen = _check_host_port(
            _expect(table["listen"], str, "metrics.listen", "host:port"), "metrics.listen"
        )
    return metrics


def _load_streaming(table: dict[str, Any]) -> StreamingSection:
    _unknown(table, {"address", "tls_cert", "tls_key"}, "streaming.")
    streaming = StreamingSection()
    if "address" in table:
        address = _expect(table["address"], str, "streaming.address", "host:port")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"streaming.address: expected host:port, got {address!r}")
        streaming.address = address
    for key in ("tls_cert", "tls_key"):
        if key in table:
            setattr(streaming, key, Path(_expect(table[key], str, f"streaming.{key}", "a path")))
    if (streaming.tls_cert is None) != (streaming.tls_key is None):
        raise ConfigError("streaming.tls_cert: tls_cert and tls_key must be given together")
    return streaming


def config_from_dict(data: dict[str, Any]) -> Config:
    # The known keys are the fields: a section added to Config cannot be forgotten here.
    _unknown(data, {f.name for f in dataclasses.fields(Config)}, "")
    cfg = Config()
    if "listen" in data:
        cfg.listen = _check_listen(_expect(data["listen"], str, "listen", "a unix:// URL"))
    for key in ("root", "run_root"):
        if key in data:
            path = Path(_expect(data[key], str, key, "an absolute path"))
            if not path.is_absolute():
                raise ConfigError(f"{key}: expected an absolute path, got {str(path)!r}")
            setattr(cfg, key, path)
    if "log_level" in data:
        cfg.log_level = _check_choice(data["log_level"], _LOG_LEVELS, "log_level")
    if "log_format" in data:
        cfg.log_format = _check_choice(data["log_format"], _LOG_FORMATS, "log_format")
    if "cgroup_manager" in data:
        cfg.cgroup_manager = _check_choice(
            data["cgroup_manager"], _CGROUP_MANAGERS, "cgroup_manager"
        )
    if "max_message_bytes" in data:
        # Below 64KiB even a normal CreateContainer (env, mounts, annotations) is refused.
        cfg.max_message_bytes = parse_size(
            data["max_message_bytes"], "max_message_bytes", minimum=64 << 10
        )
    if "socket_group" in data:
        cfg.socket_group = _check_group(
            _expect(data["socket_group"], (str, int), "socket_group", "a group name or number")
        )
    sections = {
        "network": _load_network,
        "creation": _load_creation,
        "runtime": _load_runtime,
        "images": _load_images,
        "metrics": _load_metrics,
        "streaming": _load_streaming,
        "requests": _load_requests,
    }
    for name, loader in sections.items():
        if name in data:
            setattr(cfg, name, loader(_expect(data[name], dict, name, "a table")))
    return cfg


def _check_choice(value: object, choices: tuple[str, ...], key: str) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got {value!r}")
    return value.lower()


def _check_group(value: str | int) -> str:
    """A group that exists here, by name or number: an unknown one would leave the socket
    reachable by nobody but root, which is worse to discover at the first kubelet call."""
    import grp

    text = str(value).strip()
    if text == "":
        return ""
    try:
        if text.isdigit():
            grp.getgrgid(int(text))
        else:
            grp.getgrnam(text)
    except KeyError:
        raise ConfigError(f"socket_group: no group {text!r} on this host") from None
    return text


def _check_listen(value: str) -> str:
    if not value.startswith("unix://") or not value.removeprefix("unix://").startswith("/"):
        raise ConfigError(f"listen: expected unix:///absolute/path, got {value!r}")
    return value


_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]*):(?P<port>\d{1,5})$")


def _check_host_port(value: str, key: str) -> str:
    """ "" (off), or host:port; an IPv6 host in brackets, an empty host for every address."""
    if value == "":
        return value
    match = _HOST_PORT.match(value)
    if match is None or int(match.group("port")) > 65535:
        raise ConfigError(
            f"{key}: expected host:port such as 127.0.0.1:9090 or [::1]:9090, got {value!r}"
        )
    return value


def load_config(path: Path | None) -> Config:
    """Load `path`, or the default file when it exists, or the built-in defaults."""
    if path is None:
        if not DEFAULT_CONFIG_PATH.exists():
            return Config()
        path = DEFAULT_CONFIG_PATH
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    return config_from_dict(data)


def apply_overrides(cfg: Config, **overrides: str | None) -> Config:
    """Command-line flags win over the file; each is checked like the file's key."""
    data = {k: v for k, v in overrides.items() if v is not None}
    if not data:
        return cfg
    checked = config_from_dict(data)
    for key in data:
        setattr(cfg, key, getattr(checked, key))
    return cfg


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and value == int(value):
        return int(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None
        }
    return value


_DURATION_KEYS = {
    ("network", "setup_timeout"),
    ("network", "teardown_timeout"),
    ("creation", "claim_grace"),
    ("creation", "cleanup_timeout"),
    ("runtime", "stop_timeout_grace"),
    ("images", "download_timeout"),
    ("images", "download_rate_window"),
}


# Byte counts, printed as sizes ("16MiB"); "" is the top level.
_SIZE_KEYS = {
    ("", "max_message_bytes"),
    ("images", "max_layer_bytes"),
    ("images", "download_min_rate"),
}


def config_to_toml(cfg: Config) -> str:
    data = _plain(cfg)
    for section, key in _DURATION_KEYS:
        data[section][key] = format_duration(getattr(getattr(cfg, section), key))
    for section, key in _SIZE_KEYS:
        table = data[section] if section else data
        table[key] = format_size(getattr(getattr(cfg, section) if section else cfg, key))
    return tomli_w.dumps(data)


# ---- the reference: every key documented, generated into docs/ and contrib/ ----------

# What each key means, keyed by its dotted path (NAME stands for any handler name). A test
# fails when a key has no entry here, or an entry names no key, or the generated files
# (docs/configuration.md, contrib/config.toml) are stale: the reference cannot drift.
KEY_DOCS: dict[str, str] = {
    "listen": "the CRI socket kubelet and crictl connect to (created mode 0660)",
    "root": "state: `state.db`, sandbox directories, images",
    "run_root": "runtime files: namespace pins, conmon sockets, runtime state",
    "log_level": "`debug`, `info`, `warning` or `error` (the `--log-level` flag wins)",
    "log_format": "`logfmt` (key=value), `json` (one object per line) or `text` (for humans)",
    "cgroup_manager": "`cgroupfs` or `systemd`; must match kubelet's `--cgroup-driver`",
    "max_message_bytes": "largest gRPC request accepted; a bigger one is refused with "
    "RESOURCE_EXHAUSTED before any handler reads it",
    "socket_group": "group (name or number) that owns the 0660 socket and so may connect; "
    '`""` leaves it root\'s',
    "network.config_dir": "CNI configurations; the lexically first one is used, re-read on "
    "SIGHUP and when the directory changes",
    "network.bin_dirs": "where CNI plugin binaries are looked up",
    "network.setup_timeout": "budget of a sandbox's CNI ADD, independent of the request's deadline",
    "network.teardown_timeout": "budget of a CNI DEL",
    "creation.claim_grace": "how long a finished but unclaimed object is kept after the last "
    "waiting request's deadline",
    "creation.keep_on_timeout": "`false` throws timed-out work away and refuses duplicates at once "
    "(containerd's behaviour, for comparison)",
    "creation.hand_off": "a duplicate request waiting on a creation gets the object as soon as "
    'it is finished within its deadline; `false` answers it "name is reserved" and only its '
    "next retry gets the object (CRI-O's behaviour, for comparison). No effect when "
    "`keep_on_timeout` is `false`",
    "creation.cleanup_timeout": "budget of one object's cleanup (each step retried with backoff)",
    "runtime.default_handler": "the handler used when a request names none",
    "runtime.conmon": "the conmon binary",
    "runtime.stop_timeout_grace": "extra time after SIGKILL before a stop is reported failed",
    "runtime.handlers.NAME.path": "the OCI runtime binary (runc, crun) of handler NAME",
    "runtime.handlers.NAME.root": "that runtime's `--root` state directory",
    "images.insecure_registries": "registries reached over plain HTTP",
    "images.mirrors": "registry → mirror endpoints tried in order before it, e.g. "
    '`{ "docker.io" = ["http://127.0.0.1:5000"] }`',
    "images.max_layer_bytes": "largest uncompressed layer (stream and file content); a bigger "
    "one (a decompression bomb) fails the pull or import naming this key",
    "images.max_layer_entries": "most entries (files, directories, links) in one layer; more "
    "fail the pull or import naming this key",
    "images.allow_device_nodes": "`true` keeps character and block devices found in layers; "
    "`false` refuses such a layer (overlay whiteouts, 0/0 character devices, are always kept)",
    "images.max_concurrent_downloads": "layer downloads the daemon runs at once, all registries "
    "together; more wait for a slot",
    "images.max_downloads_per_registry": "of those, how many one registry may hold, so that a "
    "slow registry cannot take every slot",
    "images.download_timeout": "budget of one layer download, from its first request to its "
    "last byte; a download past it fails UNAVAILABLE naming this key",
    "images.download_min_rate": "slowest a layer download may be (bytes a second, averaged over "
    "`download_rate_window`); a slower one is cut off and fails UNAVAILABLE naming this key; "
    '`"0B"` turns the check off',
    "images.download_rate_window": "how long the rate of a download is averaged over before it "
    "is judged against `download_min_rate`",
    "requests.max_in_flight": "CRI calls that do host work (create, start, stop, remove, exec, "
    "pull) running at once, and sandbox or container creations still running detached",
    "requests.max_queued": "such calls waiting for a slot; a call beyond both limits is refused "
    "with RESOURCE_EXHAUSTED",
    "requests.max_reads_in_flight": "calls answered from the state (list, status, stats, "
    "version) running at once; more are refused with RESOURCE_EXHAUSTED",
    "metrics.listen": 'Prometheus endpoint (`/metrics`), e.g. `127.0.0.1:9090`; `""` is off',
    "streaming.address": "host:port of the exec/attach/port-forward server whose URLs the "
    "streaming RPCs return; port 0 picks a free port, loopback suffices as kubelet proxies",
    "streaming.tls_cert": "PEM certificate to serve the streaming URLs over HTTPS (with `tls_key`)",
    "streaming.tls_key": "PEM private key of `tls_cert`; both or neither",
}

# Defaults that are computed rather than fixed, as the reference shows them.
_COMPUTED_DEFAULTS = {
    "runtime.handlers.NAME.path": "NAME",
    "runtime.handlers.NAME.root": "`<run_root>/runtime/NAME`",
}


@dataclass(frozen=True)
class ConfigKey:
    """One key of the configuration file, as the reference lists it."""

    section: str  # "" at the top level; "runtime.handlers.NAME" for per-name tables
    name: str
    kind: str  # what value it takes, for the reference
    default: str | None  # the default as a TOML literal; None when it is computed
    example_section: str  # `section` with NAME replaced by the default name ("runc")

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name


def config_keys() -> list[ConfigKey]:
    """Every key the file accepts, read from the dataclasses: a table's keys before its
    sub-tables, as TOML needs them."""
    keys: list[ConfigKey] = []
    _walk_keys(Config, Config(), "", "", keys)
    return keys


def _walk_keys(
    cls: type, instance: object, section: str, example: str, out: list[ConfigKey]
) -> None:
    hints = typing.get_type_hints(cls)
    tables: list[tuple[Any, object, str, str]] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        value = getattr(instance, f.name) if instance is not None else None
        args = typing.get_args(hint)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            tables.append((hint, value, _join(section, f.name), _join(example, f.name)))
        elif typing.get_origin(hint) is dict and dataclasses.is_dataclass(args[1]):
            # A table per name ([runtime.handlers.NAME]); the default entry is the example.
            first = next(iter(value.items()), None) if isinstance(value, dict) else None
            name, item = first if first is not None else ("NAME", None)
            tables.append(
                (
                    args[1],
                    item,
                    _join(section, f.name) + ".NAME",
                    _join(example, f"{f.name}.{name}"),
                )
            )
        else:
            default = None if value is None else _toml_literal(value, (section, f.name))
            out.append(ConfigKey(section, f.name, _kind(hint, (section, f.name)), default, example))
    for table in tables:
        _walk_keys(*table, out)


def _join(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


def _kind(hint: object, where: tuple[str, str]) -> str:
    if where in _DURATION_KEYS:
        return "duration"
    if where in _SIZE_KEYS:
        return "size"
    simple = {str: "string", bool: "boolean", Path: "path", float: "number", int: "integer"}
    if hint in simple:
        return simple[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return f"list of {_kind(args[0], where)}s"
    if origin is dict:
        return f"table of {_kind(args[1], where)}"
    if type(None) in args:  # Optional[X]
        return _kind(next(a for a in args if a is not type(None)), where)
    raise TypeError(f"config reference: no name for the type {hint!r} of {'.'.join(where)}")


def _toml_literal(value: object, where: tuple[str, str]) -> str:
    if where in _DURATION_KEYS:
        assert isinstance(value, float | int)
        value = format_duration(value)
    if where in _SIZE_KEYS:
        assert isinstance(value, int)
        value = format_size(value)
    return _literal(_plain(value))


def _literal(value: object) -> str:
    """One line of TOML for a plain value (tomli_w would spread arrays over lines)."""
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_literal(k)} = {_literal(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").strip()


def config_reference_markdown() -> str:
    """docs/configuration.md: every key, its type, default and meaning."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `cri-shim config --reference` from cri_shim/config.py; do not edit. -->",
        "",
        "TOML, default `/etc/cri-shim/config.toml` (optional; `--config PATH` names another).",
        "Every key is optional; an unknown key or a bad value stops the start with a message",
        'that names the key. Durations are strings such as `"90s"`, `"5m"`, `"250ms"` or',
        "integer seconds. The flags `--listen`, `--root`, `--run-root`, `--log-level` and",
        "`--log-format` win over the file. `contrib/config.toml` lists the same keys with",
        "their defaults, commented out. `cri-shim config` prints the effective configuration.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for key in config_keys():
        shown = f"[{key.section}] {key.name}" if key.section else key.name
        default = _COMPUTED_DEFAULTS.get(key.path) or (
            f"`{key.default}`" if key.default is not None else "unset"
        )
        meaning = KEY_DOCS.get(key.path, "**undocumented**").replace("|", "\\|")
        lines.append(f"| `{shown}` | {key.kind} | {default} | {meaning} |")
    return "\n".join(lines) + "\n"


def config_reference_toml() -> str:
    """contrib/config.toml: every key with its meaning, the default commented out."""
    out = [
        "# cri-shim configuration (/etc/cri-shim/config.toml).",
        "# Generated by `cri-shim config --reference --toml`; the reference is",
        "# docs/configuration.md. Every key is optional: each commented-out value below is",
        "# the built-in default. Uncomment a line to change it.",
    ]
    section = None
    for key in config_keys():
        if key.example_section != section:
            section = key.example_section
            out += ["", f"[{section}]"] if section else []
        # The per-name table is shown for the default name: NAME means that name there.
        name = key.example_section.rsplit(".", 1)[-1] if key.section.endswith(".NAME") else "NAME"
        meaning = re.sub(r"`([^`]*)`", r"\1", KEY_DOCS.get(key.path, "undocumented"))
        if key.default is None:
            computed = _COMPUTED_DEFAULTS.get(key.path, "unset").strip("`")
            meaning += f" (default: {computed})"
        out.append("")
        out += textwrap.wrap(
            f"{key.name}: {meaning}".replace("NAME", name),
            width=88,
            initial_indent="# ",
            subsequent_indent="# ",
        )
        if key.default is not None:
            out.append(f"#{key.name} = {key.default}")
    return "\n".join(out) + "\n"
