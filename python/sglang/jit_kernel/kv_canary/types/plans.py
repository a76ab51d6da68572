"""The verify and write plans and the write's parts (docs/architecture.md, "Plans"). No
Triton."""

from __future__ import annotations

import dataclasses
import enum

import torch

from sglang.jit_kernel.kv_canary._checks import check_int, check_tensor, same_device
from sglang.jit_kernel.kv_canary.consts import TREE_PARENT_ORPHAN


# ---------------------------------------------------------------------------------------------
# Verify plan
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class VerifyPlan:
    """The per-forward verify work list (device, fixed capacity; filled by the plan kernels).

    int64 ``[capacity]``: ``verify_slot_indices``, ``verify_expected_tokens`` (-1 = unknown),
    ``verify_expected_positions`` (the position attention reads the slot for),
    ``verify_prev_slot_indices`` (-1 = chain head, 0 = predecessor unreachable),
    ``verify_req_to_token_rows`` (the ``req_to_token`` row the slot was read from, -1 =
    ``NO_REQ_TO_TOKEN_ROW`` for an entry not read through a request, e.g. the sweep; it only
    locates a violation in the report); int32 ``[1]``: ``verify_num_valid``, ``enable`` (0 after
    an overflow).
    """

    verify_slot_indices: torch.Tensor
    verify_expected_tokens: torch.Tensor
    verify_expected_positions: torch.Tensor
    verify_prev_slot_indices: torch.Tensor
    verify_req_to_token_rows: torch.Tensor
    verify_num_valid: torch.Tensor
    enable: torch.Tensor

    def __post_init__(self):
        cap = (
            self.verify_slot_indices.shape[0]
            if isinstance(self.verify_slot_indices, torch.Tensor)
            and self.verify_slot_indices.dim() == 1
            else None
        )
        for name in (
            "verify_slot_indices",
            "verify_expected_tokens",
            "verify_expected_positions",
            "verify_prev_slot_indices",
            "verify_req_to_token_rows",
        ):
            check_tensor(
                f"VerifyPlan.{name}", getattr(self, name), dtypes=(torch.int64,), shape=(cap,)
            )
        for name in ("verify_num_valid", "enable"):
            check_tensor(
                f"VerifyPlan.{name}", getattr(self, name), dtypes=(torch.int32,), shape=(1,)
            )
        same_device({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @property
    def capacity(self) -> int:
        return self.verify_slot_indices.shape[0]

    @property
    def device(self) -> torch.device:
        return self.verify_slot_indices.device

    @classmethod
    def allocate(cls, *, verify_capacity: int, device) -> "VerifyPlan":
        check_int("verify_capacity", verify_capacity, minimum=0)
        device = torch.device(device)

        def i64():
            return torch.zeros(verify_capacity, dtype=torch.int64, device=device)

        return cls(
            verify_slot_indices=i64(),
            verify_expected_tokens=i64(),
            verify_expected_positions=i64(),
            verify_prev_slot_indices=i64(),
            verify_req_to_token_rows=i64(),
            verify_num_valid=torch.zeros(1, dtype=torch.int32, device=device),
            enable=torch.zeros(1, dtype=torch.int32, device=device),
        )


# ---------------------------------------------------------------------------------------------
# Write parts and plan
# ---------------------------------------------------------------------------------------------


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
    - ``write_req_to_token_rows`` int64 ``[req_capacity]``: request r's ``req_to_token`` row
      (-1 for a padding row and beyond the batch; it only locates a violation in the report).
    - ``write_num_valid_reqs`` int32 ``[1]``: the batch size.
    - ``verify_req_offsets`` int64 ``[req_capacity + 1]``: plan-internal scratch (per-request
      exclusive prefix sum of verify entries), read by the plan's entries stage only.
    """

    write_offsets: torch.Tensor
    write_seed_slot_indices: torch.Tensor
    write_req_to_token_rows: torch.Tensor
    write_num_valid_reqs: torch.Tensor
    verify_req_offsets: torch.Tensor

    def __post_init__(self):
        seeds = check_tensor(
            "WritePlan.write_seed_slot_indices",
            self.write_seed_slot_indices,
            dtypes=(torch.int64,),
            ndim=1,
        )
        cap = seeds.shape[0]
        check_tensor(
            "WritePlan.write_offsets", self.write_offsets, dtypes=(torch.int64,), shape=(cap + 1,)
        )
        check_tensor(
            "WritePlan.write_req_to_token_rows",
            self.write_req_to_token_rows,
            dtypes=(torch.int64,),
            shape=(cap,),
        )
        check_tensor(
            "WritePlan.verify_req_offsets",
            self.verify_req_offsets,
            dtypes=(torch.int64,),
            shape=(cap + 1,),
        )
        check_tensor(
            "WritePlan.write_num_valid_reqs",
            self.write_num_valid_reqs,
            dtypes=(torch.int32,),
            shape=(1,),
        )
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
            write_seed_slot_indices=torch.full(
                (write_req_capacity,), -1, dtype=torch.int64, device=device
            ),
            write_req_to_token_rows=torch.full(
                (write_req_capacity,), -1, dtype=torch.int64, device=device
            ),
            write_num_valid_reqs=torch.zeros(1, dtype=torch.int32, device=device),
            verify_req_offsets=torch.zeros(
                write_req_capacity + 1, dtype=torch.int64, device=device
            ),
        )


@dataclasses.dataclass(frozen=True, eq=False)
class WriteTree:
    """A speculative draft tree's shape, for a write whose entries are tree nodes rather than a
    chain (the target verify of ``--speculative-eagle-topk`` > 1; docs/speculative_trees.md,
    "3. Record semantics for tree tokens").

    - ``parent`` int64 ``[capacity]`` (device; at least the launch's ``num_tokens``): per
      entry, its parent's index *within its request's entries* (``write_offsets``), which is
      smaller than its own; ``TREE_PARENT_SEED`` (-1): its parent is the request's seed;
      ``TREE_PARENT_ORPHAN`` (-2): sglang dropped it from the tree (nothing reads it, it is
      freed): not written, not checked, as is every entry below it.
    - ``max_depth``: the most entries on a path from a request's seed to an entry (sglang's
      ``speculative_num_steps`` + 1); fixed per server (a Triton constexpr, so capturable). An
      entry deeper than this, or whose parent index is not smaller than its own, is reported
      (``write_position``, expected position -1) and not written.
    """

    parent: torch.Tensor
    max_depth: int

    def __post_init__(self):
        check_tensor("WriteTree.parent", self.parent, dtypes=(torch.int64,), ndim=1)
        check_int("WriteTree.max_depth", self.max_depth, minimum=1)

    @property
    def capacity(self) -> int:
        return self.parent.shape[0]

    @classmethod
    def allocate(cls, *, capacity: int, max_depth: int, device) -> "WriteTree":
        check_int("capacity", capacity, minimum=0)
        return cls(
            parent=torch.full(
                (capacity,), TREE_PARENT_ORPHAN, dtype=torch.int64, device=torch.device(device)
            ),
            max_depth=max_depth,
        )


@dataclasses.dataclass(frozen=True, eq=False)
class PlanLanes:
    """Per-row ``req_to_token`` layout of a plan whose rows are a speculative draft round's
    lanes (``--speculative-eagle-topk`` K > 1: row ``b * K + k`` is request b's lane k;
    docs/speculative_trees.md, "4.2 Plan"). int64 ``[capacity]`` (at least the batch's rows):

    - ``verify_from``: the row's first verified position (with a window: the later of the two);
      a lane k >= 1 verifies only its own steps, the shared prefix being lane 0's.
    - ``branch_split`` / ``branch_shift``: the row's position p is read at ``req_to_token``
      column ``p + (branch_shift if p >= branch_split else 0)`` (lane k's steps sit
      ``k * steps`` columns past the prefix); the chain seed and each entry's predecessor too.

    ``verify_from`` 0 and ``branch_shift`` 0 plan a row exactly as without lanes.
    """

    verify_from: torch.Tensor
    branch_split: torch.Tensor
    branch_shift: torch.Tensor

    def __post_init__(self):
        cap = check_tensor(
            "PlanLanes.verify_from", self.verify_from, dtypes=(torch.int64,), ndim=1
        ).shape[0]
        for name in ("branch_split", "branch_shift"):
            check_tensor(
                f"PlanLanes.{name}", getattr(self, name), dtypes=(torch.int64,), shape=(cap,)
            )
        same_device({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @property
    def capacity(self) -> int:
        return self.verify_from.shape[0]

    @classmethod
    def allocate(cls, *, capacity: int, device) -> "PlanLanes":
        check_int("capacity", capacity, minimum=0)
        device = torch.device(device)

        def zeros():
            return torch.zeros(capacity, dtype=torch.int64, device=device)

        return cls(verify_from=zeros(), branch_split=zeros(), branch_shift=zeros())
