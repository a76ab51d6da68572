"""SWA pools (docs/architecture.md, "Buffer groups and adapters"): ``attach_swa`` on a real ``SWAKVPool`` with a real
``SWATokenToKVPoolAllocator`` (the full → SWA table filled by real allocations and SWA
evictions), the buf-info splice, the serving loop with window eviction (zero false positives,
SWA-window corruption caught with ``*_SWA`` tags, slots behind the window never reported) and
the ``SwaDivergenceReporter``."""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch

from serving_driver import ServingDriver
from sglang.jit_kernel.kv_canary.types import (
    CANARY_SLOT_BYTES,
    CanaryLaunchTag,
    PoolKind,
    VerifyPlan,
)
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.pool_patcher import attach_canary_buffers, supported_pool_names
from sglang.srt.kv_canary.manager.swa_divergence import (
    SWA_DIVERGENCE_LINE_PREFIX,
    SwaDivergenceReporter,
)
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")

WINDOW = 12


def _pool(size=128, size_swa=64, page_size=1, with_allocator=True, swa=(0, 2), full=(1,)):
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool, SWATokenToKVPoolAllocator

    pool = SWAKVPool(
        size=size,
        size_swa=size_swa,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        swa_attention_layer_ids=list(swa),
        full_attention_layer_ids=list(full),
        enable_kvcache_transpose=False,
        device="cpu",
        enable_memory_saver=False,
    )
    alloc = None
    if with_allocator:
        alloc = SWATokenToKVPoolAllocator(
            size=size,
            size_swa=size_swa,
            page_size=page_size,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=pool,
            need_sort=False,
        )
    return pool, alloc


def _driver(seed=3, **kw):
    kw.setdefault("mode", "raise")
    kw.setdefault("real_data", "partial")
    return ServingDriver(
        seed=seed, pool="swa", num_slots=640, num_swa_slots=400, swa_window=WINDOW, **kw
    )


# ---- attach ---------------------------------------------------------------------------------


def test_attach_swa_builds_full_and_swa_groups_on_the_real_table():
    pool, alloc = _pool()
    config = CanaryConfig(mode="raise", real_kv_hash_mode="all", enable_mha_v=True)
    assert "SWAKVPool" in supported_pool_names()
    full, swa = attach_canary_buffers(
        pool=pool, config=config, device="cpu", swa_window_size=WINDOW
    )
    assert full.kind == PoolKind.FULL and swa.kind == PoolKind.SWA
    assert full.num_slots == pool.full_kv_pool.k_buffer[0].shape[0] == 129
    assert swa.num_slots == pool.swa_kv_pool.k_buffer[0].shape[0] == 65
    assert full.swa_index_lut is None and full.swa_window_size == 0
    # the allocator's own table, by reference: later allocations show through
    assert swa.swa_index_lut is alloc.full_to_swa_index_mapping and swa.swa_window_size == WINDOW
    got = alloc.alloc(5)
    assert torch.equal(swa.swa_index_lut[got], alloc.full_to_swa_index_mapping[got])
    assert bool((swa.swa_index_lut[got] > 0).all())
    # real-KV sources: layer 0 of each sub-pool
    assert full.real_kv_sources_k[0].tensor is pool.full_kv_pool.k_buffer[0]
    assert swa.real_kv_sources_k[0].tensor is pool.swa_kv_pool.k_buffer[0]
    assert swa.real_kv_sources_v[0].tensor is pool.swa_kv_pool.v_buffer[0]


def test_attach_swa_refuses_missing_table_window_or_sub_pool():
    config = CanaryConfig(mode="raise")
    pool, _ = _pool(with_allocator=False)
    with pytest.raises(RuntimeError, match="full_to_swa_index_mapping is not set"):
        attach_canary_buffers(pool=pool, config=config, device="cpu", swa_window_size=8)
    pool, _ = _pool()
    with pytest.raises(ValueError, match="sliding window size.*got None"):
        attach_canary_buffers(pool=pool, config=config, device="cpu")
    pool, _ = _pool()
    pool.swa_kv_pool = None
    with pytest.raises(ValueError, match="no 'swa_kv_pool' sub-pool"):
        attach_canary_buffers(pool=pool, config=config, device="cpu", swa_window_size=8)


