"""Abort mode's marks on a request and the tree-cache release it guards: the no-insert mark around the chunk stash, the release guard, the allocator's pages and frees.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| tree-cache release (``RadixCache`` / ``ChunkCache.cache_finished_req``; the ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` behind it) | hooks ``cache_finished_req``; sets ``kv_canary_release_guard`` on the tree cache; reads the allocator's ``page_size``, ``size``, ``free_pages``, ``release_pages``, ``free_group``, ``is_not_in_free_group``; wraps its ``free`` on the instance for one release (heal mode: for the server's life, dropping retired pages); frees through it; takes retired pages out of ``free_pages`` / ``release_pages``; reads ``Req.kv_committed_len``, ``cache_protected_len``, ``sampling_params.max_new_tokens``; sets ``kv_canary_contained`` on a ``Req`` | ``violations.release_guard``, ``violations.containment``, ``manager.canary_manager``, ``plugin`` |
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Optional, Tuple

from sglang.srt.kv_canary.sglang_seam.radix import is_chunk_cache

if TYPE_CHECKING:  # annotations only
    import torch

    from sglang.srt.managers.schedule_batch import Req


_CANARY_NO_INSERT = "kv_canary_no_radix_insert"


def mark_no_radix_insert(req: "Req") -> None:
    """Tell sglang not to insert the request's KV into the radix cache when it finishes
    (``Req.skip_radix_cache_insert``, which ``release_kv_cache`` honours). sglang's chunked
    prefill honours the same flag when it stashes a chunk, and a request whose chunks are not
    stashed re-prefills the same chunk for ever (allocating each time): the canary's own mark
    is lifted around the stash (:func:`chunk_stash_inserting`). A flag sglang set itself is
    left as it is."""
    if not getattr(req, "skip_radix_cache_insert", False):
        setattr(req, _CANARY_NO_INSERT, True)
    req.skip_radix_cache_insert = True


def unmark_no_radix_insert(req: "Req") -> None:
    """Undo :func:`mark_no_radix_insert` (heal mode, when a taken-back request is queued
    again: its recomputed KV is clean and is cached as any other). A flag sglang set itself
    stays."""
    if getattr(req, _CANARY_NO_INSERT, False):
        delattr(req, _CANARY_NO_INSERT)
        req.skip_radix_cache_insert = False


@contextlib.contextmanager
def chunk_stash_inserting(req: Optional["Req"]):
    """Around sglang's stash of a chunked request's prefilled chunk: the canary's no-insert
    mark (:func:`mark_no_radix_insert`) is lifted so the chunk is cached and the request's
    prefix advances to its next chunk, as for a client's abort (sglang finishes the request
    after its last chunk). What the chunk put in the tree is evicted with the corrupt slot's
    subtree (docs/user_guide.md, "Containment: --kv-canary abort"). No-op for a request the
    canary has not marked (``req`` may be None)."""
    lifted = req is not None and getattr(req, _CANARY_NO_INSERT, False)
    if lifted:
        req.skip_radix_cache_insert = False
    try:
        yield
    finally:
        if lifted:
            req.skip_radix_cache_insert = True


_CANARY_CONTAINED = "kv_canary_contained"
_CANARY_RELEASE_GUARD = "kv_canary_release_guard"


def mark_contained(req: "Req") -> None:
    """Mark a request abort mode aborted (or heal mode takes back): its release is guarded
    (:func:`release_guard_of`)."""
    setattr(req, _CANARY_CONTAINED, True)


def unmark_contained(req: "Req") -> None:
    """Undo :func:`mark_contained` (heal mode, when a taken-back request is queued again)."""
    if hasattr(req, _CANARY_CONTAINED):
        delattr(req, _CANARY_CONTAINED)


def req_contained(req: "Req") -> bool:
    return bool(getattr(req, _CANARY_CONTAINED, False))


def set_release_guard(tree_cache, guard) -> None:
    """Attach abort mode's release guard to the scheduler's tree cache (start-up); the
    ``cache_finished_req`` hook finds it there."""
    setattr(tree_cache, _CANARY_RELEASE_GUARD, guard)


def release_guard_of(tree_cache):
    return getattr(tree_cache, _CANARY_RELEASE_GUARD, None)


def req_release_span(req: "Req", tree_cache) -> Tuple[int, int]:
    """The positions of the request's ``req_to_token`` row whose slots its
    ``cache_finished_req`` frees: from ``cache_protected_len`` (below it the radix cache's
    own; 0 for ``ChunkCache``) to ``kv_committed_len``. The speculative over-allocated tail
    (``kv_committed_len`` to ``kv_allocated_len``) is freed afterwards by
    ``release_kv_cache``."""
    return req_release_start(req, tree_cache), int(req.kv_committed_len)


def req_release_start(req: "Req", tree_cache) -> int:
    """The first position of the request's ``req_to_token`` row that is its own rather than
    the radix cache's (``cache_protected_len``; 0 for ``ChunkCache``): where its release span
    starts, and where sglang's busy-time pool accounting (``_get_total_uncached_sizes``)
    starts counting the request's KV."""
    return 0 if is_chunk_cache(tree_cache) else int(getattr(req, "cache_protected_len", 0) or 0)


