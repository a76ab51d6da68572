"""Abort mode's release guard on real sglang objects (docs/subsystems.md, "Containment"): sglang 0.5.12's ``Req``, ``ReqToTokenPool``, ``TokenToKVPoolAllocator`` /
``PagedTokenToKVPoolAllocator`` and ``RadixCache``, released through sglang's own
``release_kv_cache`` with the plugin's ``cache_finished_req`` hook around the tree cache's
method. A request's ``req_to_token`` entry is rewritten to another holder's slot and left
there (what a server bug would do); after every release the pool's accounting must hold:
each page free exactly once, or held by exactly one live row or radix node, none lost. Heal
mode's containment on the same objects: a request taken back (and, past its heals, aborted
without the token of the forward that read corrupt KV), a slot retired only when a forward
launched after its free finds it corrupt again, and no more than the retirement budget."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Optional

import pytest
import torch

from sglang.jit_kernel.kv_canary.types import CANARY_SLOT_BYTES
from sglang.srt.kv_canary import plugin
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.jit_kernel.kv_canary.consts import FailReason
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag
from sglang.srt.kv_canary.violations.containment import (
    RETIRE_BUDGET_LINE_PREFIX,
    ContainmentManager,
    TakeBacks,
    parse_notice_lines,
)
from sglang.srt.kv_canary.violations.rank_relay import (
    RankAgreement,
    RankRelay,
    connect_input,
    take_containment_notices,
)
from sglang.srt.kv_canary.violations.release_guard import (
    EVICTION_LINE_PREFIX,
    RELEASE_LINE_PREFIX,
)
from sglang.srt.kv_canary.violations.resolver import IncidentRequests, RequestResolver
from sglang.srt.kv_canary.perturb import CanaryPerturber
from sglang.srt.kv_canary.perturb.config import PerturbConfig
from sglang.srt.kv_canary.perturb.report import parse_perturb_line
from sglang.srt.kv_canary.violations.records import ViolationRecord, merge_incidents
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
from sglang.srt.mem_cache.allocator import (
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-test-cpu")

NUM_SLOTS = 256


@pytest.fixture
def make_pool():
    """``make_pool(page_size, chunk=False)``: a :class:`Pool`, with sglang's global server
    args set to that page size (``release_kv_cache`` reads them); restored after the test."""
    import sglang.srt.server_args as sa

    saved = sa._global_server_args

    def make(page_size: int, *, chunk: bool = False, **heal) -> "Pool":
        sa.set_global_server_args_for_scheduler(
            sa.ServerArgs(model_path="dummy", page_size=page_size)
        )
        return Pool(page_size, chunk=chunk, **heal)

    yield make
    sa._global_server_args = saved


class SchedulerStandIn:
    """The parts of sglang's ``Scheduler`` heal mode's retraction touches, for requests that
    are in no batch: the tree cache, no running or launched batch, and a record of what it
    queues again (``_add_request_to_queue``) and sends to the detokenizer (``stream_output``)."""

    def __init__(self, tree_cache):
        self.tree_cache = tree_cache
        self.running_batch = None
        self.cur_batch = None
        self.chunked_req = None
        self.result_queue = []
        self.queued: list = []
        self.streamed: list = []

    def _add_request_to_queue(self, req, is_retracted: bool = False) -> None:
        self.queued.append((req, is_retracted))

    def stream_output(self, reqs, return_logprob: bool, skip_req=None) -> None:
        self.streamed.append(list(reqs))


class Pool:
    """One scheduler's KV bookkeeping: the allocator, ``req_to_token``, the tree cache (a
    ``RadixCache``, or a ``ChunkCache`` with ``chunk=True``), the canary records and the guard
    attached to the cache as abort mode attaches it (heal mode's, with ``heal_max``: its
    retraction over :class:`SchedulerStandIn`)."""

    def __init__(
        self,
        page_size: int,
        *,
        chunk: bool = False,
        heal_max: Optional[int] = None,
        retire_max_fraction: float = 0.01,
    ):
        self.page_size = page_size
        if page_size == 1:
            self.alloc = TokenToKVPoolAllocator(
                NUM_SLOTS, torch.bfloat16, "cpu", None, need_sort=False
            )
        else:
            self.alloc = PagedTokenToKVPoolAllocator(
                NUM_SLOTS, page_size, torch.bfloat16, "cpu", None, need_sort=False
            )
        self.r2t = ReqToTokenPool(
            size=8, max_context_len=128, device="cpu", enable_memory_saver=False
        )
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.alloc,
            page_size=page_size,
        )
        self.cache = ChunkCache(params) if chunk else RadixCache(params)
        self.records = torch.zeros(NUM_SLOTS + page_size, CANARY_SLOT_BYTES, dtype=torch.uint8)
        self.live = []
        # abort mode's containment over this pool, attached as the scheduler attaches it
        resolver = RequestResolver(req_to_token=self.r2t.req_to_token)
        resolver.running_reqs = lambda: list(self.live)
        self.containment = ContainmentManager(
            resolver=resolver,
            swa_index_lut=None,
            records=self.records,
            heal_max=heal_max,
            retire_max_fraction=retire_max_fraction,
        )
        self.containment.attach_radix_cache(self.cache)
        self.scheduler = SchedulerStandIn(self.cache)
        if heal_max is not None:
            self.containment.attach_retraction(seam.SchedulerRetraction(self.scheduler))
        self.guard = self.containment.guard
        assert seam.release_guard_of(self.cache) is self.guard
        self._rid = 0

    def request(self, n: int, *, first_token: int = 100, tokens=None) -> Req:
        """A request whose ``n`` prompt tokens (``tokens``, or new ones) were prefilled: its
        own pages allocated, its row and each slot's record (token, position, a chain hash of
        the tokens before it) written as the canary writes them."""
        self._rid += 1
        if tokens is None:
            tokens = [first_token + self._rid * 1000 + i for i in range(n)]
        req = Req(f"r{self._rid}", "", tokens, SamplingParams(max_new_tokens=4))
        self.prefill(req)
        return req

    def prefill(self, req: Req) -> None:
        """Prefill ``req``'s prompt into a row and pages of its own (a new request, or one
        taken back and queued again)."""
        tokens = list(req.origin_input_ids)
        n = len(tokens)
        self.r2t.alloc([req])
        pages = -(-n // self.page_size)
        slots = self.alloc.alloc(pages * self.page_size)[:n]
        self.r2t.req_to_token[req.req_pool_idx, :n] = slots.to(torch.int32)
        req.kv_committed_len = req.kv_allocated_len = n
        req.last_node = getattr(self.cache, "root_node", None)
        words = self.records.view(torch.int64)
        chain = 0
        for pos, (slot, tok) in enumerate(zip(slots.tolist(), tokens)):
            words[slot, 0], words[slot, 1], words[slot, 2] = tok, pos, chain
            chain = (chain * 1_000_003 + tok + 1) % (1 << 61)  # identical prefixes: same chain
        self.live.append(req)

    def row(self, req: Req):
        return self.r2t.req_to_token[req.req_pool_idx, : req.kv_allocated_len].tolist()

    def release(self, req: Req, *, insert: bool = False) -> None:
        """sglang's release of a finished request, through the plugin's hook."""
        release_kv_cache(req, self.cache, is_insert=insert)
        self.live.remove(req)

    def tree_slots(self):
        if isinstance(self.cache, ChunkCache):
            return []
        out, stack = [], list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            out += node.value.tolist()
            stack.extend(node.children.values())
        return out

    def check_busy_count(self) -> None:
        """sglang's own check after every batch (``self_check_during_busy``): free, radix
        evictable and protected, and each live request's uncached tokens add up to the
        pool."""
        p = self.page_size
        tree = (
            0
            if isinstance(self.cache, ChunkCache)
            else self.cache.evictable_size() + self.cache.protected_size()
        )
        uncached = sum(-(-r.kv_allocated_len // p) * p - r.cache_protected_len for r in self.live)
        assert self.alloc.available_size() + tree + uncached == NUM_SLOTS, "sglang sees a leak"

    def check_accounting(self) -> None:
        """Every page of the pool exactly once: free, or named by a live row or a radix node,
        or retired by heal mode (page 0 is the padding page, never handed out)."""
        p = self.page_size
        free = torch.cat([self.alloc.free_pages, self.alloc.release_pages]).tolist()
        assert len(free) == len(set(free)), "a page is free twice"
        held = {}
        for req in self.live:
            for s in self.row(req):
                held.setdefault(s // p, set()).add(req.rid)
        for s in self.tree_slots():
            held.setdefault(s // p, set()).add("tree")
        assert not set(free) & set(held), "a page is free and held"
        assert all(len(h) == 1 for h in held.values()), f"a page held twice: {held}"
        retired = self.containment.retired_pages
        assert not retired & (set(free) | set(held)), "a retired page is free or held"
        assert set(free) | set(held) | retired == set(range(1, NUM_SLOTS // p + 1)), (
            "a page is lost"
        )


@pytest.fixture
def hooked(monkeypatch):
    """The tree caches' ``cache_finished_req`` wrapped by the plugin's hook, as
    ``HookRegistry`` wraps it in a server (restored after the test)."""
    for cls in (RadixCache, ChunkCache):
        original = cls.cache_finished_req
        monkeypatch.setattr(
            cls,
            "cache_finished_req",
            lambda self, req, *a, _o=original, **k: plugin._cache_finished_req(
                _o, self, req, *a, **k
            ),
        )


def _corrupt(pool: Pool, req: Req, pos: int, slot: int) -> int:
    """Rewrite ``req``'s entry at ``pos`` to ``slot`` and leave it; returns the old slot."""
    old = int(pool.r2t.req_to_token[req.req_pool_idx, pos])
    pool.r2t.req_to_token[req.req_pool_idx, pos] = slot
    return old


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("first", ["victim", "donor"])
def test_an_aborted_request_frees_its_own_slots_not_the_ones_its_corrupt_row_names(
    make_pool, hooked, caplog, page_size, first
):
    """A's last entry names B's slot (B still running): whichever of the two is released
    first, B's page is freed once, A's own page is found by its record and freed, and the
    pool loses nothing."""
    pool = make_pool(page_size)
    a = pool.request(page_size + 1)  # its last position alone on its last page
    b = pool.request(2 * page_size + 4)
    c = pool.request(5)  # untouched
    victim_pos = page_size  # A's last position
    old = _corrupt(pool, a, victim_pos, pool.row(b)[3])
    for r in (a, b):
        seam.mark_contained(r)
    order = (a, b) if first == "victim" else (b, a)
    pool.check_busy_count()
    with caplog.at_level(logging.WARNING):
        pool.release(order[0])
        pool.check_busy_count()  # between the two releases too
        pool.release(order[1])
    pool.check_busy_count()
    pool.guard.settle(pool.cache)
    pool.check_accounting()
    free = torch.cat([pool.alloc.free_pages, pool.alloc.release_pages]).tolist()
    assert old // page_size in free  # A's own page (its row no longer named it) is free
    assert pool.guard.pending == []
    # the victim's release holds B's page back: B still runs (B frees it later), or B
    # freed it already (freeing it again would hand it out twice)
    assert pool.guard.held_back_slots == page_size
    assert pool.guard.reclaimed_slots == page_size
    assert pool.guard.unattributed == 0
    assert RELEASE_LINE_PREFIX in caplog.text
    pool.release(c)
    pool.check_accounting()


