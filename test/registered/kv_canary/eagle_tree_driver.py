"""EAGLE draft trees (``--speculative-eagle-topk`` K > 1, spec v1, any page size) over real sglang
0.5.12 pools and ForwardBatch objects (test support; docs/speculative_trees.md, "1. What
sglang 0.5.12 runs with topk > 1").

:class:`EagleTreeDriver` is :class:`~eagle_driver.EagleDriver` (prefill, finishing, the
canaries built as ``install_canary`` builds them, here with ``RankFacts.draft_topk`` K on the
draft runner and ``verify_tree_depth`` steps + 1 on the target) with a tree decode round:

1. the draft round: ``K * steps`` slots per request borrowed from the allocator and given
   back after it, lane k's step j at ``req_to_token`` column ``L + k * steps + j`` (page
   size 1; larger pages: below); ``steps - 1`` draft ``DECODE`` forwards of ``bs * K`` tokens (row ``b * K + k``, lane k at position
   ``L + i`` in forward i, its slot row i of sglang's ``[steps, bs * K]`` transposed view);
2. the target ``TARGET_VERIFY`` of a random tree of ``num_draft`` nodes (node 0 the bonus
   token at L, every other node under an earlier one, at most K children and ``steps`` levels
   below the root, node i at position ``L + depth(i)`` and column ``L + i``; now and then an
   orphan that no list links, as sgl-kernel drops a node whose parent was not selected), with a
   real ``EagleVerifyInput`` carrying the linked lists sgl-kernel's ``build_tree_efficient``
   builds (first child, then its next siblings, in index order);
3. acceptance as sglang's greedy tree verify walks the lists (from the root, the first child
   whose token is the true continuation), every node off the accepted path freed at once, the
   path's slots re-pointed into ``req_to_token[L .. L + acc]``;
4. the linear draft ``DRAFT_EXTEND`` of the accepted path (as with topk 1).

``seq_lens`` is int32 in even rounds (sglang's graph runners' static buffers) and int64 in
odd ones (an eager batch). ``replay_draft_rounds``: the even rounds' draft rounds run as
sglang's ``EAGLEDraftCudaGraphRunner`` replays them (the outside ops of every forward and the
token snapshot staged first, then each forward's inside ops in capture mode, as
``driver_forward.CpuGraph`` replays a captured decode). ``compact_accepted``: the verify's
acceptance as sglang runs it at page size > 1 (``_free_cache``): the accepted nodes' KV
moved into the request's first verify slots by sglang's torch path of ``move_kv_cache`` and
the plugin's hook on it, the rest freed.

``page_size`` > 1 (a real ``PagedTokenToKVPoolAllocator``; docs/speculative_trees.md, "1.1
Draft round (draft pool, `DECODE` forwards)"): the draft round's lanes as sglang lays them
out (:meth:`EagleTreeDriver._paged_draft_lanes`: ``npp`` whole pages per lane from the
prefix's last page boundary, lane k's step j at column ``L + k * npp * page + j``, the
prefix's last partial page copied into the head of every lane k >= 1 by the draft pool's
``move_kv_cache`` and the plugin's hook), the verify allocated contiguously from L by
``alloc_extend`` and always compacted, the pages past the last kept one freed.

``bug_*`` switches (:class:`EagleDriver`'s: PR 25015's positions, PR 26329's chunk-end token;
``bug_aligned_round_lane_slots``: sglang 0.5.12's lane slots in a paged round without a
partial page; ``bug_stale_lane_columns``: the outcome its kernel's unsynchronised read of
``req_to_token`` allows) and ``plant_*`` faults plant the defects the tests check.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from driver_forward import CpuGraph
from eagle_driver import EagleDriver
from kernel_oracle import sglang_tree_lists
from serving_driver import VOCAB, DriverReq
from sglang.srt.model_executor.forward_batch_info import ForwardMode


class EagleTreeDriver(EagleDriver):
    def __init__(
        self,
        *,
        topk: int = 2,
        steps: int = 3,
        num_draft: Optional[int] = None,
        orphan_prob: float = 0.05,
        replay_draft_rounds: bool = False,
        compact_accepted: bool = False,
        bug_aligned_round_lane_slots: bool = False,
        bug_stale_lane_columns: bool = False,
        **kwargs,
    ):
        if topk < 2:
            raise ValueError("EagleTreeDriver is for topk >= 2 (EagleDriver runs topk 1)")
        if kwargs.get("v2"):
            raise ValueError("sglang 0.5.12 runs draft trees on spec v1 only")
        super().__init__(topk=topk, steps=steps, **kwargs)
        most = topk + (steps - 1) * topk * topk + 1  # sglang's bound on the draft tokens
        self.num_draft = min(num_draft or 2 * topk + 2, most)
        self.orphan_prob = orphan_prob
        self.replay_draft_rounds = replay_draft_rounds
        # page size > 1: sglang compacts every verify's accepted nodes (topk > 1)
        self.compact_accepted = compact_accepted or self.page_size > 1
        # page size > 1: the draft pool's partial-page duplications, (target, source) slot
        # pairs per round that had one (each mirrored by the plugin's hook)
        self.duplications: List[List[tuple]] = []
        self.bug_aligned_round_lane_slots = bug_aligned_round_lane_slots
        self.aligned_rounds = 0  # page size > 1: draft rounds with no partial page
        self.bug_stale_lane_columns = bug_stale_lane_columns
        self.stale_lane_slots = 0  # lane slots taken from req_to_token before the kernel
        self.moves = 0  # compactions that moved KV (a source slot not its target)
        self.replayed_rounds = 0
        self._replay_forward: Optional[int] = None  # the replayed round's next forward
        # faults planted for the next round (the tests' switches): see plant_*
        self._fault = None
        self.fault_log: List[dict] = []

    # ---- faults ------------------------------------------------------------------------------

    def plant_rejected_sibling(self) -> None:
        """Next round: point the accepted path's first position past the root at a rejected
        node of the same depth before the free (a wrong re-pointing of ``req_to_token``)."""
        self._fault = "rejected_sibling"

    def plant_flattened_acceptance(self) -> None:
        """Next round: accept nodes ``0 .. acc`` in flattened order (what sglang's
        ``SGLANG_SIMULATE_ACC_LEN`` does), not a root path."""
        self._fault = "flattened"

    def plant_lane_flip(self) -> None:
        """Next round: after the draft round's first forward, flip a KV byte of the second
        lane's first step (draft pool): its second forward reads that lane."""
        self._fault = "lane_flip"

    # ---- a draft round replayed from its graph --------------------------------------------

    def around_round(self, fb, body) -> None:
        if not (self.replay_draft_rounds and self._seq_dtype() == torch.int32):
            return super().around_round(fb, body)
        with self.draft.with_replayed_draft_round(fb, self.steps - 1):
            self._replay_forward = 0
            try:
                body()
            finally:
                self._replay_forward = None
        self.replayed_rounds += 1

    def around_forward(self, fb, body) -> None:
        if self._replay_forward is None:
            return super().around_forward(fb, body)
        # the graph's forward i: its captured inside ops, the outside phases left as they are
        with self.draft.with_active_single_forward_manager(self._replay_forward):
            CpuGraph(self.draft, body).replay()
        self._replay_forward += 1

    # ---- one tree decode round -------------------------------------------------------------

    def decode_round(self, reqs: List[DriverReq]) -> None:
        s, k_lanes = self.steps, self.topk
        base = [r.kv_len for r in reqs]
        # 1. the draft round's lanes
        if self.page_size > 1:
            # borrowed (and given back) before the round's forwards run, as sglang does
            lane_slots = self._paged_draft_lanes(reqs, base)
            self._tree_draft_round(reqs, base, lane_slots)
        else:
            lane_slots = []
            for r, L in zip(reqs, base):
                got = self._alloc(k_lanes * s)
                self._set_slots(r, L, got)
                lane_slots.append(got)
            self._tree_draft_round(reqs, base, lane_slots)
            self.allocator.free(
                torch.tensor([x for ls in lane_slots for x in ls], dtype=torch.int64)
            )
        # 2. and 3. the target verify of each request's tree, its acceptance
        trees = [self._random_tree(r, L) for r, L in zip(reqs, base)]
        paths = self.verify_trees(reqs, base, trees)
        # 4. the draft extend of the accepted paths
        self.draft_extend_accepted(reqs, base, paths)
        self.rounds += 1

    def verify_trees(self, reqs: List[DriverReq], base: List[int], trees: List[dict]):
        """The target verify of ``trees`` (one per request, ``num_draft`` nodes each, node i
        at ``req_to_token`` column ``L + i``), acceptance along a root path (a planted fault
        applied), every other node freed; returns each request's kept slots (and sets each
        tree's ``path``: the accepted node indices, root first)."""
        n, s = self.num_draft, self.steps
        # page size > 1: contiguous from L, continuing the request's last partial page
        verify_slots = self._alloc_columns(reqs, base, [L + n for L in base])
        for r, L, got in zip(reqs, base, verify_slots):
            self._set_slots(r, L, got)
        ids = [t for tree in trees for t in tree["tokens"]]
        pos = [L + d for tree, L in zip(trees, base) for d in tree["depth"]]
        fb = self._batch(
            self.target,
            ForwardMode.TARGET_VERIFY,
            ids,
            pos,
            [x for v in verify_slots for x in v],
            [r.row for r in reqs],
            base,
            reqs,
            seq_dtype=self._seq_dtype(),
        )
        fb.spec_info = self.tree_verify_input(ids, pos, base, trees)
        self._eager(self.target, self.target_pool, fb)
        # 3. acceptance: a root path (the first matching child at each level)
        paths = []
        for r, L, tree, vs in zip(reqs, base, trees, verify_slots):
            path = self._accepted_path(r, L, tree)
            # a planted fault goes to a request that reads it next round (one not finishing)
            reads_on = r.max_new - len(r.output) > 2 * (s + 1)
            if self._fault == "flattened" and reads_on and path != list(range(len(path))):
                path = list(range(len(path)))
                self.fault_log.append(dict(kind="flattened", rid=r.rid, path=path))
            tree["path"] = path
            acc = len(path) - 1
            self.accepted += acc
            self.rejected += n - 1 - acc
            r.output += [self.truth(r, L + 1 + j) for j in range(acc + 1)]
            r.kv_len = L + acc + 1
            kept = [vs[i] for i in path]
            if self._fault == "rejected_sibling" and reads_on and acc >= 1:
                sib = [
                    i
                    for i in range(1, n)
                    if tree["depth"][i] == 1
                    and tree["parent"][i] == 0
                    and tree["tokens"][i] != tree["tokens"][path[1]]
                ]
                if sib:
                    kept[1] = vs[sib[0]]  # re-pointed at a rejected node of the same depth
                    self.fault_log.append(
                        dict(kind="rejected_sibling", rid=r.rid, position=L + 1, slot=kept[1])
                    )
            if self.compact_accepted:
                kept = self._compact(vs, kept)
            self._set_slots(r, L, kept)
            r.slots += kept
            if self.page_size > 1:
                # sglang's get_src_tgt_cache_loc: the rest of the last kept page stays the
                # request's (its next allocation continues there); the pages after it are freed
                ps = self.page_size
                keep = min((L + acc + 1 + ps - 1) // ps * ps, L + n) - L
                r.slots += vs[acc + 1 : keep]
                dropped = vs[keep:]
            else:
                dropped = [vs[i] for i in range(n) if vs[i] not in kept]
            if dropped:
                self.allocator.free(torch.tensor(dropped, dtype=torch.int64))
            paths.append(kept)
        if self.fault_log and self._fault in ("flattened", "rejected_sibling"):
            self._fault = None
        return paths

    def _compact(self, verify_slots: List[int], kept: List[int]) -> List[int]:
        """sglang's ``_free_cache`` at page size > 1: the accepted nodes' KV moved into the
        first ``len(kept)`` of the request's verify slots by sglang's own torch path of
        ``MHATokenToKVPool.move_kv_cache`` (``move_kv_cache_native``: the method itself may
        already carry the plugin's hook in this process, ``load_plugins`` having run), then
        the plugin's AFTER hook as ``HookRegistry`` runs it (the records follow); returns
        those slots."""
        from sglang.srt.kv_canary import plugin
        from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

        tgt = verify_slots[: len(kept)]
        if tgt != kept:
            self.moves += 1
        pool = self.target_pool
        t, s_ = (torch.tensor(x, dtype=torch.int64) for x in (tgt, kept))
        move_kv_cache_native(pool.k_buffer, pool.v_buffer, t, s_)
        plugin._after_move_kv_cache(None, pool, t, s_)
        return tgt

    def _paged_draft_lanes(self, reqs: List[DriverReq], base: List[int]) -> List[List[int]]:
        """sglang's ``_draft_preprocess_decode`` at page size > 1 with topk > 1: per request
        ``npp = ceil((L % page + steps) / page)`` pages per lane from the prefix's last page
        boundary (``get_last_loc_large_page_size_large_top_k``'s lengths), allocated by
        ``alloc_extend`` with the allocator's state backed up; sglang's own
        ``assign_draft_cache_locs`` kernel (Triton; its interpreter on the CPU) writes them into
        ``req_to_token``, lists the duplication of the prefix's last partial page into the head
        of every lane k >= 1 and rewrites the slots to ``[bs, K, steps]``; the draft pool's
        ``move_kv_cache`` of that duplication (sglang's torch path) and the plugin's hook on it,
        as :meth:`_compact` runs them; the allocator's state restored. Returns each request's
        ``K * steps`` lane slots (lane k's steps ``k * steps ..``) and records the
        duplication's slot pairs in :attr:`duplications`.

        In a round where no request has a partial page, sglang 0.5.12's kernel skips its
        rewrite of the slots (its part 3 sits under ``duplicate_cache_len > 0``), so the
        round's forwards write the allocation's first ``bs * K * steps`` slots, not the lanes'
        columns: the driver completes the rewrite from ``req_to_token`` unless
        ``bug_aligned_round_lane_slots`` (sglang 0.5.12 as it runs).

        ``bug_stale_lane_columns``: the kernel's part 3 loads the lanes' columns of
        ``req_to_token`` that its part 1 stored, in the same program with no barrier between
        (its PTX has none): part 1's element ``e`` (column ``L + e``) is stored by warp
        ``e % 128 // 32`` of four, part 3's 32-wide load is repeated by every warp, each storing
        into ``out_cache_loc``. A lane step at offset ``k * npp * page + j`` past warp 0's 32
        columns (lane 1 of a two-page lane: ``L % page + steps > page``) may then be read before
        it is stored: the switch gives such steps the column's slot from before the kernel (the
        outcome the race allows; GPU suite run 39 saw it at page 16, topk 2, 3 steps)."""
        from sglang.srt.kv_canary import plugin
        from sglang.srt.mem_cache.memory_pool import move_kv_cache_native
        from sglang.srt.speculative.spec_utils import assign_draft_cache_locs
        from sglang.srt.utils import next_power_of_2

        s, k_lanes, ps = self.steps, self.topk, self.page_size
        bs = len(reqs)
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        rpi, seq = i64([r.row for r in reqs]), i64(base)
        # get_last_loc_large_page_size_large_top_k
        last_page_lens = seq % ps
        npp = (last_page_lens + s + ps - 1) // ps
        ends = seq // ps * ps + npp * (ps * k_lanes)
        extend_lens = ends - seq
        state = self.allocator.backup_state()
        out = self.allocator.alloc_extend(
            seq, seq, ends, ends, self.last_loc(reqs, base), int(extend_lens.sum())
        )
        if out is None:
            raise RuntimeError("eagle driver: KV pool exhausted")
        dup = int(last_page_lens.sum()) * (k_lanes - 1)
        self.aligned_rounds += dup == 0
        tgt, src = (torch.zeros(dup, dtype=torch.int32) for _ in range(2))
        r2t = self.req_to_token_pool.req_to_token
        before = r2t[rpi].clone() if self.bug_stale_lane_columns else None
        assign_draft_cache_locs[(bs,)](
            rpi,
            r2t,
            seq,
            extend_lens,
            npp,
            out,
            src,
            tgt,
            torch.cumsum(last_page_lens, dim=0),
            dup,
            r2t.shape[1],
            k_lanes,
            s,
            ps,
            next_power_of_2(bs),
            next_power_of_2(s + ps),
        )
        if not dup and not self.bug_aligned_round_lane_slots:
            # the kernel's part 3 (the lanes' slots in [bs, K, steps] order) runs only when
            # some request has a partial page: completed here from req_to_token, as that part
            # writes it (lane k's step j at column L + k * npp * page + j)
            cols = seq.view(bs, 1, 1) + (
                torch.arange(k_lanes).view(1, k_lanes, 1) * (npp * ps).view(bs, 1, 1)
                + torch.arange(s).view(1, 1, s)
            )
            lanes = r2t[rpi.view(bs, 1, 1), cols].to(torch.int64)
            out[: bs * k_lanes * s] = lanes.reshape(-1)
        if dup and before is not None:
            for b in range(bs):
                for k in range(k_lanes):
                    for j in range(s):
                        offset = k * int(npp[b]) * ps + j
                        if offset % 128 // 32:
                            slot = before[b, int(seq[b]) + offset].to(torch.int64)
                            self.stale_lane_slots += int(slot != out[(b * k_lanes + k) * s + j])
                            out[(b * k_lanes + k) * s + j] = slot
        if dup:
            pool = self.draft_pool
            move_kv_cache_native(pool.k_buffer, pool.v_buffer, tgt, src)
            plugin._after_move_kv_cache(None, pool, tgt, src)
            self.duplications.append(list(zip(tgt.tolist(), src.tolist())))
        self.allocator.restore_state(state)
        return out[: bs * k_lanes * s].view(bs, k_lanes * s).tolist()

    def _tree_draft_round(self, reqs, base, lane_slots) -> None:
        """sglang's ``draft_forward`` with K lanes: one ForwardBatch of ``bs`` requests whose
        tokens, positions and slots are ``[bs * K]``, mutated per forward."""
        s, k_lanes = self.steps, self.topk
        fb = self._batch(
            self.draft,
            ForwardMode.DECODE,
            [self.rng.randrange(VOCAB) for _ in range(len(reqs) * k_lanes)],
            [L for L in base for _ in range(k_lanes)],
            [x for ls in lane_slots for x in ls],
            [r.row for r in reqs],
            base,
            reqs,
            seq_dtype=self._seq_dtype(),
        )
        # sglang's out_cache_loc.reshape(bs, K, steps).permute(2, 0, 1).reshape(steps, -1)
        by_step = fb.out_cache_loc.reshape(len(reqs), k_lanes, s).permute(2, 0, 1).reshape(s, -1)

        def one_forward():
            self.draft.pre_ops_maybe_inside_graph(fb)
            self.write_kv(self.draft_pool, fb)
            self.draft.post_ops_maybe_inside_graph(fb)

        def loop():
            for i in range(s - 1):
                fb.input_ids = torch.tensor(
                    [self.rng.randrange(VOCAB) for _ in range(len(reqs) * k_lanes)],
                    dtype=torch.int64,
                )
                fb.out_cache_loc = by_step[i]
                if self.bug_positions_before_forward:  # upstream PR 25015
                    fb.positions.add_(1)
                self.around_forward(fb, one_forward)
                if not self.bug_positions_before_forward:
                    fb.positions.add_(1)
                if i == 0 and self._fault == "lane_flip" and s >= 3:
                    slot = int(by_step[0][1])  # request 0, lane 1, step 0
                    self.draft_pool.k_buffer[0][slot].view(torch.uint8).view(-1)[0] ^= 0xFF
                    self.fault_log.append(dict(kind="lane_flip", rid=reqs[0].rid, slot=slot))
                    self._fault = None

        self.around_round(fb, loop)

    def _seq_dtype(self) -> torch.dtype:
        """``seq_lens``' dtype in this round's draft and verify forwards: even rounds int32
        (sglang's ``CudaGraphRunner`` / ``EAGLEDraftCudaGraphRunner`` static buffers, a
        replayed forward), odd rounds int64 (an eager batch)."""
        return torch.int32 if self.rounds % 2 == 0 else torch.int64

    def _random_tree(self, req: DriverReq, L: int) -> dict:
        """A tree of ``num_draft`` nodes (module docstring): parents, depths, tokens (each
        right with ``accept_prob``), orphans marked -2 (their subtrees stay linked under them)."""
        n, k_lanes, s = self.num_draft, self.topk, self.steps
        parent, depth, children = [-1], [0], [0] * n
        for i in range(1, n):
            choices = [p for p in range(i) if depth[p] < s and children[p] < k_lanes]
            p = self.rng.choice(choices)
            children[p] += 1
            parent.append(p)
            depth.append(depth[p] + 1)
        tokens = [req.tokens[L]] + [self._guess(req, L + depth[i]) for i in range(1, n)]
        linked = list(parent)
        for i in range(1, n):
            if self.rng.random() < self.orphan_prob:
                linked[i] = -2
        return dict(parent=linked, depth=depth, tokens=tokens)

    def _accepted_path(self, req: DriverReq, L: int, tree: dict) -> List[int]:
        parent, tokens, depth = tree["parent"], tree["tokens"], tree["depth"]
        path = [0]
        while True:
            kids = [c for c in range(len(parent)) if parent[c] == path[-1]]
            nxt = next((c for c in kids if tokens[c] == self.truth(req, L + depth[c])), None)
            if nxt is None:
                return path
            path.append(nxt)

    def tree_verify_input(self, ids, pos, seq, trees):
        """The verify's ``spec_info``: an ``EagleVerifyInput`` with the trees' lists."""
        return self._eagle_verify_input(ids, pos, seq, trees, self.topk, self.steps)

    @staticmethod
    def _eagle_verify_input(ids, pos, seq, trees, topk, steps):
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        n = len(trees[0]["parent"])
        first, sibling = sglang_tree_lists([tree["parent"] for tree in trees])
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return EagleVerifyInput(
            draft_token=i64(ids),
            custom_mask=torch.ones(len(ids), dtype=torch.bool),
            positions=i64(pos),
            retrieve_index=i64(list(range(len(ids)))).view(len(trees), n),
            retrieve_next_token=first,
            retrieve_next_sibling=sibling,
            retrieve_cum_len=i64([0]),
            spec_steps=steps,
            topk=topk,
            draft_token_num=n,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            seq_lens_sum=sum(seq),
            seq_lens_cpu=i64(seq),
        )
