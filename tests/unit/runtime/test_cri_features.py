"""Handler features, AppArmor profile choice and the supplemental groups policy, without
a container (the integration tests run them for real)."""

from __future__ import annotations

import json

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.lifecycle.pause import pause_program
from cri_shim.runtime.features import (
    HandlerFeatures,
    features_from_json,
    kernel_version,
    require_features,
)
from cri_shim.runtime.identity import resolve_identity


def test_rro_is_a_feature_only_when_runtime_and_kernel_both_have_it() -> None:
    listed = json.dumps({"mountOptions": ["ro", "rro", "rbind"]})
    assert features_from_json(listed, (6, 1)).recursive_read_only_mounts
    assert not features_from_json(listed, (5, 11)).recursive_read_only_mounts
    assert not features_from_json(
        json.dumps({"mountOptions": ["ro"]}), (6, 1)
    ).recursive_read_only_mounts
    assert features_from_json("not json", (6, 1)) == HandlerFeatures()


def test_kernel_version_reads_distribution_suffixes() -> None:
    assert kernel_version("6.18.44-fc-v857") == (6, 18)
    assert kernel_version("5.12rc1") == (5, 12)
    assert kernel_version("garbage") == (0, 0)


def test_a_handler_without_rro_refuses_the_mount_by_name() -> None:
    config = api_pb2.ContainerConfig(
        mounts=[api_pb2.Mount(container_path="/a", readonly=True, recursive_read_only=True)]
    )
    with pytest.raises(InvalidArgument, match=r"mounts\[0\].*handler 'crun'"):
        require_features(config, "crun", HandlerFeatures())
    require_features(config, "runc", HandlerFeatures(recursive_read_only_mounts=True))


@pytest.mark.parametrize(("strict", "groups"), [(False, (50000, 4000)), (True, (4000,))])
def test_strict_policy_ignores_the_images_group_memberships(
    strict: bool, groups: tuple[int, ...]
) -> None:
    files = {
        "/etc/passwd": "app:x:1000:1000::/home/app:/bin/sh\n",
        "/etc/group": "app:x:1000:\nextra:x:50000:app\n",
    }
    identity = resolve_identity(
        run_as_user=None,
        run_as_username="app",
        run_as_group=None,
        image_user="",
        supplemental_groups=[4000],
        read_etc=files.get,
        strict_groups=strict,
    )
    assert (identity.uid, identity.gid, identity.additional_gids) == (1000, 1000, groups)


def test_pause_program_is_a_static_x86_64_executable() -> None:
    program = pause_program("x86_64")
    assert program[:4] == b"\x7fELF" and len(program) < 300
    with pytest.raises(InvalidArgument, match="only for x86_64"):
        pause_program("aarch64")
