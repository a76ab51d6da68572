"""On the CPU: tensor parallelism (``tp_size=2``) on sglang 0.5.12's CPU engine (each
rank with its own ``MHATokenToKVPool``; one OpenMP thread set per rank, pynccl off). Clean with
raise + sweep + real data + token checks: no violation and the greedy outputs of the canary
off (docs/user_guide.md, "Deployments"). A fault on one rank: ``test_e2e_tp_fault_server.py``
(a file of its own: the two run side by side on CI's two workers)."""

from __future__ import annotations

import sys

import pytest
from e2e_checks import assert_tp2_clean, run_tp2_cpu, tp2_cpu_server

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=215, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow


def test_tp2_clean_matches_canary_off(tmp_path):
    server = tp2_cpu_server(tmp_path)
    rc, out, off = run_tp2_cpu(server)
    assert rc == 0 and off is not None, out[-3000:]
    rc, out, on = run_tp2_cpu(
        server,
        {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"},
        kv_canary="raise",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
    )
    assert_tp2_clean(rc, out, on, off)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
