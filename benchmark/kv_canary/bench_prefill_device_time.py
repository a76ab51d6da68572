"""What the canary adds to a bs 1 prefill when the device, not the host, sets the pace
(docs/user_guide.md, "Overhead"): in-process, real pools of the Qwen3-0.6B shapes and the
runtime's builder (as ``bench_serving_overhead.py --host-breakdown``), but the model stood in
for by its GEMMs (28 layers of the 0.6B's projections on the chunk's tokens) instead of a
sleep, so the canary's kernels compete with the model's for the GPU as they do in a server.

    python benchmark/kv_canary/bench_prefill_device_time.py [--isls 512,4096,16384]
        [--configs raise,raise+token+partial] [--rounds 20] [--out F.jsonl]

Each round runs one prefill (a new request; chunked by 8192 like the Engine) per server
stand-in, in turn: canary off, canary off again (the A/A control), each config; the host
waits for the device after each prefill, so a prefill's time is its wall time (from the first
launch: the batches are built before, as sglang builds them before the forward). Printed: the
median ms per prefill and the median of the paired ratios against the first "off"; then each
config's prefill with no model at all (the canary's own device time plus its host time).
``--smoke-cpu``: tiny shapes on the CPU, checks the script only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving_overhead import CONFIGS, _Req, append_jsonl, now_utc, parse_ints, parse_names  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isls", default="512,4096,16384")
    ap.add_argument("--configs", default="raise,raise+token+partial")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON lines file (appended)")
    ap.add_argument("--smoke-cpu", action="store_true")
    args = ap.parse_args()

    from sglang.srt.kv_canary.builder import build_canary
    from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
    from sglang.srt.kv_canary.config import CanaryConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    smoke = args.smoke_cpu
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench_prefill_device_time.py needs a CUDA GPU (or --smoke-cpu)")
    dev = torch.device("cpu" if smoke else "cuda")
    isls = parse_ints(args.isls, "--isls")
    configs = [c for c in parse_names(args.configs, CONFIGS, "--configs") if c != "off"]
    rounds = 2 if smoke else args.rounds
    layers, heads, dim, vocab, hidden = (2, 2, 8, 512, 64) if smoke else (28, 8, 128, 151936,
                                                                          1024)
    chunk = 32 if smoke else 8192
    max_ctx = max(isls) + 8
    num_slots = max(4 * max(isls), 4096)
    dtype = torch.float32 if smoke else torch.bfloat16
    # the 0.6B's projections: qkv 1024 -> 4096, o 2048 -> 1024, gate/up 1024 -> 6144,
    # down 3072 -> 1024 (scaled down for the smoke run)
    f = hidden // 1024 if hidden >= 1024 else 1 / 16
    shapes = [(hidden, int(4096 * f)), (int(2048 * f), hidden), (hidden, int(6144 * f)),
              (int(3072 * f), hidden)]
    weights = [torch.randn(a, b, device=dev, dtype=dtype) * 0.01 for a, b in shapes]

    def model(n: int) -> None:
        x = torch.randn(n, hidden, device=dev, dtype=dtype)
        for _ in range(layers):
            q = x @ weights[0]
            o = q[:, :shapes[1][0]] @ weights[1]
            u = o @ weights[2]
            x = u[:, :shapes[3][0]] @ weights[3]

    def build(cname: str):
        cfg = CONFIGS[cname]
        r2t = ReqToTokenPool(size=8, max_context_len=max_ctx, device=str(dev),
                             enable_memory_saver=False)
        kv = MHATokenToKVPool(size=num_slots, page_size=1, dtype=torch.bfloat16,
                              head_num=heads, head_dim=dim, layer_num=layers, device=str(dev),
                              enable_memory_saver=False, enable_alt_stream=False)
        mgr = build_canary(
            pool=kv, req_to_token=r2t.req_to_token, device=dev,
            config=CanaryConfig(mode=cfg.kv_canary, real_kv_hash_mode=cfg.real_data,
                                real_data_layers=cfg.real_data_layers,
                                enable_verify_token_assert=cfg.verify_tokens,
                                stats_print_every_n_steps=0),
            capacity_inputs=CanaryCapacityInputs(context_len=max_ctx,
                                                 chunked_prefill_size=chunk,
                                                 max_prefill_tokens=16384, cuda_graph_max_bs=8))
        mgr.mark_init_finished()
        return mgr, r2t, kv

    gen = torch.Generator().manual_seed(0)

    def i64(v):
        return torch.tensor(v, dtype=torch.int64, device=dev)

    def sync() -> None:
        if not smoke:
            torch.cuda.synchronize()

    def prefill(canary, isl: int, run: int, with_model: bool = True) -> float:
        """One prefill of a new ``isl``-token request; ms from its first launch to the
        device's end. Its batches (what sglang builds before a forward) are built first, for
        every stand-in alike, outside the time."""
        row = 1 + (run % 4)
        req = _Req(row, torch.randint(100, vocab - 100, (isl,), generator=gen).tolist())
        slots = torch.randperm(num_slots - 1, generator=gen)[:isl] + 1
        batches = []
        for start in range(0, isl, chunk):
            n = min(chunk, isl - start)
            r2t, kv = (canary[1], canary[2]) if canary is not None else (None, None)
            fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1,
                              input_ids=i64(req.origin_input_ids[start:start + n]),
                              req_pool_indices=i64([row]), seq_lens=i64([start + n]),
                              out_cache_loc=i64(slots[start:start + n].tolist()),
                              seq_lens_sum=start + n,
                              positions=i64(list(range(start, start + n))),
                              req_to_token_pool=r2t, token_to_kv_pool=kv)
            fb.extend_prefix_lens, fb.extend_seq_lens = i64([start]), i64([n])
            fb.extend_num_tokens = n
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = [start], [n]
            batches.append((n, fb))
        if canary is not None:
            canary[1].req_to_token[row, :isl] = slots.to(torch.int32).to(dev)
        sync()
        t0 = time.perf_counter()
        for n, fb in batches:
            if canary is None:
                model(n)
                continue
            mgr = canary[0]
            mgr.on_forward_batch_init(fb, [req])
            with mgr.with_active_single_forward_manager(0), mgr.with_ops_outside_graph(fb):
                mgr.pre_ops_maybe_inside_graph(fb)
                if with_model:
                    model(n)
                mgr.post_ops_maybe_inside_graph(fb)
            mgr.after_forward([mgr.sfms[0]], fb)
        sync()
        return (time.perf_counter() - t0) * 1e3

    name = torch.cuda.get_device_name() if not smoke else "cpu (smoke)"
    print(f"KV-canary device time of a bs1 prefill (GEMM stand-in model) — {name} — "
          f"{now_utc()} — chunk {chunk}, {rounds} rounds", flush=True)
    stand_ins = {"off": None, "off (A/A)": None}
    stand_ins.update({c: build(c) for c in configs})
    rows = []
    for isl in isls:
        for w in range(2):
            for canary in stand_ins.values():
                prefill(canary, isl, w)
        ms = {k: [] for k in stand_ins}
        for r in range(rounds):
            for k, canary in stand_ins.items():
                ms[k].append(prefill(canary, isl, r))
        alone = {c: statistics.median(prefill(stand_ins[c], isl, r, with_model=False)
                                      for r in range(rounds)) for c in configs}
        for k in stand_ins:
            ratio = None if k == "off" else 100 * statistics.median(
                a / b - 1 for a, b in zip(ms[k], ms["off"]))
            rec = dict(kind="prefill_device_time", time=now_utc(), gpu=name, isl=isl,
                       chunk=chunk, rounds=rounds, config=k,
                       median_ms=statistics.median(ms[k]), paired_overhead_pct=ratio,
                       canary_alone_ms=alone.get(k))
            append_jsonl(args.out, rec)
            rows.append(rec)
        for k, canary in stand_ins.items():
            if canary is not None and canary[0].count_violations():
                raise SystemExit(f"{k} isl {isl}: violations on a clean run")
    print()
    print("| prompt | config | prefill median ms | paired overhead (median) | "
          "canary alone, no model (ms) |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        ov = "(baseline)" if r["paired_overhead_pct"] is None else \
            f"{r['paired_overhead_pct']:+.2f} %"
        alone = "—" if r["canary_alone_ms"] is None else f"{r['canary_alone_ms']:.3f}"
        print(f"| {r['isl']} | {r['config']} | {r['median_ms']:.3f} | {ov} | {alone} |")


if __name__ == "__main__":
    main()
