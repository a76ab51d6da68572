"""The runtime's internal seams, each pinned by a test that fails if the seam breaks: the
single-forward manager's op table and its out-of-order errors, the per-group reading of the
status read-back (overflow and SWA divergence), the one assembly (``build_canary``) and its
capacity formula, the violation-line parser's de-duplication, and the canary's per-batch state
on a real ``ForwardBatch`` through the sglang seam."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types

import pytest
import torch

import serving_driver
from serving_driver import ServingDriver, stand_in_model_runner
from sglang.jit_kernel.kv_canary import consts as c
from sglang.jit_kernel.kv_canary.consts import FailReason, to_int64
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag, PoolKind
from sglang.srt.kv_canary import install, builder, sglang_seam
from sglang.srt.kv_canary.batch_state import CanaryBatchState, batch_state, batch_state_for
from sglang.srt.kv_canary.builder import build_canary
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs, CanaryLaunchCapacities
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode
from sglang.srt.kv_canary.pool_patcher import attach_canary_buffers
from sglang.srt.kv_canary.violations.reporter import ViolationReporter
from sglang.srt.kv_canary.violations.lines import format_violation_line, parse_violation_lines
from sglang.srt.kv_canary.violations.records import ViolationRecord, merge_incidents
from sglang.srt.kv_canary.single_forward_manager import (
    CanaryPhaseError,
    SfmOp,
    SfmPhase,
    SingleForwardManager,
)
from sglang.srt.kv_canary.single_forward_manager.phases import CAPTURE_TRANSITIONS, TRANSITIONS
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


def _mha_pool(size=64, layers=1):
    return MHATokenToKVPool(
        size=size,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )


# ---- single-forward manager: ops and phases ---------------------------------------------------


def test_op_tables_are_keyed_by_sfm_op_only():
    assert set(TRANSITIONS) == set(SfmOp)
    assert set(CAPTURE_TRANSITIONS) == {SfmOp.PRE_MAYBE_INSIDE_GRAPH, SfmOp.POST_MAYBE_INSIDE_GRAPH}
    for table in (TRANSITIONS, CAPTURE_TRANSITIONS):
        for op, (allowed, after) in table.items():
            assert type(op) is SfmOp, op
            assert allowed and all(type(p) is SfmPhase for p in allowed) and type(after) is SfmPhase
    # each op's value is the name of the method that runs it (the error messages use it)
    for op in SfmOp:
        assert callable(getattr(SingleForwardManager, op.value)), op


_TAKES_BATCH = {
    SfmOp.PRE_OUTSIDE_GRAPH,
    SfmOp.PRE_MAYBE_INSIDE_GRAPH,
    SfmOp.POST_MAYBE_INSIDE_GRAPH,
}


def _call(sfm, op, fb):
    method = getattr(sfm, op.value)
    return method(fb) if op in _TAKES_BATCH else method()


def _decode_driver():
    d = ServingDriver(seed=1, max_running=3)
    d.run(5)
    d.settle()
    return d, d._decode_batch(d.running)


def test_sfm_rejects_every_out_of_order_op_naming_it():
    d, fb = _decode_driver()
    sfm = d.manager.sfms[0]
    # reach each phase of an eager forward in turn; in each, every op the table does not
    # allow from it raises, names itself (method name) and the phase, and changes nothing
    path = [
        SfmOp.PRE_OUTSIDE_GRAPH,
        SfmOp.PRE_MAYBE_INSIDE_GRAPH,
        SfmOp.POST_MAYBE_INSIDE_GRAPH,
        SfmOp.POST_OUTSIDE_GRAPH,
    ]
    checked = 0
    for step in path:
        phase = sfm.phase
        for op in SfmOp:
            if phase in TRANSITIONS[op][0]:
                continue
            with pytest.raises(CanaryPhaseError) as exc:
                _call(sfm, op, fb)
            assert f"{op.value} called in phase {phase.value}" in str(exc.value), str(exc.value)
            assert sfm.phase == phase
            checked += 1
        _call(sfm, step, fb)
        assert sfm.phase == TRANSITIONS[step][1]
    assert sfm.phase == SfmPhase.IDLE and checked == 4 * 4 - 1  # mark_replayed: one phase
    # during a CUDA-graph capture the outside ops are refused by name, inside ops checked
    with sfm.capturing():
        for op in (
            SfmOp.PRE_OUTSIDE_GRAPH,
            SfmOp.MARK_REPLAYED_INSIDE_GRAPH,
            SfmOp.POST_OUTSIDE_GRAPH,
        ):
            with pytest.raises(
                CanaryPhaseError, match=f"{op.value} must not run during CUDA-graph capture"
            ):
                _call(sfm, op, fb)
        with pytest.raises(
            CanaryPhaseError, match="post_ops_maybe_inside_graph called in phase idle"
        ):
            _call(sfm, SfmOp.POST_MAYBE_INSIDE_GRAPH, fb)
    assert sfm.phase == SfmPhase.IDLE


# ---- status read-back: per group, in the groups' order ------------------------------------------

WINDOW = 12
SMALL_VERIFY_CAPACITY = 100  # < the FULL group's entries of most decodes, > any SWA plan (6 x 12)


def _swa_driver(monkeypatch, *, reorder_plans, small_capacity):
    """A SWA driver; with ``small_capacity`` its verify capacity is one the FULL group's
    plans overflow (the SWA group's window never does). With ``reorder_plans`` each
    single-forward manager's ``plans`` dict is built in the reverse of its groups' order:
    nothing may depend on the dict's order."""
    if small_capacity:
        real_for_server = CanaryLaunchCapacities.for_server.__func__

        def small(cls, **kw):
            return dataclasses.replace(
                real_for_server(cls, **kw), verify_capacity=SMALL_VERIFY_CAPACITY
            )

        monkeypatch.setattr(CanaryLaunchCapacities, "for_server", classmethod(small))
    if reorder_plans:
        real_init = SingleForwardManager.__init__

        def init(self, **kw):
            real_init(self, **kw)
            self.plans = dict(reversed(list(self.plans.items())))

        monkeypatch.setattr(SingleForwardManager, "__init__", init)
    d = ServingDriver(
        seed=5,
        pool="swa",
        num_slots=640,
        num_swa_slots=400,
        swa_window=WINDOW,
        max_running=6,
        mode="raise",
        real_data="partial",
        swa_divergence_interval=1000,
    )
    sfm = d.manager.sfms[0]
    assert [g.kind for g in sfm.groups] == [PoolKind.FULL, PoolKind.SWA]
    assert [g.kind for g in sfm.plans] == (
        [PoolKind.SWA, PoolKind.FULL] if reorder_plans else [PoolKind.FULL, PoolKind.SWA]
    )
    assert (d.capacities.verify_capacity == SMALL_VERIFY_CAPACITY) == small_capacity
    return d


@pytest.mark.parametrize("reorder_plans", [False, True])
@pytest.mark.parametrize("disabled", ["full_by_overflow", "swa_by_status"])
def test_overflow_and_divergence_are_read_against_the_right_group(
    monkeypatch, caplog, reorder_plans, disabled
):
    """FULL overflows its plans for real; or the SWA group's status entry is forced to 0
    after each forward. The read-back must skip exactly the disabled group's entries: a
    status matched to the groups in another order counts the other group's instead."""
    d = _swa_driver(
        monkeypatch, reorder_plans=reorder_plans, small_capacity=disabled == "full_by_overflow"
    )
    sfm = d.manager.sfms[0]
    swa_index = [g.kind for g in sfm.groups].index(PoolKind.SWA)
    if disabled == "swa_by_status":
        real_post = sfm.post_ops_maybe_inside_graph

        def post(fb):
            real_post(fb)
            sfm.status.plan_enabled[swa_index] = 0

        monkeypatch.setattr(sfm, "post_ops_maybe_inside_graph", post)
    expect = {PoolKind.FULL: 0, PoolKind.SWA: 0}
    skipped = {PoolKind.FULL: 0, PoolKind.SWA: 0}
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        for _ in range(60):
            d.run(1, arrivals=0.4)
            status = sfm.status.plan_enabled.tolist()
            for i, group in enumerate(sfm.groups):
                plan = sfm.plans[group].verify_plan
                n = int(plan.verify_num_valid)
                if disabled == "full_by_overflow" or group.kind == PoolKind.FULL:
                    # status entry i is group i's plan flag
                    assert status[i] == int(plan.enable), (i, status)
                if status[i]:
                    expect[group.kind] += n
                elif n:
                    skipped[group.kind] += 1
    assert d.step_count == 60
    off, on = (
        (PoolKind.FULL, PoolKind.SWA)
        if disabled == "full_by_overflow"
        else (PoolKind.SWA, PoolKind.FULL)
    )
    # the disabled group was skipped on forwards with entries, the other never
    assert skipped[off] >= 5 and skipped[on] == 0, skipped
    rep = d.manager.swa_divergence
    assert rep.forwards == 60
    assert (rep.full_verify_entries, rep.swa_verify_entries) == (
        expect[PoolKind.FULL],
        expect[PoolKind.SWA],
    )
    assert expect[on] > 0
    if disabled == "swa_by_status":
        assert rep.swa_verify_entries == 0
    # every skipped group-forward was counted (and warned about) as an overflow
    warned = [
        r.getMessage()
        for r in caplog.records
        if "had more verify entries than the capacity" in r.getMessage()
    ]
    assert d.manager.overflow.overflows == len(warned) >= skipped[off]
    assert all("in 1 buffer group(s)" in w for w in warned)
    assert d.manager.count_violations() == 0


# ---- the one assembly and its capacity formula ------------------------------------------------


SERVER_INPUTS = CanaryCapacityInputs(
    context_len=40960, chunked_prefill_size=8192, max_prefill_tokens=16384, cuda_graph_max_bs=256
)


def test_capacity_formula_of_a_server():
    caps = CanaryLaunchCapacities.for_server(
        num_slots=1000, req_to_token_rows=128, inputs=SERVER_INPUTS
    )
    assert (caps.verify_capacity, caps.write_req_capacity, caps.write_entry_capacity) == (
        3000,
        256,
        41088,
    )


def _clear_canary_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("SGLANG_KV_CANARY_"):
            monkeypatch.delenv(name)


def test_install_canary_assembles_through_build_canary_with_the_server_limits(monkeypatch):
    _clear_canary_env(monkeypatch)
    calls = []
    real = install.build_canary
    assert real is builder.build_canary

    def spy(**kw):
        manager = real(**kw)
        calls.append((kw, manager))
        return manager

    monkeypatch.setattr(install, "build_canary", spy)
    pool = _mha_pool(size=999)  # 1000 rows with the padding slot
    req_to_token = torch.zeros((128, 8), dtype=torch.int32)
    runner = stand_in_model_runner(pool, req_to_token=req_to_token, context_len=40960)
    server_args = types.SimpleNamespace(
        kv_canary="log",
        kv_canary_sweep_interval=0,
        kv_canary_real_data="none",
        device="cpu",
        disable_piecewise_cuda_graph=True,
        enable_torch_compile=False,
        chunked_prefill_size=8192,
        max_prefill_tokens=16384,
        cuda_graph_max_bs=256,
        sampling_backend="pytorch",
    )
    manager = install.install_canary(server_args=server_args, model_runner=runner)
    assert len(calls) == 1 and calls[0][1] is manager
    kw = calls[0][0]
    assert kw["pool"] is pool and kw["req_to_token"] is req_to_token
    assert kw["capacity_inputs"] == SERVER_INPUTS
    assert manager.groups[0].num_slots == 1000
    assert manager.capacities == CanaryLaunchCapacities(
        verify_capacity=3000, write_req_capacity=256, write_entry_capacity=41088
    )
    assert sglang_seam.runner_canary(runner) is manager


def _assembly(manager):
    return (
        manager.capacities,
        manager.config,
        [(g.kind, g.num_slots, g.has_v) for g in manager.groups],
        [ep.tag for ep in manager.endpoints],
        len(manager.sfms),
        manager.token_history is not None,
        manager.token_oracle is not None,
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(graph_bs=0, verify_tokens=True, max_reqs=7),
        dict(pool="swa", num_slots=640, num_swa_slots=400, swa_window=WINDOW),
    ],
)
def test_the_driver_uses_build_canary(monkeypatch, kw):
    calls = []
    real = serving_driver.build_canary
    assert real is builder.build_canary

    def spy(**args):
        manager = real(**args)
        calls.append((args, manager))
        return manager

    monkeypatch.setattr(serving_driver, "build_canary", spy)
    d = ServingDriver(seed=1, **kw)
    assert len(calls) == 1 and calls[0][1] is d.manager
    args = calls[0][0]
    assert args["pool"] is d.kv_pool and args["config"] is d.config
    assert args["req_to_token"] is d.req_to_token_pool.req_to_token
    assert d.capacities == CanaryLaunchCapacities.for_server(
        num_slots=d.groups[0].num_slots,
        req_to_token_rows=d.req_to_token_pool.req_to_token.shape[0],
        inputs=args["capacity_inputs"],
    )
    # the same assembly by hand on a fresh pool of the same shape gives the same canary
    twin = ServingDriver.__new__(ServingDriver)
    twin.device = torch.device("cpu")
    if d.pool_kind == "mha":
        fresh = MHATokenToKVPool(
            size=d.kv_pool.size,
            page_size=1,
            dtype=torch.bfloat16,
            head_num=2,
            head_dim=8,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
    else:
        from sglang.srt.mem_cache.swa_memory_pool import SWATokenToKVPoolAllocator

        fresh = twin._build_swa_pool(640, 400)
        SWATokenToKVPoolAllocator(
            size=640,
            size_swa=400,
            page_size=1,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=fresh,
            need_sort=False,
        )
    by_hand = build_canary(
        pool=fresh,
        req_to_token=d.req_to_token_pool.req_to_token.clone(),
        config=d.config,
        capacity_inputs=args["capacity_inputs"],
        device="cpu",
        swa_window_size=args.get("swa_window_size"),
    )
    assert _assembly(by_hand) == _assembly(d.manager)


def test_build_canary_refuses_mode_none_before_touching_the_pool():
    pool = _mha_pool()
    before = pool.get_contiguous_buf_infos()
    with pytest.raises(
        ValueError, match="build_canary needs --kv-canary log, raise, abort or heal"
    ):
        build_canary(
            pool=pool,
            req_to_token=torch.zeros((4, 16), dtype=torch.int32),
            config=CanaryConfig(mode="none"),
            capacity_inputs=CanaryCapacityInputs(context_len=16),
            device="cpu",
        )
    assert pool.get_contiguous_buf_infos() == before
    # nothing was spliced: the pool still takes its (one) attach
    attach_canary_buffers(pool=pool, config=CanaryConfig(mode="raise"), device="cpu")


# ---- violation lines: a line printed twice is one violation --------------------------------------


def _row(slot, bits=FailReason.VERIFY_REAL_KV_HASH_MISMATCH):
    row = [0] * c.VIOLATION_NUM_FIELDS
    row[c.VIOLATION_FIELD_KERNEL_KIND] = int(CanaryLaunchTag.TAIL_K_FULL)
    row[c.VIOLATION_FIELD_SLOT_IDX] = slot
    row[c.VIOLATION_FIELD_POSITION] = 3
    row[c.VIOLATION_FIELD_STORED_CHAIN_HASH] = to_int64(0xF00D << 48)
    row[c.VIOLATION_FIELD_FAIL_REASON_BITS] = int(bits)
    return ViolationRecord.from_row(row)


def test_parse_violation_lines_counts_a_line_printed_twice_once():
    with pytest.raises(RuntimeError) as exc:
        ViolationReporter(CanaryMode.RAISE).report(merge_incidents([_row(5), _row(6)]), step=12)
    text = str(exc.value)
    # raise mode: sglang's scheduler logs the error, then it propagates and is printed again
    output = f"[TP0] Scheduler hit an exception: {text}\nTraceback ...\nRuntimeError: {text}\n"
    got = parse_violation_lines(output)
    assert [(v.slot_idx, v.forward_step) for v in got] == [(5, 12), (6, 12)]
    assert len(parse_violation_lines(output, unique=False)) == 4
    # the same fields reported at another step are another report
    a, b = format_violation_line(_row(5), step=12), format_violation_line(_row(5), step=13)
    assert [v.forward_step for v in parse_violation_lines("\n".join([a, b, a, b]))] == [12, 13]


# ---- per-batch state on a real ForwardBatch ------------------------------------------------------


def _forward_batch():
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=2,
        input_ids=i64([1, 2]),
        req_pool_indices=i64([0, 1]),
        seq_lens=i64([3, 4]),
        out_cache_loc=i64([5, 6]),
        seq_lens_sum=7,
        positions=i64([2, 3]),
    )


