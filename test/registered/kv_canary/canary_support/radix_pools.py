"""sglang 0.5.12's smallest KV bookkeeping behind a radix cache, for tests of the walk and the
sweep on real trees: a one-layer MHA pool of page size 1, its allocator and ``req_to_token``
(``radix_cache_params``), on the CPU or a CUDA device."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


def radix_cache_params(num_slots: int, device: str = "cpu") -> CacheInitParams:
    """A tree cache's init parameters over ``num_slots`` KV slots on ``device`` (the
    allocator: ``.token_to_kv_pool_allocator``)."""
    r2t = ReqToTokenPool(size=4, max_context_len=64, device=device, enable_memory_saver=False)
    pool = MHATokenToKVPool(
        size=num_slots,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=8,
        layer_num=1,
        device=device,
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    alloc = TokenToKVPoolAllocator(num_slots, torch.bfloat16, device, pool, need_sort=False)
    return CacheInitParams(
        disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1
    )
