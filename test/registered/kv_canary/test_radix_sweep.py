"""Radix-cache sweep (docs/subsystems.md, "Radix sweep"): the walker on real sglang trees, the orchestrator's cadence,
and a sweep catching a byte flipped in a slot only the cache holds."""

from __future__ import annotations

import sys

import pytest
import torch

from canary_support.radix_pools import radix_cache_params
from serving_driver import ServingDriver
from sglang.jit_kernel.kv_canary.types import VerifyPlan
from sglang.srt.kv_canary.radix_cache_walker import walk_radix_cache_for_canary
from sglang.srt.kv_canary.manager.sweep import SweepOrchestrator
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.kv_canary.sweep_plan_builder import build_verify_plan_radix_sweep
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


def _cache(num_slots=256):
    params = radix_cache_params(num_slots)
    return RadixCache(params), params.token_to_kv_pool_allocator


def _insert(cache, alloc, tokens, slots=None):
    """Insert ``tokens``; slots of an existing prefix are reused, the rest freshly allocated."""
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens))))
    have = match.device_indices
    if slots is None:
        fresh = alloc.alloc(len(tokens) - len(have))
        slots = torch.cat([have.to(torch.int64), fresh])
    cache.insert(InsertParams(key=RadixKey(list(tokens)), value=slots))
    return slots


def _check_walk(walk, sequences):
    """Every inserted sequence's (slot, position, prev) triples appear in the walk."""
    got = {
        (s, p, q)
        for s, p, q in zip(
            walk.slot_indices.tolist(), walk.positions.tolist(), walk.prev_slot_indices.tolist()
        )
    }
    for slots in sequences:
        s = slots.tolist()
        for p, slot in enumerate(s):
            assert (slot, p, s[p - 1] if p else -1) in got
    assert len(got) == walk.num_slots  # each cached slot once


def test_walk_real_radix_cache_with_shared_prefixes():
    cache, alloc = _cache()
    a = _insert(cache, alloc, range(100, 140))
    b = _insert(cache, alloc, list(range(100, 120)) + list(range(500, 530)))  # splits a's node
    c = _insert(cache, alloc, list(range(100, 125)) + [7, 8, 9])  # splits again, deeper
    d = _insert(cache, alloc, range(900, 905))  # another root child
    walk = walk_radix_cache_for_canary(radix_cache=cache)
    _check_walk(walk, [a, b, c, d])
    assert walk.num_slots == 40 + 30 + 3 + 5
    # a child's first slot follows its parent's last slot (the split at 20 and at 25)
    by_slot = dict(zip(walk.slot_indices.tolist(), walk.prev_slot_indices.tolist()))
    assert by_slot[int(b[20])] == int(a[19]) and by_slot[int(c[25])] == int(a[24])
    assert by_slot[int(d[0])] == -1 and by_slot[int(a[0])] == -1


DEEP_TREE_NODES = 600


