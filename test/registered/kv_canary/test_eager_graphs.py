"""Eager forwards' launches on static, padded inputs (``EagerForwardGraphs``), the inputs
the CUDA graphs captured at start-up replay on.

On the CPU there is no graph; ``enable_static_eager_launches(capture_graphs=False)`` runs the
same launches on the same static inputs, which is what these tests compare with the launches
on the batch's own tensors: the same serving loop (real pools, real ``ForwardBatch`` objects,
requests of every length coming and going, so batches shrink and grow) must leave every
canary record, per-layer fingerprint and counter byte-identical, and a fault must be caught
at the same slot. The graph replay itself needs CUDA: ``test_runtime_cuda.py`` runs the
driver with the graphs captured (and compares them with the direct launches there)."""

from __future__ import annotations

import sys

import pytest
import torch

from serving_driver import ServingDriver
from sglang.jit_kernel.kv_canary import _launch
from sglang.jit_kernel.kv_canary.consts import (
    STAGE_A_INT32,
    STAGE_B_INT32,
    STAGE_OP_COPY,
    STAGE_OP_FILL,
    STAGE_OP_STRIDE,
    STAGE_OP_SUB,
    STAGE_TABLE_NUMEL,
)
from sglang.jit_kernel.kv_canary.stage_inputs import launch_stage_inputs_kernel
from sglang.srt.kv_canary.plan_input import PlanInput, StaticPrefixViews
from sglang.srt.kv_canary.single_forward_manager.eager_graphs import StageTable
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")

VARIANTS = {
    "mha_partial": dict(pool="mha", real_data="partial"),
    "mha_tokens_all_layers": dict(
        pool="mha", real_data="all", verify_tokens=True, real_data_layers="all"
    ),
    "swa": dict(pool="swa", real_data="partial", num_slots=640, num_swa_slots=400, swa_window=12),
    "mla": dict(pool="mla", real_data="partial"),
}


def _driver(variant: str, *, static: bool, **kw) -> ServingDriver:
    d = ServingDriver(seed=11, **VARIANTS[variant], **kw)
    if static:
        for sfm in d.manager.sfms:
            sfm.enable_static_eager_launches(capture_graphs=False)
    return d


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_static_padded_inputs_leave_the_same_records_as_the_batch_tensors(variant):
    direct, static = _driver(variant, static=False), _driver(variant, static=True)
    for d in (direct, static):
        d.run(70)
        d.settle()
    assert direct.step_count == static.step_count > 40
    assert direct.manager.count_violations() == static.manager.count_violations() == 0
    a, b = direct.canary_bytes(), static.canary_bytes()
    assert a.keys() == b.keys()
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert differing == [], f"static eager launches changed {differing}"
    # the loop did write and verify records, and static launches were the ones used
    assert int(b["slot_run_counters"].sum()) > 0
    assert static.manager.sfms[0].eager_graphs is not None
    assert direct.manager.sfms[0].eager_graphs is None


@pytest.mark.parametrize("variant", ["mha_partial", "swa"])
def test_static_padded_inputs_catch_a_fault_at_its_slot(variant):
    d = _driver(variant, static=True)
    d.run(40)
    d.settle()
    assert d.manager.count_violations() == 0
    info = d.fault_swap_req_to_token()
    report = d.report_within(3)
    assert "kv_canary detected KV-cache corruption" in report
    assert f"slot_idx={info['new_slot']} " in report, report[:400]


