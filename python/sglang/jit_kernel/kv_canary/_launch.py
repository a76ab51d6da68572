"""Shared launch plumbing: implementation dispatch, grid sizing and host-side validation.

Dispatch rule (SPEC §8): CUDA tensors run the Triton kernels; CPU tensors run the torch
reference, unless Triton's interpreter was on (``TRITON_INTERPRET=1``) when the kernel modules
were imported, in which case CPU tensors go through the Triton kernels in the interpreter. Like
Triton itself, the variable is read once, at import.

Validation only reads tensor metadata (no device sync, no allocation), so it is safe to run on
every launch, CUDA-graph capture included.
"""

from __future__ import annotations

import functools
from typing import Iterable, Optional, Sequence

import torch
import triton

TRITON_INTERPRET: bool = bool(triton.knobs.runtime.interpret)

INDEX_DTYPES = (torch.int32, torch.int64)


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


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    dtypes: Sequence[torch.dtype],
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``t`` matches; returns ``t``.

    ``shape`` entries of ``None`` match any size; ``shape`` implies ``ndim``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {t.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, want in enumerate(shape):
            if want is not None and t.shape[axis] != want:
                expect = tuple("*" if s is None else s for s in shape)
                raise ValueError(
                    f"{name} must have shape {expect}, got {tuple(t.shape)}"
                )
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def check_int(name: str, value, *, minimum: Optional[int] = None) -> int:
    """Raise naming ``name`` unless ``value`` is a python int (not bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def same_device(named: dict) -> torch.device:
    """The common device of the non-None tensors in ``named``; raises naming the odd one out."""
    device = None
    first = None
    for name, t in named.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(
                f"{name} is on {t.device} but {first} is on {device}: all tensors of one "
                "launch must be on the same device"
            )
    if device is None:
        raise ValueError("no tensor given")
    return device