def test_walk_skips_locked_nodes_and_handles_empty_and_deep_trees():
    cache, alloc = _cache(num_slots=4096)
    assert walk_radix_cache_for_canary(radix_cache=cache).num_slots == 0
    a = _insert(cache, alloc, range(10, 30))
    b = _insert(cache, alloc, list(range(10, 20)) + [1, 2, 3])
    node = cache.match_prefix(
        MatchPrefixParams(key=RadixKey(list(range(10, 20)) + [1, 2, 3]))
    ).last_device_node
    cache.inc_lock_ref(node)  # a running request holds b (locks its path)
    locked = set(b.tolist())
    walk = walk_radix_cache_for_canary(radix_cache=cache, unlocked_only=True)
    assert set(walk.slot_indices.tolist()) == set(a.tolist()) - locked
    assert walk_radix_cache_for_canary(radix_cache=cache).num_slots == 23
    # deep tree: 600 nested nodes (a chain of splits) walks without recursion, under a
    # recursion limit of half its depth (a recursive walk would need a frame per node)
    deep, _ = _cache(num_slots=2048)
    toks = list(range(1, DEEP_TREE_NODES + 1))
    for n in range(2, DEEP_TREE_NODES + 1):
        _insert(deep, deep.token_to_kv_pool_allocator, toks[:n])
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(DEEP_TREE_NODES // 2)
    try:
        walk = walk_radix_cache_for_canary(radix_cache=deep)
        assert sys.getrecursionlimit() == DEEP_TREE_NODES // 2
    finally:
        sys.setrecursionlimit(limit)
    assert walk.num_slots == DEEP_TREE_NODES
    assert walk.positions.tolist() == list(range(DEEP_TREE_NODES))


def _unified_cache(num_slots=256):
    from sglang.srt.mem_cache.unified_cache_components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = radix_cache_params(num_slots)
    params.tree_components = (ComponentType.FULL,)  # as sglang's scheduler sets it
    return UnifiedRadixCache(params), params.token_to_kv_pool_allocator


def test_walk_real_unified_radix_cache():
    """``SGLANG_ENABLE_UNIFIED_RADIX_TREE=1``: the same walk over ``UnifiedTreeNode``s (their
    full component's slots), locked paths left out with ``unlocked_only``."""
    cache, alloc = _unified_cache()
    a = _insert(cache, alloc, range(100, 140))
    b = _insert(cache, alloc, list(range(100, 120)) + list(range(500, 530)))
    c = _insert(cache, alloc, range(900, 905))
    walk = walk_radix_cache_for_canary(radix_cache=cache)
    _check_walk(walk, [a, b, c])
    assert walk.num_slots == 40 + 30 + 5
    by_slot = dict(zip(walk.slot_indices.tolist(), walk.prev_slot_indices.tolist()))
    assert by_slot[int(b[20])] == int(a[19]) and by_slot[int(c[0])] == -1
    node = cache.match_prefix(
        MatchPrefixParams(key=RadixKey(list(range(100, 120)) + list(range(500, 530))))
    ).last_device_node
    cache.inc_lock_ref(node)  # a running request holds b's path
    walk = walk_radix_cache_for_canary(radix_cache=cache, unlocked_only=True)
    assert set(walk.slot_indices.tolist()) == (set(a.tolist()) | set(c.tolist())) - set(b.tolist())
    assert (
        walk_radix_cache_for_canary(radix_cache=cache, swa_resident_only=True).num_slots == 75
    )  # no SWA component: no tombstones


def test_unsupported_cache_type():
    with pytest.raises(NotImplementedError, match="does not support dict.*RadixCache"):
        walk_radix_cache_for_canary(radix_cache={})


def test_plan_builder_chunks_reuse_one_buffer_and_translate_swa():
    cache, alloc = _cache()
    a = _insert(cache, alloc, range(50, 80))
    walk = walk_radix_cache_for_canary(radix_cache=cache)
    plan = VerifyPlan.allocate(verify_capacity=8, device="cpu")
    ptr = plan.verify_slot_indices.data_ptr()
    seen, start = [], 0
    while start < walk.num_slots:
        k = build_verify_plan_radix_sweep(walk=walk, plan_out=plan, start=start)
        assert int(plan.verify_num_valid) == k and int(plan.enable) == 1
        seen += plan.verify_slot_indices[:k].tolist()
        start += k
    assert seen == walk.slot_indices.tolist() and plan.verify_slot_indices.data_ptr() == ptr
    lut = torch.arange(300) + 1000
    lut[int(a[3])] = 0  # evicted from the SWA pool
    build_verify_plan_radix_sweep(walk=walk, plan_out=plan, start=0, swa_index_lut=lut)
    i = walk.slot_indices.tolist().index(int(a[3]))
    if i < 8:
        assert int(plan.verify_slot_indices[i]) == 0
    assert -1 in plan.verify_prev_slot_indices[:8].tolist()  # the chain head keeps -1
    assert set(plan.verify_expected_tokens[:8].tolist()) == {-1}


def test_orchestrator_cadence():
    calls = []
    orch = SweepOrchestrator(interval=3, endpoints=[], device="cpu", chunk_capacity=4)
    orch.run_sweep = lambda: calls.append(1)  # cadence only
    assert not orch.maybe_run_sweep(1)  # no cache attached yet
    orch.attach_radix_cache(_cache()[0])
    swept = [s for s in range(2, 12) if orch.maybe_run_sweep(s)]
    assert swept == [2, 5, 8, 11] and len(calls) == 4
    off = SweepOrchestrator(interval=0, endpoints=[], device="cpu")
    off.attach_radix_cache(_cache()[0])
    assert not any(off.maybe_run_sweep(s) for s in range(1, 10)) and off.plan is None


def test_orchestrator_without_a_radix_cache_and_with_a_tree_it_cannot_walk(caplog):
    """``--disable-radix-cache`` (sglang's ``ChunkCache``; a PD decode server's default): no
    slot stays cached, the sweep stays off and says so (it used to stop the server at its
    first pass). A tree the walker cannot read stops start-up, naming it."""
    from sglang.srt.mem_cache.chunk_cache import ChunkCache

    cache, alloc = _cache()
    chunk = ChunkCache(
        CacheInitParams(
            disable=True,
            req_to_token_pool=cache.req_to_token_pool,
            token_to_kv_pool_allocator=alloc,
            page_size=1,
        )
    )
    orch = SweepOrchestrator(interval=2, endpoints=[], device="cpu", chunk_capacity=4)
    orch.run_sweep = lambda: pytest.fail("nothing to sweep")
    with caplog.at_level("WARNING"):
        orch.attach_radix_cache(chunk)
    assert "--kv-canary-sweep-interval 2 has nothing to sweep" in caplog.text
    assert "ChunkCache" in caplog.text and orch.radix_cache is None
    assert not any(orch.maybe_run_sweep(s) for s in range(1, 10))
    with pytest.raises(
        NotImplementedError, match="--kv-canary-sweep-interval cannot walk dict .*RadixCache"
    ):
        orch.attach_radix_cache({})


def test_sweep_catches_a_flipped_byte_in_a_cached_slot():
    d = ServingDriver(seed=21, real_data="partial", mode="raise", sweep_interval=2)
    d.run(40)
    d.settle()
    cache, _ = _cache()
    cache.token_to_kv_pool_allocator = d.allocator
    for r in d.running:  # the cache holds the running requests' prefixes (as sglang's does)
        cache.insert(
            InsertParams(
                key=RadixKey(r.tokens[: r.kv_len]), value=torch.tensor(r.slots[: r.kv_len])
            )
        )
    d.manager.attach_radix_cache(cache)
    before = d.manager.sweep_passes
    for _ in range(3):
        d.step()
    assert d.manager.sweep_passes >= before + 1  # clean sweeps report nothing
    # a slot only the cache will hold: the running request that owns it is dropped from the
    # batch (so no forward reads it), then one KV byte of it flips
    victim = d.running.pop(0)
    slot = victim.slots[1]
    d.kv_pool.k_buffer[0][slot].view(torch.uint8).view(-1)[0] ^= 0x3C
    report = d.report_within(2)
    found = [(v.launch_tag, v.fail_reasons, v.slot_idx) for v in parse_violation_lines(report)]
    assert ("SWEEP_K_FULL", ("verify_real_kv_hash",), slot) in found, found
    assert found and all(tag.startswith("SWEEP") for tag, _, _ in found)


def test_walk_real_swa_radix_cache_skips_tombstones():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool, SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache

    pool = SWAKVPool(
        size=256,
        size_swa=64,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=8,
        swa_attention_layer_ids=[0],
        full_attention_layer_ids=[1],
        enable_kvcache_transpose=False,
        device="cpu",
        enable_memory_saver=False,
    )
    alloc = SWATokenToKVPoolAllocator(
        size=256,
        size_swa=64,
        page_size=1,
        dtype=torch.bfloat16,
        device="cpu",
        kvcache=pool,
        need_sort=False,
    )
    r2t = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    cache = SWARadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=r2t,
            token_to_kv_pool_allocator=alloc,
            page_size=1,
            sliding_window_size=8,
        )
    )
    a_tok = list(range(100, 130))
    a = alloc.alloc(30)
    cache.insert(InsertParams(key=RadixKey(a_tok), value=a, prev_prefix_len=0))
    b_tok = a_tok[:20] + list(range(500, 510))
    shared = cache.match_prefix(MatchPrefixParams(key=RadixKey(b_tok))).device_indices
    b = torch.cat([shared, alloc.alloc(10)])
    cache.insert(InsertParams(key=RadixKey(b_tok), value=b, prev_prefix_len=0))
    assert walk_radix_cache_for_canary(radix_cache=cache).num_slots == 40
    # SWA eviction: a leaf goes, then the shared internal node becomes a tombstone (its SWA
    # slots freed, its full slots kept)
    cache.evict(EvictParams(num_tokens=0, swa_num_tokens=5))
    cache.evict(EvictParams(num_tokens=0, swa_num_tokens=10))
    full = walk_radix_cache_for_canary(radix_cache=cache)
    resident = walk_radix_cache_for_canary(radix_cache=cache, swa_resident_only=True)
    assert full.num_slots == 30
    tomb = set(a[:20].tolist())
    assert set(resident.slot_indices.tolist()) == set(full.slot_indices.tolist()) - tomb
    assert resident.num_slots == 10
    # the remaining leaf's first slot still names its (tombstoned) parent's last slot; through
    # the SWA table that predecessor is evicted → 0 → its chain is not checked
    lut = alloc.full_to_swa_index_mapping
    plan = VerifyPlan.allocate(verify_capacity=16, device="cpu")
    build_verify_plan_radix_sweep(walk=resident, plan_out=plan, swa_index_lut=lut)
    first = resident.positions.tolist().index(20)
    assert int(resident.prev_slot_indices[first]) == int(a[19])
    assert int(plan.verify_prev_slot_indices[first]) == 0
    assert all(int(s) > 0 for s in plan.verify_slot_indices[:10])  # resident SWA slots