def test_a_smaller_batch_pads_the_rows_and_slots_a_larger_one_left():
    """After a forward of 3 requests / 7 tokens, one of 1 request / 2 tokens: rows 1-2 are
    padding again (``req_pool_indices`` 0) and slots 2-6 are sglang's padding slot 0, so
    nothing of the larger forward is planned or written a second time."""
    d = _driver("mha_partial", static=True)
    graphs = d.manager.sfms[0].eager_graphs
    plan_input = d.manager.sfms[0].plan_input

    def batch(rows, ext, loc):
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        n = sum(ext)
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(rows),
            input_ids=i64(list(range(100, 100 + n))),
            req_pool_indices=i64(rows),
            seq_lens=i64(ext),
            out_cache_loc=i64(loc),
            seq_lens_sum=n,
            positions=i64(list(range(n))),
            req_to_token_pool=d.req_to_token_pool,
            token_to_kv_pool=d.kv_pool,
        )
        fb.extend_prefix_lens, fb.extend_seq_lens = i64([0] * len(rows)), i64(ext)
        return fb

    # the batches stay alive until their side half ran (it reads them by address)
    first = batch([3, 4, 5], [2, 3, 2], [11, 12, 13, 14, 15, 16, 17])
    graphs.stage(first, num_tokens=7)
    graphs.run_side()  # the side half stages the inputs first
    assert plan_input.req_pool_indices[:4].tolist() == [3, 4, 5, 0]
    assert graphs.out_cache_loc[:8].tolist() == [11, 12, 13, 14, 15, 16, 17, 0]
    second = batch([6], [2], [21, 22])
    graphs.stage(second, num_tokens=2)
    assert plan_input.req_pool_indices[:4].tolist() == [3, 4, 5, 0]  # not before the side half
    graphs.run_side()
    assert plan_input.req_pool_indices[:4].tolist() == [6, 0, 0, 0]
    assert graphs.out_cache_loc[:8].tolist() == [21, 22, 0, 0, 0, 0, 0, 0]
    assert graphs.input_ids[:2].tolist() == [100, 101]
    assert plan_input.extend_seq_lens[:1].tolist() == [2]


def _staged(pi: PlanInput, fb):
    """Stage ``fb``'s plan input through a staging table and the staging kernel (what an eager
    forward's side half does); the three whole buffers."""
    table = StageTable(torch.device("cpu"))
    pi.stage_entries(fb, table.put)
    sent = table.send()
    launch_stage_inputs_kernel(table=table.tables[sent], device=torch.device("cpu"))
    return pi.req_pool_indices, pi.prefix_lens, pi.extend_seq_lens


def test_staging_zeroes_only_the_rows_a_larger_batch_left():
    pi = PlanInput(write_req_capacity=6, device="cpu")
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731

    def fb(rows):
        b = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(rows),
            input_ids=i64([1] * len(rows)),
            req_pool_indices=i64(rows),
            seq_lens=i64([5] * len(rows)),
            out_cache_loc=i64([9] * len(rows)),
            seq_lens_sum=5 * len(rows),
            positions=i64([4] * len(rows)),
        )
        return b

    rpi, prefix, extend = _staged(pi, fb([2, 3, 4, 5]))
    assert rpi.shape == prefix.shape == extend.shape == (6,)
    assert rpi.tolist() == [2, 3, 4, 5, 0, 0]
    assert _staged(pi, fb([7]))[0].tolist() == [7, 0, 0, 0, 0, 0]
    assert _staged(pi, fb([8, 9]))[0].tolist() == [8, 9, 0, 0, 0, 0]


def _mode_batch(mode, rows, *, seq, prefix=None, ext=None, positions=None, draft=None):
    """A ``ForwardBatch`` of ``mode`` with the dtypes sglang's ``init_new`` gives it: int64
    rows, sequence lengths and positions, int32 ``extend_prefix_lens`` / ``extend_seq_lens``."""
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    n = len(rows) if positions is None else len(positions)
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=i64([1] * n),
        req_pool_indices=i64(rows),
        seq_lens=i64(seq),
        out_cache_loc=i64([9] * n),
        seq_lens_sum=sum(seq),
        positions=i64(positions if positions is not None else [0] * n),
    )
    if prefix is not None:
        fb.extend_prefix_lens = i32(prefix)
    if ext is not None:
        fb.extend_seq_lens = i32(ext)
    if draft is not None:
        fb.spec_info = type("Spec", (), {"draft_token_num": draft})()
    return fb


# mode -> (batch, expected prefix, expected extend): the normalisation of PlanInput's docstring
MODE_CASES = {
    "decode": (
        lambda: _mode_batch(ForwardMode.DECODE, [2, 3], seq=[8, 5], positions=[7, 4]),
        [7, 4],
        [1, 1],
    ),
    "extend": (
        lambda: _mode_batch(
            ForwardMode.EXTEND,
            [2, 3],
            seq=[8, 5],
            prefix=[6, 0],
            ext=[2, 5],
            positions=[6, 7, 0, 1, 2, 3, 4],
        ),
        [6, 0],
        [2, 5],
    ),
    "target_verify": (
        lambda: _mode_batch(
            ForwardMode.TARGET_VERIFY, [2, 3], seq=[8, 5], positions=list(range(8)), draft=4
        ),
        [8, 5],
        [4, 4],
    ),
    "draft_extend": (
        lambda: _mode_batch(
            ForwardMode.DRAFT_EXTEND, [2, 3], seq=[8, 5], ext=[3, 2], positions=list(range(5))
        ),
        [5, 3],
        [3, 2],
    ),
}


