"""The accepted baselines that the KV-canary validation tests change one argument of
(``test_kernels_validation*.py``: the launchers; ``test_kernel_types_validation.py``: the
constructors of sources, contexts and plans), and the helpers those cases share. Validation
reads metadata only: CPU tensors, plus ``meta`` tensors as the "other device"."""

from __future__ import annotations

import re

import torch

from sglang.jit_kernel.kv_canary import (
    CANARY_SLOT_BYTES,
    CanaryLaunchTag,
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
)
from sglang.jit_kernel.kv_canary.consts import VIOLATION_NUM_FIELDS

CPU = torch.device("cpu")
META = torch.device("meta")
I64 = torch.int64
I32 = torch.int32


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same shape/dtype/values as ``t``, not contiguous."""
    wide = torch.zeros(t.shape + (2,), dtype=t.dtype)
    out = wide[..., 0]
    out.copy_(t)
    assert not out.is_contiguous()
    return out


def named(name: str) -> str:
    """A regex matching ``name`` as a whole identifier (not a prefix of a longer one)."""
    return r"(?<!\w)" + re.escape(name) + r"(?!\w)"


# =============================================================================================
# Baselines
# =============================================================================================


def make_source(*, pages=8, page_size=2, nbpt=16, read_bytes=16, device=CPU):
    t = torch.zeros(pages, page_size * nbpt, dtype=torch.uint8, device=device)
    return RealKvSource(
        tensor=t, page_size=page_size, num_bytes_per_token=nbpt, read_bytes=read_bytes
    )


def context_kwargs(num_slots=16, device=CPU, **over):
    kw = dict(
        canary_buf=torch.zeros(num_slots, CANARY_SLOT_BYTES, dtype=torch.uint8, device=device),
        kernel_kind=CanaryLaunchTag.TAIL_K_FULL,
        violation_ring=torch.zeros(8, VIOLATION_NUM_FIELDS, dtype=I64, device=device),
        violation_write_index=torch.zeros(1, dtype=I32, device=device),
        slot_run_counter=torch.zeros(1, dtype=I64, device=device),
        kernel_run_counter=torch.zeros(1, dtype=I64, device=device),
        real_kv_sources=(),
        real_kv_hash_mode=RealKvHashMode.NONE,
        enable_chain_position_assert=torch.ones(1, dtype=I32, device=device),
    )
    kw.update(over)
    return kw


def make_context(**over):
    return VerifyOrWriteContext(**context_kwargs(**over))
