"""Test images built without a network, from the host's static busybox (busybox-static).

The image has two layers, so that whiteouts and layer order are exercised:

  layer 1  /bin/busybox and a symlink per applet (`busybox --list`), /etc/passwd with
           root and app (1000), /etc/group, /tmp (1777), /home/app (1000:1000), and two
           things for layer 2 to hide: /etc/removed-by-layer2 and /opt/opaque/old
  layer 2  /etc/image-layer2, a whiteout of /etc/removed-by-layer2, and /opt/opaque made
           opaque (so /opt/opaque/old is hidden and /opt/opaque/new is shown)

Everything is deterministic (fixed mtimes, gzip header without a timestamp), so the same
arguments give the same digests in every run and on every machine with the same busybox.

`build_image` returns the blobs, manifest and config (`BuiltImage`) for whoever needs them
(a registry push); `build_oci_layout`, `build_oci_archive` and `build_docker_archive` write
the three import formats. `cached_oci_layout` builds a layout once per directory and
arguments, for session-scoped fixtures.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import platform
import subprocess
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import zstandard

BUSYBOX = Path("/bin/busybox")
DEFAULT_REF_NAME = "docker.io/library/busybox"
DEFAULT_PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EPOCH = 1_700_000_000  # a fixed mtime for every entry (2023-11-14)
PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    "app:x:1000:1000::/home/app:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
GROUP = "root:x:0:\napp:x:1000:\nnogroup:x:65534:\n"

Compression = Literal["gzip", "zstd", "none"]
MediaTypes = Literal["oci", "docker"]

_LAYER_TYPES = {
    ("oci", "gzip"): "application/vnd.oci.image.layer.v1.tar+gzip",
    ("oci", "zstd"): "application/vnd.oci.image.layer.v1.tar+zstd",
    ("oci", "none"): "application/vnd.oci.image.layer.v1.tar",
    ("docker", "gzip"): "application/vnd.docker.image.rootfs.diff.tar.gzip",
    ("docker", "none"): "application/vnd.docker.image.rootfs.diff.tar",
}
_MANIFEST_TYPES = {
    "oci": "application/vnd.oci.image.manifest.v1+json",
    "docker": "application/vnd.docker.distribution.manifest.v2+json",
}
_CONFIG_TYPES = {
    "oci": "application/vnd.oci.image.config.v1+json",
    "docker": "application/vnd.docker.container.image.v1+json",
}
# build_image keyword → the key in the image config's "config" object.
_CONFIG_KEYS = {
    "env": "Env",
    "cmd": "Cmd",
    "entrypoint": "Entrypoint",
    "user": "User",
    "working_dir": "WorkingDir",
    "stop_signal": "StopSignal",
    "labels": "Labels",
    "exposed_ports": "ExposedPorts",
    "volumes": "Volumes",
}


def digest_of(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


@dataclass(frozen=True)
class BuiltLayer:
    data: bytes  # the blob as stored (compressed or not)
    digest: str  # digest of `data`
    diff_id: str  # digest of the uncompressed tar
    media_type: str
    tar: bytes  # the uncompressed tar

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class BuiltImage:
    config: bytes
    config_digest: str
    manifest: bytes
    manifest_digest: str
    manifest_media_type: str
    layers: list[BuiltLayer]
    media_types: MediaTypes = "oci"

    @property
    def image_id(self) -> str:
        """The ID the store gives the image: the config digest."""
        return self.config_digest

    @property
    def config_json(self) -> dict[str, Any]:
        return dict(json.loads(self.config))

    @property
    def blobs(self) -> dict[str, bytes]:
        """Every blob by digest: config, layers and manifest (what a registry serves)."""
        result = {self.config_digest: self.config, self.manifest_digest: self.manifest}
        result.update({layer.digest: layer.data for layer in self.layers})
        return result


# --- tar building --------------------------------------------------------------------
@dataclass
class _TarBuilder:
    buffer: io.BytesIO = field(default_factory=io.BytesIO)

    def __post_init__(self) -> None:
        self.tar = tarfile.open(fileobj=self.buffer, mode="w", format=tarfile.PAX_FORMAT)

    def _info(
        self, name: str, kind: bytes, mode: int, uid: int = 0, gid: int = 0
    ) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mode = mode
        info.uid, info.gid = uid, gid
        info.uname = info.gname = ""
        info.mtime = EPOCH
        return info

    def dir(self, name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> None:
        self.tar.addfile(self._info(name, tarfile.DIRTYPE, mode, uid, gid))

    def file(self, name: str, data: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0) -> None:
        info = self._info(name, tarfile.REGTYPE, mode, uid, gid)
        info.size = len(data)
        self.tar.addfile(info, io.BytesIO(data))

    def symlink(self, name: str, target: str) -> None:
        info = self._info(name, tarfile.SYMTYPE, 0o777)
        info.linkname = target
        self.tar.addfile(info)

    def whiteout(self, directory: str, hidden: str) -> None:
        self.file(f"{directory}/.wh.{hidden}", b"", mode=0o600)

    def opaque(self, directory: str) -> None:
        self.file(f"{directory}/.wh..wh..opq", b"", mode=0o600)

    def finish(self) -> bytes:
        self.tar.close()
        return self.buffer.getvalue()


@functools.cache
def busybox_applets() -> tuple[str, ...]:
    out = subprocess.run(
        [str(BUSYBOX), "--list"], check=True, capture_output=True, text=True
    ).stdout
    return tuple(name for name in out.split() if name and name != "busybox" and "/" not in name)


@functools.cache
def _busybox_bytes() -> bytes:
    return BUSYBOX.read_bytes()


def base_layer_tar() -> bytes:
    tar = _TarBuilder()
    for directory in ("bin", "dev", "etc", "home", "opt", "proc", "sys", "usr", "var"):
        tar.dir(directory)
    tar.dir("root", 0o700)
    tar.dir("tmp", 0o1777)
    tar.dir("home/app", 0o755, uid=1000, gid=1000)
    tar.dir("usr/bin")
    tar.dir("usr/sbin")
    tar.dir("var/tmp", 0o1777)
    tar.file("bin/busybox", _busybox_bytes(), 0o755)
    for applet in busybox_applets():
        tar.symlink(f"bin/{applet}", "busybox")
    tar.file("etc/passwd", PASSWD.encode())
    tar.file("etc/group", GROUP.encode())
    tar.file("etc/removed-by-layer2", b"layer 1 only\n")
    tar.dir("opt/opaque")
    tar.file("opt/opaque/old", b"hidden by layer 2\n")
    return tar.finish()


def second_layer_tar() -> bytes:
    tar = _TarBuilder()
    tar.dir("etc")
    tar.file("etc/image-layer2", b"layer 2\n")
    tar.whiteout("etc", "removed-by-layer2")
    tar.dir("opt")
    tar.dir("opt/opaque")
    tar.opaque("opt/opaque")
    tar.file("opt/opaque/new", b"from layer 2\n")
    return tar.finish()


def extra_layer_tar(files: Mapping[str, bytes]) -> bytes:
    tar = _TarBuilder()
    made: set[str] = set()
    for name in sorted(files):
        parts = name.strip("/").split("/")
        for depth in range(1, len(parts)):
            directory = "/".join(parts[:depth])
            if directory not in made:
                tar.dir(directory)
                made.add(directory)
        tar.file("/".join(parts), files[name])
    return tar.finish()


def compress(tar: bytes, compression: Compression) -> bytes:
    if compression == "gzip":
        # mtime=0: no timestamp in the header, so the digest is reproducible.
        return gzip.compress(tar, compresslevel=6, mtime=0)
    if compression == "zstd":
        return zstandard.ZstdCompressor(level=3).compress(tar)
    if compression == "none":
        return tar
    raise ValueError(f"unknown compression {compression!r}")


def _goarch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


# --- the image -------------------------------------------------------------------------
def build_image(
    compression: Compression = "gzip",
    media_types: MediaTypes = "oci",
    extra_files: Mapping[str, bytes] | None = None,
    **config_overrides: Any,
) -> BuiltImage:
    """Build the busybox test image in memory. `config_overrides` take the keys of
    `_CONFIG_KEYS` (env, cmd, entrypoint, user, working_dir, stop_signal, labels,
    exposed_ports, volumes); `extra_files` adds a third layer (a different image that
    shares the first two layers)."""
    if (media_types, compression) not in _LAYER_TYPES:
        raise ValueError(f"{media_types} media types cannot express {compression} layers")
    unknown = set(config_overrides) - set(_CONFIG_KEYS)
    if unknown:
        raise TypeError(f"unknown image config overrides: {sorted(unknown)}")
    tars = [base_layer_tar(), second_layer_tar()]
    if extra_files:
        tars.append(extra_layer_tar(extra_files))
    layers = []
    for tar in tars:
        data = compress(tar, compression)
        layers.append(
            BuiltLayer(
                data=data,
                digest=digest_of(data),
                diff_id=digest_of(tar),
                media_type=_LAYER_TYPES[(media_types, compression)],
                tar=tar,
            )
        )
    runtime_config: dict[str, Any] = {
        "Env": [DEFAULT_PATH_ENV],
        "Cmd": ["sh"],
        "WorkingDir": "/",
    }
    for key, value in config_overrides.items():
        if value is not None:
            runtime_config[_CONFIG_KEYS[key]] = value
    config = {
        "created": "2023-11-14T22:13:20Z",
        "architecture": _goarch(),
        "os": "linux",
        "config": runtime_config,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [
            {"created": "2023-11-14T22:13:20Z", "created_by": f"tests/imagebuild.py layer {i}"}
            for i in range(len(layers))
        ],
    }
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": _MANIFEST_TYPES[media_types],
        "config": {
            "mediaType": _CONFIG_TYPES[media_types],
            "digest": digest_of(config_bytes),
            "size": len(config_bytes),
        },
        "layers": [
            {"mediaType": layer.media_type, "digest": layer.digest, "size": layer.size}
            for layer in layers
        ],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return BuiltImage(
        config=config_bytes,
        config_digest=digest_of(config_bytes),
        manifest=manifest_bytes,
        manifest_digest=digest_of(manifest_bytes),
        manifest_media_type=_MANIFEST_TYPES[media_types],
        layers=layers,
        media_types=media_types,
    )


# --- writers -----------------------------------------------------------------------------
def layout_files(
    image: BuiltImage, ref_name: str | None, containerd_name: str | None = None
) -> dict[str, bytes]:
    """The files of an OCI image layout holding `image`, by path."""
    annotations = {}
    if ref_name:
        annotations["org.opencontainers.image.ref.name"] = ref_name
    if containerd_name:
        annotations["io.containerd.image.name"] = containerd_name
    descriptor: dict[str, Any] = {
        "mediaType": image.manifest_media_type,
        "digest": image.manifest_digest,
        "size": len(image.manifest),
        "platform": {"architecture": _goarch(), "os": "linux"},
    }
    if annotations:
        descriptor["annotations"] = annotations
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [descriptor],
    }
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index, indent=2).encode(),
    }
    for digest, data in image.blobs.items():
        files[f"blobs/sha256/{digest.removeprefix('sha256:')}"] = data
    return files


def _ref_name_for(tag: str, ref_name: str | None) -> str:
    # None: the default repository with `tag`; "": only the tag, as `skopeo copy
    # oci:dir:tag` writes it (the importer then needs --name).
    if ref_name is None:
        return f"{DEFAULT_REF_NAME}:{tag}"
    return ref_name or tag


def build_oci_layout(
    dest: Path,
    tag: str = "latest",
    ref_name: str | None = None,
    *,
    compression: Compression = "gzip",
    media_types: MediaTypes = "oci",
    extra_files: Mapping[str, bytes] | None = None,
    **config_overrides: Any,
) -> Path:
    """Write an OCI image layout directory at `dest`. Its index entry is annotated with
    `org.opencontainers.image.ref.name` = `ref_name` (default
    `docker.io/library/busybox:<tag>`; pass "" for just `tag`)."""
    image = build_image(compression, media_types, extra_files, **config_overrides)
    for name, data in layout_files(image, _ref_name_for(tag, ref_name)).items():
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return dest


def _write_tar(dest_tar: Path, files: Mapping[str, bytes]) -> Path:
    dest_tar.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest_tar, "w", format=tarfile.PAX_FORMAT) as tar:
        directories = sorted({str(Path(n).parent) for n in files if "/" in n})
        for directory in directories:
            info = tarfile.TarInfo(directory)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, EPOCH
            tar.addfile(info, io.BytesIO(data))
    return dest_tar


def build_oci_archive(
    dest_tar: Path,
    tag: str = "latest",
    ref_name: str | None = None,
    *,
    compression: Compression = "gzip",
    media_types: MediaTypes = "oci",
    extra_files: Mapping[str, bytes] | None = None,
    **config_overrides: Any,
) -> Path:
    """Write an OCI archive (a tar of a layout, as `skopeo copy … oci-archive:`)."""
    image = build_image(compression, media_types, extra_files, **config_overrides)
    return _write_tar(dest_tar, layout_files(image, _ref_name_for(tag, ref_name)))


def build_docker_archive(
    dest_tar: Path,
    repo_tag: str | None = f"{DEFAULT_REF_NAME}:latest",
    *,
    compression: Compression = "none",
    extra_files: Mapping[str, bytes] | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a docker-archive (`docker save`'s legacy format: manifest.json, `<id>.json`,
    `<layer>/layer.tar`). Layers are uncompressed as docker writes them, unless
    `compression` says otherwise (docker load accepts gzip too)."""
    image = build_image(
        compression, "docker" if compression != "zstd" else "oci", extra_files, **config_overrides
    )
    config_name = f"{image.config_digest.removeprefix('sha256:')}.json"
    files: dict[str, bytes] = {config_name: image.config}
    layer_names = []
    for layer in image.layers:
        name = f"{layer.digest.removeprefix('sha256:')}/layer.tar"
        files[name] = layer.data
        layer_names.append(name)
    manifest = [
        {
            "Config": config_name,
            "RepoTags": [repo_tag] if repo_tag else None,
            "Layers": layer_names,
        }
    ]
    files["manifest.json"] = json.dumps(manifest).encode()
    return _write_tar(dest_tar, files)


_layout_cache: dict[tuple[Path, str], Path] = {}


def cached_oci_layout(base: Path, **options: Any) -> Path:
    """`build_oci_layout(...)` once per `base` and options; for a session fixture:

        @pytest.fixture(scope="session")
        def busybox_layout(tmp_path_factory):
            return cached_oci_layout(tmp_path_factory.getbasetemp() / "images")

    Treat the result as read-only: it is shared."""
    key = repr(sorted(options.items()))
    cached = _layout_cache.get((base, key))
    if cached is None:
        dest = base / f"layout-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        if not (dest / "index.json").exists():
            build_oci_layout(dest, **options)
        cached = _layout_cache[(base, key)] = dest
    return cached
