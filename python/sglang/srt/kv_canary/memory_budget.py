"""The canary's share of the KV pool's budget (docs/user_guide.md, "Memory").

sglang's ``ModelRunner._profile_available_bytes`` returns the bytes the KV pool may fill under
``--mem-fraction-static``; the plugin's hook hands them to :func:`reserve_canary_memory`,
which returns the largest KV budget whose pool, plus the canary that pool will carry (the
target runner's and, with speculative decoding, the draft runner's), fits in them. The server then keeps the
GPU memory ``--mem-fraction-static`` gives it; its pool holds fewer tokens instead. Start-up
only; not graph-related.

The canary's bytes come from :class:`~sglang.srt.kv_canary.memory.CanaryMemory` on the groups
the adapters will build for that pool (:func:`predicted_groups`); ``install_canary`` compares
what was then allocated with what was reserved here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from sglang.jit_kernel.kv_canary.types import PoolKind
from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.builder import memory_inputs
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs, CanaryLaunchCapacities
from sglang.srt.kv_canary.config import CanaryConfig, RealDataLayers
from sglang.srt.kv_canary.memory import CanaryMemory, GroupGeometry
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.kv_canary.sglang_seam import KvPoolSizing, PoolFamily, PoolTokens

if TYPE_CHECKING:
    from sglang.srt.kv_canary.sglang_seam import ModelRunner, ServerArgs

# the full-to-SWA slot table sglang's SWA allocator builds is int64
_SWA_TABLE_ITEMSIZE = 8
# an EAGLE / EAGLE3 head and a NEXTN module are one layer (per-layer fingerprint columns)
_DRAFT_LAYERS = 1


@dataclasses.dataclass(frozen=True)
class CanaryMemoryReservation:
    """What :func:`reserve_canary_memory` took: ``profiled_bytes`` (sglang's budget for the
    pool), ``kv_bytes`` (what it left the pool), the pool it sized (``tokens``) and the canary
    memory predicted for it (``target``; ``draft`` with speculative decoding, else None)."""

    profiled_bytes: int
    kv_bytes: int
    tokens: PoolTokens
    target: CanaryMemory
    draft: Optional[CanaryMemory] = None

    @property
    def reserved_bytes(self) -> int:
        return self.profiled_bytes - self.kv_bytes

    def for_runner(self, *, draft: bool) -> Optional[CanaryMemory]:
        return self.draft if draft else self.target

    def as_dict(self) -> Dict[str, int]:
        return {
            "profiled_kv_bytes": self.profiled_bytes,
            "kv_bytes": self.kv_bytes,
            "reserved_bytes": self.reserved_bytes,
            "max_total_num_tokens": self.tokens.max_total,
        }


@dataclasses.dataclass(frozen=True)
class DraftPool:
    """The draft runner's KV pool as the target's profile predicts it (it has the target's
    token counts and page size): its ``family`` and attention ``layers`` (``swa_layers``: an
    SWA pool's sliding-window ones)."""

    family: PoolFamily
    layers: int
    swa_layers: int = 0

    @classmethod
    def for_server(
        cls, sizing: KvPoolSizing, server_args: "ServerArgs", algorithm: Optional[str]
    ) -> Optional["DraftPool"]:
        """None without speculative decoding. EAGLE / EAGLE3 / NEXTN: a one-layer head, MLA
        and DeepSeek-V4 in their target's family, MHA otherwise. STANDALONE: the separate
        draft model's own pool (:func:`~sglang.srt.kv_canary.sglang_seam.draft_model_shape`);
        ``ValueError`` naming ``--speculative-draft-model-path`` when its config cannot be
        read, or when it has sliding-window layers and the target none (sglang sizes the
        draft's pool from the target's, which then has no sliding-window slot space)."""
        if algorithm is None:
            return None
        if algorithm == "STANDALONE":
            shape = sglang_seam.draft_model_shape(server_args)
            if shape.family == PoolFamily.SWA and sizing.family not in (
                PoolFamily.SWA,
                PoolFamily.DSV4,
            ):
                raise ValueError(_sliding_window_draft_refusal(server_args, shape))
            return cls(shape.family, shape.layers, shape.swa_layers)
        family = (
            sizing.family if sizing.family in (PoolFamily.MLA, PoolFamily.DSV4) else PoolFamily.MHA
        )
        return cls(family, _DRAFT_LAYERS)


def _sliding_window_draft_refusal(server_args, shape) -> str:
    """Why a STANDALONE draft with sliding-window layers cannot run behind a target without
    them, naming both models."""
    draft = getattr(server_args, "speculative_draft_model_path", None) or server_args.model_path
    return (
        f"--speculative-draft-model-path {draft!r} has sliding-window attention layers "
        f"({shape.swa_layers} of {shape.swa_layers + shape.layers}) but the target "
        f"(--model-path {server_args.model_path!r}) has none: sglang 0.5.12 sizes a "
        "STANDALONE draft's KV pool from the target's pool sizes and shares the target's "
        "token allocator, neither of which has a sliding-window part for such a target, so "
        "it cannot build this draft's pool (with or without --kv-canary); use a draft model "
        "without sliding-window layers, or a target with them"
    )


def predicted_groups(
    *,
    family: PoolFamily,
    tokens: PoolTokens,
    page_size: int,
    config: CanaryConfig,
    layers: int,
    swa_layers: int = 0,
) -> Tuple[GroupGeometry, ...]:
    """The groups the adapters build for a pool of ``family`` holding ``tokens`` (each slot
    space has one page more than its tokens: sglang's padding page)."""
    deep = config.real_data_layers == RealDataLayers.ALL
    halves = 2 if config.enable_mha_v and family in (PoolFamily.MHA, PoolFamily.SWA) else 1
    full_slots = tokens.max_total + page_size
    if family == PoolFamily.MLA:
        return (GroupGeometry(PoolKind.FULL, full_slots, 1, layers if deep else 0),)
    if family == PoolFamily.MHA:
        return (GroupGeometry(PoolKind.FULL, full_slots, halves, 2 * layers if deep else 0),)
    if tokens.swa_total is None:
        raise ValueError(
            f"kv_canary: a {family.value} pool has an SWA slot space, but sglang's "
            "sizing gave it none"
        )
    swa_slots = tokens.swa_total + page_size
    if family == PoolFamily.SWA:
        return (
            GroupGeometry(PoolKind.FULL, full_slots, halves, 2 * layers if deep else 0),
            GroupGeometry(
                PoolKind.SWA,
                swa_slots,
                halves,
                2 * swa_layers if deep else 0,
                swa_lut_itemsize=_SWA_TABLE_ITEMSIZE,
            ),
        )
    # DeepSeek-V4: no V records, no per-layer columns (docs/architecture.md)
    return (
        GroupGeometry(PoolKind.FULL, full_slots, 1, 0),
        GroupGeometry(PoolKind.SWA, swa_slots, 1, 0, swa_lut_itemsize=_SWA_TABLE_ITEMSIZE),
    )


def _runner_memory(
    *,
    groups,
    config: CanaryConfig,
    rows_cols: Tuple[int, int],
    capacity_inputs: CanaryCapacityInputs,
    sfms: int,
    device,
) -> CanaryMemory:
    capacities = CanaryLaunchCapacities.for_server(
        num_slots=groups[0].slots, req_to_token_rows=rows_cols[0], inputs=capacity_inputs
    )
    return CanaryMemory.for_inputs(
        memory_inputs(
            config=config,
            groups=groups,
            capacities=capacities,
            req_to_token_shape=rows_cols,
            num_single_forward_managers=sfms,
            device=device,
        )
    )


def predicted_memory(
    sizing: KvPoolSizing,
    tokens: PoolTokens,
    *,
    config: CanaryConfig,
    capacity_inputs: CanaryCapacityInputs,
    draft: Optional[RankFacts],
    device,
    draft_pool: Optional[DraftPool] = None,
) -> Tuple[CanaryMemory, Optional[CanaryMemory]]:
    """The target runner's canary memory for a pool of ``tokens`` and, when ``draft`` (the
    draft runner's facts) is given, the draft runner's, on ``draft_pool`` (its pool has the
    target's token counts; default: an EAGLE head, :meth:`DraftPool.for_server`)."""
    rows_cols = sizing.req_to_token_shape(tokens)
    target = _runner_memory(
        groups=predicted_groups(
            family=sizing.family,
            tokens=tokens,
            page_size=sizing.page_size,
            config=config,
            layers=sizing.layers,
            swa_layers=sizing.swa_layers,
        ),
        config=config,
        rows_cols=rows_cols,
        capacity_inputs=capacity_inputs,
        sfms=1,
        device=device,
    )
    if draft is None:
        return target, None
    if draft_pool is None:
        draft_pool = DraftPool.for_server(sizing, None, "EAGLE")
    draft_memory = _runner_memory(
        groups=predicted_groups(
            family=draft_pool.family,
            tokens=tokens,
            page_size=sizing.page_size,
            config=config,
            layers=draft_pool.layers,
            swa_layers=draft_pool.swa_layers,
        ),
        config=config,
        rows_cols=rows_cols,
        capacity_inputs=capacity_inputs,
        sfms=draft.single_forward_managers,
        device=device,
    )
    return target, draft_memory


def reserve_canary_memory(
    model_runner: "ModelRunner",
    *,
    server_args: "ServerArgs",
    config: CanaryConfig,
    capacity_inputs: CanaryCapacityInputs,
    available_bytes: int,
) -> Tuple[int, Optional[CanaryMemoryReservation]]:
    """The KV budget left after the canary's share of ``available_bytes`` (sglang's profile
    for the pool), and the reservation (None when sglang found no room for any pool: its own
    "Not enough memory" error follows). Raises ``RuntimeError`` naming
    ``--mem-fraction-static`` when a pool fits but not with its canary."""
    sizing = KvPoolSizing(model_runner)
    spec = sglang_seam.speculative_facts(server_args)
    # the draft runner as install_canary will describe it (its single-forward managers)
    draft = (
        RankFacts(draft=True, draft_steps=spec.max_steps) if spec.algorithm is not None else None
    )
    draft_pool = DraftPool.for_server(sizing, server_args, spec.algorithm)
    device = sizing.device

    def canary(kv_bytes: int):
        tokens = sizing.tokens_for(kv_bytes)
        if tokens is None:
            return None, None
        memories = predicted_memory(
            sizing,
            tokens,
            config=config,
            capacity_inputs=capacity_inputs,
            draft=draft,
            device=device,
            draft_pool=draft_pool,
        )
        return tokens, memories

    def total(memories) -> int:
        return sum(m.device_bytes for m in memories if m is not None)

    if sizing.tokens_for(available_bytes) is None:
        return available_bytes, None
    # the largest KV budget b with b + canary(pool of b) <= available_bytes (both grow with b)
    lo, hi = 0, int(available_bytes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        tokens, memories = canary(mid)
        if tokens is not None and mid + total(memories) <= available_bytes:
            lo = mid
        else:
            hi = mid - 1
    tokens, memories = canary(lo)
    if tokens is None:
        _, unshrunk = canary(available_bytes)
        raise RuntimeError(
            f"kv_canary: the KV pool's budget under --mem-fraction-static "
            f"({available_bytes / (1 << 20):.1f} MiB) cannot hold a pool and its canary (that "
            f"pool's canary would take {total(unshrunk) / (1 << 20):.1f} MiB): raise "
            "--mem-fraction-static, lower --max-running-requests or the context length, or "
            "run without --kv-canary"
        )
    return lo, CanaryMemoryReservation(
        profiled_bytes=int(available_bytes),
        kv_bytes=lo,
        tokens=tokens,
        target=memories[0],
        draft=memories[1],
    )
