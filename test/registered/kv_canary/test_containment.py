"""Abort mode at the unit level (docs/architecture.md, "Violation pipeline"; docs/subsystems.md,
"Containment"): the requests
a violation touches (``rids=``), abort mode's containment on the serving driver's real pools
with a real sglang ``RadixCache``, and the Prometheus series in a private registry. The
end-to-end HTTP server tests are in ``test_e2e_server.py``."""

from __future__ import annotations

from http import HTTPStatus
import sys

import pytest
import torch

from serving_driver import ServingDriver
from sglang.jit_kernel.kv_canary.consts import FailReason
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag
from sglang.srt.kv_canary.perturb.config import PerturbConfig
from sglang.srt.kv_canary.perturb.perturber import CanaryPerturber
from sglang.srt.kv_canary.radix_cache_walker import radix_nodes_holding_slots
from sglang.srt.kv_canary.violations.containment import (
    PREFIX_ABORT_MESSAGE,
    ContainmentManager,
    parse_prefix_abort_rids,
)
from sglang.srt.kv_canary.violations.metrics import CanaryMetrics
from sglang.srt.kv_canary.batch_state import ForwardRequests
from sglang.srt.kv_canary.violations.resolver import RequestResolver
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.kv_canary.violations.records import ViolationRecord, merge_incidents
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")

MESSAGE = "kv_canary: KV cache corruption detected"


def _row(tag, slot, *, req_row, bits=FailReason.VERIFY_REAL_KV_HASH_MISMATCH, read_position=3):
    return ViolationRecord(
        launch_tag=int(tag),
        slot_idx=slot,
        position=read_position,
        stored_token=7,
        expected_token=-1,
        stored_chain_hash=0,
        expected_aux=0,
        fail_bits=int(bits),
        read_position=read_position,
        req_to_token_row=req_row,
    )


def _flip(d: ServingDriver, slot: int) -> None:
    d.kv_pool.k_buffer[0][slot].view(torch.uint8).view(-1)[0] ^= 0x5A


def _shared_pair(d: ServingDriver):
    """Two running requests sharing a 12-token prefix, and one unrelated, all prefilled."""
    a = d.add_request(prompt_len=20, max_new=40)
    d.settle()
    b = d.add_request(prompt_len=24, max_new=40, share_with=a, shared_len=12)
    c = d.add_request(prompt_len=10, max_new=40)
    d.settle()
    assert all(r in d.running for r in (a, b, c))
    return a, b, c


