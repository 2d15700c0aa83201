"""Pod user namespace mappings: what is accepted, what is refused and how, and what the
spec and the handler features make of them (the integration tests run them for real)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from runtime_spec_inputs import container_config

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition, InvalidArgument
from cri_shim.host.idmap import IdRange, UserNamespaceMappings
from cri_shim.runtime.features import (
    HandlerFeatures,
    features_from_json,
    require_pod_features,
    user_namespaces_allowed,
)
from cri_shim.runtime.spec import SandboxContext
from cri_shim.runtime.userns import pod_mappings, require_searchable

SpecOf = Callable[..., dict[str, Any]]
BASE = 65536 * 7


def _pod(
    uids: list[tuple[int, int, int]] | None = None,
    gids: list[tuple[int, int, int]] | None = None,
    mode: int = api_pb2.POD,
    **namespaces: int,
) -> api_pb2.PodSandboxConfig:
    default = [(0, BASE, 65536)]

    def mappings(raw: list[tuple[int, int, int]] | None) -> list[api_pb2.IDMapping]:
        return [
            api_pb2.IDMapping(container_id=c, host_id=h, length=n)
            for c, h, n in (default if raw is None else raw)
        ]

    options = api_pb2.NamespaceOption(
        userns_options=api_pb2.UserNamespace(mode=mode, uids=mappings(uids), gids=mappings(gids)),
        pid=namespaces.pop("pid", api_pb2.CONTAINER),
        **namespaces,
    )
    config = api_pb2.PodSandboxConfig()
    config.linux.security_context.namespace_options.CopyFrom(options)
    return config


def test_no_userns_options_or_node_mode_means_the_hosts() -> None:
    assert pod_mappings(api_pb2.PodSandboxConfig()) is None
    assert pod_mappings(_pod(uids=[], gids=[], mode=api_pb2.NODE)) is None


def test_pod_mode_gives_the_mappings_and_the_map_file_text() -> None:
    mappings = pod_mappings(_pod(gids=[(0, BASE, 1000), (1000, BASE + 5000, 64536)]))
    assert mappings is not None
    assert mappings.map_text("uid") == f"0 {BASE} 65536\n"
    assert mappings.map_text("gid") == f"0 {BASE} 1000\n1000 {BASE + 5000} 64536\n"
    assert mappings.host_gid(999) == BASE + 999
    assert mappings.host_gid(1000) == BASE + 5000
    assert mappings.host_uid(65536) is None


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (_pod(uids=[]), r"uids: mode POD needs at least one mapping"),
        (_pod(gids=[(0, BASE, 0)]), r"gids\[0\].length: must be at least 1"),
        (_pod(uids=[(0, 0, 65536)]), r"uids\[0\].host_id: 0 would give the pod the host's root"),
        (_pod(uids=[(1, BASE, 10)]), r"uids: container id 0 .* must be mapped"),
        (
            _pod(uids=[(0, BASE, 100), (50, BASE + 1000, 100)]),
            r"uids\[1\]: overlaps another mapping's container_ids",
        ),
        (
            _pod(gids=[(0, BASE, 100), (100, BASE + 50, 100)]),
            r"gids\[1\]: overlaps another mapping's host_ids",
        ),
        (_pod(uids=[(0, 2**32 - 10, 65536)]), r"uids\[0\]: the range runs past the largest id"),
        (_pod(uids=[(i, BASE + i, 1) for i in range(341)]), r"341 mappings; the kernel takes 340"),
        (_pod(mode=api_pb2.NODE), r"uids and gids are only for mode POD"),
        (_pod(mode=api_pb2.CONTAINER), r"mode: CONTAINER is not a user namespace mode"),
        (_pod(network=api_pb2.NODE), r"cannot use the host's network namespace"),
        (_pod(pid=api_pb2.NODE), r"cannot use the host's pid namespace"),
        (_pod(ipc=api_pb2.NODE), r"cannot use the host's ipc namespace"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field(
    config: api_pb2.PodSandboxConfig, words: str
) -> None:
    with pytest.raises(InvalidArgument, match=words):
        pod_mappings(config)


@given(
    st.lists(
        st.tuples(st.integers(0, 2**20), st.integers(1, 2**20), st.integers(1, 2**16)),
        min_size=1,
        max_size=6,
    )
)
def test_accepted_mappings_never_overlap_and_always_map_root(
    raw: list[tuple[int, int, int]],
) -> None:
    try:
        mappings = pod_mappings(_pod(uids=raw))
    except InvalidArgument:
        return
    assert mappings is not None
    assert mappings.host_uid(0) is not None
    seen: set[int] = set()
    for r in mappings.uids:
        # each host id is given to at most one container id
        span = set(range(r.host_id, r.host_id + min(r.size, 64)))
        assert not span & seen
        seen |= span


def test_the_spec_joins_the_pods_user_namespace_with_its_mappings(spec_of: SpecOf) -> None:
    mappings = UserNamespaceMappings((IdRange(0, BASE, 65536),), (IdRange(0, BASE, 65536),))
    sandbox = SandboxContext(
        pod_id="p", userns_path=Path("/run/cri-shim/userns/p"), userns=mappings
    )
    spec = spec_of(sandbox=sandbox)
    assert {"type": "user", "path": "/run/cri-shim/userns/p"} in spec["linux"]["namespaces"]
    assert spec["linux"]["uidMappings"] == [{"containerID": 0, "hostID": BASE, "size": 65536}]
    assert spec["linux"]["gidMappings"] == spec["linux"]["uidMappings"]
    # Without one, no user namespace and no mappings.
    plain = spec_of(sandbox=SandboxContext(pod_id="p"))
    assert all(ns["type"] != "user" for ns in plain["linux"]["namespaces"])
    assert "uidMappings" not in plain["linux"]


def test_a_user_outside_the_mappings_is_refused(spec_of: SpecOf) -> None:
    mappings = UserNamespaceMappings((IdRange(0, BASE, 1000),), (IdRange(0, BASE, 1000),))
    sandbox = SandboxContext(pod_id="p", userns_path=Path("/u"), userns=mappings)
    cfg = container_config()
    cfg.linux.security_context.run_as_user.value = 1000
    with pytest.raises(InvalidArgument, match="uid 1000 is outside the pod's user namespace"):
        spec_of(cfg, sandbox=sandbox)
    cfg.linux.security_context.run_as_user.value = 999
    cfg.linux.security_context.run_as_group.value = 5000
    with pytest.raises(InvalidArgument, match="gid 5000 is outside"):
        spec_of(cfg, sandbox=sandbox)


def test_user_namespaces_are_a_feature_when_runtime_and_kernel_have_them() -> None:
    listed = json.dumps({"linux": {"namespaces": ["mount", "user", "network"]}})
    assert features_from_json(listed, (6, 3)).user_namespaces
    assert not features_from_json(listed, (6, 2)).user_namespaces
    assert not features_from_json(
        json.dumps({"linux": {"namespaces": ["mount"]}}), (6, 18)
    ).user_namespaces


def test_user_namespaces_turned_off_by_the_sysctl_are_no_feature(tmp_path: Path) -> None:
    limit = tmp_path / "max_user_namespaces"
    limit.write_text("0\n")
    assert not user_namespaces_allowed(limit)
    limit.write_text("96364\n")
    assert user_namespaces_allowed(limit)
    assert not user_namespaces_allowed(tmp_path / "missing")


def test_a_handler_without_user_namespaces_refuses_the_pod() -> None:
    with pytest.raises(InvalidArgument, match="not supported by runtime handler 'crun'"):
        require_pod_features(pod_mappings(_pod()), "crun", HandlerFeatures())
    require_pod_features(pod_mappings(_pod()), "runc", HandlerFeatures(user_namespaces=True))
    require_pod_features(None, "crun", HandlerFeatures())


def test_a_state_root_others_cannot_search_is_named(short_tmp: Path) -> None:
    private = short_tmp / "private"
    (private / "root").mkdir(parents=True)
    private.chmod(0o700)
    with pytest.raises(FailedPrecondition, match=r"chmod o\+x .*private"):
        require_searchable(private / "root")
    private.chmod(0o711)
    require_searchable(private / "root")
