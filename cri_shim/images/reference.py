"""Image references: parsing and normalisation, as docker and the CRI ecosystem do it.

Grammar (docker/distribution `reference`):

    reference  := name [ ":" tag ] [ "@" digest ]
    name       := [domain "/"] path-component ["/" path-component]*
    domain     := host [":" port]            host: DNS name or "[" IPv6 "]"
    path-comp. := [a-z0-9]+ (separator [a-z0-9]+)*    separator: "." | "_" | "__" | "-"+
    tag        := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
    digest     := algorithm ":" hex

Normalisation follows docker's "familiar" names: the first path component is a domain only
when it contains "." or ":", is "localhost", or has an upper-case letter; otherwise the
domain is docker.io, and a single-component docker.io path gets "library/". A name with
neither tag nor digest gets ":latest".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cri_shim.errors import InvalidArgument

DEFAULT_REGISTRY = "docker.io"
DEFAULT_TAG = "latest"
# Older clients wrote these; docker maps them to docker.io and so must we, or a tag recorded
# by one tool would not be found by another.
_LEGACY_REGISTRIES = frozenset({"index.docker.io", "registry-1.docker.io"})
_OFFICIAL_PREFIX = "library/"
# docker/distribution's NameTotalLengthMax.
MAX_NAME_LENGTH = 255

_PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = re.compile(
    rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
)
_TAG = re.compile(r"[\w][\w.-]{0,127}", re.ASCII)
_DIGEST_ALGORITHM = re.compile(r"[a-z][a-z0-9]*(?:[+._-][a-z][a-z0-9]*)*")
# Only registered algorithms are accepted, each with its exact hex length (go-digest rules).
DIGEST_HEX_LENGTHS = {"sha256": 64, "sha384": 96, "sha512": 128}
_HEX = re.compile(r"[a-f0-9]+")
_ID = re.compile(r"[a-f0-9]{64}")


@dataclass(frozen=True)
class Reference:
    """A normalised image reference. `tag` and `digest` may both be set (`repo:tag@sha256:…`);
    then the digest is what identifies the image and the tag is informational."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def name(self) -> str:
        """`registry/repository`, the part a tag or digest is attached to."""
        return f"{self.registry}/{self.repository}"

    def string(self) -> str:
        """The canonical form: `docker.io/library/busybox:latest`."""
        text = self.name
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text

    def familiar(self) -> str:
        """The short form people type: `busybox:latest`, `foo/bar@sha256:…`."""
        name = self.name
        if self.registry == DEFAULT_REGISTRY:
            name = self.repository.removeprefix(_OFFICIAL_PREFIX)
        text = name
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text

    def with_tag(self, tag: str) -> Reference:
        if not _TAG.fullmatch(tag):
            raise InvalidArgument(f"invalid tag {tag!r}: {_TAG_RULE}")
        return Reference(self.registry, self.repository, tag, None)

    def __str__(self) -> str:
        return self.string()


_TAG_RULE = "a tag is 1-128 letters, digits, '_', '.' or '-', not starting with '.' or '-'"


def validate_digest(digest: str, what: str = "digest") -> str:
    """Return `digest` if it is `<algorithm>:<hex>` with a known algorithm, else raise."""
    algorithm, sep, hex_part = digest.partition(":")
    if not sep or not algorithm or not hex_part:
        raise InvalidArgument(f"invalid {what} {digest!r}: expected <algorithm>:<hex>")
    if not _DIGEST_ALGORITHM.fullmatch(algorithm):
        raise InvalidArgument(f"invalid {what} {digest!r}: malformed algorithm {algorithm!r}")
    length = DIGEST_HEX_LENGTHS.get(algorithm)
    if length is None:
        known = ", ".join(DIGEST_HEX_LENGTHS)
        raise InvalidArgument(
            f"invalid {what} {digest!r}: unsupported algorithm {algorithm!r} (known: {known})"
        )
    if not _HEX.fullmatch(hex_part) or len(hex_part) != length:
        raise InvalidArgument(
            f"invalid {what} {digest!r}: {algorithm} needs exactly {length} lower-case hex digits"
        )
    return digest


def parse_named(text: str) -> Reference:
    """Parse and normalise `text`, leaving `tag` None when it names no tag.

    `ListImages` filters need this: `busybox` there means every tag of the repository,
    while `busybox:1.36` means one image.
    """
    if not text:
        raise InvalidArgument("invalid image reference: empty")
    if text != text.strip() or any(c.isspace() for c in text):
        raise InvalidArgument(f"invalid image reference {text!r}: contains whitespace")
    if _ID.fullmatch(text):
        # docker refuses these as names so that they can only mean an image ID.
        raise InvalidArgument(
            f"invalid image reference {text!r}: a 64-hex string is an image ID, not a name"
        )

    remainder, at, digest = text.partition("@")
    if at:
        if not digest:
            raise InvalidArgument(f"invalid image reference {text!r}: empty digest after '@'")
        validate_digest(digest)
    digest_or_none = digest if at else None

    # A tag is a ':' after the last '/', so that `host:5000/repo` is not read as a tag.
    name, tag = remainder, None
    colon = remainder.rfind(":")
    if colon > remainder.rfind("/"):
        name, tag = remainder[:colon], remainder[colon + 1 :]
        if not tag:
            raise InvalidArgument(f"invalid image reference {text!r}: empty tag after ':'")
        if not _TAG.fullmatch(tag):
            raise InvalidArgument(f"invalid image reference {text!r}: tag {tag!r}: {_TAG_RULE}")
    if not name:
        raise InvalidArgument(f"invalid image reference {text!r}: no repository name")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument(
            f"invalid image reference {text[:80]!r}…: the name is longer than "
            f"{MAX_NAME_LENGTH} characters"
        )

    registry, repository = _split_registry(name)
    if not _DOMAIN.fullmatch(registry):
        raise InvalidArgument(f"invalid image reference {text!r}: invalid registry {registry!r}")
    if not repository:
        raise InvalidArgument(f"invalid image reference {text!r}: no repository after registry")
    if repository != repository.lower():
        raise InvalidArgument(
            f"invalid image reference {text!r}: repository name must be lowercase"
        )
    for component in repository.split("/"):
        if not _PATH_COMPONENT.fullmatch(component):
            raise InvalidArgument(
                f"invalid image reference {text!r}: invalid path component {component!r} "
                "(lower-case letters and digits, separated by '.', '_', '__' or '-')"
            )
    return Reference(registry, repository, tag, digest_or_none)


def _split_registry(name: str) -> tuple[str, str]:
    first, slash, rest = name.partition("/")
    is_domain = slash and (
        "." in first or ":" in first or first == "localhost" or first != first.lower()
    )
    if is_domain:
        registry, repository = first, rest
    else:
        registry, repository = DEFAULT_REGISTRY, name
    if registry in _LEGACY_REGISTRIES:
        registry = DEFAULT_REGISTRY
    if registry == DEFAULT_REGISTRY and "/" not in repository:
        repository = _OFFICIAL_PREFIX + repository
    return registry, repository


def parse_reference(text: str) -> Reference:
    """Parse and normalise, adding `:latest` when neither tag nor digest is given."""
    ref = parse_named(text)
    if ref.tag is None and ref.digest is None:
        return Reference(ref.registry, ref.repository, DEFAULT_TAG, None)
    return ref


def normalize(text: str) -> str:
    """`busybox` → `docker.io/library/busybox:latest`."""
    return parse_reference(text).string()