def _tree_over(d: ServingDriver, reqs):
    """A real RadixCache holding ``reqs``' prefixes, over an allocator of its own (evicting
    frees into it, never into the driver's: the driver keeps its own accounting)."""
    r2t = ReqToTokenPool(size=4, max_context_len=256, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(
        d.kv_pool.size, torch.bfloat16, "cpu", d.kv_pool, need_sort=False
    )
    cache = RadixCache(
        CacheInitParams(
            disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1
        )
    )
    held = set()
    for r in reqs:
        cache.insert(
            InsertParams(
                key=RadixKey(r.tokens[: r.kv_len]), value=torch.tensor(r.slots[: r.kv_len])
            )
        )
        held |= set(r.slots[: r.kv_len])
    # the tree's slots are allocated, as in sglang (the release guard reads the free list)
    alloc.free_pages = alloc.free_pages[~torch.isin(alloc.free_pages, torch.tensor(sorted(held)))]
    return cache, alloc


def _cached_slots(cache) -> set:
    out, stack = set(), list(cache.root_node.children.values())
    while stack:
        n = stack.pop()
        out |= set(n.value.tolist())
        stack.extend(n.children.values())
    return out


# ---- rids: which requests an incident touches --------------------------------------------------


def test_resolver_names_the_reader_and_every_running_request_mapping_the_slot():
    d = ServingDriver(seed=5, mode="log")
    a, b, c = _shared_pair(d)
    forward = ForwardRequests.of([a, c])  # the forward that read it: a and c
    shared = a.slots[4]
    resolver = RequestResolver(req_to_token=d.req_to_token_pool.req_to_token)
    resolver.running_reqs = lambda: list(d.running)
    inc = merge_incidents([_row(CanaryLaunchTag.HEAD_K_FULL, shared, req_row=a.row)])
    (got,) = resolver.resolve(inc, forward)
    assert got.rids == (str(a.rid), str(b.rid))  # the reader first, then b (shares it)
    assert [r.rid for r in got.running] == [a.rid, b.rid]
    # a sweep row (no reader) of c's own slot: c alone; of a slot nobody maps: none
    (sweep,) = resolver.resolve(
        merge_incidents([_row(CanaryLaunchTag.SWEEP_K_FULL, c.slots[2], req_row=-1)]), forward
    )
    assert sweep.rids == (str(c.rid),)
    free = next(s for s in range(1, d.kv_pool.size) if s not in d.slot_refs)
    (none,) = resolver.resolve(
        merge_incidents([_row(CanaryLaunchTag.SWEEP_K_FULL, free, req_row=-1)]), forward
    )
    assert none.rids == () and none.running == ()


def test_resolver_names_a_reader_that_finished_and_ignores_stale_row_entries():
    d = ServingDriver(seed=6, mode="log")
    a, b, c = _shared_pair(d)
    forward = ForwardRequests.of(list(d.running))
    row_a, slot = a.row, a.slots[15]
    a.to_finish = FINISH_ABORT("gone")  # a finishes before the report: its row is freed
    d._finish()
    assert a.row is None
    # c's row past its allocated length holds a's slot (a leftover): not a mapping
    d.req_to_token_pool.req_to_token[c.row, len(c.slots) + 1] = slot
    resolver = RequestResolver(req_to_token=d.req_to_token_pool.req_to_token)
    resolver.running_reqs = lambda: list(d.running)
    (got,) = resolver.resolve(
        merge_incidents([_row(CanaryLaunchTag.TAIL_K_FULL, slot, req_row=row_a)]), forward
    )
    assert got.rids == (str(a.rid),) and got.running == ()


def test_resolver_translates_an_swa_slot_through_the_table():
    d = ServingDriver(seed=7, mode="log", pool="swa", swa_window=8, num_swa_slots=256)
    a, b, c = _shared_pair(d)
    resolver = RequestResolver(
        req_to_token=d.req_to_token_pool.req_to_token, swa_index_lut=d.swa_table
    )
    resolver.running_reqs = lambda: list(d.running)
    full = c.slots[-1]
    (got,) = resolver.resolve(
        merge_incidents([_row(CanaryLaunchTag.HEAD_K_SWA, d.swa_slot(full), req_row=-1)]),
        ForwardRequests.of([]),
    )
    assert got.rids == (str(c.rid),)
    # the same number as a FULL slot is another slot space: not c's (unless c maps it)
    (other,) = resolver.resolve(
        merge_incidents([_row(CanaryLaunchTag.HEAD_K_FULL, d.swa_slot(full), req_row=-1)]),
        ForwardRequests.of([]),
    )
    assert (str(c.rid) in other.rids) == (d.swa_slot(full) in c.slots)


def test_reports_name_the_requests_in_log_mode(caplog):
    d = ServingDriver(seed=8, mode="log", real_data="partial")
    a, b, c = _shared_pair(d)
    _flip(d, a.slots[3])
    with caplog.at_level("WARNING", logger="sglang.srt.kv_canary"):
        d.step()
    lines = parse_violation_lines(caplog.text)
    assert lines and all(v.slot_idx == a.slots[3] for v in lines)
    assert {frozenset(v.rids) for v in lines} == {frozenset({str(a.rid), str(b.rid)})}
    assert "Requests touched: " in caplog.text


def test_resolver_marks_incidents_that_touch_only_faked_transfers():
    d = ServingDriver(seed=9, mode="log")
    a, b, c = _shared_pair(d)
    forward = ForwardRequests.of([a, c])
    resolver = RequestResolver(req_to_token=d.req_to_token_pool.req_to_token)
    resolver.running_reqs = lambda: list(d.running)
    rows = [
        _row(CanaryLaunchTag.HEAD_K_FULL, a.slots[4], req_row=a.row),  # a reads, b shares
        _row(CanaryLaunchTag.HEAD_K_FULL, c.slots[2], req_row=c.row),  # c alone
        _row(CanaryLaunchTag.SWEEP_K_FULL, 0, req_row=-1),  # nobody
    ]
    faked = {id(a), id(c)}
    resolver.faked_transfer = lambda r: id(r) in faked
    got = resolver.resolve(merge_incidents(rows), forward)
    # b's transfer was real: the slot it shares with a is a fault
    assert [t.faked_transfer for t in got] == [False, True, False]
    faked.add(id(b))
    got = resolver.resolve(merge_incidents(rows), forward)
    assert [t.faked_transfer for t in got] == [True, True, False]


def test_reads_of_a_faked_pd_transfer_are_set_aside_and_any_other_raises(caplog):
    """A PD decode server: sglang fakes the transfer of its warm-up and /health_generate
    requests (nothing is sent), so what their slots hold is no fault. A slot only such a
    request reads is set aside: no report, no raise, out of the violation counts, counted
    apart and logged once; the same fault read by a request whose transfer was real raises."""
    d = ServingDriver(seed=10, mode="raise", real_data="partial")
    a, b, c = _shared_pair(d)
    d.manager.attach_scheduler(
        radix_cache=None,
        running_reqs=lambda: list(d.running),
        metrics_labels=None,
        kv_slots_in_use=lambda: 0,
        faked_transfer=lambda r: r is c,
    )
    _flip(d, c.slots[2])
    with caplog.at_level("INFO", logger="sglang.srt.kv_canary"):
        d.step()
        d.step()
    assert d.manager.count_violations() == 0
    assert d.manager.violations.total_incidents == 0
    assert d.manager.violations.set_aside_incidents >= 2  # read at both steps
    assert caplog.text.count("are not reported: nothing was sent for them") == 1
    assert not parse_violation_lines(caplog.text)
    _flip(d, a.slots[3])
    with pytest.raises(RuntimeError, match="KV-cache corruption"):
        d.step()
    assert d.manager.count_violations() > 0


# ---- abort mode ---------------------------------------------------------------------------------


def test_abort_mode_aborts_the_touched_requests_evicts_the_prefix_and_keeps_serving(caplog):
    d = ServingDriver(seed=9, mode="abort", real_data="partial")
    a, b, c = _shared_pair(d)
    cache, tree_alloc = _tree_over(d, [a, c])
    d.manager.attach_scheduler(
        radix_cache=cache,
        running_reqs=lambda: list(d.running),
        metrics_labels=None,
        kv_slots_in_use=lambda: 0,
    )
    shared = a.slots[3]
    free_before = tree_alloc.available_size()
    a_cached, c_cached = set(a.slots[: a.kv_len]), set(c.slots[: c.kv_len])
    _flip(d, shared)
    with caplog.at_level("WARNING", logger="sglang.srt.kv_canary"):
        d.step()  # no raise: abort mode contains it
    lines = parse_violation_lines(caplog.text)
    assert {(v.slot_idx, frozenset(v.rids)) for v in lines} == {
        (shared, frozenset({str(a.rid), str(b.rid)}))
    }  # a's read and b's read
    for r in (a, b):
        assert r.to_finish is not None, f"request {r.rid} was not aborted"
        reason = r.to_finish.to_json()
        assert (
            reason["type"] == "abort" and reason["status_code"] == HTTPStatus.INTERNAL_SERVER_ERROR
        )
        assert reason["message"] == (
            f"{MESSAGE} (launch_tag=TAIL_K_FULL, fail_reason=verify_real_kv_hash)"
        )
        assert r.skip_radix_cache_insert and r not in d.running  # the driver finished them
    assert c.to_finish is None and c in d.running
    assert d.manager.containment.aborted_requests == 2
    # after the batch result: a's cached prefix (it holds the slot) is evicted, c's is not
    assert radix_nodes_holding_slots(radix_cache=cache, slots=torch.tensor([shared]))
    d.manager.after_batch_result()
    cached = _cached_slots(cache)
    assert shared not in cached and not a_cached & cached and cached == c_cached
    # freed through the allocator, and the tree's own accounting follows
    assert tree_alloc.available_size() - free_before == len(a_cached)
    assert cache.evictable_size() == len(c_cached)
    assert d.manager.containment.pending_slots == ()
    # serving goes on, clean
    before = d.manager.count_violations()
    d.run(30)
    assert d.manager.count_violations() == before


def test_abort_mode_waits_for_locked_nodes_and_aborts_who_locks_them(caplog):
    d = ServingDriver(seed=10, mode="abort", real_data="partial")
    a, b, c = _shared_pair(d)
    cache, _ = _tree_over(d, [a])
    d.manager.attach_scheduler(
        radix_cache=cache,
        running_reqs=lambda: list(d.running),
        metrics_labels=None,
        kv_slots_in_use=lambda: 0,
    )
    (node,) = cache.root_node.children.values()
    cache.inc_lock_ref(node)  # a request holds the prefix: not evictable
    slot = a.slots[1]
    touched = d.manager.requests.resolve(
        merge_incidents([_row(CanaryLaunchTag.SWEEP_K_FULL, slot, req_row=-1)]),
        ForwardRequests.of([]),
    )
    d.manager.containment.contain(
        merge_incidents([_row(CanaryLaunchTag.SWEEP_K_FULL, slot, req_row=-1)]),
        touched,
        step=d.manager.step,
    )
    # a request admitted before the abort took effect maps the corrupt prefix too
    late = d.add_request(prompt_len=14, max_new=20, share_with=a, shared_len=6)
    d._admit()
    assert late in d.running and slot in late.slots
    d._finish()
    # c was not touched; a and b map the slot and were aborted by contain
    assert c.to_finish is None and a not in d.running and b not in d.running
    assert late.to_finish is None
    with caplog.at_level("WARNING", logger="sglang.srt.kv_canary"):
        d.manager.after_batch_result()
    assert slot in _cached_slots(cache)  # locked: kept for now
    assert late.to_finish is not None and late.to_finish.message == PREFIX_ABORT_MESSAGE
    assert parse_prefix_abort_rids(caplog.text) == (str(late.rid),)  # logged, by id
    assert d.manager.containment.aborted_requests == 3  # a, b by contain; late here
    cache.dec_lock_ref(node)
    d._finish()
    d.manager.after_batch_result()
    assert slot not in _cached_slots(cache) and d.manager.containment.pending_slots == ()


def test_abort_mode_refuses_a_tree_it_cannot_evict_from():
    d = ServingDriver(seed=11, mode="abort", pool="swa", swa_window=8, num_swa_slots=256)
    r2t = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    swa = SWARadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=r2t,
            token_to_kv_pool_allocator=d.allocator,
            page_size=1,
            sliding_window_size=8,
        )
    )
    with pytest.raises(RuntimeError, match="--kv-canary abort cannot evict.*SWARadixCache"):
        d.manager.attach_radix_cache(swa)
    assert (
        ContainmentManager(
            resolver=d.manager.requests, swa_index_lut=None, records=d.manager.groups[0].k_tail
        ).attach_radix_cache(None)
        is None
    )  # no tree: nothing to evict
    from sglang.srt.mem_cache.unified_cache_components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = CacheInitParams(
        disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=d.allocator, page_size=1
    )
    params.tree_components = (ComponentType.FULL,)  # as sglang's scheduler sets it
    with pytest.raises(RuntimeError, match="--kv-canary abort cannot evict.*UnifiedRadixCache"):
        d.manager.attach_radix_cache(UnifiedRadixCache(params))


