"""``CanaryPerturber``: injects the self-test faults into a live runner, on purpose
(docs/subsystems.md, "Self-tests"; the fault classes: docs/user_guide.md, "Self-tests: fault
injection, the token oracle, the demo").

Caller: :class:`~sglang.srt.kv_canary.manager.CanaryManager`, outside CUDA graphs.
:meth:`before_forward`: ``req_to_token``, ``req_to_token_kept``, ``real_kv_used``,
``pd_transfer`` (all but the kept one undone at the next :meth:`after_forward`, once the
forward has read them);
:meth:`after_forward`: ``real_kv_post_forward``, ``real_kv_stuck`` (once; the same slot
flipped again after each forward that writes it), ``real_kv_unused_cache``, ``host_kv``;
:meth:`swap_next_tokens`: the token oracle sampler's ``after_sample`` hook. A fault fires with
its probability per step past ``warmup_steps``, up to ``max_faults``, and logs one ``kv_canary
perturb:`` line. Host-synchronising and destructive: self-tests and the demo only.
"""

from __future__ import annotations

import random
import weakref
from typing import Callable, Collection, Dict, List, Optional, Sequence

import torch

from sglang.jit_kernel.kv_canary.types import PoolKind, RealKvSource
from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.batch_state import batch_state
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.perturb.config import (
    LAST_LAYER,
    TARGET_HALF_VAR,
    TARGET_LAYER_VAR,
    FaultKind,
    PerturbConfig,
)
from sglang.srt.kv_canary.perturb.real_kv import flip_first_byte
from sglang.srt.kv_canary.perturb.report import log_perturbation
from sglang.srt.kv_canary.plan_input import host_prefix_extend
from sglang.srt.kv_canary.sglang_seam import ForwardMode

_MAX_TRIES = 64


