"""EAGLE draft trees (``--speculative-eagle-topk`` > 1, spec v1) on real sglang 0.5.12 pools
and ForwardBatches (``eagle_tree_driver.py``; docs/speculative_trees.md): the draft round's
lanes planned one row per lane, the target verify's tree written along each node's path, the
accepted path re-pointed (page size 1) or compacted (larger pages) and read by the next
round. At page size > 1 the lanes sit whole pages apart and every lane k >= 1 carries a copy
of the prefix's last partial page (docs/speculative_trees.md, "4.5 Page size > 1 (second
step)"). Clean runs report nothing; a wrong re-pointing, a flattened acceptance, a flipped
lane byte, a duplicated partial page left without its records and sglang 0.5.12's lane slots
in a paged round without a partial page are reported."""

from __future__ import annotations

import logging
import sys

import pytest

import torch

from eagle_tree_driver import EagleTreeDriver
from sglang.jit_kernel.kv_canary import CanaryLaunchTag
from sglang.srt.kv_canary.plan_input import LaneLayout, PlanInput
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=70, suite="stage-a-test-cpu")

# the canary's kernels as the torch references but in the tests marked triton_interpreter
pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


@pytest.mark.parametrize(
    "topk, steps, num_draft",
    [(2, 3, 6), (4, 2, 9), pytest.param(2, 1, 3, marks=pytest.mark.triton_interpreter), (3, 4, 12)],
)
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


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_rejected_node_re_pointed_into_the_path_is_reported(page_size):
    """The accepted path's first position re-pointed at a rejected node of the same depth
    (another token; at page size 4 the compaction then moves that node's KV and record into
    the path): the next round reads it and the canary stops the raise server."""
    d = EagleTreeDriver(
        topk=3,
        steps=3,
        num_draft=8,
        seed=5,
        verify_tokens=True,
        accept_prob=0.8,
        page_size=page_size,
    )
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


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_flattened_acceptance_is_reported(page_size):
    """Nodes ``0 .. acc`` accepted in node order where that is no root path (sglang's
    ``SGLANG_SIMULATE_ACC_LEN`` with topk > 1): the next round's read of them is reported."""
    d = EagleTreeDriver(
        topk=2,
        steps=4,
        num_draft=8,
        seed=9,
        verify_tokens=True,
        accept_prob=0.9,
        page_size=page_size,
    )
    d.run(12)
    assert d.target.count_violations() == 0
    d.plant_flattened_acceptance()
    with pytest.raises(RuntimeError, match="KV-cache corruption") as exc:
        d.run(8, arrivals=0.0)
    assert d.fault_log and d.fault_log[0]["kind"] == "flattened"
    seen = parse_violation_lines(str(exc.value))
    assert {v.rids[0] for v in seen} <= {str(f["rid"]) for f in d.fault_log}, seen


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_lane_is_verified_from_its_own_columns(page_size):
    """A KV byte of the second lane's first draft step flipped after the draft round's first
    forward: its second forward verifies that lane's own step (the lane's column, past the
    first lane's: ``steps`` columns at page size 1, whole pages at page size 4) and the draft
    canary reports the slot."""
    d = EagleTreeDriver(
        topk=2, steps=3, num_draft=6, seed=4, verify_tokens=True, page_size=page_size
    )
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


# ---- page size > 1 (docs/speculative_trees.md, "4.5 Page size > 1 (second step)") ---------------


