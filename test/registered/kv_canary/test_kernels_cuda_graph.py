"""CUDA-graph capture of plan + HEAD verify + write, replayed with inputs changed in place.

Shows the launch paths are graph-safe (capture would fail on a host sync) and allocation-free
(no growth of torch's allocated memory across eager launches), and that replays stay
byte-equal with the torch references step after step.
"""

from __future__ import annotations

import sys

import pytest
import torch

from canary_testlib import (
    assert_contexts_equal,
    assert_plans_equal,
    clone_context,
    clone_dataclass_tensors,
    make_context,
)
from sglang.jit_kernel.kv_canary import (
    CanaryLaunchTag,
    RealKvHashMode,
    RealKvSource,
    VerifyPlan,
    WriteParts,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel,
    launch_canary_write_kernel_torch_reference,
)
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=40, stage="base-b", runner_config="1-gpu-small")

pytestmark = pytest.mark.cuda

BS = 4  # three live requests + one padding row, as a decode graph of bs 4 would hold
ROWS, CTX, SLOTS = 5, 64, 512


class _DecodeState:
    """Static buffers a decode CUDA graph would read, plus the host-side truth."""

    def __init__(self, device, *, mode):
        g = torch.Generator().manual_seed(7)
        self.device = device
        perm = (torch.randperm(SLOTS - 1, generator=g) + 1)[: (ROWS - 1) * CTX]
        self.req_to_token = torch.zeros(ROWS, CTX, dtype=torch.int32)
        self.req_to_token[1:] = perm.view(ROWS - 1, CTX).to(torch.int32)
        self.tokens = torch.randint(0, 30000, (ROWS, CTX), generator=g)
        self.prefix = {1: 5, 2: 17, 3: 1}
        kv = torch.randn(SLOTS, 8, 64, dtype=torch.bfloat16, generator=g)
        self.kv = kv.to(device)
        sources = (
            (RealKvSource(tensor=self.kv, page_size=1, num_bytes_per_token=1024, read_bytes=1024),)
            if mode != RealKvHashMode.NONE
            else ()
        )
        self.ctx = make_context(
            SLOTS,
            device=device,
            kind=CanaryLaunchTag.HEAD_K_FULL,
            sources=sources,
            mode=mode,
            ring_capacity=64,
        )
        self.vp = VerifyPlan.allocate(verify_capacity=ROWS * CTX, device=device)
        self.wp = WritePlan.allocate(write_req_capacity=BS, device=device)
        # static graph inputs
        self.r2t = self.req_to_token.to(device)
        self.rpi = torch.zeros(BS, dtype=torch.int64, device=device)
        self.pre = torch.zeros(BS, dtype=torch.int64, device=device)
        self.ext = torch.ones(BS, dtype=torch.int64, device=device)
        self.ids = torch.zeros(BS, dtype=torch.int64, device=device)
        self.pos = torch.zeros(BS, dtype=torch.int64, device=device)
        self.loc = torch.zeros(BS, dtype=torch.int64, device=device)
        self._write_prefixes()

    def _write_prefixes(self):
        """Records for every request's existing prefix (eager, through the public launchers)."""
        rows = list(self.prefix)
        plan = WritePlan.allocate(write_req_capacity=len(rows), device=self.device)
        vp = VerifyPlan.allocate(verify_capacity=0, device=self.device)
        pre = [self.prefix[r] for r in rows]
        launch_canary_plan_kernels(
            verify_plan_out=vp,
            write_plan_out=plan,
            req_pool_indices=torch.tensor(rows, device=self.device),
            prefix_lens=torch.zeros(len(rows), dtype=torch.int64, device=self.device),
            extend_seq_lens=torch.tensor(pre, device=self.device),
            req_to_token=self.r2t,
            swa_window_size=0,
            full_to_swa_index_mapping=None,
            verify_capacity=0,
            req_to_verify_expected_tokens=None,
            req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0,
        )
        ids = torch.cat([self.tokens[r, :p] for r, p in zip(rows, pre)]).to(self.device)
        pos = torch.cat([torch.arange(p) for p in pre]).to(self.device)
        loc = (
            torch.cat([self.req_to_token[r, :p] for r, p in zip(rows, pre)]).long().to(self.device)
        )
        launch_canary_write_kernel(
            context=self.ctx,
            plan=plan,
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
        )

    def set_step(self, rows_order):
        """Fill the static inputs for one decode step of ``rows_order`` (0 = padding)."""
        rpi, pre, ids, pos, loc = [], [], [], [], []
        for r in rows_order:
            p = self.prefix.get(r, 0)
            rpi.append(r)
            pre.append(p)
            ids.append(int(self.tokens[r, p]) if r else 0)
            pos.append(p)
            loc.append(int(self.req_to_token[r, p]) if r else 0)
        for dst, vals in (
            (self.rpi, rpi),
            (self.pre, pre),
            (self.ids, ids),
            (self.pos, pos),
            (self.loc, loc),
        ):
            dst.copy_(torch.tensor(vals, dtype=torch.int64))

    def advance(self):
        for r in self.prefix:
            self.prefix[r] += 1

    def plan_kwargs(self, device=None):
        mv = (lambda t: t.to(device)) if device is not None else (lambda t: t)
        return dict(
            req_pool_indices=mv(self.rpi),
            prefix_lens=mv(self.pre),
            extend_seq_lens=mv(self.ext),
            req_to_token=mv(self.r2t),
            swa_window_size=0,
            full_to_swa_index_mapping=None,
            verify_capacity=self.vp.capacity,
            req_to_verify_expected_tokens=None,
            req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0,
        )

    def write_kwargs(self, device=None):
        mv = (lambda t: t.to(device)) if device is not None else (lambda t: t)
        return dict(
            input_ids=mv(self.ids),
            positions=mv(self.pos),
            out_cache_loc=mv(self.loc),
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
        )

    def forward_ops(self):
        launch_canary_plan_kernels(
            verify_plan_out=self.vp, write_plan_out=self.wp, **self.plan_kwargs()
        )
        launch_canary_verify_kernel(
            context=self.ctx, plan=self.vp, check_verify_expected_token=False
        )
        launch_canary_write_kernel(context=self.ctx, plan=self.wp, **self.write_kwargs())


