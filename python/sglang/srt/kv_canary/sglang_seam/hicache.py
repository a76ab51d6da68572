"""HiCache (hierarchical cache): the host pool, its sizing hook, its copies wrapped to carry the canary rows, pending loads and writes.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| HiCache host pool sizing (``HostKVCache.__init__``) | hook target: its ``host_to_device_ratio`` / ``host_size`` arguments; reads the device pool's ``size`` and per-token row bytes (``k_buffer`` / ``v_buffer`` / ``kv_buffer``); the builder sets ``kv_canary_manager`` on the guarded pool | ``memory_budget``, ``builder`` |
| ``Scheduler._maybe_register_hicache_draft`` (hooked, AROUND: its host pool built at sglang's size); ``HiCacheController.has_draft``, ``.mem_pool_device_draft``, ``.mem_pool_host_draft`` | a speculative draft pool's own host pool (one host slot per target host slot), whose copies the draft canary's mirror wraps | ``plugin``, ``manager.scheduler_side`` |
| HiCache (``HiRadixCache.cache_controller``: ``mem_pool_host``, ``load_stream``; host pool ``size``, ``page_size``, ``layout``, ``k_buffer`` / ``v_buffer`` / ``kv_buffer``, ``backup_from_device_all_layer``, ``load_to_device_per_layer``; nodes' ``host_value``, ``id``; ``ongoing_write_through``; the device pool's ``layer_transfer_counter``) | wraps the host pool's two copy methods on the instance to copy the canary rows with the KV; waits for loads before reading records; lists host-resident pages; flips a host byte (``host_kv`` self-test) | ``manager.hicache``, ``perturb`` |
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from sglang.srt.kv_canary.sglang_seam.pools import wrap_method_once

if TYPE_CHECKING:  # annotations only
    pass


def hicache_host_pool(radix_cache):
    """The host-tier KV pool of a ``HiRadixCache`` (``cache_controller.mem_pool_host``), or
    None for a tree without a host tier."""
    controller = getattr(radix_cache, "cache_controller", None)
    return getattr(controller, "mem_pool_host", None) if controller is not None else None


def hicache_draft_pools(radix_cache):
    """``(device pool, host pool)`` of a speculative draft model's KV that sglang's HiCache
    copies beside the target's (``HiCacheController.set_draft_kv_pool``, called by
    ``Scheduler._maybe_register_hicache_draft`` once the tree exists), or ``(None, None)``
    where it registered none."""
    controller = getattr(radix_cache, "cache_controller", None)
    if controller is None or not getattr(controller, "has_draft", False):
        return None, None
    return controller.mem_pool_device_draft, controller.mem_pool_host_draft


def hicache_wait_for_loads(radix_cache) -> None:
    """Make the current stream wait for every host -> device load queued so far (the sweep
    reads records of slots a queued load fills). CUDA only; a no-op on the CPU, where the
    loads are synchronous."""
    controller = getattr(radix_cache, "cache_controller", None)
    stream = getattr(controller, "load_stream", None) if controller is not None else None
    import torch

    if stream is not None and isinstance(stream, torch.cuda.Stream):
        torch.cuda.current_stream(stream.device).wait_stream(stream)


def hicache_wait_for_first_layer(kv_pool) -> None:
    """Make the current stream wait until this forward's host -> device load has finished its
    first layer (which carries the canary rows): sglang's ``layer_transfer_counter``, a no-op
    when the forward loads nothing (decode) or the pool has no host tier."""
    counter = getattr(kv_pool, "layer_transfer_counter", None)
    if counter is not None:
        counter.wait_until(0)


def host_pool_kind(host_pool) -> str:
    """``mha`` or ``mla`` for the host pools the canary mirrors; raises for others."""
    from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost

    if isinstance(host_pool, MHATokenToKVPoolHost):
        return "mha"
    if isinstance(host_pool, MLATokenToKVPoolHost):
        return "mla"
    raise NotImplementedError(
        f"kv_canary does not mirror HiCache host pool {type(host_pool).__name__} (supported: "
        "MHATokenToKVPoolHost, MLATokenToKVPoolHost); run without --enable-hierarchical-cache "
        "or without --kv-canary"
    )


def host_pool_class_kind(host_pool_cls: type) -> Optional[str]:
    """``mha`` / ``mla`` for the host pool classes the canary mirrors, else None."""
    from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost

    if issubclass(host_pool_cls, MHATokenToKVPoolHost):
        return "mha"
    if issubclass(host_pool_cls, MLATokenToKVPoolHost):
        return "mla"
    return None


def host_pool_size(host_pool) -> int:
    return int(host_pool.size)


def host_pool_layer_rows(host_pool, layer: int, half: str):
    """``(tensor, page_size)``: the host rows of local ``layer``'s ``half`` ('k' / 'v'; MLA:
    'k', the latent row) addressed as the record format's ``RealKvSource`` addresses them
    (slot ``h`` = row ``h // page_size``, token ``h % page_size``). Raises for the
    ``page_head`` layout, whose rows are not contiguous per token."""
    layout = host_pool.layout
    kind = host_pool_kind(host_pool)
    if kind == "mha":
        buf = host_pool.k_buffer if half == "k" else host_pool.v_buffer
    else:
        if half != "k":
            raise ValueError("MLA host pools have K (latent) rows only")
        buf = host_pool.kv_buffer
    if layout == "layer_first":
        return buf[layer], 1
    if layout == "page_first":
        return buf[:, layer], 1
    if layout == "page_first_direct":
        return buf[:, layer], int(host_pool.page_size)
    raise ValueError(
        f"kv_canary cannot address HiCache host rows in layout {layout!r} "
        "(supported: layer_first, page_first, page_first_direct)"
    )


def wrap_host_pool_copies(host_pool, *, after_backup: Callable, before_load: Callable) -> None:
    """Wrap the host pool's two copy methods on the instance (once): ``after_backup(host_
    indices, device_indices)`` after each device -> host backup, ``before_load(host_indices,
    device_indices)`` before the first layer's host -> device load. Both run where sglang runs
    the copy (the scheduler thread, inside its write / load stream)."""

    def make_backup(original):
        def backup(device_pool, host_indices, device_indices, io_backend):
            result = original(device_pool, host_indices, device_indices, io_backend)
            after_backup(host_indices, device_indices)
            return result

        return backup

    def make_load(original):
        def load(device_pool, host_indices, device_indices, layer_id, io_backend):
            if layer_id == 0:
                before_load(host_indices, device_indices)
            return original(device_pool, host_indices, device_indices, layer_id, io_backend)

        return load

    wrap_method_once(host_pool, "backup_from_device_all_layer", make_backup)
    wrap_method_once(host_pool, "load_to_device_per_layer", make_load)


def hicache_pending_write_node_ids(radix_cache) -> set:
    """Nodes whose device -> host backup may still be in flight (their host rows are not
    final yet)."""
    return set(getattr(radix_cache, "ongoing_write_through", {}) or {})
