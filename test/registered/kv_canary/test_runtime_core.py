"""Core runtime on real sglang 0.5.12 objects: pool attach + splice, the serving loop with the
four phases (zero false positives), each fault class detected, log / raise policies, phase
ordering, health checker, capacity errors, device→host handler."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import re
import sys

import pytest
import torch

from serving_driver import ServingDriver
from sglang.jit_kernel.kv_canary import consts as c
from sglang.jit_kernel.kv_canary.consts import FailReason, to_int64
from sglang.jit_kernel.kv_canary.types import CANARY_SLOT_BYTES, CanaryLaunchTag, PoolKind
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.pool_patcher import attach_canary_buffers
from sglang.srt.kv_canary.runner import DelayedDeviceHostHandler, KernelRunCounterHealthChecker
from sglang.srt.kv_canary.runner.violation import ViolationReporter
from sglang.srt.kv_canary.runner.violation_line import (
    VIOLATION_LINE_PREFIX,
    ViolationLine,
    format_violation_block,
    format_violation_line,
    parse_violation_line,
    parse_violation_lines,
)
from sglang.srt.kv_canary.runner.violation_record import (
    ViolationRecord,
    decode_ring_rows,
    merge_incidents,
)
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.kv_canary.single_forward_manager import CanaryPhaseError
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


def _mha_pool(size=64, page_size=1, layers=3):
    return MHATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )


# ---- attach + splice ------------------------------------------------------------------------


@pytest.mark.parametrize("enable_v", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_attach_mha_groups_and_splice(enable_v, page_size):
    pool = _mha_pool(page_size=page_size)
    before = pool.get_contiguous_buf_infos()
    (group,) = attach_canary_buffers(
        pool=pool, config=CanaryConfig(mode="raise", enable_mha_v=enable_v), device="cpu"
    )
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
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool

    # a KV pool class with no adapter (a DeepSeek-V4 sub-pool on its own; dispatch looks at
    # the class before anything else, so no buffers are needed)
    pool = DeepSeekV4SingleKVPool.__new__(DeepSeekV4SingleKVPool)
    with pytest.raises(NotImplementedError, match="DeepSeekV4SingleKVPool") as exc:
        attach_canary_buffers(pool=pool, config=CanaryConfig(mode="raise"), device="cpu")
    for name in (
        "MHATokenToKVPool",
        "MLATokenToKVPool",
        "NSATokenToKVPool",
        "HybridLinearKVPool",
        "SWAKVPool",
    ):
        assert name in str(exc.value)


# ---- clean serving loop -------------------------------------------------------------------


@pytest.mark.parametrize("real_data,enable_v", [("none", False), ("partial", True), ("all", False)])
def test_serving_loop_has_no_false_positives(real_data, enable_v):
    d = ServingDriver(seed=3, real_data=real_data, enable_mha_v=enable_v)
    d.run(300)
    state = d.manager.state
    assert d.manager.count_violations() == 0
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
    "req_to_token_swap": (
        "fault_swap_req_to_token",
        {"HEAD_K_FULL"},
        {"verify_chain_hash", "verify_position"},
        1,
    ),
    "kv_byte_flip": ("fault_flip_kv_byte", {"TAIL_K_FULL"}, {"verify_real_kv_hash"}, 1),
    "record_field_flip": ("fault_flip_record_field", {"HEAD_K_FULL"}, {"verify_position"}, 1),
    # the thief's prefill overwrites the slot; the victim's next decode reads it
    "slot_reused_while_referenced": (
        "fault_reuse_referenced_slot",
        {"HEAD_K_FULL"},
        {"verify_position"},
        2,
    ),
}


def _inject(d: ServingDriver, fault: str) -> dict:
    d.run(60)
    d.settle()
    return getattr(d, FAULTS[fault][0])()


def test_raise_names_the_rank_on_a_server_of_several():
    """In raise mode the report travels in the exception, which has no log prefix naming the
    rank: on a server of several ranks the message names it; on a one-rank server it does
    not."""
    for ranks, said in (
        (
            RankFacts(tp_rank=1, tp_size=2),
            "KV-cache corruption on tp_rank 1, pp_rank 0, dp_rank 0:\n",
        ),
        (
            RankFacts(pp_rank=1, pp_size=2),
            "KV-cache corruption on tp_rank 0, pp_rank 1, dp_rank 0:\n",
        ),
        (None, "KV-cache corruption:\n"),
    ):
        d = ServingDriver(seed=11, mode="raise", real_data="partial", ranks=ranks)
        _inject(d, "req_to_token_swap")
        with pytest.raises(RuntimeError, match="kv_canary detected KV-cache corruption") as exc:
            d.step()
        assert said in str(exc.value), str(exc.value)[:300]


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
    lines = [v for r in caplog.records for v in parse_violation_lines(r.getMessage(), unique=False)]
    assert d.manager.count_violations() >= 1
    # every incident logged exactly once, none twice: one line per forward step for the slot
    assert len(lines) == d.manager.violations.total_incidents >= 1
    assert len({v.forward_step for v in lines}) == len(lines)
    assert all(v.slot_idx == info["slot"] for v in lines)
    assert all(
        v.launch_tag == "TAIL_K_FULL" and v.fail_reasons == ("verify_real_kv_hash",) for v in lines
    )
    # located: the request's req_to_token row and the position attention read the slot for
    assert {(v.req_to_token_row, v.read_position) for v in lines} == {
        (info["row"], info["position"])
    }
    assert d.step_count >= 66  # kept serving


def test_req_to_token_fault_is_located_in_one_report():
    """A wrong req_to_token entry is reported once per forward with
    every launch tag that saw it, naming the row and the position attention read it for."""
    d = ServingDriver(seed=11, mode="raise", real_data="partial")
    info = _inject(d, "req_to_token_swap")
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.step()
    lines = parse_violation_lines(str(exc.value))
    at_fault = [v for v in lines if v.slot_idx == info["new_slot"]]
    assert len(at_fault) == 1, lines  # one report for the corrupted slot in this forward
    v = at_fault[0]
    assert (v.req_to_token_row, v.read_position) == (info["row"], info["position"])
    assert {"HEAD_K_FULL", "TAIL_K_FULL"} <= set(v.seen_by) and v.launch_tag == v.seen_by[0]
    assert v.position != v.read_position  # the record says where the slot really belongs
    # the chain break it causes one position later is reported at that position, same row
    after = [w for w in lines if w.read_position == info["position"] + 1]
    assert all(w.req_to_token_row == info["row"] for w in after)
    assert len(lines) == len({(w.slot_idx, w.read_position, w.req_to_token_row) for w in lines})
    assert f"req_to_token[{info['row']}, {info['position']}] = slot {info['new_slot']}" in str(
        exc.value
    )


def test_ring_is_detailed_again_after_a_full_window(caplog):
    """A forward that overflows the ring does not blind later ones;
    every forward step gets its own ring_capacity rows of detail and its own dropped count."""
    d = ServingDriver(seed=2, mode="log", real_data="partial", ring_capacity=2)
    d.run(40)
    d.settle()
    held = sorted({s for r in d.running for s in r.slots[: r.kv_len - 1]})
    burst, later = held[:5], held[5]

    def flip(slot):
        d.kv_pool.k_buffer[0][slot].view(torch.uint8).view(-1)[0] ^= 0x5A

    def reported(step):
        text = "\n".join(r.getMessage() for r in caplog.records)
        return [v for v in parse_violation_lines(text) if v.forward_step == step], text

    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        for s in burst:  # an incident larger than the ring
            flip(s)
        d.step()
        burst_step = d.manager.step
        lines, text = reported(burst_step)
        assert len(lines) == 2 and {v.slot_idx for v in lines} <= set(burst)
        m = re.search(
            rf"(\d+) more violation\(s\) not recorded at forward step {burst_step}\b", text
        )
        assert m is not None and int(m.group(1)) >= 3, text
        for s in burst:  # repaired: the next forward is clean again
            flip(s)
        d.step()
        assert reported(d.manager.step)[0] == []
        flip(later)  # a later, unrelated incident is reported in full
        d.step()
        lines, text = reported(d.manager.step)
        assert {v.slot_idx for v in lines} == {later}, text
        assert f"not recorded at forward step {d.manager.step}" not in text
    assert d.manager.count_violations() == 2 + int(m.group(1)) + len(lines)
    assert d.manager.violations.total_dropped == int(m.group(1))


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
    count = d.manager.violations.total
    assert count > 4 and f"{count - 4} more violation(s)" in str(exc.value)


# ---- phases, nesting, capacities, health ------------------------------------------------------


def test_phases_out_of_order_raise():
    d = ServingDriver(seed=1)
    d.run(5)
    d.settle()
    fb = d._decode_batch(d.running)
    mgr = d.manager
    with mgr.with_active_single_forward_manager(0):
        with pytest.raises(
            CanaryPhaseError, match="pre_ops_maybe_inside_graph called in phase idle"
        ):
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
    fb = d._make_batch(
        d._decode_batch.__func__.__globals__["ForwardMode"].DECODE,
        [1] * (cap + 1),
        list(range(cap + 1)),
        [1] * (cap + 1),
        [1] * (cap + 1),
        seq=[1] * (cap + 1),
    )
    with d.manager.with_active_single_forward_manager(0):
        with pytest.raises(RuntimeError, match="--max-running-requests"):
            with d.manager.with_ops_outside_graph(fb):
                pass


def test_a_forward_of_exactly_the_request_capacity_runs():
    """The request capacity counts the rows of one forward including CUDA-graph padding
    (rows pointing at row 0): a padded decode of exactly ``write_req_capacity`` rows is
    served and checked; one row more is refused."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    d = ServingDriver(seed=6, max_reqs=6, max_running=6)
    cap = d.capacities.write_req_capacity
    for _ in range(6):
        d.add_request(prompt_len=8, max_new=30)
    d.settle()
    assert len(d.running) == 6 and cap == 7  # 6 request rows + the padding row

    def padded(rows_total):
        fb = d._decode_batch(d.running)
        pad = rows_total - fb.batch_size
        return d._make_batch(
            ForwardMode.DECODE,
            fb.input_ids.tolist() + [0] * pad,
            fb.positions.tolist() + [0] * pad,
            fb.out_cache_loc.tolist() + [0] * pad,
            fb.req_pool_indices.tolist() + [0] * pad,
            seq=fb.seq_lens.tolist() + [1] * pad,
        )

    before = d.manager.step
    for _ in range(3):
        d._forward(padded(cap))
    assert d.manager.step == before + 3 and d.manager.count_violations() == 0
    d.run(3, arrivals=0)  # the requests' KV written by those forwards reads back clean
    assert d.manager.count_violations() == 0
    with pytest.raises(RuntimeError, match=f"exceeds the canary's request capacity {cap}"):
        d._forward(padded(cap + 1))


