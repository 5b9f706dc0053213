"""Generate the Python stubs and their mypy .pyi from protos/.

They land in the client distribution's tree, as the package toolmesh.v1
(clients/python/src/toolmesh/v1), which holds generated code only. `--check`
regenerates into a temporary folder and fails when the committed tree differs.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
SRC = ROOT / "clients" / "python" / "src"
OUT = SRC / "toolmesh" / "v1"


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    bin_dir = Path(sys.executable).parent
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
            *protos,
        ],
        check=True,
        cwd=PROTO_ROOT,
    )
    # PEP 561 marker so type checkers read the generated .pyi files.
    for package in {p.parent for p in out.rglob("*_pb2.py")}:
        (package / "py.typed").write_text("")


def differences(left: Path, right: Path) -> list[str]:
    found: list[str] = []
    cmp = filecmp.dircmp(left, right, ignore=["__pycache__"])
    found += [f"only in committed tree: {name}" for name in cmp.left_only]
    found += [f"missing from committed tree: {name}" for name in cmp.right_only]
    for name in cmp.common_files:
        if (left / name).read_bytes() != (right / name).read_bytes():
            found.append(f"stale: {left / name}")
    for name in cmp.common_dirs:
        found += differences(left / name, right / name)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args()
    if not args.check:
        shutil.rmtree(OUT, ignore_errors=True)
        generate(SRC)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        problems = (
            differences(OUT, fresh / OUT.relative_to(SRC)) if OUT.exists() else ["generated tree missing"]
        )
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print("generated code is stale: run `python scripts/gen_protos.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
