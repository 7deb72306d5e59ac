"""Generated protobuf/gRPC modules for the specserve.v1 wire contract (do not edit; see specserve.rpc.codegen)."""
