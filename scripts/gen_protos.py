"""Regenerate client/kvcoord/v1 from proto/ (run after editing a .proto file).

The generated modules are committed; tests/unit/test_packaging.py
(test_generated_code_is_current) regenerates them in a temporary folder and fails if
the committed copies differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def generate(out: Path) -> None:
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{ROOT / 'proto'}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(ROOT / "client")
    print("generated into", ROOT / "client" / "kvcoord" / "v1", file=sys.stderr)
