"""cri-shim: a Kubernetes CRI runtime whose creation is idempotent under client timeouts."""

__version__ = "0.1.0"