@pytest.mark.parametrize("page_size", [1, 16])
def test_without_the_guard_the_same_release_frees_a_live_page_and_leaks_one(make_pool, page_size):
    """The defect the guard exists for, on the same objects: sglang alone frees B's page
    while B holds it, and A's own page is lost."""
    pool = make_pool(page_size)
    a = pool.request(page_size + 1)
    b = pool.request(2 * page_size + 4)
    _corrupt(pool, a, page_size, pool.row(b)[3])
    pool.release(a)  # not marked contained: the hook leaves it to sglang
    with pytest.raises(AssertionError, match="a page is free and held"):
        pool.check_accounting()


def test_a_corrupt_entry_whose_page_mates_free_its_own_page_is_attributed(
    make_pool, hooked, caplog
):
    """Page size 16: the entry's own slot is on a page its other entries still name, so the
    release frees it with them; nothing is reclaimed and nothing is unattributed."""
    pool = make_pool(16)
    a = pool.request(40)
    b = pool.request(40)
    _corrupt(pool, a, 20, pool.row(b)[5])
    seam.mark_contained(a)
    with caplog.at_level(logging.WARNING):
        pool.release(a)
    pool.check_busy_count()
    pool.check_accounting()
    assert (pool.guard.held_back_slots, pool.guard.reclaimed_slots) == (16, 0)
    assert pool.guard.unattributed == 0 and "unattributed entries 0" in caplog.text


