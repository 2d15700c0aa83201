"""The CRI names kubelet's retries are matched by."""

from __future__ import annotations

import pytest

from cri_shim.creation.names import container_name, sandbox_name
from cri_shim.errors import InvalidArgument


def test_sandbox_name_has_the_format_every_runtime_prints() -> None:
    assert (
        sandbox_name("nginx", "default", "0f1e2d3c-uid", 2)
        == "k8s_POD_nginx_default_0f1e2d3c-uid_2"
    )


def test_container_name_has_the_format_every_runtime_prints() -> None:
    assert (
        container_name("web", "nginx", "default", "0f1e2d3c-uid", 0)
        == "k8s_web_nginx_default_0f1e2d3c-uid_0"
    )


def test_the_same_metadata_always_gives_the_same_key() -> None:
    # A retry must land on the reservation of the request it retries.
    assert sandbox_name("p", "ns", "u", 1) == sandbox_name("p", "ns", "u", 1)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (("p", "ns", "u", 0), ("p", "ns", "u", 1)),  # a new attempt is a new sandbox
        (("p", "ns", "u", 0), ("p", "ns", "v", 0)),  # a recreated pod has a new uid
        (("p", "ns", "u", 0), ("p", "other", "u", 0)),
    ],
)
def test_any_metadata_change_gives_another_key(
    first: tuple[str, str, str, int], second: tuple[str, str, str, int]
) -> None:
    assert sandbox_name(*first) != sandbox_name(*second)


def test_a_container_never_shares_a_key_with_its_sandbox() -> None:
    assert container_name("POD2", "p", "ns", "u", 0) != sandbox_name("p", "ns", "u", 0)
    assert container_name("web", "p", "ns", "u", 0) != sandbox_name("p", "ns", "u", 0)


def test_empty_names_and_negative_attempts_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="pod name"):
        sandbox_name("", "ns", "u", 0)
    with pytest.raises(InvalidArgument, match="container name"):
        container_name("", "p", "ns", "u", 0)
    with pytest.raises(InvalidArgument, match="attempt"):
        sandbox_name("p", "ns", "u", -1)