def test_a_write_at_a_wrong_position_is_reported_only_after_init_finished():
    """The write kernel's chain-position check (``enable_chain_position_assert``) is off
    during warm-up and graph capture, whose dummy batches carry arbitrary positions, and on
    from ``mark_init_finished``: a chunk written one position off is then reported as
    ``write_position`` at the slot it wrote, with the position the chain expected."""
    d = ServingDriver(seed=3, mode="raise", init_finished=False)
    state = d.manager.state
    assert int(state.enable_chain_position_assert[0]) == 0
    fb, _ = d.shifted_chunk_batch()
    d._forward(fb)  # not reported (raise mode would raise here)
    assert d.manager.count_violations() == 0
    d.manager.mark_init_finished()
    assert int(state.enable_chain_position_assert[0]) == 1
    fb, info = d.shifted_chunk_batch()
    with pytest.raises(RuntimeError, match="kv_canary detected KV-cache corruption") as exc:
        d._forward(fb)
    lines = parse_violation_lines(str(exc.value))
    assert [
        (v.fail_reasons, v.slot_idx, v.position, v.read_position, v.req_to_token_row) for v in lines
    ] == [(("write_position",), info["slot"], info["position"], info["position"], info["row"])], (
        str(exc.value)
    )
    assert lines[0].expected_aux == info["expected_position"]
    assert set(lines[0].seen_by) == {"HEAD_K_FULL", "TAIL_K_FULL"}