def test_batch_state_round_trips_through_the_seam_on_a_forward_batch():
    fb = _forward_batch()
    assert batch_state(fb) is None and sglang_seam.batch_state(fb) is None
    attrs = set(vars(fb))
    state = batch_state_for(fb)
    assert type(state) is CanaryBatchState
    assert state.token_snapshot is None and state.oracle_rows is None
    # created once, then found again, by the canary and by the seam
    assert batch_state_for(fb) is state and batch_state(fb) is state
    assert sglang_seam.batch_state(fb) is state
    assert len(set(vars(fb)) - attrs) == 1  # the batch's only canary attribute
    replacement = CanaryBatchState()
    sglang_seam.set_batch_state(fb, replacement)
    assert batch_state(fb) is replacement and batch_state_for(fb) is replacement
    assert batch_state(_forward_batch()) is None  # per batch, not shared
    # the oracle batch rides on sampling_info through the seam (no-op without one)
    oracle = object()
    sglang_seam.set_sampling_oracle(fb, oracle)
    assert fb.sampling_info is None
    fb.sampling_info = types.SimpleNamespace()
    sglang_seam.set_sampling_oracle(fb, oracle)
    assert sglang_seam.sampling_oracle(fb.sampling_info) is oracle


def test_batch_state_refuses_a_foreign_object():
    fb = _forward_batch()
    sglang_seam.set_batch_state(fb, types.SimpleNamespace(token_snapshot=None, oracle_rows=None))
    with pytest.raises(RuntimeError, match="SimpleNamespace, not a CanaryBatchState"):
        batch_state(fb)
    with pytest.raises(RuntimeError, match="not a CanaryBatchState"):
        batch_state_for(fb)


