"""Ray Serve application: OpenAI-compatible HTTP + `specserve.v1.Generator` gRPC ingress."""

from specserve.serve.app import GRPC_SERVICER_FUNCTION, SpecServe, build_app
from specserve.serve.config import AppConfig

__all__ = ["GRPC_SERVICER_FUNCTION", "AppConfig", "SpecServe", "build_app"]
