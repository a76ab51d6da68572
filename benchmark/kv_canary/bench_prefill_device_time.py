"""What the canary adds to a bs 1 prefill when the device, not the host, sets the pace
(docs/user_guide.md, "Overhead"): in-process, real pools of the Qwen3-0.6B shapes and the
runtime's builder (as ``bench_serving_overhead.py --host-breakdown``), but the model stood in
for by its GEMMs (28 layers of the 0.6B's projections on the chunk's tokens) instead of a
sleep, so the canary's kernels compete with the model's for the GPU as they do in a server.

    python benchmark/kv_canary/bench_prefill_device_time.py [--isls 512,4096,16384]
        [--configs raise,raise+token+partial] [--rounds 20] [--out F.jsonl]
        [--trace DIR] [--overlap]

Each round runs one prefill (a new request; chunked by 8192 like the Engine) per server
stand-in, in turn: canary off, canary off again (the A/A control), each config; the host
waits for the device after each prefill, so a prefill's time is its wall time (from the first
launch: the batches are built before, as sglang builds them before the forward). Two times per
prefill: "results", until the host sees the sampled token (after the last chunk's forward a
sampling stand-in, an argmax over one row of logits, is queued on the forward stream as
sglang queues its sampling and the token's copy, and the host waits for an event after it:
what a time to first token pays), and "done", until the whole device is idle (the canary's
side-stream work included). ``--overlap`` queues the request's next forward (one token)
before the host waits for the token, as sglang's overlap scheduler does; the stand-in launches
that forward's GEMMs eagerly (sglang replays a decode graph there), so its host launch, not
the device, sets the token's time in that mode. Printed: the median ms of each and the
medians of the paired ratios against the first "off"; then each config's prefill with no
model at all (the canary's own device time plus its host time).
Each forward runs in the bracket ``ModelRunner.forward`` gets from the plugin, whose exit does
the read-back (one per forward: checked). ``--trace DIR``: after the rounds of each prompt,
one more prefill per stand-in under ``torch.profiler``; each one's Chrome trace goes to DIR
and its timeline is printed (every GPU kernel's stream, start and end from the first launch,
and the host's phases: the model's launches, the canary's pre- and post-ops, the bracket's
exit with the read-back), to show which of the canary's work lies on the prefill's critical
path. ``--smoke-cpu``: tiny shapes on the CPU, checks the script only.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    append_jsonl,
    bench_device,
    canary_on_configs,
    now_utc,
    parse_ints,
    timeline,
    trace_rows,
)
from serving_breakdown import (  # noqa: E402
    PREFILL_SHAPES,
    _Req,
    build_prefill_canary,
    prefill_chunk_batch,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isls", default="512,4096,16384")
    ap.add_argument("--configs", default="raise,raise+token+partial")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON lines file (appended)")
    ap.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="profile one more prefill per stand-in; Chrome traces to DIR",
    )
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="queue the request's next forward before waiting for its token",
    )
    ap.add_argument("--smoke-cpu", action="store_true")
    args = ap.parse_args()

    smoke = args.smoke_cpu
    dev = bench_device(smoke, "bench_prefill_device_time.py")
    isls = parse_ints(args.isls, "--isls")
    configs = canary_on_configs(args.configs, "bench_prefill_device_time.py")
    rounds = 2 if smoke else args.rounds
    layers, _, _, vocab = PREFILL_SHAPES[smoke]
    hidden = 64 if smoke else 1024
    chunk = 32 if smoke else 8192
    max_ctx = max(isls) + 8
    num_slots = max(4 * max(isls), 4096)
    dtype = torch.float32 if smoke else torch.bfloat16
    # the 0.6B's projections: qkv 1024 -> 4096, o 2048 -> 1024, gate/up 1024 -> 6144,
    # down 3072 -> 1024 (scaled down for the smoke run)
    f = hidden // 1024 if hidden >= 1024 else 1 / 16
    shapes = [
        (hidden, int(4096 * f)),
        (int(2048 * f), hidden),
        (hidden, int(6144 * f)),
        (int(3072 * f), hidden),
    ]
    weights = [torch.randn(a, b, device=dev, dtype=dtype) * 0.01 for a, b in shapes]

    def model(n: int) -> None:
        x = torch.randn(n, hidden, device=dev, dtype=dtype)
        for _ in range(layers):
            q = x @ weights[0]
            o = q[:, : shapes[1][0]] @ weights[1]
            u = o @ weights[2]
            x = u[:, : shapes[3][0]] @ weights[3]

    def build(cname: str):
        return build_prefill_canary(
            cname, device=dev, smoke=smoke, max_ctx=max_ctx, num_slots=num_slots, chunk=chunk
        )

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, vocab, device=dev, dtype=dtype)

    def sync() -> None:
        if not smoke:
            torch.cuda.synchronize()

    def prefill(
        canary,
        isl: int,
        run: int,
        with_model: bool = True,
        phase=lambda name: contextlib.nullcontext(),
    ) -> tuple:
        """One prefill of a new ``isl``-token request; ms from its first launch to the host
        seeing its sampled token (results) and to the device's end (done). Its batches (what
        sglang builds before a forward) are built first, for every stand-in alike, outside
        the time. With ``--overlap`` the request's next forward (one token) is queued after
        the sampling and before the host waits for its token, as sglang's overlap scheduler
        does. ``phase(name)`` brackets the host's phases (``--trace``)."""
        row = 1 + (run % 4)
        total = isl + 1 if args.overlap else isl
        req = _Req(row, torch.randint(100, vocab - 100, (total,), generator=gen).tolist())
        slots = torch.randperm(num_slots - 1, generator=gen)[:total] + 1
        r2t, kv = (canary[1], canary[2]) if canary is not None else (None, None)
        batches = []
        for start in range(0, isl, chunk):
            n = min(chunk, isl - start)
            batches.append(
                (n, prefill_chunk_batch(req, slots, start, n, device=dev, r2t=r2t, kv=kv))
            )
        following = (
            prefill_chunk_batch(req, slots, isl, 1, device=dev, r2t=r2t, kv=kv)
            if args.overlap
            else None
        )
        if canary is not None:
            canary[1].req_to_token[row, :total] = slots.to(torch.int32).to(dev)
        sync()
        step0 = canary[0].step if canary is not None else 0

        def forward(n, fb) -> None:
            if canary is None:
                with phase("model"):
                    model(n)
                return
            mgr = canary[0]
            with contextlib.ExitStack() as bracket:  # ModelRunner.forward's, as the plugin's
                with phase("canary.pre"):
                    mgr.on_forward_batch_init(fb, [req])
                    bracket.enter_context(mgr.with_active_single_forward_manager(0))
                    bracket.enter_context(mgr.with_ops_outside_graph(fb))
                    mgr.pre_ops_maybe_inside_graph(fb)
                if with_model:
                    with phase("model"):
                        model(n)
                with phase("canary.post"):
                    mgr.post_ops_maybe_inside_graph(fb)
                outside = bracket.pop_all()  # the bracket's exit, timed on its own
            with phase("canary.post_outside+read-back"):
                outside.close()  # post_ops_outside_graph, then after_forward (the read-back)

        t0 = time.perf_counter()
        for n, fb in batches:
            forward(n, fb)
        with phase("results"):  # sglang's sampling and the token's copy
            token = torch.argmax(logits, dim=-1)
            results = None if smoke else torch.cuda.Event()
            if results is not None:
                results.record()
        if following is not None:
            forward(1, following)
        with phase("token_wait"):
            if results is not None:
                results.synchronize()
            del token
        t_results = time.perf_counter()
        with phase("sync"):
            sync()
        forwards = len(batches) + (following is not None)
        if canary is not None and canary[0].step != step0 + forwards:
            raise SystemExit(
                f"one read-back per forward expected: {forwards} forwards "
                f"moved the canary's step from {step0} to {canary[0].step}"
            )
        return (t_results - t0) * 1e3, (time.perf_counter() - t0) * 1e3

    name = torch.cuda.get_device_name() if not smoke else "cpu (smoke)"
    print(
        f"KV-canary device time of a bs1 prefill (GEMM stand-in model) — {name} — "
        f"{now_utc()} — chunk {chunk}, {rounds} rounds",
        flush=True,
    )
    stand_ins = {"off": None, "off (A/A)": None}
    stand_ins.update({c: build(c) for c in configs})
    rows = []
    for isl in isls:
        for w in range(2):
            for canary in stand_ins.values():
                prefill(canary, isl, w)
        ms = {k: [] for k in stand_ins}
        res = {k: [] for k in stand_ins}
        for r in range(rounds):
            for k, canary in stand_ins.items():
                t_res, t_done = prefill(canary, isl, r)
                res[k].append(t_res)
                ms[k].append(t_done)
        alone = {
            c: statistics.median(
                prefill(stand_ins[c], isl, r, with_model=False)[1] for r in range(rounds)
            )
            for c in configs
        }

        def paired(series, k):
            return (
                None
                if k == "off"
                else 100 * statistics.median(a / b - 1 for a, b in zip(series[k], series["off"]))
            )

        for k in stand_ins:
            rec = dict(
                kind="prefill_device_time",
                time=now_utc(),
                gpu=name,
                isl=isl,
                chunk=chunk,
                rounds=rounds,
                config=k,
                overlap=args.overlap,
                median_ms=statistics.median(ms[k]),
                paired_overhead_pct=paired(ms, k),
                results_median_ms=statistics.median(res[k]),
                results_paired_overhead_pct=paired(res, k),
                canary_alone_ms=alone.get(k),
            )
            append_jsonl(args.out, rec)
            rows.append(rec)
        if args.trace:
            for k, canary in stand_ins.items():
                print(
                    trace_prefill(
                        lambda ph: prefill(canary, isl, rounds, phase=ph),
                        Path(args.trace),
                        f"{isl}_{k}",
                        smoke,
                    ),
                    flush=True,
                )
        for k, canary in stand_ins.items():
            if canary is not None and canary[0].count_violations():
                raise SystemExit(f"{k} isl {isl}: violations on a clean run")
    print()
    print(
        "| prompt | config | results median ms | paired overhead, results (median) | "
        "prefill median ms | paired overhead (median) | canary alone, no model (ms) |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")

    def pct(value):
        return "(baseline)" if value is None else f"{value:+.2f} %"

    for r in rows:
        alone = "—" if r["canary_alone_ms"] is None else f"{r['canary_alone_ms']:.3f}"
        print(
            f"| {r['isl']} | {r['config']} | {r['results_median_ms']:.3f} | "
            f"{pct(r['results_paired_overhead_pct'])} | {r['median_ms']:.3f} | "
            f"{pct(r['paired_overhead_pct'])} | {alone} |"
        )


def trace_prefill(run, out_dir: Path, label: str, smoke: bool) -> str:
    """Profile ``run(phase)`` (one prefill) and return its timeline (:func:`common.timeline`:
    the host phases and every kernel, µs from the first event); the Chrome trace is written to
    ``out_dir/trace_<label>.json``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    out_dir.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([] if smoke else [ProfilerActivity.CUDA])
    with profile(activities=acts) as prof:
        run(record_function)
    path = out_dir / ("trace_" + re.sub(r"[^A-Za-z0-9._-]+", "_", label) + ".json")
    prof.export_chrome_trace(str(path))
    rows = trace_rows(path, annotations=True)
    if not rows:
        return f"-- {label}: no events"
    head = f"-- timeline {label} ({path.name}): start..end µs, where, what"
    return "\n".join([head] + timeline(rows, rows[0][0]))


if __name__ == "__main__":
    main()
