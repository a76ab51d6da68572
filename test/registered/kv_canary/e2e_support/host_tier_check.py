"""The host-tier mirror on real sglang pools, in a process with the libcuda stub and the HiCache
CPU shims (sitecustomize): ``python host_tier_check.py``. Builds an ``MHATokenToKVPool`` with the
canary (real data partial, per-layer fingerprints) and an ``MHATokenToKVPoolHost``, backs slots
up and loads them back into other slots through the host pool's own (wrapped) methods, and
prints ``RESULT <json>`` with what it found, and the host pool's size with and without the
canary (the plugin's hooks applied, as in a server process)."""

import torch

from engine_main import RESULT_TAG, emit
from sglang.srt.plugins import load_plugins

from sglang.srt.kv_canary.builder import build_canary
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.memory import MemoryPart
from sglang.srt.kv_canary.manager.hicache import HostTierMirror
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost


def tiny_pool(layers: int = 2):
    """A 64-slot ``MHATokenToKVPool`` on the CPU (2 KV heads of 8, bfloat16)."""
    return MHATokenToKVPool(
        size=64,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )


def _host(device_pool, ratio=3.0, size_gb=0.0):
    return MHATokenToKVPoolHost(
        device_pool,
        host_to_device_ratio=ratio,
        host_size=size_gb,
        page_size=1,
        layout="layer_first",
        pin_memory=False,
    )


def _host_sizes(manager, pool):
    """Host slots with and without the canary, in ratio and size mode (the plugin's hook on
    HostKVCache.__init__ sizes a guarded pool's host pool), and a ratio the mirror cannot
    fit."""
    bare = tiny_pool()
    out = {"kv_per_token": 2 * 2 * 8 * 2 * 2, "mirror_per_slot": manager.host_mirror_bytes_per_slot}
    for label, kw in (("ratio", dict(ratio=3.0)), ("size", dict(size_gb=0.0001))):
        out[label] = {"off": _host(bare, **kw).size, "on": _host(pool, **kw).size}
    try:
        _host(pool, ratio=1.2)
        out["tight_ratio"] = "accepted"
    except ValueError as e:
        out["tight_ratio"] = str(e)
    return out


def _memory_host_mirror(manager, mirror):
    """The host mirror's bytes in the manager's memory once the tree attached it."""
    manager.host_tier = mirror  # what attach_radix_cache does with a HiRadixCache's host pool
    return dict(manager.memory.host).get(MemoryPart.HOST_MIRROR)


if __name__ == "__main__":
    load_plugins()  # the plugin's hooks, as in a server process
    pool = tiny_pool()
    r2t = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    config = CanaryConfig(
        mode="raise", real_kv_hash_mode="partial", real_data_layers="all", enable_mha_v=True
    )
    manager = build_canary(
        pool=pool,
        req_to_token=r2t.req_to_token,
        config=config,
        device="cpu",
        capacity_inputs=CanaryCapacityInputs(
            context_len=64, chunked_prefill_size=16, max_prefill_tokens=64
        ),
    )
    host = MHATokenToKVPoolHost(
        pool,
        host_to_device_ratio=3.0,
        host_size=0,
        page_size=1,
        layout="layer_first",
        pin_memory=False,
    )
    mirror = HostTierMirror(groups=manager.groups, host_pool=host)
    g = torch.Generator().manual_seed(0)
    buffers = [p[0] for p in mirror.pairs]  # device rows: K head/tail, V head/tail, table
    for rows in buffers:
        rows.copy_(torch.randint(-(2**62), 2**62, rows.shape, generator=g))
    for layer in range(2):
        pool.k_buffer[layer].normal_(generator=g)
        pool.v_buffer[layer].normal_(generator=g)
    dev = torch.tensor([5, 6, 7, 30], dtype=torch.int64)
    hst = torch.tensor([70, 71, 80, 2], dtype=torch.int64)  # the host pool holds 86 slots
    before = [rows[dev].clone() for rows in buffers]
    kv_before = pool.k_buffer[1][dev].clone()
    host.backup_from_device_all_layer(pool, hst, dev, "direct")
    on_host = all(torch.equal(mirror.host_rows(i)[hst], b) for i, b in enumerate(before))
    new = torch.tensor([40, 41, 42, 43], dtype=torch.int64)
    for layer in range(2):
        host.load_to_device_per_layer(pool, hst, new, layer, "direct")
    back = all(torch.equal(rows[new], b) for rows, b in zip(buffers, before))
    emit(
        RESULT_TAG,
        {
            "on_host": on_host,
            "back": back,
            "kv_back": bool(torch.equal(pool.k_buffer[1][new], kv_before)),
            "pairs": len(mirror.pairs),
            "bytes_per_host_slot": mirror.bytes_per_host_slot,
            "backed_up": mirror.backed_up_slots,
            "loaded": mirror.loaded_slots,
            "host_slots": mirror.host_slots,
            "sizes": _host_sizes(manager, pool),
            "mirror_bytes": sum(h.nbytes for _, h in mirror.pairs),
            "memory_host_mirror": _memory_host_mirror(manager, mirror),
        },
    )
