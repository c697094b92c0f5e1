"""Generated protobuf / gRPC code for protos/mesh.proto (regenerate: python -m meshnode.proto.generate)."""