def test_identical_prefixes_make_the_other_holders_slot_look_like_the_requests_own(
    make_pool, hooked
):
    """Two requests prefilled the same tokens (identical records). A's entry names B's slot:
    its record fits A too, but A's own slot, named by nobody, holds the same key: that one is
    A's, B's stays with B (in either order of release)."""
    for first in ("a", "b"):
        pool = make_pool(1)
        a = pool.request(10, first_token=5)
        b = pool.request(10, first_token=5)
        words = pool.records.view(torch.int64)
        for pos, (sa, sb) in enumerate(zip(pool.row(a), pool.row(b))):  # same tokens
            words[sb, 0], words[sb, 2] = words[sa, 0], words[sa, 2]  # and chain
            b.origin_input_ids[pos] = a.origin_input_ids[pos]
        _corrupt(pool, a, 6, pool.row(b)[6])
        for r in (a, b):
            seam.mark_contained(r)
        for r in (a, b) if first == "a" else (b, a):
            pool.release(r)
            pool.check_busy_count()
        pool.guard.settle(pool.cache)
        pool.check_accounting()
        assert pool.guard.reclaimed_slots == 1 and pool.guard.unattributed == 0, first


def _same_tokens(pool: Pool, reqs) -> None:
    """Give every request of ``reqs`` the first one's tokens (identical records: the same
    token, position and chain)."""
    words = pool.records.view(torch.int64)
    first = reqs[0]
    for other in reqs[1:]:
        for pos, (s0, s1) in enumerate(zip(pool.row(first), pool.row(other))):
            words[s1, 0], words[s1, 2] = words[s0, 0], words[s0, 2]
            other.origin_input_ids[pos] = first.origin_input_ids[pos]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("order", ["abc", "bac", "cab", "cba"])