def test_target_verify_forward_plans_from_the_committed_prefix():
    """EAGLE's target verify (``TARGET_VERIFY``) writes the drafts at positions ``seq_len ..``:
    the plan's prefix is ``seq_lens`` (verify ``[0, seq_len)``, chain the first draft to the
    record at ``seq_len - 1``); accepted drafts read back clean in the next forwards."""
    d = ServingDriver(seed=9, mode="raise", verify_tokens=True)
    d.run(20)
    d.settle()
    reqs = list(d.running)
    seq = [r.kv_len for r in reqs]
    fb = d.target_verify_batch(reqs, num_draft=3)
    d._forward(fb)
    d._finish()
    sfm = d.manager.sfms[0]
    assert sfm.plan_input.prefix_lens[: len(reqs)].tolist() == seq
    assert sfm.plan_input.extend_seq_lens[: len(reqs)].tolist() == [3] * len(reqs)
    assert d.manager.count_violations() == 0
    for _ in range(4):
        d.step()
    assert d.manager.count_violations() == 0


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
    hc = KernelRunCounterHealthChecker(
        expected_tags=[CanaryLaunchTag.TAIL_K_FULL], warmup_steps=10, interval_steps=5
    )
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
    row = [int(CanaryLaunchTag.TAIL_K_FULL), 812, 37, 5, -1, -2, 0x1234, 4 | 1, 36, 7, -1]
    assert format_violation_line(ViolationRecord.from_row(row), step=41) == (
        f"{VIOLATION_LINE_PREFIX} launch_tag=TAIL_K_FULL fail_reason=verify_chain_hash+"
        "verify_real_kv_hash slot_idx=812 position=37 stored_token=5 expected_token=-1 "
        "stored_chain_hash=0xfffffffffffffffe expected_aux=0x0000000000001234 forward_step=41 "
        "read_position=36 req_to_token_row=7 seen_by=TAIL_K_FULL kv_layer=-1 rids=-"
    )
    # a per-layer fingerprint names its layer (and the block says which half)
    deep = row[:-1] + [27]
    deep[0] = int(CanaryLaunchTag.SWEEP_V_FULL)
    line = format_violation_line(ViolationRecord.from_row(deep), step=41)
    assert " seen_by=SWEEP_V_FULL kv_layer=27 rids=-" in line
    assert parse_violation_line(line).kv_layer == 27
    assert "Layer 27's V row" in format_violation_block(ViolationRecord.from_row(deep), 41)
    assert "Layer" not in format_violation_block(ViolationRecord.from_row(row), 41)


