"""Running containers: the OCI spec (spec.py), the runtime CLI (oci.py), conmon (conmon.py,
whose RuntimeBackend hands each concern to a module of its own), cgroup statistics
(stats.py) and reaping orphans the subreaper daemon inherits (orphans.py). Host limits
that shape every spec are in host_limits.py."""