def test_a_forward_whose_batch_state_is_foreign_fails_loudly():
    """With token checks on, the single-forward manager reads the batch's snapshot through
    ``batch_state``: an object that is not the canary's stops the forward (never read as
    'no snapshot', which would silently skip the token checks)."""
    d = ServingDriver(seed=2, verify_tokens=True)
    d.add_request(prompt_len=6, max_new=2)
    d._admit()
    fb = d._extend_batch(list(d.running))
    assert batch_state(fb).token_reqs is not None
    sglang_seam.set_batch_state(fb, types.SimpleNamespace(token_snapshot=None, token_reqs=None))
    with pytest.raises(RuntimeError, match="not a CanaryBatchState"):
        d._forward(fb)


def test_a_forward_failing_in_the_pre_ops_leaves_the_manager_idle():
    """A capacity error in ``pre_ops_outside_graph`` must not leave the single-forward manager
    in PRE_OUTSIDE_GRAPH (every later forward would then fail with a phase error instead of
    its own): the next forward runs."""
    d = ServingDriver(seed=1, max_reqs=12)
    cap = d.capacities.write_req_capacity
    n = cap + 1
    fb = d._make_batch(ForwardMode.DECODE, [1] * n, list(range(n)), [1] * n, [1] * n, seq=[1] * n)
    with pytest.raises(RuntimeError, match="exceeds the canary's request capacity"):
        d._forward(fb)
    assert d.manager.sfms[0].phase == SfmPhase.IDLE
    d.run(4)  # the next forwards run normally
    assert d.step_count == 4
    assert d.manager.count_violations() == 0


