"""The config contract: defaults, every key, precise errors, TOML round trip."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from cri_shim.cli import main
from cri_shim.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    load_config,
    parse_duration,
)
from cri_shim.config.reference import config_to_toml


def test_defaults_match_the_documented_contract() -> None:
    cfg = Config()
    assert cfg.listen == "unix:///run/cri-shim/cri-shim.sock"
    assert cfg.root == Path("/var/lib/cri-shim")
    assert cfg.run_root == Path("/run/cri-shim")
    assert cfg.cgroup_manager == "auto"
    assert cfg.network.config_dir == Path("/etc/cni/net.d")
    assert cfg.network.bin_dirs == [Path("/usr/lib/cni"), Path("/opt/cni/bin")]
    assert cfg.network.setup_timeout == 300
    assert cfg.creation.claim_grace == 120
    assert cfg.creation.keep_on_timeout is True
    assert cfg.creation.hand_off is True
    assert cfg.runtime.default_handler == "runc"
    assert cfg.cdi.spec_dirs == [Path("/etc/cdi"), Path("/var/run/cdi")]


def test_cdi_spec_dirs_are_absolute_paths() -> None:
    cfg = config_from_dict({"cdi": {"spec_dirs": ["/opt/cdi", "/run/cdi"]}})
    assert cfg.cdi.spec_dirs == [Path("/opt/cdi"), Path("/run/cdi")]
    with pytest.raises(ConfigError, match=r"^cdi\.spec_dirs: expected absolute paths"):
        config_from_dict({"cdi": {"spec_dirs": ["etc/cdi"]}})
    with pytest.raises(ConfigError, match=r"^cdi\.spec_dirs"):
        config_from_dict({"cdi": {"spec_dirs": "/etc/cdi"}})


def test_nri_is_off_unless_enabled() -> None:
    assert not Config().nri.enable
    assert Config().nri.socket_path == Path("/var/run/nri/nri.sock")
    cfg = config_from_dict(
        {"nri": {"enable": True, "socket_path": "/run/n.sock", "plugin_request_timeout": "500ms"}}
    )
    assert (cfg.nri.enable, cfg.nri.socket_path) == (True, Path("/run/n.sock"))
    assert (cfg.nri.plugin_request_timeout, cfg.nri.plugin_registration_timeout) == (0.5, 5.0)
    with pytest.raises(ConfigError, match=r"^nri\.socket_path: expected an absolute path"):
        config_from_dict({"nri": {"socket_path": "nri.sock"}})
    assert (Config().nri.plugin_path, Config().nri.plugin_config_path) == (
        Path("/opt/nri/plugins"),
        Path("/etc/nri/conf.d"),
    )
    cfg = config_from_dict({"nri": {"plugin_path": "/p", "plugin_config_path": "/c"}})
    assert (cfg.nri.plugin_path, cfg.nri.plugin_config_path) == (Path("/p"), Path("/c"))
    with pytest.raises(ConfigError, match=r"^nri\.plugin_path: expected an absolute path"):
        config_from_dict({"nri": {"plugin_path": "plugins"}})
    with pytest.raises(ConfigError, match=r"^nri\.enable"):
        config_from_dict({"nri": {"enable": "yes"}})
    with pytest.raises(ConfigError, match=r"^nri\.plugin_request_timeout"):
        config_from_dict({"nri": {"plugin_request_timeout": "0s"}})
    with pytest.raises(ConfigError, match=r"^nri\.plugin_dir: unknown"):
        config_from_dict({"nri": {"plugin_dir": "/opt/nri"}})


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("90s", 90), ("5m", 300), ("1h", 3600), ("250ms", 0.25), (30, 30), ("1.5s", 1.5)],
)
def test_durations(value: object, seconds: float) -> None:
    assert parse_duration(value, "k") == seconds


@pytest.mark.parametrize("value", ["5 minutes", "-1s", True, "", "m"])
def test_bad_durations_name_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match=r"network\.setup_timeout"):
        config_from_dict({"network": {"setup_timeout": value}})


def test_every_key_is_read() -> None:
    cfg = config_from_dict(
        {
            "listen": "unix:///tmp/x.sock",
            "root": "/tmp/root",
            "run_root": "/tmp/run",
            "log_level": "DEBUG",
            "cgroup_manager": "cgroupfs",
            "network": {"config_dir": "/n", "bin_dirs": ["/b"], "setup_timeout": "90s"},
            "creation": {"claim_grace": "30s", "keep_on_timeout": False, "hand_off": False},
            "runtime": {
                "default_handler": "slow",
                "conmon": "/usr/bin/conmon",
                "handlers": {"slow": {"path": "/usr/local/bin/slow-runc"}},
            },
            "images": {
                "insecure_registries": ["127.0.0.1:5000"],
                "mirrors": {"docker.io": ["http://127.0.0.1:5000"]},
            },
        }
    )
    assert cfg.socket_path == Path("/tmp/x.sock")
    assert cfg.log_level == "debug"
    assert cfg.network.setup_timeout == 90
    assert cfg.creation.keep_on_timeout is False
    assert cfg.creation.hand_off is False
    assert cfg.runtime.handlers["slow"].path == Path("/usr/local/bin/slow-runc")
    assert "runc" in cfg.runtime.handlers
    assert cfg.images.mirrors == {"docker.io": ["http://127.0.0.1:5000"]}


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"lissen": "x"}, "lissen"),
        ({"network": {"confdir": "/x"}}, "network.confdir"),
        ({"runtime": {"handlers": {"x": {"pth": "/y"}}}}, "runtime.handlers.x.pth"),
        ({"cgroup_manager": "openrc"}, "cgroup_manager"),
        ({"root": "relative/dir"}, "root"),
        ({"listen": "tcp://0.0.0.0:1"}, "listen"),
        ({"creation": {"keep_on_timeout": "yes"}}, "creation.keep_on_timeout"),
        ({"creation": {"hand_off": 1}}, "creation.hand_off"),
        ({"runtime": {"default_handler": "kata"}}, "runtime.default_handler"),
        ({"images": {"mirrors": {"docker.io": "http://x"}}}, "images.mirrors.docker.io"),
    ],
)
def test_errors_name_the_key(data: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert str(info.value).startswith(key)


@pytest.mark.parametrize("manager", ["auto", "cgroupfs", "systemd"])
def test_every_cgroup_driver_is_accepted_as_written(manager: str) -> None:
    # Resolved against the host when the daemon starts (runtime/cgroup_driver.py).
    assert config_from_dict({"cgroup_manager": manager}).cgroup_manager == manager


@pytest.mark.parametrize("value", ["", "pod", "system.slice", "kubepods-conmon.slice"])
def test_conmon_cgroup_takes_pod_or_a_slice(value: str) -> None:
    assert config_from_dict({"conmon_cgroup": value}).conmon_cgroup == value


@pytest.mark.parametrize(
    "value", ["/system.slice", "system", "-a.slice", "a--b.slice", "a b.slice"]
)
def test_conmon_cgroup_refuses_what_is_no_slice(value: str) -> None:
    with pytest.raises(ConfigError, match=r'^conmon_cgroup: expected "pod" or a systemd slice'):
        config_from_dict({"conmon_cgroup": value})


def test_printed_config_loads_back_to_the_same(tmp_path: Path) -> None:
    cfg = config_from_dict(
        {"creation": {"claim_grace": "90s"}, "images": {"mirrors": {"a": ["b"]}}}
    )
    text = config_to_toml(cfg)
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load_config(path) == cfg
    assert tomllib.loads(text)["creation"]["claim_grace"] == "90s"


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('root = "/from/file"\nlog_level = "debug"\n')
    cfg = apply_overrides(load_config(path), root="/from/flag", log_level=None)
    assert cfg.root == Path("/from/flag")
    assert cfg.log_level == "debug"


def test_missing_or_broken_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("root = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_cli_config_prints_toml_and_refuses_bad_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "--root", "/srv/cri"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["root"] == "/srv/cri"
    bad = tmp_path / "bad.toml"
    bad.write_text("[network]\nsetup_timout = '1m'\n")
    assert main(["config", "--config", str(bad)]) == 2
    assert "network.setup_timout" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["logfmt", "json", "text", "JSON"])
def test_log_format_is_read(value: str) -> None:
    assert Config().log_format == "logfmt"
    assert config_from_dict({"log_format": value}).log_format == value.lower()


@pytest.mark.parametrize("value", ["xml", "", 1, True])
def test_bad_log_format_names_the_key_and_the_choices(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^log_format: expected one of logfmt, json, text"):
        config_from_dict({"log_format": value})


def test_log_format_flag_wins_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('log_format = "text"\n')
    assert apply_overrides(load_config(path), log_format="json").log_format == "json"
    with pytest.raises(ConfigError, match="log_format"):
        apply_overrides(load_config(path), log_format="yaml")


@pytest.mark.parametrize("value", ["", "127.0.0.1:9090", "[::1]:9090", ":9090", "node1:0"])
def test_metrics_listen_accepts_host_port(value: str) -> None:
    assert config_from_dict({"metrics": {"listen": value}}).metrics.listen == value


@pytest.mark.parametrize("value", ["9090", "127.0.0.1", "127.0.0.1:99999", "http://x:1", "a b:1"])
def test_metrics_listen_rejects_what_is_not_host_port(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^metrics.listen: expected host:port"):
        config_from_dict({"metrics": {"listen": value}})


def test_the_event_loop_sample_interval_is_a_duration_of_a_millisecond_or_more() -> None:
    assert config_from_dict({}).metrics.event_loop_sample_interval == 0.1
    config = config_from_dict({"metrics": {"event_loop_sample_interval": "5ms"}})
    assert config.metrics.event_loop_sample_interval == 0.005
    assert (
        config_from_dict(
            {"metrics": {"event_loop_sample_interval": 0}}
        ).metrics.event_loop_sample_interval
        == 0
    )
    with pytest.raises(ConfigError, match=r"^metrics.event_loop_sample_interval: at least 1ms"):
        config_from_dict({"metrics": {"event_loop_sample_interval": "0.5ms"}})
