"""Ray Serve application: OpenAI-compatible HTTP + `specserve.v1.Generator` gRPC ingress."""

from __future__ import annotations

from specserve.lazy import exports
from specserve.serve.grpc_api import GRPC_SERVICER_FUNCTION

# the application on first use: Serve's gRPC proxy imports `grpc_api` alone, without the models' code
_LAZY = {"SpecServe": "specserve.serve.app", "build_app": "specserve.serve.app", "AppConfig": "specserve.serve.config"}

__all__ = ["GRPC_SERVICER_FUNCTION", "AppConfig", "SpecServe", "build_app"]

__getattr__ = exports("specserve.serve", _LAZY)
