"""A draft tree's parent table from sglang's linked lists (docs/speculative_trees.md, "4.4
Single-forward manager").

``launch_tree_parents_kernel``: from a target verify's ``retrieve_next_token`` (a node's first
child) and ``retrieve_next_sibling`` (its next sibling), both int64 ``[bs, n]`` with local node
indices and -1 for none (``EagleVerifyInput``, built by sgl-kernel's
``build_tree_efficient``), fill ``tree.parent[b * n + i]`` (:class:`WriteTree`, the write's
entry order) with node i's parent's local index: ``TREE_PARENT_SEED`` for the root (node 0),
``TREE_PARENT_ORPHAN`` for a node no list reaches (sglang dropped it). Allocation- and
sync-free, grid ``(bs,)``; run before the verify's write (outside a graph: the lists are the
batch's own tensors). ``tree_parents_torch_reference``: the same on the host, step by step.
A node two lists claim, or a list that loops, leaves a parent the write reports as a bad link.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary._checks import check_tensor, same_device
from sglang.jit_kernel.kv_canary._kernel_consts import TREE_PARENT_ORPHAN, TREE_PARENT_SEED
from sglang.jit_kernel.kv_canary._launch import use_triton
from sglang.jit_kernel.kv_canary.consts import (
    TREE_PARENT_ORPHAN as _ORPHAN,
    TREE_PARENT_SEED as _SEED,
)
from sglang.jit_kernel.kv_canary.types import WriteTree


@triton.jit
def _tree_parents_kernel(next_token_ptr, next_sibling_ptr, parent_ptr, n, NBLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, NBLOCK).to(tl.int64)
    m = node < n
    base = b * n
    tl.store(
        parent_ptr + base + node,
        tl.where(node == 0, TREE_PARENT_SEED, TREE_PARENT_ORPHAN).to(tl.int64),
        mask=m,
    )
    tl.debug_barrier()  # every node's "none" stored before any lane names it a child
    child = tl.load(next_token_ptr + base + node, mask=m, other=-1)
    for _ in range(n):  # a node's children: its first child, then that child's siblings
        ok = m & (child >= 0) & (child < n)
        tl.store(parent_ptr + base + child, node, mask=ok)
        child = tl.load(next_sibling_ptr + base + child, mask=ok, other=-1)


def _validate(next_token, next_sibling, tree) -> tuple:
    bs, n = check_tensor("retrieve_next_token", next_token, dtypes=(torch.int64,), ndim=2).shape
    check_tensor("retrieve_next_sibling", next_sibling, dtypes=(torch.int64,), shape=(bs, n))
    if not isinstance(tree, WriteTree):
        raise TypeError(f"tree must be a WriteTree, got {type(tree).__name__}")
    if tree.capacity < bs * n:
        raise ValueError(
            f"tree.parent holds {tree.capacity} entries, fewer than the {bs} x {n} tree nodes"
        )
    same_device(
        {
            "retrieve_next_token": next_token,
            "retrieve_next_sibling": next_sibling,
            "tree.parent": tree.parent,
        }
    )
    return bs, n


def launch_tree_parents_kernel(
    *, next_token: torch.Tensor, next_sibling: torch.Tensor, tree: WriteTree
) -> None:
    """Fill ``tree.parent[: bs * n]`` from the lists (module docstring); on a CPU tensor
    without the Triton interpreter, the torch reference."""
    bs, n = _validate(next_token, next_sibling, tree)
    if bs * n == 0:
        return
    if not use_triton(next_token.device):
        return _run_reference(next_token, next_sibling, tree, bs, n)
    _tree_parents_kernel[(bs,)](
        next_token,
        next_sibling,
        tree.parent,
        n,
        NBLOCK=triton.next_power_of_2(n),
        num_warps=1,
    )


def tree_parents_torch_reference(
    *, next_token: torch.Tensor, next_sibling: torch.Tensor, tree: WriteTree
) -> None:
    """:func:`launch_tree_parents_kernel` on the host, one list at a time (host-synchronous)."""
    bs, n = _validate(next_token, next_sibling, tree)
    _run_reference(next_token, next_sibling, tree, bs, n)


def _run_reference(next_token, next_sibling, tree, bs, n) -> None:
    first, sibling = next_token.tolist(), next_sibling.tolist()
    parent = [[_SEED] + [_ORPHAN] * (n - 1) for _ in range(bs)]
    for b in range(bs):
        for p in range(n):
            child, hops = first[b][p], 0
            while 0 <= child < n and hops < n:
                parent[b][child] = p
                child, hops = sibling[b][child], hops + 1
    tree.parent[: bs * n] = torch.tensor(parent, dtype=torch.int64).flatten().to(tree.parent.device)
