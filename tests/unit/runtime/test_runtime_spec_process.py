"""build_spec: the process (command, env, cwd, user, capabilities, limits, tty)."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from runtime_spec_inputs import container_config

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.runtime.capabilities import ALL_CAPABILITIES, DEFAULT_CAPABILITIES
from cri_shim.runtime.host_limits import HostLimits
from cri_shim.runtime.spec import (
    ImageConfigView,
    SandboxContext,
    resolve_stop_signal,
)

SpecOf = Callable[..., dict[str, Any]]


# ---- command and args -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "args", "entrypoint", "cmd", "expected"),
    [
        # neither: the image's entrypoint + cmd
        ([], [], ["/ep"], ["c1", "c2"], ["/ep", "c1", "c2"]),
        ([], [], [], ["/bin/sh", "-c", "x"], ["/bin/sh", "-c", "x"]),
        # args alone replace cmd, the entrypoint stays
        ([], ["a1"], ["/ep"], ["c1"], ["/ep", "a1"]),
        ([], ["/bin/true"], [], ["c1"], ["/bin/true"]),
        # command replaces the entrypoint AND drops the image's cmd
        (["/cmd"], [], ["/ep"], ["c1"], ["/cmd"]),
        (["/cmd"], ["a1", "a2"], ["/ep"], ["c1"], ["/cmd", "a1", "a2"]),
    ],
)
def test_command_merging_follows_kubelet(
    spec_of: SpecOf,
    command: list[str],
    args: list[str],
    entrypoint: list[str],
    cmd: list[str],
    expected: list[str],
) -> None:
    cfg = container_config(command=command, args=args)
    image = ImageConfigView(entrypoint=tuple(entrypoint), cmd=tuple(cmd))
    assert spec_of(cfg, image=image)["process"]["args"] == expected


def test_nothing_to_run_is_invalid(spec_of: SpecOf) -> None:
    cfg = container_config(command=[], args=[])
    with pytest.raises(InvalidArgument, match="command"):
        spec_of(cfg, image=ImageConfigView())


# ---- env ------------------------------------------------------------------------------


def _env(spec: dict[str, Any]) -> dict[str, str]:
    return dict(entry.split("=", 1) for entry in spec["process"]["env"])


def test_request_env_overrides_image_env(spec_of: SpecOf) -> None:
    cfg = container_config(
        envs=[api_pb2.KeyValue(key="B", value=b"from-cri"), api_pb2.KeyValue(key="C", value=b"3")]
    )
    image = ImageConfigView(env=("A=1", "B=from-image", "PATH=/image/bin", "EMPTY="))
    spec = spec_of(cfg, image=image)
    env = _env(spec)
    assert env["A"] == "1"
    assert env["B"] == "from-cri"
    assert env["C"] == "3"
    assert env["EMPTY"] == ""
    assert env["PATH"] == "/image/bin"
    # An overridden key keeps its place: image order first, then new request keys.
    keys = [entry.split("=", 1)[0] for entry in spec["process"]["env"]]
    assert keys.index("A") < keys.index("B") < keys.index("C")


def test_env_defaults_only_when_unset(spec_of: SpecOf) -> None:
    cfg = container_config(tty=True)
    cfg.linux.security_context.run_as_username = "app"
    env = _env(spec_of(cfg, sandbox=SandboxContext(pod_id="p", hostname="web-0")))
    assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert env["HOME"] == "/home/app"  # from the image's passwd entry
    assert env["TERM"] == "xterm"
    assert env["HOSTNAME"] == "web-0"
    image = ImageConfigView(env=("HOME=/custom", "TERM=dumb"))
    env = _env(spec_of(cfg, image=image))
    assert env["HOME"] == "/custom" and env["TERM"] == "dumb"
    assert "TERM" not in _env(spec_of(container_config()))


def test_env_value_is_bytes_and_need_not_be_utf8(spec_of: SpecOf) -> None:
    # CRI 1.36 carries env values as bytes; config.json can only hold text.
    cfg = container_config(
        envs=[
            api_pb2.KeyValue(key="BIN", value=b"a\xffb"),
            api_pb2.KeyValue(key="U", value="é".encode()),
        ]
    )
    env = _env(spec_of(cfg))
    assert env["BIN"] == "a\ufffdb"
    assert env["U"] == "é"


@pytest.mark.parametrize("key", ["", "A=B"])
def test_bad_env_key_is_invalid(spec_of: SpecOf, key: str) -> None:
    cfg = container_config(envs=[api_pb2.KeyValue(key=key, value=b"v")])
    with pytest.raises(InvalidArgument, match=r"envs\[0\]\.key"):
        spec_of(cfg)


# ---- working dir ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cri", "image", "expected"),
    [("/work", "/img", "/work"), ("", "/img", "/img"), ("", "", "/")],
)
def test_working_dir(spec_of: SpecOf, cri: str, image: str, expected: str) -> None:
    spec = spec_of(container_config(working_dir=cri), image=ImageConfigView(working_dir=image))
    assert spec["process"]["cwd"] == expected


def test_relative_working_dir_is_invalid(spec_of: SpecOf) -> None:
    with pytest.raises(InvalidArgument, match="working_dir"):
        spec_of(container_config(working_dir="relative/dir"))


# ---- user -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("run_as_user", "username", "run_as_group", "image_user", "uid", "gid", "extra"),
    [
        (None, "", None, "", 0, 0, []),  # root by default
        (1000, "", None, "", 1000, 1001, [29, 44]),  # uid known in passwd: its group
        (4242, "", None, "", 4242, 0, []),  # uid not in passwd: group 0
        (None, "app", None, "", 1000, 1001, [29, 44]),
        (None, "daemon", None, "", 1, 1, [29]),
        (None, "", None, "app", 1000, 1001, [29, 44]),  # image "name"
        (None, "", None, "1000", 1000, 1001, [29, 44]),  # image "uid"
        (None, "", None, "1000:50", 1000, 50, [29, 44]),  # image "uid:gid"
        (None, "", None, "app:staff", 1000, 50, [29, 44]),  # image "name:group"
        (None, "", 50, "app", 1000, 50, [29, 44]),  # run_as_group overrides
        (1000, "", None, "daemon", 1000, 1001, [29, 44]),  # run_as_user beats the image
        (None, "app", None, "daemon", 1000, 1001, [29, 44]),  # so does run_as_username
    ],
)
def test_user_resolution(
    spec_of: SpecOf,
    run_as_user: int | None,
    username: str,
    run_as_group: int | None,
    image_user: str,
    uid: int,
    gid: int,
    extra: list[int],
) -> None:
    cfg = container_config()
    sc = cfg.linux.security_context
    if run_as_user is not None:
        sc.run_as_user.value = run_as_user
    if run_as_group is not None:
        sc.run_as_group.value = run_as_group
    sc.run_as_username = username
    user = spec_of(cfg, image=ImageConfigView(user=image_user))["process"]["user"]
    assert (user["uid"], user["gid"]) == (uid, gid)
    # Additional groups are the image's /etc/group memberships (as runc computes them);
    # the passwd entry's own group is not added when the group is overridden.
    assert user.get("additionalGids", []) == extra


def test_supplemental_groups_from_pod_and_container_are_added_once(spec_of: SpecOf) -> None:
    cfg = container_config()
    cfg.linux.security_context.run_as_username = "app"
    cfg.linux.security_context.supplemental_groups.extend([2000, 29])
    sandbox = SandboxContext(pod_id="p", supplemental_groups=(3000, 2000))
    user = spec_of(cfg, sandbox=sandbox)["process"]["user"]
    assert user["additionalGids"] == [29, 44, 3000, 2000]


@pytest.mark.parametrize(
    ("image_user", "username", "message"),
    [
        ("ghost", "", "image user.*ghost"),
        ("", "ghost", "run_as_username.*ghost"),
        ("app:nogroup", "", "group 'nogroup'"),
    ],
)
def test_unknown_names_are_invalid(
    spec_of: SpecOf, image_user: str, username: str, message: str
) -> None:
    cfg = container_config()
    cfg.linux.security_context.run_as_username = username
    with pytest.raises(InvalidArgument, match=message):
        spec_of(cfg, image=ImageConfigView(user=image_user))


def test_passwd_symlink_is_resolved_inside_the_rootfs(spec_of: SpecOf, rootfs: Path) -> None:
    # An image whose /etc/passwd points at an absolute path must read its own file at
    # that path, never the host's.
    (rootfs / "real").mkdir()
    (rootfs / "real" / "passwd").write_text("svc:x:777:778::/srv:/bin/sh\n")
    (rootfs / "etc" / "passwd").unlink()
    (rootfs / "etc" / "passwd").symlink_to("/../../real/passwd")
    user = spec_of(image=ImageConfigView(user="svc"))["process"]["user"]
    assert (user["uid"], user["gid"]) == (777, 778)
    (rootfs / "etc" / "passwd").unlink()
    (rootfs / "etc" / "passwd").symlink_to("/etc/../../../../etc/shadow-not-here")
    with pytest.raises(InvalidArgument, match="svc"):
        spec_of(image=ImageConfigView(user="svc"))


def test_read_etc_callable_is_used_instead_of_the_rootfs(spec_of: SpecOf) -> None:
    files = {"/etc/passwd": "other:x:5:6::/:/bin/sh\n"}
    user = spec_of(image=ImageConfigView(user="other", read_etc=files.get))["process"]["user"]
    assert (user["uid"], user["gid"]) == (5, 6)


# ---- capabilities ---------------------------------------------------------------------

BOUNDED_ALL = [c for c in ALL_CAPABILITIES if c != "CAP_SYS_RESOURCE"]


@pytest.mark.parametrize(
    ("add", "drop", "expected"),
    [
        ([], [], list(DEFAULT_CAPABILITIES)),
        (["NET_ADMIN"], [], [*DEFAULT_CAPABILITIES, "CAP_NET_ADMIN"]),
        (
            ["cap_net_raw"],
            ["KILL"],
            [c for c in DEFAULT_CAPABILITIES if c != "CAP_KILL"] + ["CAP_NET_RAW"],
        ),
        ([], ["ALL"], []),
        (["NET_BIND_SERVICE"], ["ALL"], ["CAP_NET_BIND_SERVICE"]),
        (["NET_ADMIN"], ["NET_ADMIN"], list(DEFAULT_CAPABILITIES)),  # drop wins
        (["ALL"], [], BOUNDED_ALL),
        (["ALL"], ["SYS_ADMIN"], [c for c in BOUNDED_ALL if c != "CAP_SYS_ADMIN"]),
        (["SYS_RESOURCE"], [], list(DEFAULT_CAPABILITIES)),  # not in the bounding set
    ],
)
def test_capabilities_add_and_drop(
    spec_of: SpecOf, add: list[str], drop: list[str], expected: list[str]
) -> None:
    cfg = container_config()
    cfg.linux.security_context.capabilities.add_capabilities.extend(add)
    cfg.linux.security_context.capabilities.drop_capabilities.extend(drop)
    caps = spec_of(cfg)["process"]["capabilities"]
    assert sorted(caps["bounding"]) == sorted(expected)
    assert caps["effective"] == caps["permitted"] == caps["bounding"]
    assert caps["inheritable"] == [] and caps["ambient"] == []


def test_privileged_gets_the_whole_bounding_set_and_logs_what_is_missing(
    spec_of: SpecOf, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = container_config()
    cfg.linux.security_context.privileged = True
    cfg.linux.security_context.capabilities.drop_capabilities.append("ALL")  # ignored
    with caplog.at_level(logging.WARNING):
        spec = spec_of(cfg, sandbox=SandboxContext(pod_id="p", privileged=True))
    assert sorted(spec["process"]["capabilities"]["bounding"]) == sorted(BOUNDED_ALL)
    assert "CAP_SYS_RESOURCE" in caplog.text


def test_privileged_container_needs_a_privileged_pod(spec_of: SpecOf) -> None:
    cfg = container_config()
    cfg.linux.security_context.privileged = True
    with pytest.raises(InvalidArgument, match="privileged pod"):
        spec_of(cfg)


def test_ambient_capabilities_are_also_inheritable(spec_of: SpecOf) -> None:
    cfg = container_config()
    cfg.linux.security_context.capabilities.add_ambient_capabilities.append("NET_ADMIN")
    caps = spec_of(cfg)["process"]["capabilities"]
    assert caps["ambient"] == caps["inheritable"] == ["CAP_NET_ADMIN"]
    assert "CAP_NET_ADMIN" in caps["permitted"]


@pytest.mark.parametrize("field", ["add_capabilities", "drop_capabilities"])
def test_unknown_capability_is_invalid(spec_of: SpecOf, field: str) -> None:
    cfg = container_config()
    getattr(cfg.linux.security_context.capabilities, field).append("MAKE_COFFEE")
    with pytest.raises(InvalidArgument, match=f"{field}.*MAKE_COFFEE"):
        spec_of(cfg)


# ---- limits, flags, tty ---------------------------------------------------------------


@pytest.mark.parametrize(("hard", "expected"), [(20000, 20000), (4_000_000, 1_048_576)])
def test_nofile_is_clamped_to_the_daemons_hard_limit(
    spec_of: SpecOf, host: HostLimits, hard: int, expected: int
) -> None:
    limits = HostLimits(**{**host.__dict__, "nofile_hard": hard})
    rlimits = spec_of(host=limits)["process"]["rlimits"]
    assert rlimits == [{"type": "RLIMIT_NOFILE", "hard": expected, "soft": expected}]


@pytest.mark.parametrize(
    ("daemon", "requested", "expected"),
    [(0, -997, 0), (0, 1000, 1000), (-500, -997, -500), (-500, -100, -100), (200, 0, 200)],
)
def test_oom_score_adj_never_below_the_daemons(
    spec_of: SpecOf, host: HostLimits, daemon: int, requested: int, expected: int
) -> None:
    cfg = container_config()
    cfg.linux.resources.oom_score_adj = requested
    limits = HostLimits(**{**host.__dict__, "oom_score_adj": daemon})
    assert spec_of(cfg, host=limits)["process"]["oomScoreAdj"] == expected


def test_flags_reach_the_spec(spec_of: SpecOf, rootfs: Path) -> None:
    cfg = container_config(tty=True)
    cfg.linux.security_context.readonly_rootfs = True
    cfg.linux.security_context.no_new_privs = True
    spec = spec_of(cfg)
    assert spec["process"]["terminal"] is True
    assert spec["process"]["noNewPrivileges"] is True
    assert spec["root"] == {"path": str(rootfs), "readonly": True}
    plain = spec_of()
    assert plain["process"]["terminal"] is False
    assert plain["process"]["noNewPrivileges"] is False
    assert plain["root"]["readonly"] is False
    assert plain["ociVersion"] == "1.0.2"
    assert "apparmorProfile" not in plain["process"]


def test_named_apparmor_profile_is_refused(spec_of: SpecOf) -> None:
    cfg = container_config()
    cfg.linux.security_context.apparmor.profile_type = api_pb2.SecurityProfile.Localhost
    cfg.linux.security_context.apparmor.localhost_ref = "my-profile"
    with pytest.raises(InvalidArgument, match="apparmor"):
        spec_of(cfg)


@pytest.mark.parametrize(
    ("cri", "image", "expected"),
    [
        (api_pb2.RUNTIME_DEFAULT, "", signal.SIGTERM),
        (api_pb2.RUNTIME_DEFAULT, "SIGQUIT", signal.SIGQUIT),
        (api_pb2.RUNTIME_DEFAULT, "int", signal.SIGINT),
        (api_pb2.RUNTIME_DEFAULT, "9", 9),
        (api_pb2.RUNTIME_DEFAULT, "SIGRTMIN+3", signal.SIGRTMIN + 3),
        (api_pb2.SIGUSR1, "SIGQUIT", signal.SIGUSR1),
        (api_pb2.SIGRTMINPLUS2, "", signal.SIGRTMIN + 2),
    ],
)
def test_stop_signal(cri: int, image: str, expected: int) -> None:
    cfg = container_config(stop_signal=cri)
    assert resolve_stop_signal(cfg, ImageConfigView(stop_signal=image)) == int(expected)


def test_unknown_stop_signal_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="StopSignal"):
        resolve_stop_signal(container_config(), ImageConfigView(stop_signal="SIGNOPE"))


def test_probe_reads_this_host() -> None:
    limits = HostLimits.probe()
    with open("/proc/self/oom_score_adj") as handle:
        assert limits.oom_score_adj == int(handle.read())
    assert "CAP_CHOWN" in limits.capability_bounding_set or os.geteuid() != 0


@pytest.mark.parametrize("image", ["0", "99999", "65", "SIGRTMAX+1", "SIGRTMIN-1", "SIGFOO"])
def test_a_stop_signal_that_cannot_be_sent_is_invalid(image: str) -> None:
    with pytest.raises(InvalidArgument, match="image config StopSignal"):
        resolve_stop_signal(container_config(), ImageConfigView(stop_signal=image))
