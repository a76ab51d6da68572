"""The canary's share of the KV pool's budget, and the KV and HiCache host budgets the plugin's
hooks ask for (:func:`reserve_kv_budget`, :func:`host_pool_budget`; docs/user_guide.md,
"Memory").

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
import logging
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from sglang.jit_kernel.kv_canary.types import PoolKind
from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.builder import memory_inputs
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs, CanaryLaunchCapacities
from sglang.srt.kv_canary.config import CanaryConfig, RealDataLayers
from sglang.srt.kv_canary.memory import CanaryMemory, GroupGeometry, format_bytes
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.kv_canary.sglang_seam import KvPoolSizing, PoolFamily, PoolTokens
from sglang.srt.kv_canary.startup_checks import check_server_args_for_canary

if TYPE_CHECKING:
    from sglang.srt.kv_canary.sglang_seam import ModelRunner, ServerArgs

logger = logging.getLogger(__name__)

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
        """None without speculative decoding (``algorithm`` None; the caller passes only an
        algorithm with a draft KV pool: ``SpeculativeFacts.has_draft_pool``). EAGLE / EAGLE3 /
        NEXTN: a one-layer head, MLA and DeepSeek-V4 in their target's family, MHA otherwise;
        multi-layer EAGLE on a hybrid-SWA target: one sliding-window layer in an SWA pool.
        STANDALONE and DFLASH (whose ``DFlashDraftModel`` has ``num_hidden_layers`` layers):
        the separate draft model's own pool (:func:`~sglang.srt.kv_canary.sglang_seam.draft_model_shape`);
        ``ValueError`` naming ``--speculative-draft-model-path`` when its config cannot be
        read, or when it has sliding-window layers and the target none (sglang sizes the
        draft's pool from the target's, which then has no sliding-window slot space)."""
        if algorithm is None:
            return None
        if algorithm in ("STANDALONE", "DFLASH"):
            shape = sglang_seam.draft_model_shape(server_args)
            if shape.family == PoolFamily.SWA and sizing.family not in (
                PoolFamily.SWA,
                PoolFamily.DSV4,
            ):
                raise ValueError(_sliding_window_draft_refusal(server_args, shape))
            return cls(shape.family, shape.layers, shape.swa_layers)
        if sglang_seam.speculative_facts(server_args).multi_layer_eagle and (
            sizing.family == PoolFamily.SWA
        ):
            # multi-layer EAGLE's MTP draft runners (MiMoV2MTP, Step3p5MTP): sglang gives each
            # a one-layer SWAKVPool whose one layer is sliding-window (no full one); the canary
            # is built on layer 0's (install._share_mtp_layer_0_canary)
            return cls(PoolFamily.SWA, 0, _DRAFT_LAYERS)
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
    if family == PoolFamily.SWA:  # a sub-pool without layers gets no group (attach_swa)
        full = GroupGeometry(PoolKind.FULL, full_slots, halves, 2 * layers if deep else 0)
        swa = GroupGeometry(
            PoolKind.SWA,
            swa_slots,
            halves,
            2 * swa_layers if deep else 0,
            swa_lut_itemsize=_SWA_TABLE_ITEMSIZE,
        )
        return tuple(g for g, n in ((full, layers), (swa, swa_layers)) if n > 0)
    # DeepSeek-V4: no V records, no per-layer columns (docs/subsystems.md, "Per-layer fingerprints")
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
    ranks: RankFacts,
    device,
) -> CanaryMemory:
    capacities = CanaryLaunchCapacities.for_server(
        num_slots=groups[0].slots,
        req_to_token_rows=rows_cols[0],
        inputs=capacity_inputs,
        rows_per_request=ranks.plan_rows_per_request,
    )
    return CanaryMemory.for_inputs(
        memory_inputs(
            config=config,
            groups=groups,
            capacities=capacities,
            req_to_token_shape=rows_cols,
            ranks=ranks,
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
    target: Optional[RankFacts] = None,
    draft_config: Optional[CanaryConfig] = None,
) -> Tuple[CanaryMemory, Optional[CanaryMemory]]:
    """The target runner's canary memory for a pool of ``tokens`` (``target``: its facts,
    default a single rank) and, when ``draft`` (the draft runner's facts) is given, the draft
    runner's, on ``draft_pool`` (its pool has the target's token counts; default: an EAGLE
    head, :meth:`DraftPool.for_server`), built with ``draft_config`` (default ``config``:
    :meth:`CanaryConfig.for_draft`)."""
    draft_config = config if draft_config is None else draft_config
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
        ranks=target or RankFacts(),
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
            config=draft_config,
            layers=draft_pool.layers,
            swa_layers=draft_pool.swa_layers,
        ),
        config=draft_config,
        rows_cols=rows_cols,
        capacity_inputs=capacity_inputs,
        ranks=draft,
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
    trees = dict(topk=spec.topk, verify_tree_depth=spec.verify_tree_depth, page_size=spec.page_size)
    draft = (
        RankFacts(
            draft=True, draft_steps=spec.max_steps, **RankFacts.tree_fields(**trees, draft=True)
        )
        if spec.has_draft_pool
        else None
    )
    target = RankFacts(**RankFacts.tree_fields(**trees, draft=False))
    draft_pool = DraftPool.for_server(
        sizing, server_args, spec.algorithm if spec.has_draft_pool else None
    )
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
            target=target,
            draft_config=config.for_draft(
                token_checks=spec.draft_token_checks,
                write_input_check=spec.draft_write_input_check,
            ),
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


def capacity_inputs_from_server_args(
    server_args: "ServerArgs", *, context_len: int
) -> CanaryCapacityInputs:
    value = sglang_seam.server_args_value
    spec = sglang_seam.speculative_facts(server_args)
    return CanaryCapacityInputs(
        context_len=context_len,
        chunked_prefill_size=value(server_args, "chunked_prefill_size", None),
        max_prefill_tokens=int(value(server_args, "max_prefill_tokens", 0) or 0),
        cuda_graph_max_bs=value(server_args, "cuda_graph_max_bs", None),
        verify_tokens_per_request=max(spec.num_draft_tokens, 1) if spec.algorithm else 1,
    )


def reserve_kv_budget(
    *, server_args: "ServerArgs", model_runner: "ModelRunner", available_bytes: int
) -> int:
    """The plugin's ``ModelRunner._profile_available_bytes`` hook: with the canary on, the
    KV pool's budget less the canary's share (docs/user_guide.md, "Memory"), the reservation
    kept for ``install_canary``'s check and ``/server_info``; ``available_bytes`` untouched
    with the canary off."""
    config = check_server_args_for_canary(server_args)
    if not config.enabled:
        return available_bytes
    kv_bytes, reservation = reserve_canary_memory(
        model_runner,
        server_args=server_args,
        config=config,
        capacity_inputs=capacity_inputs_from_server_args(
            server_args, context_len=sglang_seam.runner_context_len(model_runner)
        ),
        available_bytes=available_bytes,
    )
    sglang_seam.set_runner_memory_reservation(model_runner, reservation)
    if reservation is not None:
        logger.info(
            "kv_canary: %s of the KV pool's %s budget reserved for the canary (target: %s%s); "
            "the pool holds %d tokens",
            format_bytes(reservation.reserved_bytes),
            format_bytes(available_bytes),
            reservation.target.describe(),
            f"; draft: {reservation.draft.describe()}" if reservation.draft else "",
            reservation.tokens.max_total,
        )
    return kv_bytes


def host_pool_budget(
    *,
    device_pool,
    host_pool_cls: type,
    host_to_device_ratio: float,
    host_size: float,
    draft: bool = False,
) -> Tuple[float, float]:
    """The plugin's ``HostKVCache.__init__`` hook: ``(host_to_device_ratio, host_size)`` for
    a HiCache host pool of ``device_pool`` such that its KV plus the canary's mirror of its
    slots take the host memory the operator's ``--hicache-size`` (GB) or ``--hicache-ratio``
    (of the device pool's KV bytes) gives the KV alone (docs/user_guide.md, "Memory").
    Unchanged for a pool without a canary, a host pool the canary does not mirror, and a
    speculative draft pool's host pool (``draft``: built by
    ``Scheduler._maybe_register_hicache_draft``, which sizes it to the target host pool's slot
    count, outside those flags, and copies it slot for slot with the target's; a mirror of it
    is host memory beside it). Raises ``ValueError`` naming ``--hicache-ratio`` when the mirror
    leaves it no larger than the device pool (sglang's own minimum)."""
    manager = sglang_seam.pool_canary(device_pool)
    if manager is None or sglang_seam.host_pool_class_kind(host_pool_cls) is None:
        return host_to_device_ratio, host_size
    if draft:
        logger.info(
            "kv_canary: HiCache draft host pool: one slot per target host slot, as sglang sizes "
            "it; a canary mirror of it adds %d bytes per host slot beside it",
            manager.host_mirror_bytes_per_slot,
        )
        return host_to_device_ratio, host_size
    kv = sglang_seam.kv_pool_bytes_per_token(device_pool)
    mirror = manager.host_mirror_bytes_per_slot
    share = kv / (kv + mirror)
    if host_size > 0:
        budget = (host_to_device_ratio, host_size * share)
        what = f"--hicache-size {host_size} GB -> {budget[1]:.4f} GB of host slots"
    else:
        budget = (host_to_device_ratio * share, host_size)
        what = f"--hicache-ratio {host_to_device_ratio} -> {budget[0]:.4f}"
        if budget[0] <= 1:
            raise ValueError(
                f"--hicache-ratio {host_to_device_ratio} leaves no room for the canary's host "
                f"mirror ({mirror} bytes per host slot beside {kv} bytes of KV): the host pool "
                "would be no larger than the device pool, which sglang refuses; raise "
                f"--hicache-ratio above {(kv + mirror) / kv:.3f} or pass --hicache-size"
            )
    logger.info(
        "kv_canary: HiCache host pool: %d bytes of KV and %d canary bytes per host "
        "slot, within the KV's budget (%s)",
        kv,
        mirror,
        what,
    )
    return budget
