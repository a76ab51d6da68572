"""DFLASH speculative decoding over real sglang 0.5.12 pools, allocator, ``ReqToTokenPool``
and ``ForwardBatch`` objects, with both canaries driven through the plugin's own hooks
(docs/speculative_multilayer_adaptive_dflash_mtp.md, "3.5 Tests and open questions").

A stand-in ``DFlashWorker`` runs sglang 0.5.12's DFLASH life cycle at page size 1 and 16: chunked
target prefills, each followed by the draft KV append of the chunk
(``_append_target_hidden_to_draft_kv``: KV written into the draft pool outside any forward,
through the hooked sequential write path); then rounds of a draft block (a hand-built
``TARGET_VERIFY`` ``ForwardBatch`` on the draft runner over ``B`` slots borrowed with
``backup_state`` / ``restore_state``, inside the hooked ``_prepare_for_speculative_decoding``),
the target's verify of ``[bonus, drafts]`` at ``L .. L + B - 1`` with a random commit length
(the rest freed at once; at page size > 1, as sglang's ``_compute_paged_keep_slots`` says: the
slots up to the committed length's page end stay allocated, and the next block and verify
continue in them), and the append of the committed positions. Requests may start from another
request's committed prefix (a radix hit: its slots shared; whole pages at page size > 1).

With a draft window (``--speculative-draft-window-size W``) the draft runner keeps its own
compact ``ReqToTokenPool``, as sglang's does: after each append a request's row holds the
target's slots of its last ``W'`` committed positions (``W' = min(W, L)``, widened to the page
boundary at page size > 1: ``_compute_compact_draft_seq_lens``), and the draft block puts its
borrowed slots at columns ``W' .. W' + B - 1`` of that row with ``seq_lens`` = ``W'`` and the
absolute positions ``L .. L + B - 1``. The draft canary maps positions through the target's
table (the plugin's ``DFlashWorker.__init__`` hook hands it to the install)."""

from __future__ import annotations

import random
import sys
import types
from typing import List

import pytest
import torch

