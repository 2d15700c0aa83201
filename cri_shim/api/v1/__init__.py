"""runtime.v1 (k8s.io/cri-api v0.36.3): api_pb2 (messages), api_pb2_grpc (services)."""
