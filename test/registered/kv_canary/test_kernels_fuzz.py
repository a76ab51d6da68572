"""Seeded differential fuzz: Triton kernels vs torch references, byte for byte.

Each case builds a random but server-shaped state (req_to_token rows with shared prefixes,
padding rows, graph-padding tokens, SWA tables with evictions, real-KV sources of several
layouts, expected-token pools), brings the records to a consistent state, corrupts a few
records and KV bytes, then runs plan → write → verify with both implementations from identical
inputs and compares every output: plans, canary buffers, violation rows (as a multiset), the
ring write index and the counters. Triton runs compiled on CUDA, in the interpreter on CPU.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

from canary_testlib import (
    adopt_rewritten_slots,
    assert_contexts_equal,
    assert_plans_equal,
    chain_writes,
    clone_context,
    clone_dataclass_tensors,
    make_context,
)
from sglang.jit_kernel.kv_canary import (
    CanaryLaunchTag,
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
    VerifyPlan,
    WriteParts,
    WritePlan,
    launch_canary_chain_writes,
    launch_canary_plan_kernels,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel,
    launch_canary_write_kernel_torch_reference,
    launch_scatter_packed_token_ids_kernel,
    launch_scatter_req_token_ids_kernel,
    scatter_packed_token_ids_torch_reference,
    scatter_req_token_ids_torch_reference,
)
from sglang.jit_kernel.kv_canary.consts import (
    VIOLATION_FIELD_EXPECTED_AUX,
    VIOLATION_FIELD_POSITION,
    VIOLATION_FIELD_SLOT_IDX,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")

NUM_SEEDS = 24

_SOURCE_DTYPES = (torch.uint8, torch.bfloat16, torch.float32, torch.int64)


def _random_source(rng: random.Random, g: torch.Generator, num_slots: int) -> RealKvSource:
    page_size = rng.choice((1, 2, 4))
    nbpt = rng.choice((8, 16, 24, 32, 64))
    read_bytes = 8 * rng.randint(1, nbpt // 8)
    dtype = rng.choice(_SOURCE_DTYPES)
    esize = torch.empty(0, dtype=dtype).element_size()
    num_pages = -(-num_slots // page_size) + rng.randint(0, 2)
    extra = rng.choice((0, 0, 8, 16))  # bytes of row padding beyond the page
    row_elems = (page_size * nbpt + extra) // esize
    raw = torch.randint(0, 256, (num_pages, row_elems * esize), dtype=torch.uint8, generator=g)
    tensor = raw.view(dtype)
    if rng.random() < 0.3 and extra == 0 and row_elems % page_size == 0:
        tensor = tensor.view(num_pages, page_size, row_elems // page_size)
    return RealKvSource(
        tensor=tensor, page_size=page_size, num_bytes_per_token=nbpt, read_bytes=read_bytes
    )


def _scenario(seed: int):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rows = rng.randint(2, 7)
    cols = rng.randint(4, 40)
    window = rng.choice((0, 0, rng.randint(1, cols)))
    full_slots = 1 + rows * cols + rng.randint(0, 16)
    # req_to_token: row 1 is a base sequence; other rows may share a prefix of it (radix hit),
    # the rest of every row is made of fresh slots.
    fresh = (torch.randperm(full_slots - 1, generator=g) + 1).tolist()
    r2t = torch.zeros(rows, cols, dtype=rng.choice((torch.int32, torch.int64)))
    shared = [0] * rows
    for row in range(1, rows):
        share = rng.randint(0, cols // 2) if row > 1 and rng.random() < 0.5 else 0
        shared[row] = share
        r2t[row, :share] = r2t[1, :share]
        for c in range(share, cols):
            r2t[row, c] = fresh.pop()
    tokens = torch.randint(0, 1000, (rows, cols), generator=g)
    for row in range(2, rows):
        tokens[row, : shared[row]] = tokens[1, : shared[row]]

    lut = None
    num_slots = full_slots
    if window:
        num_slots = rng.randint(full_slots // 2, full_slots)
        lut = torch.randint(1, num_slots, (full_slots + rng.randint(0, 4),), generator=g)
        lut[torch.rand(lut.shape, generator=g) < 0.25] = 0  # evicted from the SWA pool
        lut[0] = 0
        lut = lut.to(rng.choice((torch.int32, torch.int64)))

    def tr(x: torch.Tensor) -> torch.Tensor:
        if lut is None:
            return x
        return torch.where(x < 0, x, lut[x.clamp_min(0)].long())

    # the batch: distinct live rows (so write regions never overlap) plus padding rows
    live_rows = rng.sample(range(1, rows), rng.randint(0, rows - 1))
    batch = []
    for row in live_rows:
        prefix = rng.randint(max(shared[row], 0), cols - 1)
        batch.append((row, prefix, rng.randint(1, cols - prefix)))
    for _ in range(rng.randint(0, 2)):
        batch.insert(rng.randint(0, len(batch)), (0, rng.randint(0, 5), 1))
    rng.shuffle(batch)
    idx_dtype = rng.choice((torch.int32, torch.int64))
    rpi = torch.tensor([b[0] for b in batch], dtype=torch.int64)
    prefix = torch.tensor([b[1] for b in batch], dtype=idx_dtype)
    extend = torch.tensor([b[2] for b in batch], dtype=idx_dtype)

    ids, pos, loc = [], [], []
    for row, pre, ext in batch:
        if row == 0:
            continue
        ids.append(tokens[row, pre : pre + ext])
        pos.append(torch.arange(pre, pre + ext))
        loc.append(tr(r2t[row, pre : pre + ext].long()))
    pad = rng.randint(0, 3)  # CUDA-graph style padding tokens after the real ones
    ids.append(torch.zeros(pad, dtype=torch.int64))
    pos.append(torch.zeros(pad, dtype=torch.int64))
    loc.append(torch.zeros(pad, dtype=torch.int64))
    input_ids, positions, out_cache_loc = torch.cat(ids), torch.cat(pos), torch.cat(loc)
    if len(out_cache_loc) and rng.random() < 0.3:
        out_cache_loc[rng.randrange(len(out_cache_loc))] = -1  # skipped entry
    if len(positions) and rng.random() < 0.3:
        positions[rng.randrange(len(positions))] += rng.choice((-2, 1, 5))  # wrong position

    sources = [_random_source(rng, g, num_slots) for _ in range(rng.randint(0, 2))]
    mode = RealKvHashMode(rng.randint(0, 2)) if sources else RealKvHashMode.NONE
    kind = CanaryLaunchTag(rng.randrange(12))
    ctx = make_context(
        num_slots,
        device="cpu",
        kind=kind,
        sources=sources,
        mode=mode,
        ring_capacity=4096,
        chain_assert=rng.choice((0, 1)),
    )

    # consistent records for every row's history (written through the reference), then damage
    hist_plan = WritePlan.allocate(write_req_capacity=rows, device="cpu")
    hist_vp = VerifyPlan.allocate(verify_capacity=0, device="cpu")
    hist_rows = torch.arange(1, rows)
    launch_canary_plan_kernels_torch_reference(
        verify_plan_out=hist_vp,
        write_plan_out=hist_plan,
        req_pool_indices=hist_rows,
        prefix_lens=torch.zeros(rows - 1, dtype=torch.int64),
        extend_seq_lens=torch.full((rows - 1,), cols),
        req_to_token=r2t,
        swa_window_size=window,
        full_to_swa_index_mapping=lut,
        verify_capacity=0,
        req_to_verify_expected_tokens=None,
        req_to_verify_expected_tokens_valid_lens=None,
        kv_token_id_vs_position_offset=0,
    )
    launch_canary_write_kernel_torch_reference(
        context=ctx,
        plan=hist_plan,
        input_ids=tokens[1:].reshape(-1),
        positions=torch.arange(cols).repeat(rows - 1),
        out_cache_loc=tr(r2t[1:].reshape(-1).long()),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    words = ctx.canary_words
    for _ in range(rng.randint(0, 3)):
        words[rng.randrange(1, num_slots), rng.randrange(4)] ^= 1 << rng.randrange(63)
    for s in sources:
        if rng.random() < 0.5:
            s.words_view[
                rng.randrange(s.words_view.shape[0]), rng.randrange(s.words_view.shape[1])
            ] ^= 1
    ctx.violation_write_index.zero_()
    ctx.violation_ring.zero_()
    ctx.slot_run_counter.zero_()
    ctx.kernel_run_counter.zero_()

    exp_pool = exp_lens = None
    offset = rng.choice((0, 1))
    if rng.random() < 0.6:
        exp_pool = torch.full((rows, cols + 2), -1, dtype=torch.int32)
        exp_pool[:, :cols] = tokens.to(torch.int32)
        if offset:
            exp_pool[:, 1 : cols + 1] = tokens.to(torch.int32)
        exp_pool[rng.randrange(rows), rng.randrange(cols)] += 7  # one wrong expectation
        # valid lengths: anywhere, or just short of the prefix (recycled rows, spec positions)
        exp_lens = torch.tensor(
            [
                rng.choice((rng.randint(0, cols + 2), max(0, pre - rng.randint(0, 2))))
                for _, pre, _ in batch
            ],
            dtype=idx_dtype,
        )
    write_assert = rng.random() < 0.4
    exp_in_tok = input_ids.clone()
    exp_in_pos = positions.clone()
    if write_assert and len(exp_in_tok):
        exp_in_tok[rng.randrange(len(exp_in_tok))] += 1

    total_verify = sum(
        min(pre, cols) - (max(0, min(pre, cols) - window) if window else 0)
        for row, pre, _ in batch
        if row
    )
    verify_capacity = max(0, total_verify + rng.choice((0, 5, 40, -1 if total_verify else 0)))
    return dict(
        ctx=ctx,
        req_capacity=len(batch) + rng.randint(0, 3),
        verify_capacity=verify_capacity,
        plan_kwargs=dict(
            req_pool_indices=rpi.to(idx_dtype),
            prefix_lens=prefix,
            extend_seq_lens=extend,
            req_to_token=r2t,
            swa_window_size=window,
            full_to_swa_index_mapping=lut,
            verify_capacity=verify_capacity,
            req_to_verify_expected_tokens=exp_pool,
            req_to_verify_expected_tokens_valid_lens=exp_lens,
            kv_token_id_vs_position_offset=offset,
        ),
        write_kwargs=dict(
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            enable_write_input_assert=write_assert,
            expected_input_tokens=exp_in_tok if write_assert else None,
            expected_input_positions=exp_in_pos if write_assert else None,
        ),
        check_token=rng.random() < 0.5,
        garbage_plans=rng.random() < 0.5,
        seed=seed,
    )


def _to(kwargs: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("seed", range(NUM_SEEDS))
def test_plan_write_verify_match_reference(seed, device):
    sc = _scenario(seed)
    ref_ctx = sc["ctx"]
    tri_ctx = clone_context(ref_ctx, device)

    ref_vp = VerifyPlan.allocate(verify_capacity=sc["verify_capacity"], device="cpu")
    ref_wp = WritePlan.allocate(write_req_capacity=sc["req_capacity"], device="cpu")
    if sc["garbage_plans"]:  # stale contents from an earlier forward must not matter
        g = torch.Generator().manual_seed(seed)
        for t in (
            ref_vp.verify_slot_indices,
            ref_vp.verify_prev_slot_indices,
            ref_vp.verify_req_to_token_rows,
            ref_wp.write_req_to_token_rows,
            ref_wp.write_offsets,
            ref_wp.write_seed_slot_indices,
            ref_wp.verify_req_offsets,
        ):
            t.copy_(torch.randint(-5, 50, t.shape, generator=g))
    tri_vp = clone_dataclass_tensors(ref_vp, device)
    tri_wp = clone_dataclass_tensors(ref_wp, device)

    launch_canary_plan_kernels_torch_reference(
        verify_plan_out=ref_vp, write_plan_out=ref_wp, **sc["plan_kwargs"]
    )
    launch_canary_plan_kernels(
        verify_plan_out=tri_vp, write_plan_out=tri_wp, **_to(sc["plan_kwargs"], device)
    )
    assert_plans_equal(tri_vp, ref_vp)
    assert_plans_equal(tri_wp, ref_wp)

    writes = chain_writes(ref_ctx.canary_words.clone(), ref_wp, **sc["write_kwargs"])
    launch_canary_write_kernel_torch_reference(context=ref_ctx, plan=ref_wp, **sc["write_kwargs"])
    launch_canary_write_kernel(context=tri_ctx, plan=tri_wp, **_to(sc["write_kwargs"], device))
    adopt_rewritten_slots(tri_ctx, ref_ctx, writes)
    assert_contexts_equal(tri_ctx, ref_ctx)

    launch_canary_verify_kernel_torch_reference(
        context=ref_ctx, plan=ref_vp, check_verify_expected_token=sc["check_token"]
    )
    launch_canary_verify_kernel(
        context=tri_ctx, plan=tri_vp, check_verify_expected_token=sc["check_token"]
    )
    assert_contexts_equal(tri_ctx, ref_ctx)


@pytest.mark.parametrize("seed", range(0, NUM_SEEDS, 3))
def test_split_write_equals_one_write(seed, device):
    """CHAIN then FINGERPRINT (the runtime's split around the model forward) leaves the bytes,
    violation rows and counters of one ALL launch, in the reference and in Triton."""
    sc = _scenario(seed)
    ref_ctx = sc["ctx"]
    ref_split = clone_context(ref_ctx, "cpu")
    tri_split = clone_context(ref_ctx, device)
    wp = WritePlan.allocate(write_req_capacity=sc["req_capacity"], device="cpu")
    vp = VerifyPlan.allocate(verify_capacity=sc["verify_capacity"], device="cpu")
    launch_canary_plan_kernels_torch_reference(
        verify_plan_out=vp, write_plan_out=wp, **sc["plan_kwargs"]
    )
    tri_wp = clone_dataclass_tensors(wp, device)
    writes = chain_writes(ref_ctx.canary_words.clone(), wp, **sc["write_kwargs"])
    launch_canary_write_kernel_torch_reference(context=ref_ctx, plan=wp, **sc["write_kwargs"])
    for parts in (WriteParts.CHAIN, WriteParts.FINGERPRINT):
        launch_canary_write_kernel_torch_reference(
            context=ref_split, plan=wp, parts=parts, **sc["write_kwargs"]
        )
        launch_canary_write_kernel(
            context=tri_split, plan=tri_wp, parts=parts, **_to(sc["write_kwargs"], device)
        )
    assert_contexts_equal(ref_split, ref_ctx)
    adopt_rewritten_slots(tri_split, ref_ctx, writes)
    assert_contexts_equal(tri_split, ref_ctx)
    if ref_ctx.fingerprint_mode:  # the chain part alone leaves the fingerprints at 0
        only_chain = clone_context(sc["ctx"], "cpu")
        launch_canary_write_kernel_torch_reference(
            context=only_chain, plan=wp, parts=WriteParts.CHAIN, **sc["write_kwargs"]
        )
        total = int(wp.write_offsets[int(wp.write_num_valid_reqs)])
        slots = sc["write_kwargs"]["out_cache_loc"][:total].long()
        slots = slots[(slots > 0) & (slots < ref_ctx.num_slots)]
        assert (only_chain.canary_words[slots, 3] == 0).all()


def _sharing(ctx, buf, tag):
    """A context of another canary buffer (``buf``) and tag that shares ``ctx``'s ring, write
    index and chain-position flag (as a pool group's K/V x HEAD/TAIL endpoints do)."""
    return VerifyOrWriteContext(
        canary_buf=buf,
        kernel_kind=tag,
        violation_ring=ctx.violation_ring,
        violation_write_index=ctx.violation_write_index,
        slot_run_counter=torch.zeros(1, dtype=torch.int64, device=buf.device),
        kernel_run_counter=torch.zeros(1, dtype=torch.int64, device=buf.device),
        enable_chain_position_assert=ctx.enable_chain_position_assert,
    )


@pytest.mark.parametrize("num_bufs", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(0, NUM_SEEDS, 4))
def test_chain_writes_of_several_buffers_equal_one_launch_each(seed, num_bufs, device):
    """``launch_canary_chain_writes`` over up to four buffers (one launch, their chains side
    by side) leaves each buffer, counter and the shared ring as one CHAIN launch per buffer
    does, also when the buffers' seed records differ (each chain starts from its own)."""
    sc = _scenario(seed)
    g = torch.Generator().manual_seed(1000 + seed)
    base = sc["ctx"]
    tags = list(CanaryLaunchTag)[:num_bufs]
    bufs = [base.canary_buf.clone() for _ in range(num_bufs)]
    for b in bufs[1:]:  # other seed records: a few rows of the other buffers differ
        rows = torch.randint(0, base.num_slots, (3,), generator=g)
        b[rows] = torch.randint(0, 256, (3, b.shape[1]), generator=g, dtype=torch.uint8)
    wp = WritePlan.allocate(write_req_capacity=sc["req_capacity"], device="cpu")
    vp = VerifyPlan.allocate(verify_capacity=sc["verify_capacity"], device="cpu")
    launch_canary_plan_kernels_torch_reference(
        verify_plan_out=vp, write_plan_out=wp, **sc["plan_kwargs"]
    )
    ref_first = clone_context(base, "cpu")
    refs = [_sharing(ref_first, b.clone(), t) for b, t in zip(bufs, tags)]
    writes = [chain_writes(c.canary_words.clone(), wp, **sc["write_kwargs"]) for c in refs]
    for c in refs:
        launch_canary_write_kernel_torch_reference(
            context=c, plan=wp, parts=WriteParts.CHAIN, **sc["write_kwargs"]
        )
    tri_first = clone_context(base, device)
    tris = [_sharing(tri_first, b.to(device), t) for b, t in zip(bufs, tags)]
    launch_canary_chain_writes(
        contexts=tris, plan=clone_dataclass_tensors(wp, device), **_to(sc["write_kwargs"], device)
    )
    for tri, ref, w in zip(tris, refs, writes):
        adopt_rewritten_slots(tri, ref, w)
        assert_contexts_equal(tri, ref)
    assert int(tris[0].violation_write_index[0]) == int(refs[0].violation_write_index[0])


@pytest.mark.parametrize("num_bufs", [3, 4])
def test_chain_writes_of_more_requests_than_one_program_holds(num_bufs, device):
    """A batch of more requests than one program's lanes hold (32 lanes: 10 requests of three
    buffers, 8 of four), each of two tokens: every request's records written once per
    buffer, each slot counted once."""
    reqs = 24
    wp = WritePlan.allocate(write_req_capacity=reqs, device=device)
    wp.write_offsets.copy_(torch.arange(reqs + 1) * 2)
    wp.write_seed_slot_indices.fill_(-1)
    wp.write_req_to_token_rows.copy_(torch.arange(reqs))
    wp.write_num_valid_reqs.fill_(reqs)
    tokens = torch.arange(2 * reqs, device=device) + 100
    positions = torch.arange(2, device=device).repeat(reqs)
    slots = torch.arange(2 * reqs, device=device) + 1
    first = make_context(2 * reqs + 1, device=device)
    ctxs = [first] + [
        _sharing(first, torch.zeros_like(first.canary_buf), t)
        for t in list(CanaryLaunchTag)[1:num_bufs]
    ]
    launch_canary_chain_writes(
        contexts=ctxs,
        plan=wp,
        input_ids=tokens,
        positions=positions,
        out_cache_loc=slots,
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    for c in ctxs:
        words = c.canary_words.cpu()
        assert words[1:, 0].tolist() == (tokens.cpu()).tolist()
        assert words[1:, 1].tolist() == positions.cpu().tolist()
        assert int(c.slot_run_counter[0]) == 2 * reqs and int(c.kernel_run_counter[0]) == 1
    assert int(first.violation_write_index[0]) == 0


class _GridSpy:
    """Stands in for a Triton kernel: records each launch's grid, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def test_a_decode_launch_over_a_large_plan_takes_one_chain_program_a_token(device, monkeypatch):
    """A server's write plan holds ``--max-running-requests`` requests while a decode graph
    launches for a few: the chain part gets a program per token the launch holds (at most one
    request with work each), not one per plan row, and writes what the host walk says (a
    64-program device, so the plan's 48 rows would fit)."""
    from sglang.jit_kernel.kv_canary import _launch, write

    monkeypatch.setattr(_launch, "_max_programs", lambda *_: 64)
    spy = _GridSpy(write._canary_write_kernel)
    monkeypatch.setattr(write, "_canary_write_kernel", spy)
    reqs, capacity = 5, 48
    wp = WritePlan.allocate(write_req_capacity=capacity, device=device)
    wp.write_offsets.copy_(torch.arange(capacity + 1).clamp(max=reqs))
    wp.write_seed_slot_indices.fill_(-1)
    wp.write_req_to_token_rows.copy_(torch.arange(capacity))
    wp.write_num_valid_reqs.fill_(reqs)
    kwargs = dict(
        input_ids=torch.arange(reqs, device=device) + 100,
        positions=torch.arange(reqs, device=device) + 7,
        out_cache_loc=torch.arange(reqs, device=device) + 1,
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    ctx = make_context(reqs + 1, device=device)
    writes = chain_writes(ctx.canary_words.clone(), wp, **kwargs)
    launch_canary_write_kernel(context=ctx, plan=wp, parts=WriteParts.CHAIN, **kwargs)
    second = make_context(reqs + 1, device=device)
    launch_canary_chain_writes(contexts=[second], plan=wp, **kwargs)
    assert spy.grids == [(reqs,), (reqs,)]
    for c in (ctx, second):
        words = c.canary_words.cpu()
        for slot, [(tok, pos, prev)] in writes.items():
            assert words[slot, :3].tolist() == [tok, pos, prev], slot
        assert int(c.slot_run_counter[0]) == reqs and int(c.violation_write_index[0]) == 0


def _mixed_lengths_case(device):
    """423 requests: 420 of one step (seeded by random records, the head or slot 0; about one
    in twenty at a wrong position or token, a few after a seed record at another position),
    one of 1100 steps from a seed (a wrong position
    after its first 1024), one of 5 from the head, one of none; every token a new slot, the
    input assert on."""
    g = torch.Generator().manual_seed(7)
    lengths = [1100] + [1] * 420 + [0, 5]
    reqs, total, seeded = len(lengths), sum(lengths), 600
    num_slots = seeded + total + 1
    words = torch.randint(-(2**62), 2**62, (num_slots, 4), generator=g)
    words[seeded + 1 :] = 0
    seeds = torch.randperm(seeded, generator=g)[:reqs] + 1  # each its own seed record
    seeds[421:] = -1  # the last two from the head
    seeds[1:421:37] = -1
    seeds[2:421:41] = 0  # an evicted SWA predecessor: no position to follow
    positions, tokens = [], []
    for r, n in enumerate(lengths):
        first = 0
        if seeds[r] > 0:
            first = 1 + r % 50
            words[seeds[r], 1] = first - 1
        positions += list(range(first, first + n))
        tokens += torch.randint(0, 150_000, (n,), generator=g).tolist()
    positions, tokens = torch.tensor(positions), torch.tensor(tokens)
    stale = seeds[9:421:29]  # seed records at another position: only the chain check sees it
    words[stale[stale > 0], 1] += 5
    exp_tok, exp_pos = tokens.clone(), positions.clone()
    positions[1050] += 3  # the long request's second block
    singles = torch.arange(1100, 1520)
    positions[singles[::19]] += 1
    exp_tok[singles[5::23]] += 1
    wp = WritePlan.allocate(write_req_capacity=reqs + 7, device="cpu")
    wp.write_offsets[: reqs + 1].copy_(torch.tensor([0] + lengths).cumsum(0))
    wp.write_seed_slot_indices[:reqs].copy_(seeds)
    wp.write_req_to_token_rows[:reqs].copy_(torch.arange(reqs) + 3)
    wp.write_num_valid_reqs.fill_(reqs)
    kwargs = dict(
        input_ids=tokens,
        positions=positions,
        out_cache_loc=torch.arange(total) + seeded + 1,
        enable_write_input_assert=True,
        expected_input_tokens=exp_tok,
        expected_input_positions=exp_pos,
    )
    return num_slots, words, wp, kwargs


def test_chain_writes_of_one_step_and_long_requests_match_reference(device):
    """One-step requests (a lane each, several blocks of them per program) beside a request
    longer than a block (its state carried into the next) and a short one, in two buffers with
    different seed records: records, violation rows and counters as one reference launch per
    buffer, and the violations of both kinds of request are there."""
    num_slots, words, wp, kwargs = _mixed_lengths_case(device)
    refs, tris = [], []
    for b, tag in enumerate((CanaryLaunchTag.HEAD_K_FULL, CanaryLaunchTag.TAIL_K_FULL)):
        buf = words.clone()
        buf[1:600, 2] += b  # the second buffer's seed records differ
        buf = buf.view(torch.uint8)
        ring = dict(ring_capacity=1024, kind=tag)
        refs.append(make_context(num_slots, device="cpu", canary_buf=buf.clone(), **ring))
        tris.append(make_context(num_slots, device=device, canary_buf=buf.to(device), **ring))
    refs[1] = _sharing(refs[0], refs[1].canary_buf, refs[1].kernel_kind)
    tris[1] = _sharing(tris[0], tris[1].canary_buf, tris[1].kernel_kind)
    for c in refs:
        launch_canary_write_kernel_torch_reference(
            context=c, plan=wp, parts=WriteParts.CHAIN, **kwargs
        )
    launch_canary_chain_writes(
        contexts=tris, plan=clone_dataclass_tensors(wp, device), **_to(kwargs, device)
    )
    for tri, ref in zip(tris, refs):
        assert_contexts_equal(tri, ref)
    num_rows = int(refs[0].violation_write_index[0])
    assert num_rows <= 1024  # every row kept
    rows = refs[0].violation_ring[:num_rows]
    slots = set(rows[:, VIOLATION_FIELD_SLOT_IDX].tolist())
    assert 600 + 1 + 1050 in slots  # the long request, after its first block
    assert len(slots & set(range(601 + 1100, 601 + 1520))) >= 20  # one-step requests
    chain_only = rows[
        rows[:, VIOLATION_FIELD_POSITION] == rows[:, VIOLATION_FIELD_EXPECTED_AUX] - 5
    ]
    assert len(chain_only) >= 10  # the stale seeds' steps, caught by the chain check alone


def test_chain_writes_refuse_contexts_they_cannot_run_together():
    sc = _scenario(0)
    ctx = sc["ctx"]
    wp = WritePlan.allocate(write_req_capacity=sc["req_capacity"], device="cpu")
    kw = dict(plan=wp, **sc["write_kwargs"])
    other = [_sharing(ctx, ctx.canary_buf.clone(), t) for t in list(CanaryLaunchTag)[:5]]
    with pytest.raises(ValueError, match="takes 1 to 4 contexts, got 0"):
        launch_canary_chain_writes(contexts=[], **kw)
    with pytest.raises(ValueError, match="takes 1 to 4 contexts, got 5"):
        launch_canary_chain_writes(contexts=other, **kw)
    with pytest.raises(ValueError, match="distinct canary buffers"):
        launch_canary_chain_writes(contexts=[other[0], other[0]], **kw)
    with pytest.raises(ValueError, match="share one violation_ring"):
        launch_canary_chain_writes(contexts=[other[0], clone_context(other[1])], **kw)
    small = _sharing(ctx, ctx.canary_buf[:-1].clone(), CanaryLaunchTag(0))
    with pytest.raises(ValueError, match="same slot count"):
        launch_canary_chain_writes(contexts=[other[0], small], **kw)


def test_fuzz_exercises_every_path():
    """The seeds above must cover what they claim to (guards against a degenerate generator)."""
    seen = set()
    for seed in range(NUM_SEEDS):
        sc = _scenario(seed)
        ctx = sc["ctx"]
        pk, wk = sc["plan_kwargs"], sc["write_kwargs"]
        seen.add(f"mode_{ctx.real_kv_hash_mode.name}")
        seen.add("swa" if pk["swa_window_size"] else "full")
        seen.add("padding_row" if bool((pk["req_pool_indices"] == 0).any()) else "no_padding")
        seen.add("expected_tokens" if pk["req_to_verify_expected_tokens"] is not None else "")
        seen.add("write_assert" if wk["enable_write_input_assert"] else "")
        seen.add("skip_slot" if bool((wk["out_cache_loc"] < 0).any()) else "")
        ref_vp = VerifyPlan.allocate(verify_capacity=sc["verify_capacity"], device="cpu")
        ref_wp = WritePlan.allocate(write_req_capacity=sc["req_capacity"], device="cpu")
        launch_canary_plan_kernels_torch_reference(
            verify_plan_out=ref_vp, write_plan_out=ref_wp, **pk
        )
        seen.add("overflow" if int(ref_vp.enable) == 0 else "fits")
        launch_canary_write_kernel_torch_reference(context=ctx, plan=ref_wp, **wk)
        launch_canary_verify_kernel_torch_reference(
            context=ctx, plan=ref_vp, check_verify_expected_token=sc["check_token"]
        )
        if int(ctx.violation_write_index) > 0:
            seen.add("violations")
        else:
            seen.add("clean")
    for want in (
        "mode_NONE",
        "mode_PARTIAL",
        "mode_ALL",
        "swa",
        "full",
        "padding_row",
        "expected_tokens",
        "write_assert",
        "skip_slot",
        "overflow",
        "fits",
        "violations",
        "clean",
    ):
        assert want in seen, f"fuzz seeds never produce {want}"


def _packed(rows_fields, flat, n=None):
    n = len(rows_fields) if n is None else n
    return torch.tensor(
        [n] + [v for row in rows_fields for v in row] + list(flat), dtype=torch.int64
    )


@pytest.mark.parametrize("seed", range(10))
def test_packed_scatter_matches_reference_and_definition(seed, device):
    """Random packed uploads (incremental starts, negative / past-the-width starts, rows
    outside the pool, a launch over more rows than requests (a graph's padding), a buffer
    longer than its content (a static buffer) or cut short): Triton (compiled or
    interpreted) byte-equal to the reference, and both to the definition written out."""
    rng = random.Random(4000 + seed)
    g = torch.Generator().manual_seed(seed)
    n = rng.randint(0, 6)
    launch_rows = n + rng.choice([0, 0, 1, 3])
    pool_rows, cols = launch_rows + rng.randint(1, 4), rng.randint(1, 20)
    rows_fields, flat = [], []
    for _ in range(n):
        length = rng.randint(0, cols + 5)
        start = rng.choice([0, 0, rng.randint(0, length), rng.randint(-2, -1), length + 2])
        rows_fields.append((length, start, len(flat)))
        flat += torch.randint(-5, 2**40, (max(0, length - start),), generator=g).tolist()
    packed = _packed(rows_fields, flat)
    tail = rng.choice(["exact", "longer", "cut"])
    if tail == "longer":
        packed = torch.cat([packed, torch.full((rng.randint(1, 9),), 77, dtype=torch.int64)])
    elif tail == "cut" and flat:
        packed = packed[: -rng.randint(1, len(flat))]
    short = 1 + 3 * launch_rows - packed.shape[0]  # the launch's rows need their header words
    if short > 0:
        packed = torch.cat([packed, torch.full((short,), 66, dtype=torch.int64)])
    rpi = torch.tensor(rng.sample(range(-1, pool_rows + 1), launch_rows), dtype=torch.int64)
    pool = torch.randint(-9, 9, (pool_rows, cols), dtype=torch.int32, generator=g)
    lens0 = torch.full((launch_rows,), 55, dtype=torch.int64)
    ref, ref_lens = pool.clone(), lens0.clone()
    scatter_packed_token_ids_torch_reference(
        packed=packed, req_pool_indices=rpi, pool_out=ref, valid_lens_out=ref_lens
    )
    out, out_lens = pool.to(device), lens0.to(device)
    launch_scatter_packed_token_ids_kernel(
        packed=packed.to(device),
        req_pool_indices=rpi.to(device),
        pool_out=out,
        valid_lens_out=out_lens,
    )
    assert torch.equal(out.cpu(), ref) and torch.equal(out_lens.cpu(), ref_lens)
    want, want_lens = pool.clone(), lens0.clone()
    for r in range(launch_rows):
        if r >= n:
            want_lens[r] = 0
            continue
        length, start, offset = rows_fields[r]
        want_lens[r] = length
        row = int(rpi[r])
        if not 0 <= row < pool_rows or start < 0:
            continue
        for p in range(start, min(length, cols)):
            at = 1 + 3 * n + offset + (p - start)
            if at < packed.shape[0]:
                want[row, p] = packed[at].to(torch.int32)
    assert torch.equal(ref, want) and torch.equal(ref_lens, want_lens)


@pytest.mark.parametrize("with_starts", [False, True], ids=["whole", "dst_starts"])
@pytest.mark.parametrize("seed", range(8))
def test_scatter_matches_reference(seed, device, with_starts):
    rng = random.Random(1000 + seed)
    g = torch.Generator().manual_seed(seed)
    bs = rng.randint(0, 9)
    rows, cols = rng.randint(bs + 1, bs + 5), rng.randint(1, 24)
    lens = [rng.randint(0, cols + 6) for _ in range(bs)]
    offsets = torch.tensor([0] + lens).cumsum(0)
    flat = torch.randint(-3, 2**40, (int(offsets[-1]),), generator=g)
    rpi = torch.tensor(rng.sample(range(rows), bs), dtype=torch.int64)
    pool = torch.randint(-9, 9, (rows, cols), dtype=torch.int32, generator=g)
    starts = (
        torch.tensor([rng.randint(-2, cols + 2) for _ in range(bs)], dtype=torch.int64)
        if with_starts
        else None
    )
    ref = pool.clone()
    scatter_req_token_ids_torch_reference(
        flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=ref, dst_starts=starts
    )
    out = pool.to(device)
    launch_scatter_req_token_ids_kernel(
        flat_in=flat.to(device),
        offsets=offsets.to(device),
        req_pool_indices=rpi.to(device),
        pool_out=out,
        dst_starts=starts.to(device) if with_starts else None,
    )
    assert torch.equal(out.cpu(), ref)
    # and the reference itself against the definition
    want = pool.clone()
    for r in range(bs):
        first = int(starts[r]) if with_starts else 0
        if first < 0:
            continue
        for p in range(min(lens[r], cols - first)):
            want[rpi[r], first + p] = torch.tensor(int(flat[offsets[r] + p])).to(torch.int32)
    assert torch.equal(ref, want)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
