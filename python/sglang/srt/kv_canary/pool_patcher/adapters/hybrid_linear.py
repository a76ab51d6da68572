"""Adapter for ``HybridLinearKVPool`` (Qwen3-Next and other models mixing full attention with
linear / Mamba layers): the full-attention layers' inner pool is guarded (docs/user_guide.md,
"Supported pools").

``HybridLinearKVPool`` keeps the full-attention layers' KV in ``full_kv_pool`` (an
``MHATokenToKVPool``, or an ``MLATokenToKVPool`` with ``use_mla``) addressed by the same slots
as ``req_to_token``, and each request's linear-attention (Mamba) state in ``mamba_pool``, one
state per request, not per token. The canary attaches to ``full_kv_pool`` with that pool's own
adapter (its groups, real-KV sources and buf-info splice; the hybrid pool's
``get_contiguous_buf_infos`` returns the inner pool's, so PD transfers carry the canary rows).
The Mamba state is not covered: it is overwritten in place on every step, so there is no
per-token record to keep, and a corrupted state shows up only in the outputs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import List

from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.pool_patcher.adapters.swa import require_sub_pool
from sglang.srt.kv_canary.pool_patcher.types import AttachRequest
from sglang.srt.kv_canary.sglang_seam import import_sglang_class

logger = logging.getLogger(__name__)


def attach_hybrid_linear(request: AttachRequest) -> List[CanaryBufferGroup]:
    """The inner ``full_kv_pool``'s adapter (MHA or MLA), on a copy of ``request`` for the
    inner pool with the model's layer ids of its layers (``full_attention_layer_id_mapping``:
    model layer id -> inner index). ``request.layer_ids`` is ignored (the hybrid pool has its
    own map)."""
    from sglang.srt.kv_canary.pool_patcher.registry import attach_for_request

    pool = request.pool
    inner = require_sub_pool(pool, "full_kv_pool")
    mapping = getattr(pool, "full_attention_layer_id_mapping", None)
    if not isinstance(mapping, dict):
        raise ValueError(
            f"kv_canary: {type(pool).__name__} has no "
            "full_attention_layer_id_mapping; this sglang's hybrid pool is not the "
            "one the canary was written for"
        )
    return attach_for_request(
        dataclasses.replace(
            request,
            pool=inner,
            layer_ids=[gid for gid, _ in sorted(mapping.items(), key=lambda kv: kv[1])],
        )
    )


def register() -> None:
    from sglang.srt.kv_canary.pool_patcher.registry import register_pool_attacher

    try:
        cls = import_sglang_class("sglang.srt.mem_cache.memory_pool", "HybridLinearKVPool")
    except ImportError:
        logger.warning("kv_canary: HybridLinearKVPool not found in this sglang; not covered")
        return
    register_pool_attacher(cls, attach_hybrid_linear)
