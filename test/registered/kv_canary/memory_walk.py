"""What a built canary holds, found by walking it: every tensor reachable from a
``CanaryManager`` through the canary's own objects, each storage counted once, sglang's
tensors (the pool's, ``req_to_token``, the allocator's tables) left out. Used to check
:class:`sglang.srt.kv_canary.memory.CanaryMemory` against what was really allocated."""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Dict, Iterable, Set, Tuple

import torch

from sglang.srt.kv_canary.memory import MemoryPart

_OURS = ("sglang.srt.kv_canary", "sglang.jit_kernel.kv_canary")

# attribute path prefixes (from the manager) -> part; the first match wins
_PARTS = (
    (".groups[].deep", MemoryPart.LAYER_FINGERPRINTS),
    (".groups[]", MemoryPart.RECORDS),
    (".sfms[].plans", MemoryPart.PLANS),
    (".sfms[]", MemoryPart.FORWARD_INPUTS),
    (".state.req_to_verify_expected_tokens", MemoryPart.TOKEN_TABLE),
    (".token_history", MemoryPart.TOKEN_TABLE),
    (".sweep", MemoryPart.SWEEP),
    (".state", MemoryPart.READBACK),
    (".device_host", MemoryPart.READBACK),
    (".host_tier", MemoryPart.HOST_MIRROR),
    (".endpoints[].context", MemoryPart.RECORDS),  # the launch contexts' source descriptors
)


def _children(obj) -> Iterable[Tuple[str, object]]:
    if isinstance(obj, dict):
        return (("[]", v) for v in obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return (("[]", v) for v in obj)
    items = list(getattr(obj, "__dict__", {}).items())
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()) or ():
            if hasattr(obj, name):
                items.append((name, getattr(obj, name)))
    return ((f".{k}", v) for k, v in items)


def walk_tensors(root, *, ours_only: bool, depth: int = 14):
    """Yield (path, tensor) for each tensor reachable from ``root`` (containers and, with
    ``ours_only``, only the canary's own objects are entered)."""
    seen: Set[int] = set()
    stack = [("", root, 0)]
    while stack:
        path, obj, d = stack.pop(0)
        if isinstance(obj, torch.Tensor):
            yield path, obj
            continue
        if id(obj) in seen or d > depth or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen.add(id(obj))
        container = isinstance(obj, (dict, list, tuple, set, frozenset))
        module = type(obj).__module__ or ""
        if not container and ours_only and not module.startswith(_OURS):
            continue
        if (
            not container
            and not ours_only
            and (
                module.startswith(_OURS)
                or not (module.startswith("sglang") or dataclasses.is_dataclass(obj))
            )
        ):
            continue  # sglang's objects, not the canary's (a guarded pool names its canary)
        stack.extend((path + k, v, d + 1) for k, v in _children(obj))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def canary_bytes_by_part(manager, *, foreign: Iterable[object]) -> Dict[MemoryPart, int]:
    """Bytes of the tensors ``manager`` holds, by part (each storage once; a storage met on
    several paths goes to the first part of the table that any of them names). ``foreign``:
    sglang objects (pools, tables) whose tensors are not the canary's. Raises if a tensor's
    paths match no part."""
    theirs = {_storage(t) for obj in foreign for _, t in walk_tensors(obj, ours_only=False)}
    paths: Dict[int, list] = collections.defaultdict(list)
    sizes: Dict[int, int] = {}
    for path, t in walk_tensors(manager, ours_only=True):
        ptr = _storage(t)
        if ptr in theirs or t.untyped_storage().nbytes() == 0:
            continue
        paths[ptr].append(re.sub(r"\[\d+\]", "[]", path))
        sizes[ptr] = t.untyped_storage().nbytes()
    parts: Dict[MemoryPart, int] = collections.Counter()
    for ptr, named in paths.items():
        part = next((p for prefix, p in _PARTS if any(n.startswith(prefix) for n in named)), None)
        if part is None:
            raise AssertionError(
                f"the canary holds a tensor at {named} that no memory part "
                "names; add it to CanaryMemory and to this walk's table"
            )
        parts[part] += sizes[ptr]
    return dict(parts)


def formula_bytes_by_part(memory) -> Dict[MemoryPart, int]:
    """Device and host bytes of a :class:`CanaryMemory`, added per part."""
    parts: Dict[MemoryPart, int] = collections.Counter()
    for part, n in memory.device + memory.host:
        parts[part] += n
    return dict(parts)
