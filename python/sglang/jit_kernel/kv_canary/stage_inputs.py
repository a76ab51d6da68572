"""Stage a forward's launch inputs into static buffers from a table of addresses
(docs/performance.md, "The forward path"; the table's layout: ``consts.STAGE_*``).

``launch_stage_inputs_kernel``: for each of the table's entries, ``dst[i] = A[i]`` (copy),
``= B`` (fill), ``= A[i] - B[i]`` (subtract) or ``= A[i * B]`` (stride: B an element count >=
1) for ``i < numel``, int64 results from int32 or int64 sources. The table is device data, so
one launch captured in a CUDA graph stages every forward the graph replays: the host writes
the next forward's addresses into the table before the replay. On CUDA the table may be pinned
host memory, which the kernel reads in place (no copy to the device; its loads cross the bus
when it runs). Destinations must not overlap any source. Allocation- and sync-free; grid
``(STAGE_MAX_ENTRIES, splits)`` (an entry's programs stride over its elements). The torch
reference (CPU tensors, through the addresses themselves) is the launcher's CPU path.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary._checks import check_tensor
from sglang.jit_kernel.kv_canary._launch import grid_size, use_triton
from sglang.jit_kernel.kv_canary.consts import (
    STAGE_A,
    STAGE_A_INT32,
    STAGE_B,
    STAGE_B_INT32,
    STAGE_DST,
    STAGE_ENTRY_FIELDS,
    STAGE_HEADER,
    STAGE_KIND,
    STAGE_MAX_ENTRIES,
    STAGE_NUM_ENTRIES,
    STAGE_NUMEL,
    STAGE_OP_COPY,
    STAGE_OP_FILL,
    STAGE_OP_MASK,
    STAGE_OP_STRIDE,
    STAGE_OP_SUB,
    STAGE_TABLE_NUMEL,
)

STAGE_BLOCK = 1024
STAGE_MAX_SPLITS = 16


@triton.jit
def _stage_inputs_kernel(
    table_ptr,
    NUM_ENTRIES: tl.constexpr,
    HEADER: tl.constexpr,
    FIELDS: tl.constexpr,
    F_DST: tl.constexpr,
    F_A: tl.constexpr,
    F_B: tl.constexpr,
    F_NUMEL: tl.constexpr,
    F_KIND: tl.constexpr,
    OP_MASK: tl.constexpr,
    OP_FILL: tl.constexpr,
    OP_SUB: tl.constexpr,
    OP_STRIDE: tl.constexpr,
    A_INT32: tl.constexpr,
    B_INT32: tl.constexpr,
    BLOCK: tl.constexpr,
):
    e = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    count = tl.load(table_ptr + NUM_ENTRIES)
    if e < count:
        entry = table_ptr + HEADER + e * FIELDS
        dst = tl.load(entry + F_DST).to(tl.pointer_type(tl.int64))
        a = tl.load(entry + F_A)
        b = tl.load(entry + F_B)
        n = tl.load(entry + F_NUMEL)
        kind = tl.load(entry + F_KIND)
        op = kind & OP_MASK
        # A's element step: B for a strided copy, 1 otherwise (B is an address or a value then)
        step = tl.where(op == OP_STRIDE, b, 1).to(tl.int64)
        for start in range(split * BLOCK, n, nsplit * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            if op == OP_FILL:
                v = tl.zeros([BLOCK], dtype=tl.int64) + b
            else:
                src = offs.to(tl.int64) * step
                if (kind & A_INT32) != 0:
                    v = tl.load(a.to(tl.pointer_type(tl.int32)) + src, mask=m).to(tl.int64)
                else:
                    v = tl.load(a.to(tl.pointer_type(tl.int64)) + src, mask=m)
                if op == OP_SUB:
                    if (kind & B_INT32) != 0:
                        w = tl.load(b.to(tl.pointer_type(tl.int32)) + offs, mask=m).to(tl.int64)
                    else:
                        w = tl.load(b.to(tl.pointer_type(tl.int64)) + offs, mask=m)
                    v = v - w
            tl.store(dst + offs, v, mask=m)


def _validate_table(table: torch.Tensor) -> torch.Tensor:
    return check_tensor("table", table, dtypes=(torch.int64,), shape=(STAGE_TABLE_NUMEL,))


def _check_table_reachable(table: torch.Tensor, device: torch.device) -> None:
    """Raise ``ValueError`` unless the kernel running on ``device`` can read ``table``: on
    ``device`` itself, or (CUDA) pinned host memory."""
    if table.device == device:
        return
    if device.type == "cuda" and table.device.type == "cpu" and table.is_pinned():
        return
    raise ValueError(
        f"table must be on {device}"
        + (" or in pinned host memory" if device.type == "cuda" else "")
        + f", got a tensor on {table.device}"
    )


def launch_stage_inputs_kernel(*, table: torch.Tensor, device: torch.device) -> None:
    """``table`` int64 ``[STAGE_TABLE_NUMEL]`` (layout: ``consts.STAGE_*``; the entry count is
    read when the kernel runs), on ``device`` (where the addresses it holds are and the kernel
    runs) or, on CUDA, in pinned host memory. Allocation- and sync-free (capturable; the
    pinned check is a driver query, at capture time)."""
    _validate_table(table)
    device = torch.device(device)
    _check_table_reachable(table, device)
    if not use_triton(device):
        return run_stage_inputs_reference(table=table)
    splits = min(STAGE_MAX_SPLITS, grid_size(device, 1 << 30, 1))
    _stage_inputs_kernel[(STAGE_MAX_ENTRIES, splits)](
        table,
        NUM_ENTRIES=STAGE_NUM_ENTRIES,
        HEADER=STAGE_HEADER,
        FIELDS=STAGE_ENTRY_FIELDS,
        F_DST=STAGE_DST,
        F_A=STAGE_A,
        F_B=STAGE_B,
        F_NUMEL=STAGE_NUMEL,
        F_KIND=STAGE_KIND,
        OP_MASK=STAGE_OP_MASK,
        OP_FILL=STAGE_OP_FILL,
        OP_SUB=STAGE_OP_SUB,
        OP_STRIDE=STAGE_OP_STRIDE,
        A_INT32=STAGE_A_INT32,
        B_INT32=STAGE_B_INT32,
        BLOCK=STAGE_BLOCK,
    )


def _host_view(address: int, numel: int, int32: bool) -> torch.Tensor:
    """``numel`` elements of host memory at ``address`` as a tensor (no copy)."""
    ctype = ctypes.c_int32 if int32 else ctypes.c_int64
    array = np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctype)), shape=(numel,))
    return torch.from_numpy(array)


def run_stage_inputs_reference(*, table: torch.Tensor) -> None:
    """The kernel's semantics on CPU tensors (the table's addresses are host addresses),
    entry after entry."""
    _validate_table(table)
    if table.device.type != "cpu":
        raise ValueError(f"the staging reference runs on CPU tables, got one on {table.device}")
    words = table.tolist()
    count = words[STAGE_NUM_ENTRIES]
    if not 0 <= count <= STAGE_MAX_ENTRIES:
        raise ValueError(f"staging table holds {count} entries; allowed 0 to {STAGE_MAX_ENTRIES}")
    for e in range(count):
        at = STAGE_HEADER + e * STAGE_ENTRY_FIELDS
        dst, a, b, n, kind = (words[at + f] for f in range(STAGE_ENTRY_FIELDS))
        if n <= 0:
            continue
        op = kind & STAGE_OP_MASK
        out = _host_view(dst, n, int32=False)
        if op == STAGE_OP_FILL:
            out.fill_(b)
            continue
        if op not in (STAGE_OP_COPY, STAGE_OP_SUB, STAGE_OP_STRIDE):
            raise ValueError(f"staging table entry {e} has kind {kind}: unknown operation {op}")
        if op == STAGE_OP_STRIDE:
            if b < 1:
                raise ValueError(f"staging table entry {e} strides A by {b}; allowed: >= 1")
            span = (n - 1) * b + 1
            values = _host_view(a, span, int32=bool(kind & STAGE_A_INT32))[::b].to(torch.int64)
            out.copy_(values)
            continue
        values = _host_view(a, n, int32=bool(kind & STAGE_A_INT32)).to(torch.int64)
        if op == STAGE_OP_SUB:
            values = values - _host_view(b, n, int32=bool(kind & STAGE_B_INT32)).to(torch.int64)
        out.copy_(values)
