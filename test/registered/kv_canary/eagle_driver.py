"""EAGLE speculative decoding (``topk`` 1) over real sglang 0.5.12 pools and ForwardBatch
objects, with both canaries driven as the plugin's hooks drive them (test support).

Two real ``MHATokenToKVPool`` s — the target model's (2 layers, 2 KV heads of 8, bfloat16) and
the draft model's (by default an EAGLE head's: 1 layer of the target's geometry; ``draft_pool``
gives a STANDALONE draft LM's own shape) — share one ``ReqToTokenPool`` and one
``TokenToKVPoolAllocator``, as sglang's EAGLE and STANDALONE workers do. Each pool gets its canary from ``build_canary`` with what ``install_canary`` passes
a runner: the draft pool (``RankFacts(draft=True, draft_steps=max_steps)``: position offset 1) and one
single-forward manager per draft forward of the largest round (``max_steps - 1``; ``max_steps``
defaults to ``steps``, which an adaptive run changes between rounds).

Per request: a chunked prefill (target ``EXTEND``, then the draft ``EXTEND`` of the same
positions with the tokens shifted by one: the next prompt token at a non-final chunk's end,
the sampled token at the last chunk's), then decode rounds of

1. a draft round (``draft_forward``): ``steps - 1`` draft ``DECODE`` forwards inside
   ``with_draft_round`` (each inside ``with_draft_forward``, as the ``ModelRunner.forward``
   hook does), writing guess ``g_i`` at position ``L + i``; positions advance after each
   forward, as sglang does;
2. the target's ``TARGET_VERIFY`` of ``[bonus, g_0 .. g_{steps-1}]`` at ``L .. L + steps``;
   the guesses that match the true continuation are accepted, plus one new bonus token;
3. the draft extend after verify: spec v1 ``DRAFT_EXTEND`` of the accepted positions (the
   rejected verify slots are freed), spec v2 ``DRAFT_EXTEND_V2`` of every verify position.

Spec v1 (``v2=False``) borrows the draft round's slots from the allocator and gives them back
before the verify allocates its own (sglang's ``backup_state`` / ``restore_state``); spec v2
(``v2=True``) pre-allocates ``2 * (steps + 1)`` slots past the committed length (sglang's
``kv_allocated_len``) that the draft round, the verify and the draft extend all use.

With ``radix_is_eagle`` set, a real ``RadixCache`` built with that ``is_eagle`` (True: EAGLE's
token-pair keys; False: single-token keys, sglang 0.5.12's for STANDALONE) is used as sglang's
scheduler uses it: an admitted request starts from its prefix match (its prompt less one token
at most); after each prefill chunk the request's KV goes into the tree and its positions the
tree already held are swapped to the tree's slots, its own freed (``cache_unfinished_req``);
a finished request's committed KV goes into the tree (``cache_finished_req``).

Bugs of real sglang versions can be re-introduced with the ``bug_*`` switches (the unit-level
counterparts of the GPU regression tests).
"""

from __future__ import annotations

import dataclasses
import random
from typing import List, Optional

import torch

from serving_driver import VOCAB, DriverReq, next_token
from sglang.srt.kv_canary.builder import build_canary
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.kv_canary.token_oracle import oracle_tokens, request_oracle_key
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.speculative.eagle_info import EagleDraftInput


@dataclasses.dataclass(frozen=True)
class DraftPoolShape:
    """The draft ``MHATokenToKVPool``'s geometry (default: an EAGLE head's, one layer of the
    target's)."""

    layers: int = 1
    heads: int = 2
    head_dim: int = 8
    dtype: torch.dtype = torch.bfloat16


def token_allocator(num_slots: int, page_size: int, kvcache) -> TokenToKVPoolAllocator:
    """sglang's slot allocator on the CPU for ``kvcache``: ``TokenToKVPoolAllocator`` at page
    size 1, else ``PagedTokenToKVPoolAllocator`` (whole pages, ``alloc_extend``)."""
    if page_size == 1:
        return TokenToKVPoolAllocator(num_slots, torch.bfloat16, "cpu", kvcache, need_sort=False)
    return PagedTokenToKVPoolAllocator(
        num_slots, page_size, torch.bfloat16, "cpu", kvcache, need_sort=False
    )


