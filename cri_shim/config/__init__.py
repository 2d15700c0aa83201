"""The daemon's configuration: the typed model (`model`), loaded and checked from TOML
(`validation`), printed back and documented key by key (`reference`).

Importers take every public name from here, but for `reference`'s: only `cri-shim config`
prints the configuration, so a serving daemon never loads its documentation (1.6 MiB).
"""

from cri_shim.config.model import (
    BUNDLED_CNI_DIR,
    DEFAULT_CONFIG_PATH,
    CdiConfig,
    Config,
    ConfigError,
    CreationConfig,
    EventsConfig,
    ImagesConfig,
    MetricsConfig,
    NetworkConfig,
    RequestsConfig,
    RuntimeConfig,
    RuntimeHandler,
    StreamingSection,
    TracingConfig,
    redact_userinfo,
)
from cri_shim.config.units import format_duration, format_size, parse_duration, parse_size
from cri_shim.config.validation import apply_overrides, config_from_dict, load_config

__all__ = [
    "BUNDLED_CNI_DIR",
    "DEFAULT_CONFIG_PATH",
    "CdiConfig",
    "Config",
    "ConfigError",
    "CreationConfig",
    "EventsConfig",
    "ImagesConfig",
    "MetricsConfig",
    "NetworkConfig",
    "RequestsConfig",
    "RuntimeConfig",
    "RuntimeHandler",
    "StreamingSection",
    "TracingConfig",
    "apply_overrides",
    "config_from_dict",
    "format_duration",
    "format_size",
    "load_config",
    "parse_duration",
    "parse_size",
    "redact_userinfo",
]
