"""The host's kernel interfaces, each in one place: the C library and its errno checks,
mounts, namespaces, idmapped mounts, inotify, netlink and process attributes.

Everything else in the daemon reaches the kernel through these modules (no ctypes
elsewhere). pyroute2, the netlink library, is imported only by `netlink`, and only when a
message is first sent: it costs about 11 MiB resident.
"""
