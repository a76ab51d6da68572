"""Core runtime on real sglang 0.5.12 objects: pool attach + splice, the serving loop with the
four phases (zero false positives), each fault class detected, log / raise policies, phase
ordering, health checker, capacity errors, device→host handler."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from serving_driver import ServingDriver
from sglang.jit_kernel.kv_canary import consts as c
from sglang.jit_kernel.kv_canary.consts import FailReason, to_int64
from sglang.jit_kernel.kv_canary.types import CANARY_SLOT_BYTES, CanaryLaunchTag, PoolKind
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.pool_patcher import attach_canary_buffers
from sglang.srt.kv_canary.runner import DelayedDeviceHostHandler, KernelRunCounterHealthChecker
from sglang.srt.kv_canary.runner.violation import (
    VIOLATION_LINE_PREFIX,
    ViolationLine,
    ViolationReporter,
    format_violation_line,
    parse_violation_line,
    parse_violation_lines,
)
from sglang.srt.kv_canary.single_forward_manager import CanaryPhaseError
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


def _mha_pool(size=64, page_size=1, layers=3):
    return MHATokenToKVPool(size=size, page_size=page_size, dtype=torch.bfloat16, head_num=2,
                            head_dim=8, layer_num=layers, device="cpu",
                            enable_memory_saver=False, enable_alt_stream=False)


# ---- attach + splice ------------------------------------------------------------------------


@pytest.mark.parametrize("enable_v", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_attach_mha_groups_and_splice(enable_v, page_size):
    pool = _mha_pool(page_size=page_size)
    before = pool.get_contiguous_buf_infos()
    (group,) = attach_canary_buffers(pool=pool, config=CanaryConfig(mode="raise",
                                                                     enable_mha_v=enable_v),
                                     device="cpu")
    rows = pool.size + pool.page_size
    assert group.kind == PoolKind.FULL and group.num_slots == rows
    assert group.k_head.shape == (rows, CANARY_SLOT_BYTES) and group.k_head.dtype == torch.uint8
    assert group.has_v == enable_v
    (src_k,) = group.real_kv_sources_k
    assert src_k.tensor.data_ptr() == pool.k_buffer[0].data_ptr()
    assert src_k.num_bytes_per_token == src_k.read_bytes == 2 * 8 * 2
    assert group.real_kv_sources_v[0].tensor.data_ptr() == pool.v_buffer[0].data_ptr()

    ptrs, lens, items = pool.get_contiguous_buf_infos()
    L = pool.layer_num
    canary = lambda buf: (buf.data_ptr(), buf.nbytes, 32 * page_size)  # noqa: E731
    expected = [canary(group.k_head)] + list(zip(*before))[:L] + [canary(group.k_tail)]
    if enable_v:
        expected += [canary(group.v_head)] + list(zip(*before))[L:] + [canary(group.v_tail)]
    else:
        expected += list(zip(*before))[L:]
    assert list(zip(ptrs, lens, items)) == expected
    assert len(ptrs) == 2 * L + (4 if enable_v else 2)

    with pytest.raises(RuntimeError, match="get_contiguous_buf_infos.*only once"):
        attach_canary_buffers(pool=pool, config=CanaryConfig(mode="raise"), device="cpu")


def test_unsupported_pool_names_the_supported_ones():
    pool = MLATokenToKVPool(size=16, page_size=1, dtype=torch.bfloat16, kv_lora_rank=16,
                            qk_rope_head_dim=8, layer_num=1, device="cpu",
                            enable_memory_saver=False)
    with pytest.raises(NotImplementedError, match="MLATokenToKVPool.*MHATokenToKVPool"):
        attach_canary_buffers(pool=pool, config=CanaryConfig(mode="raise"), device="cpu")


# ---- clean serving loop -------------------------------------------------------------------


@pytest.mark.parametrize("real_data,enable_v", [("none", False), ("partial", True),
                                                ("all", False)])
def test_serving_loop_has_no_false_positives(real_data, enable_v):
    d = ServingDriver(seed=3, real_data=real_data, enable_mha_v=enable_v)
    d.run(300)
    state = d.manager.state
    assert int(state.violation_log.violation_write_index) == 0
    # the workload covered what it claims to
    assert d.shared_admitted >= 5, "no request shared a prefix"
    assert d.reused_slots >= 50, "no KV slot was freed and reused"
    assert len(d.finished) >= 30
    assert any(len(r.prompt) > d.chunk for r in d.finished), "no chunked prefill"
    tags = [CanaryLaunchTag.HEAD_K_FULL, CanaryLaunchTag.TAIL_K_FULL]
    if enable_v:
        tags += [CanaryLaunchTag.HEAD_V_FULL, CanaryLaunchTag.TAIL_V_FULL]
    for tag in tags:
        assert int(state.kernel_run_counters[tag]) == 2 * 300  # verify + write per forward
        assert int(state.slot_run_counters[tag]) > 1000
    for tag in set(CanaryLaunchTag) - set(tags):
        assert int(state.kernel_run_counters[tag]) == 0


# ---- faults ---------------------------------------------------------------------------------

FAULTS = {
    # fault: (injector, expected tag(s), reasons that must appear, max steps to report)
    "req_to_token_swap": ("fault_swap_req_to_token", {"HEAD_K_FULL"},
                          {"verify_chain_hash", "verify_position"}, 1),
    "kv_byte_flip": ("fault_flip_kv_byte", {"TAIL_K_FULL"}, {"verify_real_kv_hash"}, 1),
    "record_field_flip": ("fault_flip_record_field", {"HEAD_K_FULL"}, {"verify_position"}, 1),
    # the thief's prefill overwrites the slot; the victim's next decode reads it
    "slot_reused_while_referenced": ("fault_reuse_referenced_slot", {"HEAD_K_FULL"},
                                     {"verify_position"}, 2),
}


def _inject(d: ServingDriver, fault: str) -> dict:
    d.run(60)
    d.settle()
    return getattr(d, FAULTS[fault][0])()


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_detected_in_raise_mode(fault):
    _, tags, reasons, max_steps = FAULTS[fault]
    d = ServingDriver(seed=11, mode="raise", real_data="partial")
    info = _inject(d, fault)
    with pytest.raises(RuntimeError, match="kv_canary detected KV-cache corruption") as exc:
        for _ in range(max_steps):
            d.step()
    lines = parse_violation_lines(str(exc.value))
    assert lines, str(exc.value)
    assert {v.launch_tag for v in lines} <= tags | {t.replace("HEAD", "TAIL") for t in tags}
    assert lines[0].launch_tag in tags
    seen = {r for v in lines for r in v.fail_reasons}
    assert seen & reasons, f"{fault}: reasons {seen}, expected one of {reasons}"
    victim_slot = info.get("slot", info.get("new_slot"))
    assert victim_slot in {v.slot_idx for v in lines}
    # reported at the forward step that raised (results are read back right after it on CPU)
    assert {v.forward_step for v in lines} == {d.manager.step}


def test_log_mode_logs_each_violation_once_and_keeps_serving(caplog):
    d = ServingDriver(seed=5, mode="log", real_data="partial")
    info = _inject(d, "kv_byte_flip")
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        for _ in range(6):
            d.step()
    lines = [v for r in caplog.records
             for v in parse_violation_lines(r.getMessage(), unique=False)]
    total = int(d.manager.state.violation_log.violation_write_index)
    assert total >= 1
    assert len(lines) == total  # every ring row logged exactly once, none twice
    assert all(v.slot_idx == info["slot"] for v in lines)
    assert all(v.launch_tag == "TAIL_K_FULL" and v.fail_reasons == ("verify_real_kv_hash",)
               for v in lines)
    assert d.step_count >= 66  # kept serving


def test_ring_overflow_is_counted_and_reported():
    d = ServingDriver(seed=2, mode="raise", real_data="partial", ring_capacity=4)
    d.run(40)
    d.settle()
    # corrupt every K row of layer 0: far more violations than the ring holds
    d.kv_pool.k_buffer[0].view(torch.uint8)[1:, 0] ^= 0x5A
    with pytest.raises(RuntimeError, match="more violation\\(s\\) not recorded") as exc:
        d.step()
    # the kept rows, each reported; the "more violation(s) not recorded" line is no violation
    assert len(parse_violation_lines(str(exc.value), unique=False)) == 4
    count = int(d.manager.state.violation_log.violation_write_index)
    assert count > 4 and f"{count - 4} more violation(s)" in str(exc.value)


# ---- phases, nesting, capacities, health ------------------------------------------------------


def test_phases_out_of_order_raise():
    d = ServingDriver(seed=1)
    d.run(5)
    d.settle()
    fb = d._decode_batch(d.running)
    mgr = d.manager
    with mgr.with_active_single_forward_manager(0):
        with pytest.raises(CanaryPhaseError, match="pre_ops_maybe_inside_graph called in phase idle"):
            mgr.pre_ops_maybe_inside_graph(fb)
        with pytest.raises(CanaryPhaseError, match="post_ops_outside_graph"):
            mgr.active_sfm.post_ops_outside_graph()
        mgr.active_sfm.pre_ops_outside_graph(fb)
        with pytest.raises(CanaryPhaseError, match="post_ops_maybe_inside_graph"):
            mgr.post_ops_maybe_inside_graph(fb)
        with pytest.raises(CanaryPhaseError, match="pre_ops_outside_graph"):
            mgr.active_sfm.pre_ops_outside_graph(fb)
        mgr.active_sfm.abort()
        with pytest.raises(RuntimeError, match="nesting is not allowed"):
            with mgr.with_active_single_forward_manager(0):
                pass
    with pytest.raises(RuntimeError, match="no single-forward manager is active"):
        mgr.pre_ops_maybe_inside_graph(fb)


def test_capacity_errors_name_the_flag():
    d = ServingDriver(seed=1, max_reqs=12)
    cap = d.capacities.write_req_capacity
    fb = d._make_batch(d._decode_batch.__func__.__globals__["ForwardMode"].DECODE,
                       [1] * (cap + 1), list(range(cap + 1)), [1] * (cap + 1), [1] * (cap + 1),
                       seq=[1] * (cap + 1))
    with d.manager.with_active_single_forward_manager(0):
        with pytest.raises(RuntimeError, match="--max-running-requests"):
            with d.manager.with_ops_outside_graph(fb):
                pass


def test_health_checker_raises_when_the_canary_stops_running():
    d = ServingDriver(seed=4)
    d.run(90)
    mgr = d.manager
    assert mgr.step == 90

    def forward_without_canary(fb):  # e.g. a graph captured without the canary launches
        with mgr.with_active_single_forward_manager(0):
            with mgr.with_ops_outside_graph(fb):
                d.model_forward(fb)
                mgr.mark_replayed_inside_graph()

    d._forward = forward_without_canary
    with pytest.raises(RuntimeError, match="canary path is not executing.*HEAD_K_FULL"):
        d.run(200)
    # warm-up 100 steps, then checks every 100: the first check (step 100) takes a baseline
    # after 10 unprotected forwards, the second (step 200) finds the counters stuck
    assert mgr.step == 200


def test_health_checker_unit():
    hc = KernelRunCounterHealthChecker(expected_tags=[CanaryLaunchTag.TAIL_K_FULL],
                                       warmup_steps=10, interval_steps=5)
    counters = [0] * 12
    for step in range(1, 30):
        counters[CanaryLaunchTag.TAIL_K_FULL] += 1
        hc.check(step=step, kernel_counters=counters)
    counters[CanaryLaunchTag.HEAD_K_FULL] += 100  # an unrelated tag growing does not help
    for step in range(30, 35):
        hc.check(step=step, kernel_counters=counters)
    with pytest.raises(RuntimeError, match="TAIL_K_FULL \\(stuck at 29\\)"):
        hc.check(step=35, kernel_counters=counters)


# ---- reporting pieces --------------------------------------------------------------------------


def test_violation_line_format():
    row = [int(CanaryLaunchTag.TAIL_K_FULL), 812, 37, 5, -1, -2, 0x1234, 4 | 1]
    assert format_violation_line(row, step=41) == (
        f"{VIOLATION_LINE_PREFIX} launch_tag=TAIL_K_FULL fail_reason=verify_chain_hash+"
        "verify_real_kv_hash slot_idx=812 position=37 stored_token=5 expected_token=-1 "
        "stored_chain_hash=0xfffffffffffffffe expected_aux=0x0000000000001234 forward_step=41")


def _row(tag, slot, pos, stored, expected, chain, aux, bits):
    row = [0] * c.VIOLATION_NUM_FIELDS
    row[c.VIOLATION_FIELD_KERNEL_KIND] = int(tag)
    row[c.VIOLATION_FIELD_SLOT_IDX] = slot
    row[c.VIOLATION_FIELD_POSITION] = pos
    row[c.VIOLATION_FIELD_STORED_TOKEN] = stored
    row[c.VIOLATION_FIELD_EXPECTED_TOKEN] = expected
    row[c.VIOLATION_FIELD_STORED_CHAIN_HASH] = to_int64(chain)
    row[c.VIOLATION_FIELD_EXPECTED_AUX] = to_int64(aux)
    row[c.VIOLATION_FIELD_FAIL_REASON_BITS] = int(bits)
    return row


@pytest.mark.parametrize("tag,slot,pos,stored,expected,chain,aux,bits,step", [
    (CanaryLaunchTag.TAIL_K_FULL, 812, 37, 5, -1, (1 << 64) - 2, 0x1234,
     FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_REAL_KV_HASH_MISMATCH, 41),
    # hashes with the top bit set (negative int64 in the ring), negative tokens / position
    (CanaryLaunchTag.HEAD_K_SWA, 0, -1, -7, -123456, 0x8000000000000000, 0xFEDCBA9876543210,
     FailReason.VERIFY_TOKEN_MISMATCH, 0),
    (CanaryLaunchTag.SWEEP_K_FULL, 2 ** 40, 131071, 151935, 0, 0, (1 << 64) - 1,
     FailReason.VERIFY_POSITION_MISMATCH, 10 ** 9),
    (CanaryLaunchTag.HEAD_K_FULL, 3, 3, 1, 2, 0xDEADBEEF, 9,
     FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH, 7),
])
def test_violation_line_round_trip(tag, slot, pos, stored, expected, chain, aux, bits, step):
    row = _row(tag, slot, pos, stored, expected, chain, aux, bits)
    line = format_violation_line(row, step=step)
    want = ViolationLine(launch_tag=tag.name, fail_reasons=tuple(FailReason.describe(int(bits))
                                                                 .split("+")),
                         slot_idx=slot, position=pos, stored_token=stored,
                         expected_token=expected, stored_chain_hash=chain, expected_aux=aux,
                         forward_step=step)
    assert parse_violation_line(line) == want
    assert all(0 <= h < 1 << 64 for h in (want.stored_chain_hash, want.expected_aux))
    # a ring row as the host reads it back (an int64 tensor row) formats the same way
    assert format_violation_line(torch.tensor(row, dtype=torch.int64).tolist(), step=step) == line
    # inside a log line (timestamp / logger prefix, trailing text) and inside a larger text
    logged = f"[2026-01-01 00:00:00 TP0] WARNING kv_canary: {line}\n  KV slot {slot} failed ..."
    assert parse_violation_line(logged) == want
    assert parse_violation_lines("noise\n" + logged + "\nmore noise\n") == [want]


def test_parse_violation_line_ignores_other_lines():
    assert parse_violation_line("kv_canary stats: step=3 protected_tokens=10") is None
    assert parse_violation_line("") is None
    assert parse_violation_lines("nothing to see\n") == []
    # the ring-full line starts with the same prefix but is not a violation
    reporter = ViolationReporter("raise")
    row = _row(CanaryLaunchTag.TAIL_K_FULL, 5, 2, 1, 1, 0, 0,
               FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
    with pytest.raises(RuntimeError) as exc:
        reporter.report([row], step=9, dropped=3)
    text = str(exc.value)
    dropped_line = next(x for x in text.splitlines() if "not recorded" in x)
    assert dropped_line.startswith(VIOLATION_LINE_PREFIX)
    assert parse_violation_line(dropped_line) is None
    (only,) = parse_violation_lines(text, unique=False)
    assert (only.slot_idx, only.forward_step) == (5, 9)
    with pytest.raises(RuntimeError) as exc:
        reporter.report([], step=9, dropped=4)
    assert VIOLATION_LINE_PREFIX in str(exc.value)
    assert parse_violation_lines(str(exc.value), unique=False) == []


@dataclasses.dataclass(frozen=True)
class _Watched:
    x: torch.Tensor


def test_device_host_handler_is_exception_safe():
    src = torch.arange(4)
    h = DelayedDeviceHostHandler(_Watched(x=src))
    assert h.synchronous and not h.has_pending
    h.stage()
    src.add_(10)  # staged copies are snapshots
    with pytest.raises(ValueError):
        h.consume(lambda host: (_ for _ in ()).throw(ValueError("consumer failed")))
    assert not h.has_pending  # no dangling future
    assert h.consume(lambda host: None) is False
    h.stage()
    got = {}
    assert h.consume(lambda host: got.update(x=host.x.tolist(), type=type(host)))
    assert got["x"] == [10, 11, 12, 13]
    assert got["type"] is _Watched  # the consumer gets the watched type back
