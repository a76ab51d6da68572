"""sglang 0.5.12's unified radix tree (``SGLANG_ENABLE_UNIFIED_RADIX_TREE=1``: one node type with
per-component data instead of ``RadixCache``'s nodes) on its CPU engine: the sweep walks it as
it walks the other trees (docs/user_guide.md, "Supported pools"). Clean with raise + sweep +
real data + token checks: no violation; under every
fault class (log mode, one server) each injected fault is reported, a byte flipped in a slot
only the tree holds by the sweep."""

from __future__ import annotations

import sys

import pytest
from e2e_checks import EVERY_FAULT_ENV, assert_every_fault_caught, run_workload

from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.kv_canary.demo.server_harness import (
    build_libcuda_stub,
    cpu_server_env,
    write_tiny_llama,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=70, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow

ARGS = dict(chunked_prefill_size=32, max_total_tokens=256, max_running_requests=4, log_level="info")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("unified_radix")
    env = cpu_server_env(build_libcuda_stub(root / "stub"))
    env = {k: v for k, v in env.items() if not k.startswith("SGLANG_KV_CANARY_")}
    env["SGLANG_ENABLE_UNIFIED_RADIX_TREE"] = "1"
    return dict(model=write_tiny_llama(root / "model"), env=env)


def run(server, env_extra=None, **engine_kwargs):
    return run_workload(
        "small_workload.py",
        server["model"],
        dict(ARGS, **engine_kwargs),
        dict(server["env"], **(env_extra or {})),
        timeout=600,
    )


def test_unified_tree_clean(server):
    """(The canary never changes what sglang computes: the outputs against the canary off are
    compared on the default tree in test_e2e_server.py; CI time.)"""
    rc, out, on = run(
        server,
        {
            "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
            "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "5",
        },
        kv_canary="raise",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
    )
    assert rc == 0 and on is not None and len(on) == 12, out[-3000:]
    assert "Init Unified RadixTree" in out  # sglang really built the unified tree
    assert parse_violation_lines(out) == []
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert stats and "violations=0" in stats[-1] and "SWEEP_K_FULL" in stats[-1], stats[-1:]


def test_unified_tree_every_fault_class_is_caught(server):
    rc, out, res = run(
        server,
        EVERY_FAULT_ENV,
        kv_canary="log",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
    )
    assert rc == 0 and res is not None and len(res) == 12, out[-3000:]
    assert_every_fault_caught(out)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
