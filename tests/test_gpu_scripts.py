"""The GPU scripts of benchmarks/ run their steps on CPU (``--cpu-dry-run``): what they call of
the library still exists and behaves as they expect, so that a machine with a GPU, lent for a
few minutes, finds them working. What they prove about CUDA needs that machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", *args, "--cpu-dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_gpu_check_dry_run_passes_every_check(tmp_path):
    out = _run("benchmarks.gpu_check", "--quick", "--out", str(tmp_path))
    for check in ("dtypes", "budget", "dtensor", "landing", "rng", "tensor_aware", "speed"):
        assert f"[{check}]" in out, check
    assert "summary on CPU dry run: 0 mismatch(es)" in out
    assert "FAILED" not in out


def test_gpu_restore_dry_run_restores_every_method_bitwise(tmp_path):
    """Each restore is checked bitwise by the script (an AssertionError ends it non-zero); here,
    that both tables list every method and the files are removed."""
    out = _run("benchmarks.gpu_restore", "--size", "16MiB", "--reps", "1", "--dir", str(tmp_path))
    for temp in ("warm", "cold"):
        assert f"{temp}, 16 MiB onto CPU dry run" in out
    for method in ("raw", "statesnap", "torch.load", "safetensors"):
        rows = [line for line in out.splitlines() if line.startswith(f"| {method} |")]
        assert len(rows) == 2, (method, out)
    assert os.listdir(tmp_path) == []
