"""Metadata-only argument checks shared by the launch validators and the plan / context types.

Torch only (no Triton), so the types and validators can be imported without the kernels. The
checks read tensor metadata only (no device sync, no allocation), so they are safe on every
launch, CUDA-graph capture included.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


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
                raise ValueError(f"{name} must have shape {expect}, got {tuple(t.shape)}")
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
