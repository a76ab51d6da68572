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
``max_running_requests`` 128, a KV pool of 262144 tokens. Configs (one Engine each, each in its
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

``--speculative eagle``: every Engine serves with EAGLE (a one-layer ``LlamaForCausalLMEagle``
draft of the same shapes, 3 steps, topk 1, 4 draft tokens, decode graphs for bs 1 and 32; the
canary guards both pools when on) and the scenarios default to ``decode_bs1`` and
``decode_bs32`` (32 requests x isl 512, osl 1024)::

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
(docs/architecture.md, "CPU server": tiny dummy Llama, libcuda stub, CUDA graphs off) with tiny
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
import cProfile
import dataclasses
import datetime
import gc
import json
import os
import pathlib
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Sequence

# ---- model, scenarios, configs ----------------------------------------------------------------

QWEN3_0_6B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

# ``--model qwen3-30b-a3b``: the upstream-shaped MoE rows: Qwen3-30B-A3B's shapes
# (48 layers, hidden 2048, 32 heads, 4 KV heads x 128, 128 experts of 768, 8 per token),
# dummy weights (about 61 GB in bf16: one H200)
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
MODELS = {"qwen3-0.6b": QWEN3_0_6B_CONFIG, "qwen3-30b-a3b": QWEN3_30B_A3B_CONFIG}
DEFAULT_MODEL = "qwen3-0.6b"

# ``--speculative eagle``: a one-layer EAGLE draft of the same shapes (hidden 1024, 16 heads,
# 8 KV heads x 128, the target's vocabulary; sglang hands it the target's embedding and head)
QWEN3_EAGLE_DRAFT_CONFIG = {
    **{k: v for k, v in QWEN3_0_6B_CONFIG.items() if k not in ("attention_bias",)},
    "architectures": ["LlamaForCausalLMEagle"],
    "model_type": "llama",
    "num_hidden_layers": 1,
    "tie_word_embeddings": False,
}
SPECULATIVE = {
    "none": {},
    "eagle": dict(speculative_algorithm="EAGLE", speculative_num_steps=3,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=4),
}

TOKEN_ENV = "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT"
RESULT_PREFIX = "BENCH "  # lines the Engine child prints for the parent to echo


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    bs: int
    isl: int
    osl: int

    @property
    def kind(self) -> str:
        return "prefill" if self.osl == 1 else "decode"


SCENARIOS = {s.name: s for s in (
    Scenario("decode_bs128", bs=128, isl=512, osl=1024),
    Scenario("decode_bs1", bs=1, isl=512, osl=1024),
    Scenario("prefill_bs32", bs=32, isl=16384, osl=1),
    Scenario("prefill_bs1_4k", bs=1, isl=4096, osl=1),
    Scenario("decode_bs32", bs=32, isl=512, osl=1024),
    Scenario("prefill_bs1_512", bs=1, isl=512, osl=1),
    Scenario("prefill_bs1_16k", bs=1, isl=16384, osl=1),
    Scenario("decode_bs64", bs=64, isl=256, osl=512),
)}
# scenarios run when --scenarios is not given
DEFAULT_SCENARIOS = {"none": ("decode_bs128", "decode_bs1", "prefill_bs32", "prefill_bs1_4k"),
                     "eagle": ("decode_bs1", "decode_bs32")}
SMOKE_SCENARIOS = {s.name: s for s in (
    Scenario("decode_bs128", bs=2, isl=16, osl=8),
    Scenario("decode_bs1", bs=1, isl=16, osl=8),
    Scenario("prefill_bs32", bs=2, isl=64, osl=1),
    Scenario("prefill_bs1_4k", bs=1, isl=64, osl=1),
    Scenario("decode_bs32", bs=2, isl=16, osl=8),
    Scenario("prefill_bs1_512", bs=1, isl=16, osl=1),
    Scenario("prefill_bs1_16k", bs=1, isl=96, osl=1),
    Scenario("decode_bs64", bs=2, isl=16, osl=8),
)}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    name: str
    kv_canary: str = "none"
    real_data: str = "none"
    verify_tokens: bool = False
    real_data_layers: str = "first"  # "all" = per-layer fingerprints

    @property
    def canary_on(self) -> bool:
        return self.kv_canary != "none"

    def engine_kwargs(self) -> dict:
        kw = {"kv_canary": self.kv_canary}
        if self.canary_on:
            kw["kv_canary_real_data"] = self.real_data
            kw["kv_canary_real_data_layers"] = self.real_data_layers
        return kw

    def env(self) -> dict[str, str]:
        return {TOKEN_ENV: "1"} if self.verify_tokens else {}


CONFIGS = {c.name: c for c in (
    BenchConfig("off"),
    BenchConfig("raise", kv_canary="raise"),
    BenchConfig("abort", kv_canary="abort"),
    BenchConfig("raise+partial", kv_canary="raise", real_data="partial"),
    BenchConfig("raise+token", kv_canary="raise", verify_tokens=True),
    BenchConfig("raise+token+partial", kv_canary="raise", real_data="partial",
                verify_tokens=True),
    BenchConfig("raise+partial+layers", kv_canary="raise", real_data="partial",
                real_data_layers="all"),
    BenchConfig("raise+all+layers", kv_canary="raise", real_data="all", real_data_layers="all"),
)}


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """Server settings shared by every config (only the canary differs)."""

    chunked_prefill_size: int = 8192
    max_total_tokens: int = 262144
    max_running_requests: int = 128
    mem_fraction_static: float = 0.7
    cuda_graph_bs: tuple = (1, 128)
    speculative: str = "none"  # a key of SPECULATIVE
    piecewise: bool = True  # sglang's piecewise CUDA graphs for prefill (its default: on)
    model: str = DEFAULT_MODEL  # a key of MODELS
    # sglang's request metrics on (every config): each output's meta_info then carries the
    # scheduler's forward-entry and prefill-finished times (the server-side prefill time)
    server_timing: bool = True

    def engine_kwargs(self, model_dir: str, *, smoke: bool,
                      draft_dir: str | None = None) -> dict:
        from sglang.srt.kv_canary.testing.server_harness import (
            cpu_engine_kwargs,
            gpu_engine_kwargs,
        )

        if smoke:
            return cpu_engine_kwargs(model_dir, chunked_prefill_size=self.chunked_prefill_size,
                                     max_total_tokens=self.max_total_tokens,
                                     max_running_requests=self.max_running_requests,
                                     enable_metrics=self.server_timing, log_level="info")
        spec = dict(SPECULATIVE[self.speculative])
        if spec:
            spec["speculative_draft_model_path"] = draft_dir
        return gpu_engine_kwargs(model_dir, chunked_prefill_size=self.chunked_prefill_size,
                                 max_total_tokens=self.max_total_tokens,
                                 max_running_requests=self.max_running_requests,
                                 mem_fraction_static=self.mem_fraction_static,
                                 cuda_graph_bs=list(self.cuda_graph_bs),
                                 cuda_graph_max_bs=max(self.cuda_graph_bs),
                                 disable_piecewise_cuda_graph=not self.piecewise,
                                 enable_metrics=self.server_timing,
                                 log_level="info", **spec)


SMOKE_SETTINGS = EngineSettings(chunked_prefill_size=32, max_total_tokens=4096,
                                max_running_requests=8, mem_fraction_static=0.05,
                                cuda_graph_bs=(1, 2))


def parse_names(value: str, allowed: dict[str, object], flag: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SystemExit(f"{flag}: unknown value(s) {', '.join(map(repr, bad)) or '(empty)'}; "
                         f"allowed (comma-separated): {', '.join(allowed)}")
    return names


def gpu_name(smoke: bool) -> str:
    """GPU name without initialising CUDA in this process (sglang spawns its own)."""
    if smoke:
        return "cpu (smoke)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False).stdout.strip()
        return out.splitlines()[0] if out else "unknown GPU"
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def append_jsonl(path: str | None, record: dict) -> None:
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(paths: Sequence[str]) -> list[dict]:
    records = []
    for p in paths:
        with open(p) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


# ---- Engine child (one config, one process) ---------------------------------------------------

def make_inputs(scenario: Scenario, run: int, vocab: int) -> list[list[int]]:
    """Random token ids, fixed per (scenario, run): every config sees the same inputs, every
    request and run differs (no radix hits)."""
    import numpy as np

    rng = np.random.default_rng(zlib.crc32(f"{scenario.name}/{run}".encode()))
    lo, hi = min(100, vocab // 8), vocab - min(100, vocab // 8)
    return rng.integers(lo, hi, size=(scenario.bs, scenario.isl)).tolist()


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between the order statistics)."""
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def server_prefill_ms(outs: list[dict]) -> float | None:
    """The scheduler's own prefill time of one ``generate`` call (``--server-timing``): from
    the first request's entry into a forward batch to the last request's prefill result
    processed (sglang's ``forward_entry_time`` / ``prefill_finished_time``, meta_info with
    request metrics on), in ms; None without them. What a time to first token pays in the
    scheduler, without the tokenizer / detokenizer processes and their queues."""
    metas = [o.get("meta_info", {}) for o in outs]
    starts = [m.get("forward_entry_time") for m in metas]
    ends = [m.get("prefill_finished_time") for m in metas]
    if not metas or None in starts or None in ends:
        return None
    return (max(ends) - min(starts)) * 1e3


def server_stats(server: list) -> dict:
    """The JSON fields of the server-side prefill times of one scenario (none if missing)."""
    if not server or None in server:
        return {}
    return dict(server_runs_ms=server, server_median_ms=statistics.median(server),
                server_min_ms=min(server), server_p10_ms=quantile(server, 0.1),
                server_p90_ms=quantile(server, 0.9))


def engine_child(args) -> None:
    import sglang

    smoke = args.smoke_cpu
    cfg = CONFIGS[args.engine_child]
    scenarios = [(SMOKE_SCENARIOS if smoke else SCENARIOS)[n]
                 for n in parse_names(args.scenarios, SCENARIOS, "--scenarios")]
    settings = SMOKE_SETTINGS if smoke else args.settings
    with tempfile.TemporaryDirectory(prefix="kv_canary_bench_model_") as tmp:
        if smoke:
            from sglang.srt.kv_canary.testing.server_harness import (
                TINY_LLAMA_CONFIG,
                write_tiny_llama,
            )

            model_dir, vocab = write_tiny_llama(tmp), TINY_LLAMA_CONFIG["vocab_size"]
        else:
            model_cfg = MODELS[settings.model]
            pathlib.Path(tmp, "config.json").write_text(json.dumps(model_cfg, indent=1))
            model_dir, vocab = tmp, model_cfg["vocab_size"]
        draft_dir = None
        if settings.speculative != "none":
            draft_dir = os.path.join(tmp, "draft")
            os.makedirs(draft_dir)
            pathlib.Path(draft_dir, "config.json").write_text(
                json.dumps(QWEN3_EAGLE_DRAFT_CONFIG, indent=1))
        kwargs = {**settings.engine_kwargs(model_dir, smoke=smoke, draft_dir=draft_dir),
                  **cfg.engine_kwargs()}
        t0 = time.perf_counter()
        engine = sglang.Engine(**kwargs)
        startup_s = time.perf_counter() - t0
        print(f"{RESULT_PREFIX}[{cfg.name}] engine up in {startup_s:.1f} s "
              f"(kv_canary={getattr(engine.server_args, 'kv_canary', '?')}, "
              f"real_data={getattr(engine.server_args, 'kv_canary_real_data', '?')}, "
              f"{TOKEN_ENV}={os.environ.get(TOKEN_ENV, '0')})", flush=True)
        try:
            for sc in scenarios:
                params = [{"max_new_tokens": sc.osl, "ignore_eos": True, "temperature": 0}
                          for _ in range(sc.bs)]
                times, server = [], []
                for run in range(-1, args.runs):  # run -1: warm-up
                    ids = make_inputs(sc, run, vocab)
                    engine.flush_cache()
                    t0 = time.perf_counter()
                    outs = engine.generate(input_ids=ids, sampling_params=params)
                    ms = (time.perf_counter() - t0) * 1e3
                    lens = sorted({len(o["output_ids"]) for o in outs})
                    if len(outs) != sc.bs or lens != [sc.osl]:
                        raise RuntimeError(f"{sc.name}: expected {sc.bs} outputs of {sc.osl} "
                                           f"tokens, got {len(outs)} with lengths {lens}")
                    if run >= 0:
                        times.append(ms)
                        server.append(server_prefill_ms(outs))
                    else:
                        warmup_ms = ms
                rec = dict(kind="engine", invocation=args.invocation, time=now_utc(),
                           gpu=args.gpu, smoke=smoke, config=cfg.name, scenario=sc.name,
                           speculative=settings.speculative,
                           bs=sc.bs, isl=sc.isl, osl=sc.osl, runs_ms=times,
                           median_ms=statistics.median(times), min_ms=min(times),
                           p10_ms=quantile(times, 0.1), p90_ms=quantile(times, 0.9),
                           warmup_ms=warmup_ms, startup_s=startup_s,
                           model=settings.model,
                           **server_stats(server),
                           settings=dataclasses.asdict(settings),
                           engine_kwargs={k: v for k, v in kwargs.items() if k != "model_path"},
                           env={TOKEN_ENV: os.environ.get(TOKEN_ENV, "0")})
                append_jsonl(args.out, rec)
                print(f"{RESULT_PREFIX}[{cfg.name}] {sc.name}: median {rec['median_ms']:.1f} ms, "
                      f"min {rec['min_ms']:.1f} ms, runs "
                      f"{', '.join(f'{t:.1f}' for t in times)} (warm-up {warmup_ms:.1f})",
                      flush=True)
            if args.host_profile:
                host_profile(engine, cfg, scenarios[-1], vocab, args.host_profile, tmp)
        finally:
            engine.shutdown()


def host_profile(engine, cfg: BenchConfig, sc: Scenario, vocab: int, steps: int, tmp: str
                 ) -> None:
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
    engine.start_profile(output_dir=out_dir, num_steps=steps, activities=["CPU", "GPU"],
                         with_stack=True, record_shapes=False)
    params = [{"max_new_tokens": sc.osl, "ignore_eos": True, "temperature": 0}
              for _ in range(sc.bs)]
    engine.generate(input_ids=make_inputs(sc, 0, vocab), sampling_params=params)
    deadline = time.monotonic() + 120
    files: list[str] = []
    while time.monotonic() < deadline and not files:
        time.sleep(1)
        files = glob.glob(os.path.join(out_dir, "**", "*.trace.json*"), recursive=True)
    if not files:
        print(f"{RESULT_PREFIX}[{cfg.name}] host profile: no trace written in {out_dir}",
              flush=True)
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
        keep = (cat == "cuda_runtime" or (cat == "python_function" and "kv_canary" in name))
        if keep:
            t = totals.setdefault((cat, name), [0.0, 0])
            t[0] += ev["dur"]
            t[1] += 1
    print(f"{RESULT_PREFIX}[{cfg.name}] host profile of {sc.name}: {forwards} forwards traced "
          "(µs per forward, inclusive; count per forward)", flush=True)
    per = max(forwards, 1)
    for (cat, name), (dur, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:45]:
        short = name.split("kv_canary/")[-1] if cat == "python_function" else name
        print(f"{RESULT_PREFIX}[{cfg.name}]   {cat[:6]:6s} {dur / per:9.1f} µs  "
              f"x{n / per:5.2f}  {short}", flush=True)


# ---- parent: one child process per config ----------------------------------------------------

def child_env(cfg: BenchConfig, smoke: bool, stub_dir: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    if smoke:
        from sglang.srt.kv_canary.testing.server_harness import cpu_server_env

        env = cpu_server_env(stub_dir, env)
    env.update(cfg.env())
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_child(args, cfg: BenchConfig, log_path: str, stub_dir: str | None) -> int:
    cmd = [sys.executable, os.path.abspath(__file__), "--_engine-child", cfg.name,
           "--_invocation", args.invocation, "--_gpu", args.gpu,
           "--scenarios", args.scenarios, "--runs", str(args.runs), "--out", args.out,
           "--chunked-prefill-size", str(args.chunked_prefill_size),
           "--max-total-tokens", str(args.max_total_tokens),
           "--mem-fraction-static", str(args.mem_fraction_static),
           "--speculative", args.speculative, "--piecewise", args.piecewise]
    if args.smoke_cpu:
        cmd.append("--smoke-cpu")
    if args.host_profile:
        cmd += ["--host-profile", str(args.host_profile)]
    proc = subprocess.Popen(cmd, env=child_env(cfg, args.smoke_cpu, stub_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: a timeout kills it whole
    timed_out = threading.Event()

    def kill():
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(args.child_timeout, kill)
    timer.start()
    tail: list[str] = []
    installed = []
    draft_installed = False
    try:
        with open(log_path, "w") as log:
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line])[-60:]
                if line.startswith(RESULT_PREFIX):
                    print(line[len(RESULT_PREFIX):], end="", flush=True)
                if "kv_canary installed:" in line:
                    installed.append(line.split("kv_canary installed:", 1)[1].strip())
                if "kv_canary installed on the EAGLE draft worker:" in line:
                    draft_installed = True
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # this process failed or was interrupted: take the child down
            kill()
            proc.wait()
    if timed_out.is_set():
        print(f"[{cfg.name}] killed after --child-timeout {args.child_timeout} s", flush=True)
        rc = rc or 124
    if rc == 0 and cfg.canary_on and not installed:
        print(f"[{cfg.name}] ERROR: the Engine log has no 'kv_canary installed' line: the "
              "canary did not run; results of this config are invalid", flush=True)
        rc = 3
    if rc == 0 and cfg.canary_on and args.speculative != "none" and not draft_installed:
        print(f"[{cfg.name}] ERROR: no 'kv_canary installed on the EAGLE draft worker' line: "
              "the draft pool ran unguarded; results of this config are invalid", flush=True)
        rc = 3
    if rc == 0 and not cfg.canary_on and installed:
        print(f"[{cfg.name}] ERROR: the canary was installed in the 'off' config", flush=True)
        rc = 3
    if installed:
        print(f"[{cfg.name}] kv_canary installed: {installed[0]}", flush=True)
    if rc != 0:
        print(f"[{cfg.name}] child exited {rc}; last lines of {log_path}:\n" + "".join(tail),
              flush=True)
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
        from sglang.srt.kv_canary.testing.server_harness import build_libcuda_stub

        stub_dir = build_libcuda_stub(os.path.join(tmpdir, "stub"))
    print(f"KV-canary serving overhead — {args.gpu} — {now_utc()} — configs {', '.join(configs)}"
          f" — runs {args.runs} — results to {args.out}", flush=True)
    failed = []
    for name in configs:
        t0 = time.perf_counter()
        log_path = f"{args.out}.{name.replace('+', '_')}.log"  # '+' does not survive $OUT
        rc = run_child(args, CONFIGS[name], log_path, stub_dir)
        print(f"[{name}] done in {time.perf_counter() - t0:.0f} s (log: {log_path})", flush=True)
        if rc != 0:
            failed.append(name)
    records = [r for r in read_jsonl([args.out]) if r.get("invocation") == args.invocation] \
        if os.path.exists(args.out) else []
    print()
    print(engine_table(records, title=f"This invocation ({args.gpu})"))
    print()
    print(server_table(records, title="Server-side prefill time (scheduler: forward entry to "
                                      "prefill result processed)"))
    if failed:
        print(f"\nFAILED configs: {', '.join(failed)}")
        return 1
    return 0


# ---- report ----------------------------------------------------------------------------------

def pct(on: float, off: float) -> str:
    return f"{(on - off) / off * 100:+.2f} %"


def _latest_rows(records: list[dict]) -> list[dict]:
    """The latest record per (model, scenario, speculative, config, invocation), in table
    order (model, speculative, scenario, config)."""
    latest: dict[tuple, dict] = {}
    for r in records:
        latest[(r.get("model", DEFAULT_MODEL), r["scenario"], r.get("speculative", "none"),
                r["config"], r["invocation"])] = r
    order = {n: i for i, n in enumerate(CONFIGS)}
    sc_order = {n: i for i, n in enumerate(SCENARIOS)}
    return sorted(latest.values(), key=lambda r: (r.get("model", DEFAULT_MODEL),
                                                  r.get("speculative", "none"),
                                                  sc_order.get(r["scenario"], 99),
                                                  order.get(r["config"], 99), r["time"]))


def _baseline(rows: list[dict], r: dict) -> tuple[dict | None, bool]:
    """The ``off`` row ``r`` is compared with: the same invocation's (same model, scenario
    and speculative setting) when there is one, else the latest; and whether it is from
    another invocation."""
    offs = [o for o in rows if o["config"] == "off" and o["scenario"] == r["scenario"]
            and o.get("speculative", "none") == r.get("speculative", "none")
            and o.get("model", DEFAULT_MODEL) == r.get("model", DEFAULT_MODEL)]
    same = [o for o in offs if o["invocation"] == r["invocation"]]
    if same:
        return same[-1], False
    return (offs[-1], True) if offs else (None, False)


def _overheads(r: dict, base: dict | None, cross: bool, median: str, minimum: str
               ) -> tuple[str, str]:
    """Overhead cells (median, min) of ``r`` against ``base`` for the given fields."""
    if r["config"] == "off" or base is None:
        cell = "—" if r["config"] == "off" else "no off"
        return cell, cell
    mark = "*" if cross else ""
    return pct(r[median], base[median]) + mark, pct(r[minimum], base[minimum]) + mark


def engine_table(records: list[dict], title: str) -> str:
    """Per scenario x config: median / min ms and overhead vs ``off`` (the ``off`` of the same
    invocation when there is one, else the latest ``off``; marked *)."""
    if not records:
        return f"{title}: no Engine results"
    lines = [f"{title}", "",
             ("| scenario | config | runs | median ms | min ms | p10 / p90 ms | "
              "ms / output token (median) | overhead (median) | overhead (min) |"),
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows = _latest_rows(records)
    any_cross = False
    for r in rows:
        base, cross = _baseline(rows, r)
        any_cross |= cross
        ov_med, ov_min = _overheads(r, base, cross, "median_ms", "min_ms")
        per_tok = f"{r['median_ms'] / r['osl']:.3f}" if r["osl"] > 1 else "—"
        spec = "" if r.get("speculative", "none") == "none" else f", {r['speculative']}"
        spread = (f"{r['p10_ms']:.1f} / {r['p90_ms']:.1f}" if "p10_ms" in r
                  else f"{quantile(r['runs_ms'], 0.1):.1f} / {quantile(r['runs_ms'], 0.9):.1f}")
        pw = "" if r.get("settings", {}).get("piecewise", False) else ", pw off"
        if r.get("model", DEFAULT_MODEL) != DEFAULT_MODEL:
            pw += f", {r['model']}"
        lines.append(f"| {r['scenario']} (bs{r['bs']} isl{r['isl']} osl{r['osl']}{spec}{pw}) | "
                     f"{r['config']} | {len(r['runs_ms'])} | {r['median_ms']:.1f} | "
                     f"{r['min_ms']:.1f} | {spread} | {per_tok} | {ov_med} | "
                     f"{ov_min} |")
    if any_cross:
        lines += ["", ("\\* overhead against an `off` measured in another invocation (another "
                       "Engine start, possibly another machine).")]
    return "\n".join(lines)


def server_table(records: list[dict], title: str) -> str:
    """Per scenario x config with server-side prefill times: their median / min and the
    overhead against ``off`` of the same invocation (else the latest ``off``, marked *)."""
    rows = _latest_rows([r for r in records if "server_median_ms" in r])
    if not rows:
        return f"{title}: no server-side times (run with --server-timing on)"
    lines = [title, "", ("| scenario | config | runs | server median ms | server min ms | "
                         "p10 / p90 ms | overhead (median) | overhead (min) |"),
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base, cross = _baseline(rows, r)
        ov_med, ov_min = _overheads(r, base, cross, "server_median_ms", "server_min_ms")
        model = "" if r.get("model", DEFAULT_MODEL) == DEFAULT_MODEL else f", {r['model']}"
        lines.append(f"| {r['scenario']} (bs{r['bs']} isl{r['isl']} osl{r['osl']}{model}) | "
                     f"{r['config']} | {len(r['server_runs_ms'])} | "
                     f"{r['server_median_ms']:.2f} | {r['server_min_ms']:.2f} | "
                     f"{r['server_p10_ms']:.2f} / {r['server_p90_ms']:.2f} | {ov_med} | "
                     f"{ov_min} |")
    return "\n".join(lines)


BREAKDOWN_ORDER = ("token-id scatter (outside graph)", "plan input fill", "plan kernels",
                   "HEAD verify", "HEAD + TAIL chain write", "TAIL verify",
                   "TAIL fingerprint write",
                   "status copy + rest of post-ops", "rest of pre-ops",
                   "forward-stream total (sum)", "CUDA-graph replay of the in-graph ops",
                   "D2H staging (side stream, copy engine)", "unattributed device time")


def breakdown_table(records: list[dict]) -> str:
    if not records:
        return "Breakdown: no results"
    unit = records[0]["unit"]
    keys = sorted({(r["config"], r["bs"]) for r in records},
                  key=lambda k: (list(CONFIGS).index(k[0]) if k[0] in CONFIGS else 99, k[1]))
    latest = {(r["config"], r["bs"]): r for r in records}
    head = " | ".join(f"{c} bs{bs}" for c, bs in keys)
    lines = [(f"Canary {unit} per decode step (context {records[0]['ctx']} tokens; "
              f"{records[0]['steps']} steps; {records[0]['gpu']}, {records[0]['time']})"), "",
             f"| launch | {head} |", "| --- |" + " ---: |" * len(keys)]
    for label in BREAKDOWN_ORDER:
        vals = [latest[k]["launches"].get(label) for k in keys]
        if all(v is None for v in vals):
            continue
        cells = " | ".join("—" if v is None else f"{v:.1f}" for v in vals)
        bold = "**" if label == "forward-stream total (sum)" else ""
        lines.append(f"| {bold}{label}{bold} | {cells} |")
    lines += ["", ("Kernels by name (same steps, µs per step; HEAD and TAIL launches of one "
                   "kernel add up):"), ""]
    for k in keys:
        by = latest[k]["by_kernel"]
        top = sorted(by.items(), key=lambda kv: -kv[1])[:8]
        lines.append(f"- {k[0]} bs{k[1]}: " + ("; ".join(f"`{n[:60]}` {v:.1f}" for n, v in top)
                                                 or "(no device kernels recorded)"))
    lines += ["", ("The model's own decode step time: the Engine runs (ms / output token of "
                   "the decode scenarios).")]
    return "\n".join(lines)


def report(paths: Sequence[str]) -> None:
    records = read_jsonl(paths)
    eng = [r for r in records if r.get("kind") == "engine"]
    brk = [r for r in records if r.get("kind") == "breakdown"]
    hbd = [r for r in records if r.get("kind") == "host_breakdown"]
    gpus = sorted({r["gpu"] for r in records})
    dates = sorted({r["time"] for r in records})
    out = [f"# KV-canary serving overhead — {', '.join(gpus) or '?'}"]
    if dates:
        out.append(f"Measured {dates[0]} .. {dates[-1]}.")
    if eng:
        s = eng[0]
        kw = s["engine_kwargs"]
        out += ["", ("Settings: Qwen3-0.6B-shaped dummy model, "
                f"attention {kw.get('attention_backend')}, CUDA graphs "
                f"{'off' if kw.get('disable_cuda_graph') else 'bs ' + str(kw.get('cuda_graph_bs'))}, "
                f"piecewise graphs {'off' if kw.get('disable_piecewise_cuda_graph') else 'on'}, "
                f"chunked prefill {kw.get('chunked_prefill_size')}, "
                f"max running requests {kw.get('max_running_requests')}, KV pool "
                f"{kw.get('max_total_tokens')} tokens, mem fraction {kw.get('mem_fraction_static')}; "
                "radix cache flushed before every run; latency = wall time of one "
                "`Engine.generate` over the batch; median / min over the runs after one warm-up."),
                ""]
        out.append(engine_table(eng, title="## End-to-end latency"))
        out += ["", server_table(eng, title="## Server-side prefill time")]
    if hbd:
        out += ["", "## Canary host time per bs1 prefill", "", host_breakdown_table(hbd)]
    if brk:
        out += ["", "## Canary GPU time per decode step", "", breakdown_table(brk)]
        step_ms = {r["bs"]: r["median_ms"] / r["osl"] for r in eng
                   if r["config"] == "off" and r["osl"] > 1}
        shares = []
        for r in brk:
            graph = r["launches"].get("CUDA-graph replay of the in-graph ops")
            if graph is not None and r["bs"] in step_ms:
                shares.append(f"{r['config']} bs{r['bs']}: {graph:.1f} µs / "
                              f"{step_ms[r['bs']] * 1e3:.0f} µs = "
                              f"{graph / (step_ms[r['bs']] * 1e3) * 100:.2f} %")
        if shares:
            out += ["", ("In-graph canary time as a share of the `off` decode step (Engine "
                         "latency / osl, which includes the prefill):"), ""]
            out += [f"- {line}" for line in shares]
    print("\n".join(out))


# ---- breakdown ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BreakdownShape:
    head_num: int
    head_dim: int
    layer_num: int
    num_slots: int
    max_reqs: int
    max_context_len: int
    ctx: int
    batch_sizes: tuple
    prefill_chunk: int
    steps: int
    warmup_steps: int
    vocab: int


LABEL = "kvc: "


class _Req:
    """What the token-id snapshot reads from an sglang ``Req``."""

    def __init__(self, row: int, prompt: list[int]):
        self.row = self.req_pool_idx = row
        self.origin_input_ids = prompt
        self.output_ids: list[int] = []
        self.slots: list[int] = []

    @property
    def length(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)


# the in-process prefill stand-ins' pool shapes (Qwen3-0.6B; tiny for --smoke-cpu):
# layers, KV heads, head dim, vocabulary
PREFILL_SHAPES = {False: (28, 8, 128, 151936), True: (2, 2, 8, 512)}


def build_prefill_canary(cname: str, *, device, smoke: bool, max_ctx: int, num_slots: int,
                         chunk: int):
    """``(manager, req_to_token_pool, kv_pool)``: config ``cname``'s canary from the runtime's
    builder on real sglang pools of :data:`PREFILL_SHAPES` (eight request rows, page size 1,
    layer 0's K and V random), start-up finished (on CUDA: its graphs captured). For the
    in-process bs 1 prefills of ``--host-breakdown`` and ``bench_prefill_device_time.py``."""
    import torch
    from sglang.srt.kv_canary.builder import build_canary
    from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
    from sglang.srt.kv_canary.config import CanaryConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    cfg = CONFIGS[cname]
    layers, heads, dim, _ = PREFILL_SHAPES[smoke]
    r2t = ReqToTokenPool(size=8, max_context_len=max_ctx, device=str(device),
                         enable_memory_saver=False)
    kv = MHATokenToKVPool(size=num_slots, page_size=1, dtype=torch.bfloat16, head_num=heads,
                          head_dim=dim, layer_num=layers, device=str(device),
                          enable_memory_saver=False, enable_alt_stream=False)
    kv.k_buffer[0].normal_()
    kv.v_buffer[0].normal_()
    mgr = build_canary(
        pool=kv, req_to_token=r2t.req_to_token, device=device,
        config=CanaryConfig(mode=cfg.kv_canary, real_kv_hash_mode=cfg.real_data,
                            real_data_layers=cfg.real_data_layers,
                            enable_verify_token_assert=cfg.verify_tokens,
                            stats_print_every_n_steps=0),
        capacity_inputs=CanaryCapacityInputs(context_len=max_ctx, chunked_prefill_size=chunk,
                                             max_prefill_tokens=16384, cuda_graph_max_bs=8))
    mgr.mark_init_finished()
    return mgr, r2t, kv


def prefill_chunk_batch(req: "_Req", slots, start: int, n: int, *, device, r2t=None,
                        kv=None):
    """The ``ForwardBatch`` sglang would build for tokens ``[start, start + n)`` of ``req``'s
    prompt (bs 1 EXTEND, prefix ``start``), written to ``slots[start:start + n]``."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    def i64(v):
        return torch.tensor(v, dtype=torch.int64, device=device)

    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1,
                      input_ids=i64(req.origin_input_ids[start:start + n]),
                      req_pool_indices=i64([req.row]), seq_lens=i64([start + n]),
                      out_cache_loc=i64(slots[start:start + n].tolist()),
                      seq_lens_sum=start + n, positions=i64(list(range(start, start + n))),
                      req_to_token_pool=r2t, token_to_kv_pool=kv)
    fb.extend_prefix_lens, fb.extend_seq_lens = i64([start]), i64([n])
    fb.extend_num_tokens = n
    fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = [start], [n]
    return fb


@contextlib.contextmanager
def labelled_launches(manager):
    """Wrap the runtime's launch functions (module globals the single-forward manager and the
    kernel launcher call) in ``record_function`` ranges that end with a device
    synchronisation, so every kernel can be charged to the canary launch that issued it (the
    syncs only add idle time between launches, kernel durations are unchanged). Restored on
    exit."""
    import torch
    from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag
    from sglang.srt.kv_canary import plan_input as pi_mod
    from sglang.srt.kv_canary import token_history as th_mod
    from sglang.srt.kv_canary.single_forward_manager import launches as kl_mod
    from sglang.srt.kv_canary.single_forward_manager import manager as sfm_mod

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def wrap(fn, label_of):
        def wrapper(*a, **kw):
            with torch.profiler.record_function(LABEL + label_of(*a, **kw)):
                out = fn(*a, **kw)
                sync()  # the range's device work ends inside it (see attribute())
                return out
        return wrapper

    def tag_phase(**kw):
        return CanaryLaunchTag(int(kw["context"].kernel_kind)).phase.name

    patches = [
        (th_mod.TokenHistoryUploader, "upload",
         lambda *a, **k: "token-id scatter (outside graph)"),
        (sfm_mod, "launch_group_plan", lambda *a, **k: "plan kernels"),
        (kl_mod, "launch_canary_verify_kernel", lambda *a, **k: f"{tag_phase(**k)} verify"),
        (kl_mod, "launch_canary_write_kernel", lambda *a, **k: f"{tag_phase(**k)} write"),
        (kl_mod, "launch_canary_chain_writes", lambda *a, **k: "HEAD + TAIL chain write"),
        (pi_mod.PlanInput, "fill_from_forward_batch", lambda *a, **k: "plan input fill"),
        (sfm_mod.SingleForwardManager, "pre_ops_maybe_inside_graph", lambda *a, **k: "pre-ops"),
        (sfm_mod.SingleForwardManager, "post_ops_maybe_inside_graph",
         lambda *a, **k: "post-ops"),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    dh = manager.device_host
    orig_stage = dh.stage
    try:
        for obj, name, label_of in patches:
            setattr(obj, name, wrap(getattr(obj, name), label_of))
        dh.stage = wrap(orig_stage, lambda *a, **k: "D2H staging")
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        dh.stage = orig_stage


def attribute(events, *, use_cuda: bool):
    """Per label: inclusive and exclusive (minus nested labelled ranges) time per label, summed
    over all its ranges, in µs; also device time by kernel name inside canary ranges and the
    device time outside every labelled range.

    On CUDA by time: every labelled range ends with a device synchronisation (see
    :func:`labelled_launches`), so each device activity (kernel, memcpy, memset) runs inside
    the CPU time span of the range that launched it; it is charged to the innermost labelled
    range containing its start. (The profiler's correlation-based attribution misses Triton
    launches.) On the CPU: the ranges' CPU time."""
    from torch.autograd import DeviceType

    incl: dict[str, float] = {}
    excl: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    ranges = sorted(((ev.time_range.start, ev.time_range.end, ev.name[len(LABEL):])
                     for ev in events
                     if ev.device_type == DeviceType.CPU and ev.name.startswith(LABEL)),
                    key=lambda r: (r[0], -r[1]))
    if not use_cuda:
        for ev in events:
            if ev.device_type != DeviceType.CPU or not ev.name.startswith(LABEL):
                continue
            name = ev.name[len(LABEL):]
            below, todo = 0.0, list(ev.cpu_children)
            while todo:
                ch = todo.pop()
                if ch.name.startswith(LABEL):
                    below += ch.cpu_time_total
                else:
                    todo += ch.cpu_children
            incl[name] = incl.get(name, 0.0) + ev.cpu_time_total
            excl[name] = excl.get(name, 0.0) + ev.cpu_time_total - below
        return incl, excl, by_kernel, 0.0
    unattributed = 0.0
    for ev in events:
        if ev.device_type != DeviceType.CUDA or ev.name.startswith(LABEL):
            continue  # (the device-side copies of the labelled ranges carry the label's name)
        t, dur = ev.time_range.start, ev.time_range.end - ev.time_range.start
        enclosing = [r for r in ranges if r[0] <= t <= r[1]]
        if not enclosing:
            unattributed += dur
            continue
        innermost = max(enclosing, key=lambda r: r[0])
        excl[innermost[2]] = excl.get(innermost[2], 0.0) + dur
        for name in {r[2] for r in enclosing}:
            incl[name] = incl.get(name, 0.0) + dur
        if not any(r[2] == "model stand-in" for r in enclosing):
            by_kernel[ev.name] = by_kernel.get(ev.name, 0.0) + dur
    return incl, excl, by_kernel, unattributed


def run_breakdown(args) -> None:
    import torch
    from sglang.srt.kv_canary.builder import build_canary
    from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
    from sglang.srt.kv_canary.config import CanaryConfig
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    smoke = args.smoke_cpu
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("--breakdown needs a CUDA GPU (or pass --smoke-cpu for a CPU dry run)")
    device = torch.device("cpu" if smoke else "cuda")
    use_cuda = device.type == "cuda"
    configs = [c for c in parse_names(args.configs, CONFIGS, "--configs") if c != "off"]
    if not configs:
        raise SystemExit("--breakdown: --configs names no canary-on config "
                         f"(allowed: {', '.join(c for c in CONFIGS if c != 'off')})")
    bss = tuple(int(b) for b in parse_ints(args.breakdown_bs, "--breakdown-bs"))
    if smoke:
        shape = BreakdownShape(head_num=2, head_dim=8, layer_num=2, num_slots=4096, max_reqs=8,
                               max_context_len=256, ctx=64, batch_sizes=tuple(min(b, 4) for b in
                                                                              bss),
                               prefill_chunk=128, steps=2, warmup_steps=1, vocab=512)
    else:
        shape = BreakdownShape(head_num=8, head_dim=128, layer_num=28,
                               num_slots=args.max_total_tokens, max_reqs=128,
                               max_context_len=QWEN3_0_6B_CONFIG["max_position_embeddings"],
                               ctx=args.breakdown_ctx, batch_sizes=bss,
                               prefill_chunk=args.chunked_prefill_size,
                               steps=args.breakdown_steps, warmup_steps=3,
                               vocab=QWEN3_0_6B_CONFIG["vocab_size"])
    if max(shape.batch_sizes) > shape.max_reqs:
        raise SystemExit(f"--breakdown-bs: at most {shape.max_reqs} (the Engine's "
                         "max_running_requests)")
    need = max(shape.batch_sizes) * (shape.ctx + shape.warmup_steps + shape.steps + 2)
    if need > shape.num_slots:
        raise SystemExit(f"--breakdown-ctx / --max-total-tokens: {need} slots needed, the pool "
                         f"has {shape.num_slots}")
    name = torch.cuda.get_device_name() if use_cuda else "cpu (smoke)"
    unit = "GPU µs" if use_cuda else "CPU µs (smoke, meaningless)"
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if use_cuda else None
    print(f"KV-canary per-launch breakdown — {name} — {now_utc()} — context {shape.ctx}, "
          f"{shape.steps} profiled decode steps", flush=True)
    records = []
    for cname in configs:
        cfg = CONFIGS[cname]
        for bs in shape.batch_sizes:
            rec = breakdown_one(cfg, bs, shape, device, flush, name, unit, torch=torch,
                                CanaryCapacityInputs=CanaryCapacityInputs,
                                CanaryConfig=CanaryConfig, build_canary=build_canary,
                                TokenToKVPoolAllocator=TokenToKVPoolAllocator,
                                MHATokenToKVPool=MHATokenToKVPool, ReqToTokenPool=ReqToTokenPool,
                                ForwardBatch=ForwardBatch, ForwardMode=ForwardMode)
            append_jsonl(args.out, rec)
            records.append(rec)
            tot = rec["launches"]["forward-stream total (sum)"]
            graph = rec["launches"].get("CUDA-graph replay of the in-graph ops")
            print(f"[{cname} bs{bs}] forward-stream total {tot:.1f} {unit}/step"
                  + (f", graph replay {graph:.1f} µs" if graph is not None else ""), flush=True)
            gc.collect()  # the pools, the manager and the patched buf-info methods form cycles
            if use_cuda:
                torch.cuda.empty_cache()
    print()
    print(breakdown_table(records))


HOST_PHASES = ("batch init (token snapshot)", "outside pre-ops", "inside pre-ops",
               "inside post-ops", "outside post-ops + read-back")


def run_host_breakdown(args) -> None:
    """Host (CPU) time of each canary phase around one request's eager prefill, what a bs1
    time to first token pays: real pools with the Qwen3 shapes, the canary from the
    runtime's builder, a new request per prefill (chunked like the Engine), the model stood
    in for by a GPU sleep long enough that the host is never waiting for the device (so the
    phases' host time is all that is measured). ``batch init``, ``outside pre-ops`` and
    ``inside pre-ops`` run before the model's kernels are queued: their sum is what the
    forward waits for. Medians over ``--host-breakdown-runs`` prefills after two warm-ups."""
    import torch

    smoke = args.smoke_cpu
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("--host-breakdown needs a CUDA GPU (or --smoke-cpu for a dry run)")
    device = torch.device("cpu" if smoke else "cuda")
    isls = parse_ints(args.host_breakdown, "--host-breakdown")
    configs = [c for c in parse_names(args.configs, CONFIGS, "--configs") if c != "off"]
    if not configs:
        raise SystemExit("--host-breakdown: --configs names no canary-on config")
    chunk = 32 if smoke else args.chunked_prefill_size
    vocab = PREFILL_SHAPES[smoke][3]
    max_ctx = max(isls) + 8
    num_slots = max(4 * max(isls), 4096)
    runs = 2 if smoke else args.host_breakdown_runs
    name = torch.cuda.get_device_name() if not smoke else "cpu (smoke)"
    print(f"KV-canary host time per phase of a bs1 eager prefill — {name} — {now_utc()} — "
          f"chunk {chunk}, {runs} runs", flush=True)
    rows = []
    for cname in configs:
        mgr, r2t, kv = build_prefill_canary(cname, device=device, smoke=smoke,
                                            max_ctx=max_ctx, num_slots=num_slots, chunk=chunk)
        gen = torch.Generator().manual_seed(0)

        for isl in isls:
            times = {p: [] for p in HOST_PHASES}
            profiler = pre_profiler = None
            detail = None
            extra = (20 if args.host_breakdown_cprofile else 0) + (
                runs if args.host_breakdown_detail else 0)
            for run in range(-2, runs + extra):
                # two warm-ups (Triton JIT, allocator), the timed runs, then (with
                # --host-breakdown-cprofile) 20 more under cProfile, not timed, and (with
                # --host-breakdown-detail) as many again with the canary's methods timed
                if run == runs and args.host_breakdown_cprofile:
                    profiler, pre_profiler = cProfile.Profile(), cProfile.Profile()
                if (args.host_breakdown_detail
                        and run == runs + (20 if args.host_breakdown_cprofile else 0)):
                    if profiler is not None:
                        profiler = pre_profiler = None
                    detail = MethodTimers(mgr)
                row = 1 + (run % 4)
                req = _Req(row, torch.randint(100, vocab - 100, (isl,), generator=gen).tolist())
                slots = torch.randperm(num_slots - 1, generator=gen)[:isl] + 1
                r2t.req_to_token[row, :isl] = slots.to(torch.int32).to(device)
                per_run = {p: 0.0 for p in HOST_PHASES}
                for start in range(0, isl, chunk):
                    n = min(chunk, isl - start)
                    fb = prefill_chunk_batch(req, slots, start, n, device=device, r2t=r2t,
                                             kv=kv)
                    tick = time.perf_counter
                    if pre_profiler is not None:
                        pre_profiler.enable()
                    t1 = tick()
                    mgr.on_forward_batch_init(fb, [req])
                    t2 = tick()
                    with mgr.with_active_single_forward_manager(0), \
                            mgr.with_ops_outside_graph(fb):
                        t3 = tick()
                        mgr.pre_ops_maybe_inside_graph(fb)
                        t4 = tick()
                        if pre_profiler is not None:
                            pre_profiler.disable()
                        if not smoke:
                            torch.cuda._sleep(20_000_000)  # ~10 ms: the device stays busy
                        t5 = tick()
                        if profiler is not None:
                            profiler.enable()
                        mgr.post_ops_maybe_inside_graph(fb)
                        t6 = tick()
                    t7 = tick()
                    if profiler is not None:
                        profiler.disable()
                    for phase, dt in zip(HOST_PHASES, (t2 - t1, t3 - t2, t4 - t3, t6 - t5,
                                                       t7 - t6)):
                        per_run[phase] += dt * 1e6
                if not smoke:
                    torch.cuda.synchronize()
                if 0 <= run < runs:
                    for p in HOST_PHASES:
                        times[p].append(per_run[p])
            if mgr.count_violations():
                raise SystemExit(f"host breakdown {cname} isl {isl}: violations on a clean run")
            med = {p: statistics.median(v) for p, v in times.items()}
            before = sum(med[p] for p in HOST_PHASES[:3])
            rec = dict(kind="host_breakdown", time=now_utc(), gpu=name, config=cname, isl=isl,
                       chunk=chunk, runs=runs, median_us=med, before_forward_us=before)
            append_jsonl(args.out, rec)
            rows.append(rec)
            print(f"[{cname} isl {isl}] before the forward {before:.0f} µs; "
                  + "; ".join(f"{p} {med[p]:.0f}" for p in HOST_PHASES), flush=True)
            if detail is not None:
                detail.remove()
                print(f"[{cname} isl {isl}] host µs per call of the canary's methods "
                      f"(inclusive: a method's time holds its callees'), {runs} prefills:")
                print(detail.table(prefills=runs), flush=True)
                rec["methods_median_us"] = detail.medians()
                append_jsonl(args.out, dict(rec, kind="host_breakdown_detail"))
            if profiler is not None:
                print(f"[{cname} isl {isl}] cProfile of 20 prefills' batch init + outside "
                      "pre-ops + inside pre-ops (tottime, top 30):", flush=True)
                pstats.Stats(pre_profiler).sort_stats("tottime").print_stats(30)
                print(f"[{cname} isl {isl}] cProfile of 20 prefills' inside post-ops + outside "
                      "post-ops + read-back (tottime, top 30):", flush=True)
                pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        del mgr, kv, r2t
        gc.collect()
    print()
    print(host_breakdown_table(rows))


class MethodTimers:
    """Wraps the per-forward methods of a built canary (``mgr``: its ``CanaryManager``) with
    timers, on the instances (the classes are untouched; :meth:`remove` restores them): what
    each costs the host per call, for ``--host-breakdown-detail``. A wrapper adds about 0.3
    µs to each call it wraps and to every caller's figure."""

    def __init__(self, mgr):
        sfm = mgr.sfms[0]
        targets = [(mgr, "CanaryManager", ("on_forward_batch_init", "after_forward",
                                           "_on_host_copies", "_stage")),
                   (mgr.device_host, "device_host", ("fence", "stage", "_gather", "consume")),
                   (mgr.sweep, "sweep", ("maybe_run_sweep",)),
                   (sfm, "sfm", ("pre_ops_outside_graph", "pre_ops_maybe_inside_graph",
                                 "post_ops_maybe_inside_graph", "post_ops_outside_graph",
                                 "upload_tokens_before_replay", "_join"))]
        if sfm.eager_graphs is not None:
            targets.append((sfm.eager_graphs, "eager_graphs", ("stage", "run_side",
                                                                "run_tail")))
        if mgr.token_history is not None:
            targets.append((mgr.token_history, "token_history", ("stage_for_replay", "upload",
                                                                  "snapshot")))
        self.samples = {}
        self._installed = []
        for obj, label, names in targets:
            for name in names:
                self._wrap(obj, f"{label}.{name}", name)

    def _wrap(self, obj, key, name) -> None:
        inner = getattr(obj, name)
        samples = self.samples.setdefault(key, [])
        tick = time.perf_counter

        def timed(*a, **kw):
            t0 = tick()
            try:
                return inner(*a, **kw)
            finally:
                samples.append((tick() - t0) * 1e6)

        setattr(obj, name, timed)
        self._installed.append((obj, name))

    def remove(self) -> None:
        for obj, name in self._installed:
            delattr(obj, name)
        self._installed = []

    def medians(self) -> dict:
        return {k: statistics.median(v) for k, v in self.samples.items() if v}

    def table(self, *, prefills: int) -> str:
        lines = ["| method | calls per prefill | µs per call (median) |", "| --- | ---: | ---: |"]
        for k, v in self.samples.items():
            if v:
                lines.append(f"| {k} | {len(v) / prefills:.1f} | {statistics.median(v):.1f} |")
        return "\n".join(lines)


def host_breakdown_table(rows: list[dict]) -> str:
    if not rows:
        return "Host breakdown: no results"
    head = " | ".join(HOST_PHASES)
    lines = [f"Host µs per bs1 prefill (median of {rows[0]['runs']}; {rows[0]['gpu']}, "
             f"{rows[0]['time']}; chunk {rows[0]['chunk']})", "",
             f"| config | prompt | {head} | before the forward |",
             "| --- | ---: |" + " ---: |" * (len(HOST_PHASES) + 1)]
    for r in rows:
        cells = " | ".join(f"{r['median_us'][p]:.0f}" for p in HOST_PHASES)
        lines.append(f"| {r['config']} | {r['isl']} | {cells} | **{r['before_forward_us']:.0f}** |")
    return "\n".join(lines)


def parse_ints(value: str, flag: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or any(v < 1 for v in out):
        raise SystemExit(f"{flag}: expected comma-separated positive integers, got {value!r}")
    return out


def breakdown_one(cfg: BenchConfig, bs: int, shape: BreakdownShape, device, flush, gpu: str,
                  unit: str, *, torch, CanaryCapacityInputs, CanaryConfig, build_canary,
                  TokenToKVPoolAllocator, MHATokenToKVPool, ReqToTokenPool, ForwardBatch,
                  ForwardMode) -> dict:
    use_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)
    gen = torch.Generator().manual_seed(bs)
    r2t = ReqToTokenPool(size=shape.max_reqs, max_context_len=shape.max_context_len,
                         device=str(device), enable_memory_saver=False)
    kv = MHATokenToKVPool(size=shape.num_slots, page_size=1, dtype=torch.bfloat16,
                          head_num=shape.head_num, head_dim=shape.head_dim,
                          layer_num=shape.layer_num, device=str(device),
                          enable_memory_saver=False, enable_alt_stream=False)
    for layer in range(shape.layer_num if cfg.real_data_layers == "all" else 1):
        kv.k_buffer[layer].normal_()  # never hash zeros: the layers the canary reads
        kv.v_buffer[layer].normal_()
    alloc = TokenToKVPoolAllocator(shape.num_slots, torch.bfloat16, str(device), kv,
                                   need_sort=False)
    config = CanaryConfig(mode=cfg.kv_canary, real_kv_hash_mode=cfg.real_data,
                          real_data_layers=cfg.real_data_layers,
                          enable_verify_token_assert=cfg.verify_tokens,
                          stats_print_every_n_steps=0)
    # the production assembly, with the Engine's limits (max_prefill_tokens: its default)
    mgr = build_canary(pool=kv, req_to_token=r2t.req_to_token, config=config, device=device,
                       capacity_inputs=CanaryCapacityInputs(
                           context_len=shape.max_context_len,
                           chunked_prefill_size=shape.prefill_chunk, max_prefill_tokens=16384,
                           cuda_graph_max_bs=shape.max_reqs))
    mgr.mark_init_finished()

    # slots as after churn: the allocator's free list, shuffled
    free = alloc.alloc(bs * (shape.ctx + shape.warmup_steps + shape.steps + 2))
    free = free[torch.randperm(free.shape[0], generator=gen).to(free.device)].tolist()
    reqs = [_Req(r2t.free_slots.pop(0),
                 torch.randint(100, shape.vocab - 100, (shape.ctx,), generator=gen).tolist())
            for _ in range(bs)]

    def i64(v):
        return torch.tensor(v, dtype=torch.int64, device=device)

    def batch(mode, part, ids, pos, loc, pre=None, ext=None):
        seq = [p + e for p, e in zip(pre, ext)] if pre is not None else [p + 1 for p in pos]
        fb = ForwardBatch(forward_mode=mode, batch_size=len(part), input_ids=i64(ids),
                          req_pool_indices=i64([r.row for r in part]), seq_lens=i64(seq),
                          out_cache_loc=i64(loc), seq_lens_sum=sum(seq), positions=i64(pos),
                          req_to_token_pool=r2t, token_to_kv_pool=kv)
        if mode == ForwardMode.EXTEND:
            fb.extend_prefix_lens, fb.extend_seq_lens = i64(pre), i64(ext)
            fb.extend_num_tokens = len(ids)
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = list(pre), list(ext)
        mgr.on_forward_batch_init(fb, part)  # what the ForwardBatch.init_new hook does
        return fb

    def model_stand_in():
        if flush is not None:
            with torch.profiler.record_function(LABEL + "model stand-in"):
                flush.zero_()
                torch.cuda.synchronize()

    def forward(fb):
        with mgr.with_active_single_forward_manager(0), mgr.with_ops_outside_graph(fb):
            mgr.pre_ops_maybe_inside_graph(fb)
            model_stand_in()  # the KV of the new tokens is already random
            mgr.post_ops_maybe_inside_graph(fb)
        model_stand_in()

    # prefill through the canary, in chunks of at most prefill_chunk tokens per forward
    per_fwd = max(1, shape.prefill_chunk // shape.ctx)
    for start in range(0, bs, per_fwd):
        part = reqs[start:start + per_fwd]
        ids, pos, loc = [], [], []
        for r in part:
            r.slots = [free.pop() for _ in range(shape.ctx)]
            r2t.req_to_token[r.row, :shape.ctx] = torch.tensor(r.slots, dtype=torch.int32)
            ids += r.origin_input_ids
            pos += list(range(shape.ctx))
            loc += r.slots
        forward(batch(ForwardMode.EXTEND, part, ids, pos, loc, pre=[0] * len(part),
                      ext=[shape.ctx] * len(part)))

    def decode_batch():
        ids, pos, loc = [], [], []
        for r in reqs:
            tok = int(torch.randint(100, shape.vocab - 100, (1,), generator=gen))
            r.output_ids.append(tok)
            p = r.length - 1
            slot = free.pop()
            r2t.req_to_token[r.row, p] = slot
            r.slots.append(slot)
            ids.append(tok)
            pos.append(p)
            loc.append(slot)
        return batch(ForwardMode.DECODE, reqs, ids, pos, loc)

    for _ in range(shape.warmup_steps):  # compiles the Triton kernels
        forward(decode_batch())
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if use_cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    fbs = [decode_batch() for _ in range(shape.steps)]  # host-side batch building unprofiled
    with labelled_launches(mgr), torch.profiler.profile(activities=acts) as prof:
        for fb in fbs:
            forward(fb)
        sync()
    incl, excl, by_kernel, unattributed = attribute(prof.events(), use_cuda=use_cuda)
    n = shape.steps
    launches = {
        "plan input fill": incl.get("plan input fill", 0.0) / n,
        "plan kernels": incl.get("plan kernels", 0.0) / n,
        "HEAD verify": incl.get("HEAD verify", 0.0) / n,
        # a group's HEAD writes and TAIL chain part: one launch (launch_canary_chain_writes)
        "HEAD + TAIL chain write": incl.get("HEAD + TAIL chain write", 0.0) / n,
        "TAIL verify": incl.get("TAIL verify", 0.0) / n,
        "TAIL fingerprint write": incl.get("TAIL write", 0.0) / n,
        "status copy + rest of post-ops": excl.get("post-ops", 0.0) / n,
        "rest of pre-ops": excl.get("pre-ops", 0.0) / n,
    }
    if cfg.verify_tokens:
        launches = {"token-id scatter (outside graph)":
                    incl.get("token-id scatter (outside graph)", 0.0) / n, **launches}
    launches["forward-stream total (sum)"] = sum(launches.values())
    launches["D2H staging (side stream, copy engine)"] = incl.get("D2H staging", 0.0) / n
    if use_cuda:
        launches["unattributed device time"] = unattributed / n
        launches["CUDA-graph replay of the in-graph ops"] = graph_replay_us(
            mgr, decode_batch(), bs, device, torch=torch, ForwardBatch=ForwardBatch,
            ForwardMode=ForwardMode, reqs=reqs, r2t=r2t, kv=kv)
    sync()
    violations = int(mgr.state.violation_log.violation_write_index[0])
    if violations:
        raise SystemExit(f"breakdown {cfg.name} bs{bs}: {violations} canary violations on a "
                         "clean workload")
    rec = dict(kind="breakdown", time=now_utc(), gpu=gpu, unit=unit, config=cfg.name, bs=bs,
               ctx=shape.ctx, steps=n, shape=dataclasses.asdict(shape), launches=launches,
               by_kernel={k: v / n for k, v in by_kernel.items()},
               capacities=dataclasses.asdict(mgr.capacities))
    return rec


def graph_replay_us(mgr, fb, bs, device, *, torch, ForwardBatch, ForwardMode,
                    reqs, r2t, kv) -> float:
    """Capture one decode step's in-graph canary ops (plan, HEAD, TAIL, status copy) into a
    CUDA graph as sglang's decode graphs hold them, run it once as the runtime does (outside
    ops + replay), then time replays (idempotent: same records rewritten, same prefix
    verified) with ``do_bench`` (L2 flushed before each)."""
    import triton

    def z():
        return torch.zeros(bs, dtype=torch.int64, device=device)

    static = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=z(),
                          req_pool_indices=z(), seq_lens=z(), out_cache_loc=z(),
                          seq_lens_sum=fb.seq_lens_sum, positions=z(), req_to_token_pool=r2t,
                          token_to_kv_pool=kv)
    for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
        getattr(static, name).copy_(getattr(fb, name))
    mgr.on_forward_batch_init(static, reqs)

    def body():
        mgr.pre_ops_maybe_inside_graph(static)
        mgr.post_ops_maybe_inside_graph(static)

    with mgr.with_active_single_forward_manager(0), mgr.capturing():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
    torch.cuda.synchronize()
    with mgr.with_active_single_forward_manager(0), mgr.with_ops_outside_graph(static):
        mgr.before_graph_replay()
        graph.replay()
        mgr.mark_replayed_inside_graph()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return ms * 1e3


# ---- CLI -------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, from: {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--scenarios",
                    help=f"comma-separated, from: {', '.join(SCENARIOS)} (default: "
                    f"{', '.join(DEFAULT_SCENARIOS['none'])}; with --speculative eagle: "
                    f"{', '.join(DEFAULT_SCENARIOS['eagle'])})")
    ap.add_argument("--speculative", default="none", choices=sorted(SPECULATIVE),
                    help="eagle: every Engine serves with EAGLE speculative decoding (a "
                    "one-layer draft of the same shapes, 3 steps, topk 1, 4 draft tokens; "
                    "decode graphs for bs 1 and 32), canary on both pools when on")
    ap.add_argument("--piecewise", default="on", choices=("on", "off"),
                    help="sglang's piecewise CUDA graphs for prefill, for every config (default "
                    "on, sglang's default; results before 2026-11-24 ran with them off)")
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS),
                    help="the dummy-weight model's shapes (default qwen3-0.6b; qwen3-30b-a3b: "
                    "the upstream-shaped MoE rows, one H200)")
    ap.add_argument("--server-timing", default="on", choices=("on", "off"),
                    help="sglang's request metrics on for every config, and the scheduler's "
                    "own prefill time per run from meta_info (default on)")
    ap.add_argument("--cuda-graph-bs", help="decode CUDA-graph batch sizes, comma-separated "
                    "(default 1,128; 1,32 with --speculative eagle)")
    ap.add_argument("--runs", type=int, help="timed runs per scenario (default 5; 2 with "
                    "--smoke-cpu)")
    ap.add_argument("--out", help="append results as JSON lines to this file (Engine logs go "
                    "to <out>.<config>.log)")
    ap.add_argument("--report", nargs="+", metavar="JSONL",
                    help="print the markdown report of these JSON lines files and exit")
    ap.add_argument("--breakdown", action="store_true",
                    help="per-launch canary GPU time per decode step (in-process, no Engine)")
    ap.add_argument("--breakdown-bs", default="1,128", help="decode batch sizes (default 1,128)")
    ap.add_argument("--breakdown-ctx", type=int, default=1024,
                    help="context per request before the profiled decode steps (default 1024)")
    ap.add_argument("--breakdown-steps", type=int, default=20,
                    help="profiled decode steps (default 20)")
    ap.add_argument("--host-breakdown", metavar="ISL[,ISL...]",
                    help="host time of each canary phase of a one-request eager prefill of "
                    "each prompt length (in-process, no Engine; --configs picks the configs)")
    ap.add_argument("--host-breakdown-runs", type=int, default=30,
                    help="prefills per prompt length and config (default 30)")
    ap.add_argument("--host-breakdown-cprofile", action="store_true",
                    help="with --host-breakdown: 20 more prefills per row under cProfile (not "
                    "timed) and the top 30 functions by own time, before the forward and after")
    ap.add_argument("--host-breakdown-detail", action="store_true",
                    help="with --host-breakdown: as many prefills again with the canary's "
                    "per-forward methods timed one by one (µs per call, inclusive)")
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="tiny CPU dry run (sglang CPU server / CPU pools); numbers meaningless")
    ap.add_argument("--chunked-prefill-size", type=int, default=EngineSettings.chunked_prefill_size)
    ap.add_argument("--max-total-tokens", type=int, default=EngineSettings.max_total_tokens)
    ap.add_argument("--mem-fraction-static", type=float,
                    default=EngineSettings.mem_fraction_static)
    ap.add_argument("--child-timeout", type=float, default=540,
                    help="seconds one config's Engine process may take (default 540)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                    help="after the timed runs, profile STEPS forwards of one more run of the "
                    "last scenario (sglang's torch profiler, Python stacks) and print the "
                    "scheduler's host time per canary function and CUDA runtime call")
    ap.add_argument("--_engine-child", dest="engine_child", help=argparse.SUPPRESS)
    ap.add_argument("--_invocation", dest="invocation", help=argparse.SUPPRESS)
    ap.add_argument("--_gpu", dest="gpu", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.runs is None:
        args.runs = 2 if args.smoke_cpu else 5
    for flag, value, minimum in (("--runs", args.runs, 1),
                                 ("--breakdown-ctx", args.breakdown_ctx, 2),
                                 ("--breakdown-steps", args.breakdown_steps, 1),
                                 ("--chunked-prefill-size", args.chunked_prefill_size, 1),
                                 ("--max-total-tokens", args.max_total_tokens, 1)):
        if value < minimum:
            ap.error(f"{flag} must be >= {minimum}, got {value}")
    if args.scenarios is None:
        args.scenarios = ",".join(DEFAULT_SCENARIOS[args.speculative])
    if args.speculative != "none" and args.smoke_cpu:
        ap.error("--speculative eagle cannot run with --smoke-cpu: sglang 0.5.12's CPU engine "
                 "cannot serve EAGLE (docs/user_guide.md, \"Speculative decoding\")")
    if not 0 < args.mem_fraction_static < 1:
        ap.error(f"--mem-fraction-static must be in (0, 1), got {args.mem_fraction_static}")
    if args.engine_child is not None and args.engine_child not in CONFIGS:
        ap.error(f"--_engine-child: unknown config {args.engine_child!r}; allowed: "
                 f"{', '.join(CONFIGS)}")
    args.settings = EngineSettings(chunked_prefill_size=args.chunked_prefill_size,
                                   max_total_tokens=args.max_total_tokens,
                                   mem_fraction_static=args.mem_fraction_static,
                                   speculative=args.speculative,
                                   piecewise=args.piecewise == "on",
                                   model=args.model, server_timing=args.server_timing == "on",
                                   cuda_graph_bs=(tuple(parse_ints(args.cuda_graph_bs,
                                                                   "--cuda-graph-bs"))
                                                  if args.cuda_graph_bs else
                                                  (1, 32) if args.speculative != "none"
                                                  else EngineSettings.cuda_graph_bs))
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