@pytest.mark.parametrize("mode", sorted(MODE_CASES))
@pytest.mark.parametrize("fill", ["staged", "fill_from_forward_batch"])
def test_plan_input_normalises_each_mode_from_sglang_dtypes(mode, fill):
    """Both fills (the staged one through the staging kernel's table, int32 sources beside
    int64 ones) give each mode's prefix and extend, in int64; a second, smaller batch leaves
    no row of the first behind in the padded rows."""
    make, prefix, extend = MODE_CASES[mode]
    pi = PlanInput(write_req_capacity=4, device="cpu")
    _staged(pi, _mode_batch(ForwardMode.DECODE, [5, 6, 7], seq=[1, 1, 1], positions=[0, 0, 0]))
    rpi, p, e = _staged(pi, make()) if fill == "staged" else pi.fill_from_forward_batch(make())
    assert (p.dtype, e.dtype) == (torch.int64, torch.int64)
    assert p[:2].tolist() == prefix and e[:2].tolist() == extend
    if fill == "staged":
        assert rpi.tolist() == [2, 3, 0, 0]


@pytest.mark.parametrize("fill", ["staged", "fill_from_forward_batch"])
@pytest.mark.parametrize("positions_dtype", [torch.int64, torch.int32])
def test_a_dflash_draft_blocks_prefix_is_each_rows_first_position(fill, positions_dtype):
    """DFLASH's draft block (``block_prefix_from_positions``): ``seq_lens`` holds the draft's
    compact window ``W'`` (here 8 and 5), the positions run ``L .. L + B - 1`` per row (L = 40
    and 13, B = 4): both fills give prefix ``L``, read every B-th position (a strided copy
    in the staging kernel), extend ``B``; a runner without the flag keeps ``seq_lens``."""
    positions = [40 + j for j in range(4)] + [13 + j for j in range(4)]
    block = lambda: _mode_batch(  # noqa: E731
        ForwardMode.TARGET_VERIFY, [2, 3], seq=[8, 5], positions=positions, draft=4
    )
    pi = PlanInput(write_req_capacity=4, device="cpu", block_prefix_from_positions=True)
    fb = block()
    fb.positions = fb.positions.to(positions_dtype)
    _, p, e = _staged(pi, fb) if fill == "staged" else pi.fill_from_forward_batch(fb)
    assert p[:2].tolist() == [40, 13] and e[:2].tolist() == [4, 4]
    plain = PlanInput(write_req_capacity=4, device="cpu")
    _, p, _ = (
        _staged(plain, block()) if fill == "staged" else plain.fill_from_forward_batch(block())
    )
    assert p[:2].tolist() == [8, 5]


def test_staging_refuses_a_batch_field_it_cannot_read_by_address():
    """The staging kernel reads sglang's tensors through their addresses: a field that is not
    a contiguous int32 / int64 vector on the canary's device is refused, naming it."""
    pi = PlanInput(write_req_capacity=4, device="cpu")
    fb = MODE_CASES["extend"][0]()
    fb.extend_seq_lens = torch.tensor([2.0, 5.0])
    with pytest.raises(ValueError, match="ForwardBatch.extend_seq_lens must be a contiguous"):
        _staged(pi, fb)
    fb = MODE_CASES["extend"][0]()
    fb.extend_prefix_lens = torch.tensor([6, 9, 0, 9], dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="ForwardBatch.extend_prefix_lens must be a contiguous"):
        _staged(pi, fb)


