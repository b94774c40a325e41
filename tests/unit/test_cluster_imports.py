"""``import hora`` (and hora.torch, hora.spark) never imports Ray or PySpark; the shim
modules resolve to hora's."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def test_import_hora_imports_neither_ray_nor_pyspark():
    code = ("import sys, hora, hora.torch, hora.elastic, hora.spark; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'pyspark')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=100)
    assert out.stdout.strip() == "[]"


def test_python_m_hora_horovod_puts_the_shim_on_the_path(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text("import os, sys\n"
                      "import horovod.spark, horovod.torch\n"
                      "print(horovod.spark.run.__module__, horovod.torch.__name__, sys.argv[1:])\n"
                      "print(os.environ['PYTHONPATH'].split(os.pathsep)[0].endswith('_compat'))\n")
    out = subprocess.run([sys.executable, "-m", "hora.horovod", str(script), "--flag"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["hora.spark.runner horovod.torch ['--flag']", "True"]
