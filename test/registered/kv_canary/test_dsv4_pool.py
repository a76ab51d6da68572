"""DeepSeek-V4 pool (docs/architecture.md, "Buffer groups and adapters"): ``attach_dsv4`` on a real ``DeepSeekV4TokenToKVPool`` built on
CPU with a real ``SWATokenToKVPoolAllocator``: the groups, the real-KV sources over the
584-byte token records (576 data bytes + 8 scale bytes per token, as sglang's ``SetKAndS``
lays them out), the buf-info splices, and the serving loop (written through sglang's own
``SetKAndS`` torch path) with faults in each covered sub-pool."""

from __future__ import annotations

import sys

import pytest
import torch

from serving_driver import ServingDriver
from sglang.jit_kernel.kv_canary.consts import RealKvHashMode
from sglang.jit_kernel.kv_canary.types import CANARY_SLOT_BYTES, PoolKind
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.pool_patcher import attach_canary_buffers, supported_pool_names
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")

WINDOW = 10


def _driver(seed=3, **kw):
    kw.setdefault("mode", "raise")
    kw.setdefault("real_data", "partial")
    return ServingDriver(
        seed=seed, pool="dsv4", num_slots=640, num_swa_slots=400, swa_window=WINDOW, **kw
    )


def _fresh_pool():
    from sglang.srt.mem_cache.swa_memory_pool import SWATokenToKVPoolAllocator

    probe = ServingDriver.__new__(ServingDriver)
    probe.device = torch.device("cpu")
    pool = probe._build_dsv4_pool(640, 400)
    alloc = SWATokenToKVPoolAllocator(
        size=640,
        size_swa=400,
        page_size=1,
        dtype=torch.bfloat16,
        device="cpu",
        kvcache=pool,
        need_sort=False,
    )
    return pool, alloc


def test_attach_dsv4_groups_and_584_byte_sources():
    pool, alloc = _fresh_pool()
    assert "DeepSeekV4TokenToKVPool" in supported_pool_names()
    config = CanaryConfig(mode="raise", real_kv_hash_mode="all", enable_mha_v=True)
    full, swa = attach_canary_buffers(
        pool=pool, config=config, device="cpu", swa_window_size=WINDOW
    )
    assert full.kind == PoolKind.FULL and swa.kind == PoolKind.SWA
    assert full.num_slots == alloc.full_to_swa_index_mapping.shape[0] - 1 == 641
    assert full.real_kv_sources_k == () and full.swa_index_lut is None
    assert not full.has_v and not swa.has_v  # DSV4 stores K only
    swa_pool = pool.swa_kv_pool
    page = swa_pool.page_size
    assert swa.num_slots == swa_pool.kv_buffer[0].shape[0] * page
    assert swa.swa_index_lut is alloc.full_to_swa_index_mapping and swa.swa_window_size == WINDOW
    data, scale = swa.real_kv_sources_k
    assert (data.num_bytes_per_token, data.read_bytes) == (576, 576)
    assert (scale.num_bytes_per_token, scale.read_bytes) == (8, 8)
    assert (
        data.words_to_fold(RealKvHashMode.ALL) + scale.words_to_fold(RealKvHashMode.ALL) == 584 // 8
    )
    # the bytes each source reads for slot s are exactly the token's bytes in sglang's layout
    s = page + 3
    buf = swa_pool.kv_buffer[0]
    buf[s // page].view(-1)[(s % page) * 576] = 0x5A
    buf[s // page].view(-1)[page * 576 + (s % page) * 8] = 0xA5
    assert int(data.words_view[s // page, (s % page) * 72] & 0xFF) == 0x5A
    assert int(scale.words_view[s // page, (s % page)] & 0xFF) == 0xA5


def test_attach_dsv4_window_falls_back_to_the_pool_and_checks_the_table():
    pool, _ = _fresh_pool()
    _, swa = attach_canary_buffers(pool=pool, config=CanaryConfig(mode="log"), device="cpu")
    assert swa.swa_window_size == pool.swa_window_size == 16
    pool, _ = _fresh_pool()
    pool.full_to_swa_index_mapping = None
    with pytest.raises(RuntimeError, match="full_to_swa_index_mapping is not set"):
        attach_canary_buffers(
            pool=pool, config=CanaryConfig(mode="log"), device="cpu", swa_window_size=8
        )


def test_dsv4_buf_info_splice():
    pool, _ = _fresh_pool()
    before_c = pool.get_contiguous_buf_infos()
    before_s = pool.get_state_buf_infos()
    full, swa = attach_canary_buffers(
        pool=pool, config=CanaryConfig(mode="log"), device="cpu", swa_window_size=8
    )
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [full.k_head.data_ptr()] + before_c[0] + [full.k_tail.data_ptr()]
    assert items[0] == items[-1] == CANARY_SLOT_BYTES * pool.page_size
    assert lens[1:-1] == before_c[1] and items[1:-1] == before_c[2]
    ptrs, lens, items = pool.get_state_buf_infos()
    layers = len(pool.swa_kv_pool.kv_buffer)
    assert ptrs == (
        [swa.k_head.data_ptr()]
        + before_s[0][:layers]
        + [swa.k_tail.data_ptr()]
        + before_s[0][layers:]
    )  # compress-state entries after, untouched
    assert items[0] == CANARY_SLOT_BYTES * pool.swa_kv_pool.page_size
    assert len(ptrs) == len(lens) == len(items) == len(before_s[0]) + 2


def test_dsv4_serving_loop_has_no_false_positives():
    d = _driver(seed=5, real_data="all", verify_tokens=True)
    d.run(80, arrivals=0.35)
    d.settle()
    for _ in range(10):
        d.step()
    state = d.manager.state
    assert d.manager.count_violations() == 0
    assert d.reused_slots > 0
    assert int(state.kernel_run_counters[8]) > 0  # TAIL_K_SWA ran


@pytest.mark.parametrize("part", ["data", "scale"])
def test_dsv4_swa_pool_byte_flip_detected(part):
    d = _driver(seed=13, real_data="partial")
    d.run(60)
    d.settle()
    info = d.fault_flip_swa_kv_byte(inside_window=True, part=part)
    with pytest.raises(RuntimeError, match="kv_canary detected KV-cache corruption") as exc:
        d.step()
    lines = parse_violation_lines(str(exc.value))
    assert {(v.launch_tag, v.fail_reasons) for v in lines} == {
        ("TAIL_K_SWA", ("verify_real_kv_hash",))
    }
    assert {(v.slot_idx, v.position) for v in lines} == {(info["swa_slot"], info["position"])}


def test_dsv4_full_group_catches_req_to_token_corruption():
    d = _driver(seed=11)
    d.run(60)
    d.settle()
    info = d.fault_swap_req_to_token()
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.step()
    lines = parse_violation_lines(str(exc.value))
    full = [v for v in lines if v.launch_tag == "HEAD_K_FULL"]
    assert full and info["new_slot"] in {v.slot_idx for v in full}
    assert {r for v in full for r in v.fail_reasons} & {"verify_chain_hash", "verify_position"}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