def test_a_ring_row_is_decoded_once_into_a_record():
    """``ViolationRecord.from_row`` reads each column by its ``consts`` index (a row of another
    width is refused, naming both widths); it is the runtime's one reader of the columns."""
    row = _row(
        CanaryLaunchTag.SWEEP_V_SWA,
        812,
        37,
        5,
        9,
        -2,
        0x1234,
        FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
        read_position=36,
        req_row=-2,
        kv_layer=3,
    )
    rec = ViolationRecord.from_row(row)
    assert rec == ViolationRecord(
        launch_tag=int(CanaryLaunchTag.SWEEP_V_SWA),
        slot_idx=812,
        position=37,
        stored_token=5,
        expected_token=9,
        stored_chain_hash=-2,
        expected_aux=0x1234,
        fail_bits=int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH),
        read_position=36,
        req_to_token_row=-2,
        kv_layer=3,
    )
    assert rec.tag == CanaryLaunchTag.SWEEP_V_SWA and rec.tag_name == "SWEEP_V_SWA"
    assert rec.pool_kind == PoolKind.SWA and rec.on_host_tier  # -2: HOST_TIER_ROW
    unknown = ViolationRecord.from_row([99] + row[1:])
    assert unknown.tag is None and unknown.pool_kind is None and unknown.tag_name == "UNKNOWN_99"
    with pytest.raises(ValueError, match=f"has {c.VIOLATION_NUM_FIELDS} fields, got 10"):
        ViolationRecord.from_row(row[:-1])
    # nothing else in the runtime package indexes the ring's columns
    runtime = pathlib.Path(c.__file__).resolve().parents[2] / "srt" / "kv_canary"
    readers = sorted(
        p.relative_to(runtime).as_posix()
        for p in runtime.rglob("*.py")
        if "VIOLATION_FIELD_" in p.read_text()
    )
    assert readers == ["runner/violation_record.py"]


