"""The write kernels compile for an sm_90 GPU (``kernel_compile.py``, in a process of its own
with the interpreter off): CPU CI runs the kernels in Triton's interpreter, which accepts Python
the compiler rejects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")

HERE = Path(__file__).resolve().parent


def test_write_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(HERE / "kernel_compile.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    compiled = [line for line in run.stdout.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == 8, run.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