@pytest.mark.parametrize("only", ["swa", "full"])
def test_a_sub_pool_without_layers_gets_no_group(only):
    """An ``SWAKVPool`` of sliding-window layers only (an MTP draft model's: sglang's
    ``Step3p5MTP`` / ``MiMoV2MTP`` pools have one sliding layer and no full one) gets the SWA
    group alone, spliced into ``get_state_buf_infos`` only; one of full layers only gets the
    FULL group alone; one with neither is refused."""
    layers = dict(swa=(0,), full=()) if only == "swa" else dict(swa=(), full=(0,))
    pool, _ = _pool(**layers)
    before_full = len(pool.get_contiguous_buf_infos()[0])
    before_swa = len(pool.get_state_buf_infos()[0])
    config = CanaryConfig(mode="raise")
    groups = attach_canary_buffers(pool=pool, config=config, device="cpu", swa_window_size=8)
    kind = PoolKind.SWA if only == "swa" else PoolKind.FULL
    assert [g.kind for g in groups] == [kind]
    sub = pool.swa_kv_pool if only == "swa" else pool.full_kv_pool
    assert groups[0].real_kv_sources_k[0].tensor is sub.k_buffer[0]
    grown = {
        "swa": len(pool.get_state_buf_infos()[0]) - before_swa,
        "full": len(pool.get_contiguous_buf_infos()[0]) - before_full,
    }
    assert grown == {only: 2, ("full" if only == "swa" else "swa"): 0}, grown
    pool, _ = _pool(swa=(), full=())
    with pytest.raises(ValueError, match="no layer in either sub-pool"):
        attach_canary_buffers(pool=pool, config=config, device="cpu", swa_window_size=8)


def test_an_swa_only_pool_serves_clean_and_catches_a_flipped_window_byte():
    """A serving loop over an MTP draft model's kind of pool (one sliding-window layer, no
    full one) with SWA eviction: clean, then a byte flipped inside a window is reported."""
    d = _driver(seed=7, verify_tokens=True, swa_only=True)
    assert [g.kind for g in d.manager.groups] == [PoolKind.SWA]
    d.run(120)
    d.settle()
    assert d.manager.count_violations() == 0
    assert int(d.manager.state.slot_run_counters[int(CanaryLaunchTag.HEAD_K_SWA)]) > 100
    info = d.fault_flip_swa_kv_byte(inside_window=True)
    with pytest.raises(RuntimeError, match="kv_canary detected KV-cache corruption") as exc:
        d.step()
    lines = parse_violation_lines(str(exc.value))
    assert {(v.slot_idx, v.position, v.launch_tag) for v in lines} == {
        (info["swa_slot"], info["position"], "TAIL_K_SWA")
    }


@pytest.mark.parametrize("mode", ["abort", "heal"])
def test_containment_on_an_swa_only_draft_pool_names_the_draft_variable(mode):
    """Abort and heal mode find a slot's request through the FULL group's records, which an
    SWA-only pool lacks: a draft canary acting on its violations
    (``SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act``) on such a pool is refused at build, naming
    the variable; with the draft's default (``report``) it builds, logging only."""
    from sglang.srt.kv_canary.builder import build_canary
    from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
    from sglang.srt.kv_canary.ranks import RankFacts

    def build(draft_violations):
        pool, _ = _pool(swa=(0,), full=())
        return build_canary(
            pool=pool,
            req_to_token=torch.zeros((8, 64), dtype=torch.int32),
            config=CanaryConfig(mode=mode, draft_violations=draft_violations),
            device="cpu",
            capacity_inputs=CanaryCapacityInputs(context_len=64, chunked_prefill_size=32),
            swa_window_size=8,
            ranks=RankFacts(draft=True, draft_steps=3),
        )

    with pytest.raises(ValueError, match="SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act; unset it"):
        build("act")
    manager = build("report")
    assert [g.kind for g in manager.groups] == [PoolKind.SWA]


@pytest.mark.parametrize("enable_v", [False, True])
def test_swa_buf_info_splice_lengths_and_order(enable_v):
    page = 4
    pool, _ = _pool(size=128, size_swa=64, page_size=page)
    before_full = pool.get_contiguous_buf_infos()
    before_swa = pool.get_state_buf_infos()
    config = CanaryConfig(mode="log", enable_mha_v=enable_v)
    full, swa = attach_canary_buffers(pool=pool, config=config, device="cpu", swa_window_size=8)
    for method, before, group, layers in (
        (pool.get_contiguous_buf_infos, before_full, full, 1),
        (pool.get_state_buf_infos, before_swa, swa, 2),
    ):
        ptrs, lens, items = method()
        k_ptrs, v_ptrs = before[0][:layers], before[0][layers:]
        if enable_v:
            expect = (
                [group.k_head.data_ptr()]
                + k_ptrs
                + [group.k_tail.data_ptr()]
                + [group.v_head.data_ptr()]
                + v_ptrs
                + [group.v_tail.data_ptr()]
            )
        else:
            expect = [group.k_head.data_ptr()] + k_ptrs + [group.k_tail.data_ptr()] + v_ptrs
        assert ptrs == expect
        assert len(ptrs) == len(lens) == len(items) == len(before[0]) + (4 if enable_v else 2)
        assert lens[0] == group.k_head.nbytes and items[0] == CANARY_SLOT_BYTES * page
        assert lens[1 : 1 + layers] == before[1][:layers]
    with pytest.raises(RuntimeError, match="already wrapped"):
        attach_canary_buffers(pool=pool, config=config, device="cpu", swa_window_size=8)


