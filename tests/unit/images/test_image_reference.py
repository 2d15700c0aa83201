"""Image reference parsing and normalisation, against docker's own behaviour."""

from __future__ import annotations

import pytest

from cri_shim.errors import InvalidArgument
from cri_shim.images.reference import (
    Reference,
    normalize,
    parse_named,
    parse_reference,
    validate_digest,
)

D = "sha256:" + "a" * 64
D512 = "sha512:" + "b" * 128


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("busybox", "docker.io/library/busybox:latest"),
        ("busybox:1.36", "docker.io/library/busybox:1.36"),
        ("library/busybox", "docker.io/library/busybox:latest"),
        ("docker.io/busybox", "docker.io/library/busybox:latest"),
        ("docker.io/library/busybox:latest", "docker.io/library/busybox:latest"),
        ("index.docker.io/busybox", "docker.io/library/busybox:latest"),
        ("registry-1.docker.io/foo/bar:1", "docker.io/foo/bar:1"),
        ("foo/bar", "docker.io/foo/bar:latest"),
        ("foo/bar/baz:v2", "docker.io/foo/bar/baz:v2"),
        ("quay.io/coreos/etcd", "quay.io/coreos/etcd:latest"),
        ("registry.k8s.io/pause:3.9", "registry.k8s.io/pause:3.9"),
        ("localhost/x", "localhost/x:latest"),
        ("localhost:5000/x:y", "localhost:5000/x:y"),
        ("host:5000/repo", "host:5000/repo:latest"),
        ("host:5000/repo:tag", "host:5000/repo:tag"),
        ("127.0.0.1:5000/a/b:c", "127.0.0.1:5000/a/b:c"),
        ("[::1]:5000/repo:t", "[::1]:5000/repo:t"),
        ("Uppercase/repo", "Uppercase/repo:latest"),  # an upper-case first part is a host
        ("busybox@" + D, "docker.io/library/busybox@" + D),
        ("busybox:1.36@" + D, "docker.io/library/busybox:1.36@" + D),
        ("host:5000/repo@" + D, "host:5000/repo@" + D),
        ("repo@" + D512, "docker.io/library/repo@" + D512),
        ("a_b.c__d-e--f", "docker.io/library/a_b.c__d-e--f:latest"),
        ("busybox:Tag_1.2-3", "docker.io/library/busybox:Tag_1.2-3"),
        ("busybox:_x", "docker.io/library/busybox:_x"),
        ("host:5000", "docker.io/library/host:5000"),  # no '/': the part after ':' is a tag
        ("a" * 63, "docker.io/library/" + "a" * 63 + ":latest"),
        ("0123456789abcdef", "docker.io/library/0123456789abcdef:latest"),
    ],
)
def test_normalises_like_docker(text: str, canonical: str) -> None:
    assert normalize(text) == canonical
    assert parse_reference(text).string() == canonical
    # Normalising is idempotent.
    assert normalize(canonical) == canonical


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        (" busybox", "whitespace"),
        ("busy box", "whitespace"),
        ("BusyBox", "lowercase"),
        ("docker.io/Foo/bar", "lowercase"),
        ("busybox:", "empty tag"),
        ("busybox@", "empty digest"),
        ("busybox:-x", "tag"),
        ("busybox:.x", "tag"),
        ("busybox:" + "t" * 129, "tag"),
        ("busybox:a/b", "registry"),  # "busybox:a" would be a host with a bad port
        ("busybox@sha256:abc", "64"),
        ("busybox@sha256:" + "A" * 64, "64"),
        ("busybox@md5:" + "a" * 32, "unsupported algorithm"),
        ("busybox@nocolon", "expected <algorithm>:<hex>"),
        ("-busybox", "path component"),
        ("busybox-", "path component"),
        ("a//b", "path component"),
        ("a/b/", "path component"),
        ("foo/.bar", "path component"),
        ("a___b", "path component"),
        ("-host.io/x", "registry"),
        ("host.io:port/x", "registry"),
        ("host.io/", "no repository"),
        (":tag", "no repository"),
        ("a" * 64, "image ID"),
        ("x/" + "a" * 260, "longer than 255"),
    ],
)
def test_refuses_invalid_references_saying_why(text: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        parse_reference(text)


def test_fields_name_familiar_and_str() -> None:
    ref = parse_reference("busybox:1.36")
    assert ref == Reference("docker.io", "library/busybox", "1.36", None)
    assert ref.name == "docker.io/library/busybox"
    assert ref.familiar() == "busybox:1.36"
    assert str(ref) == "docker.io/library/busybox:1.36"
    assert parse_reference("foo/bar").familiar() == "foo/bar:latest"
    assert parse_reference("quay.io/a/b@" + D).familiar() == "quay.io/a/b@" + D
    assert parse_reference("localhost/x").familiar() == "localhost/x:latest"


def test_digest_only_reference_gets_no_tag() -> None:
    ref = parse_reference("busybox@" + D)
    assert ref.tag is None
    assert ref.digest == D


def test_tag_and_digest_are_both_kept() -> None:
    ref = parse_reference("busybox:1.36@" + D)
    assert (ref.tag, ref.digest) == ("1.36", D)


def test_parse_named_leaves_a_missing_tag_missing() -> None:
    assert parse_named("busybox").tag is None
    assert parse_named("busybox:1").tag == "1"


def test_with_tag_and_with_digest() -> None:
    ref = parse_reference("busybox")
    assert ref.with_tag("2").string() == "docker.io/library/busybox:2"
    assert parse_reference("busybox@" + D).string() == "docker.io/library/busybox@" + D
    with pytest.raises(InvalidArgument):
        ref.with_tag("bad tag")
    with pytest.raises(InvalidArgument):
        parse_reference("busybox@sha256:short")


@pytest.mark.parametrize("digest", [D, D512, "sha384:" + "c" * 96])
def test_validate_digest_accepts_known_algorithms(digest: str) -> None:
    assert validate_digest(digest) == digest
