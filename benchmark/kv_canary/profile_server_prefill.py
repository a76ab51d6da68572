"""Where a server's prefill spends its time, canary off and on (docs/user_guide.md,
"Overhead"): one ``python -m sglang.launch_server`` per config, one after another (never side
by side), each profiled by sglang's own torch profiler (``/start_profile``) over a few bs 1
prefills after a warm-up; the trace of the last prefill is printed as a timeline (the GPU's
kernels and copies by stream, the host's CUDA calls that order or wait: graph launches, event
waits and syncs), so what of the canary lies on the request's critical path shows.

    python benchmark/kv_canary/profile_server_prefill.py [--configs off,raise] [--isl 512]
        [--requests 4] [--out DIR]

The servers are those of ``bench_interleaved.py`` (same settings, spinning schedulers).
Printed per config: sglang's server-side prefill time of each profiled request and the
timeline; DIR keeps each server's trace (``<config>/*.trace.json.gz``) and log. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_interleaved import Server, http_json, server_kwargs  # noqa: E402
from common import (  # noqa: E402
    CONFIGS,
    DEFAULT_MODEL,
    MODELS,
    EngineSettings,
    Scenario,
    make_inputs,
    now_utc,
    parse_names,
    server_prefill_ms,
    timeline,
    trace_rows,
)

# a gap this long between kernels separates two requests' work in the trace
REQUEST_GAP_US = 2000.0
# host CUDA calls shown in the timeline (the others: launches, one per kernel shown)
SHOWN_CALLS = (
    "cudaGraphLaunch",
    "cudaStreamWaitEvent",
    "cudaEventSynchronize",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpyAsync",
)


def last_request_timeline(rows: list) -> str:
    """The events of the last request's work (after the last kernel gap of
    :data:`REQUEST_GAP_US`; rows of :func:`common.trace_rows`), µs from its first kernel, as
    :func:`common.timeline` lines, and where its last kernel ends."""
    kernels = [r for r in rows if r[2] != "host"]
    if not kernels:
        return "(no kernels in the trace)"
    start = kernels[0][0]
    end_prev = kernels[0][0] + kernels[0][1]
    for ts, dur, _, _ in kernels[1:]:
        if ts - end_prev > REQUEST_GAP_US:
            start = ts
        end_prev = max(end_prev, ts + dur)
    last = [r for r in rows if r[0] >= start - 50.0]
    k_end = max(ts + dur for ts, dur, w, _ in last if w != "host") - start
    return "\n".join(timeline(last, start) + [f"(last kernel ends at {k_end:.1f} µs)"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="off,raise")
    ap.add_argument("--isl", type=int, default=512)
    ap.add_argument("--requests", type=int, default=4, help="prefills profiled per config")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None, help="directory for traces and logs")
    args = ap.parse_args()
    names = parse_names(args.configs, CONFIGS, "--configs")
    if args.requests < 1 or args.isl < 1:
        raise SystemExit(f"--requests and --isl must be >= 1 (got {args.requests}, {args.isl})")
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="kv_canary_profile_"))
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(MODELS[DEFAULT_MODEL], indent=1))
    vocab = MODELS[DEFAULT_MODEL]["vocab_size"]
    settings = EngineSettings()
    sc = Scenario(f"prefill_bs1_{args.isl}", bs=1, isl=args.isl, osl=1)
    print(
        f"KV-canary server prefill profile — {now_utc()} — isl {args.isl}, "
        f"{args.requests} profiled after {args.warmup}",
        flush=True,
    )
    for name in names:
        cfg = CONFIGS[name]
        kwargs = server_kwargs(
            settings.engine_kwargs(str(model_dir), smoke=False), cfg, mem_fraction=0.6, idle="spin"
        )
        trace_dir = out / name.replace("+", "_")
        trace_dir.mkdir(exist_ok=True)
        env = {**os.environ, **cfg.env(), "SGLANG_TORCH_PROFILER_DIR": str(trace_dir)}
        srv = Server(name, cfg, kwargs, env, str(trace_dir / "server.log"))
        try:
            srv.wait_ready(900.0)
            for k in range(args.warmup):
                srv.generate(make_inputs(sc, -1 - k, vocab), sc.osl)
            status, body = http_json(
                srv.port,
                "POST",
                "/start_profile",
                {"output_dir": str(trace_dir), "activities": ["CPU", "GPU"]},
            )
            if status != 200:
                raise SystemExit(f"[{name}] /start_profile answered {status}: {body}")
            prefill = []
            for k in range(args.requests):
                time.sleep(0.05)
                _, outs = srv.generate(make_inputs(sc, k, vocab), sc.osl)
                prefill.append(server_prefill_ms(outs))
            status, body = http_json(srv.port, "POST", "/stop_profile")
            if status != 200:
                raise SystemExit(f"[{name}] /stop_profile answered {status}: {body}")
            traces = []
            for _ in range(120):  # the trace is written after the answer
                traces = sorted(trace_dir.glob("*.trace.json*"))
                if traces:
                    break
                time.sleep(1.0)
        finally:
            srv.stop()
        if not traces:
            raise SystemExit(f"[{name}] no trace in {trace_dir}")
        time.sleep(2.0)
        print(
            f"\n== {name}: server prefill ms {[round(p, 2) for p in prefill if p]} "
            f"(median {statistics.median([p for p in prefill if p]):.2f}); trace "
            f"{traces[-1].name}",
            flush=True,
        )
        rows = trace_rows(traces[-1], annotations=False, host_calls=SHOWN_CALLS)
        print(last_request_timeline(rows), flush=True)


if __name__ == "__main__":
    main()