def tree_cache_allocator(tree_cache):
    """The tree cache's ``token_to_kv_pool_allocator`` (what its releases free into)."""
    return tree_cache.token_to_kv_pool_allocator


def allocator_page_size(allocator) -> int:
    return int(allocator.page_size)


def allocator_size(allocator) -> int:
    """The allocator's slots (``size``: the KV pool's tokens, padding slot excluded)."""
    return int(allocator.size)


def allocator_free_pages(allocator) -> "torch.Tensor":
    """The pages free now, int64 on the allocator's device: ``free_pages``, ``release_pages``
    (freed, not merged yet) and the slots of an open free group (``free_group``, freed at
    ``free_group_end``) as pages. Page ids are slot ids at page size 1."""
    import torch

    parts = [allocator.free_pages.to(torch.int64), allocator.release_pages.to(torch.int64)]
    if not allocator.is_not_in_free_group and allocator.free_group:
        parts.append(
            torch.cat(allocator.free_group).to(torch.int64) // allocator_page_size(allocator)
        )
    return torch.cat(parts)


def allocator_take_out(allocator, pages: "torch.Tensor") -> int:
    """Take ``pages`` (int64 page ids; slot ids at page size 1) out of the allocator's free
    lists (``free_pages``, ``release_pages``): they are never handed out again. Returns how
    many of them were free. Between batches only (no free group open)."""
    import torch

    taken = 0
    for name in ("free_pages", "release_pages"):
        current = getattr(allocator, name)
        hit = torch.isin(current.to(torch.int64), pages.to(current.device, torch.int64))
        if bool(hit.any()):
            taken += int(hit.sum())
            setattr(allocator, name, current[~hit])
    return taken


def allocator_retiring(allocator, retired, on_drop: Callable[[list], None]) -> None:
    """From now on, for the allocator's life, ``allocator.free(indices)`` drops the slots on
    a page in ``retired`` (a set of page ids the caller grows) and hands those pages to
    ``on_drop``: an instance-level wrap of ``free`` (what :func:`allocator_frees_filtered`
    wraps and restores in turn). Nothing is checked while ``retired`` is empty."""
    import torch

    original = allocator.free
    page_size = allocator_page_size(allocator)

    def free(free_index):
        if retired and free_index.numel():
            pages = free_index.to(torch.int64) // page_size
            ids = torch.tensor(sorted(retired), dtype=torch.int64, device=pages.device)
            dropped = torch.isin(pages, ids)
            if bool(dropped.any()):
                on_drop(torch.unique(pages[dropped]).tolist())
                free_index = free_index[~dropped]
                if not free_index.numel():
                    return None
        return original(free_index)

    allocator.free = free


@contextlib.contextmanager
def allocator_frees_filtered(allocator, keep: Callable[["torch.Tensor"], "torch.Tensor"]):
    """Within the block, every ``allocator.free(indices)`` frees ``keep(indices)`` instead
    (a slot tensor of the same dtype; nothing when it is empty): the instance's ``free`` is
    wrapped for the block and restored after it."""
    own = vars(allocator).get("free")  # an instance-level ``free`` set before ours, if any
    original = allocator.free

    def free(free_index):
        kept = keep(free_index)
        if kept.numel():
            original(kept)

    allocator.free = free
    try:
        yield
    finally:
        if own is None:
            del allocator.free  # the class's method again
        else:
            allocator.free = own
