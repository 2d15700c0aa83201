"""NameRegistrar: one name, one object."""

from __future__ import annotations

import pytest

from cri_shim.creation.registrar import NameRegistrar, NameTaken
from cri_shim.errors import AlreadyExists


def test_reserve_then_look_up_both_ways() -> None:
    registrar = NameRegistrar()
    registrar.reserve("k8s_POD_a", "id-a")
    assert registrar.get("k8s_POD_a") == "id-a"
    assert registrar.name_of("id-a") == "k8s_POD_a"
    assert "k8s_POD_a" in registrar
    assert len(registrar) == 1


def test_a_taken_name_names_its_holder() -> None:
    registrar = NameRegistrar()
    registrar.reserve("k8s_POD_a", "id-a")
    with pytest.raises(NameTaken) as caught:
        registrar.reserve("k8s_POD_a", "id-b")
    assert caught.value.holder == "id-a"
    assert "id-a" in str(caught.value)
    assert isinstance(caught.value, AlreadyExists)  # ALREADY_EXISTS if it ever escapes
    assert registrar.get("k8s_POD_a") == "id-a"
    assert registrar.name_of("id-b") is None


def test_reserving_the_same_pair_again_is_harmless() -> None:
    registrar = NameRegistrar()
    registrar.reserve("k8s_POD_a", "id-a")
    registrar.reserve("k8s_POD_a", "id-a")
    assert len(registrar) == 1


def test_one_object_holds_one_name() -> None:
    registrar = NameRegistrar()
    registrar.reserve("k8s_POD_a", "id-a")
    with pytest.raises(ValueError, match="already holds"):
        registrar.reserve("k8s_POD_b", "id-a")
    assert "k8s_POD_b" not in registrar


def test_empty_names_and_ids_are_refused() -> None:
    registrar = NameRegistrar()
    with pytest.raises(ValueError):
        registrar.reserve("", "id-a")
    with pytest.raises(ValueError):
        registrar.reserve("k8s_POD_a", "")


def test_release_frees_the_name_for_another_object_and_is_idempotent() -> None:
    registrar = NameRegistrar()
    registrar.reserve("k8s_POD_a", "id-a")
    registrar.release("k8s_POD_a")
    registrar.release("k8s_POD_a")
    registrar.release("never-reserved")
    assert registrar.get("k8s_POD_a") is None
    assert registrar.name_of("id-a") is None
    registrar.reserve("k8s_POD_a", "id-b")
    assert registrar.get("k8s_POD_a") == "id-b"


def test_names_lists_a_snapshot_oldest_first() -> None:
    registrar = NameRegistrar()
    for n in ("c", "a", "b"):
        registrar.reserve(n, f"id-{n}")
    names = registrar.names()
    registrar.release("a")
    assert names == ["c", "a", "b"]
    assert registrar.names() == ["c", "b"]
    assert len(registrar) == 2
