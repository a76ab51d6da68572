"""Abort mode's release guard: a holder of KV slots the canary suspects frees only the ones it
owns (docs/subsystems.md, "Containment"; docs/user_guide.md, "Containment:
--kv-canary abort").

:class:`ReleaseGuard` guards the release of each request an incident touched
(:meth:`~ReleaseGuard.releasing`, around the tree cache's ``cache_finished_req``) and each
containment eviction (:meth:`~ReleaseGuard.evicting`): a page another holder keeps (a radix
node names it, or a live row names it where sglang counts it for that row and its record holds
the row's (position, token): ``_kept``), or already free, is held back (the rule: ``_decide``)
and freed once, by its holder or by :meth:`~ReleaseGuard.settle`; a slot nobody names whose
record holds an entry in doubt's (position, token) is reclaimed; an entry whose own slot no
record identifies is counted as unattributed. Scheduler thread; host work and read-backs on
the containment path only. Page ids are slot ids at page size 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from sglang.jit_kernel.kv_canary.consts import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_TOKEN,
)
from sglang.jit_kernel.kv_canary.types import CANARY_SLOT_BYTES
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.radix_cache_walker import radix_subtree_nodes, radix_tree_nodes
from sglang.srt.kv_canary.violations.rank_relay import SINGLE_RANK, RankAgreement, agree_release
from sglang.srt.kv_canary.violations.resolver import violation_path_sync

logger = logging.getLogger(__name__)

# (position, token) packed into one int64 key: positions and token ids are below 2**31
_KEY_SHIFT = 31

GUARD_LINE_PREFIX = "kv_canary abort:"
RELEASE_LINE_PREFIX = f"{GUARD_LINE_PREFIX} released request"
EVICTION_LINE_PREFIX = f"{GUARD_LINE_PREFIX} evicting a corrupt prefix"
_UNATTRIBUTED_RE = re.compile(
    re.escape(GUARD_LINE_PREFIX) + r" .*, unattributed entries "
    r"(\d+)$"
)


def parse_unattributed(line: str) -> int:
    """The unattributed entries a guarded-release line (:meth:`ReleaseOutcome.describe`)
    counts; 0 for any other line."""
    m = _UNATTRIBUTED_RE.search(line)
    return int(m.group(1)) if m else 0


@dataclasses.dataclass(frozen=True)
class ReleaseOutcome:
    """What one guarded release did: pages held back (another holder's, or free already) and
    reclaimed (the request's own, no longer named by its row), entries whose own slot no record
    identified; each in pages of ``page_size`` slots."""

    what: str  # "released request <rid>" or "evicting a corrupt prefix"
    page_size: int
    held_back: int
    reclaimed: int
    unattributed: int

    @property
    def changed(self) -> bool:
        return bool(self.held_back or self.reclaimed or self.unattributed)

    def describe(self) -> str:
        unit = "slot(s)" if self.page_size == 1 else f"page(s) of {self.page_size} slots"
        return (
            f"{GUARD_LINE_PREFIX} {self.what}: held back {self.held_back} {unit} another "
            f"holder owns, reclaimed {self.reclaimed} {unit} its row no longer named, "
            f"unattributed entries {self.unattributed}"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class _Holders:
    """Bool ``[num_pages]`` masks (:meth:`ReleaseGuard._holders`): pages another holder names
    (a live row or a radix node), pages a radix node names, free pages."""

    named: torch.Tensor
    free: torch.Tensor
    by_nodes: torch.Tensor
    rows: tuple  # the other holders' live rows (ReleaseGuard._live_rows)


@dataclasses.dataclass(frozen=True, eq=False)
class _ReleasePlan:
    """One guarded release: pages held back (int64, the allocator's device), pages reclaimed,
    held-back pages not free yet (host list), unattributed entries. ``agreed`` (several
    ranks): the pages every rank frees, in the order each frees them (sorted), instead of
    sglang's frees in its own order."""

    held_back: torch.Tensor
    reclaim: torch.Tensor
    still_held: List[int]
    unattributed: int
    agreed: Optional[Tuple[int, ...]] = None
    # pages the holder frees although a live row names them: those rows name a page that is
    # not theirs (a corrupt entry); they are marked, so their own release is guarded
    named_elsewhere: Tuple[int, ...] = ()


class ReleaseGuard:
    """``records``: the full pool's canary records (uint8 ``[num_slots, 32]``, the TAIL
    buffer: every written slot's token and position); ``req_to_token``: the runner's int32
    table; ``live_reqs``: the scheduler's requests that may hold rows (its running and
    forwarding batches, the chunked request); ``radix_cache``: the tree cache (None, or a
    ``ChunkCache``: no tree)."""

    def __init__(
        self,
        *,
        records: torch.Tensor,
        req_to_token: torch.Tensor,
        live_reqs: Callable[[], Sequence],
        radix_cache=None,
    ):
        if (
            records.dtype != torch.uint8
            or records.dim() != 2
            or records.shape[1] != CANARY_SLOT_BYTES
        ):
            raise ValueError(
                f"records must be uint8 [num_slots, {CANARY_SLOT_BYTES}], got "
                f"{records.dtype} {tuple(records.shape)}"
            )
        self.records = records.view(torch.int64)
        self.req_to_token = req_to_token
        self.live_reqs = live_reqs
        self.radix_cache = (
            None if radix_cache is None or seam.is_chunk_cache(radix_cache) else radix_cache
        )
        self.pending: List[int] = []  # held-back pages not free yet
        self.held_back_slots = 0  # over the server's life, in slots
        self.reclaimed_slots = 0
        self.settled_slots = 0  # held-back slots the guard freed itself (no holder left)
        self.unattributed = 0
        self.guarded_releases = 0
        # a release or eviction under way: a guard nested in it (sglang calling a hooked
        # method from another, a second wrap of the same method) leaves it to the outer one
        self._busy = False
        # several TP ranks: every plan is agreed (they free the same pages; see agree_release)
        self.agreement: RankAgreement = SINGLE_RANK

    # ---- who holds what ----------------------------------------------------------------------

    def _holders(
        self, allocator, page_size: int, *, exclude_req=None, exclude_nodes: Sequence = ()
    ) -> "_Holders":
        """Bool ``[num_pages]`` masks on the records' device: pages named by a live request's
        row (``exclude_req`` left out) or a radix node (``exclude_nodes`` left out), pages
        named by such a node, and pages free in ``allocator``."""
        device = self.records.device
        num_pages = (self.records.shape[0] + page_size - 1) // page_size
        by_nodes = torch.zeros(num_pages, dtype=torch.bool, device=device)
        if self.radix_cache is not None:
            skip = {id(n) for n in exclude_nodes}
            values = [
                v
                for n in radix_tree_nodes(self.radix_cache)
                if id(n) not in skip
                for v in [seam.radix_node_value(n)]
                if v is not None and v.numel()
            ]
            if values:
                by_nodes[torch.cat(values).to(device, torch.int64) // page_size] = True
        named = by_nodes.clone()
        rows = self._live_rows(exclude_req)
        reqs, table, live = rows
        if reqs:
            named[table[live].to(device, torch.int64) // page_size] = True
        free = torch.zeros(num_pages, dtype=torch.bool, device=device)
        free[seam.allocator_free_pages(allocator).to(device)] = True
        return _Holders(named=named, free=free, by_nodes=by_nodes, rows=rows)

    def _kept(
        self, holders: "_Holders", pages: torch.Tensor, page_size: int, tree_cache
    ) -> torch.Tensor:
        """Bool ``[num_pages]``: of ``pages`` (int64), those another holder keeps as its own
        (what sglang's pool accounting counts for it): a radix node names the page, or one of
        ``holders``' live rows names a slot of it at a position sglang counts as that request's
        (``req_release_start``, ``cache_protected_len``, to ``kv_allocated_len``:
        ``_get_total_uncached_sizes``) where the slot's record holds the request's (position,
        token). A row naming a page anywhere else keeps nothing: its entry is corrupt (the
        records are another sequence's), or below ``cache_protected_len``, where the nodes the
        request locks count its KV; sglang counts that page for the tree or the holder
        deciding, not for the row."""
        device = self.records.device
        kept = holders.by_nodes.clone()
        reqs, table, live = holders.rows
        if not reqs:
            return kept
        starts = torch.tensor([seam.req_release_start(r, tree_cache) for r in reqs])
        cols = torch.arange(table.shape[1], device=device)
        slots = table.to(device, torch.int64)
        counted = live.to(device) & (cols[None, :] >= starts.to(device)[:, None])
        counted &= torch.isin(slots // page_size, pages.to(device))
        rows, positions = counted.nonzero(as_tuple=True)
        if not rows.numel():
            return kept
        tokens = {i: seam.req_token_ids(reqs[i]) for i in set(rows.tolist())}
        want = torch.tensor(
            [
                tokens[i][p] if p < len(tokens[i]) else -1
                for i, p in zip(rows.tolist(), positions.tolist())
            ],
            dtype=torch.int64,
        ).to(device)
        named = slots[rows, positions]
        stored = self.records[named]
        fits = (stored[:, CANARY_FIELD_POSITION] == positions) & (
            (want < 0) | (stored[:, CANARY_FIELD_TOKEN] == want)
        )
        kept[named[fits] // page_size] = True
        return kept

    def _live_rows(self, exclude_req=None):
        """The live requests holding KV (``exclude_req`` left out), their ``req_to_token``
        rows as one table (``[n, longest]``, the table's device) and the mask of each row's
        entries in use (up to its ``kv_allocated_len``); ``([], None, None)`` when none."""
        reqs = [
            r
            for r in seam.live_row_reqs(self.live_reqs())
            if r is not exclude_req and seam.req_kv_len(r) > 0
        ]
        if not reqs:
            return [], None, None
        rows = torch.tensor([seam.req_pool_row(r) for r in reqs], dtype=torch.int64)
        lens = torch.tensor([seam.req_kv_len(r) for r in reqs], dtype=torch.int64)
        table = self.req_to_token[rows.to(self.req_to_token.device), : int(lens.max())]
        live = (
            torch.arange(table.shape[1], device=table.device)[None, :]
            < lens.to(table.device)[:, None]
        )
        return reqs, table, live

    def _mark_namers(self, pages: Sequence[int], page_size: int, *, exclude_req=None) -> None:
        """Mark the live requests whose rows name one of ``pages`` (pages a guarded release
        frees as its holder's): their entries there are not theirs, so their own release must
        be guarded too."""
        if not pages:
            return
        reqs, table, live = self._live_rows(exclude_req)
        if not reqs:
            return
        wanted = torch.tensor(pages, dtype=torch.int64, device=table.device)
        hits = (torch.isin(table.to(torch.int64) // page_size, wanted) & live).any(dim=1)
        for r in (r for r, hit in zip(reqs, hits.tolist()) if hit):
            seam.mark_contained(r)

    # ---- the guarded frees -------------------------------------------------------------------

    @contextlib.contextmanager
    def releasing(self, req, tree_cache):
        """Around ``tree_cache.cache_finished_req(req)`` of a request an incident touched: its
        frees skip held-back pages and repeats; after it, its reclaimed pages are freed."""
        allocator = seam.tree_cache_allocator(tree_cache)
        page_size = seam.allocator_page_size(allocator)
        row = seam.req_pool_row(req)
        lo, hi = seam.req_release_span(req, tree_cache)
        if self._busy or row is None or hi <= lo:
            yield
            return
        device = self.records.device
        with violation_path_sync(device):
            holders = self._holders(allocator, page_size, exclude_req=req)
            entries = self.req_to_token[row, lo:hi].to(device, torch.int64)
            tokens = seam.req_token_ids(req)[lo:hi]
            plan = self._decide(
                entries,
                torch.arange(lo, lo + len(tokens), device=device),
                torch.tensor(tokens, dtype=torch.int64).to(device),
                holders,
                self._kept(holders, entries // page_size, page_size, tree_cache),
                page_size,
            )
            plan = self._agreed(plan, entries // page_size, holders.free)
            self._mark_namers(plan.named_elsewhere, page_size, exclude_req=req)
        with self._guarded(allocator, page_size, plan, f"released request {seam.req_rid(req)}"):
            yield

    @contextlib.contextmanager
    def evicting(self, radix_cache, node):
        """Around abort mode's eviction of ``node``'s subtree from the radix cache: the same
        guard for the slots its nodes hold (a corrupt ``req_to_token`` row that sglang cached
        before its report put another holder's slot there, and left the request's own slot
        with nobody)."""
        allocator = seam.tree_cache_allocator(radix_cache)
        page_size = seam.allocator_page_size(allocator)
        subtree = radix_subtree_nodes(node)
        device = self.records.device
        slots, positions, tokens = [], [], []
        for n in subtree:
            value = seam.radix_node_value(n)
            if value is None or not value.numel():
                continue
            key = seam.radix_node_key_tokens(n)[: value.numel()]
            depth = seam.radix_node_depth(n)
            slots.append(value.to(device, torch.int64))
            positions += range(depth, depth + value.numel())
            tokens += key + [-1] * (value.numel() - len(key))
        if self._busy or not slots:
            yield
            return
        with violation_path_sync(device):
            holders = self._holders(allocator, page_size, exclude_nodes=subtree)
            entries = torch.cat(slots)
            plan = self._decide(
                entries,
                torch.tensor(positions, device=device),
                torch.tensor(tokens, dtype=torch.int64).to(device),
                holders,
                self._kept(holders, entries // page_size, page_size, radix_cache),
                page_size,
            )
            plan = self._agreed(plan, entries // page_size, holders.free)
            self._mark_namers(plan.named_elsewhere, page_size)
        with self._guarded(allocator, page_size, plan, "evicting a corrupt prefix"):
            yield

    @contextlib.contextmanager
    def _guarded(self, allocator, page_size: int, plan: "_ReleasePlan", what: str):
        if plan.agreed is not None:
            with self._agreed_frees(allocator, page_size, plan):
                yield
            self._account(plan, page_size, what)
            return
        dropped = plan.held_back
        freed: List[torch.Tensor] = []

        def keep(free_index: torch.Tensor) -> torch.Tensor:
            idx = free_index.to(torch.int64)
            pg = idx // page_size
            mask = ~torch.isin(pg, dropped.to(pg.device))
            if freed:
                mask &= ~torch.isin(pg, torch.cat(freed).to(pg.device))
            idx = idx[mask]
            if page_size == 1:
                idx = torch.unique(idx)
            freed.append(torch.unique(idx // page_size))
            return idx.to(free_index.dtype)

        with self._filtered_frees(allocator, keep):
            yield
        if plan.reclaim.numel():
            allocator.free(plan.reclaim * page_size)
        self._account(plan, page_size, what)

    @contextlib.contextmanager
    def _filtered_frees(self, allocator, keep):
        """Within the block, the allocator's frees go through ``keep`` and this guard is busy
        (a guard nested in the block leaves the release to this one)."""
        self._busy = True
        try:
            with seam.allocator_frees_filtered(allocator, keep):
                yield
        finally:
            self._busy = False

    @contextlib.contextmanager
    def _agreed_frees(self, allocator, page_size: int, plan: "_ReleasePlan"):
        """Several ranks: sglang's frees within the block are collected, not made; after it,
        the agreed pages among them (and those the plan reclaims) are freed in one call,
        sorted, so every rank's allocator hands out the same slots afterwards."""
        tried: List[torch.Tensor] = []

        def keep(free_index: torch.Tensor) -> torch.Tensor:
            tried.append(free_index.to(torch.int64) // page_size)
            return free_index[:0]

        with self._filtered_frees(allocator, keep):
            yield
        attempted = set(torch.cat(tried).tolist()) if tried else set()
        pages = sorted(set(plan.agreed) & (attempted | set(plan.reclaim.tolist())))
        if pages:
            device = plan.held_back.device
            allocator.free(torch.tensor(pages, dtype=torch.int64, device=device) * page_size)

    def _account(self, plan: "_ReleasePlan", page_size: int, what: str) -> None:
        self.pending.extend(p for p in plan.still_held if p not in self.pending)
        outcome = ReleaseOutcome(
            what=what,
            page_size=page_size,
            held_back=int(plan.held_back.numel()),
            reclaimed=int(plan.reclaim.numel()),
            unattributed=plan.unattributed,
        )
        self.guarded_releases += 1
        self.held_back_slots += outcome.held_back * page_size
        self.reclaimed_slots += outcome.reclaimed * page_size
        self.unattributed += outcome.unattributed
        if outcome.changed:
            logger.warning(outcome.describe())

    def _decide(
        self,
        entries: torch.Tensor,
        positions: torch.Tensor,
        want: torch.Tensor,
        holders: "_Holders",
        kept: torch.Tensor,
        page_size: int,
    ) -> "_ReleasePlan":
        """Which pages a holder's frees of ``entries`` (int64 slots; the first
        ``len(positions)`` hold the sequence ``positions`` with tokens ``want``, -1: unknown)
        must skip, and which it must free although it no longer names them. ``holders``: who
        else names each page, and what is free; ``kept``: the pages another holder keeps as
        its own (:meth:`_kept`).

        An entry is the holder's to free when its page is not free and either no other holder
        keeps it, or its record holds the entry's (position, token) and no other slot that
        may be the holder's (one nobody names, or one on a page no other holder keeps) holds
        that record as well (then that one is the holder's, and this one the other's: two
        requests' identical prefixes have identical records). A page is held back when an
        entry naming it is not the holder's to free. A slot nobody names, not free, whose
        record holds the (position, token) of an entry in doubt (its record is another's,
        another holder keeps it, or it is free) is reclaimed. ``named_elsewhere``: the pages
        freed although another holder names them (a live row naming one has a corrupt entry
        there)."""
        device = self.records.device
        named, free = holders.named, holders.free
        pages = entries // page_size
        other, was_free = kept[pages], free[pages]
        n = positions.shape[0]
        stored = self.records[entries[:n]]
        fits = torch.zeros_like(other)
        fits[:n] = (
            (stored[:, CANARY_FIELD_POSITION] == positions)
            & (stored[:, CANARY_FIELD_TOKEN] == want)
            & (want >= 0)
        )
        doubt = (~fits | other | was_free)[:n] & (want >= 0)
        keys = (positions << _KEY_SHIFT) | want.clamp(min=0)
        has_orphan = torch.zeros_like(other)
        reclaim = torch.zeros(0, dtype=torch.int64, device=device)
        slots = torch.zeros(0, dtype=torch.int64, device=device)
        rec_keys = None
        if bool(doubt.any()):
            rec_keys = (self.records[:, CANARY_FIELD_POSITION] << _KEY_SHIFT) | self.records[
                :, CANARY_FIELD_TOKEN
            ]
            slots = torch.isin(rec_keys, keys[doubt]).nonzero().flatten()
            slots = slots[slots >= page_size]  # the padding slot (page 0) is nobody's
            cand = slots // page_size
            orphan = ~named[cand] & ~free[cand] & ~torch.isin(cand, pages)
            reclaim = torch.unique(cand[orphan])
            # the holder's own slot of a key: an orphan, or a slot on a page no other holder
            # keeps (a page mate of its other entries: at page size > 1 identical prefixes
            # put the key on the holder's own page too)
            own_pages = torch.unique(pages[~other & ~was_free])
            mine = slots[orphan | torch.isin(cand, own_pages)]
            # the same record: (position, token) and the chain before it (identical token
            # prefixes only; two sequences share a (position, token) by chance)
            same = (keys[:, None] == rec_keys[mine][None, :]) & (
                stored[:, CANARY_FIELD_PREV_HASH, None]
                == self.records[mine, CANARY_FIELD_PREV_HASH][None, :]
            )
            has_orphan[:n] = same.any(dim=1) & doubt & fits[:n]
        ok = ~was_free & (~other | (fits & ~has_orphan))
        held_back = torch.unique(pages[~ok])
        named_elsewhere = torch.unique(pages[ok & named[pages]])
        named_elsewhere = named_elsewhere[~torch.isin(named_elsewhere, held_back)]
        unattributed = 0
        lost = (~fits & ~ok)[:n] & (want >= 0)  # another's record on a page held back
        if bool(lost.any()):
            # its own slot is reclaimed, or on a page this holder frees (a page mate's)
            freed_pages = torch.cat([reclaim, torch.unique(pages[ok])])
            mine = slots[torch.isin(slots // page_size, freed_pages)]
            unattributed = int((lost & ~torch.isin(keys, rec_keys[mine])).sum())
        return _ReleasePlan(
            held_back=held_back,
            reclaim=reclaim,
            still_held=held_back[~free[held_back]].tolist(),
            unattributed=unattributed,
            named_elsewhere=tuple(named_elsewhere.tolist()),
        )

    def _agreed(
        self, plan: "_ReleasePlan", entry_pages: torch.Tensor, free: torch.Tensor
    ) -> "_ReleasePlan":
        """On several ranks, ``plan`` replaced by the ranks' agreed one (``agree_release``):
        the pages every rank frees, in one order, and the pages held back on every rank. One
        gather; ``plan`` itself on one rank."""
        if not self.agreement.several:
            return plan
        agreed = agree_release(
            self.agreement,
            entry_pages=torch.unique(entry_pages).tolist(),
            held_back=plan.held_back.tolist(),
            reclaim=plan.reclaim.tolist(),
        )
        device = plan.held_back.device
        return _ReleasePlan(
            held_back=torch.tensor(agreed.held_back, dtype=torch.int64, device=device),
            reclaim=torch.tensor(agreed.reclaim, dtype=torch.int64, device=device),
            still_held=[p for p in agreed.kept if not bool(free[p])],
            unattributed=plan.unattributed,
            agreed=agreed.frees,
            named_elsewhere=plan.named_elsewhere,
        )

    # ---- held-back pages ---------------------------------------------------------------------

    def settle(self, tree_cache) -> int:
        """Between batches: forget held-back pages that are free now (their holder freed
        them) and free those no holder names any more (returns how many). Host work only
        while pages are held back."""
        if not self.pending:
            return 0
        allocator = seam.tree_cache_allocator(tree_cache)
        page_size = seam.allocator_page_size(allocator)
        device = self.records.device
        with violation_path_sync(device):
            holders = self._holders(allocator, page_size)
            named, free = holders.named, holders.free
            pending = torch.tensor(self.pending, dtype=torch.int64, device=device)
            orphans = pending[~named[pending] & ~free[pending]].tolist()
            held = pending[~free[pending]].tolist()
        if self.agreement.several:  # freed only where no rank sees a holder
            orphans = self.agreement.common(orphans)
        gone = set(orphans)
        keep = [p for p in held if p not in gone]
        orphan = torch.tensor(orphans, dtype=torch.int64, device=device)
        if orphans:
            allocator.free(orphan * page_size)
            self.settled_slots += len(orphans) * page_size
            logger.warning(
                "kv_canary abort: freed %d held-back page(s) no holder names any more", len(orphans)
            )
        self.pending = keep
        return len(orphans)
