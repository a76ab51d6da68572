"""Canary write kernel and its plan (SPEC §5).

``launch_canary_write_kernel`` stores a fresh record for every slot a forward writes: token,
position, the running chain hash of the request, and (TAIL launches) the real-KV fingerprint.
One part of the grid walks each request's chain serially (lanes = requests, loop = chain steps);
the other part fingerprints all written slots in parallel. Graph-safe on CUDA.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary import _hash_triton as H
from sglang.jit_kernel.kv_canary._launch import (
    INDEX_DTYPES,
    check_int,
    check_tensor,
    grid_size,
    same_device,
    use_triton,
)
from sglang.jit_kernel.kv_canary.verify import VerifyOrWriteContext, append_violations


class WriteParts(enum.Enum):
    """Which part of the write a launch does. ``CHAIN`` then ``FINGERPRINT`` (in stream order)
    leaves exactly the bytes, violations and counters of one ``ALL`` launch; split, the serial
    chain (which needs no KV bytes) can run before / beside the model forward and only the
    parallel fingerprint after it.

    - ``ALL``: records with chain and fingerprint (one launch).
    - ``CHAIN``: token, position, chain hash, checks, counters; ``real_kv_hash`` stored as 0.
    - ``FINGERPRINT``: only ``real_kv_hash`` of every written slot; no checks, no counters; a
      no-op without real-data fingerprints.
    """

    ALL = "all"
    CHAIN = "chain"
    FINGERPRINT = "fingerprint"


@dataclasses.dataclass(frozen=True, eq=False)
class WritePlan:
    """Per-forward write layout (device, fixed request capacity; filled by the plan kernels).

    - ``write_offsets`` int64 ``[req_capacity + 1]``: request r writes the entries
      ``[write_offsets[r], write_offsets[r + 1])`` of ``input_ids`` / ``positions`` /
      ``out_cache_loc``; zero beyond the batch.
    - ``write_seed_slot_indices`` int64 ``[req_capacity]``: slot holding position
      ``prefix_len - 1`` (the chain seed), -1 for a chain head or a padding row.
    - ``write_num_valid_reqs`` int32 ``[1]``: the batch size.
    - ``verify_req_offsets`` int64 ``[req_capacity + 1]``: plan-internal scratch (per-request
      exclusive prefix sum of verify entries), read by the plan's entries stage only.
    """

    write_offsets: torch.Tensor
    write_seed_slot_indices: torch.Tensor
    write_num_valid_reqs: torch.Tensor
    verify_req_offsets: torch.Tensor

    def __post_init__(self):
        seeds = check_tensor("WritePlan.write_seed_slot_indices", self.write_seed_slot_indices,
                             dtypes=(torch.int64,), ndim=1)
        cap = seeds.shape[0]
        check_tensor("WritePlan.write_offsets", self.write_offsets, dtypes=(torch.int64,),
                     shape=(cap + 1,))
        check_tensor("WritePlan.verify_req_offsets", self.verify_req_offsets,
                     dtypes=(torch.int64,), shape=(cap + 1,))
        check_tensor("WritePlan.write_num_valid_reqs", self.write_num_valid_reqs,
                     dtypes=(torch.int32,), shape=(1,))
        same_device({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @property
    def req_capacity(self) -> int:
        return self.write_seed_slot_indices.shape[0]

    @property
    def device(self) -> torch.device:
        return self.write_seed_slot_indices.device

    @classmethod
    def allocate(cls, *, write_req_capacity: int, device) -> "WritePlan":
        check_int("write_req_capacity", write_req_capacity, minimum=0)
        device = torch.device(device)
        return cls(
            write_offsets=torch.zeros(write_req_capacity + 1, dtype=torch.int64, device=device),
            write_seed_slot_indices=torch.full((write_req_capacity,), -1, dtype=torch.int64,
                                               device=device),
            write_num_valid_reqs=torch.zeros(1, dtype=torch.int32, device=device),
            verify_req_offsets=torch.zeros(write_req_capacity + 1, dtype=torch.int64,
                                           device=device),
        )


@triton.jit
def _canary_write_kernel(
    canary_ptr, num_slots,
    offsets_ptr, seeds_ptr, num_reqs_ptr, req_capacity,
    input_ids_ptr, positions_ptr, loc_ptr, num_tokens, exp_tok_ptr, exp_pos_ptr,
    chain_assert_ptr,
    ring_ptr, ring_index_ptr, ring_capacity, slot_counter_ptr, kernel_counter_ptr, kernel_kind,
    s0_ptr, s0_stride, s0_page, s0_wpt, s0_nwords,
    s1_ptr, s1_stride, s1_page, s1_wpt, s1_nwords,
    s2_ptr, s2_stride, s2_page, s2_wpt, s2_nwords,
    s3_ptr, s3_stride, s3_page, s3_wpt, s3_nwords,
    num_chain_programs,
    INPUT_ASSERT: tl.constexpr,
    NUM_SOURCES: tl.constexpr,
    RBLOCK: tl.constexpr,
    FBLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_reqs = tl.minimum(tl.maximum(tl.load(num_reqs_ptr), 0), req_capacity)
    if pid < num_chain_programs:
        # ---- serial chains: lanes are requests, the loop walks chain steps ----
        if pid == 0:
            tl.atomic_add(kernel_counter_ptr, 1)
        chain_assert_on = tl.load(chain_assert_ptr) == 1
        head = H.chain_head_hash()
        written = tl.zeros([RBLOCK], dtype=tl.int64)
        for rstart in range(pid * RBLOCK, num_reqs, num_chain_programs * RBLOCK):
            r = rstart + tl.arange(0, RBLOCK)
            rmask = r < num_reqs
            start = tl.load(offsets_ptr + r, mask=rmask, other=0)
            end = tl.load(offsets_ptr + r + 1, mask=rmask, other=0)
            length = tl.where(rmask, tl.maximum(end - start, 0), 0)
            seed = tl.load(seeds_ptr + r, mask=rmask, other=-1)
            seed_ok = rmask & (seed >= 0) & (seed < num_slots)
            running = tl.where(seed_ok, H.record_hash(canary_ptr, seed, seed_ok), head)
            prev_pos = tl.load(canary_ptr + seed * 4 + 1, mask=seed_ok, other=0)
            # slot 0 (an evicted SWA predecessor) holds no real record: no position to follow
            check_pos = seed_ok & (seed > 0) & chain_assert_on
            # Step j's inputs are loaded during step j-1 (software pipelining): the chain is
            # serial, the loads are not.
            act_n = (0 < length) & (start >= 0) & (start < num_tokens)
            tok_n = tl.load(input_ids_ptr + start, mask=act_n, other=0).to(tl.int64)
            pos_n = tl.load(positions_ptr + start, mask=act_n, other=0).to(tl.int64)
            slot_n = tl.load(loc_ptr + start, mask=act_n, other=-1).to(tl.int64)
            for j in range(0, tl.max(length, axis=0)):
                i = start + j
                act, tok, pos, slot = act_n, tok_n, pos_n, slot_n
                act_n = (j + 1 < length) & (i + 1 >= 0) & (i + 1 < num_tokens)
                tok_n = tl.load(input_ids_ptr + i + 1, mask=act_n, other=0).to(tl.int64)
                pos_n = tl.load(positions_ptr + i + 1, mask=act_n, other=0).to(tl.int64)
                slot_n = tl.load(loc_ptr + i + 1, mask=act_n, other=-1).to(tl.int64)
                store_ok = act & (slot >= 0) & (slot < num_slots)
                rec = canary_ptr + slot * 4
                tl.store(rec + 0, tok, mask=store_ok)
                tl.store(rec + 1, pos, mask=store_ok)
                tl.store(rec + 2, H.as_i64(running), mask=store_ok)
                if NUM_SOURCES == 0:
                    tl.store(rec + 3, tl.zeros_like(tok), mask=store_ok)
                bits = tl.zeros([RBLOCK], dtype=tl.int64)
                if INPUT_ASSERT:
                    exp_tok = tl.load(exp_tok_ptr + i, mask=act, other=0).to(tl.int64)
                    exp_pos = tl.load(exp_pos_ptr + i, mask=act, other=0).to(tl.int64)
                    bits |= tl.where(tok != exp_tok, 8, 0)
                    bits |= tl.where(pos != exp_pos, 16, 0)
                else:
                    exp_tok = tok
                    exp_pos = pos
                chain_bad = check_pos & (pos != prev_pos + 1)
                bits |= tl.where(chain_bad, 16, 0)
                exp_pos = tl.where(chain_bad, prev_pos + 1, exp_pos)
                append_violations(
                    ring_ptr, ring_index_ptr, ring_capacity, store_ok & (bits != 0),
                    kernel_kind, slot, pos, tok, exp_tok, H.as_i64(running), exp_pos, bits,
                )
                written += store_ok.to(tl.int64)
                running = tl.where(act, H.mix3(running, H.as_u64(tok), H.as_u64(pos)), running)
                prev_pos = tl.where(act, pos, prev_pos)
        tl.atomic_add(slot_counter_ptr, tl.sum(written, axis=0))
    else:
        # ---- real-KV fingerprints of every written slot, in parallel ----
        if NUM_SOURCES > 0:
            fpid = pid - num_chain_programs
            nfp = tl.num_programs(0) - num_chain_programs
            total = tl.minimum(tl.maximum(tl.load(offsets_ptr + num_reqs), 0), num_tokens)
            for fstart in range(fpid * FBLOCK, total, nfp * FBLOCK):
                i = fstart + tl.arange(0, FBLOCK)
                m = i < total
                slot = tl.load(loc_ptr + i, mask=m, other=-1).to(tl.int64)
                ok = m & (slot >= 0) & (slot < num_slots)
                fp = H.real_kv_fingerprint(
                    slot, ok, NUM_SOURCES,
                    s0_ptr, s0_stride, s0_page, s0_wpt, s0_nwords,
                    s1_ptr, s1_stride, s1_page, s1_wpt, s1_nwords,
                    s2_ptr, s2_stride, s2_page, s2_wpt, s2_nwords,
                    s3_ptr, s3_stride, s3_page, s3_wpt, s3_nwords,
                )
                tl.store(canary_ptr + slot * 4 + 3, H.as_i64(fp), mask=ok)


WRITE_REQ_BLOCK = 32
WRITE_FINGERPRINT_BLOCK = 128


def validate_write_args(*, context, plan, input_ids, positions, out_cache_loc,
                        enable_write_input_assert, expected_input_tokens,
                        expected_input_positions, parts=WriteParts.ALL) -> None:
    """Host-side checks shared by the launcher and the torch reference (metadata only)."""
    if not isinstance(parts, WriteParts):
        raise TypeError(f"parts must be a WriteParts, got {parts!r}")
    if not isinstance(context, VerifyOrWriteContext):
        raise TypeError(f"context must be a VerifyOrWriteContext, got {type(context).__name__}")
    if not isinstance(plan, WritePlan):
        raise TypeError(f"plan must be a WritePlan, got {type(plan).__name__}")
    if not isinstance(enable_write_input_assert, bool):
        raise TypeError("enable_write_input_assert must be a bool, got "
                        f"{type(enable_write_input_assert).__name__}")
    n = check_tensor("input_ids", input_ids, dtypes=INDEX_DTYPES, ndim=1).shape[0]
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(n,))
    check_tensor("out_cache_loc", out_cache_loc, dtypes=INDEX_DTYPES, shape=(n,))
    if enable_write_input_assert:
        for name, t in (("expected_input_tokens", expected_input_tokens),
                        ("expected_input_positions", expected_input_positions)):
            if t is None:
                raise ValueError(f"{name} is required when enable_write_input_assert=True")
            check_tensor(name, t, dtypes=INDEX_DTYPES, shape=(n,))
    same_device({
        "context.canary_buf": context.canary_buf, "plan.write_offsets": plan.write_offsets,
        "input_ids": input_ids, "positions": positions, "out_cache_loc": out_cache_loc,
        "expected_input_tokens": expected_input_tokens if enable_write_input_assert else None,
        "expected_input_positions": expected_input_positions if enable_write_input_assert else None,
    })


def launch_canary_write_kernel(
    *,
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    enable_write_input_assert: bool,
    expected_input_tokens: Optional[torch.Tensor],
    expected_input_positions: Optional[torch.Tensor],
    parts: WriteParts = WriteParts.ALL,
) -> None:
    """Write the canary records of this forward's new KV slots (``parts``: all of it, or only
    the chain / only the fingerprints, see :class:`WriteParts`).

    ``input_ids`` / ``positions`` / ``out_cache_loc``: int32 or int64 ``[num_tokens]``, laid out
    as ``plan.write_offsets`` says (SWA callers pass translated slots). Per live request, serially:
    slot < 0 → entry skipped (no store, no check), but the chain still advances;
    store ``(token, position, running, fingerprint)`` and advance
    ``running = mix3(running, token, position)``, starting from ``H(record[seed])`` or
    ``H(none)``. Checks: token/position vs ``expected_input_*`` (``enable_write_input_assert``)
    and, when the request has a real seed (``seed > 0``; slot 0 is the padding slot an evicted
    SWA predecessor translates to) and ``context.enable_chain_position_assert == 1``,
    position == previous position + 1 (starting from the seed record's position). Violation rows: tag, slot, position, token, expected
    token (``expected_input_tokens[i]`` if the input assert is on, else the token), running
    chain hash, expected position, bits. Counters: kernel +1, slot + entries stored.
    """
    kwargs = dict(context=context, plan=plan, input_ids=input_ids, positions=positions,
                  out_cache_loc=out_cache_loc, enable_write_input_assert=enable_write_input_assert,
                  expected_input_tokens=expected_input_tokens,
                  expected_input_positions=expected_input_positions, parts=parts)
    validate_write_args(**kwargs)
    if not use_triton(context.device):
        from sglang.jit_kernel.kv_canary.write_ref import launch_canary_write_kernel_torch_reference

        return launch_canary_write_kernel_torch_reference(**kwargs)
    num_tokens = input_ids.shape[0]
    num_sources = len(context.real_kv_sources) if context.fingerprint_mode else 0
    n_chain = grid_size(context.device, plan.req_capacity, WRITE_REQ_BLOCK)
    n_fp = grid_size(context.device, num_tokens, WRITE_FINGERPRINT_BLOCK) if num_sources else 0
    if parts == WriteParts.CHAIN:
        num_sources, n_fp = 0, 0  # the chain part then stores real_kv_hash = 0
    elif parts == WriteParts.FINGERPRINT:
        if not n_fp:
            return
        n_chain = 0
    if enable_write_input_assert:
        exp_tok, exp_pos = expected_input_tokens, expected_input_positions
    else:  # never dereferenced: INPUT_ASSERT is a constexpr
        exp_tok, exp_pos = input_ids, positions
    _canary_write_kernel[(n_chain + n_fp,)](
        context.canary_words, context.num_slots,
        plan.write_offsets, plan.write_seed_slot_indices, plan.write_num_valid_reqs,
        plan.req_capacity,
        input_ids, positions, out_cache_loc, num_tokens, exp_tok, exp_pos,
        context.enable_chain_position_assert,
        context.violation_ring, context.violation_write_index, context.ring_capacity,
        context.slot_run_counter, context.kernel_run_counter, int(context.kernel_kind),
        *context.source_launch_args,
        n_chain,
        INPUT_ASSERT=enable_write_input_assert,
        NUM_SOURCES=num_sources,
        RBLOCK=WRITE_REQ_BLOCK,
        FBLOCK=WRITE_FINGERPRINT_BLOCK,
    )
