"""Generate the Python stubs for protos/ into client/_generated.

protoc writes imports such as ``from jitney.v1 import generation_pb2``; they
are rewritten to ``from client._generated.jitney.v1 import ...`` so the stubs
live inside the ``client`` package. ``make proto`` runs this; a test runs it
into a temporary folder and compares, so the stubs cannot drift.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "client" / "_generated"
PACKAGE = "client._generated"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into ``out_dir``; return the files written."""
    from grpc_tools import protoc  # build-time dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = sorted(p for p in out_dir.rglob("*.py*") if p.is_file())
    for path in written:
        _rewrite_imports(path)
    for pkg_dir in {p.parent for p in written} | {out_dir}:
        while True:
            init = pkg_dir / "__init__.py"
            if not init.exists():
                init.write_text("")
            if pkg_dir == out_dir:
                break
            pkg_dir = pkg_dir.parent
    return sorted(p for p in out_dir.rglob("*.py*") if p.is_file())


def _rewrite_imports(path: Path) -> None:
    text = path.read_text()
    text = re.sub(r"^from jitney\.", f"from {PACKAGE}.jitney.", text, flags=re.M)
    text = re.sub(r"^import jitney\.", f"import {PACKAGE}.jitney.", text, flags=re.M)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
