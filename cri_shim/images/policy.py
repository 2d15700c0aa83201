"""What an image layer may contain, as `[images]` says. Apart from the unpacker so that
holding the policy (the store does from the start) does not import tarfile and zstd,
which only a pull needs."""

from __future__ import annotations

from dataclasses import dataclass

from cri_shim.config import ImagesConfig


@dataclass(frozen=True)
class UnpackPolicy:
    """What a layer may contain; the defaults are `[images]`'s."""

    max_bytes: int = ImagesConfig.max_layer_bytes
    max_entries: int = ImagesConfig.max_layer_entries
    allow_device_nodes: bool = ImagesConfig.allow_device_nodes

    @classmethod
    def from_config(cls, images: ImagesConfig) -> UnpackPolicy:
        return cls(images.max_layer_bytes, images.max_layer_entries, images.allow_device_nodes)
