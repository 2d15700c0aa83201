"""The host's kernel interfaces, each in one place: the C library and its errno checks,
mounts, namespaces, idmapped mounts, inotify, netlink and process attributes.

Everything else in the daemon reaches the kernel through these modules (no ctypes
elsewhere). `netlink` encodes its one message with `struct`: a netlink library costs
about 11 MiB resident.
"""
