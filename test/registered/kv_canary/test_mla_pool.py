"""MLA, NSA and hybrid linear-attention pools (docs/architecture.md, "Buffer groups
and adapters"): the attachers on real sglang pools (``MLATokenToKVPool``,
``MLATokenToKVPoolFP4``, ``NSATokenToKVPool``, ``HybridLinearKVPool``), their buf-info
splice, and the serving driver's loop on each (clean, then every fault class caught)."""

from __future__ import annotations

import sys

import pytest
import torch

from serving_driver import ServingDriver
from sglang.jit_kernel.kv_canary.types import CANARY_SLOT_BYTES, PoolKind
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.pool_patcher import attach_canary_buffers, supported_pool_names
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.mem_cache.memory_pool import (
    HybridLinearKVPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    MLATokenToKVPoolFP4,
    NSATokenToKVPool,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")

CFG = CanaryConfig(mode="raise", real_kv_hash_mode="all")


def _mla(cls=MLATokenToKVPool, size=128, page_size=1, rank=32, rope=16, layers=3):
    return cls(
        size=size,
        page_size=page_size,
        dtype=torch.bfloat16,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def _nsa(size=128, layers=2):
    return NSATokenToKVPool(
        size=size,
        page_size=64,
        kv_lora_rank=32,
        dtype=torch.bfloat16,
        qk_rope_head_dim=16,
        layer_num=layers,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=48,
    )


def _hybrid(use_mla=False, size=128):
    kw = dict(kv_lora_rank=32, qk_rope_head_dim=16) if use_mla else {}
    return HybridLinearKVPool(
        size=size,
        dtype=torch.bfloat16,
        page_size=1,
        head_num=2,
        head_dim=8,
        full_attention_layer_ids=[1, 3],
        enable_kvcache_transpose=False,
        device="cpu",
        mamba_pool=None,
        use_mla=use_mla,
        **kw,
    )


# ---- attach and splice ---------------------------------------------------------------------


def test_every_new_pool_class_is_supported():
    names = supported_pool_names()
    for name in (
        "MLATokenToKVPool",
        "MLATokenToKVPoolFP4",
        "NSATokenToKVPool",
        "HybridLinearKVPool",
    ):
        assert name in names


@pytest.mark.parametrize("page_size", [1, 16])
def test_attach_mla_one_full_k_group_over_the_latent_rows(page_size):
    pool = _mla(page_size=page_size)
    plain = pool.get_contiguous_buf_infos()
    (group,) = attach_canary_buffers(pool=pool, config=CFG, device="cpu")
    assert group.kind == PoolKind.FULL and not group.has_v and group.real_kv_sources_v == ()
    assert group.num_slots == pool.kv_buffer[0].shape[0] == 128 + page_size
    (src,) = group.real_kv_sources_k
    assert src.tensor is pool.kv_buffer[0] and src.read_bytes == (32 + 16) * 2
    # the buf infos: K-head, every layer's latent rows, K-tail; one canary item per page
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [group.k_head.data_ptr(), *plain[0], group.k_tail.data_ptr()]
    assert lens[0] == lens[-1] == group.k_head.nbytes
    assert items[0] == items[-1] == CANARY_SLOT_BYTES * page_size and items[1:-1] == plain[2]
    with pytest.raises(RuntimeError, match="only once"):
        attach_canary_buffers(pool=pool, config=CFG, device="cpu")


def test_attach_mla_fp4_fingerprints_the_packed_rows():
    pool = _mla(cls=MLATokenToKVPoolFP4)
    (group,) = attach_canary_buffers(pool=pool, config=CFG, device="cpu")
    (src,) = group.real_kv_sources_k
    assert src.tensor is pool.kv_buffer[0] and pool.kv_buffer[0].dtype == torch.uint8
    assert src.read_bytes == (32 + 16) // 2  # two elements per byte


def test_attach_nsa_adds_the_indexer_keys():
    pool = _nsa()
    (group,) = attach_canary_buffers(pool=pool, config=CFG, device="cpu")
    latent, index = group.real_kv_sources_k
    assert latent.tensor is pool.kv_buffer[0]
    assert index.tensor is pool.index_k_with_scale_buffer[0]
    assert (index.page_size, index.num_bytes_per_token, index.read_bytes) == (64, 128, 128)
    assert index.num_slots >= group.num_slots == 128 + 64
    # slot s's key bytes: page row s // 64, bytes (s % 64) * 128 ..., before the page's scales
    slot = 70
    words = index.words_view[slot // 64, (slot % 64) * 16 : (slot % 64 + 1) * 16]
    pool.index_k_with_scale_buffer[0].view(-1)[
        (slot // 64) * pool.index_k_with_scale_buffer[0].shape[1] + (slot % 64) * 128
    ] = 0x5A
    assert int(words[0]) & 0xFF == 0x5A


@pytest.mark.parametrize("use_mla", [False, True])
def test_attach_hybrid_guards_the_full_attention_pool(use_mla):
    pool = _hybrid(use_mla=use_mla)
    inner = pool.full_kv_pool
    assert isinstance(inner, MLATokenToKVPool if use_mla else MHATokenToKVPool)
    plain = pool.get_contiguous_buf_infos()
    (group,) = attach_canary_buffers(pool=pool, config=CFG, device="cpu")
    buf = inner.kv_buffer[0] if use_mla else inner.k_buffer[0]
    assert group.real_kv_sources_k[0].tensor is buf
    # the hybrid pool's buf infos are the inner pool's, spliced once
    ptrs = pool.get_contiguous_buf_infos()[0]
    assert ptrs[0] == group.k_head.data_ptr() and len(ptrs) == len(plain[0]) + 2


# ---- the serving loop ---------------------------------------------------------------------------


def _driver(pool, seed=3, **kw):
    kw.setdefault("mode", "raise")
    kw.setdefault("real_data", "partial")
    return ServingDriver(seed=seed, pool=pool, **kw)


@pytest.mark.parametrize("pool", ["mla", "nsa", "hybrid"])
def test_serving_loop_clean(pool):
    d = _driver(pool, verify_tokens=True)
    d.run(220)
    assert d.manager.count_violations() == 0
    assert d.shared_admitted >= 3 and d.reused_slots >= 20


FAULTS = {
    "req_to_token_swap": ("fault_swap_req_to_token", {"verify_chain_hash", "verify_position"}),
    "kv_byte_flip": ("fault_flip_kv_byte", {"verify_real_kv_hash"}),
    "record_field_flip": ("fault_flip_record_field", {"verify_position"}),
    "slot_reused_while_referenced": ("fault_reuse_referenced_slot", {"verify_position"}),
}


@pytest.mark.parametrize("pool", ["mla", "nsa", "hybrid"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_serving_loop_catches_each_fault(pool, fault):
    injector, reasons = FAULTS[fault]
    d = _driver(pool, seed=11)
    d.run(60)
    d.settle()
    info = getattr(d, injector)()
    report = d.report_within(3)
    assert "kv_canary detected KV-cache corruption" in report
    found = parse_violation_lines(report)
    assert {r for v in found for r in v.fail_reasons} & reasons, found
    assert info.get("slot", info.get("new_slot")) in {v.slot_idx for v in found}


def test_nsa_indexer_key_byte_flip_is_caught():
    """A byte of a read slot's indexer key (the second real-KV source) changes: TAIL's
    fingerprint of that slot no longer matches."""
    d = _driver("nsa", seed=12)
    d.run(40)
    d.settle()
    victim = d.running[0]
    slot = victim.slots[2]
    flat = d.kv_pool.index_k_with_scale_buffer[0].view(-1)
    flat[d.nsa_index_key_bytes(0, torch.tensor([slot]))[0, 0]] ^= 0x77
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.step()
    found = parse_violation_lines(str(exc.value))
    assert [(v.slot_idx, v.fail_reasons) for v in found if v.launch_tag.startswith("TAIL")] == [
        (slot, ("verify_real_kv_hash",))
    ]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