# ---- serving loop ---------------------------------------------------------------------------


def _plans_by_kind(d, sfm_index=0):
    """The (FULL, SWA) groups' plans of a single-forward manager, looked up by group."""
    sfm = d.manager.sfms[sfm_index]
    by_kind = {g.kind: sfm.plans[g] for g in sfm.groups}
    assert len(by_kind) == len(sfm.groups) == 2
    return by_kind[PoolKind.FULL], by_kind[PoolKind.SWA]


def _swa_tags(d):
    return {int(CanaryLaunchTag.HEAD_K_SWA), int(CanaryLaunchTag.TAIL_K_SWA)}


def test_serving_loop_with_window_eviction_has_no_false_positives():
    d = _driver(seed=7, verify_tokens=True)
    evicted_but_held = 0
    for _ in range(200):
        d.run(1, arrivals=0.35)
        # SWA eviction really happens: full slots still held by running requests whose SWA
        # slot was freed (table entry 0)
        evicted_but_held = max(
            evicted_but_held,
            sum(int(d.swa_table[s]) == 0 for r in d.running for s in r.slots[: r.swa_evicted]),
        )
    d.settle()
    for _ in range(30):
        d.step()
    state = d.manager.state
    assert d.manager.count_violations() == 0
    assert evicted_but_held > 0
    assert d.reused_slots > 0 and d.shared_admitted > 0
    for tag in _swa_tags(d) | {int(CanaryLaunchTag.TAIL_K_FULL)}:
        assert int(state.kernel_run_counters[tag]) > 0
    # the SWA group verified far fewer entries than the FULL group (window vs whole prefix)
    head_full = int(state.slot_run_counters[int(CanaryLaunchTag.HEAD_K_FULL)])
    head_swa = int(state.slot_run_counters[int(CanaryLaunchTag.HEAD_K_SWA)])
    assert 0 < head_swa < head_full


def test_swa_plan_covers_only_the_window_through_the_table():
    d = _driver(seed=4)
    d.run(50)
    d.settle()
    reqs = [(r.kv_len, list(r.slots)) for r in d.running]  # prefix of the coming decode
    windows = [
        [int(d.swa_table[slots[p]]) for p in range(max(0, kv - WINDOW), kv)] for kv, slots in reqs
    ]
    d.step()  # a decode of every running request
    full_plans, swa_plans = _plans_by_kind(d)
    n = int(swa_plans.verify_plan.verify_num_valid)
    assert n == sum(min(kv, WINDOW) for kv, _ in reqs) < sum(kv for kv, _ in reqs)
    assert int(full_plans.verify_plan.verify_num_valid) == sum(kv for kv, _ in reqs)
    # request order, then position order, each slot translated through the table
    assert swa_plans.verify_plan.verify_slot_indices[:n].tolist() == [s for w in windows for s in w]


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_swa_window_corruption_detected_with_swa_tags(real_data):
    d = _driver(seed=13, real_data=real_data)
    d.run(120)
    d.settle()
    info = d.fault_flip_swa_kv_byte(inside_window=True)
    with pytest.raises(RuntimeError, match="kv_canary detected KV-cache corruption") as exc:
        d.step()
    lines = parse_violation_lines(str(exc.value))
    assert lines, str(exc.value)
    assert {v.launch_tag for v in lines} == {"TAIL_K_SWA"}
    assert {v.fail_reasons for v in lines} == {("verify_real_kv_hash",)}
    # reported in the SWA slot space, at the corrupted position
    assert {(v.slot_idx, v.position) for v in lines} == {(info["swa_slot"], info["position"])}


def test_swa_slots_behind_the_window_are_never_reported():
    d = _driver(seed=21, swa_evict_interval=40)  # lazy eviction: resident slots behind windows
    d.run(120)
    d.settle()
    infos = []
    for _ in range(4):
        infos.append(d.fault_flip_swa_kv_byte(inside_window=False))
    # serve the running requests to completion with no new arrivals (nothing else reads them)
    for _ in range(60):
        if not d.running:
            break
        d.step()
    assert not d.running
    assert d.manager.count_violations() == 0
    assert all(i["position"] < i["window"][0] for i in infos)


def test_full_pool_corruption_still_reported_with_full_tags():
    d = _driver(seed=17)
    d.run(80)
    d.settle()
    victim = d.victim_request()
    p = 1
    slot = victim.slots[p]
    d.kv_pool.full_kv_pool.k_buffer[0][slot].view(torch.uint8).view(-1)[0] ^= 0xFF
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.step()
    lines = parse_violation_lines(str(exc.value))
    assert {v.launch_tag for v in lines} == {"TAIL_K_FULL"}
    assert {v.slot_idx for v in lines} == {slot}


