"""What the image build reads before any tool runs: the requirement lists of each torch
flavour (deploy/tools/requirements.py, also the wheelhouse's). Needs no Docker."""

from __future__ import annotations

import subprocess
import sys

import pytest
from deploy_tools import ROOT

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(60)]


def requirements(*extras: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "deploy" / "tools" / "requirements.py"),
                           str(ROOT / "pyproject.toml"), *extras],
                          capture_output=True, text=True, timeout=30)


def test_the_cpu_image_needs_no_nvidia_package_and_the_cuda_one_adds_nccl():
    cpu = requirements("examples").stdout.splitlines()
    assert "torch>=2.2,<3" in cpu and "scikit-learn>=1.3" in cpu
    assert not [r for r in cpu if r.startswith("nvidia")]
    cuda = requirements("examples cuda").stdout.splitlines()
    assert [r for r in cuda if r.startswith("nvidia")] == ["nvidia-nccl-cu12>=2.21"]


def test_an_unknown_extra_is_refused_with_the_known_ones():
    proc = requirements("examples,gpu")
    assert proc.returncode != 0
    assert "no extra 'gpu'" in proc.stderr and "cuda" in proc.stderr
