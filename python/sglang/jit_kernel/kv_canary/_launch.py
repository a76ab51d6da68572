"""Launch dispatch and grid sizing (the argument checks live in ``_checks``).

Dispatch rule (docs/architecture.md, "Kernel rules"): CUDA tensors run the Triton kernels; CPU
tensors run the torch reference, unless Triton's interpreter was on (``TRITON_INTERPRET=1``)
when the kernel modules were imported, in which case CPU tensors go through the Triton kernels
in the interpreter. Like Triton itself, the variable is read once, at import.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

TRITON_INTERPRET: bool = bool(triton.knobs.runtime.interpret)


def use_triton(device: torch.device) -> bool:
    """True when launches on ``device`` go to the Triton kernel, False for the torch reference."""
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        return TRITON_INTERPRET
    raise ValueError(
        f"kv_canary kernels support 'cuda' and 'cpu' tensors, got tensors on '{device}'"
    )


@functools.lru_cache(maxsize=None)
def _max_programs(device_type: str, device_index: Optional[int]) -> int:
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(device_index or 0)
        return 4 * props.multi_processor_count
    # The interpreter runs programs one after another: keep the grid small but > 1 so the
    # grid-stride loops are exercised.
    return 3


def grid_size(device: torch.device, work_items: int, block: int) -> int:
    """Programs for a grid-stride loop over at most ``work_items`` items (host-known bound)."""
    needed = max(1, triton.cdiv(max(0, work_items), block))
    return min(needed, _max_programs(device.type, device.index))