def test_violation_line_names_requests_and_round_trips_odd_ids():
    """``rids=`` ends the line, after every earlier field in its order; ids with a
    comma, a blank or an equals sign survive the round trip (percent-encoded); none is ``-``."""
    row = [int(CanaryLaunchTag.HEAD_K_FULL), 812, 37, 5, -1, -2, 0x1234, 2, 36, 7, -1]
    inc = dataclasses.replace(
        merge_incidents(decode_ring_rows([row]))[0],
        rids=("a1b2", "user,req 7", "x=y%", "plain-id.3:4"),
    )
    line = format_violation_line(inc, step=41)
    assert line.endswith(
        " seen_by=HEAD_K_FULL kv_layer=-1 rids=a1b2,user%2Creq%207,x%3Dy%25,plain-id.3:4"
    )
    plain = format_violation_line(ViolationRecord.from_row(row), step=41)
    assert line.startswith(plain.removesuffix(" rids=-"))
    parsed = parse_violation_line("INFO something: " + line + " trailing")
    assert parsed.rids == ("a1b2", "user,req 7", "x=y%", "plain-id.3:4")
    assert (parsed.slot_idx, parsed.req_to_token_row, parsed.seen_by) == (812, 7, ("HEAD_K_FULL",))
    assert parse_violation_line(plain).rids == ()
    block = format_violation_block(inc, 41)
    assert "Requests touched: a1b2, user,req 7" in block


