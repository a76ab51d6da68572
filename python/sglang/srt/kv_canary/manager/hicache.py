"""HiCache: the canary rows follow their KV pages to host memory and back (docs/subsystems.md,
"HiCache").

:class:`HostTierMirror` keeps one host row per host-pool slot for each canary buffer of each
group and copies them with sglang's own copies (it wraps the host pool's two copy methods):
after each device → host backup and before the first layer of each host → device load, same
indices, same stream (:func:`~sglang.jit_kernel.kv_canary.rows.launch_copy_rows`). Readers
wait: the forward's canary work for the first loaded layer (``hicache_wait_for_first_layer``),
the sweep for every queued load (``hicache_wait_for_loads``). Not graph code: the copies run on
HiCache's write / load streams, outside CUDA graphs.
"""

from __future__ import annotations

import logging
from typing import List, Sequence, Tuple

import torch

from sglang.jit_kernel.kv_canary._hash_torch import real_kv_fingerprint_t
from sglang.jit_kernel.kv_canary.consts import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    HOST_TIER_ROW,
    NO_EXPECTED_TOKEN,
    NO_KV_LAYER,
    FailReason,
    RealKvHashMode,
)
from sglang.jit_kernel.kv_canary.rows import launch_copy_rows
from sglang.jit_kernel.kv_canary.types import (
    CanaryLaunchTag,
    CanaryPhase,
    KvHalf,
    PoolKind,
    RealKvSource,
)
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.radix_cache_walker import host_resident_nodes
from sglang.srt.kv_canary.violations.records import (
    ViolationIncident,
    ViolationRecord,
    merge_incidents,
)

logger = logging.getLogger(__name__)