def _reference_step(state: _DecodeState):
    """The same step through the torch references, on CPU copies of the pre-step state."""
    ctx = clone_context(state.ctx, "cpu")
    vp = clone_dataclass_tensors(state.vp, "cpu")
    wp = clone_dataclass_tensors(state.wp, "cpu")
    launch_canary_plan_kernels_torch_reference(
        verify_plan_out=vp, write_plan_out=wp, **state.plan_kwargs("cpu")
    )
    launch_canary_verify_kernel_torch_reference(
        context=ctx, plan=vp, check_verify_expected_token=False
    )
    launch_canary_write_kernel_torch_reference(context=ctx, plan=wp, **state.write_kwargs("cpu"))
    return ctx, vp, wp


@pytest.mark.parametrize("mode", [RealKvHashMode.NONE, RealKvHashMode.ALL])
def test_graph_replay_matches_reference(mode):
    state = _DecodeState(torch.device("cuda"), mode=mode)
    # padding rows (0) come last, as in sglang's CUDA-graph padding: they own no token entries
    batches = [[1, 2, 3, 0], [3, 1, 0, 0], [2, 3, 1, 0], [2, 1, 3, 0], [0, 0, 0, 0]]
    state.set_step(batches[0])
    # warm up (JIT compile) outside capture, on a side stream as sglang does
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ref = _reference_step(state)
        state.forward_ops()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert_contexts_equal(state.ctx, ref[0])
    state.advance()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        state.forward_ops()
    torch.cuda.synchronize()
    # Capture does not run the kernels; undo nothing. Replay per step with fresh inputs.
    for step, rows in enumerate(batches[1:] * 2):
        state.set_step(rows)
        ref_ctx, ref_vp, ref_wp = _reference_step(state)
        graph.replay()
        torch.cuda.synchronize()
        assert_plans_equal(state.vp, ref_vp)
        assert_plans_equal(state.wp, ref_wp)
        assert_contexts_equal(state.ctx, ref_ctx)
        for r in rows:
            if r:
                state.prefix[r] += 1
    assert int(state.ctx.violation_write_index[0]) == 0, "clean replays must not report"
    assert int(state.ctx.kernel_run_counter[0]) == 2 * (1 + 2 * (len(batches) - 1)) + 1

    # a corrupted record is caught by the next replay, through the same graph
    victim = int(state.req_to_token[1, 2])
    state.ctx.canary_words[victim, 1] += 100  # position field
    state.set_step([1, 2, 3, 0])
    graph.replay()
    torch.cuda.synchronize()
    rows = state.ctx.violation_ring[: int(state.ctx.violation_write_index[0])].cpu()
    assert victim in rows[:, 1].tolist()  # position mismatch (its successor: chain mismatch)
    assert set(rows[:, 0].tolist()) == {int(CanaryLaunchTag.HEAD_K_FULL)}


