"""Running containers: the OCI spec (spec.py), the runtime CLI (oci.py), conmon (conmon.py),
and cgroup statistics (stats.py). Host limits that shape every spec are in host_limits.py."""