def _sglang_paged_lanes(page, topk, steps, lengths):
    """sglang's own layout of a paged draft round (``get_last_loc_large_page_size_large_top_k``
    lengths, a real ``PagedTokenToKVPoolAllocator``'s ``alloc_extend``, its
    ``assign_draft_cache_locs`` kernel) for requests of committed lengths ``lengths``, the
    first with a partial page (the kernel's slot rewrite runs): returns ``(req_to_token,
    rows, lanes [bs, K, steps] slots, {target slot: source slot} of the duplication)``."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.common import get_last_loc_torch
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.speculative.spec_utils import assign_draft_cache_locs
    from sglang.srt.utils import next_power_of_2

    from eagle_driver import tiny_mha_pool

    assert lengths[0] % page
    bs = len(lengths)
    r2t_pool = ReqToTokenPool(
        size=bs + 1, max_context_len=256, device="cpu", enable_memory_saver=False
    )
    r2t = r2t_pool.req_to_token
    alloc = PagedTokenToKVPoolAllocator(
        1024, page, torch.bfloat16, "cpu", tiny_mha_pool(1024), need_sort=False
    )
    rows = torch.arange(1, bs + 1, dtype=torch.int64)
    seq = torch.tensor(lengths, dtype=torch.int64)
    for row, L in zip(rows.tolist(), lengths):  # each prefix on whole pages, as a prefill
        r2t[row, :L] = alloc.alloc((L + page - 1) // page * page)[:L].to(torch.int32)
    last_page = seq % page
    npp = (last_page + steps + page - 1) // page
    ends = seq // page * page + npp * page * topk
    out = alloc.alloc_extend(
        seq, seq, ends, ends, get_last_loc_torch(r2t, rows, seq), int((ends - seq).sum())
    )
    dup = int(last_page.sum()) * (topk - 1)
    tgt, src = torch.zeros(dup, dtype=torch.int32), torch.zeros(dup, dtype=torch.int32)
    assign_draft_cache_locs[(bs,)](
        rows,
        r2t,
        seq,
        ends - seq,
        npp,
        out,
        src,
        tgt,
        torch.cumsum(last_page, dim=0),
        dup,
        r2t.shape[1],
        topk,
        steps,
        page,
        next_power_of_2(bs),
        next_power_of_2(steps + page),
    )
    lanes = out[: bs * topk * steps].view(bs, topk, steps)
    return r2t, rows, lanes, dict(zip(tgt.tolist(), src.tolist()))


@pytest.mark.parametrize("seq_dtype", [torch.int32, torch.int64], ids=["graph", "eager"])
@pytest.mark.parametrize("page, topk, steps", [(4, 3, 3), (16, 2, 4), (8, 4, 8)])
def test_paged_lane_rows_read_the_columns_sglang_lays_out(page, topk, steps, seq_dtype):
    """``PlanInput.fill_lanes`` at page size > 1 against sglang's own layout of the round: for
    every lane row and every position it verifies or writes at, ``req_to_token`` at the
    planned column (``p + branch_shift`` from ``branch_split`` on) holds the slot sglang gave
    that lane's step (positions L on) or, for a lane k >= 1, the copy sglang's duplication
    made of the prefix's slot at p (positions from the last page boundary to L); lane 0 reads
    the prefix itself from position 0. Committed lengths with and without a partial page;
    ``seq_lens`` int32 (a graph runner's buffer) and int64 (an eager batch)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    lengths = [page + 3, 2 * page, 3 * page - 1, page + 1]
    r2t, rows, lanes, copies = _sglang_paged_lanes(page, topk, steps, lengths)
    pi = PlanInput(
        write_req_capacity=16,
        device="cpu",
        lanes=LaneLayout(topk=topk, steps=steps, page_size=page),
    )
    bs = len(lengths)
    seq = torch.tensor(lengths, dtype=seq_dtype)
    for i in range(steps - 1):  # the round's forwards: positions L + i
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=torch.zeros(bs * topk, dtype=torch.int64),
            req_pool_indices=rows,
            seq_lens=seq,
            out_cache_loc=lanes[:, :, i].reshape(-1),
            seq_lens_sum=sum(lengths),
            positions=torch.tensor([L + i for L in lengths for _ in range(topk)]),
        )
        rpi, prefix, extend, plan = pi.fill_lanes(fb)
        assert extend.tolist() == [1] * (bs * topk)
        for b, L in enumerate(lengths):
            for k in range(topk):
                r = b * topk + k
                assert int(rpi[r]) == int(rows[b]) and int(prefix[r]) == L + i
                split, shift = int(plan.branch_split[r]), int(plan.branch_shift[r])
                frm = int(plan.verify_from[r])
                assert frm == (0 if k == 0 else L - L % page)

                def slot(p):
                    return int(r2t[rows[b], p + (shift if p >= split else 0)])

                for p in range(L, L + i + 1):  # the lane's steps read and the one written
                    assert slot(p) == int(lanes[b, k, p - L]), (b, k, p)
                for p in range(frm, L):
                    original = int(r2t[rows[b], p])
                    if k == 0:
                        assert slot(p) == original
                    else:  # the copy of the prefix's slot at p
                        assert copies[slot(p)] == original, (b, k, p)


