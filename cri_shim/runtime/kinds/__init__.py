"""Runtime handler kinds: what differs between runc-like OCI runtimes, gVisor and Kata,
one object per kind (base.py), decided once per runtime binary (probe.py)."""
