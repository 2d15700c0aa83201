"""NRI, the Node Resource Interface: plugins that see and adjust pods and containers.

`mux` splits one plugin connection into its two logical connections, `ttrpc` frames the
calls on each; both are codecs without I/O. The NRI messages live in `api/`.
"""