def test_page_size_1_lanes_keep_their_static_shift():
    """Page size 1: ``branch_shift`` is the static ``k * steps`` and the split the committed
    length, whatever the batch."""
    pi = PlanInput(write_req_capacity=6, device="cpu", lanes=LaneLayout(topk=3, steps=4))
    assert pi.lanes.branch_shift.tolist() == [0, 4, 8, 0, 4, 8]
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        LaneLayout(topk=3, steps=4, page_size=0)
    with pytest.raises(TypeError, match="must be a LaneLayout"):
        PlanInput(write_req_capacity=6, device="cpu", lanes=(3, 4))


@pytest.mark.parametrize(
    "page_size, topk, steps, num_draft, replay, aligned",
    [
        (4, 2, 3, 6, False, 1),
        (4, 3, 2, 8, True, 0),
        pytest.param(16, 4, 3, 12, False, 0, marks=pytest.mark.triton_interpreter),
    ],
)
def test_paged_tree_rounds_run_clean(page_size, topk, steps, num_draft, replay, aligned, caplog):
    """Raise mode, real data and token checks at page size 4 and 16: the draft lanes laid out
    by sglang's own kernel (whole pages per lane, each later lane's copy of the prefix's
    partial page mirrored by the plugin's hook), the verify compacted; nothing reported,
    partial pages copied and accepted nodes moved (every other round's draft round replayed
    from the draft graph in one case; in another, a round without a partial page, whose lane
    slots the driver rewrites as sglang's kernel does when one exists)."""
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        d = EagleTreeDriver(
            topk=topk,
            steps=steps,
            num_draft=num_draft,
            seed=3,
            verify_tokens=True,
            page_size=page_size,
            num_slots=4096,
            replay_draft_rounds=replay,
        )
        d.run(28)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert d.target.count_violations() == 0 and d.draft.count_violations() == 0
    assert d.rounds >= 8 and d.accepted >= 10 and d.rejected >= 10
    assert len(d.duplications) >= 3 and d.moves >= 3 and d.aligned_rounds >= aligned
    assert d.draft.sfms[0].plan_input.lane_layout.page_size == page_size
    assert not replay or d.replayed_rounds >= 3


def test_a_duplicated_partial_page_left_without_its_records_is_reported(monkeypatch):
    """The plugin's ``move_kv_cache`` hook a no-op for the draft pool (its KV copied into every
    later lane's head, its records not): the first draft round of requests whose prefixes end
    inside a page verifies those copies in the later lanes and stops the raise server: every
    copy is reported (read at the position of the prefix slot it copies), and each later
    lane's first step, written from the copy of the last prefix position, at the committed
    length."""
    from sglang.srt.kv_canary import plugin

    d = EagleTreeDriver(topk=3, steps=3, num_draft=8, seed=6, verify_tokens=True, page_size=4)
    mirror = plugin._after_move_kv_cache

    def target_pool_only(result, pool, *args, **kwargs):
        return result if pool is d.draft_pool else mirror(result, pool, *args, **kwargs)

    monkeypatch.setattr(plugin, "_after_move_kv_cache", target_pool_only)
    with pytest.raises(RuntimeError, match="draft model's KV pool") as exc:
        d.run(28)
    assert d.duplications and d.target.count_violations() == 0
    copies = dict(d.duplications[-1])
    seen = parse_violation_lines(str(exc.value))
    reads = [v for v in seen if v.fail_reasons != ("write_position",)]
    writes = [v for v in seen if v.fail_reasons == ("write_position",)]
    assert {v.slot_idx for v in reads} == set(copies), (copies, seen)
    r2t = d.req_to_token_pool.req_to_token
    for v in reads:  # the copy of the request's own prefix slot at the position read
        assert copies[v.slot_idx] == int(r2t[v.req_to_token_row, v.read_position]), v
        assert "verify_position" in v.fail_reasons
    committed = {}
    for v in reads:
        committed[v.req_to_token_row] = max(
            committed.get(v.req_to_token_row, 0), v.read_position + 1
        )
    assert len(writes) == 2 * len(committed)  # lanes 1 and 2 of each such request
    assert all(v.position == committed[v.req_to_token_row] for v in writes), (committed, writes)


