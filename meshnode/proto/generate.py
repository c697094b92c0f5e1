"""Regenerate mesh_pb2.py / mesh_pb2_grpc.py from protos/mesh.proto.

Run ``python -m meshnode.proto.generate`` after editing the .proto (needs grpcio-tools, part
of the ``test`` extra). The generated files are committed so a user's install needs no code
generation; tests/test_proto.py checks the committed copy matches the .proto.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE.parent.parent / "protos" / "mesh.proto"
OUTPUTS = ("mesh_pb2.py", "mesh_pb2.pyi", "mesh_pb2_grpc.py")


def generate(out_dir: Path, proto: Path = PROTO) -> None:
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-I{proto.parent}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto}")
    grpc_file = out_dir / "mesh_pb2_grpc.py"
    # The generated module imports its sibling as a top-level module; make it relative.
    text = re.sub(r"^import mesh_pb2 as", "from . import mesh_pb2 as", grpc_file.read_text(), flags=re.M)
    grpc_file.write_text(text)


def is_up_to_date() -> list[str]:
    """Names of committed files that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [n for n in OUTPUTS if (Path(tmp) / n).read_text() != (HERE / n).read_text()]


if __name__ == "__main__":
    generate(HERE)
    print("generated", ", ".join(OUTPUTS), "in", HERE)
    sys.exit(0)
