#!/usr/bin/env python3
"""End-to-end serving overhead of the KV-canary (docs/user_guide.md, "Overhead"): a real sglang
0.5.12 Engine on one GPU, canary off vs on, plus a per-launch breakdown of the canary's own GPU time per decode step.

What it measures
----------------
Engine runs (default mode). A Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16
heads, 8 KV heads x head_dim 128, vocab 151936; dummy weights, only a ``config.json`` written to
a temp dir, nothing downloaded) served by ``sglang.Engine`` with CUDA graphs on (decode graphs
captured for batch sizes 1 and 128 only, to keep the start cheap), ``attention_backend=triton``,
``sampling_backend=pytorch``, ``grammar_backend=none``, ``skip_tokenizer_init``,
piecewise CUDA graphs for prefill on (sglang's default; ``--piecewise off`` turns them off for
every config, as results before 2026-11-24 had them), chunked prefill 8192 (sglang's own default on an 80 GB GPU),
``max_running_requests`` 128, a KV pool of 262144 tokens, the scheduler spinning when idle
(sglang's default; the test servers' ``--sleep-on-idle`` made short prefills slow in
regimes, ``benchmark/results/latency_h100.md``). Configs (one Engine each, each in its
own process):

    off            --kv-canary none
    raise          --kv-canary raise
    raise+partial  --kv-canary raise --kv-canary-real-data partial
    raise+token    --kv-canary raise + SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=1
    raise+token+partial   both of the last two

Scenarios (requests as ``input_ids``: random token ids from a seed fixed per scenario and run, so
every config sees the same inputs; ``max_new_tokens`` = osl, ``ignore_eos``, temperature 0; the
radix cache is flushed before every run, so no run hits a cached prefix):

    decode_bs128   128 requests x isl 512, osl 1024 (one batch)
    decode_bs1     1 request x isl 512, osl 1024
    prefill_bs32   32 requests x isl 16384, osl 1 (latency of the whole batch = the prefill,
                   chunked in 8192-token chunks, so the second chunk of every request verifies
                   its 8192-token prefix)
    prefill_bs1_512, prefill_bs1_4k, prefill_bs1_16k
                   1 request x isl 512 / 4096 / 16384, osl 1: time to first token at low load
                   (run them with ``--runs 30``; the table gives p10 / p90 too)

``--model qwen3-30b-a3b``: the same Engine runs on a Qwen3-30B-A3B-shaped MoE model (48 layers,
hidden 2048, 32 heads, 4 KV heads x 128, 128 experts of 768, 8 per token; dummy weights, about
61 GB: one H200), with the scenario ``decode_bs64`` (64 requests x isl 256, osl 512) beside
``decode_bs1`` and ``prefill_bs32``: upstream's published canary scenarios::

    . .device/c/setup.sh && python benchmark/kv_canary/bench_serving_overhead.py \
        --model qwen3-30b-a3b --configs off,raise --scenarios decode_bs1,decode_bs64,prefill_bs32 \
        --runs 3 --mem-fraction-static 0.85 --max-total-tokens 540000 --cuda-graph-bs 1,64 \
        --out $OUT/moe.jsonl

Server-side prefill time (``--server-timing on``, the default): every Engine runs with sglang's
request metrics on, so each output's ``meta_info`` carries the scheduler's
``forward_entry_time`` and ``prefill_finished_time``; per ``generate`` the benchmark records the
first entry to the last prefill result processed (the prefill as the scheduler saw it, without
the tokenizer / detokenizer processes) and prints a second table of those times. For decode
scenarios it also holds the launch of the first decode step (the overlap scheduler processes
the prefill result after queuing the next batch).

``--speculative MODE`` (``eagle``, ``eagle-tree``, ``eagle3``, ``standalone``, ``ngram``,
``dflash``, ``adaptive``, ``nextn``, ``frozen-kv-mtp``, ``multi-layer``; each mode's settings, target, draft config and draft worker
in ``common.SPECULATIVE``, ``SPECULATIVE_MODELS``, ``SPECULATIVE_DRAFT_CONFIGS`` and
``SPECULATIVE_DRAFT_WORKERS``, summed up by ``--help``): every Engine serves with that mode
(Qwen3-0.6B shapes; ``nextn`` on ``--model deepseek-v3-mtp`` (its default), whose MTP layer drafts;
``frozen-kv-mtp`` on ``--model gemma4-mtp``, whose KV its Gemma4 assistant reads;
``multi-layer`` on ``--model step3p5-mtp``, whose MTP layers draft, CUDA graphs off; decode
graphs for bs 1 and 32) and the scenarios default to ``decode_bs1`` and ``decode_bs32`` (32
requests x isl 512, osl 1024). A canary-on Engine must log the canary installed on the target
and, for a mode with a draft KV pool, on that mode's draft worker; a canary-off Engine on
neither; otherwise its config fails::

    . .device/c/setup.sh && python benchmark/kv_canary/bench_serving_overhead.py \
        --speculative eagle --configs off,raise --runs 3 --out $OUT/eagle.jsonl

Per Engine: start, one warm-up run per scenario, then ``--runs`` (5) timed runs per scenario
(wall time of the ``Engine.generate`` call); median and min. Overhead % = (on - off) / off of
the medians (and of the mins). Off and on run in different Engines, one after the other, so
compare the mins as well, and repeat with more ``--runs`` if the two disagree.

Breakdown (``--breakdown``, in-process, no Engine). Real sglang pools on the GPU with the Qwen3
shapes (``MHATokenToKVPool`` bf16, 28 layers x 8 KV heads x 128, 262144 slots, random KV;
``ReqToTokenPool`` 128 rows x 40960; ``TokenToKVPoolAllocator``, slots shuffled as after churn),
the canary assembled by the runtime's own builder (``build_canary``, with the Engine's limits),
bs 1 and bs 128 requests prefilled through the canary (1024
tokens each, in 8192-token chunks) and then decoded. Per decode step, every canary launch's GPU
time (torch.profiler: CUDA kernel / memcpy durations, attributed to the launch that issued them
through ``record_function`` ranges around the runtime's launch functions), averaged over
``--breakdown-steps`` eager steps; a 256 MB memset between the HEAD and TAIL launches and
between steps stands in for the model (it evicts L2 as the model's weight reads would). Also the
replay time of a CUDA graph holding one step's in-graph canary launches (what sglang's decode
graphs run), ``triton.testing.do_bench`` median with L2 flushed. The decode step time of the
model itself is the Engine runs' (latency / osl).

How to run it on the device (H100; the machine keeps /tmp/site ~30 s between calls)
-----------------------------------------------------------------------------------
Bundles (see /work/shared/device/README.md): call 1 with carry ``[".device/a"]``::

    . .device/a/setup.sh

then, immediately, calls with carry ``[".device/b", ".device/c"]`` (or only ``[".device/c"]``
once b is installed; its setup.sh sets PYTHONPATH again)::

    . .device/b/setup.sh && python benchmark/kv_canary/bench_serving_overhead.py \
        --configs off,raise --out $OUT/overhead.jsonl
    . .device/c/setup.sh && python benchmark/kv_canary/bench_serving_overhead.py \
        --configs raise+partial,raise+token --out $OUT/overhead.jsonl
    . .device/c/setup.sh && python benchmark/kv_canary/bench_serving_overhead.py --breakdown \
        --out $OUT/breakdown.jsonl

Each Engine config takes about 1-2 min to start (Triton JIT, graph capture) plus ~1.5 min for
the three scenarios at ``--runs 5``; keep one call under 9 min (two configs). Results are
appended to ``--out`` as JSON lines (one per scenario x config, one per breakdown row), so the
calls can be merged afterwards, here::

    python benchmark/kv_canary/bench_serving_overhead.py --report overhead.jsonl breakdown.jsonl

Each invocation prints its own summary table last; an Engine's full log goes to
``<out>.<config>.log`` (next to ``--out``; ``+`` in a
config name becomes ``_``).

Host profile (``--host-profile STEPS``, with the Engine runs): after an Engine's timed runs,
one more run of the last scenario is profiled for STEPS forwards with sglang's own profiler
(torch.profiler, Python stacks) and the scheduler's host time per canary function and per CUDA
runtime call is printed (a host sync shows up as ``cudaEventSynchronize`` /
``cudaStreamSynchronize``). The timed runs are not profiled; the profiled figures are inflated
by the tracing, so compare configs, not absolute values::

    . .device/c/setup.sh && python benchmark/kv_canary/bench_serving_overhead.py \
        --configs raise,raise+token --scenarios decode_bs1 --runs 2 --host-profile 150

Host breakdown (``--host-breakdown ISL[,ISL...]``, in-process, no Engine): the host time of
each canary phase around one request's eager prefill of each prompt length (batch init, outside
pre-ops, inside pre-ops, inside post-ops, outside post-ops + read-back), with the model stood in
for by a GPU sleep so the host never waits; the first three run before the model's kernels are
queued (what a bs1 time to first token waits for)::

    . .device/c/setup.sh && python benchmark/kv_canary/bench_serving_overhead.py \
        --host-breakdown 512,4096,16384 --configs raise,raise+token --out $OUT/host.jsonl

Without a GPU (``--smoke-cpu``): the same code paths on the CPU, sglang's CPU server
(docs/testing.md, "CPU server": tiny dummy Llama, libcuda stub, CUDA graphs off) with tiny
scenarios (bs 2 / 1 / 2, isl 16 / 16 / 64, osl 8 / 8 / 1, chunked prefill 32) and
``--runs 2``; ``--breakdown --smoke-cpu`` builds
tiny CPU pools (the kernels run as torch references) and reports CPU times. Numbers from smoke
runs are meaningless; they only check that the script works::

    python benchmark/kv_canary/bench_serving_overhead.py --smoke-cpu --out /tmp/s.jsonl
    python benchmark/kv_canary/bench_serving_overhead.py --smoke-cpu --breakdown
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence

from common import (
    CONFIGS,
    DEFAULT_SCENARIOS,
    DRAFT_WORKERS_HELP,
    MODELS,
    MODELS_WITHOUT_PIECEWISE,
    RESULT_PREFIX,
    SCENARIOS,
    SMOKE_SCENARIOS,
    SMOKE_SETTINGS,
    SPECULATIVE,
    SPECULATIVE_HELP,
    TOKEN_ENV,
    BenchConfig,
    EngineSettings,
    Scenario,
    append_jsonl,
    canary_lines_problem,
    gpu_name,
    make_inputs,
    now_utc,
    parse_ints,
    parse_names,
    quantile,
    read_jsonl,
    server_prefill_ms,
    server_stats,
    speculative_mode,
    speculative_model,
    piecewise_setting,
    speculative_model_problem,
    write_speculative_files,
)
from serving_breakdown import (
    run_breakdown,
    run_host_breakdown,
)
from serving_report import (
    engine_table,
    report,
    server_table,
)
from trace_kernels import canary_kernel_names, kernel_time


def engine_child(args) -> None:
    import sglang

    smoke = args.smoke_cpu
    cfg = CONFIGS[args.engine_child]
    scenarios = [
        (SMOKE_SCENARIOS if smoke else SCENARIOS)[n]
        for n in parse_names(args.scenarios, SCENARIOS, "--scenarios")
    ]
    settings = SMOKE_SETTINGS if smoke else args.settings
    with tempfile.TemporaryDirectory(prefix="kv_canary_bench_model_") as tmp:
        if smoke:
            from sglang.srt.kv_canary.demo.server_harness import (
                TINY_LLAMA_CONFIG,
                write_tiny_llama,
            )

            model_dir, vocab = write_tiny_llama(tmp), TINY_LLAMA_CONFIG["vocab_size"]
        else:
            model_cfg = MODELS[settings.model]
            pathlib.Path(tmp, "config.json").write_text(json.dumps(model_cfg, indent=1))
            model_dir, vocab = tmp, model_cfg["vocab_size"]
        draft_dir = write_speculative_files(settings.speculative, os.path.join(tmp, "draft"))
        kwargs = {
            **settings.engine_kwargs(model_dir, smoke=smoke, draft_dir=draft_dir),
            **cfg.engine_kwargs(),
        }
        t0 = time.perf_counter()
        engine = sglang.Engine(**kwargs)
        startup_s = time.perf_counter() - t0
        print(
            f"{RESULT_PREFIX}[{cfg.name}] engine up in {startup_s:.1f} s "
            f"(kv_canary={getattr(engine.server_args, 'kv_canary', '?')}, "
            f"real_data={getattr(engine.server_args, 'kv_canary_real_data', '?')}, "
            f"{TOKEN_ENV}={os.environ.get(TOKEN_ENV, '0')})",
            flush=True,
        )
        try:
            for sc in scenarios:
                params = [
                    {"max_new_tokens": sc.osl, "ignore_eos": True, "temperature": 0}
                    for _ in range(sc.bs)
                ]
                times, server = [], []
                for run in range(-1, args.runs):  # run -1: warm-up
                    ids = make_inputs(sc, run, vocab)
                    engine.flush_cache()
                    t0 = time.perf_counter()
                    outs = engine.generate(input_ids=ids, sampling_params=params)
                    ms = (time.perf_counter() - t0) * 1e3
                    lens = sorted({len(o["output_ids"]) for o in outs})
                    if len(outs) != sc.bs or lens != [sc.osl]:
                        raise RuntimeError(
                            f"{sc.name}: expected {sc.bs} outputs of {sc.osl} "
                            f"tokens, got {len(outs)} with lengths {lens}"
                        )
                    if run >= 0:
                        times.append(ms)
                        server.append(server_prefill_ms(outs))
                    else:
                        warmup_ms = ms
                rec = dict(
                    kind="engine",
                    invocation=args.invocation,
                    time=now_utc(),
                    gpu=args.gpu,
                    smoke=smoke,
                    config=cfg.name,
                    scenario=sc.name,
                    speculative=settings.speculative,
                    bs=sc.bs,
                    isl=sc.isl,
                    osl=sc.osl,
                    runs_ms=times,
                    median_ms=statistics.median(times),
                    min_ms=min(times),
                    p10_ms=quantile(times, 0.1),
                    p90_ms=quantile(times, 0.9),
                    warmup_ms=warmup_ms,
                    startup_s=startup_s,
                    model=settings.model,
                    **server_stats(server),
                    settings=dataclasses.asdict(settings),
                    engine_kwargs={k: v for k, v in kwargs.items() if k != "model_path"},
                    env={TOKEN_ENV: os.environ.get(TOKEN_ENV, "0")},
                )
                append_jsonl(args.out, rec)
                print(
                    f"{RESULT_PREFIX}[{cfg.name}] {sc.name}: median {rec['median_ms']:.1f} ms, "
                    f"min {rec['min_ms']:.1f} ms, runs "
                    f"{', '.join(f'{t:.1f}' for t in times)} (warm-up {warmup_ms:.1f})",
                    flush=True,
                )
            if args.host_profile:
                host_profile(engine, cfg, scenarios[-1], vocab, args.host_profile, tmp)
        finally:
            engine.shutdown()


def host_profile(engine, cfg: BenchConfig, sc: Scenario, vocab: int, steps: int, tmp: str) -> None:
    """Profile ``steps`` forward steps of one more run of ``sc`` with sglang's own profiler
    (torch.profiler, CPU + GPU activities, Python stacks) and print where the scheduler
    process's host time goes: CUDA runtime calls (a host sync shows up here as
    ``cudaEventSynchronize`` / ``cudaStreamSynchronize`` / ``cudaMemcpy*``) and the canary's own
    Python functions (inclusive time). Diagnostic only: Python tracing slows the host down, so
    compare configs with each other, not with the timed runs."""
    import glob
    import gzip

    out_dir = os.path.join(tmp, "host_profile")
    engine.flush_cache()
    engine.start_profile(
        output_dir=out_dir,
        num_steps=steps,
        activities=["CPU", "GPU"],
        with_stack=True,
        record_shapes=False,
    )
    params = [
        {"max_new_tokens": sc.osl, "ignore_eos": True, "temperature": 0} for _ in range(sc.bs)
    ]
    engine.generate(input_ids=make_inputs(sc, 0, vocab), sampling_params=params)
    deadline = time.monotonic() + 120
    files: list[str] = []
    while time.monotonic() < deadline and not files:
        time.sleep(1)
        files = glob.glob(os.path.join(out_dir, "**", "*.trace.json*"), recursive=True)
    if not files:
        print(
            f"{RESULT_PREFIX}[{cfg.name}] host profile: no trace written in {out_dir}", flush=True
        )
        return
    time.sleep(2)  # let the writer finish
    opener = gzip.open if files[0].endswith(".gz") else open
    with opener(files[0], "rt") as f:
        events = json.load(f).get("traceEvents", [])
    totals: dict[tuple, list] = {}
    forwards = 0
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, name = ev.get("cat", ""), ev.get("name", "")
        if cat == "python_function" and "model_runner.py(" in name and name.endswith(": forward"):
            forwards += 1
        keep = cat == "cuda_runtime" or (cat == "python_function" and "kv_canary" in name)
        if keep:
            t = totals.setdefault((cat, name), [0.0, 0])
            t[0] += ev["dur"]
            t[1] += 1
    print(
        f"{RESULT_PREFIX}[{cfg.name}] host profile of {sc.name}: {forwards} forwards traced "
        "(µs per forward, inclusive; count per forward)",
        flush=True,
    )
    per = max(forwards, 1)
    if forwards:
        kt = kernel_time(events, forwards, canary_kernel_names())
        print(
            f"{RESULT_PREFIX}[{cfg.name}] GPU per forward: canary kernels {kt.canary_us:.1f} µs, "
            f"other kernels {kt.other_us:.1f} µs, span {kt.span_us:.1f} µs; most frequent "
            f"kernel {kt.probe_name} median {kt.probe_median_us:.2f} µs",
            flush=True,
        )
    for (cat, name), (dur, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:45]:
        short = name.split("kv_canary/")[-1] if cat == "python_function" else name
        print(
            f"{RESULT_PREFIX}[{cfg.name}]   {cat[:6]:6s} {dur / per:9.1f} µs  "
            f"x{n / per:5.2f}  {short}",
            flush=True,
        )


# ---- parent: one child process per config ----------------------------------------------------


def child_env(cfg: BenchConfig, smoke: bool, stub_dir: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    if smoke:
        from sglang.srt.kv_canary.demo.server_harness import cpu_server_env

        env = cpu_server_env(stub_dir, env)
    env.update(cfg.env())
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_child(args, cfg: BenchConfig, log_path: str, stub_dir: str | None) -> int:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_engine-child",
        cfg.name,
        "--_invocation",
        args.invocation,
        "--_gpu",
        args.gpu,
        "--scenarios",
        args.scenarios,
        "--runs",
        str(args.runs),
        "--out",
        args.out,
        "--chunked-prefill-size",
        str(args.chunked_prefill_size),
        "--max-total-tokens",
        str(args.max_total_tokens),
        "--mem-fraction-static",
        str(args.mem_fraction_static),
        "--speculative",
        args.speculative,
        "--model",
        args.model,
        "--piecewise",
        args.piecewise,
    ]
    if args.smoke_cpu:
        cmd.append("--smoke-cpu")
    if args.host_profile:
        cmd += ["--host-profile", str(args.host_profile)]
    proc = subprocess.Popen(
        cmd,
        env=child_env(cfg, args.smoke_cpu, stub_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # its own group: a timeout kills it whole
    timed_out = threading.Event()

    def kill():
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(args.child_timeout, kill)
    timer.start()
    tail: list[str] = []
    installed = []
    install_lines = []  # every "kv_canary installed" line: the target's and the draft's
    try:
        with open(log_path, "w") as log:
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line])[-60:]
                if line.startswith(RESULT_PREFIX):
                    print(line[len(RESULT_PREFIX) :], end="", flush=True)
                if "kv_canary installed:" in line:
                    installed.append(line.split("kv_canary installed:", 1)[1].strip())
                if "kv_canary installed" in line:
                    install_lines.append(line)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # this process failed or was interrupted: take the child down
            kill()
            proc.wait()
    if timed_out.is_set():
        print(f"[{cfg.name}] killed after --child-timeout {args.child_timeout} s", flush=True)
        rc = rc or 124
    problem = canary_lines_problem(
        "".join(install_lines), canary_on=cfg.canary_on, speculative=args.speculative
    )
    if rc == 0 and problem:
        print(
            f"[{cfg.name}] ERROR: {problem} (Engine log {log_path}); results of this config "
            "are invalid",
            flush=True,
        )
        rc = 3
    if installed:
        print(f"[{cfg.name}] kv_canary installed: {installed[0]}", flush=True)
    if rc != 0:
        print(
            f"[{cfg.name}] child exited {rc}; last lines of {log_path}:\n" + "".join(tail),
            flush=True,
        )
    return rc


def run_engines(args) -> int:
    configs = parse_names(args.configs, CONFIGS, "--configs")
    parse_names(args.scenarios, SCENARIOS, "--scenarios")
    args.gpu = gpu_name(args.smoke_cpu)
    args.invocation = uuid.uuid4().hex[:12]
    tmpdir = tempfile.mkdtemp(prefix="kv_canary_bench_")
    if not args.out:
        args.out = os.path.join(tmpdir, "overhead.jsonl")
    args.out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    stub_dir = None
    if args.smoke_cpu:
        from sglang.srt.kv_canary.demo.server_harness import build_libcuda_stub

        stub_dir = build_libcuda_stub(os.path.join(tmpdir, "stub"))
    print(
        f"KV-canary serving overhead — {args.gpu} — {now_utc()} — configs {', '.join(configs)}"
        f" — runs {args.runs} — results to {args.out}",
        flush=True,
    )
    failed = []
    for name in configs:
        t0 = time.perf_counter()
        log_path = f"{args.out}.{name.replace('+', '_')}.log"  # '+' does not survive $OUT
        rc = run_child(args, CONFIGS[name], log_path, stub_dir)
        print(f"[{name}] done in {time.perf_counter() - t0:.0f} s (log: {log_path})", flush=True)
        if rc != 0:
            failed.append(name)
    records = (
        [r for r in read_jsonl([args.out]) if r.get("invocation") == args.invocation]
        if os.path.exists(args.out)
        else []
    )
    print()
    print(engine_table(records, title=f"This invocation ({args.gpu})"))
    print()
    print(
        server_table(
            records,
            title="Server-side prefill time (scheduler: forward entry to prefill result processed)",
        )
    )
    if failed:
        print(f"\nFAILED configs: {', '.join(failed)}")
        return 1
    return 0


# ---- CLI -------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, from: {', '.join(CONFIGS)} (default: all)",
    )
    ap.add_argument(
        "--scenarios",
        help=f"comma-separated, from: {', '.join(SCENARIOS)} (default: "
        f"{', '.join(DEFAULT_SCENARIOS['none'])}; with a --speculative mode: "
        f"{', '.join(DEFAULT_SCENARIOS['eagle'])})",
    )
    ap.add_argument(
        "--speculative",
        default="none",
        type=speculative_mode,
        metavar="{" + ",".join(SPECULATIVE) + "}",
        help=SPECULATIVE_HELP.replace("every server", "every Engine") + "; decode graphs for "
        "bs 1 and 32; each canary-on Engine must report the canary installed on the target "
        "and on the mode's draft worker (" + DRAFT_WORKERS_HELP + ")",
    )
    ap.add_argument(
        "--piecewise",
        default=None,
        choices=("on", "off"),
        help="sglang's piecewise CUDA graphs for prefill, for every config (default "
        "on, sglang's default; off for a --model sglang 0.5.12 cannot capture: "
        + ", ".join(MODELS_WITHOUT_PIECEWISE)
        + "; results before 2026-11-24 ran with them off)",
    )
    ap.add_argument(
        "--model",
        default=None,
        choices=sorted(MODELS),
        help="the dummy-weight model's shapes (default: the --speculative mode's target, "
        "else qwen3-0.6b; qwen3-30b-a3b: the upstream-shaped MoE rows, one H200)",
    )
    ap.add_argument(
        "--server-timing",
        default="on",
        choices=("on", "off"),
        help="sglang's request metrics on for every config, and the scheduler's "
        "own prefill time per run from meta_info (default on)",
    )
    ap.add_argument(
        "--cuda-graph-bs",
        help="decode CUDA-graph batch sizes, comma-separated "
        "(default 1,128; 1,32 with a --speculative mode)",
    )
    ap.add_argument(
        "--runs", type=int, help="timed runs per scenario (default 5; 2 with --smoke-cpu)"
    )
    ap.add_argument(
        "--out",
        help="append results as JSON lines to this file (Engine logs go to <out>.<config>.log)",
    )
    ap.add_argument(
        "--report",
        nargs="+",
        metavar="JSONL",
        help="print the markdown report of these JSON lines files and exit",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="per-launch canary GPU time per decode step (in-process, no Engine)",
    )
    ap.add_argument("--breakdown-bs", default="1,128", help="decode batch sizes (default 1,128)")
    ap.add_argument(
        "--breakdown-ctx",
        type=int,
        default=1024,
        help="context per request before the profiled decode steps (default 1024)",
    )
    ap.add_argument(
        "--breakdown-steps", type=int, default=20, help="profiled decode steps (default 20)"
    )
    ap.add_argument(
        "--host-breakdown",
        metavar="ISL[,ISL...]",
        help="host time of each canary phase of a one-request eager prefill of "
        "each prompt length (in-process, no Engine; --configs picks the configs)",
    )
    ap.add_argument(
        "--host-breakdown-runs",
        type=int,
        default=30,
        help="prefills per prompt length and config (default 30)",
    )
    ap.add_argument(
        "--host-breakdown-cprofile",
        action="store_true",
        help="with --host-breakdown: 20 more prefills per row under cProfile (not "
        "timed) and the top 30 functions by own time, before the forward and after",
    )
    ap.add_argument(
        "--host-breakdown-detail",
        action="store_true",
        help="with --host-breakdown: as many prefills again with the canary's "
        "per-forward methods timed one by one (µs per call, inclusive)",
    )
    ap.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="tiny CPU dry run (sglang CPU server / CPU pools); numbers meaningless",
    )
    ap.add_argument("--chunked-prefill-size", type=int, default=EngineSettings.chunked_prefill_size)
    ap.add_argument("--max-total-tokens", type=int, default=EngineSettings.max_total_tokens)
    ap.add_argument("--mem-fraction-static", type=float, default=EngineSettings.mem_fraction_static)
    ap.add_argument(
        "--child-timeout",
        type=float,
        default=540,
        help="seconds one config's Engine process may take (default 540)",
    )
    ap.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="after the timed runs, profile STEPS forwards of one more run of the "
        "last scenario (sglang's torch profiler, Python stacks) and print the "
        "scheduler's host time per canary function and CUDA runtime call",
    )
    ap.add_argument("--_engine-child", dest="engine_child", help=argparse.SUPPRESS)
    ap.add_argument("--_invocation", dest="invocation", help=argparse.SUPPRESS)
    ap.add_argument("--_gpu", dest="gpu", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.runs is None:
        args.runs = 2 if args.smoke_cpu else 5
    for flag, value, minimum in (
        ("--runs", args.runs, 1),
        ("--breakdown-ctx", args.breakdown_ctx, 2),
        ("--breakdown-steps", args.breakdown_steps, 1),
        ("--chunked-prefill-size", args.chunked_prefill_size, 1),
        ("--max-total-tokens", args.max_total_tokens, 1),
    ):
        if value < minimum:
            ap.error(f"{flag} must be >= {minimum}, got {value}")
    if args.scenarios is None:
        args.scenarios = ",".join(DEFAULT_SCENARIOS[args.speculative])
    if args.speculative != "none" and args.smoke_cpu:
        ap.error(
            f"--speculative {args.speculative} cannot run with --smoke-cpu: sglang 0.5.12's CPU "
            "engine has no speculative decoding (docs/user_guide.md, \"Speculative decoding\")"
        )
    args.model = speculative_model(args.speculative, args.model)
    args.piecewise = piecewise_setting(args.model, args.piecewise)
    problem = speculative_model_problem(args.speculative, args.model)
    if problem:
        ap.error(problem)
    if not 0 < args.mem_fraction_static < 1:
        ap.error(f"--mem-fraction-static must be in (0, 1), got {args.mem_fraction_static}")
    if args.engine_child is not None and args.engine_child not in CONFIGS:
        ap.error(
            f"--_engine-child: unknown config {args.engine_child!r}; allowed: {', '.join(CONFIGS)}"
        )
    args.settings = EngineSettings(
        chunked_prefill_size=args.chunked_prefill_size,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        speculative=args.speculative,
        piecewise=args.piecewise == "on",
        model=args.model,
        server_timing=args.server_timing == "on",
        cuda_graph_bs=(
            tuple(parse_ints(args.cuda_graph_bs, "--cuda-graph-bs"))
            if args.cuda_graph_bs
            else (1, 32)
            if args.speculative != "none"
            else EngineSettings.cuda_graph_bs
        ),
    )
    if args.report:
        missing = [p for p in args.report if not os.path.exists(p)]
        if missing:
            ap.error(f"--report: no such file(s): {', '.join(missing)}")
        report(args.report)
        return 0
    if args.engine_child:
        engine_child(args)
        return 0
    if args.breakdown:
        run_breakdown(args)
        return 0
    if args.host_breakdown:
        run_host_breakdown(args)
        return 0
    return run_engines(args)


if __name__ == "__main__":
    sys.exit(main())
