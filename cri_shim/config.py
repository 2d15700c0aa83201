"""Daemon configuration: typed dataclasses, loaded from TOML, printed back as TOML.

Every key is optional. An unknown key or a value of the wrong kind stops the start with a
message that names the key, so that a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
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
        raise ConfigError(f"{key}: expected a duration such as \"90s\" or \"5m\", got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise ConfigError(f"{key}: expected a duration such as \"90s\" or \"5m\", got {value!r}")
    if seconds < 0:
        raise ConfigError(f"{key}: a duration cannot be negative, got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    if seconds and seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{int(round(seconds * 1000))}ms"


@dataclass
class NetworkConfig:
    config_dir: Path = Path("/etc/cni/net.d")
    bin_dirs: list[Path] = field(default_factory=lambda: [Path("/usr/lib/cni"), Path("/opt/cni/bin")])
    # A minute more than kubelet's longest request, so a slow plugin's work can be reused.
    setup_timeout: float = 300.0
    teardown_timeout: float = 120.0


@dataclass
class CreationConfig:
    claim_grace: float = 120.0
    keep_on_timeout: bool = True
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


@dataclass
class MetricsConfig:
    listen: str = ""


@dataclass
class Config:
    listen: str = "unix:///run/cri-shim/cri-shim.sock"
    root: Path = Path("/var/lib/cri-shim")
    run_root: Path = Path("/run/cri-shim")
    log_level: str = "info"
    cgroup_manager: str = "cgroupfs"
    network: NetworkConfig = field(default_factory=NetworkConfig)
    creation: CreationConfig = field(default_factory=CreationConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def socket_path(self) -> Path:
        return Path(self.listen.removeprefix("unix://"))

    @property
    def state_db(self) -> Path:
        return self.root / "state.db"


_LOG_LEVELS = ("debug", "info", "warning", "error")
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
    _unknown(table, {"claim_grace", "keep_on_timeout", "cleanup_timeout"}, "creation.")
    creation = CreationConfig()
    for key in ("claim_grace", "cleanup_timeout"):
        if key in table:
            setattr(creation, key, parse_duration(table[key], f"creation.{key}"))
    if "keep_on_timeout" in table:
        creation.keep_on_timeout = _expect(
            table["keep_on_timeout"], bool, "creation.keep_on_timeout", "true or false"
        )
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
        handler = RuntimeHandler(path=Path(_expect(spec.get("path", name), str, prefix + ".path", "a path")))
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
    _unknown(table, {"insecure_registries", "mirrors"}, "images.")
    images = ImagesConfig()
    if "insecure_registries" in table:
        images.insecure_registries = _str_list(
            table["insecure_registries"], "images.insecure_registries"
        )
    mirrors = _expect(table.get("mirrors", {}), dict, "images.mirrors", "a table")
    for registry, endpoints in mirrors.items():
        images.mirrors[registry] = _str_list(endpoints, f"images.mirrors.{registry}")
    return images


def _load_metrics(table: dict[str, Any]) -> MetricsConfig:
    _unknown(table, {"listen"}, "metrics.")
    metrics = MetricsConfig()
    if "listen" in table:
        metrics.listen = _expect(table["listen"], str, "metrics.listen", "host:port")
    return metrics


def config_from_dict(data: dict[str, Any]) -> Config:
    top = {"listen", "root", "run_root", "log_level", "cgroup_manager", "network", "creation",
           "runtime", "images", "metrics"}
    _unknown(data, top, "")
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
    if "cgroup_manager" in data:
        cfg.cgroup_manager = _check_choice(data["cgroup_manager"], _CGROUP_MANAGERS, "cgroup_manager")
    sections = {
        "network": _load_network,
        "creation": _load_creation,
        "runtime": _load_runtime,
        "images": _load_images,
        "metrics": _load_metrics,
    }
    for name, loader in sections.items():
        if name in data:
            setattr(cfg, name, loader(_expect(data[name], dict, name, "a table")))
    return cfg


def _check_choice(value: object, choices: tuple[str, ...], key: str) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got {value!r}")
    return value.lower()


def _check_listen(value: str) -> str:
    if not value.startswith("unix://") or not value.removeprefix("unix://").startswith("/"):
        raise ConfigError(f"listen: expected unix:///absolute/path, got {value!r}")
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
        return {f.name: _plain(getattr(value, f.name))
                for f in dataclasses.fields(value) if getattr(value, f.name) is not None}
    return value


_DURATION_KEYS = {
    ("network", "setup_timeout"), ("network", "teardown_timeout"),
    ("creation", "claim_grace"), ("creation", "cleanup_timeout"),
    ("runtime", "stop_timeout_grace"),
}


def config_to_toml(cfg: Config) -> str:
    data = _plain(cfg)
    for section, key in _DURATION_KEYS:
        data[section][key] = format_duration(getattr(getattr(cfg, section), key))
    return tomli_w.dumps(data)
