"""Manifests, indexes and descriptors in both dialects (OCI and Docker schema 2), and the
choice of one platform's manifest from an index. Shared by import and registry pull."""

from __future__ import annotations

import json
import platform as _platform
from dataclasses import dataclass, field
from typing import Any

from cri_shim.errors import InvalidArgument
from cri_shim.images.reference import validate_digest

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"

INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
CONFIG_TYPES = frozenset({OCI_CONFIG, DOCKER_CONFIG})
LAYER_TYPES = frozenset(
    {
        OCI_LAYER,
        OCI_LAYER_GZIP,
        OCI_LAYER_ZSTD,
        DOCKER_LAYER,
        DOCKER_LAYER_GZIP,
        # Non-distributable ("foreign") layers: unpacked like any other when present.
        "application/vnd.oci.image.layer.nondistributable.v1.tar",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
    }
)

REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"
# containerd and docker (25+) put the full image name here; OCI's ref.name is often a tag.
CONTAINERD_NAME_ANNOTATION = "io.containerd.image.name"
# buildkit lists attestation manifests beside the images in an index; they are not images.
_REFERENCE_TYPE_ANNOTATION = "vnd.docker.reference.type"


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str = ""

    def __str__(self) -> str:
        text = f"{self.os}/{self.architecture}"
        return f"{text}/{self.variant}" if self.variant else text


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict)
    platform: Platform | None = None


@dataclass(frozen=True)
class Manifest:
    media_type: str
    config: Descriptor
    layers: list[Descriptor]


_MACHINE_TO_GOARCH = {
    "x86_64": ("amd64", ""),
    "amd64": ("amd64", ""),
    "aarch64": ("arm64", "v8"),
    "arm64": ("arm64", "v8"),
    "armv7l": ("arm", "v7"),
    "armv6l": ("arm", "v6"),
    "i386": ("386", ""),
    "i686": ("386", ""),
    "ppc64le": ("ppc64le", ""),
    "s390x": ("s390x", ""),
    "riscv64": ("riscv64", ""),
}


def host_platform() -> Platform:
    machine = _platform.machine().lower()
    architecture, variant = _MACHINE_TO_GOARCH.get(machine, (machine, ""))
    return Platform("linux", architecture, variant)


def _load_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} is not a JSON object")
    return value


def parse_descriptor(raw: Any, what: str) -> Descriptor:
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{what}: descriptor is not a JSON object")
    digest = raw.get("digest")
    if not isinstance(digest, str):
        raise InvalidArgument(f"{what}: descriptor has no digest")
    validate_digest(digest, f"{what} digest")
    # Required by the OCI spec, and what caps the download: a descriptor without one (or
    # with a negative one) would let a registry send as much as it likes.
    size = raw.get("size")
    if size is None:
        raise InvalidArgument(f"{what}: descriptor {digest} has no size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise InvalidArgument(
            f"{what}: descriptor {digest} has size {size!r}, not a non-negative integer"
        )
    plat = raw.get("platform")
    parsed_platform = None
    if isinstance(plat, dict):
        parsed_platform = Platform(
            str(plat.get("os", "")), str(plat.get("architecture", "")), str(plat.get("variant", ""))
        )
    annotations = raw.get("annotations") or {}
    return Descriptor(
        media_type=str(raw.get("mediaType", "")),
        digest=digest,
        size=size,
        annotations={str(k): str(v) for k, v in annotations.items()},
        platform=parsed_platform,
    )


def media_type_of(data: bytes, what: str) -> str:
    """The document's own mediaType, or a guess from its shape (the field is optional)."""
    doc = _load_json(data, what)
    media_type = doc.get("mediaType")
    if isinstance(media_type, str) and media_type:
        return media_type
    if "manifests" in doc:
        return OCI_INDEX
    if "config" in doc and "layers" in doc:
        return OCI_MANIFEST
    raise InvalidArgument(f"{what} is neither an image manifest nor an index")


def parse_index(data: bytes, what: str = "image index") -> list[Descriptor]:
    doc = _load_json(data, what)
    manifests = doc.get("manifests")
    if not isinstance(manifests, list):
        raise InvalidArgument(f"{what} has no manifests list")
    return [parse_descriptor(m, f"{what} entry {i}") for i, m in enumerate(manifests)]


def parse_manifest(data: bytes, what: str = "image manifest") -> Manifest:
    doc = _load_json(data, what)
    media_type = str(doc.get("mediaType") or OCI_MANIFEST)
    if media_type not in MANIFEST_TYPES:
        raise InvalidArgument(f"{what} has unsupported media type {media_type!r}")
    if doc.get("schemaVersion") != 2:
        raise InvalidArgument(f"{what}: only schema version 2 manifests are supported")
    config = parse_descriptor(doc.get("config"), f"{what} config")
    if config.media_type and config.media_type not in CONFIG_TYPES:
        raise InvalidArgument(
            f"{what} is not a container image: config media type {config.media_type!r}"
        )
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list):
        raise InvalidArgument(f"{what} has no layers list")
    layers = [parse_descriptor(layer, f"{what} layer {i}") for i, layer in enumerate(raw_layers)]
    for layer in layers:
        if layer.media_type not in LAYER_TYPES:
            raise InvalidArgument(
                f"{what}: layer {layer.digest} has unsupported media type {layer.media_type!r}"
            )
    return Manifest(media_type=media_type, config=config, layers=layers)


def is_attestation(descriptor: Descriptor) -> bool:
    return descriptor.annotations.get(_REFERENCE_TYPE_ANNOTATION) == "attestation-manifest"


def platform_matches(candidate: Platform | None, wanted: Platform) -> bool:
    """A descriptor without a platform matches (single-image layouts often omit it)."""
    if candidate is None:
        return True
    if candidate.os != wanted.os or candidate.architecture != wanted.architecture:
        return False
    # arm64 images rarely say v8; arm (32-bit) variants differ in instruction set.
    return not (candidate.variant and wanted.variant and candidate.variant != wanted.variant)


def select_platform(
    descriptors: list[Descriptor], wanted: Platform, what: str = "image index"
) -> Descriptor:
    """The manifest for `wanted` from an index's entries; `InvalidArgument` listing what
    is there when none matches."""
    images = [d for d in descriptors if not is_attestation(d)]
    for descriptor in images:
        if descriptor.platform is not None and platform_matches(descriptor.platform, wanted):
            return descriptor
    untagged = [d for d in images if d.platform is None]
    if len(untagged) == 1:
        return untagged[0]
    available = ", ".join(sorted({str(d.platform) for d in images if d.platform})) or "none"
    raise InvalidArgument(f"{what} has no image for platform {wanted} (available: {available})")
