"""The CRI streaming server: exec, attach and port-forward URLs and the protocols behind them.

`server.StreamingServer` is what the daemon owns; `backend.StreamingBackend` is what it
needs from a runtime, and `runc_backend.RuncStreamingBackend` is the real one.
"""
