"""Generated protobuf and gRPC code for proto/edgespec/v1 (see proto/generate.py)."""