class HostTierMirror:
    """Host rows of every canary buffer of ``groups`` for a HiCache host pool (FULL groups:
    sglang's HiCache builds its host pool for MHA and MLA pools). Host rows are pinned on
    CUDA (the copy kernel reaches them through unified addressing) and plain on the CPU.
    Wraps the host pool's copy methods on construction."""

    def __init__(
        self,
        *,
        groups: Sequence[CanaryBufferGroup],
        host_pool,
        real_kv_hash_mode: RealKvHashMode = RealKvHashMode.NONE,
        sweep_pages: int = 0,
    ):
        kind = seam.host_pool_kind(host_pool)  # raises for a host pool it cannot mirror
        odd = [g.kind.name for g in groups if g.kind != PoolKind.FULL]
        if odd:
            raise NotImplementedError(
                f"kv_canary mirrors HiCache host rows of FULL groups only, got {odd}: run "
                "without --enable-hierarchical-cache or without --kv-canary"
            )
        self.host_pool = host_pool
        self.kind = kind
        self.host_slots = seam.host_pool_size(host_pool)
        self.pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (device rows, host rows)
        self.tails: List[Tuple[KvHalf, torch.Tensor]] = []  # host rows of the TAIL records
        for group in groups:
            self.tails.append((KvHalf.K, len(self.pairs) + 1))
            if group.v_tail is not None:
                self.tails.append((KvHalf.V, len(self.pairs) + 3))
            bufs = [
                b.view(torch.int64)
                for b in (group.k_head, group.k_tail, group.v_head, group.v_tail)
                if b is not None
            ]
            if group.deep is not None:
                bufs.append(group.deep.table)
            for rows in bufs:
                pin = rows.device.type == "cuda"
                host = torch.zeros(
                    (self.host_slots, rows.shape[1]), dtype=torch.int64, pin_memory=pin
                )
                self.pairs.append((rows, host))
        self.tails = [(half, self.pairs[i][1]) for half, i in self.tails]
        self.bytes_per_host_slot = sum(h.shape[1] * 8 for _, h in self.pairs)
        self.mode = RealKvHashMode(real_kv_hash_mode)
        self.sweep_pages = int(sweep_pages)
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        self.host_sources = (
            self._host_sources(groups[0])
            if self.sweep_pages > 0 and self.mode != RealKvHashMode.NONE
            else None
        )
        self.sweep_cursor = 0  # round robin over the host-resident tokens
        self.swept_slots = 0
        self.backed_up_slots = 0  # host slots written by backups so far
        self.loaded_slots = 0  # device slots filled by loads so far
        seam.wrap_host_pool_copies(host_pool, after_backup=self.backup, before_load=self.load)
        logger.info(
            "kv_canary: HiCache host tier mirrored (%s host pool, %d host slots, %d "
            "canary bytes per slot: %.1f MB of host memory)",
            kind,
            self.host_slots,
            self.bytes_per_host_slot,
            self.host_slots * self.bytes_per_host_slot / 1e6,
        )

    def backup(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """After sglang copied the KV of ``device_indices`` to ``host_indices``: the rows."""
        for rows, host in self.pairs:
            launch_copy_rows(
                src=rows, dst=host, src_indices=device_indices, dst_indices=host_indices
            )
        self.backed_up_slots += int(host_indices.shape[0])

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Before sglang loads the KV of ``host_indices`` into ``device_indices``: the rows."""
        for rows, host in self.pairs:
            launch_copy_rows(
                src=host, dst=rows, src_indices=host_indices, dst_indices=device_indices
            )
        self.loaded_slots += int(device_indices.shape[0])

    def host_rows(self, index: int) -> torch.Tensor:
        """The host copy of canary buffer ``index`` (in the order above; tests, self-tests)."""
        return self.pairs[index][1]

    # ---- the host-tier sweep -----------------------------------------------------------------

    def _host_sources(self, group: CanaryBufferGroup):
        """Per half, the host rows that mirror the group's real-KV sources (layer 0's row:
        the first per-layer column's; refuses pools whose record fingerprints more)."""
        out = {}
        for half, device_sources in (
            (KvHalf.K, group.real_kv_sources_k),
            (KvHalf.V, group.real_kv_sources_v),
        ):
            if half == KvHalf.V and group.v_tail is None:
                continue
            if len(device_sources) != 1:
                raise NotImplementedError(
                    f"kv_canary's host-tier sweep covers pools whose record fingerprints one "
                    f"row per half; this {self.kind} pool's {half.value} record folds "
                    f"{len(device_sources)}: set SGLANG_KV_CANARY_HOST_SWEEP_PAGES=0"
                )
            rows, page_size = seam.host_pool_layer_rows(self.host_pool, 0, half.value)
            row_bytes = rows[0].nbytes // page_size
            out[half] = RealKvSource(
                tensor=rows,
                page_size=page_size,
                num_bytes_per_token=row_bytes,
                read_bytes=row_bytes,
            )
        return out

    def sweep(self, radix_cache) -> List[ViolationIncident]:
        """Check the real-KV fingerprint of up to ``sweep_pages`` pages of host-resident
        tokens (round robin over the tree's host copies, skipping backups still in flight)
        against their mirrored TAIL records, on the CPU. Returns the incidents (tag SWEEP_*,
        slot = the host-pool index, ``req_to_token_row`` = ``HOST_TIER_ROW``, read position =
        the token's depth). Host-synchronising (CUDA: waits for queued transfers first);
        after a forward, outside any graph."""
        if self.host_sources is None:
            return []
        seam.hicache_wait_for_loads(radix_cache)
        nodes = host_resident_nodes(radix_cache)
        chunks = [host.to("cpu", torch.int64) for host, _ in nodes]
        depths = [torch.arange(d, d + host.numel(), dtype=torch.int64) for host, d in nodes]
        if not chunks:
            return []
        if any(rows.is_cuda for rows, _ in self.pairs):
            torch.cuda.synchronize()  # backups queued before this sweep have landed
        slots, positions = torch.cat(chunks), torch.cat(depths)
        total = slots.numel()
        take = min(total, self.sweep_pages * self.page_size)
        pick = (torch.arange(take) + self.sweep_cursor) % total
        self.sweep_cursor = int((self.sweep_cursor + take) % total)
        slots, positions = slots[pick], positions[pick]
        self.swept_slots += take
        records = []
        for half, tail in self.tails:
            source = self.host_sources[half]
            fp = real_kv_fingerprint_t((source,), (source.words_to_fold(self.mode),), slots)
            rec = tail[slots]
            bad = (rec[:, CANARY_FIELD_REAL_KV_HASH] != fp).nonzero().flatten().tolist()
            tag = CanaryLaunchTag.of(CanaryPhase.SWEEP, half, PoolKind.FULL)
            for i in bad:
                prev = int(rec[i, CANARY_FIELD_PREV_HASH])
                records.append(
                    ViolationRecord(
                        launch_tag=int(tag),
                        slot_idx=int(slots[i]),
                        position=int(rec[i, CANARY_FIELD_POSITION]),
                        stored_token=int(rec[i, CANARY_FIELD_TOKEN]),
                        expected_token=NO_EXPECTED_TOKEN,
                        stored_chain_hash=prev,
                        expected_aux=prev,
                        fail_bits=int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH),
                        read_position=int(positions[i]),
                        req_to_token_row=HOST_TIER_ROW,
                        kv_layer=NO_KV_LAYER,
                    )
                )
        return merge_incidents(records)
