#!/usr/bin/env python3
"""Host-tier cost of the KV-canary under HiCache (docs/subsystems.md, "HiCache"): memory per
host slot and the time the canary's row copies add to sglang's own backups and loads.

    python benchmark/kv_canary/bench_hicache.py [--tokens 64 1024 8192] [--reps 20] [--out F]

Real sglang 0.5.12 pools on one GPU, Qwen3-0.6B shapes: ``MHATokenToKVPool`` bf16, 28 layers x
8 KV heads x 128 (114688 KV bytes per token), 32768 slots; an ``MHATokenToKVPoolHost`` of twice
as many slots, pinned, ``layer_first``; the canary assembled by the runtime's builder and its
:class:`~sglang.srt.kv_canary.manager.hicache.HostTierMirror` wrapping the host pool's copy
methods as in a server. Per canary config (real data ``partial``; ``partial`` with per-layer
fingerprints, ``--kv-canary-real-data-layers all``) and per transfer size (tokens, device and
host slots scattered as after churn; page size 1):

- backup: ``backup_from_device_all_layer(..., io_backend="kernel")``, sglang's own method
  (unwrapped: the baseline) and the wrapped one (sglang's copy + the canary rows);
- load: ``load_to_device_per_layer`` for every layer, likewise.

GPU time of each call (CUDA events on the current stream, ``--reps`` calls after a warm-up;
median and min), the rounds in A B B A order. Prints a markdown table; ``--out`` appends
JSON lines. Needs the device bundles a and b (real pools import ``sgl_kernel``)."""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import cuda_event_ms  # noqa: E402  (a sibling module)

SHAPE = dict(layer_num=28, head_num=8, head_dim=128, num_slots=32768)
CONFIGS = {
    "partial": dict(real_kv_hash_mode="partial"),
    "partial+layers": dict(real_kv_hash_mode="partial", real_data_layers="all"),
}


def build(config_name: str):
    from sglang.srt.kv_canary.builder import build_canary
    from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
    from sglang.srt.kv_canary.config import CanaryConfig
    from sglang.srt.kv_canary.manager.hicache import HostTierMirror
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost

    pool = MHATokenToKVPool(
        size=SHAPE["num_slots"],
        page_size=1,
        dtype=torch.bfloat16,
        head_num=SHAPE["head_num"],
        head_dim=SHAPE["head_dim"],
        layer_num=SHAPE["layer_num"],
        device="cuda",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    for layer in range(SHAPE["layer_num"]):
        pool.k_buffer[layer].normal_()
        pool.v_buffer[layer].normal_()
    r2t = ReqToTokenPool(size=8, max_context_len=8192, device="cuda", enable_memory_saver=False)
    config = CanaryConfig(mode="raise", stats_print_every_n_steps=0, **CONFIGS[config_name])
    manager = build_canary(
        pool=pool,
        req_to_token=r2t.req_to_token,
        config=config,
        device="cuda",
        capacity_inputs=CanaryCapacityInputs(
            context_len=8192, chunked_prefill_size=8192, max_prefill_tokens=16384
        ),
    )
    host = MHATokenToKVPoolHost(
        pool,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=1,
        layout="layer_first",
        pin_memory=True,
    )
    plain = (host.backup_from_device_all_layer, host.load_to_device_per_layer)
    mirror = HostTierMirror(
        groups=manager.groups, host_pool=host, real_kv_hash_mode=config.real_kv_hash_mode
    )
    wrapped = (host.backup_from_device_all_layer, host.load_to_device_per_layer)
    for rows, _ in mirror.pairs:
        rows.copy_(torch.randint(-(2**62), 2**62, rows.shape, device="cuda"))
    return pool, host, mirror, plain, wrapped


def measure(config_name: str, tokens, reps: int):
    pool, host, mirror, plain, wrapped = build(config_name)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in tokens:
        dev = torch.randperm(SHAPE["num_slots"] - 1, generator=g)[:n].add_(1).cuda()
        hst = torch.randperm(host.size, generator=g)[:n].cuda()
        calls = {}
        for name, (backup, load) in (("sglang", plain), ("sglang+canary", wrapped)):
            calls[name] = (
                lambda b=backup: b(pool, hst, dev, "kernel"),
                lambda ld=load: [
                    ld(pool, hst, dev, layer, "kernel") for layer in range(SHAPE["layer_num"])
                ],
            )
        times = {(name, op): [] for name in calls for op in ("backup", "load")}
        for name in ("sglang", "sglang+canary", "sglang+canary", "sglang"):  # A B B A
            for op, fn in zip(("backup", "load"), calls[name]):
                times[(name, op)] += cuda_event_ms(fn, reps, warmup=1)
        for op in ("backup", "load"):
            base, on = times[("sglang", op)], times[("sglang+canary", op)]
            rows.append(
                dict(
                    config=config_name,
                    op=op,
                    tokens=n,
                    sglang_med_ms=statistics.median(base),
                    sglang_min_ms=min(base),
                    canary_med_ms=statistics.median(on),
                    canary_min_ms=min(on),
                    kv_bytes=n * kv_bytes_per_token(),
                    canary_bytes=n * mirror.bytes_per_host_slot,
                    canary_bytes_per_slot=mirror.bytes_per_host_slot,
                )
            )
    return rows


def kv_bytes_per_token() -> int:
    return SHAPE["layer_num"] * 2 * SHAPE["head_num"] * SHAPE["head_dim"] * 2  # K and V, bf16


def table(rows) -> str:
    out = [
        "| config | op | tokens | sglang median / min (ms) | + canary rows median / min (ms) "
        "| added (median) | canary bytes per host slot |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        added = (r["canary_med_ms"] - r["sglang_med_ms"]) / r["sglang_med_ms"] * 100
        out.append(
            f"| {r['config']} | {r['op']} | {r['tokens']} | {r['sglang_med_ms']:.3f} / "
            f"{r['sglang_min_ms']:.3f} | {r['canary_med_ms']:.3f} / "
            f"{r['canary_min_ms']:.3f} | {added:+.1f} % | {r['canary_bytes_per_slot']} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 1024, 8192])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated, from: {', '.join(CONFIGS)}"
    )
    ap.add_argument("--out", help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        ap.error(f"--configs: unknown {', '.join(bad) or '(empty)'}; allowed: {', '.join(CONFIGS)}")
    if args.reps < 1 or any(n < 1 or n > SHAPE["num_slots"] - 1 for n in args.tokens):
        ap.error(f"--reps must be >= 1 and --tokens in [1, {SHAPE['num_slots'] - 1}]")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (HiCache's pinned host pool and sglang's transfer kernels)")
    gpu = torch.cuda.get_device_name()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = []
    for name in names:
        rows += measure(name, args.tokens, args.reps)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, gpu=gpu, date=when)) + "\n")
    kv_per_token = kv_bytes_per_token()
    print(
        f"HiCache host-tier cost of the KV-canary — {gpu} — {when} — Qwen3-0.6B shapes "
        f"({kv_per_token} KV bytes per token), page size 1, io backend kernel, layer_first"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
