"""Loading the configuration: TOML parsed and checked into the typed model.

Every key is optional. An unknown key or a value of the wrong kind stops the start with a
message that names the key, so that a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

from cri_shim.config.model import (
    DEFAULT_CONFIG_PATH,
    CdiConfig,
    Config,
    ConfigError,
    CreationConfig,
    EventsConfig,
    ImagesConfig,
    MetricsConfig,
    NetworkConfig,
    NriConfig,
    RequestsConfig,
    RuntimeConfig,
    RuntimeHandler,
    StreamingSection,
    TracingConfig,
)
from cri_shim.config.units import parse_duration, parse_size

_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("logfmt", "json", "text")
# "auto" is resolved when the daemon starts (runtime/cgroup_driver.py): systemd where
# systemd runs the host, cgroupfs elsewhere.
_CGROUP_MANAGERS = ("auto", "cgroupfs", "systemd")


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


def _positive_int(value: object, key: str) -> int:
    number = _expect(value, int, key, "a positive integer")
    if number < 1:
        raise ConfigError(f"{key}: expected a positive integer, got {value!r}")
    return int(number)


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
        _unknown(spec, {"path", "root", "pod_sandbox", "runtime_args"}, prefix + ".")
        handler = RuntimeHandler(
            path=Path(_expect(spec.get("path", name), str, prefix + ".path", "a path"))
        )
        if "root" in spec:
            handler.root = Path(_expect(spec["root"], str, prefix + ".root", "a path"))
        if "runtime_args" in spec:
            handler.runtime_args = _str_list(spec["runtime_args"], prefix + ".runtime_args")
        if "pod_sandbox" in spec:
            handler.pod_sandbox = _expect(
                spec["pod_sandbox"], bool, prefix + ".pod_sandbox", "true or false"
            )
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
    for key in sorted(keys - {"stream_write_timeout", "max_reply_bytes_in_flight"}):
        if key in table:
            setattr(requests, key, _positive_int(table[key], f"requests.{key}"))
    if "max_reply_bytes_in_flight" in table:
        requests.max_reply_bytes_in_flight = parse_size(
            table["max_reply_bytes_in_flight"], "requests.max_reply_bytes_in_flight"
        )
    if "stream_write_timeout" in table:
        timeout = parse_duration(table["stream_write_timeout"], "requests.stream_write_timeout")
        if timeout <= 0:
            raise ConfigError(
                f"requests.stream_write_timeout: must be more than 0, got "
                f"{table['stream_write_timeout']!r}"
            )
        requests.stream_write_timeout = timeout
    return requests


def _load_events(table: dict[str, Any]) -> EventsConfig:
    _unknown(table, {"max_subscribers", "max_backlog_bytes"}, "events.")
    events = EventsConfig()
    if "max_subscribers" in table:
        events.max_subscribers = _positive_int(table["max_subscribers"], "events.max_subscribers")
    if "max_backlog_bytes" in table:
        # Below 64KiB an ordinary pod's few events would drop kubelet's stream.
        events.max_backlog_bytes = parse_size(
            table["max_backlog_bytes"], "events.max_backlog_bytes", minimum=64 << 10
        )
    return events


def _load_metrics(table: dict[str, Any]) -> MetricsConfig:
    _unknown(table, {"listen", "event_loop_sample_interval", "layer_usage_max_age"}, "metrics.")
    metrics = MetricsConfig()
    if "layer_usage_max_age" in table:
        age = parse_duration(table["layer_usage_max_age"], "metrics.layer_usage_max_age")
        if age < 0:
            raise ConfigError(
                "metrics.layer_usage_max_age: must be 0 or more, got "
                f"{table['layer_usage_max_age']!r}"
            )
        metrics.layer_usage_max_age = age
    if "event_loop_sample_interval" in table:
        interval = parse_duration(
            table["event_loop_sample_interval"], "metrics.event_loop_sample_interval"
        )
        if 0 < interval < 0.001:
            raise ConfigError(
                "metrics.event_loop_sample_interval: at least 1ms (or 0 for off), got "
                f"{table['event_loop_sample_interval']!r}"
            )
        metrics.event_loop_sample_interval = interval
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
    if streaming.tls_cert is not None and streaming.tls_key is not None:
        _check_tls(streaming.tls_cert, streaming.tls_key)
    return streaming


def _check_tls(cert: Path, key: Path) -> None:
    """Load the pair now: the streaming server starts with the first Exec, and a bad
    file must stop the daemon's start, not every Exec after it."""
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"streaming.tls_cert: cannot serve TLS with certificate {cert} and key {key}: "
            f"{exc.strerror or exc}"
        ) from None


