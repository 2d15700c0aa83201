"""Container logs in the CRI format that kubelet reads (crilog.py)."""
