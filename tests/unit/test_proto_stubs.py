"""The checked-in gRPC stubs (hora_proto.v1) are what `make proto` generates from proto/hora/v1."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
STUBS = ROOT / "proto" / "hora_proto" / "v1"


def test_checked_in_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    protos = sorted(str(p) for p in (PROTO_DIR / "hora" / "v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-Ihora_proto={PROTO_DIR / 'hora'}",
                    f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", *protos], check=True)
    generated = sorted(p.name for p in (tmp_path / "hora_proto" / "v1").iterdir())
    checked_in = sorted(p.name for p in STUBS.iterdir()
                        if p.suffix in (".py", ".pyi") and p.name != "__init__.py")
    assert generated == checked_in, "stub files differ from the .proto files: run `make proto`"
    stale = [name for name in generated
             if not filecmp.cmp(tmp_path / "hora_proto" / "v1" / name, STUBS / name, shallow=False)]
    assert not stale, f"stale gRPC stubs {stale}: run `make proto` and commit the result"
