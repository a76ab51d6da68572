"""NGRAM speculative decoding (``--speculative-algorithm NGRAM``, page size 1) on real sglang
0.5.12 pools, ForwardBatches and ``NgramVerifyInput`` (``ngram_driver.py``;
docs/speculative_standalone_ngram.md, "2. NGRAM (n-gram lookup, no draft model)"): the target verify's trees of the n-gram
corpus (BFS order, padding siblings under the root) written along each node's path, the
accepted path re-pointed and read by the next round. Clean runs report nothing; a wrong
re-pointing and a flattened acceptance are reported. Start-up and install:
``test_speculative_install.py``."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from ngram_driver import NgramDriver
from sglang.jit_kernel.kv_canary import CanaryLaunchTag
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")


@pytest.mark.parametrize("num_draft, breadth", [(2, 1), (6, 1), (6, 3), (12, 10)])
def test_ngram_rounds_run_clean_with_token_checks(num_draft, breadth, caplog):
    """Raise mode, real-data fingerprints and token checks: rounds of corpus-shaped trees
    (padding siblings at ``L + 1`` even at breadth 1) report nothing, with drafts accepted and
    rejected, and at breadth > 1 paths through a node that is not its parent's first child."""
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        d = NgramDriver(
            num_draft=num_draft, breadth=breadth, seed=3, verify_tokens=True, accept_prob=0.7
        )
        d.run(28)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert d.target.count_violations() == 0 and d.draft is None
    assert d.rounds >= 10 and d.accepted >= 5 and d.rejected >= 10
    assert len(d.finished) >= 3
    if breadth > 1:
        assert d.branch_accepted >= 1
    assert int(d.target.state.slot_run_counters[CanaryLaunchTag.HEAD_K_FULL]) > 300
    assert d.target.sfms[0].tree is not None and d.target.sfms[0].tree.max_depth == num_draft


def _clean_then_planted(d: NgramDriver, plant) -> list:
    """Three long requests run clean for 8 steps, then ``plant()`` and the run that must stop
    the raise server on it; the violation lines of its report."""
    for _ in range(3):
        d.add_request(d.rng.randint(8, 40), 60)
    d.run(8, arrivals=0.0)
    assert d.target.count_violations() == 0
    plant()
    with pytest.raises(RuntimeError, match="KV-cache corruption") as exc:
        d.run(12, arrivals=0.0)
    return parse_violation_lines(str(exc.value))


def test_a_rejected_node_re_pointed_into_the_path_is_reported():
    """The accepted path's first position re-pointed at a rejected sibling (another token,
    a padding node included): the next round reads it and the canary stops the raise
    server, naming the request."""
    d = NgramDriver(num_draft=6, breadth=3, seed=5, verify_tokens=True, accept_prob=0.8)
    seen = _clean_then_planted(d, d.plant_rejected_sibling)
    faults = d.fault_log  # one per request of the round that had a rejected sibling
    assert faults and {f["kind"] for f in faults} == {"rejected_sibling"}
    assert any(
        v.rids[0] == str(f["rid"])
        and (
            (v.position == f["position"] and "verify_token" in v.fail_reasons)
            or (v.position == f["position"] + 1 and "verify_chain_hash" in v.fail_reasons)
        )
        for v in seen
        for f in faults
    ), (faults, seen)
    assert {v.rids[0] for v in seen} <= {str(f["rid"]) for f in faults}, seen


def test_a_flattened_acceptance_is_reported():
    """Nodes ``0 .. acc`` accepted in node order where that is no root path (siblings in BFS
    order, padding included): the next round's read of them is reported."""
    d = NgramDriver(num_draft=8, breadth=3, seed=9, verify_tokens=True, accept_prob=0.9)
    seen = _clean_then_planted(d, d.plant_flattened_acceptance)
    assert d.fault_log and d.fault_log[0]["kind"] == "flattened"
    assert {v.rids[0] for v in seen} <= {str(f["rid"]) for f in d.fault_log}, seen


def test_an_accepted_node_s_flipped_kv_byte_is_reported():
    """A KV byte of the slot of the last verify's deepest accepted node (written by the tree
    verify, re-pointed into the request's row) flipped: the next round's verify of the
    request's prefix reports that slot (its real-data fingerprint)."""
    d = NgramDriver(num_draft=6, breadth=3, seed=11, verify_tokens=True)
    fault = {}

    def flip():
        victim = d.committed_victim()
        slot = int(d.req_to_token_pool.req_to_token[victim.row, victim.kv_len - 1])
        d.target_pool.k_buffer[0][slot].view(torch.uint8).view(-1)[0] ^= 0xFF
        fault.update(rid=victim.rid, slot=slot)

    seen = _clean_then_planted(d, flip)
    assert any(v.slot_idx == fault["slot"] for v in seen), (fault, seen)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