from eagle_driver import EagleDriver, alloc_paged_columns, token_allocator
from serving_driver import VOCAB, DriverReq, next_token
from sglang.srt.kv_canary import plugin
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.builder import build_canary
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.mem_cache.common import get_last_loc_torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.speculative.dflash_info import (
    DFlashDraftInput,
    DFlashVerifyInput,
    _compute_paged_keep_slots,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")

MASK = VOCAB - 1  # the draft config's mask_token_id


class DFlashDriver:
    """``bug``: a fault of the append re-introduced: ``skip_request`` (one request's newly
    committed positions dropped before the append, as if its ``ctx_lens`` were lost),
    ``start_off_by_one`` (the write path given ``ctx_start + 1``), ``block_slot_left`` (one
    committed column of ``req_to_token`` still pointing at a draft block slot after a
    verify; page size 1 only: at a larger page the block and the verify get the same slots,
    both continuing the row's last page from ``req_to_token[row, L - 1]``)."""

    def __init__(
        self,
        *,
        block=4,
        seed=0,
        verify_tokens=True,
        num_slots=2048,
        chunk=16,
        page_size=1,
        window=None,
    ):
        self.B, self.chunk, self.rng = block, chunk, random.Random(seed)
        self.page_size = page_size
        self.window = window
        self.bug = None
        self.req_to_token_pool = ReqToTokenPool(
            size=8, max_context_len=256, device="cpu", enable_memory_saver=False
        )
        # the draft runner's own table: the target's without a window, else a compact one
        self.draft_req_to_token_pool = (
            self.req_to_token_pool
            if window is None
            else ReqToTokenPool(
                size=8, max_context_len=256, device="cpu", enable_memory_saver=False
            )
        )
        self.draft_lens = {}  # rid -> W', the draft's resident length after the last append
        self.windowed_blocks = 0  # block rows whose window W' < L
        kw = dict(
            size=num_slots,
            page_size=page_size,
            dtype=torch.bfloat16,
            head_num=2,
            head_dim=8,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        self.target_pool = MHATokenToKVPool(layer_num=2, **kw)
        self.draft_pool = MHATokenToKVPool(layer_num=2, **kw)  # a 2-layer DFlashDraftModel
        self.allocator = token_allocator(num_slots, page_size, self.target_pool)
        config = CanaryConfig(
            mode="raise",
            real_kv_hash_mode="partial",
            enable_verify_token_assert=verify_tokens,
            stats_print_every_n_steps=0,
            draft_violations="act",
        )
        caps = CanaryCapacityInputs(
            context_len=256, chunked_prefill_size=chunk, max_prefill_tokens=128
        )
        r2t = self.req_to_token_pool.req_to_token
        common = dict(req_to_token=r2t, config=config, device="cpu", capacity_inputs=caps)
        self.target = build_canary(pool=self.target_pool, ranks=RankFacts(), **common)
        self.draft = build_canary(
            pool=self.draft_pool,
            ranks=RankFacts(draft=True, draft_steps=1, draft_worker="DFLASH"),
            **common,
        )
        self.target.mark_init_finished()
        # the worker: its draft runner carries the draft canary; DFlashWorker.__init__'s hook
        self.draft_runner = types.SimpleNamespace(is_draft_worker=True)
        seam.set_runner_canary(self.draft_runner, self.draft)
        self.worker = types.SimpleNamespace(draft_model_runner=self.draft_runner)
        # (the install inside it maps positions through the target's table: r2t above)
        target_worker = types.SimpleNamespace(
            model_runner=types.SimpleNamespace(req_to_token_pool=self.req_to_token_pool)
        )
        plugin._dflash_init(
            lambda worker, target_worker: None, self.worker, target_worker=target_worker
        )
        self.running: List[DriverReq] = []
        self.done: List[DriverReq] = []
        self.next_rid = 1
        self.rounds = self.appends = self.commits_below_block = self.shares = 0
        self.partial_page_rows = 0  # verify rows continuing a page the last verify kept
        self.block_rows_seen = []  # each draft block batch's request rows, as the canary has them

    # ---- requests --------------------------------------------------------------------

    def truth(self, req: DriverReq, p: int) -> int:
        return req.prompt[p] if p < len(req.prompt) else next_token(req.rid, p)

    def add(self, prompt_len: int, max_new: int, parent: DriverReq = None, shared: int = 0):
        """A request; with ``parent``, its prompt starts with the parent's first ``shared``
        committed tokens and their slots (a radix hit)."""
        prompt = [self.rng.randrange(VOCAB - 1) for _ in range(prompt_len)]
        req = DriverReq(rid=self.next_rid, prompt=prompt, max_new=max_new)
        self.next_rid += 1
        req.row = self.req_to_token_pool.free_slots.pop(0)
        if parent is not None:
            self.shares += 1
            req.prompt[:shared] = parent.tokens[:shared]
            slots = parent.slots[:shared]  # by position (its row may be reused by now)
            self._set(req, 0, slots)
            req.slots, req.kv_len = list(slots), shared
        self.running.append(req)
        return req

    def _set(self, req, start, slots):
        r2t = self.req_to_token_pool.req_to_token
        r2t[req.row, start : start + len(slots)] = torch.tensor(slots, dtype=torch.int32)

    def _alloc_columns(self, reqs, starts, ends) -> List[List[int]]:
        """Slots for columns ``[start, end)`` of each request's row (not set there): ``alloc``
        at page size 1; else one ``alloc_extend`` of the batch, as sglang's DFLASH block and
        verify (and ``alloc_paged_token_slots_extend``) take them: each row continues its
        last partial page, from the slot at ``req_to_token[row, start - 1]``."""
        if self.page_size == 1:
            return [self.allocator.alloc(e - b).tolist() for b, e in zip(starts, ends)]
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64)
        starts_t = torch.tensor(starts, dtype=torch.int64)
        last = get_last_loc_torch(self.req_to_token_pool.req_to_token, rows, starts_t)
        return alloc_paged_columns(self.allocator, last, starts, ends, "dflash driver")

    def step(self) -> None:
        pre = [r for r in self.running if not r.prefilled]
        if pre:
            self.prefill(pre)
        elif self.running:
            self.decode(list(self.running))
        for r in [r for r in self.running if r.prefilled and r.done]:
            self.running.remove(r)
            self.req_to_token_pool.free_slots.append(r.row)
            self.done.append(r)  # its slots stay put: a later request may share them

    # ---- the target's forwards ------------------------------------------------------------

    def _forward(self, manager, pool, runner, fb):
        """``ModelRunner.forward`` through the plugin's hook; the model writes KV bytes."""

        def model(_runner, batch):
            manager.pre_ops_maybe_inside_graph(batch)
            EagleDriver.write_kv(pool, batch)
            manager.post_ops_maybe_inside_graph(batch)

        plugin._model_runner_forward(model, runner, fb)

    def _target_batch(self, mode, reqs, ids, pos, loc, seq, pre=None, ext=None):
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(reqs),
            input_ids=i64(ids),
            req_pool_indices=i64([r.row for r in reqs]),
            seq_lens=i64(seq),
            out_cache_loc=i64(loc),
            seq_lens_sum=sum(seq),
            positions=i64(pos),
        )
        fb.seq_lens_cpu = i64(seq)
        if ext is not None:
            fb.extend_prefix_lens, fb.extend_seq_lens = i64(pre), i64(ext)
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = list(pre), list(ext)
        self.target.on_forward_batch_init(fb, reqs)  # the ForwardBatch.init_new hook
        return fb

    def prefill(self, reqs) -> None:
        target_runner = types.SimpleNamespace()
        seam.set_runner_canary(target_runner, self.target)
        ids, pos, loc, pre, ext, seq = [], [], [], [], [], []
        sizes = [min(self.chunk, len(r.prompt) - r.kv_len) for r in reqs]
        starts = [r.kv_len for r in reqs]
        columns = self._alloc_columns(reqs, starts, [b + n for b, n in zip(starts, sizes)])
        for r, n, got in zip(reqs, sizes, columns):
            self._set(r, r.kv_len, got)
            r.slots += got
            ids += r.prompt[r.kv_len : r.kv_len + n]
            pos += list(range(r.kv_len, r.kv_len + n))
            loc += got
            pre.append(r.kv_len)
            ext.append(n)
            r.kv_len += n
            seq.append(r.kv_len)
        fb = self._target_batch(ForwardMode.EXTEND, reqs, ids, pos, loc, seq, pre, ext)
        self._forward(self.target, self.target_pool, target_runner, fb)
        for r in reqs:
            if r.prefilled:
                r.output.append(self.truth(r, len(r.prompt)))  # the first bonus token
        self.append(reqs, ForwardMode.EXTEND, torch.tensor(ids), ext)

    # ---- DFLASH: the append, the draft block, the verify -------------------------------

    def append(self, reqs, mode, input_ids, ctx) -> None:
        """sglang's ``_append_target_hidden_to_draft_kv(batch, draft_input)`` through the
        plugin's hook: the newly committed ``ctx`` positions of each request."""
        ctx = list(ctx)
        if self.bug == "skip_request" and mode == ForwardMode.TARGET_VERIFY:
            ctx[0] = 0  # the first request's committed positions never reach the append
        batch = types.SimpleNamespace(
            forward_mode=mode,
            req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64),
            seq_lens=torch.tensor([r.kv_len for r in reqs], dtype=torch.int64),
            input_ids=input_ids,
            spec_info=types.SimpleNamespace(draft_token_num=self.B),
            reqs=reqs,
        )
        draft_input = DFlashDraftInput(
            bonus_tokens=torch.zeros(len(reqs), dtype=torch.int64),
            target_hidden=torch.zeros((sum(ctx), 1)),
            ctx_lens=torch.tensor(ctx, dtype=torch.int32),
            draft_seq_lens=torch.zeros(len(reqs), dtype=torch.int32),
        )
        plugin._dflash_append(DFlashDriver._append_impl, self, batch, draft_input)
        self.appends += 1

    @property
    def draft_model_runner(self):  # what the seam reads of a DFlashWorker
        return self.draft_runner

    def _append_impl(self, batch, draft_input) -> None:
        """sglang 0.5.12's append, reduced: the committed positions' slots gathered from
        ``req_to_token``, the projected KV written by the sequential path."""
        total = int(draft_input.target_hidden.shape[0])
        ctx = draft_input.ctx_lens.to(torch.int64)
        if total > 0:
            start = batch.seq_lens - ctx + (1 if self.bug == "start_off_by_one" else 0)
            pos = torch.cat([torch.arange(s, s + n) for s, n in zip(start.tolist(), ctx.tolist())])
            rows = torch.repeat_interleave(batch.req_pool_indices, ctx)
            slots = self.req_to_token_pool.req_to_token[rows, pos].to(torch.int64)
            plugin._dflash_write(
                DFlashDriver._write_sequential, self, draft_input.target_hidden, pos, slots
            )
        if self.window is not None:
            self._rebuild_compact_rows(batch)
        draft_input.ctx_lens = torch.zeros_like(draft_input.ctx_lens)
        draft_input.target_hidden = draft_input.target_hidden[:0]

    def _rebuild_compact_rows(self, batch) -> None:
        """sglang's compact rewrite after an append: row ``[0, W')`` = the target's slots of
        positions ``[L - W', L)``, ``W'`` from ``_compute_compact_draft_seq_lens``."""
        target = self.req_to_token_pool.req_to_token
        compact = self.draft_req_to_token_pool.req_to_token
        for req, row, L in zip(
            batch.reqs, batch.req_pool_indices.tolist(), batch.seq_lens.tolist()
        ):
            visible = min(self.window, L)
            start = L - visible
            start -= start % self.page_size
            compact[row, : L - start] = target[row, start:L]
            self.draft_lens[req.rid] = L - start

    def _write_sequential(self, ctx_hidden, ctx_positions, ctx_cache_loc) -> None:
        """The draft layers' KV of each position (stand-in bytes of the position)."""
        fb = types.SimpleNamespace(
            out_cache_loc=ctx_cache_loc, input_ids=ctx_positions * 0 + 5, positions=ctx_positions
        )
        EagleDriver.write_kv(self.draft_pool, fb)

    def decode(self, reqs) -> None:
        B, bs = self.B, len(reqs)
        L = [r.kv_len for r in reqs]
        self.partial_page_rows += sum(l % self.page_size != 0 for l in L)
        bonus = [r.tokens[r.kv_len] for r in reqs]
        block_slots = {}

        # the draft's resident lengths: W' with a window (the compact rows), else L
        W = [self.draft_lens[r.rid] for r in reqs] if self.window is not None else L
        self.windowed_blocks += sum(w < l for w, l in zip(W, L))

        def prepare(_worker, _batch):  # _prepare_for_speculative_decoding's draft block
            backup = self.allocator.backup_state()
            draft_r2t = self.draft_req_to_token_pool.req_to_token
            try:
                # the row's last page continues from column W' - 1 of the draft's table, which
                # holds the target's slot of position L - 1 (with or without a window)
                columns = self._alloc_columns(reqs, L, [l + B for l in L])
                loc = torch.tensor([s for c in columns for s in c], dtype=torch.int64)
                for r, start, got in zip(reqs, W, columns):
                    draft_r2t[r.row, start : start + B] = torch.tensor(got, dtype=torch.int32)
                    block_slots[r.rid] = got
                i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
                fb = ForwardBatch(  # built by hand, as DFlashWorker does: no init_new
                    forward_mode=ForwardMode.TARGET_VERIFY,
                    batch_size=bs,
                    input_ids=i64([t for b in bonus for t in [b] + [MASK] * (B - 1)]),
                    req_pool_indices=i64([r.row for r in reqs]),
                    seq_lens=torch.tensor(W, dtype=torch.int32),
                    out_cache_loc=loc.to(torch.int64),
                    seq_lens_sum=sum(W),
                    seq_lens_cpu=torch.tensor(W, dtype=torch.int32),
                    positions=i64([l + j for l in L for j in range(B)]),
                    spec_info=DFlashVerifyInput(
                        draft_token=torch.empty((0,), dtype=torch.long),
                        positions=torch.empty((0,), dtype=torch.int64),
                        draft_token_num=B,
                        custom_mask=None,
                    ),
                )
                self._forward(self.draft, self.draft_pool, self.draft_runner, fb)
                state = seam.batch_state(fb)  # set by the canary from batch.reqs
                self.block_rows_seen.append(
                    None if state is None or state.requests is None else state.requests.rows
                )
            finally:
                self.allocator.restore_state(backup)

        plugin._dflash_prepare(prepare, self, types.SimpleNamespace(reqs=reqs))
        # the target's verify of [bonus, drafts] at L .. L + B - 1, fresh slots (the block's,
        # given back; with block_slot_left, shifted by one: the block's first slot held)
        held = self.allocator.alloc(1).tolist() if self.bug == "block_slot_left" else []
        loc = [s for c in self._alloc_columns(reqs, L, [l + B for l in L]) for s in c]
        ids, acc = [], []
        for i, r in enumerate(reqs):
            self._set(r, L[i], loc[i * B : (i + 1) * B])
            a = self.rng.randrange(B)
            left = r.max_new - len(r.output)
            if self.bug == "block_slot_left" and i == 0:
                a = max(a, 1)  # the fault needs a committed column past the bonus
            a = min(a, max(0, left - 1))
            acc.append(a)
            drafts = [
                self.truth(r, L[i] + 1 + k) if k < a else (self.truth(r, L[i] + 1 + k) + 1) % VOCAB
                for k in range(B - 1)
            ]
            ids += [bonus[i]] + drafts
        pos = [l + j for l in L for j in range(B)]
        fb = self._target_batch(ForwardMode.TARGET_VERIFY, reqs, ids, pos, loc, L)
        fb.spec_info = DFlashVerifyInput(
            draft_token=torch.tensor(ids), positions=torch.tensor(pos), draft_token_num=B
        )
        target_runner = types.SimpleNamespace()
        seam.set_runner_canary(target_runner, self.target)
        self._forward(self.target, self.target_pool, target_runner, fb)
        commit = [a + 1 for a in acc]
        keep = commit  # page size 1: the uncommitted slots freed at once
        if self.page_size > 1:
            keep = _compute_paged_keep_slots(
                prefix_lens=torch.tensor(L, dtype=torch.int64),
                commit_lens=torch.tensor(commit, dtype=torch.int32),
                draft_token_num=B,
                page_size=self.page_size,
            ).tolist()
        for i, r in enumerate(reqs):
            n = commit[i]
            self.commits_below_block += n < B
            mine = loc[i * B : (i + 1) * B]
            r.slots += mine[:n]
            self.allocator.free(torch.tensor(mine[keep[i] :], dtype=torch.int64))
            r.output += [self.truth(r, L[i] + 1 + k) for k in range(n)]
            r.kv_len = L[i] + n
            if held and i == 0 and n >= 2 and held[0] == block_slots[r.rid][0]:
                self._set(r, L[i] + 1, held)  # the block's slot, not the verify's, kept
        self.append(reqs, ForwardMode.TARGET_VERIFY, torch.tensor(ids), commit)
        self.rounds += 1

    # ---- faults ------------------------------------------------------------------------

    def report_within(self, steps: int) -> str:
        for _ in range(steps):
            try:
                self.workload(1)
            except RuntimeError as exc:
                if "kv_canary detected" not in str(exc):
                    raise
                return str(exc)
        raise AssertionError(f"no kv_canary report within {steps} steps")

    def workload(self, steps: int) -> None:
        for _ in range(steps):
            if len(self.running) < 4 and self.rng.random() < 0.5:
                page = self.page_size
                parents = [r for r in self.running + self.done if r.kv_len > max(8, page - 1)]
                if parents and self.rng.random() < 0.5:
                    parent = self.rng.choice(parents)
                    if page == 1:
                        shared = self.rng.randrange(2, min(parent.kv_len, 30))
                    else:  # the radix cache matches whole pages
                        shared = page * self.rng.randrange(1, parent.kv_len // page + 1)
                    self.add(self.rng.randint(shared + 1, shared + 30), 12, parent, shared)
                else:
                    self.add(self.rng.randint(5, 40), self.rng.randint(4, 16))
            self.step()


def _reasons(report: str) -> set:
    return {
        reason
        for line in report.splitlines()
        if "fail_reason=" in line
        for reason in line.split("fail_reason=")[1].split()[0].split("+")
    }


def _driver(page_size: int, seed: int, window=None) -> DFlashDriver:
    # pages of 16 hold more slots per request, and done requests keep theirs
    return DFlashDriver(seed=seed, page_size=page_size, num_slots=2048 * page_size, window=window)


@pytest.mark.parametrize(
    "page_size,seed,window",
    [(1, 0, None), (1, 1, None), (1, 2, None), (16, 0, None), (16, 1, None)]
    + [(1, 0, 8), (1, 1, 5), (16, 0, 8), (16, 1, 20)],
)
def test_a_clean_dflash_workload_reports_nothing(page_size, seed, window):
    """Chunked prefills with appends, verifies with random commit lengths and their appends,
    draft blocks on borrowed slots, requests sharing another's committed prefix: no report,
    and both canaries did their work (the draft one's verifies ran in the blocks, its writes
    in the appends, with the chain-position check on). With a draft window, most blocks
    read a compact row shorter than the committed length."""
    d = _driver(page_size, seed, window)
    d.workload(120)
    assert d.rounds > 20 and d.appends > d.rounds and d.commits_below_block > 5
    assert len(d.done) >= 4 and d.shares >= 2
    if page_size > 1:
        assert d.partial_page_rows > 10
    if window is not None:
        assert d.windowed_blocks > 20
    assert d.draft.count_violations() == 0 and d.target.count_violations() == 0
    assert d.draft.state.enable_chain_position_assert.item() == 1
    assert d.draft.groups[0].kv_token_id_vs_position_offset == 0
    assert d.draft.step == d.rounds  # one step per draft block, none per append
    # the hand-built block batches got their requests (reports' rids, token checks)
    assert len(d.block_rows_seen) == d.rounds and all(d.block_rows_seen)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_flipped_draft_byte_at_a_committed_position_is_reported_by_the_next_block(page_size):
    d = _driver(page_size, seed=3)
    d.workload(30)
    victim = max((r for r in d.running if r.prefilled), key=lambda r: r.max_new - len(r.output))
    slot = int(d.req_to_token_pool.req_to_token[victim.row, victim.kv_len // 2])
    d.draft_pool.k_buffer[0][slot].view(torch.uint8).view(-1)[0] ^= 0xFF
    report = d.report_within(3)
    assert "verify_real_kv_hash" in _reasons(report) and f"slot_idx={slot}" in report


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("where", ["in_window", "before_window"])
def test_with_a_draft_window_a_flipped_draft_byte_is_reported_by_the_next_block(page_size, where):
    """With ``--speculative-draft-window-size`` 8 the block's ``seq_lens`` is the compact
    ``W'``, not ``L``: a flipped byte at committed position ``L - 2`` (in the window, past
    column ``W'``) is reported at the next block, whose prefix is ``L`` (its first position);
    so is one before the window: the block verifies ``[0, L)``, a superset of what it reads
    (docs/speculative_multilayer_adaptive_dflash_mtp.md, "3.4 Changes to the canary")."""
    d = _driver(page_size, seed=3, window=8)
    d.workload(30)
    victim = max((r for r in d.running if r.prefilled), key=lambda r: r.max_new - len(r.output))
    assert victim.kv_len > 16 + page_size
    pos = victim.kv_len - 2 if where == "in_window" else 1
    slot = int(d.req_to_token_pool.req_to_token[victim.row, pos])
    d.draft_pool.k_buffer[0][slot].view(torch.uint8).view(-1)[0] ^= 0xFF
    report = d.report_within(3)
    assert "verify_real_kv_hash" in _reasons(report) and f"slot_idx={slot}" in report


@pytest.mark.parametrize(
    "bug,reason,page_size,window",
    [
        ("skip_request", "verify_chain_hash", 1, None),
        ("start_off_by_one", "verify_position", 1, None),
        ("block_slot_left", "verify_token", 1, None),
        ("skip_request", "verify_chain_hash", 16, None),
        ("start_off_by_one", "verify_position", 16, None),
        ("skip_request", "verify_chain_hash", 1, 8),
        ("start_off_by_one", "verify_position", 16, 8),
    ],
)
def test_each_append_fault_is_reported_by_its_check(bug, reason, page_size, window):
    """An append that skips a request (its committed positions keep stale records), a write
    path given ``ctx_start + 1`` (position ``ctx_start`` never written, the last one past the
    committed length), a draft block's slot left in ``req_to_token`` after a verify (page
    size 1: at larger pages the block's slots are the verify's): the draft canary reports
    each at the next draft block, by the check named, also with a draft window of 8."""
    d = _driver(page_size, seed=4, window=window)
    d.workload(30)
    d.bug = bug
    report = d.report_within(12)
    assert reason in _reasons(report), report


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.IDLE])
def test_an_append_after_another_batch_kind_is_refused_naming_it(mode):
    """An append with rows to write after a batch that is neither a prefill nor a verify
    (sglang 0.5.12 makes none) is refused naming the batch's mode, not recorded with tokens
    the canary cannot know; an empty one (sglang's early return) is nothing to record."""
    draft_input = DFlashDraftInput(
        bonus_tokens=torch.zeros(2, dtype=torch.int64),
        target_hidden=torch.zeros((3, 1)),
        ctx_lens=torch.tensor([1, 2], dtype=torch.int32),
        draft_seq_lens=torch.zeros(2, dtype=torch.int32),
    )
    batch = types.SimpleNamespace(
        forward_mode=mode,
        req_pool_indices=torch.tensor([0, 1]),
        seq_lens=torch.tensor([5, 6]),
        input_ids=torch.tensor([7, 8]),
        spec_info=None,
    )
    with pytest.raises(NotImplementedError, match=f"after a {mode.name} batch") as refused:
        seam.dflash_append_inputs(batch, draft_input)
    # the message names the batch kinds it records appends after: sglang's extend modes
    assert "(an extend batch: EXTEND, MIXED, DRAFT_EXTEND, " in str(refused.value)
    assert str(refused.value).endswith("or a verify (TARGET_VERIFY) only")
    draft_input.target_hidden = torch.zeros((0, 1))
    assert seam.dflash_append_inputs(batch, draft_input) is None


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
