"""Test helpers for the kernel suites: contexts, plans, snapshots and comparisons.

``run_both`` runs a launcher (Triton: compiled on CUDA, interpreted on CPU) and its torch
reference on independent copies of the same state and returns both states for comparison.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sglang.jit_kernel.kv_canary import (
    CANARY_SLOT_BYTES,
    CanaryLaunchTag,
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
)
from sglang.jit_kernel.kv_canary.consts import VIOLATION_NUM_FIELDS, to_int64


def make_context(
    num_slots: int,
    *,
    device,
    kind: CanaryLaunchTag = CanaryLaunchTag.TAIL_K_FULL,
    sources: Sequence[RealKvSource] = (),
    mode: RealKvHashMode = RealKvHashMode.NONE,
    ring_capacity: int = 256,
    chain_assert: int = 1,
    canary_buf: Optional[torch.Tensor] = None,
) -> VerifyOrWriteContext:
    buf = (
        canary_buf
        if canary_buf is not None
        else torch.zeros(num_slots, CANARY_SLOT_BYTES, dtype=torch.uint8, device=device)
    )
    return VerifyOrWriteContext(
        canary_buf=buf,
        kernel_kind=kind,
        violation_ring=torch.zeros(
            ring_capacity, VIOLATION_NUM_FIELDS, dtype=torch.int64, device=device
        ),
        violation_write_index=torch.zeros(1, dtype=torch.int32, device=device),
        slot_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
        kernel_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
        real_kv_sources=tuple(sources),
        real_kv_hash_mode=mode,
        enable_chain_position_assert=torch.full(
            (1,), chain_assert, dtype=torch.int32, device=device
        ),
    )


def clone_context(ctx: VerifyOrWriteContext, device=None) -> VerifyOrWriteContext:
    """Deep copy (records, ring, counters, source tensors) onto ``device`` (default: same)."""
    device = torch.device(device) if device is not None else ctx.device
    sources = tuple(
        RealKvSource(
            tensor=s.tensor.detach().to(device, copy=True),
            page_size=s.page_size,
            num_bytes_per_token=s.num_bytes_per_token,
            read_bytes=s.read_bytes,
        )
        for s in ctx.real_kv_sources
    )
    return VerifyOrWriteContext(
        canary_buf=ctx.canary_buf.to(device, copy=True),
        kernel_kind=ctx.kernel_kind,
        violation_ring=ctx.violation_ring.to(device, copy=True),
        violation_write_index=ctx.violation_write_index.to(device, copy=True),
        slot_run_counter=ctx.slot_run_counter.to(device, copy=True),
        kernel_run_counter=ctx.kernel_run_counter.to(device, copy=True),
        real_kv_sources=sources,
        real_kv_hash_mode=ctx.real_kv_hash_mode,
        enable_chain_position_assert=ctx.enable_chain_position_assert.to(device, copy=True),
    )


def clone_dataclass_tensors(obj, device=None):
    """Copy of a VerifyPlan / WritePlan with every tensor cloned onto ``device``."""
    import dataclasses

    kw = {}
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        v = getattr(obj, f.name)
        kw[f.name] = v.to(device if device is not None else v.device, copy=True)
    return type(obj)(**kw)


def records(ctx: VerifyOrWriteContext) -> torch.Tensor:
    """int64 ``[num_slots, 4]`` view of the records on the CPU."""
    return ctx.canary_words.cpu()


def ring_rows(ctx: VerifyOrWriteContext):
    """The kept violation rows as a sorted list of tuples (a multiset: launch order may differ)."""
    n = min(int(ctx.violation_write_index[0]), ctx.ring_capacity)
    rows = ctx.violation_ring[:n].cpu().tolist()
    return sorted(tuple(r) for r in rows)


def assert_contexts_equal(a: VerifyOrWriteContext, b: VerifyOrWriteContext) -> None:
    """Byte-equal records, equal ring multisets, write index and counters."""
    assert torch.equal(a.canary_buf.cpu(), b.canary_buf.cpu()), "canary buffers differ"
    assert int(a.violation_write_index[0]) == int(b.violation_write_index[0]), (
        f"violation_write_index {int(a.violation_write_index[0])} != "
        f"{int(b.violation_write_index[0])}"
    )
    assert ring_rows(a) == ring_rows(b), "violation rows differ"
    assert int(a.slot_run_counter[0]) == int(b.slot_run_counter[0]), "slot_run_counter differs"
    assert int(a.kernel_run_counter[0]) == int(b.kernel_run_counter[0]), (
        "kernel_run_counter differs"
    )


def assert_plans_equal(a, b) -> None:
    """Every tensor of two VerifyPlans / WritePlans byte-equal."""
    import dataclasses

    for f in dataclasses.fields(a):
        if not f.init:
            continue
        x, y = getattr(a, f.name).cpu(), getattr(b, f.name).cpu()
        assert torch.equal(x, y), f"{type(a).__name__}.{f.name} differs:\n{x}\n{y}"


def u64(x: int) -> int:
    return to_int64(x)


def chain_writes(records: torch.Tensor, plan, input_ids, positions, out_cache_loc, **_) -> dict:
    """Every record a write of these inputs stores, as ``{slot: [(token, position, prev_hash),
    ...]}`` in step order (``records``: the int64 ``[slots, 4]`` records before the launch;
    every chain starts from them: docs/architecture.md, "Write"). A slot listed more than once
    was written by several steps of the launch, which may run in parallel: it holds one of
    them."""
    from sglang.jit_kernel.kv_canary.consts import canary_chain_head_hash, canary_chain_step

    recs = records.cpu().tolist()
    num_slots = len(recs)
    nreq = min(max(int(plan.write_num_valid_reqs[0]), 0), plan.req_capacity)
    offsets = plan.write_offsets.cpu().tolist()
    seeds = plan.write_seed_slot_indices.cpu().tolist()
    ids, pos, loc = (t.cpu().tolist() for t in (input_ids, positions, out_cache_loc))
    out: dict = {}
    for r in range(nreq):
        seed = seeds[r]
        if 0 <= seed < num_slots:
            running = canary_chain_step(recs[seed][2], recs[seed][0], recs[seed][1])
        else:
            running = canary_chain_head_hash()
        for i in range(offsets[r], offsets[r + 1]):
            if not 0 <= i < len(ids):
                continue
            if 0 <= loc[i] < num_slots:
                out.setdefault(loc[i], []).append((ids[i], pos[i], to_int64(running)))
            running = canary_chain_step(running, ids[i], pos[i])
    return out


def adopt_rewritten_slots(got: VerifyOrWriteContext, want: VerifyOrWriteContext, writes) -> None:
    """For each slot ``writes`` (:func:`chain_writes`) lists more than once: ``got``'s record
    must be one of those writes; ``want`` takes it (token, position, prev_hash), so that the
    two contexts can be compared byte for byte after it."""
    for slot, candidates in writes.items():
        if len(candidates) < 2:
            continue
        held = tuple(got.canary_words[slot, :3].cpu().tolist())
        assert held in candidates, f"slot {slot} holds {held}, none of its writes {candidates}"
        want.canary_words[slot, :3] = got.canary_words[slot, :3].to(want.canary_words.device)
