"""The per-layer fingerprint table of one buffer group (docs/subsystems.md, "Per-layer
fingerprints"; its descriptor layout: ``consts.DEEP_DESC_*``). No Triton."""

from __future__ import annotations

import dataclasses
from typing import Tuple

import torch

from sglang.jit_kernel.kv_canary._checks import check_int, check_tensor, same_device
from sglang.jit_kernel.kv_canary.consts import (
    DEEP_DESC_HALF,
    DEEP_DESC_LAYER,
    DEEP_DESC_WORDS,
    DEEP_HALF_K,
    REAL_KV_DESC_WORDS,
    DEEP_HALF_V,
    RealKvHashMode,
)
from sglang.jit_kernel.kv_canary.types.tags import KvHalf
from sglang.jit_kernel.kv_canary.types.context import RealKvSource


@dataclasses.dataclass(frozen=True)
class DeepColumn:
    """One column of a :class:`DeepFingerprintTable`: the KV row of sglang layer ``layer_id``,
    half ``half``, of every slot (``source``, in the group's slot space)."""

    layer_id: int
    half: KvHalf
    source: RealKvSource


@dataclasses.dataclass(frozen=True, eq=False)
class DeepFingerprintTable:
    """Per-slot, per-(layer, half) real-KV fingerprints of one buffer group
    (``--kv-canary-real-data-layers all``; docs/subsystems.md, "Per-layer fingerprints").

    - ``table``: int64 ``[num_slots, num_columns]``; ``table[s, c]`` is the fingerprint of slot
      ``s`` over ``columns[c].source`` alone (the record format's fingerprint with one source),
      taken when the slot was written.
    - ``columns``: the :class:`DeepColumn` of each column, layer-major (layer 0's K, layer 0's
      V, layer 1's K, ...); every source covers ``num_slots`` slots.
    - ``mode``: PARTIAL or ALL (as ``--kv-canary-real-data``).
    - ``columns_per_forward``: how many columns a forward's rotating check covers, a multiple
      of the halves per layer (whole layers), at most ``num_columns``.
    - ``descriptors``: int64 ``[num_columns, DEEP_DESC_WORDS]`` (device) built here;
      ``cursor``: int64 ``[1]`` (device), the first column of the next forward's window,
      counting up without wrapping (the kernels take it modulo ``num_columns``).
    """

    table: torch.Tensor
    columns: Tuple[DeepColumn, ...]
    mode: RealKvHashMode
    columns_per_forward: int
    descriptors: torch.Tensor = dataclasses.field(init=False, repr=False)
    cursor: torch.Tensor = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        columns = tuple(self.columns)
        object.__setattr__(self, "columns", columns)
        if not columns:
            raise ValueError("DeepFingerprintTable needs at least one column")
        for i, col in enumerate(columns):
            if not isinstance(col, DeepColumn):
                raise TypeError(
                    f"DeepFingerprintTable.columns[{i}] must be a DeepColumn, got "
                    f"{type(col).__name__}"
                )
        try:
            mode = RealKvHashMode(self.mode)
        except ValueError:
            raise ValueError(
                f"DeepFingerprintTable.mode must be PARTIAL or ALL, got {self.mode!r}"
            ) from None
        if mode == RealKvHashMode.NONE:
            raise ValueError("DeepFingerprintTable.mode must be PARTIAL or ALL, got NONE")
        object.__setattr__(self, "mode", mode)
        table = check_tensor(
            "DeepFingerprintTable.table",
            self.table,
            dtypes=(torch.int64,),
            shape=(None, len(columns)),
        )
        if not table.is_contiguous():
            raise ValueError("DeepFingerprintTable.table must be contiguous")
        for i, col in enumerate(columns):
            if col.source.num_slots < table.shape[0]:
                raise ValueError(
                    f"DeepFingerprintTable.columns[{i}] (layer {col.layer_id} "
                    f"{col.half.value}) covers {col.source.num_slots} slots but "
                    f"the table has {table.shape[0]}"
                )
        halves = self.halves_per_layer
        first_halves = [c.half for c in columns[:halves]]
        for i, col in enumerate(columns):
            if (
                col.half != first_halves[i % halves]
                or col.layer_id != columns[i - i % halves].layer_id
                or (i % halves == 0 and i and col.layer_id == columns[i - 1].layer_id)
            ):
                raise ValueError(
                    "DeepFingerprintTable.columns must be layer-major with the same halves, in "
                    f"the same order, for every layer; column {i} is layer {col.layer_id} "
                    f"{col.half.value}"
                )
        check_int("DeepFingerprintTable.columns_per_forward", self.columns_per_forward, minimum=1)
        if self.columns_per_forward % halves or self.columns_per_forward > len(columns):
            raise ValueError(
                f"DeepFingerprintTable.columns_per_forward must be a multiple of {halves} (whole "
                f"layers) and at most {len(columns)}, got {self.columns_per_forward}"
            )
        same_device(
            {
                "table": table,
                **{f"columns[{i}].source": c.source.tensor for i, c in enumerate(columns)},
            }
        )
        desc = [[0] * DEEP_DESC_WORDS for _ in columns]
        for row, c in zip(desc, columns):
            row[:REAL_KV_DESC_WORDS] = c.source.descriptor(mode)
            row[DEEP_DESC_LAYER] = c.layer_id
            row[DEEP_DESC_HALF] = DEEP_HALF_K if c.half == KvHalf.K else DEEP_HALF_V
        object.__setattr__(
            self, "descriptors", torch.tensor(desc, dtype=torch.int64).to(table.device)
        )
        object.__setattr__(self, "cursor", torch.zeros(1, dtype=torch.int64, device=table.device))

    @property
    def num_slots(self) -> int:
        return self.table.shape[0]

    @property
    def num_columns(self) -> int:
        return len(self.columns)

    @property
    def halves_per_layer(self) -> int:
        """Columns per layer (2 with V rows, 1 for K-only pools such as MLA)."""
        first = self.columns[0].layer_id
        return sum(1 for c in self.columns if c.layer_id == first)

    @property
    def layers(self) -> Tuple[int, ...]:
        return tuple(dict.fromkeys(c.layer_id for c in self.columns))

    @property
    def forwards_per_rotation(self) -> int:
        """Forwards after which a slot read by each of them has had every column checked."""
        return -(-self.num_columns // self.columns_per_forward)

    @property
    def device(self) -> torch.device:
        return self.table.device

    @classmethod
    def allocate(
        cls, *, num_slots: int, columns, mode: RealKvHashMode, layers_per_forward: int, device
    ) -> "DeepFingerprintTable":
        """A zeroed table for ``columns``; ``layers_per_forward`` whole layers per forward
        (clamped to the layer count)."""
        columns = tuple(columns)
        check_int("layers_per_forward", layers_per_forward, minimum=1)
        if not columns:
            raise ValueError("DeepFingerprintTable needs at least one column")
        first = columns[0].layer_id
        halves = sum(1 for c in columns if c.layer_id == first)
        num_layers = len(columns) // halves
        return cls(
            table=torch.zeros(
                num_slots, len(columns), dtype=torch.int64, device=torch.device(device)
            ),
            columns=columns,
            mode=mode,
            columns_per_forward=min(layers_per_forward, num_layers) * halves,
        )