def test_sweep_of_a_swa_pool_reads_the_swa_records_through_the_table():
    """The radix cache holds FULL slot indices; the SWA group's sweep must translate them
    through the pool's full -> SWA table before reading SWA records: clean sweeps stay clean,
    and a corrupted SWA byte of a slot only the cache holds is reported in the SWA slot
    space."""
    d = ServingDriver(
        seed=31,
        pool="swa",
        num_slots=640,
        num_swa_slots=400,
        swa_window=12,
        real_data="partial",
        mode="raise",
        sweep_interval=1,
    )
    d.run(60)
    d.settle()
    cache, _ = _cache()
    cache.token_to_kv_pool_allocator = d.allocator
    for r in d.running:
        cache.insert(
            InsertParams(
                key=RadixKey(r.tokens[: r.kv_len]), value=torch.tensor(r.slots[: r.kv_len])
            )
        )
    cached = walk_radix_cache_for_canary(radix_cache=cache).slot_indices.tolist()
    resident = {s for s in cached if d.swa_slot(s) > 0}
    # the two slot spaces really differ here (else an untranslated read would pass)
    assert sum(d.swa_slot(s) != s for s in resident) >= len(resident) // 2 > 0
    d.manager.attach_radix_cache(cache)
    before = d.manager.sweep_passes
    for _ in range(3):
        d.step()
    assert d.manager.sweep_passes >= before + 3  # clean sweeps report nothing
    # a request leaves the batch (only the cache holds its slots); flip one SWA byte of a
    # cached position still resident in the SWA pool
    victim = d.running.pop(0)
    pos = next(
        p
        for p in range(victim.kv_len - 1, 0, -1)
        if victim.slots[p] in resident
        and d.swa_slot(victim.slots[p]) > 0
        and d.slot_refs[victim.slots[p]] == 1
    )
    slot = victim.slots[pos]
    swa_slot = d.swa_slot(slot)
    d.kv_pool.swa_kv_pool.k_buffer[0][swa_slot].view(torch.uint8).view(-1)[0] ^= 0x3C
    d.add_request(prompt_len=5, max_new=8)  # forwards keep running (the sweep follows them)
    report = d.report_within(2)
    found = {
        (v.launch_tag, v.fail_reasons, v.slot_idx, v.position)
        for v in parse_violation_lines(report)
    }
    assert found == {("SWEEP_K_SWA", ("verify_real_kv_hash",), swa_slot, pos)}, found


