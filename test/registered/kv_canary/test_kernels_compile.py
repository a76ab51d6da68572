"""Every Triton kernel of ``sglang.jit_kernel.kv_canary`` compiles for an sm_90 GPU, in the
variants the kernel suites launch (``kernel_compile_plugin.py``: the suites below run in a
process of their own with every launch compiled by Triton's compiler and ptxas instead of run).
CPU CI otherwise runs the kernels only in Triton's interpreter, which accepts Python the
compiler rejects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")

HERE = Path(__file__).resolve().parent
# the suites whose launches are compiled: together they launch every kernel of the package
SUITES = (
    "test_kernels_fuzz.py",
    "test_kernels_hand.py",
    "test_kernels_tree_write.py",
    "test_deep_fingerprints.py",
    "test_eager_graphs.py",
)
# their tests that build host pools (slow, and no launch the others lack)
DESELECT = "not host_tier and not host_pool and not host_copy"


def test_every_kernel_compiles_for_sm90_in_the_suites_variants(tmp_path):
    report = tmp_path / "compile.json"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "KV_CANARY_COMPILE_REPORT": str(report),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "kernel_compile_plugin", "-o", "addopts="]
        + ["-p", "no:cacheprovider", *SUITES, "-k", DESELECT],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(report.read_text())
    assert not got["failures"], "\n\n".join(
        f"{f['kernel']} {f['constexprs']}:\n{f['error']}" for f in got["failures"]
    )
    assert got["kernels"], "no kernel found in the package"
    missing = sorted(set(got["kernels"]) - set(got["compiled"]))
    assert not missing, f"kernels no suite above launches (add one to SUITES): {missing}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
