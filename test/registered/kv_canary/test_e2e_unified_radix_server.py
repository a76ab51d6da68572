"""sglang 0.5.12's unified radix tree (``SGLANG_ENABLE_UNIFIED_RADIX_TREE=1``: one node type with
per-component data instead of ``RadixCache``'s nodes) on its CPU engine: the sweep walks it as
it walks the other trees (docs/user_guide.md, "Supported pools"). One server (log mode, sweep +
real data + token checks), a clean phase, then every fault class: the clean phase reports no
violation; each fault injected after it is reported, a byte flipped in a slot only the tree
holds by the sweep."""

from __future__ import annotations

import sys

import pytest
from e2e_checks import (
    EVERY_FAULT_ENV,
    assert_clean_phase_then_faults,
    assert_every_fault_caught,
    run_workload,
)

from sglang.srt.kv_canary.demo.server_harness import (
    build_libcuda_stub,
    cpu_server_env,
    write_tiny_llama,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow

ARGS = dict(chunked_prefill_size=32, max_total_tokens=256, max_running_requests=4, log_level="info")
# faults only past the clean phase (small_workload.py's waves: 32 forwards)
WARMUP = 50


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``small_workload.py two-phase`` on the unified tree: the waves clean, then the faults
    of :data:`EVERY_FAULT_ENV` from step ``WARMUP`` on, while the second phase's waves run."""
    root = tmp_path_factory.mktemp("unified_radix")
    env = cpu_server_env(build_libcuda_stub(root / "stub"))
    env = {k: v for k, v in env.items() if not k.startswith("SGLANG_KV_CANARY_")}
    env["SGLANG_ENABLE_UNIFIED_RADIX_TREE"] = "1"
    env.update(
        EVERY_FAULT_ENV,
        SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS=str(WARMUP),
        SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS="1",
    )
    kwargs = dict(ARGS, kv_canary="log", kv_canary_real_data="partial", kv_canary_sweep_interval=2)
    rc, out, res = run_workload(
        "small_workload.py",
        write_tiny_llama(root / "model"),
        kwargs,
        env,
        "cpu",
        "two-phase",
        timeout=600,
    )
    assert rc == 0 and res is not None, out[-3000:]
    return out, res


def test_unified_tree_clean(run):
    """The clean phase: no violation, the sweep ran. (The canary never changes what sglang
    computes: the outputs against the canary off are compared on the default tree in
    test_e2e_server.py; CI time.)"""
    out, res = run
    assert len(res["clean"]) == 12 and "Init Unified RadixTree" in out  # sglang's unified tree
    clean_stats = assert_clean_phase_then_faults(out, warmup=WARMUP)
    assert "SWEEP_K_FULL" in clean_stats, clean_stats  # the sweep ran in it


def test_unified_tree_every_fault_class_is_caught(run):
    out, res = run
    assert len(res["second"]) == 24
    assert_every_fault_caught(out)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