def alloc_paged_columns(allocator, last_loc, starts, ends, who: str) -> List[List[int]]:
    """Slots for columns ``[start, end)`` of each row from one ``alloc_extend`` of the batch,
    as sglang's ``alloc_paged_token_slots_extend`` takes them (each row continues its last
    partial page from ``last_loc``, the slot at column ``start - 1``, then whole pages)."""
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    pre, seq = i64(starts), i64(ends)
    out = allocator.alloc_extend(
        pre, pre, seq, seq, last_loc.to(torch.int64), int(sum(ends) - sum(starts))
    )
    if out is None:
        raise RuntimeError(f"{who}: KV pool exhausted")
    got, at = [], 0
    for b, e in zip(starts, ends):
        got.append(out[at : at + e - b].tolist())
        at += e - b
    return got


def tiny_mha_pool(size: int) -> MHATokenToKVPool:
    """A one-layer real ``MHATokenToKVPool`` on the CPU (2 KV heads of 8, bfloat16): an EAGLE
    head's pool, for the tests that build a draft canary on their own."""
    return MHATokenToKVPool(
        size=size,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )


# a STANDALONE draft LM of another shape than the target (2 layers, 2 KV heads of 8, bfloat16)
STANDALONE_DRAFT = DraftPoolShape(layers=3, heads=1, head_dim=16, dtype=torch.float16)


