"""Which CUDA allocations of a built + captured canary does the memory walk not see?"""
import sys, collections, torch
sys.path.insert(0, "test/registered/kv_canary")
from memory_walk import walk_tensors
from sglang.srt.kv_canary.builder import build_canary
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

CONFIGS = {"raise": {}, "v": dict(enable_mha_v=True), "layers": dict(real_kv_hash_mode="partial", real_data_layers="all"),
           "tokens": dict(enable_verify_token_assert=True), "sweep": dict(sweep_interval=4), "partial": dict(real_kv_hash_mode="partial")}
for name, cfg in [(sys.argv[1], CONFIGS[sys.argv[1]])]:
    pool = MHATokenToKVPool(size=20000, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=3, device="cuda", enable_memory_saver=False, enable_alt_stream=False)
    r2t = ReqToTokenPool(size=64, max_context_len=4096, device="cuda", enable_memory_saver=False)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    before = torch.cuda.memory_allocated()
    m = build_canary(pool=pool, req_to_token=r2t.req_to_token, config=CanaryConfig(mode="raise", **cfg), device="cuda",
                     capacity_inputs=CanaryCapacityInputs(context_len=4096, chunked_prefill_size=512, cuda_graph_max_bs=64))
    mid = torch.cuda.memory_allocated()
    m.mark_init_finished()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    theirs = {t.untyped_storage().data_ptr() for o in (pool, r2t) for _, t in walk_tensors(o, ours_only=False)}
    ours = {t.untyped_storage().data_ptr() for _, t in walk_tensors(m, ours_only=True) if t.is_cuda}
    extra = collections.Counter()
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] != "active_allocated":
                continue
            a = blk["address"]
            if a in ours or a in theirs:
                continue
            frames = blk.get("frames") or []
            where = " <- ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in frames[:14])[:700]
            extra[(blk["size"], where, seg.get("segment_pool_id"))] += 1
    print(f"== {name}: build {mid-before} capture {after-mid}")
    for (size, where, poolid), n in sorted(extra.items(), key=lambda kv: -kv[0][0]*kv[1])[:12]:
        print(f"  {n} x {size} pool={poolid} {where}")
    del m, pool, r2t
    torch.cuda.empty_cache()
