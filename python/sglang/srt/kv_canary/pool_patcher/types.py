"""The pool adapters' types (docs/architecture.md, "Buffer groups and adapters"): the attach
request every adapter takes and the adapter interface the registry holds. No sglang, no
allocation."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Protocol, Sequence, Tuple

import torch

from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.config import CanaryConfig


@dataclasses.dataclass(frozen=True, eq=False)
class AttachRequest:
    """What attaching canary buffers to one KV pool needs, built once by
    :func:`~sglang.srt.kv_canary.pool_patcher.registry.attach_canary_buffers` (start-up only).

    - ``pool``: the sglang KV pool object; the registry dispatches on its class.
    - ``config``: the server's :class:`CanaryConfig`.
    - ``device``: where the canary buffers go (normalised to a ``torch.device``).
    - ``kv_token_id_vs_position_offset``: 0, or 1 for an EAGLE draft pool (read one ahead).
    - ``swa_window_size``: ``ModelRunner.sliding_window_size`` (tokens), ``None`` when not
      known; the SWA / DeepSeek-V4 adapters need it, the others ignore it (the adapters check
      it, with their own messages).
    - ``layer_ids``: the model's layer id of each of the pool's layers, for a pool held inside
      another whose layers are a subset of the model's (the hybrid pool's full-attention
      pool); ``None`` = the pool's own numbering from its ``start_layer``. Adapters of pools
      with their own layer map (SWA, DeepSeek-V4) ignore it.
    """

    pool: object
    config: CanaryConfig
    device: torch.device
    kv_token_id_vs_position_offset: int = 0
    swa_window_size: Optional[int] = None
    layer_ids: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if not isinstance(self.config, CanaryConfig):
            raise TypeError(
                f"AttachRequest.config must be a CanaryConfig, got {type(self.config).__name__}"
            )
        object.__setattr__(self, "device", torch.device(self.device))
        offset = self.kv_token_id_vs_position_offset
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(
                f"AttachRequest.kv_token_id_vs_position_offset must be an int >= 0, got {offset!r}"
            )
        if self.layer_ids is not None:
            object.__setattr__(self, "layer_ids", _layer_ids(self.layer_ids))


def _layer_ids(layer_ids: Sequence[int]) -> Tuple[int, ...]:
    ids = tuple(layer_ids)
    for i, layer in enumerate(ids):
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"AttachRequest.layer_ids[{i}] must be an int >= 0, got {layer!r}")
    return ids


class PoolAdapter(Protocol):
    """What an adapter of one pool family is: given an :class:`AttachRequest` whose pool is of
    a class it was registered for (``register_pool_attacher``), allocate the canary buffers on
    ``request.device``, splice them into the pool's buf-info methods (wrapping twice raises)
    and return the pool's groups, FULL first (docs/architecture.md, "Adding a pool adapter").
    Runs once, at start-up."""

    def __call__(self, request: AttachRequest) -> List[CanaryBufferGroup]: ...
