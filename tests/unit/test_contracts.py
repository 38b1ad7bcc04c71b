"""Architecture contracts: generated code is fresh, the sidecar never loads torch."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_api_matches_the_proto(tmp_path):
    bindir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path=sidecar/api={ROOT / 'proto'}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--mypy_out={tmp_path}",
            f"--mypy_grpc_out={tmp_path}",
            "sidecar/api/strata/v1/strata.proto",
        ],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    generated = tmp_path / "sidecar/api/strata/v1"
    names = sorted(p.name for p in generated.iterdir())
    assert names == ["strata_pb2.py", "strata_pb2.pyi", "strata_pb2_grpc.py", "strata_pb2_grpc.pyi"]
    _, mismatch, errors = filecmp.cmpfiles(generated, ROOT / "sidecar/api/strata/v1", names, shallow=False)
    assert not mismatch and not errors, f"stale generated code {mismatch + errors}: run `make proto`"


def test_the_sidecar_never_imports_torch():
    code = (
        "import sys, sidecar.cli, sidecar.server, sidecar.engine, sidecar.store.s3, sidecar.store.file, "
        "sidecar.local.seaweed, sidecar.faults, sidecar.api.dtypes; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'trainer_client'))); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_import_contracts_hold():
    out = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(declared)} kept, 0 broken" in out.stdout