def test_one_line_per_incident_lists_every_tag():
    """HEAD and TAIL (and the V half) seeing one slot read for one position of one request in
    one forward window: one line, reasons united, every tag listed; another slot, position,
    row or pool kind is another incident."""
    head = _row(
        CanaryLaunchTag.HEAD_K_FULL,
        812,
        37,
        5,
        -1,
        0,
        0,
        FailReason.VERIFY_POSITION_MISMATCH,
        read_position=36,
        req_row=7,
    )
    tail = _row(
        CanaryLaunchTag.TAIL_K_FULL,
        812,
        37,
        5,
        -1,
        0,
        0,
        FailReason.VERIFY_POSITION_MISMATCH | FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
        read_position=36,
        req_row=7,
    )
    tail_v = list(tail)
    tail_v[c.VIOLATION_FIELD_KERNEL_KIND] = int(CanaryLaunchTag.TAIL_V_FULL)
    nxt = _row(
        CanaryLaunchTag.HEAD_K_FULL,
        813,
        37,
        6,
        -1,
        0,
        0,
        FailReason.VERIFY_CHAIN_HASH_MISMATCH,
        read_position=37,
        req_row=7,
    )
    other_row = _row(
        CanaryLaunchTag.HEAD_K_FULL,
        812,
        37,
        5,
        -1,
        0,
        0,
        FailReason.VERIFY_POSITION_MISMATCH,
        read_position=36,
        req_row=8,
    )
    swa = _row(
        CanaryLaunchTag.HEAD_K_SWA,
        812,
        37,
        5,
        -1,
        0,
        0,
        FailReason.VERIFY_POSITION_MISMATCH,
        read_position=36,
        req_row=7,
    )
    incidents = merge_incidents(decode_ring_rows([head, nxt, tail, tail_v, other_row, swa]))
    assert [(i.record.slot_idx, i.record.req_to_token_row) for i in incidents] == [
        (812, 7),
        (813, 7),
        (812, 8),
        (812, 7),
    ]
    first = parse_violation_line(format_violation_line(incidents[0], step=9))
    assert first.launch_tag == "HEAD_K_FULL"
    assert first.seen_by == ("HEAD_K_FULL", "TAIL_K_FULL", "TAIL_V_FULL")
    assert first.fail_reasons == ("verify_position", "verify_real_kv_hash")
    assert (first.read_position, first.req_to_token_row) == (36, 7)
    assert [
        parse_violation_line(format_violation_line(i, step=9)).seen_by for i in incidents[1:]
    ] == [("HEAD_K_FULL",), ("HEAD_K_FULL",), ("HEAD_K_SWA",)]
    # the explanation names the req_to_token entry attention read
    block = format_violation_block(incidents[0], 9)
    assert "req_to_token[7, 36] = slot 812" in block and "holds position 37" in block
    assert "predecessor req_to_token[7, 36]" in format_violation_block(incidents[1], 9)
    # the explanation reads the incident's reasons, not its first row's: a chain break the
    # TAIL also saw as changed bytes is not blamed on the predecessor
    tail_kv = list(nxt)
    tail_kv[c.VIOLATION_FIELD_KERNEL_KIND] = int(CanaryLaunchTag.TAIL_K_FULL)
    tail_kv[c.VIOLATION_FIELD_FAIL_REASON_BITS] = int(
        FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    )
    (both,) = merge_incidents(decode_ring_rows([nxt, tail_kv]))
    assert "predecessor req_to_token" not in format_violation_block(both, 9)


def test_an_incident_unites_the_reasons_of_all_its_rows():
    """Every reason any row of the incident carries is on its line, whichever row carries it
    (not only the first's or the last's), and the line's other fields are the first row's."""
    reasons = (
        FailReason.VERIFY_POSITION_MISMATCH,
        FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
        FailReason.VERIFY_CHAIN_HASH_MISMATCH,
    )
    tags = (CanaryLaunchTag.HEAD_K_FULL, CanaryLaunchTag.TAIL_K_FULL, CanaryLaunchTag.TAIL_V_FULL)
    rows = [
        _row(tag, 40, 9, 100 + i, -1, 0, 0, bits, read_position=9, req_row=3)
        for i, (tag, bits) in enumerate(zip(tags, reasons))
    ]
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        (inc,) = merge_incidents(decode_ring_rows([rows[i] for i in order]))
        assert inc.fail_bits == int(reasons[0] | reasons[1] | reasons[2])
        assert inc.seen_by == tuple(int(tags[i]) for i in order)
        line = parse_violation_line(format_violation_line(inc, step=4))
        assert line.fail_reasons == ("verify_chain_hash", "verify_position", "verify_real_kv_hash")
        assert line.stored_token == 100 + order[0] and line.launch_tag == tags[order[0]].name