def test_launches_do_not_allocate():
    state = _DecodeState(torch.device("cuda"), mode=RealKvHashMode.PARTIAL)
    state.set_step([1, 2, 3, 0])
    state.forward_ops()  # compile
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        state.forward_ops()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_packed_token_scatter_replays_with_the_buffer_refilled():
    """The packed token-id scatter captured once for a padded batch of 4 rows, replayed with
    the static buffer refilled in place (1 to 4 requests, whole and incremental segments):
    pool and valid lengths byte-equal to the reference each replay; padding rows 0."""
    from sglang.jit_kernel.kv_canary import (
        launch_scatter_packed_token_ids_kernel,
        scatter_packed_token_ids_torch_reference,
    )

    dev = torch.device("cuda")
    buf = torch.zeros(1 + 3 * BS + 64, dtype=torch.int64, device=dev)
    rpi = torch.zeros(BS, dtype=torch.int64, device=dev)
    pool = torch.full((ROWS, CTX), -1, dtype=torch.int32, device=dev)
    lens = torch.zeros(BS, dtype=torch.int64, device=dev)
    kwargs = dict(packed=buf, req_pool_indices=rpi, pool_out=pool, valid_lens_out=lens)
    launch_scatter_packed_token_ids_kernel(**kwargs)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_scatter_packed_token_ids_kernel(**kwargs)
    gen = torch.Generator().manual_seed(3)
    ref_pool, ref_lens = pool.cpu(), lens.cpu()
    steps = [
        [(1, 5, 0), (2, 3, 0), (3, 9, 0)],
        [(3, 10, 9), (1, 6, 5)],
        [(4, 7, 0), (2, 4, 3), (1, 7, 6), (3, 11, 10)],
        [(2, 5, 4)],
    ]
    for step in steps:
        header, flat = [len(step)], []
        for _, length, start in step:
            header += [length, start, len(flat)]
            flat += torch.randint(0, 2**31 - 1, (length - start,), generator=gen).tolist()
        host = torch.tensor(header + flat, dtype=torch.int64)
        rows = [r for r, _, _ in step] + [0] * (BS - len(step))
        buf[: host.shape[0]].copy_(host)
        rpi.copy_(torch.tensor(rows))
        graph.replay()
        torch.cuda.synchronize()
        scatter_packed_token_ids_torch_reference(
            packed=buf.cpu(), req_pool_indices=rpi.cpu(), pool_out=ref_pool, valid_lens_out=ref_lens
        )
        assert torch.equal(pool.cpu(), ref_pool) and torch.equal(lens.cpu(), ref_lens)
        assert lens.cpu().tolist() == [length for _, length, _ in step] + [0] * (BS - len(step))


