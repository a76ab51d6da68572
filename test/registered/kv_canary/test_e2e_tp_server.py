"""On the CPU: tensor parallelism (``tp_size=2``) on sglang 0.5.12's CPU engine (each
rank with its own ``MHATokenToKVPool``; one OpenMP thread set per rank, pynccl off). Clean with
raise + sweep + real data + token checks: no violation and the greedy outputs of the canary
off. ``SGLANG_KV_CANARY_PERTURB_TP_RANK=1``: only rank 1 injects faults and reports them, rank
0 stays clean; in raise mode the whole server stops with the structured line (docs/user_guide.md,
"Deployments")."""

from __future__ import annotations

import sys

import pytest
from e2e_checks import (
    TP_RANK_1_FAULT,
    assert_tp2_clean,
    assert_tp2_fault_on_rank_1_only,
    run_workload,
)

from sglang.srt.kv_canary.demo.server_harness import (
    build_libcuda_stub,
    cpu_server_env,
    write_tiny_llama,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=280, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow

ARGS = dict(
    tp_size=2,
    chunked_prefill_size=32,
    max_total_tokens=512,
    max_running_requests=4,
    log_level="info",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_server")
    env = cpu_server_env(build_libcuda_stub(root / "stub"))
    env = {k: v for k, v in env.items() if not k.startswith("SGLANG_KV_CANARY_")}
    env["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank
    env["SGLANG_NCCL_SO_PATH"] = str(root / "no-nccl.so")  # pynccl off: gloo on the CPU
    # 4 KV heads: 2 per rank
    model = write_tiny_llama(root / "model", num_attention_heads=4, num_key_value_heads=4)
    return dict(model=model, env=env)


def run(server, env_extra=None, **engine_kwargs):
    return run_workload(
        "small_workload.py",
        server["model"],
        dict(ARGS, **engine_kwargs),
        dict(server["env"], **(env_extra or {})),
        timeout=900,
    )


def test_tp2_clean_matches_canary_off(server):
    rc, out, off = run(server)
    assert rc == 0 and off is not None, out[-3000:]
    rc, out, on = run(
        server,
        {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"},
        kv_canary="raise",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
    )
    assert_tp2_clean(rc, out, on, off)


def test_a_fault_on_one_rank_is_reported_by_that_rank_only_and_raise_stops_the_server(server):
    """One server run (raise mode): rank 1 injects, rank 0 says it has no fault injection,
    and the whole server stops with the structured lines in rank 1's error (the raise
    message names the rank: it carries no log prefix)."""
    rc, out, res = run(server, TP_RANK_1_FAULT, kv_canary="raise")
    assert_tp2_fault_on_rank_1_only(rc, out, res)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
