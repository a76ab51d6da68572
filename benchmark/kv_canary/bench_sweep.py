"""Cost of one radix-cache sweep pass (walk + plan + verify) on a real sglang RadixCache.

    python benchmark/kv_canary/bench_sweep.py [--tokens 100000 1000000] [--out FILE] [--smoke]

Builds a real ``RadixCache`` over a real ``MHATokenToKVPool`` (Qwen3-0.6B-like layer 0: 8 KV
heads × 128 × bf16 = 2048 bytes per token) holding the requested number of cached tokens as a
two-level tree (shared prefixes of 512 tokens, each with branches of 256), writes consistent
canary records for every cached slot with the write kernel, then times a full sweep pass per
real-KV mode: the host walk (incl. the device flattening), the plan chunks and the verify
launches, and checks that the clean cache reports no violation. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys
import time

import torch

from sglang.jit_kernel.kv_canary import (
    CanaryLaunchTag,
    RealKvHashMode,
    RealKvSource,
    WritePlan,
    launch_canary_write_kernel,
)
from sglang.jit_kernel.kv_canary.deep import (
    launch_deep_fingerprint_verify,
    launch_deep_fingerprint_write,
)
from sglang.jit_kernel.kv_canary.types import DeepFingerprintTable
from sglang.srt.kv_canary.pool_patcher.layer_columns import layer_columns
from sglang.srt.kv_canary.radix_cache_walker import walk_radix_cache_for_canary
from sglang.srt.kv_canary.capacities import SWEEP_CHUNK_CAPACITY
from sglang.srt.kv_canary.sweep_plan_builder import build_verify_plan_radix_sweep
from sglang.jit_kernel.kv_canary.verify import (
    VerifyPlan,
    launch_canary_verify_kernel,
)
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import use_test_support  # noqa: E402  (a sibling module)

use_test_support()
from canary_testlib import make_context  # noqa: E402

PREFIX, BRANCH, BRANCHES = 512, 256, 4


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(tokens: int, device, head_num=8, head_dim=128, layers=1):
    num_slots = tokens + 16
    pool = MHATokenToKVPool(
        size=num_slots,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=head_num,
        head_dim=head_dim,
        layer_num=layers,
        device=str(device),
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    for layer in range(layers):
        pool.k_buffer[layer].normal_()
        pool.v_buffer[layer].normal_()
    alloc = TokenToKVPoolAllocator(num_slots, torch.bfloat16, str(device), pool, need_sort=False)
    r2t = ReqToTokenPool(size=4, max_context_len=8, device=str(device), enable_memory_saver=False)
    cache = RadixCache(
        CacheInitParams(
            disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1
        )
    )
    per_group = PREFIX + BRANCHES * BRANCH
    groups = max(1, tokens // per_group)
    g = torch.Generator().manual_seed(0)
    seqs = []  # (tokens, slots, seed slot, first position)
    for i in range(groups):
        ptok = torch.randint(0, 150000, (PREFIX,), generator=g).tolist()
        pslots = alloc.alloc(PREFIX)
        cache.insert(InsertParams(key=RadixKey(ptok), value=pslots))
        seqs.append((ptok, pslots, -1, 0))
        for _ in range(BRANCHES):
            btok = torch.randint(0, 150000, (BRANCH,), generator=g).tolist()
            bslots = alloc.alloc(BRANCH)
            cache.insert(InsertParams(key=RadixKey(ptok + btok), value=torch.cat([pslots, bslots])))
            seqs.append((btok, bslots, int(pslots[-1]), PREFIX))
    return pool, cache, seqs


def sweep_context(pool, mode):
    """The sweep's context over layer 0's K rows: a ring of 64 rows, the chain-position
    check off (as a freshly allocated device state has it)."""
    k = pool.k_buffer[0]
    src = RealKvSource(
        tensor=k, page_size=1, num_bytes_per_token=k[0].nbytes, read_bytes=k[0].nbytes
    )
    return make_context(
        k.shape[0],
        device=k.device,
        kind=CanaryLaunchTag.SWEEP_K_FULL,
        sources=(src,) if mode else (),
        mode=mode,
        ring_capacity=64,
        chain_assert=0,
    )


def write_records(ctx, seqs, device):
    """Consistent records for the cache: prefixes (chain heads) first, then branches."""
    for head in (True, False):
        part = [s for s in seqs if (s[2] < 0) == head]
        n = len(part)
        lens = torch.tensor([len(s[0]) for s in part])
        plan = WritePlan.allocate(write_req_capacity=n, device=device)
        plan.write_offsets[1:].copy_(lens.cumsum(0))
        plan.write_seed_slot_indices.copy_(torch.tensor([s[2] for s in part]))
        plan.write_num_valid_reqs.fill_(n)
        launch_canary_write_kernel(
            context=ctx,
            plan=plan,
            input_ids=torch.tensor([t for s in part for t in s[0]], device=device),
            positions=torch.cat([torch.arange(s[3], s[3] + len(s[0])) for s in part]).to(device),
            out_cache_loc=torch.cat([s[1].to(torch.int64) for s in part]).to(device),
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
        )


def deep_table(pool, mode, seqs, device):
    """The per-layer table over every layer's K and V rows, filled as forwards fill
    it (one write of every cached slot)."""
    cols = layer_columns(
        list(range(len(pool.k_buffer))), pool.k_buffer, pool.v_buffer, what="bench"
    )
    table = DeepFingerprintTable.allocate(
        num_slots=pool.k_buffer[0].shape[0],
        columns=cols,
        mode=mode,
        layers_per_forward=1,
        device=device,
    )
    loc = torch.cat([s[1].to(torch.int64) for s in seqs]).to(device)
    plan = WritePlan.allocate(write_req_capacity=1, device=device)
    plan.write_offsets[1] = loc.numel()
    plan.write_num_valid_reqs.fill_(1)
    launch_deep_fingerprint_write(table=table, plan=plan, out_cache_loc=loc)
    return table


def deep_sweep_once(cache, ctx, table, plan, device):
    """Plan + every layer's check of every cached slot (the walk is the pass's own)."""
    walk = walk_radix_cache_for_canary(radix_cache=cache)
    sync(device)
    t0 = time.perf_counter()
    start = 0
    while start < walk.num_slots:
        start += build_verify_plan_radix_sweep(walk=walk, plan_out=plan, start=start)
        launch_deep_fingerprint_verify(
            table=table,
            plan=plan,
            canary_buf=ctx.canary_buf,
            violation_ring=ctx.violation_ring,
            violation_write_index=ctx.violation_write_index,
            tag_k=CanaryLaunchTag.SWEEP_K_FULL,
            tag_v=CanaryLaunchTag.SWEEP_V_FULL,
            rotate=False,
        )
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def sweep_once(cache, ctx, plan, device):
    t0 = time.perf_counter()
    walk = walk_radix_cache_for_canary(radix_cache=cache)
    sync(device)
    t1 = time.perf_counter()
    start = 0
    while start < walk.num_slots:
        start += build_verify_plan_radix_sweep(walk=walk, plan_out=plan, start=start)
        launch_canary_verify_kernel(context=ctx, plan=plan, check_verify_expected_token=False)
    sync(device)
    t2 = time.perf_counter()
    return walk.num_slots, (t1 - t0) * 1e3, (t2 - t1) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run (torch references)")
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="KV layers of the pool; > 1 also times the per-layer check of every "
        "layer's K and V rows (--kv-canary-real-data-layers all)",
    )
    args = ap.parse_args()
    if args.layers < 1:
        raise SystemExit(f"--layers must be >= 1, got {args.layers}")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    tokens = [3000] if args.smoke else args.tokens
    head = (1, 16) if args.smoke else (8, 128)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    lines = [
        f"Radix sweep pass — {name} — {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC — "
        f"torch {torch.__version__}",
        "",
        f"KV layers: {args.layers}",
        "",
        "| cached tokens | mode | walk ms (host + flatten) | plan + verify ms | total ms | "
        "every layer (plan + per-layer check) ms | violations |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in tokens:
        pool, cache, seqs = build(n, device, *head, layers=args.layers)
        for mode in (RealKvHashMode.NONE, RealKvHashMode.PARTIAL, RealKvHashMode.ALL):
            ctx = sweep_context(pool, mode)
            write_records(ctx, seqs, device)
            plan = VerifyPlan.allocate(
                verify_capacity=min(SWEEP_CHUNK_CAPACITY, n + 16), device=device
            )
            sweep_once(cache, ctx, plan, device)  # warm-up / compile
            runs = [sweep_once(cache, ctx, plan, device) for _ in range(1 if args.smoke else 5)]
            cached = runs[0][0]
            walk_ms = sorted(r[1] for r in runs)[len(runs) // 2]
            ver_ms = sorted(r[2] for r in runs)[len(runs) // 2]
            deep_ms = "-"
            if mode and args.layers > 1:
                table = deep_table(pool, mode, seqs, device)
                deep_sweep_once(cache, ctx, table, plan, device)  # warm-up / compile
                deep = sorted(
                    deep_sweep_once(cache, ctx, table, plan, device)
                    for _ in range(1 if args.smoke else 5)
                )
                deep_ms = f"{deep[len(deep) // 2]:.2f}"
            viol = int(ctx.violation_write_index)
            if viol:
                raise SystemExit(f"clean cache reported {viol} violations")
            lines.append(
                f"| {cached} | {mode.name.lower()} | {walk_ms:.2f} | {ver_ms:.2f} | "
                f"{walk_ms + ver_ms:.2f} | {deep_ms} | {viol} |"
            )
            print(lines[-1], flush=True)
        del pool, cache, seqs
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