def _load_cdi(table: dict[str, Any]) -> CdiConfig:
    _unknown(table, {"spec_dirs"}, "cdi.")
    cdi = CdiConfig()
    if "spec_dirs" in table:
        cdi.spec_dirs = [Path(p) for p in _str_list(table["spec_dirs"], "cdi.spec_dirs")]
        for path in cdi.spec_dirs:
            if not path.is_absolute():
                raise ConfigError(f"cdi.spec_dirs: expected absolute paths, got {str(path)!r}")
    return cdi


def _load_nri(table: dict[str, Any]) -> NriConfig:
    _unknown(
        table,
        {
            "enable",
            "socket_path",
            "plugin_registration_timeout",
            "plugin_request_timeout",
            "plugin_path",
            "plugin_config_path",
        },
        "nri.",
    )
    nri = NriConfig()
    if "enable" in table:
        nri.enable = _expect(table["enable"], bool, "nri.enable", "true or false")
    for key in ("socket_path", "plugin_path", "plugin_config_path"):
        if key in table:
            path = Path(_expect(table[key], str, f"nri.{key}", "an absolute path"))
            if not path.is_absolute():
                raise ConfigError(f"nri.{key}: expected an absolute path, got {str(path)!r}")
            setattr(nri, key, path)
    for key in ("plugin_registration_timeout", "plugin_request_timeout"):
        if key in table:
            setattr(nri, key, parse_duration(table[key], f"nri.{key}"))
            if getattr(nri, key) <= 0:
                raise ConfigError(f"nri.{key}: expected a duration above zero")
    return nri


def _load_tracing(table: dict[str, Any]) -> TracingConfig:
    _unknown(
        table,
        {
            "endpoint",
            "sampling_ratio",
            "service_name",
            "max_queued_spans",
            "max_queued_bytes",
            "export_timeout",
        },
        "tracing.",
    )
    tracing = TracingConfig()
    if "endpoint" in table:
        endpoint = _expect(table["endpoint"], str, "tracing.endpoint", "an http(s):// URL")
        if endpoint and not re.match(r"^https?://[^/\s]+(/\S*)?$", endpoint):
            raise ConfigError(
                "tracing.endpoint: expected the OTLP/HTTP base URL of a collector, such as "
                f"http://127.0.0.1:4318, got {endpoint!r}"
            )
        tracing.endpoint = endpoint
    if "sampling_ratio" in table:
        ratio = _expect(table["sampling_ratio"], (int, float), "tracing.sampling_ratio", "0 to 1")
        if not 0 <= ratio <= 1:
            raise ConfigError(f"tracing.sampling_ratio: expected 0 to 1, got {ratio!r}")
        tracing.sampling_ratio = float(ratio)
    if "service_name" in table:
        name = _expect(table["service_name"], str, "tracing.service_name", "a name")
        if not name:
            raise ConfigError("tracing.service_name: expected a name, got an empty string")
        tracing.service_name = name
    if "max_queued_spans" in table:
        tracing.max_queued_spans = _positive_int(
            table["max_queued_spans"], "tracing.max_queued_spans"
        )
    if "max_queued_bytes" in table:
        # Below 64KiB a handful of spans would fill it.
        tracing.max_queued_bytes = parse_size(
            table["max_queued_bytes"], "tracing.max_queued_bytes", minimum=64 << 10
        )
    if "export_timeout" in table:
        tracing.export_timeout = parse_duration(table["export_timeout"], "tracing.export_timeout")
        if tracing.export_timeout <= 0:
            raise ConfigError("tracing.export_timeout: expected a duration above zero")
    if tracing.endpoint:
        _check_tracing_installed()
    return tracing


def _check_tracing_installed() -> None:
    """The exporter is imported when the daemon starts tracing; a missing package must
    stop the start here, with the fix, not later."""
    import importlib.util

    for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ConfigError(
                f"tracing.endpoint: tracing needs {module}, which is not installed "
                "(pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http)"
            )


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
    if "conmon_cgroup" in data:
        cfg.conmon_cgroup = _check_conmon_cgroup(
            _expect(data["conmon_cgroup"], str, "conmon_cgroup", '"pod" or a slice name')
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
        "events": _load_events,
        "cdi": _load_cdi,
        "nri": _load_nri,
        "tracing": _load_tracing,
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


def _check_conmon_cgroup(value: str) -> str:
    """ "", "pod" or a slice's name (`system.slice`, `kubepods-conmon.slice`)."""
    if value in ("", "pod"):
        return value
    stem = value.removesuffix(".slice")
    if (
        not value.endswith(".slice")
        or not re.fullmatch(r"[A-Za-z0-9_.:-]+", stem)
        or stem.startswith("-")
        or stem.endswith("-")
        or "--" in stem
    ):
        raise ConfigError(
            f'conmon_cgroup: expected "pod" or a systemd slice name (like "system.slice"), '
            f"got {value!r}"
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
