"""Flatten a radix cache into (slot, position, predecessor slot) triples for the sweep
(docs/subsystems.md, "Radix sweep").

The walk is iterative (deep trees never hit Python's recursion limit) and touches each node
once on the host, collecting only its value tensor, depth and parent; the flattening itself
(positions, predecessors) is vectorised on the device where the slots live, with no per-node
device→host reads and, on CUDA, no wait for the forward stream: its work queues behind the
forward's kernels, holding the node values it reads for that stream.
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch

from sglang.srt.kv_canary import sglang_seam as seam


@dataclasses.dataclass(frozen=True, eq=False)
class RadixCacheWalkResult:
    """int64 ``[n]`` tensors in depth-first order: each cached slot, the sequence position it
    holds (its depth in the tree) and the slot holding the previous position (the previous
    slot of its node, or its parent's last slot; -1 for position 0)."""

    slot_indices: torch.Tensor
    positions: torch.Tensor
    prev_slot_indices: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.slot_indices.shape[0]


def _empty(device) -> RadixCacheWalkResult:
    z = torch.zeros(0, dtype=torch.int64, device=device)
    return RadixCacheWalkResult(z, z.clone(), z.clone())


def walk_radix_cache_for_canary(
    *, radix_cache, unlocked_only: bool = False, swa_resident_only: bool = False
) -> RadixCacheWalkResult:
    """Every non-root node of a ``RadixCache`` / ``SWARadixCache`` / ``MambaRadixCache`` /
    ``UnifiedRadixCache`` (its full-attention slots), depth first.

    ``unlocked_only`` leaves out nodes locked by running requests (``lock_ref > 0``);
    ``swa_resident_only`` leaves out SWA tombstones (their SWA slots are freed). Nodes whose
    value was evicted are left out with their subtrees. Other cache types raise
    ``NotImplementedError`` naming the type.
    """
    supported = seam.radix_cache_types()
    if not isinstance(radix_cache, supported):
        raise NotImplementedError(
            f"kv_canary sweep does not support {type(radix_cache).__name__}; supported: "
            f"{', '.join(t.__name__ for t in supported)}"
        )
    values: List[torch.Tensor] = []
    lens: List[int] = []
    starts: List[int] = []
    parents: List[int] = []
    keep: List[bool] = []
    filtering = unlocked_only or swa_resident_only
    stack = [(child, -1, 0) for child in seam.radix_root_children(radix_cache)]
    pop, push = stack.pop, stack.extend
    value_of, children_of = seam.radix_node_value, seam.radix_node_children
    while stack:
        node, parent, depth = pop()
        value = value_of(node)
        if value is None:
            continue
        n = value.shape[0]
        if n == 0:
            continue
        index = len(values)
        values.append(value)
        lens.append(n)
        starts.append(depth)
        parents.append(parent)
        if filtering:
            keep.append(
                not (
                    (unlocked_only and seam.radix_node_locked(node))
                    or (swa_resident_only and seam.radix_node_swa_tombstone(node))
                )
            )
        if seam.radix_node_has_children(node):
            depth += n
            push((child, index, depth) for child in children_of(node))
    if not values:
        return _empty(seam.radix_cache_device(radix_cache))

    device = values[0].device
    if device.type == "cuda":
        # sglang makes a node's value on its scheduling stream; the walk's reads below queue on
        # the current (forward) stream, behind that forward's model kernels. An eviction before
        # they run frees the value there, and the scheduling stream's next tensor may take its
        # memory and be written first: the walk would read another sequence's slots. Each
        # value stays allocated until this stream's queued work is done.
        stream = torch.cuda.current_stream(device)
        for value in values:
            value.record_stream(stream)
    lens_d = _host_list_to(lens, torch.int64, device)
    meta = _host_list_to([starts, parents], torch.int64, device)
    node_starts, node_parents = meta[0], meta[1]
    offsets = torch.cumsum(lens_d, 0) - lens_d
    flat = torch.cat(values).to(torch.int64)
    total = flat.shape[0]
    node_of = torch.repeat_interleave(
        torch.arange(len(values), device=device), lens_d, output_size=total
    )
    within = torch.arange(total, device=device) - offsets[node_of]
    positions = node_starts[node_of] + within
    prev = torch.empty_like(flat)
    prev[1:] = flat[:-1]
    parent_last = flat[(offsets + lens_d - 1)[node_parents.clamp(min=0)]]
    prev[offsets] = torch.where(node_parents >= 0, parent_last, -1)
    if not filtering or all(keep):
        return RadixCacheWalkResult(flat, positions, prev)
    mask = _host_list_to(keep, torch.bool, device)[node_of]
    return RadixCacheWalkResult(flat[mask], positions[mask], prev[mask])


def _host_list_to(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``data`` (a host list) as a tensor on ``device``: on CUDA through pinned memory and a
    copy queued on the current stream, so the walk never waits for the forward's kernels (a
    pageable copy would block the host until the stream is idle); the pinned buffer is kept
    until that copy ran (torch's pinned allocator)."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def radix_tree_nodes(radix_cache) -> List:
    """Every non-root node of a radix cache, in no particular order (host walk)."""
    nodes: List = []
    for child in seam.radix_root_children(radix_cache):
        nodes += radix_subtree_nodes(child)
    return nodes


def radix_subtree_nodes(node) -> List:
    """``node`` and its descendants, each after its parent (host walk)."""
    nodes, stack = [], [node]
    while stack:
        n = stack.pop()
        nodes.append(n)
        stack.extend(seam.radix_node_children(n))
    return nodes


def radix_nodes_holding_slots(*, radix_cache, slots: torch.Tensor) -> List:
    """The topmost nodes of a radix cache whose value holds any of ``slots`` (int64 ``[k]``
    full-pool slots): a node below a returned node is not returned (evicting the returned
    node's subtree covers it). Host walk plus one device ``isin`` and one read-back: for the
    containment path (a violation), never per forward. ``[]`` for a cache that is not a
    radix tree (``ChunkCache``)."""
    if not isinstance(radix_cache, seam.radix_cache_types()) or slots.numel() == 0:
        return []
    nodes: List = []
    values: List[torch.Tensor] = []
    parents: List[int] = []
    stack = [(child, -1) for child in seam.radix_root_children(radix_cache)]
    while stack:
        node, parent = stack.pop()
        value = seam.radix_node_value(node)
        if value is None or value.shape[0] == 0:
            continue
        index = len(nodes)
        nodes.append(node)
        values.append(value)
        parents.append(parent)
        stack.extend((child, index) for child in seam.radix_node_children(node))
    if not nodes:
        return []
    flat = torch.cat(values).to(torch.int64)
    lens = torch.tensor([v.shape[0] for v in values], dtype=torch.int64).to(flat.device)
    node_of = torch.repeat_interleave(
        torch.arange(len(nodes), device=flat.device), lens, output_size=flat.shape[0]
    )
    hit = torch.zeros(len(nodes), dtype=torch.bool, device=flat.device)
    hit[node_of[torch.isin(flat, slots.to(flat.device, torch.int64))]] = True
    hits = hit.tolist()
    out = []
    for i, node in enumerate(nodes):  # parents come before their children in ``nodes``
        if not hits[i]:
            continue
        p = parents[i]
        while p >= 0 and not hits[p]:
            p = parents[p]
        if p < 0:
            out.append(node)
    return out


def host_resident_nodes(radix_cache, *, host_only: bool = False) -> List[tuple]:
    """HiCache: ``(host_indices, depth)`` of every node whose host copy is complete (its
    backup is not in flight), depth-first; ``host_only``: only nodes evicted from the device
    (the ones a prefix hit loads back). ``depth`` is the position of the node's first token."""
    pending = seam.hicache_pending_write_node_ids(radix_cache)
    out = []
    stack = [(child, 0) for child in seam.radix_root_children(radix_cache)]
    while stack:
        node, depth = stack.pop()
        host = seam.radix_node_host_value(node)
        value = seam.radix_node_value(node)
        if (
            host is not None
            and host.numel()
            and seam.radix_node_id(node) not in pending
            and not (host_only and value is not None)
        ):
            out.append((host, depth))
        n = max(host.numel() if host is not None else 0, value.numel() if value is not None else 0)
        stack.extend((child, depth + n) for child in seam.radix_node_children(node))
    return out