@pytest.mark.parametrize("interpret", [True, False])
def test_the_staging_kernel_and_its_reference_stage_the_same_values(interpret, monkeypatch):
    """Copies from int32 and int64 sources, fills, differences (of every source dtype pair)
    and strided copies (every B-th element, from either dtype), sized past the kernel's
    block, entries past the count ignored: Triton's kernel (in its interpreter) and the torch
    reference write the same values, and nothing else."""
    monkeypatch.setattr(_launch, "TRITON_INTERPRET", interpret)
    g = torch.Generator().manual_seed(3)
    n = 2500  # more than one block of the kernel

    def src(dtype):
        return torch.randint(-(1 << 30), 1 << 30, (n,), generator=g).to(dtype)

    a64, a32, b64, b32 = src(torch.int64), src(torch.int32), src(torch.int64), src(torch.int32)
    outs = [torch.full((n + 3,), -7, dtype=torch.int64) for _ in range(9)]
    # strided sources: n // 3 + 1 elements of a64 every 3rd, n // 5 of a32 every 5th
    n3, n5 = n // 3 + 1, n // 5
    table = StageTable(torch.device("cpu"))
    table.put(outs[0].data_ptr(), n, STAGE_OP_COPY, a64.data_ptr())
    table.put(outs[1].data_ptr(), n - 1, STAGE_OP_COPY | STAGE_A_INT32, a32.data_ptr())
    table.put(outs[2].data_ptr(), 5, STAGE_OP_FILL, 0, -(1 << 40))
    table.put(outs[3].data_ptr(), n, STAGE_OP_SUB, a64.data_ptr(), b64.data_ptr())
    table.put(
        outs[4].data_ptr(),
        n,
        STAGE_OP_SUB | STAGE_A_INT32 | STAGE_B_INT32,
        a32.data_ptr(),
        b32.data_ptr(),
    )
    table.put(outs[5].data_ptr(), n, STAGE_OP_SUB | STAGE_B_INT32, a64.data_ptr(), b32.data_ptr())
    table.put(outs[6].data_ptr(), 0, STAGE_OP_FILL, 0, 1)  # nothing: no entry
    table.put(outs[7].data_ptr(), n3, STAGE_OP_STRIDE, a64.data_ptr(), 3)
    table.put(outs[8].data_ptr(), n5, STAGE_OP_STRIDE | STAGE_A_INT32, a32.data_ptr(), 5)
    cpu = torch.device("cpu")
    launch_stage_inputs_kernel(table=table.tables[table.send()], device=cpu)
    i64 = torch.int64
    expected = [
        a64,
        a32[: n - 1].to(i64),
        torch.full((5,), -(1 << 40), dtype=i64),
        a64 - b64,
        a32.to(i64) - b32.to(i64),
        a64 - b32.to(i64),
        torch.zeros(0, dtype=i64),
        a64[::3][:n3],
        a32[::5][:n5].to(i64),
    ]
    for out, want in zip(outs, expected):
        k = want.shape[0]
        assert torch.equal(out[:k], want)
        assert out[k:].eq(-7).all()
    # a table of fewer entries: the entries past its count are left alone
    table.put(outs[0].data_ptr(), 3, STAGE_OP_FILL, 0, 9)
    table.send()
    launch_stage_inputs_kernel(table=table.tables[table.send()], device=cpu)  # a count of 0
    assert torch.equal(outs[0][:n], a64)


def test_the_staging_kernel_refuses_a_table_it_cannot_read():
    """The table must be where the kernel runs or, on CUDA, in pinned host memory (which the
    device reads in place): pageable host memory for a CUDA launch, or a table on another
    device, is refused naming what is allowed, before anything launches."""
    table = torch.zeros(STAGE_TABLE_NUMEL, dtype=torch.int64)
    with pytest.raises(
        ValueError, match="table must be on cuda or in pinned host memory, got a tensor on cpu"
    ):
        launch_stage_inputs_kernel(table=table, device=torch.device("cuda"))
    meta = torch.zeros(STAGE_TABLE_NUMEL, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="table must be on cpu, got a tensor on meta"):
        launch_stage_inputs_kernel(table=meta, device=torch.device("cpu"))
    launch_stage_inputs_kernel(table=table, device=torch.device("cpu"))  # 0 entries: no-op


def test_static_prefix_views_are_the_buffers_own_and_bounded():
    a, b = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)
    views = StaticPrefixViews(a, b, max_entries=2)
    va, vb = views(3)
    assert va.shape == (3,) and vb.shape == (3,) and views(3)[0] is va
    va.fill_(7)
    assert a.tolist() == [7, 7, 7, 0, 0, 0, 0, 0]
    views(4), views(5)  # the oldest length (3) is dropped: a new view, the same storage
    assert views(3)[0] is not va and views(3)[0].data_ptr() == a.data_ptr()
    assert len(views._views) == 2
    with pytest.raises(ValueError, match="max_entries"):
        StaticPrefixViews(a, max_entries=0)


