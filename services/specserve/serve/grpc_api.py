"""The `specserve.v1.Generator` service as registered on Ray Serve's gRPC proxy (`grpc_servicer_functions`).

The generated `add_GeneratorServicer_to_server` parses requests in the proxy;
a message that does not parse made grpc answer UNKNOWN ("Unexpected
DecodeError"). Here the parse never raises: an undecodable message becomes
a request marked `UNDECODABLE`, which the ingress refuses with
INVALID_ARGUMENT like any other bad input.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from specserve.v1 import generator_pb2

SERVICE = "specserve.v1.Generator"
# the proxy hands the ingress a request with this model name for bytes that are no GenerateRequest
UNDECODABLE = "\x00specserve-undecodable"
GENERATED_FUNCTION = "specserve.v1.generator_pb2_grpc.add_GeneratorServicer_to_server"
# what a Serve config names in grpc_servicer_functions: this module's registration
GRPC_SERVICER_FUNCTION = "specserve.serve.grpc_api.add_GeneratorServicer_to_server"


def parse_request(data: bytes) -> generator_pb2.GenerateRequest:
    try:
        return generator_pb2.GenerateRequest.FromString(data)
    except DecodeError:
        return generator_pb2.GenerateRequest(model=UNDECODABLE)


def add_GeneratorServicer_to_server(servicer, server) -> None:  # noqa: N802 - the name gRPC's convention expects
    serialize = generator_pb2.GenerateResponse.SerializeToString
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=parse_request, response_serializer=serialize),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=parse_request, response_serializer=serialize),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