# ---- metrics -----------------------------------------------------------------------------------


def _sample(registry, name, **labels):
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_metrics_count_each_line_each_abort_and_the_slots_checked(caplog):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    labels = {"model_name": "tiny", "tp_rank": "0"}
    d = ServingDriver(seed=12, mode="abort", real_data="partial", sweep_interval=3)
    a, b, c = _shared_pair(d)
    cache, _ = _tree_over(d, [a, c])
    d.manager.attach_scheduler(
        radix_cache=cache,
        running_reqs=lambda: list(d.running),
        metrics_labels=labels,
        kv_slots_in_use=lambda: 123,
        metrics_registry=registry,
    )
    d.step()
    verified = _sample(registry, "sglang:kv_canary_verified_slots_total", **labels)
    assert verified > 0
    assert _sample(registry, "sglang:kv_canary_protected_tokens", **labels) == 123
    d.step()
    assert _sample(registry, "sglang:kv_canary_verified_slots_total", **labels) > verified
    assert (
        _sample(registry, "sglang:kv_canary_sweep_passes_total", **labels) == d.manager.sweep_passes
    )
    _flip(d, a.slots[3])
    with caplog.at_level("WARNING", logger="sglang.srt.kv_canary"):
        d.step()
    lines = parse_violation_lines(caplog.text)
    assert lines
    by_label = {}
    for v in lines:
        key = (v.launch_tag, "+".join(v.fail_reasons))
        by_label[key] = by_label.get(key, 0) + 1
    for (tag, reason), n in by_label.items():
        assert (
            _sample(
                registry,
                "sglang:kv_canary_violations_total",
                **labels,
                pool="target",
                launch_tag=tag,
                fail_reason=reason,
            )
            == n
        )
    assert _sample(registry, "sglang:kv_canary_aborted_requests_total", **labels) == 2
    assert _sample(registry, "sglang:kv_canary_dropped_violations_total", **labels) == 0


