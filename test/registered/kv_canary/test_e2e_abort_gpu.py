"""Abort mode on the GPU: ``sglang.Engine(kv_canary="abort")`` with CUDA graphs (and sglang's
overlap scheduler), reports one forward late as the GPU read-back does: a clean run aborts
nothing; under two injected ``req_to_token`` faults the touched requests end with the canary's
message and every other and later request completes. Then abort mode's storm
(``canary_support/storm.py``, as the CPU soak test runs it) on a GPU ``launch_server`` at page sizes 1
and 16: every fault class, the kept ``req_to_token`` entry among them, eight clients, sglang's
strict pool checks; every check of the storm must pass."""

from __future__ import annotations

import os
import sys

import pytest
from test_e2e_abort_server import MAX_NEW, check_engine_abort_run, run_abort_engine

from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.kv_canary.demo.server_harness import write_tiny_llama
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=660, stage="base-b", runner_config="1-gpu-small")
GPU_LANES = {
    "e2e_abort_gpu": ("not storm", 180),
    "abort_storm_gpu_page_1": ("storm and one_slot_pages", 240),
    "abort_storm_gpu_page_16": ("storm and sixteen_slot_pages", 240),
}
STORM_SECONDS = 120

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

ARGS = dict(
    chunked_prefill_size=64,
    max_total_tokens=1024,
    max_running_requests=8,
    log_level="info",
    kv_canary_real_data="partial",
    kv_canary_sweep_interval=8,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(
        tmp_path_factory.mktemp("gpu_model"),
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _env(**extra):
    env = dict(os.environ, SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT="1", **extra)
    return env


def test_abort_engine_on_gpu_clean(model):
    rc, out, res = run_abort_engine(model, _env(), "cuda", **ARGS)
    assert rc == 0 and res is not None, out[-4000:]
    assert parse_violation_lines(out) == [], out[-4000:]
    assert all(
        r.get("ok") == MAX_NEW for r in [*res["results"].values(), *res["later"].values()]
    ), res
    assert "cuda graph: True" in out


def test_abort_engine_on_gpu_contains_faults(model):
    env = _env(
        SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB="0.5",
        SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS="20",
        SGLANG_KV_CANARY_PERTURB_MAX_FAULTS="2",
    )
    rc, out, res = run_abort_engine(model, env, "cuda", **ARGS)
    check_engine_abort_run(rc, out, res)
    print("GPU abort run:", {k: v for k, v in res["results"].items() if "error" in v})


@pytest.mark.parametrize("page_size", [1, 16], ids=["one_slot_pages", "sixteen_slot_pages"])
def test_abort_mode_storm_on_the_gpu(tmp_path, page_size):
    from canary_support.storm import StormSettings, assert_storm_passed, run_storm

    figures = run_storm(
        StormSettings(
            mode="abort",
            seconds=STORM_SECONDS,
            idle_seconds=10,
            device="cuda",
            page_size=page_size,
            out=tmp_path,
        )
    )
    assert_storm_passed(figures, "GPU storm")
    assert figures["aborted"] > 0 and figures["completed"] > figures["aborted"], figures


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
