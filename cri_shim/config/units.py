"""Durations ("90s", "5m", "250ms") and sizes ("16MiB") as the configuration writes them."""

from __future__ import annotations

import re

from cri_shim.config.model import ConfigError

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


def format_duration(seconds: float) -> str:
    if seconds and seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{round(seconds * 1000)}ms"