def test_a_model_calling_another_models_forward_is_bracketed_once():
    """A vision-language model's ``forward`` calls its language model's ``forward`` (the same
    signature): only the runner's outermost ``model.forward`` carries the canary bracket, so
    one forward runs the pre / post launches once, whichever inner forwards it calls."""
    calls = []

    class Inner(torch.nn.Module):
        def forward(self, input_ids, positions, forward_batch):
            calls.append("inner")
            return input_ids

    class Outer(torch.nn.Module):  # what a VLM does: its own work, then the LM's forward
        def __init__(self):
            super().__init__()
            self.language_model = Inner()

        def forward(self, input_ids, positions, forward_batch):
            calls.append("outer")
            return self.language_model.forward(input_ids, positions, forward_batch)

    runner = types.SimpleNamespace(model=Outer())
    assert sglang_seam.wrap_model_forward(
        runner, before=lambda fb: calls.append("before"), after=lambda fb: calls.append("after")
    )
    # a second install on the same model does not wrap it again
    assert not sglang_seam.wrap_model_forward(
        runner, before=lambda fb: calls.append("x"), after=lambda fb: calls.append("x")
    )
    runner.model.forward(torch.zeros(2), torch.zeros(2), object())
    assert calls == ["before", "outer", "inner", "after"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
