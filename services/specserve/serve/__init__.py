"""Ray Serve application: OpenAI-compatible HTTP + `specserve.v1.Generator` gRPC ingress."""

from __future__ import annotations

import importlib

from specserve.serve.grpc_api import GRPC_SERVICER_FUNCTION

# the application on first use: Serve's gRPC proxy imports `grpc_api` alone, without the models' code
_LAZY = {"SpecServe": "specserve.serve.app", "build_app": "specserve.serve.app", "AppConfig": "specserve.serve.config"}

__all__ = ["GRPC_SERVICER_FUNCTION", "AppConfig", "SpecServe", "build_app"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specserve.serve' has no attribute {name!r}")
