"""What the daemon reports of its pods, containers and itself, read live for the stats,
metrics and status RPCs and the Prometheus endpoint: no protobuf, no gRPC.

`host.HostReader` is the one reader of the host for all of it (cgroup files, the pod's
network namespace, the writable layer's filesystem); `usage.UsageCollector` turns what it
reads into the usage of pods and containers, with CPU rates kept between samples;
`census.Census` counts creations and objects; `runtime_spec` reads what a container was
made with.
"""
