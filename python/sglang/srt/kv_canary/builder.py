"""``build_canary``: the one assembly of the canary, for production, tests and benchmarks.

:func:`~sglang.srt.kv_canary.install.install_canary` calls it with what it reads off a
``ModelRunner``; the test driver and the benchmarks call it with their own pools. Nothing here
knows about ``ModelRunner``: inputs are the KV pool, the ``req_to_token`` table, the config and
the server limits (:class:`~sglang.srt.kv_canary.capacities.CanaryCapacityInputs`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs, CanaryLaunchCapacities
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.memory import CanaryMemoryInputs, GroupGeometry
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.kv_canary.pool_patcher import attach_canary_buffers
from sglang.srt.kv_canary.manager import CanaryManager
from sglang.srt.kv_canary.token_oracle.expected_tokens import TokenOracleManager


def build_canary(
    *,
    pool,
    req_to_token: torch.Tensor,
    config: CanaryConfig,
    capacity_inputs: CanaryCapacityInputs,
    device,
    swa_window_size: Optional[int] = None,
    vocab_size: Optional[int] = None,
    token_oracle: Optional[TokenOracleManager] = None,
    ranks: Optional[RankFacts] = None,
) -> CanaryManager:
    """Attach canary buffers to ``pool`` (splicing them into its buf-info methods), size the
    per-forward buffers from ``capacity_inputs`` and return the :class:`CanaryManager`.

    ``req_to_token``: int32 ``[rows, max_context_len]`` (sglang's ``ReqToTokenPool`` table);
    ``swa_window_size``: the model's sliding window (SWA pools; None without one). With the
    token oracle on (``config.enable_token_oracle``) a :class:`TokenOracleManager` over
    ``vocab_size`` is created unless ``token_oracle`` is given. ``ranks``: which worker the
    model runner is (default: a single rank, not a draft): an EAGLE draft runner's pool is read
    one position ahead and its canary has one single-forward manager per forward of a draft
    round (which may run inside one CUDA graph); fault injection runs only where the rank
    targets match. Not graph-related; runs once, at start-up."""
    if not config.enabled:
        raise ValueError("build_canary needs --kv-canary log, raise, abort or heal (got none)")
    device = torch.device(device)
    ranks = ranks or RankFacts()
    groups = attach_canary_buffers(
        pool=pool,
        config=config,
        device=device,
        kv_token_id_vs_position_offset=ranks.kv_token_id_vs_position_offset,
        swa_window_size=swa_window_size,
    )
    capacities = CanaryLaunchCapacities.for_server(
        num_slots=groups[0].num_slots,
        req_to_token_rows=int(req_to_token.shape[0]),
        inputs=capacity_inputs,
        rows_per_request=ranks.plan_rows_per_request,
    )
    if config.enable_token_oracle and token_oracle is None:
        if vocab_size is None:
            raise ValueError("build_canary: the token oracle is on but no vocab_size was given")
        token_oracle = TokenOracleManager(
            vocab_size=vocab_size,
            device=device,
            draft=ranks.draft,
            token_offset=ranks.kv_token_id_vs_position_offset,
        )
    memory = memory_inputs(
        config=config,
        groups=[GroupGeometry.of(g) for g in groups],
        capacities=capacities,
        req_to_token_shape=tuple(req_to_token.shape),
        ranks=ranks,
        device=device,
    )
    manager = CanaryManager(
        config=config,
        groups=groups,
        capacities=capacities,
        req_to_token=req_to_token,
        device=device,
        token_oracle=token_oracle,
        ranks=ranks,
        kv_pool=pool,
        memory_inputs=memory,
    )
    # HiCache sizes its host pool from the device pool: the canary's mirror goes beside it
    sglang_seam.set_pool_canary(pool, manager)
    # sglang's compaction of accepted tree nodes (page size > 1) moves KV between slots: the
    # records follow (plugin's move_kv_cache hook)
    sglang_seam.bind_kv_move_groups(pool, groups)
    return manager


def memory_inputs(
    *,
    config: CanaryConfig,
    groups: Sequence[GroupGeometry],
    capacities: CanaryLaunchCapacities,
    req_to_token_shape: Tuple[int, int],
    ranks: RankFacts,
    device,
) -> CanaryMemoryInputs:
    """What :func:`build_canary` allocates for ``groups`` (built, or predicted by the KV-pool
    sizing hook) under ``config``, for :class:`~sglang.srt.kv_canary.memory.CanaryMemory`.
    The HiCache host mirror is added once the scheduler attaches its tree."""
    return CanaryMemoryInputs(
        groups=tuple(groups),
        capacities=capacities,
        req_to_token_shape=(int(req_to_token_shape[0]), int(req_to_token_shape[1])),
        single_forward_managers=ranks.single_forward_managers,
        ring_capacity=config.ring_capacity,
        token_checks=config.enable_verify_token_assert,
        write_input_check=config.enable_write_input_assert,
        sweep=config.sweep_interval > 0,
        swa_divergence_stats=config.swa_divergence_stats_interval > 0,
        cuda=torch.device(device).type == "cuda",
        plan_lanes=ranks.draft_topk > 1,
        plan_lane_pages=ranks.draft_page_size > 1,
        verify_trees=ranks.verify_tree_depth > 0,
    )