class CanaryPerturber:
    """``req_to_token``: the runner's int32 ``[rows, max_context_len]`` table;
    ``radix_cache``: a callable returning the scheduler's tree cache (or None before it is
    attached); ``page_size``: the pool's (the kept ``req_to_token`` fault's unit);
    ``faked_transfer``: whether sglang faked a request's PD transfer (nothing received)."""

    def __init__(
        self,
        *,
        config: PerturbConfig,
        groups: Sequence[CanaryBufferGroup],
        req_to_token: torch.Tensor,
        radix_cache: Callable[[], object],
        draft: bool = False,
        page_size: int = 1,
        faked_transfer: Callable[[object], bool] = lambda req: False,
    ):
        if page_size < 1:
            raise ValueError(f"CanaryPerturber needs page_size >= 1, got {page_size}")
        self.config = config
        self.page_size = page_size
        self.draft = draft  # an EAGLE draft runner's (its DECODE forwards are draft rounds)
        self.req_to_token = req_to_token
        self._radix_cache = radix_cache
        self._faked_transfer = faked_transfer
        self.rng = random.Random(config.seed)
        self.step = 0
        self.injected: List[str] = []  # every line logged, in order
        self.restored = 0  # faults undone after the forward that read them
        # undo actions of this forward's before-forward faults, run by after_forward
        self._undo: List[Callable[[], None]] = []
        self.target: Optional[CanaryBufferGroup] = None
        if config.target_group is not None:
            matches = [g for g in groups if g.kind == config.target_group]
            if not matches:
                raise ValueError(
                    f"SGLANG_KV_CANARY_PERTURB_TARGET_GROUP={config.target_group.name.lower()} "
                    f"but this pool has only {', '.join(g.kind.name.lower() for g in groups)} "
                    "canary groups"
                )
            self.target = matches[0]
        # a pool whose only group is a sliding window's (an MTP draft model's): a forward reads
        # no position before the window, so a req_to_token fault lands inside it
        self._window_only = (
            groups[0].swa_window_size
            if groups and all(g.kind == PoolKind.SWA for g in groups)
            else None
        )
        self.flip_source, self.flip_layer = (
            self._resolve_flip_target() if self.target is not None else (None, None)
        )
        # pd_transfer: the requests a forward has already read (their received pages were
        # read once: a flip now would no longer be "before the first decode step"), by id,
        # each entry dropped with its request
        self._read_once: Dict[int, weakref.ref] = {}
        self.stuck_slot: Optional[int] = None  # real_kv_stuck's slot, once it fired

    def _resolve_flip_target(self):
        """The real-KV source (and its sglang layer id) a real-KV fault flips a byte of:
        ``SGLANG_KV_CANARY_PERTURB_TARGET_LAYER`` / ``_TARGET_HALF`` of the target group
        (default: layer 0's K row, the one ``--kv-canary-real-data-layers first`` guards).
        Refuses a layer or half the group's pool does not have."""
        cfg, group = self.config, self.target
        cols = group.layer_columns
        if cfg.targets_layer_0_k:  # the row the record's fingerprint covers (a pipeline
            # stage's first layer when it does not hold layer 0)
            return group.real_kv_sources_k[0], (cols[0].layer_id if cols else 0)
        layers = sorted({c.layer_id for c in cols})
        if not layers:
            raise ValueError(
                f"{TARGET_LAYER_VAR}={cfg.target_layer} / {TARGET_HALF_VAR}="
                f"{cfg.target_half.value}: the {group.kind.name.lower()} group of this pool has "
                "no per-layer rows to target; leave both unset (layer 0's K row)"
            )
        layer = layers[-1] if cfg.target_layer == LAST_LAYER else cfg.target_layer
        for col in cols:
            if col.layer_id == layer and col.half == cfg.target_half:
                return col.source, layer
        halves = sorted({c.half.value for c in cols})
        raise ValueError(
            f"{TARGET_LAYER_VAR}={cfg.target_layer}, {TARGET_HALF_VAR}={cfg.target_half.value}: "
            f"the {group.kind.name.lower()} group has layers {layers[0]}..{layers[-1]} "
            f"({', '.join(map(str, layers))}) and halves {', '.join(halves)}; allowed: one of "
            f"those layer ids or '{LAST_LAYER}', and one of those halves"
        )

    # ---- scheduling ------------------------------------------------------------------------

    def _fires(self, kind: FaultKind) -> bool:
        p = self.config.prob(kind)
        if p <= 0.0 or self.step <= self.config.warmup_steps:
            return False
        if self.config.max_faults and len(self.injected) >= self.config.max_faults:
            return False
        return self.rng.random() < p

    def _log(self, kind: FaultKind, **fields) -> None:
        self.injected.append(log_perturbation(kind, step=self.step, **fields))

    # ---- hooks -------------------------------------------------------------------------------

    def before_forward(
        self, forward_batch, *, step: int, lasting_rows: Callable[[], Collection[int]] = frozenset
    ) -> None:
        """``step``: the number of the forward about to run (1-based); ``lasting_rows``: the
        rows of the batch's requests that stay running past the next forward (the kept
        ``req_to_token`` fault picks only those: its report, a forward later, must find the
        request before sglang releases it)."""
        self.step = step
        if self._fires(FaultKind.REQ_TO_TOKEN):
            self._perturb_req_to_token(forward_batch, FaultKind.REQ_TO_TOKEN)
        if self._fires(FaultKind.REQ_TO_TOKEN_KEPT):
            if self.page_size > 1:
                self._perturb_req_to_token_page(forward_batch, rows=lasting_rows())
            else:
                self._perturb_req_to_token(
                    forward_batch, FaultKind.REQ_TO_TOKEN_KEPT, rows=lasting_rows()
                )
        if self._fires(FaultKind.REAL_KV_USED):
            self._perturb_real_kv_used(forward_batch)
        if self.config.prob(FaultKind.PD_TRANSFER) > 0:
            self._perturb_pd_transfer(forward_batch)

    def after_forward(self, forward_batch, *, step: int) -> None:
        """``step``: the number of the forward that just ran. First undoes this forward's
        before-forward faults (the forward has read them), then injects the after-forward
        ones."""
        self.step = step
        undo, self._undo = self._undo, []
        for action in undo:
            action()
            self.restored += 1
        if self._fires(FaultKind.REAL_KV_POST_FORWARD):
            self._perturb_real_kv_post_forward(forward_batch)
        if self.stuck_slot is not None or self.config.prob(FaultKind.REAL_KV_STUCK) > 0:
            self._perturb_real_kv_stuck(forward_batch)
        if self._fires(FaultKind.REAL_KV_UNUSED_CACHE):
            self._perturb_real_kv_unused_cache()
        if self._fires(FaultKind.HOST_KV):
            self._perturb_host_kv()

    def swap_next_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Swap two rows of the sampled tokens (rows whose tokens differ), in place."""
        if not self._fires(FaultKind.NEXT_TOKEN_SWAP) or next_token_ids.shape[0] < 2:
            return
        tokens = next_token_ids.tolist()
        for _ in range(_MAX_TRIES):
            i, j = self.rng.sample(range(len(tokens)), 2)
            if tokens[i] != tokens[j]:
                next_token_ids[i], next_token_ids[j] = tokens[j], tokens[i]
                self._log(
                    FaultKind.NEXT_TOKEN_SWAP,
                    row_a=i,
                    row_b=j,
                    old_a=tokens[i],
                    new_a=tokens[j],
                    old_b=tokens[j],
                    new_b=tokens[i],
                )
                return

    # ---- the faults --------------------------------------------------------------------------

    def _active_prefix(self, forward_batch):
        rows, prefix, _ = host_prefix_extend(forward_batch)
        live = [(r, n) for r, n in zip(rows, prefix) if n > 0]
        return live

    def _perturb_req_to_token(
        self, forward_batch, kind: FaultKind, rows: Optional[Collection[int]] = None
    ) -> None:
        """``rows``: the rows the rewritten entry may be in (None: any active one)."""
        live = self._active_prefix(forward_batch)
        targets = live if rows is None else [(r, n) for r, n in live if r in rows]
        if not targets:
            return
        written = set(forward_batch.out_cache_loc.tolist())
        r2t = self.req_to_token
        fallback = None
        for _ in range(_MAX_TRIES):
            row, n = self.rng.choice(targets)
            # never the seed position n - 1 when there is another: this forward's new KV
            # chains from that entry's record, which must stay the request's own
            lo = max(0, n - self._window_only) if self._window_only else 0
            pos = self.rng.randrange(lo, n - 1) if n - 1 > lo else n - 1
            donor_row, donor_n = self.rng.choice(live)
            donor_pos = self.rng.randrange(donor_n)
            old, new = int(r2t[row, pos]), int(r2t[donor_row, donor_pos])
            if new == old or new in written or new <= 0:
                continue
            if donor_pos == pos:  # a same-position swap: only the token check may see it
                fallback = fallback or (row, pos, donor_row, donor_pos, old, new)
                continue
            break
        else:
            if fallback is None:
                return
            row, pos, donor_row, donor_pos, old, new = fallback
        r2t[row, pos] = new
        if kind == FaultKind.REQ_TO_TOKEN:
            self._undo.append(lambda: r2t.__setitem__((row, pos), old))
        self._log(
            kind,
            req_pool_idx=row,
            position=pos,
            old_slot=old,
            new_slot=new,
            donor_req_pool_idx=donor_row,
            donor_position=donor_pos,
        )

    def _perturb_req_to_token_page(self, forward_batch, rows: Collection[int]) -> None:
        """The kept fault at page size > 1: every entry of one full page of a lasting row
        (never the page of its seed position ``n - 1``) is pointed at the same offsets of
        another active request's full page (never one written this forward), and left."""
        ps = self.page_size
        live = self._active_prefix(forward_batch)
        # pages wholly before the page holding the seed position n - 1
        targets = [(r, (n - 1) // ps) for r, n in live if r in rows and (n - 1) // ps > 0]
        donors = [(r, n // ps) for r, n in live if n // ps > 0]
        if not targets or not donors:
            return
        written = {s // ps for s in forward_batch.out_cache_loc.tolist()}
        r2t = self.req_to_token
        fallback = None
        for _ in range(_MAX_TRIES):
            row, pages = self.rng.choice(targets)
            donor_row, donor_pages = self.rng.choice(donors)
            page, donor_page = self.rng.randrange(pages), self.rng.randrange(donor_pages)
            old = int(r2t[row, page * ps]) // ps
            new = int(r2t[donor_row, donor_page * ps]) // ps
            if new == old or new in written or new <= 0:
                continue
            if donor_page == page:  # same positions: only the token check may see it
                fallback = fallback or (row, page, donor_row, donor_page, old, new)
                continue
            break
        else:
            if fallback is None:
                return
            row, page, donor_row, donor_page, old, new = fallback
        span = slice(page * ps, (page + 1) * ps)
        r2t[row, span] = r2t[donor_row, donor_page * ps : (donor_page + 1) * ps].clone()
        self._log(
            FaultKind.REQ_TO_TOKEN_KEPT,
            req_pool_idx=row,
            position=page * ps,
            old_slot=old * ps,
            new_slot=new * ps,
            donor_req_pool_idx=donor_row,
            donor_position=donor_page * ps,
            entries=ps,
        )

    def _target_slot(self, full_slot: int) -> int:
        """The target group's slot for a FULL slot (0 = evicted from the SWA pool)."""
        if self.target.kind == PoolKind.SWA:
            return int(self.target.swa_index_lut[full_slot])
        return full_slot

    def _flip(
        self, kind: FaultKind, full_slot: int, *, undo_after_forward: bool = False, **fields
    ) -> bool:
        slot = self._target_slot(full_slot)
        if slot <= 0:
            return False
        source = self.flip_source
        byte, mask = self.config.flip.byte_and_mask
        flip = flip_first_byte(source, slot, mask=mask, byte=byte)
        if undo_after_forward:  # flipping the same byte again restores it
            self._undo.append(lambda: flip_first_byte(source, slot, mask=mask, byte=byte))
        self._log(
            kind,
            group=self.target.kind.name.lower(),
            layer=self.flip_layer,
            half=self.config.target_half.value,
            slot=slot,
            full_slot=full_slot,
            row=flip.row,
            byte=flip.byte,
            old=f"0x{flip.old:02x}",
            new=f"0x{flip.new:02x}",
            **fields,
        )
        return True

    def _perturb_real_kv_used(self, forward_batch) -> None:
        live = self._active_prefix(forward_batch)
        window = self.target.swa_window_size
        for _ in range(_MAX_TRIES if live else 0):
            row, n = self.rng.choice(live)
            lo = max(0, n - window) if window else 0
            pos = self.rng.randrange(lo, n)
            if self._flip(
                FaultKind.REAL_KV_USED,
                int(self.req_to_token[row, pos]),
                undo_after_forward=True,
                req_pool_idx=row,
                position=pos,
            ):
                return

    def _perturb_pd_transfer(self, forward_batch) -> None:
        """A PD decode server (start-up refuses the fault elsewhere): flip a byte of a page
        received for a request this forward reads for the first time (its prefix came from
        the prefill server; nothing has read it here yet), so the forward's verify is the
        first read of the corrupted page. Requests whose transfer sglang faked (nothing was
        received) are left alone. Every request of the batch counts as read afterwards."""
        requests = batch_state(forward_batch).requests
        if requests is None:
            return
        read = self._read_once
        fresh = [
            (req, row)
            for req, row in zip(requests.reqs, requests.rows)
            if row is not None and id(req) not in read and not self._faked_transfer(req)
        ]
        for req in requests.reqs:
            if id(req) not in read:
                read[id(req)] = weakref.ref(req, lambda _, key=id(req): read.pop(key, None))
        if not fresh or not self._fires(FaultKind.PD_TRANSFER):
            return
        prefix = dict(self._active_prefix(forward_batch))
        fresh = [(req, row) for req, row in fresh if prefix.get(row, 0) > 0]
        for _ in range(_MAX_TRIES if fresh else 0):
            req, row = self.rng.choice(fresh)
            pos = self.rng.randrange(prefix[row])
            if self._flip(
                FaultKind.PD_TRANSFER,
                int(self.req_to_token[row, pos]),
                undo_after_forward=True,
                req_pool_idx=row,
                position=pos,
                rid=sglang_seam.req_rid(req),
            ):
                return

    def _perturb_real_kv_post_forward(self, forward_batch) -> None:
        written = forward_batch.out_cache_loc.tolist()
        mode = forward_batch.forward_mode
        if self.draft and mode == ForwardMode.DECODE:
            return  # a draft round's slots: rewritten by the draft extend, never read as they are
        if self.draft and mode == ForwardMode.TARGET_VERIFY:
            # DFLASH's draft block (a draft runner's only verify-mode forward): its slots are
            # borrowed for the block, then rewritten by the verify's draft KV append
            return
        if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
            # a fixed number of tokens per request, of which only the first is always kept
            per_req = len(written) // max(1, forward_batch.req_pool_indices.shape[0])
            written = written[:: max(1, per_req)]
        candidates = [s for s in written if s > 0]
        for _ in range(_MAX_TRIES if candidates else 0):
            if self._flip(FaultKind.REAL_KV_POST_FORWARD, self.rng.choice(candidates)):
                return

    def _perturb_real_kv_stuck(self, forward_batch) -> None:
        """A stuck bit: once it fires, a slot this forward wrote is flipped; from then on the
        same slot is flipped again after every forward that writes it (each logged, with
        ``repeat=1`` after the first)."""
        written = forward_batch.out_cache_loc.tolist()
        if self.stuck_slot is not None:
            if self.stuck_slot in written:
                self._flip(FaultKind.REAL_KV_STUCK, self.stuck_slot, repeat=1)
            return
        candidates = [s for s in written if s > 0]
        if candidates and self._fires(FaultKind.REAL_KV_STUCK):
            slot = self.rng.choice(candidates)
            if self._flip(FaultKind.REAL_KV_STUCK, slot, repeat=0):
                self.stuck_slot = slot

    def _perturb_real_kv_unused_cache(self) -> None:
        from sglang.srt.kv_canary.radix_cache_walker import walk_radix_cache_for_canary

        cache = self._radix_cache()
        if cache is None:
            return
        walk = walk_radix_cache_for_canary(
            radix_cache=cache,
            unlocked_only=True,
            swa_resident_only=self.target.kind == PoolKind.SWA,
        )
        slots = [s for s in walk.slot_indices.tolist() if s > 0]
        for _ in range(_MAX_TRIES if slots else 0):
            if self._flip(FaultKind.REAL_KV_UNUSED_CACHE, self.rng.choice(slots)):
                return

    def _perturb_host_kv(self) -> None:
        """Flip the first byte of the target row of a token HiCache holds in host memory only
        (evicted from the device: the next prefix hit loads it back), in the host pool's own
        buffer: in the first half of such a node nearest the root (the prefixes requests
        reuse; the tail of a node, e.g. a finished request's outputs, may never be loaded
        again). No such token yet: nothing this step (the fault fires on a later one)."""
        cache = self._radix_cache()
        host_pool = sglang_seam.hicache_host_pool(cache) if cache is not None else None
        if host_pool is None:
            return
        from sglang.srt.kv_canary.radix_cache_walker import host_resident_nodes

        host_only = host_resident_nodes(cache, host_only=True)
        if not host_only:
            return
        top = min(depth for _, depth in host_only)
        host, depth = self.rng.choice([e for e in host_only if e[1] == top])
        offset = self.rng.randrange(max(1, host.numel() // 2))
        index = int(host[offset])
        layers = sorted({c.layer_id for c in self.target.layer_columns}) or [self.flip_layer]
        rows, page_size = sglang_seam.host_pool_layer_rows(
            host_pool, layers.index(self.flip_layer), self.config.target_half.value
        )
        row_bytes = rows[0].nbytes // page_size
        flip = flip_first_byte(
            RealKvSource(
                tensor=rows,
                page_size=page_size,
                num_bytes_per_token=row_bytes,
                read_bytes=row_bytes,
            ),
            index,
        )
        self._log(
            FaultKind.HOST_KV,
            group=self.target.kind.name.lower(),
            layer=self.flip_layer,
            half=self.config.target_half.value,
            host_index=index,
            position=depth + offset,
            old=f"0x{flip.old:02x}",
            new=f"0x{flip.new:02x}",
        )
