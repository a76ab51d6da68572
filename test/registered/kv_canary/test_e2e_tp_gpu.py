"""Tensor parallelism on two GPUs (``tp_size=2``, one rank per GPU, NCCL, decode CUDA graphs):
each rank guards its own ``MHATokenToKVPool``. Clean with raise + sweep + real data + token
checks: no violation and the greedy outputs of the canary off. With
``SGLANG_KV_CANARY_PERTURB_TP_RANK=1`` only rank 1 injects faults and reports them, rank 0
stays clean, and in raise mode the whole server stops with rank 1's structured line
(docs/user_guide.md, "Deployments"). The CPU engine's twin: ``test_e2e_tp_server.py``."""

from __future__ import annotations

import os
import re
import sys

import pytest
from e2e_checks import (
    TP_RANK_1_FAULT,
    assert_tp2_clean,
    assert_tp2_fault_on_rank_1_only,
    run_workload,
)

from sglang.srt.kv_canary.demo.server_harness import write_tiny_llama
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=420, stage="base-b", runner_config="2-gpu-h200")
# its lanes in the GPU suite (test/gpu_lanes.py): name -> (pytest -k, est. seconds); each lane
# gets the file's two GPUs
GPU_LANES = {"tp2_clean": ("clean", 260), "tp2_fault": ("fault", 160)}

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

ARGS = dict(
    tp_size=2,
    chunked_prefill_size=64,
    max_total_tokens=1024,
    max_running_requests=8,
    log_level="info",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.fail(
            f"needs two GPUs, sees {torch.cuda.device_count()}: run it as its GPU lane "
            "(test/gpu_lanes.py gives it two)"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_KV_CANARY_")}
    env["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast on the lent machines
    # 4 KV heads: 2 per rank
    model = write_tiny_llama(
        tmp_path_factory.mktemp("tp_gpu_model"),
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    return dict(model=model, env=env)


def run(server, env_extra=None, **engine_kwargs):
    return run_workload(
        "small_workload.py",
        server["model"],
        dict(ARGS, **engine_kwargs),
        dict(server["env"], **(env_extra or {})),
        "cuda",
        timeout=600,
    )


def test_tp2_clean_on_two_gpus_matches_canary_off(server):
    rc, out, off = run(server)
    assert rc == 0 and off is not None, out[-3000:]
    rc, out, on = run(
        server,
        {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"},
        kv_canary="raise",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
        decode_log_interval=1,  # a "Decode batch" line per step: it says whether a graph ran
    )
    assert_tp2_clean(rc, out, on, off)
    assert re.search(r"Decode batch.*cuda graph: True", out), "decode never used a CUDA graph"


def test_a_fault_on_rank_1_of_two_gpus_is_reported_by_that_rank_and_raise_stops_the_server(
    server,
):
    """Rank 1 injects, rank 0 says it has no fault injection, and the whole server stops with
    the structured lines in rank 1's error (the raise message names the rank)."""
    rc, out, res = run(server, TP_RANK_1_FAULT, kv_canary="raise")
    assert_tp2_fault_on_rank_1_only(rc, out, res)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
