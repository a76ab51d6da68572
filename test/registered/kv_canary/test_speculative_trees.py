"""EAGLE draft trees (``--speculative-eagle-topk`` > 1, spec v1) on real sglang 0.5.12 pools
and ForwardBatches (``eagle_tree_driver.py``; docs/speculative_trees.md): the draft round's
lanes planned one row per lane, the target verify's tree written along each node's path, the
accepted path re-pointed and read by the next round. Clean runs report nothing; a wrong
re-pointing and a flattened acceptance are reported."""

from __future__ import annotations

import logging
import sys

import pytest

from eagle_tree_driver import EagleTreeDriver
from sglang.jit_kernel.kv_canary import CanaryLaunchTag
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="stage-a-test-cpu")


@pytest.mark.parametrize("topk, steps, num_draft", [(2, 3, 6), (4, 2, 9), (2, 1, 3), (3, 4, 12)])
def test_tree_rounds_run_clean_with_token_checks(topk, steps, num_draft, caplog):
    """Raise mode, real-data fingerprints and token checks: rounds of random trees (orphans
    included) over both pools report nothing, with nodes accepted past the first child."""
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        d = EagleTreeDriver(topk=topk, steps=steps, num_draft=num_draft, seed=3, verify_tokens=True)
        d.run(28)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert d.target.count_violations() == 0 and d.draft.count_violations() == 0
    assert d.rounds >= 10 and d.accepted >= 10 and d.rejected >= 10
    assert len(d.finished) >= 3
    for manager in (d.target, d.draft):
        assert int(manager.state.slot_run_counters[CanaryLaunchTag.HEAD_K_FULL]) > 300
    # the draft canary planned each lane as its own row
    assert d.draft.sfms[0].plan_input.lanes is not None
    assert d.target.sfms[0].tree is not None and d.target.sfms[0].tree.max_depth == steps + 1


def test_replayed_draft_rounds_check_each_lane_against_its_own_request_s_tokens():
    """Draft rounds replayed from the draft graph (every other round): the graph's token
    scatter puts each request's history in its own expected-token row, not one per lane (the
    lanes of requests b and b + 1 would share rows and a lane compare its draft KV with another
    request's tokens): clean rounds report nothing."""
    d = EagleTreeDriver(
        topk=2, steps=3, num_draft=6, seed=5, verify_tokens=True, replay_draft_rounds=True
    )
    d.run(28)
    assert d.replayed_rounds >= 5 and d.rounds - d.replayed_rounds >= 5
    assert d.draft.count_violations() == 0 and d.target.count_violations() == 0
    assert int(d.draft.state.slot_run_counters[CanaryLaunchTag.HEAD_K_FULL]) > 300


def test_a_rejected_node_re_pointed_into_the_path_is_reported():
    """The accepted path's first position re-pointed at a rejected node of the same depth
    (another token): the next round reads it and the canary stops the raise server."""
    d = EagleTreeDriver(topk=3, steps=3, num_draft=8, seed=5, verify_tokens=True, accept_prob=0.8)
    d.run(12)
    assert d.target.count_violations() == 0
    d.plant_rejected_sibling()
    with pytest.raises(RuntimeError, match="KV-cache corruption") as exc:
        d.run(6, arrivals=0.0)
    (fault,) = d.fault_log
    seen = parse_violation_lines(str(exc.value))
    # the target's records: the token at the re-pointed position (its chain holds: the
    # rejected node hangs off the same root), or the chain of the position after it
    assert any(
        (v.position == fault["position"] and "verify_token" in v.fail_reasons)
        or (v.position == fault["position"] + 1 and "verify_chain_hash" in v.fail_reasons)
        for v in seen
    ), (fault, seen)
    assert all(v.rids[0] == str(fault["rid"]) for v in seen), seen


def test_a_flattened_acceptance_is_reported():
    """Nodes ``0 .. acc`` accepted in node order where that is no root path (sglang's
    ``SGLANG_SIMULATE_ACC_LEN`` with topk > 1): the next round's read of them is reported."""
    d = EagleTreeDriver(topk=2, steps=4, num_draft=8, seed=9, verify_tokens=True, accept_prob=0.9)
    d.run(12)
    assert d.target.count_violations() == 0
    d.plant_flattened_acceptance()
    with pytest.raises(RuntimeError, match="KV-cache corruption") as exc:
        d.run(8, arrivals=0.0)
    assert d.fault_log and d.fault_log[0]["kind"] == "flattened"
    seen = parse_violation_lines(str(exc.value))
    assert {v.rids[0] for v in seen} <= {str(f["rid"]) for f in d.fault_log}, seen


def test_a_lane_is_verified_from_its_own_columns():
    """A KV byte of the second lane's first draft step flipped after the draft round's first
    forward: its second forward verifies that lane's own step (the lane's column, past the
    first lane's) and the draft canary reports the slot."""
    d = EagleTreeDriver(topk=2, steps=3, num_draft=6, seed=4, verify_tokens=True)
    d.run(10)
    assert d.draft.count_violations() == 0
    d.plant_lane_flip()
    with pytest.raises(RuntimeError, match="draft model's KV pool") as exc:
        d.run(3, arrivals=0.0)
    (fault,) = d.fault_log
    seen = parse_violation_lines(str(exc.value))
    assert {(v.slot_idx, v.fail_reasons) for v in seen} == {
        (fault["slot"], ("verify_real_kv_hash",))
    }, seen


@pytest.mark.parametrize("bug", [False, True], ids=["fixed", "bug"])
def test_pr25015_tree_draft_positions_advanced_before_the_forward(bug):
    """Upstream PR 25015 with draft trees: every lane's positions advanced before each draft
    forward, so each lane wrote step i at position L + i + 1; the draft canary reports the
    positions, the target's nothing. The same workload without the bug is clean."""
    d = EagleTreeDriver(topk=2, steps=3, seed=10, bug_positions_before_forward=bug)
    if not bug:
        d.run(28)
        assert d.target.count_violations() == 0 and d.draft.count_violations() == 0
        return
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.run(28)
    seen = parse_violation_lines(str(exc.value))
    assert {r for v in seen for r in v.fail_reasons} & {"verify_position", "write_position"}
    assert d.target.violations.total == 0 and d.draft.violations.total >= 1


@pytest.mark.parametrize("bug", [False, True], ids=["fixed", "bug"])
def test_pr26329_tree_chunk_end_draft_input_uses_the_sampled_token(bug):
    """Upstream PRs 26329 / 26800 with draft trees (the prefill is the same as topk 1's): the
    draft KV at a non-final chunk's last position computed from the sampled token; the draft
    canary's token check reports exactly those positions. Without the bug: clean."""
    d = EagleTreeDriver(
        topk=2, steps=3, seed=12, verify_tokens=True, bug_chunk_end_uses_sampled_token=bug
    )
    if not bug:
        d.run(28)
        assert d.chunked >= 1
        assert d.target.count_violations() == 0 and d.draft.count_violations() == 0
        return
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.run(28)
    seen = parse_violation_lines(str(exc.value))
    assert {r for v in seen for r in v.fail_reasons} == {"verify_token"}
    assert all(v.position % d.chunk == d.chunk - 1 for v in seen), [v.position for v in seen]
    assert d.target.violations.total == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
