"""KV pool instances: page size, buffer sizes, the pool's canary, sglang's pool classes, methods wrapped once on an instance.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| KV pool instances | wraps buf-info methods on the instance (:func:`wrap_method_once`); pool classes (:func:`import_sglang_class`); each adapter reads its pool's buffers (listed in the adapter's docstring); reads ``page_size`` (the kept ``req_to_token`` self-test's unit) | ``pool_patcher``, ``manager.canary_manager`` |
| KV pools' ``full_kv_pool`` / ``swa_kv_pool`` sub-pools and ``k_buffer`` / ``v_buffer`` tensors | binds the canary groups fingerprinting those tensors to the pool (:func:`bind_kv_move_groups`), whose ``move_kv_cache`` the plugin mirrors | ``builder``, ``plugin`` |
| ``memory_pool.HybridLinearKVPool``, ``deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool`` | ``isinstance`` (:func:`hybrid_linear_or_dsv4_pool`): the pools a separate draft model's runner is refused on | ``startup_checks`` |
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:  # annotations only
    from sglang.srt.mem_cache.memory_pool import KVCache


_WRAPPED_METHODS_ATTR = "_kv_canary_wrapped_methods"


def kv_pool_page_size(kv_pool: "KVCache") -> int:
    """The pool's page size (``KVCache.page_size``; the hybrid pools' too)."""
    return int(kv_pool.page_size)


def import_sglang_class(module: str, name: str) -> type:
    """``module.name`` from sglang; ``ImportError`` when this build lacks it."""
    cls = getattr(importlib.import_module(module), name, None)
    if cls is None:
        raise ImportError(f"{module} has no {name}")
    return cls


def hybrid_linear_or_dsv4_pool(kv_pool: "KVCache") -> Optional[str]:
    """The sglang class ``kv_pool`` is an instance of when it is a ``HybridLinearKVPool`` or a
    ``DeepSeekV4TokenToKVPool``; None for any other pool."""
    for module, name in (
        ("sglang.srt.mem_cache.memory_pool", "HybridLinearKVPool"),
        ("sglang.srt.mem_cache.deepseek_v4_memory_pool", "DeepSeekV4TokenToKVPool"),
    ):
        if isinstance(kv_pool, import_sglang_class(module, name)):
            return name
    return None


def wrap_method_once(obj, method_name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``obj.method_name`` (on the instance) with ``make_wrapper(original)``.

    Raises ``RuntimeError`` if the canary already wrapped this method on this object (a second
    attach would splice the canary buffers twice and break PD transfers)."""
    wrapped = obj.__dict__.setdefault(_WRAPPED_METHODS_ATTR, set())
    if method_name in wrapped:
        raise RuntimeError(
            f"kv_canary already wrapped {type(obj).__name__}.{method_name} on this pool; "
            "canary buffers can be attached to a pool only once"
        )
    original = getattr(obj, method_name)
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    setattr(obj, method_name, wrapper)
    wrapped.add(method_name)


# set by the builder on a guarded device pool: its canary manager (HiCache sizes the host pool
# from it, and the host tier's mirror of its records goes beside the host KV)
_POOL_CANARY_ATTR = "kv_canary_manager"


def set_pool_canary(kv_pool: "KVCache", manager) -> None:
    setattr(kv_pool, _POOL_CANARY_ATTR, manager)


def pool_canary(kv_pool: "KVCache"):
    return getattr(kv_pool, _POOL_CANARY_ATTR, None)


# the canary groups whose records follow this pool's ``move_kv_cache`` (an MHA pool's, or an
# SWA / hybrid pool's sub-pools': their own ``move_kv_cache`` calls reach the sub-pools)
_KV_MOVE_GROUPS_ATTR = "kv_canary_move_groups"
_SUB_POOL_ATTRS = ("full_kv_pool", "swa_kv_pool")


def bind_kv_move_groups(kv_pool: "KVCache", groups) -> int:
    """Bind to ``kv_pool`` and to each of its sub-pools (``full_kv_pool``, ``swa_kv_pool``)
    that keeps its KV in ``k_buffer`` / ``v_buffer`` the groups among ``groups`` that
    fingerprint those tensors (``CanaryBufferGroup.fingerprinted_tensors``): the groups whose
    records :func:`kv_move_groups` returns for that pool's ``move_kv_cache``. Returns how many
    pools got a group. Start-up only."""
    pools = [kv_pool] + [
        sub for sub in (getattr(kv_pool, a, None) for a in _SUB_POOL_ATTRS) if sub is not None
    ]
    bound = 0
    for pool in pools:
        if not hasattr(pool, "k_buffer"):
            continue
        ptrs = {t.data_ptr() for t in (*pool.k_buffer, *pool.v_buffer)}
        mine = tuple(
            g for g in groups if any(t.data_ptr() in ptrs for t in g.fingerprinted_tensors())
        )
        if mine:
            setattr(pool, _KV_MOVE_GROUPS_ATTR, mine)
            bound += 1
    return bound


def kv_move_groups(kv_pool: "KVCache") -> tuple:
    """The groups :func:`bind_kv_move_groups` bound to ``kv_pool`` (empty: none)."""
    return getattr(kv_pool, _KV_MOVE_GROUPS_ATTR, ())


def kv_pool_bytes_per_token(kv_pool: "KVCache") -> int:
    """KV bytes one token takes over all of an MHA or MLA pool's layers (one row of each
    layer's ``k_buffer`` and ``v_buffer``, or of its ``kv_buffer``): what HiCache's host pool
    of that device pool stores per token (``HostKVCache.get_size_per_token``)."""
    if hasattr(kv_pool, "k_buffer"):
        return sum(int(b[0].nbytes) for b in (*kv_pool.k_buffer, *kv_pool.v_buffer))
    return sum(int(b[0].nbytes) for b in kv_pool.kv_buffer)


def kv_pool_size(kv_pool: "KVCache") -> int:
    return int(kv_pool.size)
