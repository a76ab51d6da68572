"""HiCache with a speculative draft pool, on real sglang pools, in a process with the libcuda
stub and the HiCache CPU shims (sitecustomize): ``python draft_host_tier_check.py``. A target
and an EAGLE draft ``MHATokenToKVPool``, each with its canary (the plugin's hooks applied, as
in a server process); the target's ``MHATokenToKVPoolHost``; both canaries attached to the
tree as the scheduler's ``init_cache_with_memory_pool`` hook does; then sglang's own
``Scheduler._maybe_register_hicache_draft`` (on a stand-in scheduler and controller) builds the
draft's host pool. Slots are backed up and loaded back into other slots through both host
pools' own (wrapped) methods, target then draft, as ``HiCacheController`` does. Prints
``RESULT <json>``: whether each canary's rows went to its host pool and came back, both host
pools' slot counts, and what went wrong where.

``python draft_host_tier_check.py dflash``: sglang 0.5.12's DFLASH case, where
``_get_draft_kv_pool`` returns the target's pool, so the "draft" host pool copies the target's
KV a second time and the draft pool's KV has no host copy."""

import sys

import types

import torch

from engine_main import RESULT_TAG, emit
from host_tier_check import tiny_pool
from sglang.srt.plugins import load_plugins

from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.builder import build_canary
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.memory import MemoryPart
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost


def _rows_moved(manager, dev, new, before):
    host = manager.host_tier
    rows = [p[0] for p in host.pairs]
    return all(torch.equal(r[new], b) for r, b in zip(rows, before))


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["dflash"]):
        sys.exit(f"draft_host_tier_check.py: arguments {sys.argv[1:]}; allowed: none, or dflash")
    dflash = sys.argv[1:] == ["dflash"]
    load_plugins()
    r2t = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    config = CanaryConfig(mode="raise", real_kv_hash_mode="partial")
    caps = CanaryCapacityInputs(context_len=64, chunked_prefill_size=16, max_prefill_tokens=64)
    target_pool, draft_pool = tiny_pool(2), tiny_pool(1)
    common = dict(req_to_token=r2t.req_to_token, config=config, device="cpu", capacity_inputs=caps)
    target = build_canary(pool=target_pool, **common)
    draft = build_canary(pool=draft_pool, ranks=RankFacts(draft=True, draft_steps=3), **common)
    runners = [types.SimpleNamespace(), types.SimpleNamespace(is_draft_worker=True)]
    seam.set_runner_canary(runners[0], target)
    seam.set_runner_canary(runners[1], draft)
    host = MHATokenToKVPoolHost(
        target_pool, host_to_device_ratio=3.0, host_size=0, page_size=1, layout="layer_first"
    )
    controller = types.SimpleNamespace(
        mem_pool_host=host, mem_pool_device=target_pool, has_draft=False
    )
    controller.set_draft_kv_pool = types.MethodType(HiCacheController.set_draft_kv_pool, controller)
    tree = types.SimpleNamespace(cache_controller=controller)
    scheduler = types.SimpleNamespace(
        tp_worker=types.SimpleNamespace(model_runner=runners[0]),
        draft_worker=types.SimpleNamespace(model_runner=runners[1]),
        tree_cache=tree,
        enable_hierarchical_cache=True,
        page_size=1,
        server_args=types.SimpleNamespace(hicache_mem_layout="layer_first"),
        _get_draft_kv_pool=lambda: (target_pool if dflash else draft_pool, None),
    )
    registered_pool = target_pool if dflash else draft_pool
    errors = {}
    for name, manager in (("target", target), ("draft", draft)):
        try:  # what the plugin's init_cache_with_memory_pool hook does for each canary
            manager.attach_radix_cache(tree)
        except Exception as exc:  # reported, not raised: the test names what failed
            errors[f"attach_{name}"] = f"{type(exc).__name__}: {exc}"
    draft_mirrored_before_register = draft.host_tier is not None
    Scheduler._maybe_register_hicache_draft(scheduler)  # sglang's own; the plugin's hook after
    draft_host = controller.mem_pool_host_draft
    # what sglang's registration gives a draft pool without a canary
    bare_draft_host = MHATokenToKVPoolHost(
        tiny_pool(2 if dflash else 1),
        host_to_device_ratio=host.size / 64,
        host_size=0,
        page_size=1,
        layout="layer_first",
    )
    g = torch.Generator().manual_seed(0)
    for manager in (target, draft):
        for rows, _ in manager.host_tier.pairs if manager.host_tier else ():
            rows.copy_(torch.randint(-(2**62), 2**62, rows.shape, generator=g))
    dev = torch.tensor([5, 6, 7, 30], dtype=torch.int64)
    hst = torch.tensor([70, 71, 80, host.size - 1], dtype=torch.int64)
    new = torch.tensor([40, 41, 42, 43], dtype=torch.int64)
    before = {
        name: [p[0][dev].clone() for p in m.host_tier.pairs] if m.host_tier else None
        for name, m in (("target", target), ("draft", draft))
    }
    moved = {}
    try:  # HiCacheController's backup, then its per-layer load: target, then draft
        host.backup_from_device_all_layer(target_pool, hst, dev, "direct")
        draft_host.backup_from_device_all_layer(registered_pool, hst, dev, "direct")
        for layer in range(2):
            host.load_to_device_per_layer(target_pool, hst, new, layer, "direct")
            if layer < draft_host.layer_num:
                draft_host.load_to_device_per_layer(registered_pool, hst, new, layer, "direct")
        for name, m in (("target", target), ("draft", draft)):
            moved[name] = m.host_tier is not None and _rows_moved(m, dev, new, before[name])
    except Exception as exc:
        errors["copies"] = f"{type(exc).__name__}: {exc}"
    emit(
        RESULT_TAG,
        {
            "errors": errors,
            "host_slots": host.size,
            "draft_host_slots": draft_host.size if draft_host is not None else None,
            "draft_host_slots_canary_off": bare_draft_host.size,
            "draft_mirrored_before_register": draft_mirrored_before_register,
            "draft_mirror_host_pool_is_drafts": bool(
                draft.host_tier is not None and draft.host_tier.host_pool is draft_host
            ),
            "moved": moved,
            "draft_memory_host_mirror": dict(draft.memory.host).get(MemoryPart.HOST_MIRROR)
            if draft.host_tier
            else None,
        },
    )