def test_metrics_count_dropped_rows():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    metrics = CanaryMetrics({"tp_rank": 0}, registry=registry)
    metrics.on_incidents([], dropped=5, pool="target")
    assert _sample(registry, "sglang:kv_canary_dropped_violations_total", tp_rank="0") == 5


def test_metrics_histogram_of_heal_seconds():
    """``sglang:kv_canary_heal_seconds``: one observation per healed request, in seconds."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    metrics = CanaryMetrics({"tp_rank": 0}, registry=registry)
    metrics.on_heal_seconds([0.02, 0.3, 4.0])
    name = "sglang:kv_canary_heal_seconds"
    assert _sample(registry, f"{name}_count", tp_rank="0") == 3
    assert _sample(registry, f"{name}_sum", tp_rank="0") == pytest.approx(4.32)
    assert _sample(registry, f"{name}_bucket", tp_rank="0", le="0.5") == 2


def test_max_faults_stops_injection():
    d = ServingDriver(seed=13, mode="log")
    p = CanaryPerturber(
        config=PerturbConfig(warmup_steps=0, req_to_token_prob=1.0, max_faults=2),
        groups=d.groups,
        req_to_token=d.req_to_token_pool.req_to_token,
        radix_cache=lambda: None,
    )
    a, b, c = _shared_pair(d)
    for step in range(1, 8):
        fb = d._decode_batch(d.running)
        p.before_forward(fb, step=step)
        p.after_forward(fb, step=step)
    assert len(p.injected) == 2 and p.restored == 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
