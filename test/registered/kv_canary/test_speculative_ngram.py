"""NGRAM speculative decoding (``--speculative-algorithm NGRAM``) on real sglang
0.5.12 pools, ForwardBatches and ``NgramVerifyInput`` (``ngram_driver.py``;
docs/speculative_standalone_ngram.md, "2. NGRAM (n-gram lookup, no draft model)"): the target verify's trees of the n-gram
corpus (BFS order, padding siblings under the root) written along each node's path, the
accepted path re-pointed (page size 1) or compacted with ``move_kv_cache`` (page size > 1,
the records following through the plugin's hook) and read by the next round. Clean runs
report nothing; a wrong re-pointing, a flattened acceptance and records left behind by a
compaction are reported. Start-up and install:
``test_speculative_install.py``."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from ngram_driver import NgramDriver
from sglang.jit_kernel.kv_canary import CanaryLaunchTag
from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

# the canary's kernels as the torch references but in the tests marked triton_interpreter
pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


@pytest.mark.parametrize(
    "num_draft, breadth",
    [pytest.param(2, 1, marks=pytest.mark.triton_interpreter), (6, 1), (6, 3), (12, 10)],
)
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


@pytest.mark.parametrize("num_draft, breadth", [(6, 3), (12, 10)])
def test_ngram_compacted_acceptance_runs_clean(num_draft, breadth):
    """Acceptance as sglang runs it at page size > 1: the accepted nodes' KV moved into the
    request's first verify slots (sglang's torch ``move_kv_cache``) with the plugin's hook on
    it, so the records follow the KV: clean rounds with token checks and real data report
    nothing, and compactions did move KV."""
    d = NgramDriver(
        num_draft=num_draft,
        breadth=breadth,
        seed=4,
        verify_tokens=True,
        accept_prob=0.7,
        compact_accepted=True,
    )
    d.run(28)
    assert d.target.count_violations() == 0
    assert d.moves >= 3 and d.branch_accepted >= 1 and d.accepted >= 5
    assert sglang_seam.kv_move_groups(d.target_pool) == tuple(d.target.groups)


def test_ngram_compaction_whose_records_stay_behind_is_reported(monkeypatch):
    """The same compaction with the hook doing nothing (the KV moved, the records left at
    the accepted nodes' slots): the next round's read of a moved slot finds another node's
    record there and the raise server stops."""
    from sglang.srt.kv_canary import plugin

    d = NgramDriver(
        num_draft=6, breadth=3, seed=4, verify_tokens=True, accept_prob=0.8, compact_accepted=True
    )
    monkeypatch.setattr(plugin, "_after_move_kv_cache", lambda result, *a, **k: result)
    with pytest.raises(RuntimeError, match="KV-cache corruption"):
        d.run(28)
    assert d.moves >= 1


def test_a_move_reads_every_source_row_before_it_writes_one():
    """``CanaryBufferGroup.mirror_kv_move`` with overlapping slots (a target that is also a
    later source, as a compaction's are): every buffer's target rows get the sources' rows as
    they were before the move, and a shape mismatch is refused."""
    d = NgramDriver(num_draft=6, breadth=3, seed=1)
    group = d.target.groups[0]
    bufs = [group.k_head, group.k_tail]
    for i, buf in enumerate(bufs):
        buf.copy_(torch.arange(buf.numel(), dtype=torch.int64).view(buf.shape).to(torch.uint8) + i)
    before = [buf.clone() for buf in bufs]
    tgt, src = torch.tensor([5, 6, 7]), torch.tensor([6, 9, 5])
    group.mirror_kv_move(tgt, src)
    for buf, old in zip(bufs, before):
        assert torch.equal(buf[tgt], old[src])
        untouched = [s for s in range(buf.shape[0]) if s not in (5, 6, 7)]
        assert torch.equal(buf[untouched], old[untouched])
    with pytest.raises(ValueError, match="move_kv_cache with"):
        group.mirror_kv_move(torch.tensor([1, 2]), torch.tensor([3]))


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
