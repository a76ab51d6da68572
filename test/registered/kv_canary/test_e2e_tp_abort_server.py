"""On the CPU: ``--kv-canary abort`` with tensor parallelism (``tp_size=2``) on sglang 0.5.12's
CPU engine (each rank with its own ``MHATokenToKVPool``; one OpenMP thread set per rank,
pynccl off). Rank 1 alone injects faults (``SGLANG_KV_CANARY_PERTURB_TP_RANK=1``); both ranks
contain its reports together at one iteration and the server serves on
(docs/multi_rank_abort_design.md). The raise-mode twin: ``test_e2e_tp_server.py``. Its own
file, so that the two TP 2 servers run on different CI workers."""

from __future__ import annotations

import sys

import pytest
from canary_support.storm import ABORT_MESSAGE
from e2e_checks import TP_RANK_1_FAULT, lines_by_tp_rank, run_tp2_cpu, tp2_cpu_server

from sglang.srt.kv_canary.perturb.report import PERTURB_LINE_PREFIX
from sglang.srt.kv_canary.violations.containment import NOTICE_LINE_PREFIX, parse_notice_lines
from sglang.srt.kv_canary.violations.lines import parse_violation_lines

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=110, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow


def test_tp2_abort_a_fault_on_rank_1_aborts_the_same_requests_on_both_ranks_and_keeps_serving(
    tmp_path,
):
    """``--kv-canary abort`` with TP 2 (``e2e_support/abort_workload.py short``: two waves
    of six requests sharing a prefix, then a later wave) and ``req_to_token`` faults on rank 1 only:
    rank 1 reports, both ranks apply its containment at the same iteration (each logs the
    same request ids), those requests end with the canary's abort message, every other
    request and the later wave complete, and neither rank's scheduler finds a leak (sglang
    checks its pool's accounting when idle and stops on a mismatch)."""
    server = tp2_cpu_server(tmp_path)
    rc, out, res = run_tp2_cpu(server, TP_RANK_1_FAULT, "cpu", "short", script="abort_workload.py")
    assert rc == 0 and res is not None, out[-4000:]
    assert sorted(lines_by_tp_rank(out, PERTURB_LINE_PREFIX)) == [1], out[-4000:]
    violations = parse_violation_lines(out)
    assert violations, out[-4000:]
    assert "corruption on tp_rank 0" not in out
    applied = {
        rank: parse_notice_lines("\n".join(lines))
        for rank, lines in lines_by_tp_rank(out, NOTICE_LINE_PREFIX).items()
    }
    assert sorted(applied) == [0, 1] and applied[0] == applied[1], applied
    assert all(origin == "tp_rank 1, pp_rank 0, dp_rank 0" for origin, _ in applied[0])
    aborted = {rid for _, rids in applied[0] for rid in rids}
    results = res["results"]
    errors = {rid: r["error"] for rid, r in results.items() if "error" in r}
    assert aborted and set(errors) == aborted, (errors, applied)
    assert all(ABORT_MESSAGE in e for e in errors.values()), errors
    assert all(r.get("ok") == 16 for rid, r in results.items() if rid not in aborted)
    assert all(r.get("ok") == 16 for r in res["later"].values()), res["later"]
    assert res["server_info"]["kv_canary"] == "abort"
    assert "memory leak" not in out and "Traceback" not in out, out[-4000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
