"""Regenerate the protobuf/gRPC modules from protos/ (the only source of the wire contract).

    python -m specserve.rpc.codegen          # writes services/specserve/v1/*_pb2*.py(i)

Needs grpcio-tools (a dev dependency). The generated modules are committed
so the installed package imports them without the tools; the test suite
regenerates into a temporary directory and fails on any drift.
"""

from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO / "protos"
OUTPUT_ROOT = REPO / "services"  # protos/specserve/v1/x.proto -> services/specserve/v1/x_pb2.py


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(output_root: pathlib.Path = OUTPUT_ROOT) -> list[pathlib.Path]:
    """Run protoc; return the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    protos = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={output_root}",
        f"--pyi_out={output_root}",
        f"--grpc_python_out={output_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for proto in protos for p in (output_root / proto).parent.glob(pathlib.Path(proto).stem + "_pb2*"))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(REPO), file=sys.stderr)
