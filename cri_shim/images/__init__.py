"""Images (DESIGN §7): references, the local store (blobs by digest, layers unpacked once,
records in the state database), import from OCI layouts and archives, and overlayfs root
filesystems. Registry pull builds on `ImageStore.put_blob` and `ImageStore.add_image`."""

from cri_shim.images.layers import LayerBlob
from cri_shim.images.reference import Reference, normalize, parse_named, parse_reference
from cri_shim.images.store import FsInfo, ImageStore
from cri_shim.state.records import ImageRecord

__all__ = [
    "FsInfo",
    "ImageRecord",
    "ImageStore",
    "LayerBlob",
    "Reference",
    "normalize",
    "parse_named",
    "parse_reference",
]