@pytest.mark.parametrize("static", [True, False])
def test_an_eager_forward_queues_its_side_half_after_the_model(static, monkeypatch):
    """Each eager forward: the model's kernels, then the side half (with static launches:
    staging and the side graph), the join, then the tail half. Queuing the side half before
    the model was measured slower on an H100 (docs/performance.md, "The forward path"): its host
    staging delays the model's first kernel and its chain walk slows the model's GEMMs."""
    from sglang.srt.kv_canary.single_forward_manager import forward_manager as sfm_module
    from sglang.srt.kv_canary.single_forward_manager.eager_graphs import EagerForwardGraphs

    d = _driver("mha_partial", static=static)
    order = []
    model = d.model_forward
    monkeypatch.setattr(d, "model_forward", lambda fb: (order.append("model"), model(fb)))
    for name in ("run_side", "run_tail"):
        real = getattr(EagerForwardGraphs, name)
        monkeypatch.setattr(
            EagerForwardGraphs, name, lambda self, _r=real, _n=name: (order.append(_n), _r(self))
        )
    verify = sfm_module.launch_verifies

    def spy(endpoints, phase, **kw):
        order.append(f"verify {phase.name}")
        return verify(endpoints, phase, **kw)

    monkeypatch.setattr(sfm_module, "launch_verifies", spy)
    d.run(20)
    assert order.count("model") >= 20
    side = ["run_side", "verify HEAD"] if static else ["verify HEAD"]
    tail = ["run_tail", "verify TAIL"] if static else ["verify TAIL"]
    per_forward = ["model"] + side + tail
    forwards = [order[i : i + len(per_forward)] for i in range(0, len(order), len(per_forward))]
    assert all(f == per_forward for f in forwards), order[:12]


def test_static_launches_are_enabled_once_and_only_when_idle():
    d = _driver("mha_partial", static=True)
    sfm = d.manager.sfms[0]
    with pytest.raises(RuntimeError, match="already enabled"):
        sfm.enable_static_eager_launches(capture_graphs=False)
    with pytest.raises(RuntimeError, match="need CUDA"):
        sfm.eager_graphs.capture()


@pytest.mark.parametrize("variant", ["mha_partial", "swa", "mla"])
def test_side_half_writes_each_group_with_one_chain_launch(variant, monkeypatch):
    """The side half writes every group's HEAD records and TAIL chain part with one
    ``launch_canary_chain_writes`` per group per forward: its contexts are exactly that
    group's HEAD and TAIL endpoints (K and V where the group has V)."""
    from sglang.srt.kv_canary.single_forward_manager import launches

    calls = []
    real = launches.launch_canary_chain_writes

    def recording(**kw):
        calls.append(tuple(id(c) for c in kw["contexts"]))
        real(**kw)

    monkeypatch.setattr(launches, "launch_canary_chain_writes", recording)
    d = _driver(variant, static=True)
    sfm = d.manager.sfms[0]
    want = {
        g: tuple(
            id(ep.context)
            for ep in sfm.endpoints
            if ep.group is g and ep.phase.name in ("HEAD", "TAIL")
        )
        for g in sfm.groups
    }
    assert all(len(c) == (4 if g.v_head is not None else 2) for g, c in want.items())
    d.run(12)
    d.settle()
    assert d.manager.count_violations() == 0
    assert calls and len(calls) % len(want) == 0
    per_forward = [calls[i : i + len(want)] for i in range(0, len(calls), len(want))]
    assert all(sorted(f) == sorted(want.values()) for f in per_forward)


def test_side_half_refuses_a_head_endpoint_that_fingerprints():
    """HEAD writes go out as chain parts: a HEAD endpoint with a fingerprinting context (which
    a chain part would leave at 0) is refused, naming it."""
    import dataclasses

    from sglang.srt.kv_canary.single_forward_manager.launches import chain_write_launches

    d = _driver("mha_partial", static=True)
    sfm = d.manager.sfms[0]
    tail = next(ep for ep in sfm.endpoints if ep.phase.name == "TAIL")
    assert tail.context.fingerprint_mode
    endpoints = [
        dataclasses.replace(ep, context=tail.context) if ep.phase.name == "HEAD" else ep
        for ep in sfm.endpoints
    ]
    n = 4
    t = torch.zeros(n, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"HEAD endpoint HEAD_K_\w+ fingerprints"):
        chain_write_launches(
            endpoints,
            plans_by_group=sfm.plans,
            input_ids=t,
            positions=t,
            out_cache_loc=t,
            expected_inputs=None,
        )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
