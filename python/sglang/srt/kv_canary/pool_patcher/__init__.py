"""Attach canary buffers to sglang KV pools (registry + one adapter per pool family)."""

from sglang.srt.kv_canary.pool_patcher.registry import (
    attach_canary_buffers,
    register_pool_attacher,
    supported_pool_names,
)

__all__ = ["attach_canary_buffers", "register_pool_attacher", "supported_pool_names"]