def test_sglang_0_5_12_lane_slots_of_a_paged_round_without_a_partial_page_are_reported():
    """A paged draft round in which no request's prefix ends inside a page, as sglang 0.5.12
    runs it: its ``assign_draft_cache_locs`` skips the rewrite of the round's slots (its part
    3 sits under ``duplicate_cache_len > 0``), so the lanes' steps are written to the
    allocation's first slots, not to the lanes' columns that attention reads; the draft canary
    reports the first lane step read from a stale column (position L, a page multiple) or the
    step written after it (L + 1), the target's nothing. The same rounds with the slots
    rewritten run clean (:func:`test_paged_tree_rounds_run_clean`, page size 4, topk 2)."""
    d = EagleTreeDriver(
        topk=2, steps=3, num_draft=6, seed=3, page_size=4, bug_aligned_round_lane_slots=True
    )
    with pytest.raises(RuntimeError, match="draft model's KV pool") as exc:
        d.run(28)
    assert d.aligned_rounds >= 1 and d.target.violations.total == 0
    seen = parse_violation_lines(str(exc.value))
    assert seen and {v.read_position % 4 for v in seen} <= {0, 1}, seen


def test_sglang_0_5_12_stale_lane_columns_of_a_two_page_lane_are_reported():
    """sglang 0.5.12's ``assign_draft_cache_locs`` reads back the lanes' ``req_to_token``
    columns that the same program stored, with no barrier between: a lane step stored by
    another warp than the one whose load lands last (lane 1 of a lane spanning two pages at
    page 16, 3 steps: ``L % 16`` of 14 or 15) may get the column's slot from before the kernel
    (``bug_stale_lane_columns``). The step is then written where the lane does not read it:
    the draft canary reports the stale read at position L (``L % 16`` 14 or 15) or the step
    written after it (L + 1), the target's nothing. The same rounds without the race run
    clean (:func:`test_paged_tree_rounds_run_clean`, page 16, topk 4)."""
    d = EagleTreeDriver(
        topk=2, steps=3, num_draft=6, seed=2, page_size=16, bug_stale_lane_columns=True
    )
    with pytest.raises(RuntimeError, match="draft model's KV pool") as exc:
        d.run(28)
    assert d.stale_lane_slots >= 1 and d.target.violations.total == 0
    seen = parse_violation_lines(str(exc.value))
    assert seen and {v.read_position % 16 for v in seen} <= {14, 15, 0}, seen
    assert any("verify_position" in v.fail_reasons for v in seen), seen


@pytest.mark.triton_interpreter
def test_a_marked_test_keeps_the_triton_kernels_of_the_run():
    """``triton_interpreter`` leaves the dispatch as the run set it (the interpreter on CPU
    tensors in CI); the module's other tests get the torch references (below)."""
    import triton

    from sglang.jit_kernel.kv_canary import _launch

    assert _launch.TRITON_INTERPRET is bool(triton.knobs.runtime.interpret)


def test_the_module_s_other_tests_run_the_torch_references():
    from sglang.jit_kernel.kv_canary import _launch

    assert _launch.TRITON_INTERPRET is False
    assert not _launch.use_triton(torch.device("cpu"))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
