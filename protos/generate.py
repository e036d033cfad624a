"""Generate the Python stubs of ``protos/`` into the ``jitney`` package.

protoc writes each file where its proto package puts it: ``jitney.v1``
(public, what ``jitney.client`` exposes) into ``jitney/v1/`` and
``jitney.engine.v1`` (the internal scheduler <-> worker contract) into
``jitney/engine/v1/``. Its imports (``from jitney.v1 import ...``) are
already right: nothing is rewritten. ``make proto`` runs this; a test runs it
into a temporary folder and compares, so the stubs cannot drift.

    python protos/generate.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT  # protoc adds jitney/v1/... itself


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generated_files(out_dir: Path) -> list[Path]:
    """The stubs protoc writes under ``out_dir`` (``*_pb2*.py*``)."""
    return sorted(p for p in (out_dir / "jitney").rglob("*_pb2*.py*") if p.is_file())


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into ``out_dir``; return the stub files written."""
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
    return generated_files(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
