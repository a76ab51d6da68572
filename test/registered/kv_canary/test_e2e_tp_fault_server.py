"""On the CPU: a fault on one rank of a tensor-parallel server (``tp_size=2`` on sglang
0.5.12's CPU engine; the settings of ``test_e2e_tp_server.py``, from ``e2e_checks``).
``SGLANG_KV_CANARY_PERTURB_TP_RANK=1``: only rank 1 injects faults and reports them, rank 0
stays clean; in raise mode the whole server stops with the structured line (docs/user_guide.md,
"Deployments")."""

from __future__ import annotations

import sys

import pytest
from e2e_checks import (
    TP_RANK_1_FAULT,
    assert_tp2_fault_on_rank_1_only,
    run_tp2_cpu,
    tp2_cpu_server,
)

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=105, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow


def test_a_fault_on_one_rank_is_reported_by_that_rank_only_and_raise_stops_the_server(tmp_path):
    """One server run (raise mode): rank 1 injects, rank 0 says it has no fault injection,
    and the whole server stops with the structured lines in rank 1's error (the raise
    message names the rank: it carries no log prefix)."""
    rc, out, res = run_tp2_cpu(tp2_cpu_server(tmp_path), TP_RANK_1_FAULT, kv_canary="raise")
    assert_tp2_fault_on_rank_1_only(rc, out, res)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