def test_a_third_holder_of_identical_records_keeps_its_page(make_pool, hooked, page_size, order):
    """Three requests prefilled the same tokens in slots of their own (identical records). A's
    entry names B's slot; C holds a slot with the same (position, token) as well. Released in
    any order: no page is freed while another live request names it (C's above all: its
    record fits A's entry, but C holds it), A's own slot is freed once (at page size 1 found
    by its record, nobody naming it; at 16 with its page mates), nothing is lost."""
    pool = make_pool(page_size)
    reqs = dict(zip("abc", [pool.request(2 * page_size + 3, first_token=5) for _ in range(3)]))
    _same_tokens(pool, list(reqs.values()))
    pos = page_size + 1  # on each request's second page
    own = _corrupt(pool, reqs["a"], pos, pool.row(reqs["b"])[pos])
    for r in reqs.values():
        seam.mark_contained(r)
    for n, name in enumerate(order):
        pool.release(reqs[name])
        pool.check_busy_count()
        pool.guard.settle(pool.cache)
        free = set(torch.cat([pool.alloc.free_pages, pool.alloc.release_pages]).tolist())
        for live in order[n + 1 :]:
            row = pool.row(reqs[live])
            if live == "a":
                row = row[:pos] + row[pos + 1 :]  # its corrupt entry names B's page
            assert not free & {s // page_size for s in row}, (name, live)
        if "a" in order[: n + 1]:
            pool.check_accounting()
    assert own // page_size in free
    assert pool.guard.unattributed == 0 and pool.guard.pending == []
    assert pool.guard.reclaimed_slots == (1 if page_size == 1 else 0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_corrupt_row_sglang_cached_before_its_report_is_evicted_under_the_guard(
    make_pool, hooked, page_size
):
    """On the GPU a report comes a forward late, and sglang may cache a request's row in the
    radix cache before (``cache_unfinished_req`` after a prefill): a corrupt entry then puts
    B's slot in the tree and leaves A's own slot with nobody (at page size 16: on a page the
    node's other slots still hold). Abort mode's eviction of that prefix must not free B's
    page (B runs) and must free A's."""
    pool = make_pool(page_size)
    a = pool.request(12 if page_size == 1 else 32)
    b = pool.request(12 if page_size == 1 else 32)
    a.fill_ids = list(a.origin_input_ids)
    own = _corrupt(pool, a, 7, pool.row(b)[3])
    pool.cache.cache_unfinished_req(a)  # the corrupt mapping enters the tree
    assert pool.row(b)[3] in pool.tree_slots() and own not in pool.tree_slots()
    seam.mark_contained(a)
    pool.release(a)  # its span is the tree's now: nothing of it to free
    # the incident (B's slot read at A's position 7) is contained: the prefix holding the
    # slot is evicted after the batch result
    (incident,) = merge_incidents(
        [
            ViolationRecord(
                launch_tag=int(CanaryLaunchTag.HEAD_K_FULL),
                slot_idx=pool.row(b)[3],
                position=7,
                stored_token=7,
                expected_token=-1,
                stored_chain_hash=0,
                expected_aux=0,
                fail_bits=int(FailReason.VERIFY_POSITION_MISMATCH),
                read_position=7,
                req_to_token_row=a.req_pool_idx or 0,
            )
        ]
    )
    pool.containment.contain([incident], [IncidentRequests(rids=(), running=())], step=1)
    pool.containment.after_batch_result(launched_step=1)
    assert pool.containment.evicted_nodes == 1
    pool.check_busy_count()
    pool.check_accounting()
    free = pool.alloc.free_pages.tolist()
    assert own // page_size in free and pool.row(b)[3] // page_size not in free
    assert pool.guard.held_back_slots == page_size and pool.guard.unattributed == 0
    # page 1: A's slot reclaimed by its record; page 16: freed with its page mates
    assert pool.guard.reclaimed_slots == (1 if page_size == 1 else 0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_an_evicted_prefix_frees_the_page_a_corrupt_row_names_and_keeps_sglangs_count(
    make_pool, hooked, page_size
):
    """The GPU heal storm at page 16 (10 minutes): a kept fault gave a live request V's first
    page the entries of a finished request's page the radix cache held; the prefix was then
    evicted for another incident before V's report. V names that page without owning it
    (its records are another sequence's, and V locks no node of the prefix), so sglang counts
    it nowhere once the tree lets it go: the eviction must free it (held back, sglang's busy
    check saw a page missing and stopped the server) and mark V, whose own release then
    reclaims the page its row lost."""
    pool = make_pool(page_size)
    done = pool.request(64)
    pool.release(done, insert=True)  # its prefix cached in the tree, nobody locking it
    cached = pool.tree_slots()
    # a sibling branch: the same first 32 tokens, other ones, then the same tokens at the
    # same positions 48-63 as the page V's row will name (same position and token, another
    # chain: the storm's prompts draw from 500 tokens, so such pairs are common)
    toks = list(done.origin_input_ids)
    sibling = pool.request(64, tokens=toks[:32] + [t + 7 for t in toks[32:48]] + toks[48:])
    pool.release(sibling, insert=True)
    assert len(pool.tree_slots()) == 96
    v = pool.request(32)
    # the kept fault: V's first page names the cached sequence's last page
    own = [_corrupt(pool, v, i, cached[48 + i]) for i in range(page_size)]
    incident = _incident(cached[12], position=12)  # another incident in the prefix
    pool.containment.contain([incident], [IncidentRequests(rids=(), running=())], step=1)
    pool.containment.after_batch_result(launched_step=1)
    assert pool.containment.evicted_nodes == 1 and not pool.tree_slots()
    pool.check_busy_count()
    free = set(pool.alloc.free_pages.tolist())
    assert cached[48] // page_size in free and own[0] // page_size not in free
    assert seam.req_contained(v)  # its release is guarded: it names a page it does not own
    pool.release(v)
    pool.check_busy_count()
    pool.check_accounting()
    assert pool.guard.reclaimed_slots == page_size and pool.guard.unattributed == 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("holder", ["evicted prefix", "released request"])
def test_a_page_a_corrupt_row_names_is_freed_by_its_holder_though_a_lost_twin_page_matches_it(
    make_pool, hooked, page_size, holder
):
    """T and W are the same request sent twice (the same prompt; greedy decoding gives the
    same tokens), each in pages of its own. The kept ``req_to_token`` fault hits W (its third
    page named D's second, at other positions: W's own page is lost, nobody names it, and
    W's count still covers it) and V (its second page named T's third, at other positions; T
    was that forward's donor). V's report comes a forward later. Then the holder of T's page
    gives it up: the radix cache (T finished, sglang cached its sequence, and the prefix is
    evicted) or T itself (it maps the slot, so it is aborted and released). V names the page
    without owning it (its records are T's, at other positions), and only that holder
    counted it: the holder frees it, and W's lost page, whose records match it, stays W's
    (reclaimed at W's release). sglang's count holds after every batch result, and once the
    requests are released the pool has lost nothing."""
    pool = make_pool(page_size)
    ps, n = page_size, 4 * max(page_size, 4)
    tokens = [7000 + i for i in range(n)]
    t, w = pool.request(n, tokens=tokens), pool.request(n, tokens=list(tokens))
    d, v = pool.request(n), pool.request(n)
    quarter = n // 4
    lost = [_corrupt(pool, w, 2 * quarter + i, pool.row(d)[quarter + i]) for i in range(ps)]
    own_v = [_corrupt(pool, v, quarter + i, pool.row(t)[2 * quarter + i]) for i in range(ps)]
    page = pool.row(v)[quarter] // ps  # T's page, named by V
    pool.check_busy_count()
    # V's report: it read T's page at its own positions (a position mismatch)
    incident = _incident(page * ps, v, position=quarter)
    if holder == "evicted prefix":
        pool.release(t, insert=True)  # T finished first: its sequence cached, unlocked
        pool.check_busy_count()
        touched = IncidentRequests(rids=(v.rid,), running=(v,), holding=(v,))
        assert pool.containment.contain([incident], [touched], step=2) == 1
        pool.containment.after_batch_result(launched_step=2)
        assert pool.containment.evicted_nodes == 1 and not pool.tree_slots()
    else:
        touched = IncidentRequests(rids=(v.rid, t.rid), running=(v, t), holding=(v, t))
        assert pool.containment.contain([incident], [touched], step=2) == 2
        pool.release(t)  # aborted: its release is guarded
        pool.containment.after_batch_result(launched_step=2)
    pool.check_busy_count()
    freed_first = _free_pages(pool)
    pool.release(v)  # aborted: its release reclaims the page its row lost
    pool.containment.after_batch_result(launched_step=3)
    pool.check_busy_count()
    assert page in freed_first and lost[0] // ps not in freed_first
    assert own_v[0] // ps in _free_pages(pool)
    for r in (w, d):  # W's own report (it read D's page) aborted it, and D with it
        seam.mark_contained(r)
    for r in (w, d):
        pool.release(r)
        pool.containment.after_batch_result(launched_step=4)
        pool.check_busy_count()
    pool.check_accounting()
    assert pool.guard.unattributed == 0 and pool.guard.pending == []
    assert pool.guard.reclaimed_slots == 2 * ps  # V's and W's own pages, at their releases


@pytest.mark.parametrize("v_page", ["cached", "own"])
def test_an_evicted_prefix_frees_a_page_a_corrupt_row_names_though_a_sibling_branch_starts_alike(
    make_pool, hooked, caplog, v_page
):
    """Page size 16. Two prompts share a 50-token prefix: sglang's tree keeps their first 48
    tokens in one node and gives each its own branch from position 48, whose first pages
    hold identical records at positions 48 and 49 (the same tokens after the same prefix).
    The kept ``req_to_token`` fault gave a live request V's second page the entries of one
    branch's first page P (its donor held that cached prompt, and finished since), at other
    positions: V's page is the tree's (``cached``: V's prompt was cached after its prefill,
    the storm's usual case) or V's own (``own``). Another fault's report in the shared prefix
    then evicts it with both branches. V names P without owning it, so only the tree counted
    P: the eviction frees it (the other branch's identical records are the tree's own, not a
    sign that P is V's) and marks V, and sglang's busy check finds every page; nothing is
    held back or reclaimed there. V's release reclaims V's own page when V's row lost it."""
    pool = make_pool(16)
    prefix = [5000 + i for i in range(50)]
    first = pool.request(80, tokens=prefix + [6000 + i for i in range(30)])
    shared, p = pool.row(first)[:48], pool.row(first)[48:64]
    pool.release(first, insert=True)
    second = pool.request(80, tokens=prefix + [6100 + i for i in range(30)])
    pool.release(second, insert=True)  # the tree splits at page 48: two branches
    assert len(pool.tree_slots()) == 48 + 2 * 32
    v = pool.request(48)
    if v_page == "cached":
        v.fill_ids = list(v.origin_input_ids)
        pool.cache.cache_unfinished_req(v)  # V's prompt cached; V locks its node
        assert v.cache_protected_len == 48
    cached_v = pool.row(v)
    own = [_corrupt(pool, v, 16 + i, p[i]) for i in range(16)]
    pool.check_busy_count()
    # an idle cached slot of the shared prefix was flipped; the sweep reported it
    nobody = IncidentRequests(rids=(), running=())
    pool.containment.contain([_incident(shared[5], position=5)], [nobody], step=1)
    with caplog.at_level(logging.WARNING):
        pool.containment.after_batch_result(launched_step=1)
    assert pool.containment.evicted_nodes == 1
    assert set(pool.tree_slots()) == (set(cached_v) if v_page == "cached" else set())
    pool.check_busy_count()
    assert EVICTION_LINE_PREFIX not in caplog.text  # no page held back, none reclaimed
    assert p[0] // 16 in _free_pages(pool) and own[0] // 16 not in _free_pages(pool)
    assert seam.req_contained(v)  # its release is guarded: it names a page it does not own
    pool.release(v)
    pool.check_busy_count()
    pool.check_accounting()
    assert pool.guard.held_back_slots == (16 if v_page == "own" else 0)
    assert pool.guard.reclaimed_slots == (16 if v_page == "own" else 0)
    assert pool.guard.unattributed == 0


def _decode_batch(pool: Pool, reqs) -> ForwardBatch:
    """A decode ``ForwardBatch`` of ``reqs`` (each request's last prefilled position is the
    one written), as the kept fault sees it before the forward."""
    rows = [r.req_pool_idx for r in reqs]
    lens = [r.kv_allocated_len for r in reqs]
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(reqs),
        input_ids=torch.tensor([r.origin_input_ids[-1] for r in reqs]),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(lens),
        out_cache_loc=torch.tensor([pool.row(r)[-1] for r in reqs]),
        seq_lens_sum=sum(lens),
        positions=torch.tensor([n - 1 for n in lens]),
    )
    fb.seq_lens_cpu = torch.tensor(lens)
    return fb


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(4))
def test_the_kept_fault_loses_the_requests_own_page_and_the_guard_reclaims_it(
    make_pool, hooked, page_size, seed
):
    """The self-test's kept ``req_to_token`` fault on real pools: at page size 16 it rewrites
    every entry of one of the victim's full pages (a single entry would leave the page named
    by its page mates, and nothing to reclaim), so the release must hold back the page the
    row names and reclaim the one it lost; the pool loses nothing."""
    pool = make_pool(page_size)
    a = pool.request(40)
    b = pool.request(40)
    before = pool.row(a)
    perturber = CanaryPerturber(
        config=PerturbConfig(seed=seed, warmup_steps=0, req_to_token_kept_prob=1.0),
        groups=(),
        req_to_token=pool.r2t.req_to_token,
        radix_cache=lambda: pool.cache,
        page_size=page_size,
    )
    perturber.before_forward(
        _decode_batch(pool, [a, b]), step=1, lasting_rows=lambda: {a.req_pool_idx}
    )
    (line,) = perturber.injected
    fault = parse_perturb_line(line)
    start, size = int(fault["position"]), int(fault.get("entries", 1))
    assert fault["fault"] == "req_to_token_kept" and size == page_size
    after = pool.row(a)
    changed = [i for i, (x, y) in enumerate(zip(before, after)) if x != y]
    assert changed == list(range(start, start + page_size))
    assert start % page_size == 0 and start + page_size <= 39  # never the seed's page
    donor = pool.row(b) if int(fault["donor_req_pool_idx"]) == b.req_pool_idx else before
    d0 = int(fault["donor_position"])
    assert after[start : start + page_size] == donor[d0 : d0 + page_size]
    assert {s // page_size for s in after[start : start + page_size]} == {
        int(fault["new_slot"]) // page_size
    }
    lost = {s // page_size for s in before} - {s // page_size for s in after}
    assert lost == {int(fault["old_slot"]) // page_size}  # the row no longer names its page
    for r in (a, b):
        seam.mark_contained(r)
    pool.release(a)
    pool.check_busy_count()
    pool.check_accounting()
    assert pool.guard.reclaimed_slots == page_size and pool.guard.unattributed == 0
    pool.release(b)
    pool.guard.settle(pool.cache)
    pool.check_accounting()


def test_a_row_naming_its_own_slot_twice_frees_it_once(make_pool, hooked):
    pool = make_pool(1)
    a = pool.request(12)
    own = _corrupt(pool, a, 9, pool.row(a)[2])
    seam.mark_contained(a)
    pool.release(a)
    pool.check_accounting()
    assert own in pool.alloc.free_pages.tolist()
    assert pool.guard.held_back_slots == 0 and pool.guard.reclaimed_slots == 1


def test_a_page_the_radix_cache_holds_is_held_back(make_pool, hooked):
    """A's entry names a slot of a prefix another finished request left in the tree: the
    tree keeps it; A's own slot is reclaimed."""
    pool = make_pool(1)
    done = pool.request(10)
    pool.release(done, insert=True)  # its KV cached in the tree
    a = pool.request(8)
    cached = pool.tree_slots()[4]
    _corrupt(pool, a, 5, cached)
    seam.mark_contained(a)
    pool.release(a)
    pool.check_accounting()
    assert cached in pool.tree_slots() and cached not in pool.alloc.free_pages.tolist()
    assert pool.guard.pending == [cached]  # named by the tree: it stays held back
    assert pool.guard.held_back_slots == 1 and pool.guard.reclaimed_slots == 1


def test_a_held_back_page_no_holder_names_any_more_is_freed_by_settle(make_pool, hooked):
    """A held-back page whose other holder left without freeing it (its row returned to
    sglang as a release that does not free would) is freed by the guard, once."""
    pool = make_pool(1)
    a = pool.request(6)
    b = pool.request(6)
    shared = pool.row(b)[1]
    _corrupt(pool, a, 4, shared)
    seam.mark_contained(a)
    pool.release(a)
    assert pool.guard.pending == [shared]
    assert pool.guard.settle(pool.cache) == 0  # B names it
    # B's other slots freed by hand, its row returned: nobody names the held-back slot now
    pool.alloc.free(torch.tensor([s for s in pool.row(b) if s != shared]))
    pool.r2t.free(b)
    pool.live.remove(b)
    assert pool.guard.settle(pool.cache) == 1
    assert pool.guard.settle(pool.cache) == 0  # once
    pool.check_accounting()
    assert pool.guard.pending == [] and pool.guard.settled_slots == 1


def test_an_entry_whose_own_slot_no_record_names_is_counted_unattributed(make_pool, hooked):
    """A's own slot lost its record as well: the guard cannot tell it is A's, so it holds
    B's slot back, counts the entry, and leaves A's slot allocated."""
    pool = make_pool(1)
    a = pool.request(6)
    b = pool.request(6)
    old = _corrupt(pool, a, 3, pool.row(b)[2])
    pool.records[old] = 0
    seam.mark_contained(a)
    pool.release(a)
    assert pool.guard.unattributed == 1 and pool.guard.reclaimed_slots == 0
    free = pool.alloc.free_pages.tolist()
    assert old not in free and pool.row(b)[2] not in free


def test_a_chunk_cache_release_is_guarded_too(make_pool, hooked):
    """``--disable-radix-cache`` (``ChunkCache``): the same guard on its release."""
    pool = make_pool(1, chunk=True)
    a = pool.request(6)
    b = pool.request(6)
    _corrupt(pool, a, 2, pool.row(b)[4])
    for r in (a, b):
        seam.mark_contained(r)
    pool.release(a)
    pool.release(b)
    pool.guard.settle(pool.cache)
    pool.check_accounting()
    assert pool.guard.held_back_slots == 1 and pool.guard.reclaimed_slots == 1


def test_a_guard_nested_in_a_guarded_release_leaves_it_to_the_outer_one(
    make_pool, hooked, monkeypatch
):
    """The hook applied twice to the same method (a process that loaded the plugin twice, a
    subclass calling its parent's hooked method): one release, one guarded decision; the
    slot the row lost is freed once."""
    original = RadixCache.cache_finished_req  # already the plugin's wrap (``hooked``)
    monkeypatch.setattr(
        RadixCache,
        "cache_finished_req",
        lambda self, req, *a, **k: plugin._cache_finished_req(original, self, req, *a, **k),
    )
    pool = make_pool(1)
    a = pool.request(6)
    b = pool.request(6)
    _corrupt(pool, a, 4, pool.row(b)[2])
    seam.mark_contained(a)
    pool.release(a)
    pool.check_busy_count()
    pool.check_accounting()
    assert pool.guard.guarded_releases == 1 and pool.guard.reclaimed_slots == 1


def test_an_unmarked_request_is_released_by_sglang_alone(make_pool, hooked, monkeypatch):
    """The hook does nothing for a request no incident touched: no guard work at all."""
    pool = make_pool(1)
    a = pool.request(6)
    monkeypatch.setattr(
        pool.guard, "releasing", lambda *a, **k: pytest.fail("guarded an unmarked request")
    )
    pool.release(a)
    pool.check_accounting()
    assert pool.guard.guarded_releases == 0


# ---- several TP ranks -------------------------------------------------------------------------


class _ThreadRanks:
    """Threads standing in for the TP ranks of one scheduler group, each with its own pool:
    ``agreement(rank)`` gathers as ``all_gather_object`` does (every rank's object, in rank
    order, once every rank has made the call)."""

    def __init__(self, n: int):
        self.n = n
        self._barrier = threading.Barrier(n, timeout=60)
        self._box = [None] * n
        self.gathers = 0

    def agreement(self, rank: int) -> RankAgreement:
        def gather(obj):
            self._box[rank] = obj
            self._barrier.wait()
            out = list(self._box)
            self._barrier.wait()
            if rank == 0:
                self.gathers += 1
            return out

        return RankAgreement(gather, self.n)


def _on_ranks(*calls) -> None:
    """Run ``calls[i]`` on rank i's thread, all at once (as the ranks' schedulers reach the
    same step); re-raise the first error."""
    errors = []

    def run(call):
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]


def _free_list(pool: Pool):
    return torch.cat([pool.alloc.free_pages, pool.alloc.release_pages]).tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_two_tp_ranks_free_the_same_pages_in_the_same_order_when_one_ranks_row_is_corrupt(
    make_pool, hooked, page_size
):
    """Two TP ranks hold the same requests in the same slots. Rank 1's copy of A's row names
    B's slot at a middle position (a fault on that GPU); rank 0's is clean. Released under
    the guard on both ranks at once, A frees the same pages on both, in the same order (the
    next request gets the same slots on both), B's page is held back on both until B frees
    it, and each pool's accounting holds. Without the agreement rank 1 frees A's own slot
    last (its reclaim) and keeps a pending page rank 0 does not have."""
    ranks = _ThreadRanks(2)
    pools = [make_pool(page_size), make_pool(page_size)]
    for rank, pool in enumerate(pools):
        pool.guard.agreement = ranks.agreement(rank)
    reqs = [(p.request(3 * page_size + 2), p.request(2 * page_size + 4)) for p in pools]
    assert pools[0].row(reqs[0][0]) == pools[1].row(reqs[1][0])
    a1, b1 = reqs[1]
    _corrupt(pools[1], a1, page_size + 1, pools[1].row(b1)[3])
    for pool, (a, b) in zip(pools, reqs):
        seam.mark_contained(a)
        seam.mark_contained(b)
    _on_ranks(*(lambda p=p, r=r: p.release(r[0]) for p, r in zip(pools, reqs)))
    assert _free_list(pools[0]) == _free_list(pools[1])
    assert (
        pools[0].guard.pending
        == pools[1].guard.pending
        == [pools[0].row(reqs[0][1])[3] // page_size]
    )
    c = [p.request(page_size + 1) for p in pools]
    assert pools[0].row(c[0]) == pools[1].row(c[1])  # the same slots handed out
    _on_ranks(*(lambda p=p, r=r: p.release(r[1]) for p, r in zip(pools, reqs)))
    _on_ranks(*(lambda p=p: p.guard.settle(p.cache) for p in pools))
    assert _free_list(pools[0]) == _free_list(pools[1])
    for pool in pools:
        assert pool.guard.pending == []
        pool.check_busy_count()
        pool.check_accounting()
    assert ranks.gathers == 3  # one per guarded release, one for settle (a page pending)


def test_a_held_back_page_is_freed_by_settle_only_when_no_rank_sees_a_holder(make_pool, hooked):
    """The ranks' views of a held-back page differ (rank 0 still sees B's row name it, rank
    1 does not): settle frees it on neither rank until no rank sees a holder, then on both."""
    ranks = _ThreadRanks(2)
    pools = [make_pool(1), make_pool(1)]
    for rank, pool in enumerate(pools):
        pool.guard.agreement = ranks.agreement(rank)
    bs = [p.request(6) for p in pools]
    page = pools[0].row(bs[0])[2]
    for pool in pools:
        pool.guard.pending = [page]
    pools[1].r2t.req_to_token[bs[1].req_pool_idx, 2] = pools[1].row(bs[1])[1]  # rank 1 only
    _on_ranks(*(lambda p=p: p.guard.settle(p.cache) for p in pools))
    assert [p.guard.pending for p in pools] == [[page], [page]]
    assert _free_list(pools[0]) == _free_list(pools[1])
    pools[0].r2t.req_to_token[bs[0].req_pool_idx, 2] = pools[0].row(bs[0])[1]
    _on_ranks(*(lambda p=p: p.guard.settle(p.cache) for p in pools))
    assert [p.guard.pending for p in pools] == [[], []]
    assert page in _free_list(pools[0]) and _free_list(pools[0]) == _free_list(pools[1])


def test_a_report_on_one_rank_is_contained_on_every_rank_through_rank_0s_inputs(
    make_pool, hooked, caplog
):
    """Rank 1's containment sends its incident (no abort yet) to rank 0's scheduler input
    socket; taken out of that iteration's inputs (the tokenizer's request stays), the notice
    is applied on both ranks: the same request aborted by id, its slot remembered, the same
    line on each rank."""
    import zmq

    ranks = _ThreadRanks(2)
    pools = [make_pool(1), make_pool(1)]
    relays = [
        RankRelay(origin=f"tp_rank {r}, pp_rank 0, dp_rank 0", pool="target") for r in range(2)
    ]
    context = zmq.Context(1)
    rank0_input = context.socket(zmq.PULL)  # the scheduler's recv_from_tokenizer
    try:
        connect_input(rank0_input, [r.endpoint for r in relays])
        for rank, pool in enumerate(pools):
            pool.containment.attach_ranks(relays[rank], ranks.agreement(rank))
        reqs = [(p.request(6), p.request(6)) for p in pools]
        a1 = reqs[1][0]
        slot = pools[1].row(a1)[2]
        (incident,) = merge_incidents(
            [
                ViolationRecord(
                    launch_tag=int(CanaryLaunchTag.HEAD_K_FULL),
                    slot_idx=slot,
                    position=2,
                    stored_token=7,
                    expected_token=-1,
                    stored_chain_hash=0,
                    expected_aux=0,
                    fail_bits=int(FailReason.VERIFY_TOKEN_MISMATCH),
                    read_position=2,
                    req_to_token_row=a1.req_pool_idx,
                )
            ]
        )
        touched = IncidentRequests(rids=(a1.rid,), running=(a1,), holding=(a1,))
        assert pools[1].containment.contain([incident], [touched], step=1) == 0
        assert not seam.req_done(a1)  # nothing aborted before every rank has the notice
        assert rank0_input.poll(10_000), "the notice never reached rank 0's input"
        inputs = ["a tokenized request", rank0_input.recv_pyobj()]
        notices = take_containment_notices(inputs)
        assert inputs == ["a tokenized request"] and len(notices) == 1
        with caplog.at_level(logging.WARNING):
            for pool in pools:  # every rank gets the same list (recv_requests' broadcast)
                assert pool.containment.apply(notices[0]) == 1
        for pool, (a, b) in zip(pools, reqs):
            assert seam.req_done(a) and not seam.req_done(b)
            assert a.to_finish.message.startswith("kv_canary: KV cache corruption detected")
            assert seam.req_contained(a) and not seam.req_contained(b)
            assert list(pool.containment.pending_slots) == [slot]
        assert (
            parse_notice_lines(caplog.text) == [("tp_rank 1, pp_rank 0, dp_rank 0", (a1.rid,))] * 2
        )
    finally:
        rank0_input.close()
        context.term()
        for relay in relays:
            relay.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


# ---- heal mode -------------------------------------------------------------------------------


def _incident(slot: int, req: Optional[Req] = None, position: int = 3):
    """A position-mismatch incident on ``slot`` (read by ``req``'s row, if given)."""
    (incident,) = merge_incidents(
        [
            ViolationRecord(
                launch_tag=int(CanaryLaunchTag.HEAD_K_FULL),
                slot_idx=slot,
                position=position,
                stored_token=7,
                expected_token=-1,
                stored_chain_hash=0,
                expected_aux=0,
                fail_bits=int(FailReason.VERIFY_POSITION_MISMATCH),
                read_position=position,
                req_to_token_row=(req.req_pool_idx or 0) if req is not None else 0,
            )
        ]
    )
    return incident


def _free_pages(pool: Pool) -> set:
    return set(torch.cat([pool.alloc.free_pages, pool.alloc.release_pages]).tolist())


def _report_freed_slot(pool: Pool, slot: int, *, step: int, launched: int) -> None:
    """Heal mode's containment of a report of ``slot`` (read by no running request) found by
    forward ``step``, then the batch result's settling with forward ``launched`` the newest
    launched."""
    nobody = IncidentRequests(rids=(), running=())
    pool.containment.contain([_incident(slot)], [nobody], step=step)
    pool.containment.after_batch_result(launched_step=launched)


@pytest.mark.parametrize("page_size", [1, 16])
def test_heal_retires_a_slot_only_when_a_forward_launched_after_its_free_finds_it_again(
    make_pool, hooked, page_size
):
    """On the GPU a forward's checks are read one forward late: a forward launched before a
    corrupt slot was freed still reads (and reports) its old content after the free. That is
    the same corruption, not a stuck bit; only a forward launched after the free is news."""
    pool = make_pool(page_size, heal_max=3, retire_max_fraction=0.5)
    a = pool.request(12 if page_size == 1 else 32)
    slot = pool.row(a)[3]
    page = slot // page_size
    touched = IncidentRequests(rids=(a.rid,), running=(a,), holding=(a,))
    # forward 5 read the corrupt slot; forward 6 was launched before the result of 5
    pool.containment.contain([_incident(slot, a)], [touched], step=5)
    assert pool.containment.before_batch_result() == TakeBacks(healed=1, aborted=0)
    pool.live.remove(a)
    assert a.req_pool_idx is None and page in _free_pages(pool)
    pool.containment.after_batch_result(launched_step=6)  # the slot's content freed now
    assert pool.scheduler.queued == [(a, True)]  # computed again from its tokens
    # forward 6 read the slot before the free: its report comes after it
    nobody = IncidentRequests(rids=(), running=())
    pool.containment.contain([_incident(slot)], [nobody], step=6)
    assert pool.containment.pending_slots == ()  # the old content: nothing left to evict
    pool.containment.after_batch_result(launched_step=7)
    assert pool.containment.retired_pages == set() and page in _free_pages(pool)
    # forward 8 was built after the free: the slot was handed out, written and is corrupt again
    _report_freed_slot(pool, slot, step=8, launched=9)
    assert pool.containment.retired_pages == {page}
    assert page not in _free_pages(pool) and pool.containment.retired_slots == page_size
    pool.check_accounting()


@pytest.mark.parametrize("page_size", [1, 16])
def test_heal_retires_no_more_than_its_fraction_of_the_pool(make_pool, hooked, caplog, page_size):
    """``SGLANG_KV_CANARY_RETIRE_MAX_FRACTION``: past the budget (whole pages, rounded down) a
    slot found corrupt again stays in service, and says so."""
    pool = make_pool(page_size, heal_max=3, retire_max_fraction=2 * page_size / NUM_SLOTS)
    slots = [page_size * p + (page_size > 1) for p in (3, 5, 7)]  # on pages 3, 5, 7
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        for i, slot in enumerate(slots):
            _report_freed_slot(pool, slot, step=10 * i + 1, launched=10 * i + 2)
            _report_freed_slot(pool, slot, step=10 * i + 3, launched=10 * i + 4)
    assert pool.containment.retired_pages == {3, 5}
    assert pool.containment.retire_refused == 1 and 7 in _free_pages(pool)
    assert any(
        r.getMessage().startswith(RETIRE_BUDGET_LINE_PREFIX) and " 7 " in r.getMessage()
        for r in caplog.records
    ), caplog.text
    pool.check_accounting()
    none = make_pool(page_size, heal_max=3, retire_max_fraction=0.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        for step in range(1, 13, 2):  # found again five times: counted five times, said once
            _report_freed_slot(none, slots[0], step=step, launched=step + 1)
    assert none.containment.retired_pages == set() and none.containment.retire_refused == 5
    refusals = [r for r in caplog.records if r.getMessage().startswith(RETIRE_BUDGET_LINE_PREFIX)]
    assert len(refusals) == 1, caplog.text


def test_heal_times_a_request_from_its_take_back_to_its_next_token(make_pool, hooked):
    """``sglang:kv_canary_heal_seconds``: a request taken back is timed until a token more
    than it had at its take-back (its KV computed again); taken back a second time before
    that token, it is timed once, from the first; one that ends without it is not timed."""
    pool = make_pool(1, heal_max=3)
    a, b = pool.request(12), pool.request(12)
    a.output_ids, b.output_ids = [5], [6]
    for step, reqs in ((1, (a, b)), (3, (a,))):  # A taken back twice, B once
        touched = [IncidentRequests(rids=(r.rid,), running=(r,), holding=(r,)) for r in reqs]
        pool.containment.contain([_incident(pool.row(r)[3], r) for r in reqs], touched, step=step)
        t0 = time.monotonic()
        assert pool.containment.before_batch_result().healed == len(reqs)
        for r in reqs:
            pool.live.remove(r)
        pool.containment.after_batch_result(launched_step=step + 1)
        assert pool.containment.take_heal_seconds() == []  # no token yet
        for r in reqs:  # queued again: prefilled again (a row and pages of its own)
            pool.prefill(r)
    time.sleep(0.05)
    a.output_ids.append(7)  # A's next token; B ends without one (aborted by its client)
    b.finished_reason = FINISH_ABORT("client gone")
    pool.containment.after_batch_result(launched_step=9)
    (seconds,) = pool.containment.take_heal_seconds()
    assert 0.05 <= seconds < time.monotonic() - t0 + 1.0
    a.output_ids.append(8)
    pool.containment.after_batch_result(launched_step=10)
    assert pool.containment.take_heal_seconds() == []


@pytest.mark.parametrize("page_size", [1, 16])
def test_heal_past_its_heals_takes_the_request_back_then_aborts_it(make_pool, hooked, page_size):
    """A request healed ``heal_max`` times and hit again is aborted, but taken back first: the
    token of the batch whose forward read corrupt KV (its result comes next) is never
    appended, so its client, streaming or not, gets no token computed from corrupt KV; its KV
    is freed at once and its output goes out once, with abort mode's message."""
    pool = make_pool(page_size, heal_max=1)
    a = pool.request(12 if page_size == 1 else 32)
    a.output_ids = [5, 6]
    seam.count_heal(a)  # healed once already
    slot = pool.row(a)[3]
    touched = IncidentRequests(rids=(a.rid,), running=(a,), holding=(a,))
    assert pool.containment.contain([_incident(slot, a)], [touched], step=4) == 0
    assert not seam.req_done(a)  # not yet: sglang would append the next result's token first
    assert pool.containment.before_batch_result() == TakeBacks(healed=0, aborted=1)
    pool.live.remove(a)
    assert a.finished() and a.is_retracted and a.req_pool_idx is None
    assert a.finished_reason.message.endswith(", after 1 heal(s))")
    assert a.output_ids == [5, 6]
    assert pool.scheduler.streamed == [[a]] and pool.scheduler.queued == []
    assert pool.containment.aborted_requests == 1 and pool.containment.healed_requests == 0
    pool.containment.after_batch_result(launched_step=5)
    pool.check_busy_count()
    pool.check_accounting()
