"""The radix caches: which trees the sweep walks, their nodes, and abort mode's eviction of a subtree.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| radix tree nodes (``TreeNode``) | reads ``root_node``, ``children``, ``value``, ``lock_ref`` (``full_lock_ref`` in ``MambaRadixCache``), ``swa_tombstone``; ``RadixCache`` / ``SWARadixCache`` / ``MambaRadixCache`` / ``UnifiedRadixCache`` types; ``UnifiedTreeNode``: ``component_data[ComponentType.FULL]`` (``value``, ``lock_ref``, ``host_value``), ``component_data[ComponentType.SWA].value``, ``tree_components`` | ``radix_cache_walker`` |
| ``RadixCache`` eviction step | ``token_to_kv_pool_allocator.free(value)``, ``_delete_leaf``, ``_record_remove_event`` per node of an evicted subtree (abort mode) | ``violations.containment`` |
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Iterable, List, Optional, Tuple

if TYPE_CHECKING:  # annotations only
    import torch

    from sglang.srt.mem_cache.radix_cache import TreeNode


def radix_cache_types() -> Tuple[type, ...]:
    """The tree caches the sweep can walk: ``RadixCache``, ``SWARadixCache``,
    ``MambaRadixCache`` (hybrid linear-attention models: its nodes' ``value`` holds the
    full-attention slots, ``mamba_value`` the per-request state the canary does not cover) and
    ``UnifiedRadixCache`` (``SGLANG_ENABLE_UNIFIED_RADIX_TREE=1``: one node type whose
    per-component data holds the full-attention slots, the SWA slots or the Mamba state)."""
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return (RadixCache, SWARadixCache, MambaRadixCache, UnifiedRadixCache)


def is_chunk_cache(tree_cache) -> bool:
    """``ChunkCache`` / ``SWAChunkCache``: the tree cache of a server without a radix cache
    (``--disable-radix-cache``; a PD decode server's default). No tree: a finished request's
    slots are freed, not cached."""
    from sglang.srt.mem_cache.chunk_cache import ChunkCache

    return isinstance(tree_cache, ChunkCache)


@functools.lru_cache(maxsize=None)
def _unified_component_indices() -> Tuple[int, int]:
    """``(FULL, SWA)``: where a ``UnifiedTreeNode``'s ``component_data`` keeps the
    full-attention and the SWA component."""
    from sglang.srt.mem_cache.unified_cache_components import ComponentType

    return int(ComponentType.FULL), int(ComponentType.SWA)


def _unified_full(node):
    """A ``UnifiedTreeNode``'s full-attention component data, None for the other node types."""
    data = getattr(node, "component_data", None)
    return None if data is None else data[_unified_component_indices()[0]]


def radix_root_children(radix_cache) -> Iterable["TreeNode"]:
    return radix_cache.root_node.children.values()


def radix_node_children(node: "TreeNode") -> Iterable["TreeNode"]:
    return node.children.values()


def radix_node_key_tokens(node: "TreeNode") -> List[int]:
    """The tokens of the node's key, one per slot of its value (a bigram key, EAGLE's, holds
    one more: each slot's token is the first of its pair)."""
    return list(node.key.token_ids)


def radix_node_depth(node: "TreeNode") -> int:
    """The sequence position of the node's first slot: its ancestors' key lengths."""
    depth, parent = 0, node.parent
    while parent is not None:  # the root's key is empty
        depth += len(parent.key) if parent.key is not None else 0
        parent = parent.parent
    return depth


def radix_node_has_children(node: "TreeNode") -> bool:
    return bool(node.children)


def radix_node_value(node: "TreeNode") -> Optional["torch.Tensor"]:
    """The node's full-attention KV slots (None once evicted from the device)."""
    full = _unified_full(node)
    return node.value if full is None else full.value


def radix_node_locked(node: "TreeNode") -> bool:
    """Held by a running request (``lock_ref``; ``MambaRadixCache`` nodes: ``full_lock_ref``;
    ``UnifiedTreeNode``: the full component's ``lock_ref``)."""
    full = _unified_full(node)
    if full is not None:
        return full.lock_ref > 0
    ref = getattr(node, "lock_ref", None)
    return (ref if ref is not None else node.full_lock_ref) > 0


def radix_node_swa_tombstone(node: "TreeNode") -> bool:
    """An SWA node whose SWA slots were freed: ``SWARadixCache``'s ``swa_tombstone``; a
    ``UnifiedTreeNode`` of a tree with an SWA component whose SWA value is gone. False for
    other caches."""
    data = getattr(node, "component_data", None)
    if data is None:
        return bool(getattr(node, "swa_tombstone", False))
    swa = _unified_component_indices()[1]
    return swa in node.tree_components and data[swa].value is None


def radix_cache_device(radix_cache):
    return getattr(radix_cache, "device", "cpu")


def radix_subtree_eviction_supported(radix_cache) -> bool:
    """Whether :func:`radix_evict_subtree` can evict from this cache: ``RadixCache`` itself
    (its subclasses and the SWA, HiCache, Mamba and unified caches keep more state per node
    than its ``evict`` step updates)."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return type(radix_cache) is RadixCache


def radix_subtree_evictable(radix_cache, node: "TreeNode") -> bool:
    """Whether :func:`radix_evict_subtree` can remove ``node`` and its descendants now: a
    supported cache and no node of the subtree locked by a running request."""
    if not radix_subtree_eviction_supported(radix_cache):
        return False
    stack = [node]
    while stack:
        n = stack.pop()
        if n.lock_ref > 0:
            return False
        stack.extend(n.children.values())
    return True


def radix_evict_subtree(radix_cache, node: "TreeNode") -> int:
    """Remove ``node`` and its descendants from a ``RadixCache`` and free their KV slots,
    leaves first, each step as sglang's own ``RadixCache.evict`` does it for one leaf
    (``token_to_kv_pool_allocator.free(value)``, ``_delete_leaf``, ``_record_remove_event``);
    returns the number of tokens freed. Call only when :func:`radix_subtree_evictable` says
    True (the scheduler's thread, between batches)."""
    order, stack = [], [node]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(n.children.values())
    freed = 0
    for n in reversed(order):  # every child comes after its parent in ``order``
        radix_cache.token_to_kv_pool_allocator.free(n.value)
        freed += len(n.value)
        radix_cache._delete_leaf(n)
        radix_cache._record_remove_event(n)
    return freed


def radix_node_host_value(node: "TreeNode"):
    """A HiCache node's host indices (None when it has no host copy)."""
    full = _unified_full(node)
    return getattr(node, "host_value", None) if full is None else full.host_value


def radix_node_id(node: "TreeNode") -> int:
    return int(node.id)
