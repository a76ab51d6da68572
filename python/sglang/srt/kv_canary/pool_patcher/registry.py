"""Pool-class → attacher registry and the ``attach_canary_buffers`` dispatcher
(docs/architecture.md, "Buffer groups and adapters")."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.pool_patcher.types import AttachRequest, PoolAdapter

_ATTACHERS: Dict[type, PoolAdapter] = {}
_ADAPTERS_LOADED = False


def register_pool_attacher(pool_cls: type, attacher: PoolAdapter) -> None:
    """Register ``attacher`` for ``pool_cls`` (exact class; subclasses fall back to the MRO)."""
    if not isinstance(pool_cls, type):
        raise TypeError(f"pool_cls must be a class, got {pool_cls!r}")
    if not callable(attacher):
        raise TypeError(
            f"the attacher for {pool_cls.__name__} must be a PoolAdapter (a callable taking "
            f"an AttachRequest), got {attacher!r}"
        )
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
    transfers carry them), and return the buffer groups. The arguments (documented on
    :class:`AttachRequest`, which checks them) become one request for
    :func:`attach_for_request`, which dispatches on the pool's class; an unsupported pool
    raises ``NotImplementedError`` naming the supported ones. Start-up only."""
    return attach_for_request(
        AttachRequest(
            pool=pool,
            config=config,
            device=device,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
            swa_window_size=swa_window_size,
            layer_ids=None if layer_ids is None else tuple(layer_ids),
        )
    )


def attach_for_request(request: AttachRequest) -> List[CanaryBufferGroup]:
    """:func:`attach_canary_buffers` on a built request: the adapter registered for
    ``request.pool``'s class (exact match first, then its base classes), or
    ``NotImplementedError`` naming the supported pools. Adapters that delegate to an inner
    pool's adapter (the hybrid pool's) call this with a copy of their request."""
    _load_adapters()
    pool = request.pool
    for cls in type(pool).__mro__:
        attacher = _ATTACHERS.get(cls)
        if attacher is not None:
            return attacher(request)
    raise NotImplementedError(
        f"kv_canary does not support KV pool {type(pool).__name__}; supported pools: "
        f"{', '.join(supported_pool_names())}. Run without --kv-canary for this model."
    )