def test_walk_real_mamba_radix_cache():
    """Hybrid linear-attention models cache prefixes in a ``MambaRadixCache``,
    whose nodes hold the full-attention slots in ``value`` (and lock with ``full_lock_ref``):
    the sweep walks it like a RadixCache, and leaves out locked nodes when asked."""
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache

    _, alloc = _cache()
    r2t = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    cache = MambaRadixCache(
        CacheInitParams(
            disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1
        )
    )
    a = alloc.alloc(12)
    cache.insert(
        InsertParams(key=RadixKey(list(range(12))), value=a, mamba_value=torch.tensor([1]))
    )
    b = torch.cat([a[:5], alloc.alloc(6)])
    cache.insert(
        InsertParams(
            key=RadixKey(list(range(5)) + list(range(50, 56))),
            value=b,
            mamba_value=torch.tensor([2]),
        )
    )
    walk = walk_radix_cache_for_canary(radix_cache=cache)
    _check_walk(walk, [a, b])
    node = next(iter(cache.root_node.children.values()))  # the shared 5-token prefix
    node.full_lock_ref += 1
    locked_out = walk_radix_cache_for_canary(radix_cache=cache, unlocked_only=True)
    assert set(locked_out.slot_indices.tolist()) == set(a[5:].tolist()) | set(b[5:].tolist())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