def test_the_staging_kernel_replays_with_the_table_rewritten():
    """The staging kernel captured once per staging table (pinned host memory the kernel
    reads in place, as an eager forward's side half does), the host rewriting the tables in
    turn between replays: every replay stages the sources of its table's latest contents
    (int32 and int64 copies, fills, differences, strided copies, a shorter batch leaving the
    rest of the destination as the earlier one wrote it). And a table whose reader is still queued is
    not rewritten under it: ``send`` waits for that reader."""
    from sglang.jit_kernel.kv_canary.consts import (
        STAGE_A_INT32,
        STAGE_OP_COPY,
        STAGE_OP_FILL,
        STAGE_OP_STRIDE,
        STAGE_OP_SUB,
    )
    from sglang.jit_kernel.kv_canary.stage_inputs import launch_stage_inputs_kernel
    from sglang.srt.kv_canary.single_forward_manager.eager_graphs import StageTable

    dev = torch.device("cuda")
    table = StageTable(dev)
    assert all(t.is_pinned() and t.device.type == "cpu" for t in table.tables)
    dst = [torch.full((3000,), -1, dtype=torch.int64, device=dev) for _ in range(4)]
    launch_stage_inputs_kernel(table=table.tables[0], device=dev)  # compile (0 entries)
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in table.tables]
    for t, graph in zip(table.tables, graphs):
        with torch.cuda.graph(graph):
            launch_stage_inputs_kernel(table=t, device=dev)
    gen = torch.Generator().manual_seed(5)
    expected = [torch.full((3000,), -1, dtype=torch.int64) for _ in range(4)]
    for n in (3000, 17, 2049, 1, 700):
        a32 = torch.randint(0, 1 << 30, (n,), generator=gen, dtype=torch.int32).to(dev)
        a64 = torch.randint(0, 1 << 40, (n,), generator=gen).to(dev)
        table.put(dst[0].data_ptr(), n, STAGE_OP_COPY | STAGE_A_INT32, a32.data_ptr())
        table.put(
            dst[1].data_ptr(), n, STAGE_OP_SUB | STAGE_A_INT32, a32.data_ptr(), a64.data_ptr()
        )
        table.put(dst[2].data_ptr(), n, STAGE_OP_FILL, 0, n)
        # every 4th element of a32 (as a DFLASH draft block's row starts: positions[row * B])
        table.put(
            dst[3].data_ptr(), (n + 3) // 4, STAGE_OP_STRIDE | STAGE_A_INT32, a32.data_ptr(), 4
        )
        graphs[table.send()].replay()
        table.mark_read()
        torch.cuda.synchronize()
        expected[0][:n] = a32.cpu().to(torch.int64)
        expected[1][:n] = a32.cpu().to(torch.int64) - a64.cpu()
        expected[2][:n] = n
        expected[3][: (n + 3) // 4] = a32.cpu()[::4].to(torch.int64)
        for got, want in zip(dst, expected):
            assert torch.equal(got.cpu(), want)
    # a reader queued behind ~0.2 s of device work: the table it reads is written again two
    # sends later, and that send waits for it (the replay stages the fill of 5, not of 6)
    torch.cuda._sleep(400_000_000)
    table.put(dst[2].data_ptr(), 10, STAGE_OP_FILL, 0, 5)
    graphs[table.send()].replay()
    table.mark_read()
    table.send()
    table.put(dst[2].data_ptr(), 10, STAGE_OP_FILL, 0, 6)
    table.send()
    torch.cuda.synchronize()
    assert dst[2][:10].tolist() == [5] * 10


def test_a_draft_trees_parents_and_write_replay_with_the_lists_rewritten():
    """A target verify of draft trees (bs 3, 6 nodes each): the parent table from sglang's
    lists and the tree's chain write captured once, replayed with the lists, tokens and slots
    rewritten in place: records, ring and counters byte-equal to the torch references each
    replay, and no allocation across eager launches."""
    from kernel_oracle import sglang_tree_lists
    from sglang.jit_kernel.kv_canary import WriteTree, launch_canary_chain_writes
    from sglang.jit_kernel.kv_canary.tree_parents import (
        launch_tree_parents_kernel,
        tree_parents_torch_reference,
    )

    dev, bs, n = torch.device("cuda"), 3, 6
    gen = torch.Generator().manual_seed(11)
    first = torch.full((bs, n), -1, dtype=torch.int64, device=dev)
    sibling = torch.full((bs, n), -1, dtype=torch.int64, device=dev)
    ids = torch.zeros(bs * n, dtype=torch.int64, device=dev)
    pos = torch.zeros(bs * n, dtype=torch.int64, device=dev)
    loc = torch.zeros(bs * n, dtype=torch.int64, device=dev)
    plan = WritePlan.allocate(write_req_capacity=bs, device=dev)
    plan.write_offsets.copy_(torch.arange(bs + 1) * n)
    plan.write_seed_slot_indices.copy_(torch.tensor([7, 8, 9]))
    plan.write_req_to_token_rows.copy_(torch.arange(bs))
    plan.write_num_valid_reqs.fill_(bs)
    tree = WriteTree.allocate(capacity=bs * n, max_depth=4, device=dev)
    ctx = make_context(SLOTS, device=dev)
    ctx.canary_words[7:10] = torch.randint(0, 1000, (3, 4), generator=gen).to(dev)
    args = dict(
        plan=plan,
        input_ids=ids,
        positions=pos,
        out_cache_loc=loc,
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
        tree=tree,
    )

    def ops():
        launch_tree_parents_kernel(next_token=first, next_sibling=sibling, tree=tree)
        launch_canary_chain_writes(contexts=[ctx], **args)

    ops()  # compile
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ops()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops()
    ref = clone_context(ctx, "cpu")
    for step in range(3):
        parents = []
        for _ in range(bs):  # node i under a random earlier node, depth <= 4; node 5 orphaned
            depth = [1]
            row = [-1]
            for i in range(1, n):
                p = int(torch.randint(0, i, (1,), generator=gen))
                while depth[p] >= 4:
                    p = int(torch.randint(0, i, (1,), generator=gen))
                row.append(p if i < n - 1 or step == 0 else -2)
                depth.append(depth[p] + 1)
            parents.append((row, depth))
        f, sib = sglang_tree_lists([row for row, _ in parents])
        first.copy_(f)
        sibling.copy_(sib)
        ids.copy_(torch.randint(0, 30000, (bs * n,), generator=gen))
        pos.copy_(torch.tensor([10 + d - 1 for _, depth in parents for d in depth]))
        loc.copy_(torch.randperm(SLOTS - 16, generator=gen)[: bs * n] + 16)
        graph.replay()
        torch.cuda.synchronize()
        ref_tree = WriteTree.allocate(capacity=bs * n, max_depth=4, device="cpu")
        tree_parents_torch_reference(next_token=f, next_sibling=sib, tree=ref_tree)
        assert tree.parent.cpu().tolist() == ref_tree.parent.tolist()
        launch_canary_write_kernel_torch_reference(
            context=ref,
            **{
                **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()},
                "plan": clone_dataclass_tensors(plan, "cpu"),
                "tree": ref_tree,
            },
            parts=WriteParts.CHAIN,
        )
        assert_contexts_equal(ctx, ref)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
