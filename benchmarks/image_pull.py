"""PullImage from a local docker-registry: a generated ~50 MB image (incompressible
layers), cold and then a second image sharing most of its layers, against `skopeo copy` of
the same image to a local directory.

The comparison is not like for like, and the figures say so: skopeo copies the
compressed blobs into a directory and stops, while a pull also decompresses every layer
and unpacks it into the store (what a container needs). So the "fetch" column, the
pull's time minus its unpacking, is the one to hold against skopeo.

Usage: sudo .venv/bin/python benchmarks/image_pull.py [--runs 3] [--layer-mib 12]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cri_shim.api.v1 import api_pb2
from cri_shim.images.pull import ImagePuller
from cri_shim.images.store import ImageStore
from cri_shim.state.db import Database
from tests.harness import Daemon
from tests.imagebuild import (
    BuiltImage,
    BuiltLayer,
    base_layer_tar,
    compress,
    digest_of,
    extra_layer_tar,
    second_layer_tar,
)
from tests.registry import RegistryServer, start_registry

OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"


def random_layer(name: str, mib: int) -> bytes:
    """A tar of one file of random bytes: gzip cannot shrink it, like real binaries."""
    return extra_layer_tar({f"data/{name}": os.urandom(mib << 20)})


def assemble(tars: list[bytes]) -> BuiltImage:
    layers = []
    for tar in tars:
        # Level 1: the random layers do not compress anyway, and building stays quick.
        data = compress(tar, "gzip") if len(tar) < 8 << 20 else _fast_gzip(tar)
        layers.append(BuiltLayer(data, digest_of(data), digest_of(tar), OCI_LAYER_GZIP, tar))
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": ["sh"]},
        "rootfs": {"type": "layers", "diff_ids": [x.diff_id for x in layers]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {
            "mediaType": OCI_CONFIG,
            "digest": digest_of(config_bytes),
            "size": len(config_bytes),
        },
        "layers": [{"mediaType": x.media_type, "digest": x.digest, "size": x.size} for x in layers],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    return BuiltImage(
        config_bytes,
        digest_of(config_bytes),
        manifest_bytes,
        digest_of(manifest_bytes),
        OCI_MANIFEST,
        layers,
    )


def _fast_gzip(tar: bytes) -> bytes:
    import gzip

    return gzip.compress(tar, compresslevel=1, mtime=0)


def daemon_pull(base: Path, registry: RegistryServer, refs: list[str]) -> list[float]:
    """Seconds per PullImage, in order, through a fresh daemon (cold store)."""
    root = Path(tempfile.mkdtemp(prefix="csb-", dir=base))
    daemon = Daemon(root, None, settings={"images": {"insecure_registries": [registry.host]}})
    daemon.start()
    try:
        times = []
        for ref in refs:
            request = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=ref))
            started = time.perf_counter()
            daemon.images().PullImage(request, timeout=300)
            times.append(time.perf_counter() - started)
        return times
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)


def inprocess_pull(base: Path, registry: RegistryServer, ref: str) -> tuple[float, float]:
    """(total, of which add_image: decompress + unpack + commit) for one cold pull."""
    root = Path(tempfile.mkdtemp(prefix="csp-", dir=base))
    db = Database(root / "state.db")
    store = ImageStore(root, db)
    unpacking = 0.0
    add_image = store.add_image

    def timed_add_image(*args: object, **kwargs: object) -> object:
        nonlocal unpacking
        started = time.perf_counter()
        try:
            return add_image(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            unpacking += time.perf_counter() - started

    store.add_image = timed_add_image  # type: ignore[method-assign,assignment]

    async def run() -> float:
        puller = ImagePuller(store, [registry.host])
        try:
            started = time.perf_counter()
            await puller.pull(ref)
            return time.perf_counter() - started
        finally:
            await puller.aclose()

    try:
        total = asyncio.run(run())
    finally:
        db.close()
        shutil.rmtree(root, ignore_errors=True)
    return total, unpacking


def skopeo_copy(base: Path, registry: RegistryServer, ref: str) -> float:
    dest = Path(tempfile.mkdtemp(prefix="css-", dir=base))
    try:
        started = time.perf_counter()
        subprocess.run(
            [
                "skopeo",
                "copy",
                "--quiet",
                "--src-tls-verify=false",
                f"docker://{ref}",
                f"dir:{dest}",
            ],
            check=True,
            capture_output=True,
        )
        return time.perf_counter() - started
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layer-mib", type=int, default=12, help="size of each random layer")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="csbench-", dir="/tmp"))
    registry = start_registry(base / "registry")
    try:
        shared = [base_layer_tar(), second_layer_tar()]
        shared += [random_layer(f"shared{i}", args.layer_mib) for i in range(3)]
        first = assemble([*shared, random_layer("first", args.layer_mib)])
        second = assemble([*shared, random_layer("second", args.layer_mib)])
        registry.push("bench/app", first, "v1")
        registry.push("bench/app", second, "v2")
        size = sum(x.size for x in first.layers) / (1 << 20)
        own = second.layers[-1].size / (1 << 20)
        ref1, ref2 = f"{registry.host}/bench/app:v1", f"{registry.host}/bench/app:v2"
        print(
            f"image: {len(first.layers)} layers, {size:.1f} MiB compressed; the second "
            f"image shares all but its last layer ({own:.1f} MiB)"
        )

        cold, warm, total, unpack, skopeo = [], [], [], [], []
        for _ in range(args.runs):
            a, b = daemon_pull(base, registry, [ref1, ref2])
            cold.append(a)
            warm.append(b)
            t, u = inprocess_pull(base, registry, ref1)
            total.append(t)
            unpack.append(u)
            skopeo.append(skopeo_copy(base, registry, ref1))

        med = statistics.median
        fetch = [t - u for t, u in zip(total, unpack, strict=True)]
        print(
            f"PullImage, cold (daemon)            {med(cold):7.3f} s  "
            f"({size / med(cold):6.1f} MiB/s)"
        )
        print(f"PullImage, second image, shared     {med(warm):7.3f} s")
        print(
            f"  in-process cold pull              {med(total):7.3f} s = fetch+verify "
            f"{med(fetch):.3f} s + decompress/unpack {med(unpack):.3f} s"
        )
        print(
            f"skopeo copy docker:// -> dir:       {med(skopeo):7.3f} s  "
            f"({size / med(skopeo):6.1f} MiB/s)"
        )
        print(f"ratio PullImage cold / skopeo       {med(cold) / med(skopeo):7.2f}")
        print(f"ratio fetch+verify / skopeo         {med(fetch) / med(skopeo):7.2f}")
        print(f"(median of {args.runs} runs)")
    finally:
        registry.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
