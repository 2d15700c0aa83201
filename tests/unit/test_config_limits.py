"""The configuration's limits on layers, downloads, messages and requests: defaults, sizes,
bad values named."""

from __future__ import annotations

import grp
import tomllib

import pytest

from cri_shim.config import (
    Config,
    ConfigError,
    config_from_dict,
    format_size,
    parse_size,
)
from cri_shim.config.reference import config_to_toml
from cri_shim.images.policy import UnpackPolicy


def test_defaults() -> None:
    cfg = Config()
    assert cfg.max_message_bytes == 16 << 20
    assert cfg.socket_group == ""
    assert cfg.images.max_layer_bytes == 64 << 30
    assert cfg.images.max_layer_entries == 1_000_000
    assert cfg.images.allow_device_nodes is False
    assert (cfg.requests.max_in_flight, cfg.requests.max_queued) == (32, 256)
    assert cfg.requests.max_reads_in_flight == 1024
    # The unpacker's defaults are the configuration's.
    assert UnpackPolicy() == UnpackPolicy.from_config(cfg.images)


@pytest.mark.parametrize(
    ("value", "size"),
    [(1024, 1024), ("16MiB", 16 << 20), ("64GiB", 64 << 30), ("512KiB", 512 << 10), ("7B", 7)],
)
def test_sizes(value: object, size: int) -> None:
    assert parse_size(value, "k") == size


def test_sizes_print_back_in_units() -> None:
    assert [format_size(s) for s in (16 << 20, 64 << 30, 1 << 40, 1000)] == [
        "16MiB",
        "64GiB",
        "1TiB",
        "1000B",
    ]


def test_every_hardening_key_is_read_and_round_trips() -> None:
    group = grp.getgrgid(0).gr_name
    cfg = config_from_dict(
        {
            "max_message_bytes": "1MiB",
            "socket_group": group,
            "images": {
                "max_layer_bytes": "2GiB",
                "max_layer_entries": 5000,
                "allow_device_nodes": True,
            },
            "requests": {
                "max_in_flight": 4,
                "max_queued": 8,
                "max_reads_in_flight": 16,
                "max_streams_in_flight": 2,
                "stream_write_timeout": "5s",
            },
        }
    )
    assert cfg.max_message_bytes == 1 << 20
    assert cfg.socket_group == group
    assert (cfg.images.max_layer_bytes, cfg.images.max_layer_entries) == (2 << 30, 5000)
    assert cfg.images.allow_device_nodes is True
    assert (cfg.requests.max_in_flight, cfg.requests.max_queued) == (4, 8)
    assert cfg.requests.max_reads_in_flight == 16
    assert (cfg.requests.max_streams_in_flight, cfg.requests.stream_write_timeout) == (2, 5.0)
    printed = tomllib.loads(config_to_toml(cfg))
    assert printed["max_message_bytes"] == "1MiB"
    assert printed["images"]["max_layer_bytes"] == "2GiB"
    assert config_from_dict(printed) == cfg


def test_socket_group_by_number() -> None:
    assert config_from_dict({"socket_group": 0}).socket_group == "0"


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"max_message_bytes": "16 megabytes"}, "max_message_bytes"),
        ({"max_message_bytes": "1KiB"}, "max_message_bytes"),  # below a usable minimum
        ({"max_message_bytes": True}, "max_message_bytes"),
        ({"socket_group": "no-such-group-cri-shim"}, "socket_group"),
        ({"socket_group": ["wheel"]}, "socket_group"),
        ({"images": {"max_layer_bytes": "0B"}}, "images.max_layer_bytes"),
        ({"images": {"max_layer_bytes": -5}}, "images.max_layer_bytes"),
        ({"images": {"max_layer_entries": 0}}, "images.max_layer_entries"),
        ({"images": {"max_layer_entries": "many"}}, "images.max_layer_entries"),
        ({"images": {"allow_device_nodes": "no"}}, "images.allow_device_nodes"),
        ({"requests": {"max_in_flight": 0}}, "requests.max_in_flight"),
        ({"requests": {"max_queued": 1.5}}, "requests.max_queued"),
        ({"requests": {"max_queue": 5}}, "requests.max_queue"),
        ({"requests": {"max_streams_in_flight": 0}}, "requests.max_streams_in_flight"),
        ({"requests": {"stream_write_timeout": "0s"}}, "requests.stream_write_timeout"),
        ({"requests": {"stream_write_timeout": "soon"}}, "requests.stream_write_timeout"),
    ],
)
def test_bad_values_name_the_key(data: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert str(info.value).startswith(key)
