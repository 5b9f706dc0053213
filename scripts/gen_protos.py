"""Generate the code that comes from protos/: Python stubs, Connect routes, TypeScript.

- Python stubs and their mypy .pyi land in the client distribution's tree, as
  the package toolmesh.v1 (clients/python/src/toolmesh/v1).
- The protos' descriptors with their comments (services/src/toolmesh/runtime/
  descriptors.binpb), which the servers' reflection serves.
- The Connect and gRPC-Web routes of the web ports (protoc-gen-connectrpc,
  on the same protobuf messages) land in the server distribution's tree
  (services/src/toolmesh/v1/*_connect.py): only the servers need connectrpc.
- The TypeScript messages and service descriptors (protoc-gen-es through
  `buf generate`) land in clients/typescript/src/gen; they need `npm ci` in
  clients/typescript first. Beside them, src/gen/tables.ts: the error table and
  the limits from toolmesh.core (scripts/gen_ts_tables.py), and the page
  assistant's turn-code table, clients/typescript/assistant/src/gen/turns.ts.

`--check` regenerates into a temporary folder and fails when a committed tree differs.
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
CLIENT_SRC = ROOT / "clients" / "python" / "src"
SERVER_SRC = ROOT / "services" / "src"
TYPESCRIPT = ROOT / "clients" / "typescript"
# Each generated tree, relative to the folder its generator writes into.
PYTHON_TREE = Path("toolmesh") / "v1"
CONNECT_FILES = [
    Path("toolmesh") / "v1" / f"{name}_connect.py" for name in ("bridge", "invocation", "registry")
]
# In the server distribution: the servers' reflection serves it.
DESCRIPTORS_FILE = Path("toolmesh") / "runtime" / "descriptors.binpb"
TYPESCRIPT_TREE = Path("src") / "gen"
# The page assistant's generated tree (assistant/src/gen/turns.ts, the turn-code table).
ASSISTANT_TREE = Path("assistant") / "src" / "gen"
# Writes src/gen/tables.ts, the error table and limits from toolmesh.core, and
# assistant/src/gen/turns.ts, the turn-code table from toolmesh.assistant.
TS_TABLES = ROOT / "scripts" / "gen_ts_tables.py"
# Served over Connect and gRPC-Web on the web ports: the bridge's host RPCs, the caller RPCs of the
# registry and the invocation service.
CONNECT_PROTOS = ["toolmesh/v1/bridge.proto", "toolmesh/v1/invocation.proto", "toolmesh/v1/registry.proto"]


def _protoc(out: Path, plugin_args: list[str], protos: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", *plugin_args, *protos],
        check=True,
        cwd=PROTO_ROOT,
    )


def generate_python(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    bin_dir = Path(sys.executable).parent
    _protoc(
        out,
        [
            f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
        ],
        protos,
    )
    # PEP 561 marker so type checkers read the generated .pyi files.
    for package in {p.parent for p in out.rglob("*_pb2.py")}:
        (package / "py.typed").write_text("")


def generate_descriptors(out: Path) -> None:
    """The protos' descriptors with their comments, which reflection serves (the stubs' carry none)."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    (out / DESCRIPTORS_FILE).parent.mkdir(parents=True, exist_ok=True)
    _protoc(out, ["--include_source_info", f"--descriptor_set_out={out / DESCRIPTORS_FILE}"], protos)


def generate_connect(out: Path) -> None:
    plugin = Path(sys.executable).parent / "protoc-gen-connectrpc"
    _protoc(
        out,
        [
            f"--plugin=protoc-gen-connectrpc={plugin}",
            f"--connectrpc_out={out}",
            # Our messages are google.protobuf ones, shared with the gRPC port.
            "--connectrpc_opt=protobuf=google",
        ],
        CONNECT_PROTOS,
    )


def generate_typescript(out: Path) -> None:
    buf = TYPESCRIPT / "node_modules" / ".bin" / "buf"
    if not buf.exists():
        raise SystemExit("TypeScript generation needs `npm ci` in clients/typescript first")
    subprocess.run(
        [str(buf), "generate", str(ROOT), "--template", "buf.gen.yaml", "--output", str(out)],
        check=True,
        cwd=TYPESCRIPT,
    )
    # After buf, which empties src/gen (clean: true in buf.gen.yaml).
    subprocess.run([sys.executable, str(TS_TABLES), "--out", str(out)], check=True)


def differences(left: Path, right: Path) -> list[str]:
    found: list[str] = []
    cmp = filecmp.dircmp(left, right, ignore=["__pycache__"])
    found += [f"only in committed tree: {left / name}" for name in cmp.left_only]
    found += [f"missing from committed tree: {left / name}" for name in cmp.right_only]
    for name in cmp.common_files:
        if (left / name).read_bytes() != (right / name).read_bytes():
            found.append(f"stale: {left / name}")
    for name in cmp.common_dirs:
        found += differences(left / name, right / name)
    return found


def _file_difference(committed: Path, fresh: Path) -> list[str]:
    if not committed.exists():
        return [f"missing from committed tree: {committed}"]
    return [] if committed.read_bytes() == fresh.read_bytes() else [f"stale: {committed}"]


def check() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate_python(fresh / "python")
        generate_connect(fresh / "connect")
        generate_descriptors(fresh / "descriptors")
        generate_typescript(fresh / "typescript")
        problems: list[str] = []
        for committed, generated in [
            (CLIENT_SRC / PYTHON_TREE, fresh / "python" / PYTHON_TREE),
            (TYPESCRIPT / TYPESCRIPT_TREE, fresh / "typescript" / TYPESCRIPT_TREE),
            (TYPESCRIPT / ASSISTANT_TREE, fresh / "typescript" / ASSISTANT_TREE),
        ]:
            problems += (
                differences(committed, generated)
                if committed.exists()
                else [f"generated tree missing: {committed}"]
            )
        for connect_file in CONNECT_FILES:
            problems += _file_difference(SERVER_SRC / connect_file, fresh / "connect" / connect_file)
        problems += _file_difference(SERVER_SRC / DESCRIPTORS_FILE, fresh / "descriptors" / DESCRIPTORS_FILE)
        return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    if not args.check:
        shutil.rmtree(CLIENT_SRC / PYTHON_TREE, ignore_errors=True)
        generate_python(CLIENT_SRC)
        generate_connect(SERVER_SRC)
        generate_descriptors(SERVER_SRC)
        generate_typescript(TYPESCRIPT)
        return 0
    problems = check()
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print("generated code is stale: run `python scripts/gen_protos.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
