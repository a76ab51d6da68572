"""Pool-class → attacher registry and the ``attach_canary_buffers`` dispatcher
(docs/architecture.md, "Buffer groups and adapters")."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup

# attacher(*, pool, config, device, kv_token_id_vs_position_offset, swa_window_size)
#   -> list of groups (attachers of pools without a sliding window ignore swa_window_size)
PoolAttacher = Callable[..., List[CanaryBufferGroup]]

_ATTACHERS: Dict[type, PoolAttacher] = {}
_ADAPTERS_LOADED = False


def register_pool_attacher(pool_cls: type, attacher: PoolAttacher) -> None:
    """Register ``attacher`` for ``pool_cls`` (exact class; subclasses fall back to the MRO)."""
    if not isinstance(pool_cls, type):
        raise TypeError(f"pool_cls must be a class, got {pool_cls!r}")
    existing = _ATTACHERS.get(pool_cls)
    if existing is not None and existing is not attacher:
        raise ValueError(
            f"a canary attacher for {pool_cls.__name__} is already registered "
            f"({existing.__qualname__})"
        )
    _ATTACHERS[pool_cls] = attacher


def _load_adapters() -> None:
    global _ADAPTERS_LOADED
    if not _ADAPTERS_LOADED:
        from sglang.srt.kv_canary.pool_patcher.adapters import load_all

        load_all()
        _ADAPTERS_LOADED = True


def supported_pool_names() -> List[str]:
    _load_adapters()
    return sorted(cls.__name__ for cls in _ATTACHERS)


def attach_canary_buffers(
    *,
    pool,
    config,
    device,
    kv_token_id_vs_position_offset: int = 0,
    swa_window_size: Optional[int] = None,
    layer_ids: Optional[Sequence[int]] = None,
) -> List[CanaryBufferGroup]:
    """Allocate canary buffers for ``pool``, splice them into its buf-info methods (so PD
    transfers carry them), and return the buffer groups. Dispatches on the pool's class (exact
    match first, then its base classes); an unsupported pool raises ``NotImplementedError``
    naming the supported ones.

    ``swa_window_size``: the sliding window (tokens) of the model's SWA layers, i.e.
    ``ModelRunner.sliding_window_size`` (what the scheduler's SWA eviction uses). Needed by
    the SWA / DeepSeek-V4 attachers (the DSV4 one falls back to the pool's own
    ``swa_window_size``); ignored by pools without a window. ``None`` = not known.
    ``layer_ids``: the model's layer id of each of the pool's layers, for a pool held inside
    another whose layers are a subset of the model's (the hybrid pool's full-attention pool);
    None = the pool's own numbering from its ``start_layer``. Attachers of pools with their
    own layer map (SWA, DeepSeek-V4) ignore it."""
    _load_adapters()
    for cls in type(pool).__mro__:
        attacher = _ATTACHERS.get(cls)
        if attacher is not None:
            return attacher(
                pool=pool,
                config=config,
                device=device,
                kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
                swa_window_size=swa_window_size,
                layer_ids=layer_ids,
            )
    raise NotImplementedError(
        f"kv_canary does not support KV pool {type(pool).__name__}; supported pools: "
        f"{', '.join(supported_pool_names())}. Run without --kv-canary for this model."
    )
