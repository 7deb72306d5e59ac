"""gRPC plumbing: codegen, conversions between wire messages and engine types, worker servicers.

Generated code lives in `specserve.v1`; this package holds the thin helpers
around it and knows nothing about Ray.
"""