# ---- SwaDivergenceReporter -----------------------------------------------------------------


def test_swa_divergence_reporter_logs_running_counts(caplog):
    d = _driver(seed=9, swa_divergence_interval=10)
    with caplog.at_level(logging.INFO, logger="sglang.srt.kv_canary"):
        d.run(60)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith(SWA_DIVERGENCE_LINE_PREFIX)
    ]
    stats = [json.loads(x[len(SWA_DIVERGENCE_LINE_PREFIX) :]) for x in lines]
    assert [s["step"] for s in stats] == list(range(10, 61, 10))
    rep = d.manager.swa_divergence
    last = stats[-1]
    assert last["forwards"] == 60 == rep.forwards
    assert last["full_verify_entries"] == rep.full_verify_entries > 0
    assert 0 < last["swa_verify_entries"] == rep.swa_verify_entries < rep.full_verify_entries
    assert last["full_minus_swa"] == rep.full_verify_entries - rep.swa_verify_entries
    # running totals never decrease
    fulls = [s["full_verify_entries"] for s in stats]
    assert fulls == sorted(fulls)


def test_swa_divergence_counts_match_the_plans():
    d = _driver(seed=2, swa_divergence_interval=1000)
    expect_full = expect_swa = 0
    for _ in range(40):
        d.run(1, arrivals=0.4)
        full_plans, swa_plans = _plans_by_kind(d)
        expect_full += int(full_plans.verify_plan.verify_num_valid)
        expect_swa += int(swa_plans.verify_plan.verify_num_valid)
    rep = d.manager.swa_divergence
    assert rep.forwards == d.step_count == 40
    assert (rep.full_verify_entries, rep.swa_verify_entries) == (expect_full, expect_swa)
    assert expect_full > expect_swa > 0


def test_swa_divergence_reporter_off_watches_nothing():
    plan = VerifyPlan.allocate(verify_capacity=4, device="cpu")
    rep = SwaDivergenceReporter(interval=0, sfm_plans=[[(PoolKind.FULL, plan)]])
    assert not rep.enabled and rep.device_tensors() == ()
    # off: reads nothing (not even the num_valid it is handed)
    rep.consume(num_valid=(), plan_enabled=[1], step=1, sfm_index=0)
    assert rep.forwards == 0 and rep.full_verify_entries == rep.swa_verify_entries == 0
    with pytest.raises(ValueError, match="interval must be an int >= 0"):
        SwaDivergenceReporter(interval=-1, sfm_plans=[])


def test_swa_divergence_reporter_counts_by_kind_and_skips_disabled_plans(caplog):
    """Per single-forward manager, in its groups' order: a plan whose status entry says
    disabled (overflowed) is not counted; the kinds follow the order the plans were given."""
    full, swa = (VerifyPlan.allocate(verify_capacity=4, device="cpu") for _ in range(2))
    # sfm 0 lists FULL then SWA, sfm 1 lists SWA then FULL
    rep = SwaDivergenceReporter(
        interval=2,
        sfm_plans=[
            [(PoolKind.FULL, full), (PoolKind.SWA, swa)],
            [(PoolKind.SWA, swa), (PoolKind.FULL, full)],
        ],
    )
    sources = rep.device_tensors()
    assert len(sources) == 2
    assert sources[0][0] is full.verify_num_valid and sources[0][1] is swa.verify_num_valid
    assert sources[1][0] is swa.verify_num_valid and sources[1][1] is full.verify_num_valid
    n = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
    rep.consume(num_valid=(n(10), n(3)), plan_enabled=[1, 1], step=1, sfm_index=0)
    assert (rep.full_verify_entries, rep.swa_verify_entries) == (10, 3)
    rep.consume(num_valid=(n(4), n(20)), plan_enabled=[1, 1], step=3, sfm_index=1)
    assert (rep.full_verify_entries, rep.swa_verify_entries) == (30, 7)
    rep.consume(num_valid=(n(100), n(5)), plan_enabled=[0, 1], step=5, sfm_index=0)
    assert (rep.full_verify_entries, rep.swa_verify_entries) == (30, 12)
    with caplog.at_level(logging.INFO, logger="sglang.srt.kv_canary"):
        rep.consume(num_valid=(n(1), n(1000)), plan_enabled=[1, 0], step=6, sfm_index=1)
    assert (rep.full_verify_entries, rep.swa_verify_entries, rep.forwards) == (30, 13, 4)
    (line,) = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith(SWA_DIVERGENCE_LINE_PREFIX)
    ]
    assert json.loads(line[len(SWA_DIVERGENCE_LINE_PREFIX) :]) == rep.snapshot(6)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
