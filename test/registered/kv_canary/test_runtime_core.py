"""Core runtime on real sglang 0.5.12 objects: pool attach + splice, the serving loop with the
four phases (zero false positives), each fault class detected, log / raise policies, phase
ordering, health checker, capacity errors. The reporting pieces (ring rows, incidents, the
violation line) and the device→host handler: ``test_runtime_reporting.py``."""

from __future__ import annotations

import logging
import re
import sys

import pytest
import torch

from serving_driver import ServingDriver
from sglang.jit_kernel.kv_canary.types import CANARY_SLOT_BYTES, CanaryLaunchTag, PoolKind
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.pool_patcher import (
    AttachRequest,
    attach_canary_buffers,
    register_pool_attacher,
)
from sglang.srt.kv_canary.pool_patcher import registry as pool_registry
from sglang.srt.kv_canary.manager import KernelRunCounterHealthChecker
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.kv_canary.single_forward_manager import CanaryPhaseError
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

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


def test_the_attach_request_is_checked_and_handed_to_the_registered_adapter(monkeypatch):
    cfg = CanaryConfig(mode="raise")
    with pytest.raises(TypeError, match="config must be a CanaryConfig"):
        AttachRequest(pool=object(), config={"mode": "raise"}, device="cpu")
    for offset in (-1, True, 1.0):
        with pytest.raises(ValueError, match="kv_token_id_vs_position_offset"):
            AttachRequest(
                pool=object(), config=cfg, device="cpu", kv_token_id_vs_position_offset=offset
            )
    with pytest.raises(ValueError, match=r"layer_ids\[1\] must be an int >= 0"):
        AttachRequest(pool=object(), config=cfg, device="cpu", layer_ids=[3, -1])

    class _Pool:
        pass

    monkeypatch.setattr(pool_registry, "_ATTACHERS", dict(pool_registry._ATTACHERS))
    with pytest.raises(TypeError, match="_Pool must be a PoolAdapter"):
        register_pool_attacher(_Pool, object())
    seen = []
    register_pool_attacher(_Pool, lambda request: seen.append(request) or [])
    pool = _Pool()
    out = attach_canary_buffers(
        pool=pool,
        config=cfg,
        device="cpu",
        kv_token_id_vs_position_offset=1,
        swa_window_size=7,
        layer_ids=[4, 5],
    )
    (request,) = seen
    assert out == [] and isinstance(request, AttachRequest)
    assert (request.pool, request.config, request.device) == (pool, cfg, torch.device("cpu"))
    assert (request.kv_token_id_vs_position_offset, request.swa_window_size) == (1, 7)
    assert request.layer_ids == (4, 5)


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
    not. A PD server's reports name which server of the pair it is."""
    for ranks, said in (
        (
            RankFacts(tp_rank=1, tp_size=2),
            "KV-cache corruption on tp_rank 1, pp_rank 0, dp_rank 0:\n",
        ),
        (
            RankFacts(pp_rank=1, pp_size=2),
            "KV-cache corruption on tp_rank 0, pp_rank 1, dp_rank 0:\n",
        ),
        (
            RankFacts(disaggregation_mode="decode"),
            "KV-cache corruption of the PD decode server:\n",
        ),
        (
            RankFacts(tp_rank=1, tp_size=2, disaggregation_mode="prefill"),
            "KV-cache corruption on tp_rank 1, pp_rank 0, dp_rank 0 of the PD prefill server:\n",
        ),
        (None, "KV-cache corruption:\n"),
    ):
        d = ServingDriver(seed=11, mode="raise", real_data="partial", ranks=ranks)
        _inject(d, "req_to_token_swap")
        with pytest.raises(RuntimeError, match="kv_canary detected KV-cache corruption") as exc:
            d.step()
        assert said in str(exc.value), str(exc.value)[:300]
        server = ranks.server_role if ranks is not None else ""
        blocks = str(exc.value).count("\n  Server: ")
        assert blocks == (len(parse_violation_lines(str(exc.value))) if server else 0)


def test_rank_facts_say_what_an_eagle_draft_runner_needs():
    """A draft runner's pool is read one position ahead and its canary has one single-forward
    manager per forward of a draft round (steps - 1); a target runner has one and offset 0."""
    target, draft = RankFacts(), RankFacts(draft=True, draft_steps=4)
    assert (target.kv_token_id_vs_position_offset, target.single_forward_managers) == (0, 1)
    assert target.draft_forwards_per_round == 0
    assert (draft.kv_token_id_vs_position_offset, draft.single_forward_managers) == (1, 3)
    assert draft.draft_forwards_per_round == 3
    one_step = RankFacts(draft=True, draft_steps=1)  # a round of no draft forward
    assert (one_step.single_forward_managers, one_step.draft_forwards_per_round) == (1, 0)
    with pytest.raises(ValueError, match="0 unless draft=True"):
        RankFacts(draft_steps=3)
    with pytest.raises(ValueError, match=">= 0"):
        RankFacts(draft=True, draft_steps=-1)
    with pytest.raises(TypeError, match="draft_steps must be an int"):
        RankFacts(draft=True, draft_steps=True)


def test_rank_facts_refuse_an_unknown_pd_role():
    with pytest.raises(
        ValueError, match="disaggregation_mode must be one of null, prefill, decode"
    ):
        RankFacts(disaggregation_mode="encode")


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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