class EagleDriver:
    def __init__(
        self,
        *,
        steps: int = 3,
        v2: bool = False,
        mode: str = "raise",
        real_data: str = "partial",
        verify_tokens: bool = True,
        seed: int = 0,
        accept_prob: float = 0.6,
        num_slots: int = 1024,
        max_reqs: int = 8,
        max_ctx: int = 256,
        chunk: int = 24,
        max_running: int = 4,
        bug_positions_before_forward: bool = False,
        bug_chunk_end_uses_sampled_token: bool = False,
        max_steps: Optional[int] = None,
        draft_pool: DraftPoolShape = DraftPoolShape(),
        canary_settings: Optional[dict] = None,
        radix_is_eagle: Optional[bool] = None,
        draft_violations: str = "act",
        topk: int = 1,
        draft_model: bool = True,
        verify_tree_depth: Optional[int] = None,
        page_size: int = 1,
        token_oracle: bool = False,
    ):
        """``token_oracle``: the token oracle and its write-input check on (both canaries,
        vocabulary ``VOCAB``), the continuation being the oracle's tokens (what the verify
        commits with the plugin's verify hooks, ``test_speculative_oracle.py``).
        ``page_size``: sglang's ``--page-size``: the pools' page size, a real
        ``PagedTokenToKVPoolAllocator`` when > 1 (its ``alloc_extend``: each request's new
        slots continue its last partial page, then whole pages) and the draft canary's lane
        layout; the topk 1 round, spec v2 and the radix cache are page size 1 only here.
        ``draft_violations``: ``CanaryConfig.draft_violations``; ``act`` (not the server's
        default, ``report``) so that a raise-mode driver stops at either pool's first
        violation, as the detection tests read them; the default's own tests pass
        ``report``. ``draft_model`` False: no draft canary and no draft forward (NGRAM's
        worker); ``verify_tree_depth``: the target's ``RankFacts.verify_tree_depth`` (default:
        ``max_steps + 1`` with ``topk`` > 1, else 0)."""
        if steps < 1:
            raise ValueError("steps must be >= 1")
        if page_size > 1 and (v2 or radix_is_eagle is not None):
            raise ValueError("the driver runs page size > 1 without spec v2 and the radix cache")
        self.page_size = page_size
        # ``max_steps``: the largest step count the canary is sized for (an adaptive worker's
        # largest candidate); ``steps`` may then change between rounds, as sglang's switch does
        self.max_steps = steps if max_steps is None else max_steps
        if self.max_steps < steps:
            raise ValueError(f"max_steps {self.max_steps} < steps {steps}")
        self.steps, self.v2, self.chunk, self.topk = steps, v2, chunk, topk
        self.accept_prob, self.max_running = accept_prob, max_running
        self.rng = random.Random(seed)
        self.bug_positions_before_forward = bug_positions_before_forward
        self.bug_chunk_end_uses_sampled_token = bug_chunk_end_uses_sampled_token
        self.req_to_token_pool = ReqToTokenPool(
            size=max_reqs, max_context_len=max_ctx, device="cpu", enable_memory_saver=False
        )
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
        kw.update(dtype=draft_pool.dtype, head_num=draft_pool.heads, head_dim=draft_pool.head_dim)
        self.draft_pool = MHATokenToKVPool(layer_num=draft_pool.layers, **kw)
        self.allocator = token_allocator(num_slots, page_size, self.target_pool)
        self.token_oracle = token_oracle
        if token_oracle:
            canary_settings = dict(
                canary_settings or {}, enable_token_oracle=True, enable_write_input_assert=True
            )
        self.config = CanaryConfig(
            mode=mode,
            real_kv_hash_mode=real_data,
            enable_verify_token_assert=verify_tokens,
            stats_print_every_n_steps=0,
            draft_violations=draft_violations,
            **(canary_settings or {}),
        )
        caps = CanaryCapacityInputs(
            context_len=max_ctx, chunked_prefill_size=chunk, max_prefill_tokens=chunk * max_reqs
        )
        r2t = self.req_to_token_pool.req_to_token
        self.target = build_canary(
            pool=self.target_pool,
            req_to_token=r2t,
            config=self.config,
            vocab_size=VOCAB,
            device="cpu",
            capacity_inputs=caps,
            ranks=RankFacts(
                verify_tree_depth=(
                    verify_tree_depth
                    if verify_tree_depth is not None
                    else self.max_steps + 1
                    if topk > 1
                    else 0
                )
            ),
        )
        # what install_canary builds on an EAGLE draft runner (none without a draft model)
        self.draft = (
            build_canary(
                pool=self.draft_pool,
                req_to_token=r2t,
                config=self.config,
                vocab_size=VOCAB,
                device="cpu",
                capacity_inputs=caps,
                ranks=RankFacts(
                    draft=True,
                    draft_steps=self.max_steps,
                    **RankFacts.tree_fields(
                        topk=topk, verify_tree_depth=0, draft=True, page_size=page_size
                    ),
                ),
            )
            if draft_model
            else None
        )
        self.target.mark_init_finished()
        if self.draft is not None:
            self.draft.mark_init_finished()
        self.radix = None
        if radix_is_eagle is not None:
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.radix_cache import RadixCache

            self.radix = RadixCache(
                CacheInitParams(
                    disable=False,
                    req_to_token_pool=self.req_to_token_pool,
                    token_to_kv_pool_allocator=self.allocator,
                    page_size=1,
                    is_eagle=radix_is_eagle,
                )
            )
        self.waiting: List[DriverReq] = []
        self.running: List[DriverReq] = []
        self.finished: List[DriverReq] = []
        self._next_rid = 1
        self.rounds = 0
        self.accepted = 0  # accepted guesses, over all rounds
        self.rejected = 0
        self.chunked = 0  # non-final prefill chunks

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self, prompt_len: int, max_new: int, prompt: Optional[List[int]] = None
    ) -> DriverReq:
        req = DriverReq(
            rid=self._next_rid,
            prompt=(
                list(prompt)
                if prompt is not None
                else [self.rng.randrange(VOCAB) for _ in range(prompt_len)]
            ),
            max_new=max_new,
        )
        self._next_rid += 1
        self.waiting.append(req)
        return req

    def truth(self, req: DriverReq, position: int) -> int:
        """The token at ``position`` (prompt, else the deterministic continuation)."""
        if position < len(req.prompt):
            return req.prompt[position]
        if self.token_oracle:
            key = torch.tensor([request_oracle_key(req.rid)])
            return int(oracle_tokens(key, torch.tensor([position]), VOCAB))
        return next_token(req.rid, position)

    # ---- the loop -----------------------------------------------------------------------------

    def run(self, steps: int, *, arrivals: float = 0.4) -> None:
        for _ in range(steps):
            if self.rng.random() < arrivals or not (self.running or self.waiting):
                self.add_request(self.rng.randint(6, 70), self.rng.randint(4, 20))
            self.step()

    def step_until_committed(self, kv_len: int = 4) -> None:
        """Step (no new arrivals) until a running request is prefilled and holds ``kv_len``
        committed positions or more: one whose KV the next forwards read."""
        while not any(r.prefilled and r.kv_len >= kv_len for r in self.running):
            self.step()

    def step(self) -> str:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting.pop(0)
            req.row = self.req_to_token_pool.free_slots.pop(0)
            if self.radix is not None:
                self._match_prefix(req)
            self.running.append(req)
        prefill = [r for r in self.running if not r.prefilled]
        if prefill:
            self.prefill_chunk(prefill)
            kind = "extend"
        elif self.running:
            self.decode_round(list(self.running))
            kind = "decode"
        else:
            return "idle"
        self._finish()
        return kind

    def _alloc(self, n: int) -> List[int]:
        got = self.allocator.alloc(n)
        if got is None:
            raise RuntimeError("eagle driver: KV pool exhausted")
        return got.tolist()

    def _alloc_columns(self, reqs: List[DriverReq], starts: List[int], ends: List[int]):
        """Slots for columns ``[start, end)`` of each request's ``req_to_token`` row (not set
        there), one list per request: page size 1 from ``alloc``; larger pages from one
        ``alloc_extend`` of the batch, as sglang's ``alloc_paged_token_slots_extend`` (the
        columns continue the request's last partial page, the slot after
        ``req_to_token[row, start - 1]``, then take whole pages)."""
        if self.page_size == 1:
            return [self._alloc(e - b) for b, e in zip(starts, ends)]
        return alloc_paged_columns(
            self.allocator, self.last_loc(reqs, starts), starts, ends, "eagle driver"
        )

    def last_loc(self, reqs: List[DriverReq], starts: List[int]) -> torch.Tensor:
        """sglang's ``get_last_loc`` (its torch path): each request's slot at column ``start
        - 1``, -1 where ``start`` is 0."""
        from sglang.srt.mem_cache.common import get_last_loc_torch

        return get_last_loc_torch(
            self.req_to_token_pool.req_to_token,
            torch.tensor([r.row for r in reqs], dtype=torch.int64),
            torch.tensor(starts, dtype=torch.int64),
        ).to(torch.int64)

    def _set_slots(self, req: DriverReq, start: int, slots: List[int]) -> None:
        self.req_to_token_pool.req_to_token[req.row, start : start + len(slots)] = torch.tensor(
            slots, dtype=torch.int32
        )

    def _slots(self, req: DriverReq, start: int, n: int) -> List[int]:
        return self.req_to_token_pool.req_to_token[req.row, start : start + n].tolist()

    # ---- prefill: target EXTEND, then the draft EXTEND shifted by one ----------------------

    def prefill_chunk(self, reqs: List[DriverReq]) -> None:
        t_ids, d_ids, pos, loc, rows, pre, ext = [], [], [], [], [], [], []
        sampled = []
        starts = [r.kv_len for r in reqs]
        ends = [min(b + self.chunk, len(r.prompt)) for r, b in zip(reqs, starts)]
        fresh = None if self.v2 else self._alloc_columns(reqs, starts, ends)
        for i, r in enumerate(reqs):
            start = r.kv_len
            n = min(self.chunk, len(r.prompt) - start)
            end = start + n
            if self.v2:
                self._ensure_allocated(r, end)
                new = self._slots(r, start, n)
            else:
                new = fresh[i]
                self._set_slots(r, start, new)
                r.slots += new
            last = end == len(r.prompt)
            if last:  # the target samples the first output token: the bonus (appended to
                # the request's output after the forwards, as sglang's process_batch_result)
                shifted_tail = self.truth(r, end)
                sampled.append((r, shifted_tail))
            elif self.bug_chunk_end_uses_sampled_token:
                # upstream PRs 26329 / 26800: the non-final chunk's draft input ends with the
                # token the target sampled there, not the next prompt token
                shifted_tail = next_token(r.rid, end)
                self.chunked += 1
            else:
                shifted_tail = r.prompt[end]
                self.chunked += 1
            t_ids += r.prompt[start:end]
            d_ids += r.prompt[start + 1 : end] + [shifted_tail]
            pos += list(range(start, end))
            loc += new
            rows.append(r.row)
            pre.append(start)
            ext.append(n)
            r.kv_len = end
        seq = [p + e for p, e in zip(pre, ext)]
        self._eager(
            self.target,
            self.target_pool,
            self._batch(
                self.target, ForwardMode.EXTEND, t_ids, pos, loc, rows, seq, reqs, pre=pre, ext=ext
            ),
        )
        if self.draft is not None:
            self._eager(
                self.draft,
                self.draft_pool,
                self._batch(
                    self.draft,
                    ForwardMode.EXTEND,
                    d_ids,
                    pos,
                    loc,
                    rows,
                    seq,
                    reqs,
                    pre=pre,
                    ext=ext,
                ),
            )
        for r, token in sampled:
            r.output.append(token)
        if self.radix is not None:
            for r in reqs:
                self._cache_unfinished(r)

    def _ensure_allocated(self, req: DriverReq, upto: int) -> None:
        """Spec v2: the request's slots cover positions ``[0, upto)``."""
        if len(req.slots) < upto:
            new = self._alloc(upto - len(req.slots))
            self._set_slots(req, len(req.slots), new)
            req.slots += new

    # ---- one decode round ------------------------------------------------------------------

    def decode_round(self, reqs: List[DriverReq]) -> None:
        if self.page_size > 1:
            raise NotImplementedError("the driver's topk 1 round runs at page size 1 only")
        s = self.steps
        base = [r.kv_len for r in reqs]  # L: committed KV; the bonus token sits at L
        guesses = [[self._guess(r, L + 1 + i) for i in range(s)] for r, L in zip(reqs, base)]
        # 1. the draft round: draft slots of positions L .. L + s - 1
        if self.v2:
            for r, L in zip(reqs, base):
                self._ensure_allocated(r, L + 2 * (s + 1))
            draft_slots = [self._slots(r, L, s) for r, L in zip(reqs, base)]
        else:  # borrowed from the allocator, given back before the verify allocates
            draft_slots = []
            for r, L in zip(reqs, base):
                got = self._alloc(s)
                self._set_slots(r, L, got)
                draft_slots.append(got)
        self.draft_round(reqs, base, guesses, draft_slots)
        if not self.v2:
            self.allocator.free(
                torch.tensor([x for ss in draft_slots for x in ss], dtype=torch.int64)
            )
        # 2. the target verify of [bonus, g_0 .. g_{s-1}] at L .. L + s
        verify_slots = []
        for r, L in zip(reqs, base):
            if self.v2:
                verify_slots.append(self._slots(r, L, s + 1))
            else:
                got = self._alloc(s + 1)
                self._set_slots(r, L, got)
                verify_slots.append(got)
        ids = [t for r, L, g in zip(reqs, base, guesses) for t in [r.tokens[L]] + g]
        pos = [L + j for L in base for j in range(s + 1)]
        fb = self._batch(
            self.target,
            ForwardMode.TARGET_VERIFY,
            ids,
            pos,
            [x for v in verify_slots for x in v],
            [r.row for r in reqs],
            base,
            reqs,
        )
        fb.spec_info = self._verify_input(ids, pos, base, s + 1)
        self._eager(self.target, self.target_pool, fb)
        # accept the guesses matching the continuation, plus one new bonus token
        accepts = []
        for r, L, g, vs in zip(reqs, base, guesses, verify_slots):
            acc = 0
            while acc < s and g[acc] == self.truth(r, L + 1 + acc):
                acc += 1
            self.accepted += acc
            self.rejected += s - acc
            r.output += [self.truth(r, L + 1 + k) for k in range(acc + 1)]
            r.kv_len = L + acc + 1
            accepts.append(acc)
            if not self.v2:
                r.slots += vs[: acc + 1]
                self.allocator.free(torch.tensor(vs[acc + 1 :], dtype=torch.int64))
        # 3. the draft extend after the verify
        if not self.v2:
            kept = [vs[: acc + 1] for acc, vs in zip(accepts, verify_slots)]
            self.draft_extend_accepted(reqs, base, kept)
        else:
            ids, pos, loc, seq = [], [], [], []
            for r, L, acc, vs in zip(reqs, base, accepts, verify_slots):
                ids += [
                    self.truth(r, L + 1 + k) if k <= acc else self.rng.randrange(VOCAB)
                    for k in range(s + 1)
                ]
                pos += [L + k for k in range(s + 1)]
                loc += vs
                seq.append(L + s + 1)
            ext = [s + 1] * len(reqs)
            self._eager(
                self.draft,
                self.draft_pool,
                self._batch(
                    self.draft,
                    ForwardMode.DRAFT_EXTEND_V2,
                    ids,
                    pos,
                    loc,
                    [r.row for r in reqs],
                    seq,
                    reqs,
                    pre=base,
                    ext=ext,
                    accepted=[acc + 1 for acc in accepts],
                ),
            )
        self.rounds += 1

    def draft_extend_accepted(self, reqs, base, kept) -> None:
        """Spec v1's draft ``DRAFT_EXTEND`` after a verify: each request's accepted slots
        ``kept`` (its verify's bonus and accepted guesses) at ``L ..``, with the tokens
        shifted by one (position p holds the KV of token p + 1)."""
        ids, pos, loc, seq, ext = [], [], [], [], []
        for r, L, slots in zip(reqs, base, kept):
            n = len(slots)
            ids += [self.truth(r, L + 1 + k) for k in range(n)]
            pos += [L + k for k in range(n)]
            loc += slots
            seq.append(L + n)
            ext.append(n)
        self._eager(
            self.draft,
            self.draft_pool,
            self._batch(
                self.draft,
                ForwardMode.DRAFT_EXTEND,
                ids,
                pos,
                loc,
                [r.row for r in reqs],
                seq,
                reqs,
                pre=base,
                ext=ext,
            ),
        )

    def _guess(self, req: DriverReq, position: int) -> int:
        right = self.truth(req, position)
        if self.rng.random() < self.accept_prob:
            return right
        return (right + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB

    def draft_round(self, reqs, base, guesses, draft_slots) -> None:
        """sglang's ``draft_forward``: one ForwardBatch, mutated per forward (input ids, the
        forward's slots), positions advanced after each forward. ``around_round(fb, body)``
        and ``around_forward(fb, body)`` are what sglang's hooked ``draft_forward`` and
        ``ModelRunner.forward`` do around ``body()`` (default: the manager calls the plugin's
        hooks make; a test may route them through the hooks themselves)."""
        n = self.steps - 1
        fb = self._batch(
            self.draft,
            ForwardMode.DECODE,
            [g[0] for g in guesses],
            list(base),
            [x for ss in draft_slots for x in ss],
            [r.row for r in reqs],
            base,
            reqs,
        )

        def one_forward():  # the wrapped model.forward of the draft runner
            self.draft.pre_ops_maybe_inside_graph(fb)
            self.write_kv(self.draft_pool, fb)
            self.draft.post_ops_maybe_inside_graph(fb)

        # the round's slots [request][step] as sglang lays them out for its forwards: step
        # i's slots are row i of a transposed view (strided, not contiguous)
        by_step = (
            fb.out_cache_loc.reshape(len(reqs), 1, self.steps)
            .permute(2, 0, 1)
            .reshape(self.steps, -1)
        )

        def loop():
            for i in range(n):
                fb.input_ids = torch.tensor([g[i] for g in guesses], dtype=torch.int64)
                fb.out_cache_loc = by_step[i]
                if self.bug_positions_before_forward:  # upstream PR 25015
                    fb.positions.add_(1)
                self.around_forward(fb, one_forward)
                if not self.bug_positions_before_forward:
                    fb.positions.add_(1)

        self.around_round(fb, loop)

    def around_round(self, fb: ForwardBatch, body) -> None:
        with self.draft.with_draft_round(self.steps - 1):
            body()

    def around_forward(self, fb: ForwardBatch, body) -> None:
        with self.draft.with_draft_forward(fb):
            body()

    def _match_prefix(self, req: DriverReq) -> None:
        """The radix cache's prefix of ``req``'s prompt (one token at least left to prefill):
        its slots become the request's first ones (sglang's ``match_prefix``)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        key = self._radix_key(req.prompt[: len(req.prompt) - 1])
        got = self.radix.match_prefix(MatchPrefixParams(key=key)).device_indices.tolist()
        if got:
            self._set_slots(req, 0, got)
            req.slots = list(got)
            req.kv_len = req.shared_prefix = len(got)

    def _radix_key(self, tokens: List[int]):
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(list(tokens), is_bigram=self.radix.is_eagle)

    def _cache_unfinished(self, req: DriverReq) -> None:
        """sglang's ``cache_unfinished_req`` after a prefill chunk: the prefilled tokens go
        into the tree; positions the tree already held (another request's identical prefix)
        are swapped to the tree's slots, the request's own ones freed."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

        key = self._radix_key(req.prompt[: req.kv_len])
        n = len(key)
        prefix = self.radix.insert(
            InsertParams(key=key, value=torch.tensor(req.slots[:n], dtype=torch.int64))
        ).prefix_len
        protected = req.shared_prefix
        if prefix > protected:
            self.allocator.free(torch.tensor(req.slots[protected:prefix], dtype=torch.int64))
        new = self.radix.match_prefix(MatchPrefixParams(key=key)).device_indices.tolist()
        self._set_slots(req, protected, new[protected:])
        req.slots[protected : len(new)] = new[protected:]
        req.shared_prefix = len(new)

    def _cache_finished(self, req: DriverReq) -> None:
        """sglang's ``cache_finished_req``: the committed KV goes into the tree (with pair keys
        one slot less); the request's own slots the tree already had, and those it did not
        take, are freed."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        key = self._radix_key(req.tokens[: req.kv_len])
        kept = len(key)
        prefix = self.radix.insert(
            InsertParams(key=key, value=torch.tensor(req.slots[:kept], dtype=torch.int64))
        ).prefix_len
        freed = req.slots[req.shared_prefix : prefix] + req.slots[kept:]
        if freed:
            self.allocator.free(torch.tensor(freed, dtype=torch.int64))

    def _finish(self) -> None:
        for r in list(self.running):
            if r.prefilled and r.done and self.radix is not None:
                self.running.remove(r)
                self._cache_finished(r)
                self.req_to_token_pool.free_slots.append(r.row)
                r.row = None
                self.finished.append(r)
            elif r.prefilled and r.done:
                self.running.remove(r)
                self.allocator.free(torch.tensor(r.slots, dtype=torch.int64))
                self.req_to_token_pool.free_slots.append(r.row)
                r.row = None
                self.finished.append(r)

    # ---- batches and forwards ------------------------------------------------------------

    def _batch(
        self,
        manager,
        mode,
        ids,
        pos,
        loc,
        rows,
        seq,
        reqs,
        *,
        pre=None,
        ext=None,
        seq_dtype=torch.int64,
        accepted=None,
    ) -> ForwardBatch:
        """``seq_dtype``: ``seq_lens``' dtype: int64 as an eager batch has it, int32 as
        sglang's CUDA graph runners' static buffers hold it in a replayed forward."""
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=i64(ids),
            req_pool_indices=i64(rows),
            seq_lens=torch.tensor(seq, dtype=seq_dtype),
            out_cache_loc=i64(loc),
            seq_lens_sum=sum(seq),
            positions=i64(pos),
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=(self.target_pool if manager is self.target else self.draft_pool),
        )
        fb.seq_lens_cpu = i64(seq)
        if ext is not None:
            fb.extend_prefix_lens, fb.extend_seq_lens = i64(pre), i64(ext)
            fb.extend_num_tokens = len(ids)
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = list(pre), list(ext)
        if accepted is not None:  # spec v2's draft extend: its spec info's accepted counts
            fb.spec_info = EagleDraftInput.create_idle_input(
                device="cpu", hidden_size=8, dtype=torch.bfloat16, topk=1, capture_hidden_mode=None
            )
            fb.spec_info.num_accept_tokens = torch.tensor(accepted, dtype=torch.int32)
        manager.on_forward_batch_init(fb, reqs)  # the ForwardBatch.init_new hook
        return fb

    @staticmethod
    def _verify_input(ids, pos, seq, num_draft):
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return EagleVerifyInput(
            draft_token=i64(ids),
            custom_mask=torch.ones(len(ids), dtype=torch.bool),
            positions=i64(pos),
            retrieve_index=i64(list(range(len(ids)))),
            retrieve_next_token=i64([-1] * len(ids)),
            retrieve_next_sibling=i64([-1] * len(ids)),
            retrieve_cum_len=i64([0]),
            spec_steps=num_draft - 1,
            topk=1,
            draft_token_num=num_draft,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            seq_lens_sum=sum(seq),
            seq_lens_cpu=i64(seq),
        )

    @staticmethod
    def write_kv(pool: MHATokenToKVPool, fb: ForwardBatch) -> None:
        """Deterministic KV bytes of (token, position, layer) for every token of ``fb``, in
        the pool's geometry and dtype."""
        n = fb.out_cache_loc.shape[0]
        base = (fb.input_ids[:n] * 31 + fb.positions[:n] * 7).unsqueeze(1)
        heads, dim = pool.k_buffer[0].shape[1:]
        dtype = pool.k_buffer[0].dtype
        for layer in range(pool.layer_num):
            vals = ((base + layer * 13 + torch.arange(heads * dim)) % 251).to(dtype) / 251
            pool.k_buffer[layer][fb.out_cache_loc] = vals.view(n, heads, dim)
            pool.v_buffer[layer][fb.out_cache_loc] = (vals * 0.5).view(n, heads, dim)

    def _eager(self, manager, pool, fb: ForwardBatch) -> None:
        """An eager forward as the ``ModelRunner.forward`` hook brackets it."""
        with manager.with_active_single_forward_manager(0):
            with manager.with_ops_outside_graph(fb):
                manager.pre_ops_maybe_inside_graph(fb)
                self.write_kv(pool, fb)
                manager.post_ops_maybe_inside_graph(fb)

    # ---- faults ------------------------------------------------------------------------------

    def committed_victim(self) -> DriverReq:
        """The running request with a committed prefix that has the most tokens left to
        generate (it reads its prefix in the next rounds)."""
        reqs = [r for r in self.running if r.prefilled and r.kv_len >= 4]
        if not reqs:
            raise RuntimeError("eagle driver: no running request with a committed prefix")
        return max(reqs, key=lambda r: (r.max_new - len(r.output), -r.rid))

    def flip_byte(
        self, pool: MHATokenToKVPool, req: Optional[DriverReq] = None, layer: int = 0
    ) -> dict:
        """Flip the first byte of ``layer``'s K row of a committed slot a running request
        reads next round."""
        req = req or self.committed_victim()
        p = self.rng.randrange(0, req.kv_len - 1)
        slot = int(self.req_to_token_pool.req_to_token[req.row, p])
        row = pool.k_buffer[layer][slot].view(torch.uint8).view(-1)
        row[0] ^= 0xFF
        return dict(rid=req.rid, position=p, slot=slot)

    def swap_req_to_token(self) -> dict:
        """Point one committed position of a request at another request's committed slot."""
        victim = self.committed_victim()
        others = [
            int(self.req_to_token_pool.req_to_token[r.row, p])
            for r in self.running
            if r is not victim and r.prefilled
            for p in range(r.kv_len)
        ]
        if not others:
            raise RuntimeError("eagle driver: no other committed slot")
        p = self.rng.randrange(1, victim.kv_len - 1)
        new = self.rng.choice(others)
        self.req_to_token_pool.req_to_token[victim.row, p] = new
        return dict(rid=victim.rid, position=p, new_slot=new)
