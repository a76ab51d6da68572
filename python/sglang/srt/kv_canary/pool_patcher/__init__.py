"""Attach canary buffers to sglang KV pools (registry + one adapter per pool family)."""

from sglang.srt.kv_canary.pool_patcher.registry import (
    attach_canary_buffers,
    attach_for_request,
    register_pool_attacher,
    supported_pool_names,
)
from sglang.srt.kv_canary.pool_patcher.types import AttachRequest, PoolAdapter

__all__ = [
    "AttachRequest",
    "PoolAdapter",
    "attach_canary_buffers",
    "attach_for_request",
    "register_pool_attacher",
    "supported_pool_names",
]