def _row(
    tag, slot, pos, stored, expected, chain, aux, bits, *, read_position=0, req_row=-1, kv_layer=-1
):
    row = [0] * c.VIOLATION_NUM_FIELDS
    row[c.VIOLATION_FIELD_KV_LAYER] = kv_layer
    row[c.VIOLATION_FIELD_READ_POSITION] = read_position
    row[c.VIOLATION_FIELD_REQ_TO_TOKEN_ROW] = req_row
    row[c.VIOLATION_FIELD_KERNEL_KIND] = int(tag)
    row[c.VIOLATION_FIELD_SLOT_IDX] = slot
    row[c.VIOLATION_FIELD_POSITION] = pos
    row[c.VIOLATION_FIELD_STORED_TOKEN] = stored
    row[c.VIOLATION_FIELD_EXPECTED_TOKEN] = expected
    row[c.VIOLATION_FIELD_STORED_CHAIN_HASH] = to_int64(chain)
    row[c.VIOLATION_FIELD_EXPECTED_AUX] = to_int64(aux)
    row[c.VIOLATION_FIELD_FAIL_REASON_BITS] = int(bits)
    return row


@pytest.mark.parametrize(
    "tag,slot,pos,stored,expected,chain,aux,bits,step",
    [
        (
            CanaryLaunchTag.TAIL_K_FULL,
            812,
            37,
            5,
            -1,
            (1 << 64) - 2,
            0x1234,
            FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
            41,
        ),
        # hashes with the top bit set (negative int64 in the ring), negative tokens / position
        (
            CanaryLaunchTag.HEAD_K_SWA,
            0,
            -1,
            -7,
            -123456,
            0x8000000000000000,
            0xFEDCBA9876543210,
            FailReason.VERIFY_TOKEN_MISMATCH,
            0,
        ),
        (
            CanaryLaunchTag.SWEEP_K_FULL,
            2**40,
            131071,
            151935,
            0,
            0,
            (1 << 64) - 1,
            FailReason.VERIFY_POSITION_MISMATCH,
            10**9,
        ),
        (
            CanaryLaunchTag.HEAD_K_FULL,
            3,
            3,
            1,
            2,
            0xDEADBEEF,
            9,
            FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH,
            7,
        ),
    ],
)
def test_violation_line_round_trip(tag, slot, pos, stored, expected, chain, aux, bits, step):
    row = _row(
        tag,
        slot,
        pos,
        stored,
        expected,
        chain,
        aux,
        bits,
        read_position=pos + 1,
        req_row=slot % 5 - 1,
    )
    line = format_violation_line(ViolationRecord.from_row(row), step=step)
    want = ViolationLine(
        launch_tag=tag.name,
        fail_reasons=tuple(FailReason.describe(int(bits)).split("+")),
        slot_idx=slot,
        position=pos,
        stored_token=stored,
        expected_token=expected,
        stored_chain_hash=chain,
        expected_aux=aux,
        forward_step=step,
        read_position=pos + 1,
        req_to_token_row=slot % 5 - 1,
        seen_by=(tag.name,),
        kv_layer=-1,
        rids=(),
    )
    assert parse_violation_line(line) == want
    assert all(0 <= h < 1 << 64 for h in (want.stored_chain_hash, want.expected_aux))
    # a ring row as the host reads it back (an int64 tensor row) formats the same way
    read_back = torch.tensor(row, dtype=torch.int64).tolist()
    assert format_violation_line(ViolationRecord.from_row(read_back), step=step) == line
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
    row = _row(
        CanaryLaunchTag.TAIL_K_FULL, 5, 2, 1, 1, 0, 0, FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    )
    with pytest.raises(RuntimeError) as exc:
        reporter.report(merge_incidents(decode_ring_rows([row])), step=9, dropped=3)
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


@dataclasses.dataclass(frozen=True)
class _Nested:
    index: torch.Tensor
    ring: torch.Tensor
    statuses: tuple
    flags: torch.Tensor


