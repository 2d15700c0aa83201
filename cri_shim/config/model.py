"""The daemon's configuration as typed dataclasses: every key, its type and its default.

Loading and checking a file is `validation`; printing it back and documenting every key
is `reference`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_CONFIG_PATH = Path("/etc/cri-shim/config.toml")
# The default bridge network shipped with the source tree (used when config_dir is empty).
BUNDLED_CNI_DIR = Path(__file__).resolve().parents[2] / "cni"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key."""


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
    # Whether pods get a sandbox container their containers join, created first and
    # removed last. None: the handler's kind decides (gVisor and Kata: runtime/kinds/).
    pod_sandbox: bool | None = None
    # Global options given to every call of the runtime, before the command.
    runtime_args: list[str] = field(default_factory=list)


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
    # Limits on one layer as it is unpacked: a decompression bomb stops here, with a
    # message naming the key. Generous: real layers reach tens of GiB.
    max_layer_bytes: int = 64 << 30
    max_layer_entries: int = 1_000_000
    # Device nodes in a layer can open host devices to whoever may use the image's
    # files; overlay whiteouts (0/0 character devices) are always kept.
    allow_device_nodes: bool = False
    # Layer downloads: the daemon runs at most max_concurrent_downloads at once, one
    # registry at most max_downloads_per_registry of them, each within download_timeout,
    # and one slower than download_min_rate bytes a second over download_rate_window is cut
    # off, so no registry can hold the others up.
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
    """Admission of CRI calls: a flood is queued or refused, never unbounded."""

    # Calls that do host work (create, stop, remove, exec, pull) running at once...
    max_in_flight: int = 32
    # ...and waiting for a slot; a call beyond both is refused with RESOURCE_EXHAUSTED.
    max_queued: int = 256
    # Calls answered from memory and the database (list, status, stats, version).
    max_reads_in_flight: int = 1024
    # Streaming lists (StreamContainers, ...) open at once: apart from the reads, as a
    # client that does not read holds its stream open.
    max_streams_in_flight: int = 64
    # How long one message of such a stream may wait for the client to read.
    stream_write_timeout: float = 30.0
    # Memory held for unary replies gRPC has not sent yet, all calls together
    # (server/limits.py hold_reply).
    max_reply_bytes_in_flight: int = 64 << 20


@dataclass
class EventsConfig:
    """GetContainerEvents: kubelet opens one stream; crictl events a few more."""

    # Streams open at once; one more is refused with RESOURCE_EXHAUSTED.
    max_subscribers: int = 16
    # Events one stream may leave unread; a stream behind by more is dropped.
    max_backlog_bytes: int = 16 << 20


@dataclass
class StreamingSection:
    # Loopback on a free port: kubelet proxies exec/attach/port-forward from the node.
    address: str = "127.0.0.1:0"
    tls_cert: Path | None = None
    tls_key: Path | None = None


@dataclass
class MetricsConfig:
    listen: str = ""
    # How often the event loop's lag is sampled (loop_monitor.py); 0 turns it off.
    event_loop_sample_interval: float = 0.1
    # How old a writable layer's disk use may be before a stats call walks it again
    # (inspection/layer_usage.py); 0 walks it for every call.
    layer_usage_max_age: float = 10.0


@dataclass
class CdiConfig:
    # Later directories override earlier ones for the same device (the CDI spec's order).
    spec_dirs: list[Path] = field(default_factory=lambda: [Path("/etc/cdi"), Path("/var/run/cdi")])


@dataclass
class NriConfig:
    # Off by default, as in containerd and CRI-O: a plugin can change every container.
    enable: bool = False
    socket_path: Path = Path("/var/run/nri/nri.sock")
    # A plugin that connects must register within this, and answer every call within the
    # request timeout; one that does not is disconnected (and never holds a creation up).
    plugin_registration_timeout: float = 5.0
    plugin_request_timeout: float = 2.0
    # Pre-installed plugins, as containerd's NRI has them: executables named NN-name that
    # the daemon launches at start, and their configuration files.
    plugin_path: Path = Path("/opt/nri/plugins")
    plugin_config_path: Path = Path("/etc/nri/conf.d")


@dataclass
class TracingConfig:
    # Off while empty: nothing of OpenTelemetry is imported.
    endpoint: str = ""
    sampling_ratio: float = 1.0
    service_name: str = "cri-shim"
    # Spans waiting for export, in number and in bytes; beyond either the oldest are
    # dropped (a dead collector costs this much memory at most).
    max_queued_spans: int = 2048
    max_queued_bytes: int = 8 << 20
    # One export's whole exchange with the collector: connect, send, read the answer.
    export_timeout: float = 5.0


@dataclass
class Config:
    listen: str = "unix:///run/cri-shim/cri-shim.sock"
    root: Path = Path("/var/lib/cri-shim")
    run_root: Path = Path("/run/cri-shim")
    log_level: str = "info"
    log_format: str = "logfmt"
    # "auto": systemd where systemd is PID 1, cgroupfs elsewhere (runtime/cgroup_driver.py).
    cgroup_manager: str = "auto"
    # Where each conmon goes with the systemd driver: "" (system.slice), "pod" (the pod's
    # slice) or a slice's name. Unused with cgroupfs: conmon stays in the daemon's cgroup.
    conmon_cgroup: str = ""
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
    events: EventsConfig = field(default_factory=EventsConfig)
    cdi: CdiConfig = field(default_factory=CdiConfig)
    nri: NriConfig = field(default_factory=NriConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    @property
    def socket_path(self) -> Path:
        return Path(self.listen.removeprefix("unix://"))

    @property
    def state_db(self) -> Path:
        return self.root / "state.db"


# Fields given as durations ("90s") and byte counts ("16MiB") in the file; "" is the top
# level. The loader parses them so, and the printer and the reference write them so.
DURATION_KEYS = {
    ("network", "setup_timeout"),
    ("network", "teardown_timeout"),
    ("creation", "claim_grace"),
    ("creation", "cleanup_timeout"),
    ("runtime", "stop_timeout_grace"),
    ("images", "download_timeout"),
    ("images", "download_rate_window"),
    ("nri", "plugin_registration_timeout"),
    ("nri", "plugin_request_timeout"),
    ("requests", "stream_write_timeout"),
    ("metrics", "layer_usage_max_age"),
}
SIZE_KEYS = {
    ("", "max_message_bytes"),
    ("images", "max_layer_bytes"),
    ("images", "download_min_rate"),
    ("tracing", "max_queued_bytes"),
    ("events", "max_backlog_bytes"),
    ("requests", "max_reply_bytes_in_flight"),
}
