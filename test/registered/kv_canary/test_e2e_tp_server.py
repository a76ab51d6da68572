"""On the CPU: tensor parallelism (``tp_size=2``) on sglang 0.5.12's CPU engine (each
rank with its own ``MHATokenToKVPool``; one OpenMP thread set per rank, pynccl off). One
canary-on server (raise + sweep + real data + token checks) serves the clean workload first:
the greedy outputs of the canary off, nothing reported. Then rank 1's fault injection starts
(``SGLANG_KV_CANARY_PERTURB_TP_RANK=1``, its warm-up past every forward of the clean phase):
only rank 1 injects faults and reports them, rank 0 stays clean, and in raise mode the whole
server stops with the structured line (docs/user_guide.md, "Deployments").
Abort mode with TP 2: ``test_e2e_tp_abort_server.py``."""

from __future__ import annotations

import sys

import pytest
from e2e_checks import (
    TP_RANK_1_FAULT_AFTER_CLEAN,
    assert_tp2_clean_then_fault_on_rank_1,
    run_tp2_cpu,
    tp2_cpu_server,
)

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=150, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow


def test_tp2_clean_matches_canary_off_then_a_fault_on_rank_1_stops_the_server(tmp_path):
    """The canary-off server's outputs; then one canary-on server: its clean phase's outputs
    are those, nothing reported, and its last forward comes before the first injection (the
    stats lines' steps); then rank 1 injects, rank 0 says it has no fault injection, and the
    whole server stops with the structured lines in rank 1's error (the raise message names
    the rank: it carries no log prefix)."""
    server = tp2_cpu_server(tmp_path)
    rc, out, off = run_tp2_cpu(server)
    assert rc == 0 and off is not None, out[-3000:]
    rc, out, res = run_tp2_cpu(
        server,
        TP_RANK_1_FAULT_AFTER_CLEAN,
        script="clean_then_fault_workload.py",
        kv_canary="raise",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
    )
    assert_tp2_clean_then_fault_on_rank_1(rc, out, res, off)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