def test_device_host_handler_packs_mixed_dtypes_into_one_buffer():
    """Every watched tensor travels in one packed buffer; each host copy is its own tensor
    back (dtype, shape, values), aligned, and a later stage does not disturb the copy the
    consumer has not read yet (two buffers alternate)."""
    src = _Nested(
        index=torch.tensor([3], dtype=torch.int32),
        ring=torch.arange(12, dtype=torch.int64).reshape(4, 3) - 5,
        statuses=(
            _Watched(x=torch.tensor([1, 0, 1], dtype=torch.int32)),
            _Watched(x=torch.tensor([-(2**40)], dtype=torch.int64)),
        ),
        flags=torch.tensor([True, False, True, True]),
    )
    h = DelayedDeviceHostHandler(src)
    assert h.num_bytes == 4 + 12 * 8 + 3 * 4 + 8 + 4
    h.stage()
    first = h._pending  # step T's copies, not consumed yet
    src.ring.mul_(-1)
    src.statuses[0].x.fill_(7)
    src.index.fill_(9)
    got = {}
    assert h.consume(lambda host: got.update(host=host))
    host = got["host"]
    assert type(host) is _Nested and type(host.statuses[1]) is _Watched
    assert host.index.tolist() == [3] and host.index.dtype == torch.int32
    assert host.ring.shape == (4, 3) and torch.equal(host.ring, -src.ring)
    assert host.statuses[0].x.tolist() == [1, 0, 1]
    assert host.statuses[1].x.tolist() == [-(2**40)] and host.flags.tolist() == [
        True,
        False,
        True,
        True,
    ]
    for leaf in (host.index, host.ring, host.statuses[0].x, host.statuses[1].x, host.flags):
        assert leaf.data_ptr() % leaf.element_size() == 0
    h.stage()  # step T+1 into the other buffer: T's host copies stay as they were
    assert first.get().statuses[0].x.tolist() == [1, 0, 1]
    h.consume(lambda host: got.update(again=host))
    assert got["again"].statuses[0].x.tolist() == [7, 7, 7]
    assert got["again"].index.tolist() == [9] and torch.equal(got["again"].ring, src.ring)


def test_device_host_handler_refuses_strided_tensors():
    with pytest.raises(ValueError, match="contiguous"):
        DelayedDeviceHostHandler(_Watched(x=torch.arange(8).reshape(2, 4).t()))


def test_device_host_handler_empties_the_named_window_after_its_copy():
    """``zero_after_copy`` names watched tensors reset right after each copy (the violation
    ring's write index: one window per stage); the consumer still sees the value copied."""
    index = torch.tensor([3], dtype=torch.int32)
    src = _Nested(
        index=index,
        ring=torch.zeros(2, 3, dtype=torch.int64),
        statuses=(),
        flags=torch.tensor([True]),
    )
    h = DelayedDeviceHostHandler(src, zero_after_copy=(index,))
    h.stage()
    assert index.tolist() == [0]
    got = {}
    h.consume(lambda host: got.update(index=host.index.tolist()))
    assert got["index"] == [3]


def test_device_host_handler_refuses_to_zero_what_it_does_not_watch():
    watched = torch.zeros(2)
    with pytest.raises(ValueError, match=r"zero_after_copy entries \[1\] are not leaves"):
        DelayedDeviceHostHandler(_Watched(x=watched), zero_after_copy=(watched, torch.zeros(2)))


def test_device_host_handler_captures_only_on_cuda():
    h = DelayedDeviceHostHandler(_Watched(x=torch.zeros(2)))
    with pytest.raises(RuntimeError, match="captured only on CUDA"):
        h.capture()


def test_parallel_lanes_run_in_order_off_cuda_and_refuse_more_sequences_than_lanes():
    from sglang.srt.kv_canary.cuda_streams import ParallelLanes

    lanes = ParallelLanes(3, "cpu")
    order = []
    lanes.run([lambda i=i: order.append(i) for i in range(3)])
    assert order == [0, 1, 2]
    with pytest.raises(ValueError, match="4 sequences for 3 lanes"):
        lanes.run([lambda: None] * 4)
    with pytest.raises(ValueError, match="lanes >= 1, got 0"):
        ParallelLanes(0, "cpu")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
