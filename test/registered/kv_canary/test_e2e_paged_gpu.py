"""Paged KV pools end to end on a GPU: sglang 0.5.12's paged allocator
runs Triton kernels, so its CPU engine serves only page size 1 and these runs need CUDA.

At ``--page-size`` 16 and 64:

- clean: the canary in raise mode, the radix sweep, real-data fingerprints and token checks
  reports nothing and matches the canary off token for token;
- faults: one ``--kv-canary log`` server with every fault class of the perturbation framework
  injected (``req_to_token``, the three real-KV byte flips, a token swap under the token
  oracle) catches each and serves its whole workload (fault injection undoes what it changed
  in ``req_to_token`` once the forward has read it: a leftover entry makes sglang free another
  request's page and leak its own, and its pool checker then stops the server); the demo's
  GPU-only case, ``host_kv`` (HiCache at that page size, a byte flipped in host memory), is
  found in log mode as well."""

from __future__ import annotations

import json
import subprocess
import sys
import pytest
from e2e_checks import EVERY_FAULT_WITH_ORACLE_ENV, assert_every_fault_caught, demo_failure
from e2e_workload import run_mixed_workload

from sglang.srt.kv_canary.violations.lines import VIOLATION_LINE_PREFIX
from sglang.srt.kv_canary.demo.server_harness import write_tiny_llama
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=960, stage="base-b", runner_config="1-gpu-small")
# its lanes in the GPU suite (test/gpu_lanes.py): name -> (pytest -k, est. seconds)
GPU_LANES = {
    "paged_clean_16": ("clean and 16", 260),
    "paged_clean_64": ("clean and 64", 260),
    "paged_faults_16": ("log_mode and 16", 220),
    "paged_faults_64": ("log_mode and 64", 220),
}

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

PAGE_SIZES = (16, 64)


def _workload(model, mode, page_size, env_extra=None, extra=None):
    args = dict(
        page_size=page_size,
        chunked_prefill_size=max(64, page_size),
        max_total_tokens=4096,
        max_running_requests=8,
        log_level="info",
        **(extra or {}),
    )
    return run_mixed_workload(model, mode, args, device="cuda", env_extra=env_extra)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(
        tmp_path_factory.mktemp("paged_model"),
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_clean_run_quiet_and_identical(model, page_size):
    rc_off, out_off, res_off = _workload(model, "none", page_size)
    assert rc_off == 0 and res_off is not None, out_off[-4000:]
    rc, out, res = _workload(
        model,
        "raise",
        page_size,
        {
            "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
            "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "10",
        },
        dict(kv_canary_sweep_interval=2, kv_canary_real_data="partial"),
    )
    assert rc == 0, out[-4000:]
    assert res == res_off
    assert VIOLATION_LINE_PREFIX not in out and "health check failed" not in out
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert stats and "violations=0" in stats[-1] and " sweep_passes=0 " not in stats[-1]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_log_mode_catches_every_fault_in_one_server(model, page_size):
    rc, out, res = _workload(
        model,
        "log",
        page_size,
        dict(EVERY_FAULT_WITH_ORACLE_ENV),
        dict(kv_canary_sweep_interval=2, kv_canary_real_data="partial"),
    )
    assert rc == 0 and res is not None and len(res) == 48, out[-4000:]  # served to the end
    assert_every_fault_caught(out, also_injected=("next_token_swap",))
    assert "memory leak detected" not in out and "Traceback" not in out, out[-4000:]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_log_mode_demo_host_kv(page_size, tmp_path):
    out_json = tmp_path / "demo.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.srt.kv_canary.demo",
            "--device",
            "cuda",
            "--mode",
            "log",
            "--page-size",
            str(page_size),
            "--cases",
            "host_kv",
            "--json",
            str(out_json),
            "--logs",
            str(tmp_path / "logs"),
            "--timeout",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    print(proc.stdout)
    assert proc.returncode == 0, demo_failure(out, tmp_path / "logs", "host_kv")
    (row,) = json.loads(out_json.read_text())
    assert row["name"] == "host_kv" and row["mode"] == "log", row
    assert row["returncode"] == 0 and row["finished"], row  # served to the end
    assert row["injections"] > 0 and row["detected"], row
    logs = "".join(f.read_text() for f in sorted((tmp_path / "logs").glob("*.log")))
    assert "memory leak detected" not in logs and "Traceback" not in logs


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
