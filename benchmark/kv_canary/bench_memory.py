#!/usr/bin/env python3
"""The canary's memory on one GPU (docs/user_guide.md, "Memory"): per configuration, a server
with the canary off and on at the same ``--mem-fraction-static``: the canary's bytes by part
(``/server_info``), the pool's tokens (``max_total_num_tokens``) and the GPU's memory in use,
idle after start-up and at its peak while a workload fills the pool; then a server started at a
fraction that leaves under 1 GiB of the GPU free, with token checks on, filling its pool with
long prompts (its first fraction estimated from the GPU's size, one more try from what that
server left free); when it fails (or with ``--control``), the canary-off server at the same
fraction as its control, which says whose memory ran out. ``--only-tight``: the tight servers
alone (GPU lane ``memory_gpu_tight``).

One server at a time, alone on the GPU: the memory figures are the GPU's (``cudaMemGetInfo``,
sampled every 20 ms by the Engine's process, whose own CUDA context is the same for every
config). The model: the Qwen3-0.6B shape with dummy weights (``common.MODELS``); sglang's
defaults otherwise, but no piecewise graphs and decode graphs up to bs 8 (a faster start-up; the
canary's graph buffers do not depend on them).

Run it on the device (bundles as in ``bench_serving_overhead.py``)::

    python benchmark/kv_canary/bench_memory.py --out $OUT/memory.jsonl

``--smoke-cpu``: the tiny CPU server, two configs, no GPU figures (the script's own check).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Dict, List, Optional, Sequence

from common import MODELS, append_jsonl, gpu_name, now_utc

GIB = 1 << 30
TOKEN_ENV = "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT"
V_ENV = "SGLANG_KV_CANARY_ENABLE_MHA_V"
RESULT = "MEMORY "

# name -> (engine kwargs, environment)
CONFIGS: Dict[str, tuple] = {
    "off": (dict(kv_canary="none"), {}),
    "raise": (dict(kv_canary="raise"), {}),
    "raise+partial+layers": (
        dict(kv_canary="raise", kv_canary_real_data="partial", kv_canary_real_data_layers="all"),
        {},
    ),
    "raise+token": (dict(kv_canary="raise"), {TOKEN_ENV: "1"}),
    "everything": (
        dict(
            kv_canary="raise",
            kv_canary_real_data="partial",
            kv_canary_real_data_layers="all",
            kv_canary_sweep_interval=8,
        ),
        {TOKEN_ENV: "1", V_ENV: "1"},
    ),
}
TIGHT_CONFIG = "raise+token"
TIGHT_FREE = 0.6 * GIB  # what the tight server aims to leave free
TIGHT_LIMIT = 1 * GIB  # and must leave less than
# what a server holds after start-up outside its --mem-fraction-static share at a tight
# fraction (CUDA contexts, graphs, sglang's buffers): 0.86-0.93 GiB measured on an H100 and
# 0.88-0.90 GiB on an H200 (benchmark/results/memory.md); the tight server's first fraction
# aims from it, and one more try corrects what it missed
OUTSIDE_STATIC = 0.9 * GIB
# the tight servers' workload: so few, long prompts that at most this many requests decode at
# once, whatever the pool's size. sglang's own memory outside the pool grows with the running
# batch (the logits of a decode step, float32 [requests, vocabulary]: 0.58 MiB a request for
# this model), so with short prompts a larger GPU's larger pool runs more requests at once and
# needs more free memory than 1 GiB, with the canary off too (benchmark/results/memory.md)
TIGHT_CONCURRENCY = 32
SHORT_ISL = 4000  # the other servers' prompts (and --tight-isl's historical value)
OSL = 32


class GpuSampler:
    """The GPU's memory in use (total - free), sampled every ``period`` s in a thread."""

    def __init__(self, period: float = 0.02):
        import torch

        self._torch = torch
        self.total = torch.cuda.mem_get_info()[1]
        self.peak = 0
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def used(self) -> int:
        free, total = self._torch.cuda.mem_get_info()
        return total - free

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(self._period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.used())


def fill_requests(tokens: int, *, isl: int, osl: int, vocab: int, seed: int) -> List[list]:
    """Prompts whose prompt and output tokens together exceed the pool (``tokens``) by 10 %."""
    rng = random.Random(seed)
    n = max(1, math.ceil(1.1 * tokens / (isl + osl)))
    return [[rng.randrange(3, vocab - 1) for _ in range(isl)] for _ in range(n)]


def tight_isl(tokens: int, context_len: int, osl: int = OSL) -> int:
    """Prompt tokens of the tight servers' requests: 110 % of a ``tokens`` pool in requests of
    which at most :data:`TIGHT_CONCURRENCY` fit in it at once, within the context length
    (sglang gives a request at most ``context_len - 1`` tokens in all)."""
    cap = context_len - 1 - osl
    return max(min(SHORT_ISL, cap), min(cap, math.ceil(tokens / TIGHT_CONCURRENCY) - osl))


def first_tight_fraction(gpu_total: int) -> float:
    """The tight server's first ``--mem-fraction-static``: the one that leaves
    :data:`TIGHT_FREE` of a ``gpu_total``-byte GPU free, if the server holds
    :data:`OUTSIDE_STATIC` outside its static share."""
    return round(1 - (TIGHT_FREE + OUTSIDE_STATIC) / gpu_total, 4)


def next_tight_fraction(fraction: float, free: int, gpu_total: int) -> float:
    """The fraction to try after a server at ``fraction`` left ``free`` bytes free (the pool
    grows with the fraction, sglang's other buffers a little)."""
    return round(fraction + (free - TIGHT_FREE) / gpu_total, 4)


def child(args) -> None:
    import sglang

    kwargs, _ = CONFIGS[args.child]
    with tempfile.TemporaryDirectory(prefix="kv_canary_mem_model_") as tmp:
        if args.smoke_cpu:
            from sglang.srt.kv_canary.demo.server_harness import (
                TINY_LLAMA_CONFIG,
                cpu_engine_kwargs,
                write_tiny_llama,
            )

            model_dir, vocab = write_tiny_llama(tmp), TINY_LLAMA_CONFIG["vocab_size"]
            engine_kwargs = cpu_engine_kwargs(
                model_dir, max_total_tokens=2048, log_level="info", **kwargs
            )
            sampler = None
        else:
            model = MODELS["qwen3-0.6b"]
            pathlib.Path(tmp, "config.json").write_text(json.dumps(model))
            model_dir, vocab = tmp, model["vocab_size"]
            sampler = GpuSampler()
            if args.fraction is None:  # the tight server's first: from this GPU's size
                args.fraction = first_tight_fraction(sampler.total)
            engine_kwargs = dict(
                model_path=model_dir,
                load_format="dummy",
                skip_tokenizer_init=True,
                mem_fraction_static=args.fraction,
                attention_backend="triton",
                disable_piecewise_cuda_graph=True,
                cuda_graph_max_bs=8,
                log_level="info",
                random_seed=0,
                **kwargs,
            )
        t0 = time.perf_counter()
        engine = sglang.Engine(**engine_kwargs)
        startup_s = time.perf_counter() - t0
        info = engine.get_server_info()
        tokens = int(info["max_total_num_tokens"])
        idle = sampler.used() if sampler is not None else None
        isl, osl = (SHORT_ISL, OSL) if sampler is not None else (200, 8)
        if args.tight_isl is not None:
            isl = args.tight_isl
        elif args.tight and sampler is not None:
            isl = tight_isl(tokens, MODELS["qwen3-0.6b"]["max_position_embeddings"])
        prompts = fill_requests(tokens, isl=isl, osl=osl, vocab=vocab, seed=1)
        t0 = time.perf_counter()
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": osl, "temperature": 0, "ignore_eos": True},
        )
        fill_s = time.perf_counter() - t0
        served = sum(1 for o in outs if len(o["output_ids"]) == osl)
        peak = sampler.stop() if sampler is not None else None
        engine.shutdown()
    print(
        RESULT
        + json.dumps(
            dict(
                config=args.child,
                fraction=args.fraction,
                max_total_num_tokens=tokens,
                kv_canary_memory=info.get("kv_canary", {}).get("memory"),
                gpu_total=sampler.total if sampler is not None else None,
                gpu_used_idle=idle,
                gpu_used_peak=peak,
                requests=len(prompts),
                served=served,
                prompt_tokens=isl,
                output_tokens=osl,
                startup_s=startup_s,
                fill_s=fill_s,
            )
        ),
        flush=True,
    )


def run_child(
    args,
    name: str,
    fraction: Optional[float],
    log_path: str,
    stub_dir: Optional[str],
    tight: bool,
) -> Optional[dict]:
    """One server in a child process; ``fraction`` None: the tight server's first, its fraction
    chosen by the child from the GPU's size. Its record, or None when it failed."""
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    env.pop(V_ENV, None)
    if args.smoke_cpu:
        from sglang.srt.kv_canary.demo.server_harness import cpu_server_env

        env = cpu_server_env(stub_dir, env)
    env.update(CONFIGS[name][1])
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_child",
        name,
        "--_fraction",
        "auto" if fraction is None else str(fraction),
    ] + (["--smoke-cpu"] if args.smoke_cpu else [])
    if tight:
        cmd.append("--_tight")
        if args.tight_isl is not None:
            cmd += ["--tight-isl", str(args.tight_isl)]
    with open(log_path, "w") as log:
        proc = subprocess.run(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=args.child_timeout,
        )
        log.write(proc.stdout)
    found = [json.loads(x[len(RESULT) :]) for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode != 0 or not found:
        print(
            f"[{name} @ {_fraction(fraction)}] exited {proc.returncode}; last lines of {log_path}:\n"
            + "\n".join(proc.stdout.splitlines()[-40:]),
            flush=True,
        )
        return None
    return found[0]


def _fraction(fraction: Optional[float]) -> str:
    return "(from the GPU's size)" if fraction is None else f"{fraction:.4f}"


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / (1 << 20):,.0f}"


def _role(r: dict) -> str:
    return " (tight control)" if r.get("control") else " (tight)" if r.get("tight") else ""


def table(records: Sequence[dict]) -> str:
    off = next((r for r in records if r["config"] == "off" and not _role(r)), None)
    rows = [
        "| config | fraction | canary device MiB (by part) | host MiB | pool tokens | vs off "
        "| GPU used idle MiB | GPU peak MiB | peak vs off | served |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        mem = (r.get("kv_canary_memory") or {}).get("target", {}).get("allocated")
        parts = (
            ", ".join(f"{k} {v / (1 << 20):.1f}" for k, v in mem["device"].items()) if mem else ""
        )
        dev = _mib(mem["device_bytes"]) if mem else "0"
        host = _mib(mem["host_bytes"]) if mem else "0"
        vs = peak_vs = ""
        if off is not None and r is not off and not _role(r):
            vs = f"{r['max_total_num_tokens'] / off['max_total_num_tokens'] - 1:+.3%}"
            if r["gpu_used_peak"] is not None:
                peak_vs = f"{r['gpu_used_peak'] / off['gpu_used_peak'] - 1:+.3%}"
        rows.append(
            f"| {r['config']}{_role(r)} | {r['fraction']:.4f} "
            f"| {dev} ({parts}) | {host} | {r['max_total_num_tokens']:,} | {vs} "
            f"| {_mib(r['gpu_used_idle'])} | {_mib(r['gpu_used_peak'])} | {peak_vs} "
            f"| {r['served']}/{r['requests']} |"
        )
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, from: {', '.join(CONFIGS)} (off first)",
    )
    ap.add_argument(
        "--fraction",
        type=float,
        default=0.5,
        help="--mem-fraction-static of every server but the tight one",
    )
    ap.add_argument("--no-tight", action="store_true", help="skip the tight servers")
    ap.add_argument(
        "--only-tight",
        action="store_true",
        help="only the tight servers (no servers at --fraction; --configs must be 'off')",
    )
    ap.add_argument(
        "--tight-fraction",
        type=float,
        help="start the tight server at this --mem-fraction-static (not from the GPU's size; "
        "no second try)",
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help="also run the canary-off control at the tight server's fraction when the tight "
        "server served its workload (it always runs when the tight server did not)",
    )
    ap.add_argument(
        "--tight-isl",
        type=int,
        help="prompt tokens of the tight servers' requests (default: from the pool, so that "
        f"at most {TIGHT_CONCURRENCY} decode at once; {SHORT_ISL} reproduces the workload "
        "whose decode batch grows with the GPU)",
    )
    ap.add_argument("--out", help="JSON lines file (one record per server)")
    ap.add_argument("--child-timeout", type=float, default=900)
    ap.add_argument("--smoke-cpu", action="store_true")
    ap.add_argument("--_child", dest="child", help=argparse.SUPPRESS)
    ap.add_argument(
        "--_fraction",
        dest="child_fraction",
        type=lambda v: None if v == "auto" else float(v),
        help=argparse.SUPPRESS,
    )
    ap.add_argument("--_tight", dest="tight", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.fraction = args.child_fraction
        child(args)
        return 0
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names or names[0] != "off":
        ap.error(
            f"--configs: {', '.join(bad) or args.configs!r}: give 'off' first, then any of "
            f"{', '.join(CONFIGS)}"
        )
    if args.tight_isl is not None and not 1 <= args.tight_isl <= 40000:
        ap.error(f"--tight-isl {args.tight_isl}: give 1 to 40000 prompt tokens")
    if args.tight_fraction is not None and not 0 < args.tight_fraction < 1:
        ap.error(f"--tight-fraction {args.tight_fraction}: give a fraction in (0, 1)")
    if args.only_tight and (args.no_tight or args.smoke_cpu or names != ["off"]):
        ap.error(
            "--only-tight: runs the tight servers alone; give it without --no-tight and "
            "--smoke-cpu, with --configs off (the default names every config)"
        )
    if args.smoke_cpu:
        args.fraction = 0.3
    invocation, gpu = uuid.uuid4().hex[:12], gpu_name(args.smoke_cpu)
    tmp = tempfile.mkdtemp(prefix="kv_canary_mem_")
    out = os.path.abspath(args.out or os.path.join(tmp, "memory.jsonl"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    stub_dir = None
    if args.smoke_cpu:
        from sglang.srt.kv_canary.demo.server_harness import build_libcuda_stub

        stub_dir = build_libcuda_stub(os.path.join(tmp, "stub"))
    print(
        f"KV-canary memory — {gpu} — {now_utc()} — configs {', '.join(names)} — "
        f"--mem-fraction-static {args.fraction} — results to {out}",
        flush=True,
    )
    records, failed = [], []
    # (config, fraction, role): role "" a server at --fraction, "tight" the tight canary
    # server, "control" the canary-off server at the tight one's final fraction (when the
    # tight one failed, or --control); a fraction None: the tight one's first (from the GPU)
    plan = [] if args.only_tight else [(n, args.fraction, "") for n in names]
    if not (args.no_tight or args.smoke_cpu):
        plan.append((TIGHT_CONFIG, args.tight_fraction, "tight"))
    # tight servers started again when the last left TIGHT_LIMIT or more free
    tries = 0 if args.tight_fraction is not None else 1
    crashed = set()  # the roles of the servers that exited
    while plan:
        name, fraction, role = plan.pop(0)
        rec = run_child(
            args,
            name,
            fraction,
            f"{out}.{name.replace('+', '_')}{'_' + role if role else ''}.log",
            stub_dir,
            tight=bool(role),
        )
        if rec is None:
            crashed.add(role)
            failed.append(f"{name}{' ' + role if role else ''} @ {_fraction(fraction)} (exited)")
        else:
            rec.update(
                kind="memory",
                invocation=invocation,
                gpu=gpu,
                time=now_utc(),
                tight=role == "tight",
                control=role == "control",
                smoke=args.smoke_cpu,
            )
            records.append(rec)
            append_jsonl(out, rec)
            print(
                f"[{name}{' ' + role if role else ''}] {rec['max_total_num_tokens']:,} tokens, "
                f"idle {_mib(rec['gpu_used_idle'])} MiB, peak {_mib(rec['gpu_used_peak'])} MiB, "
                f"served {rec['served']}/{rec['requests']} of {rec['prompt_tokens']}+"
                f"{rec['output_tokens']} tokens",
                flush=True,
            )
        if role != "tight":
            continue
        fraction = fraction if rec is None else rec["fraction"]
        if rec is not None and tries and rec["gpu_total"] - rec["gpu_used_idle"] >= TIGHT_LIMIT:
            tries -= 1
            free = rec["gpu_total"] - rec["gpu_used_idle"]
            plan.append((TIGHT_CONFIG, next_tight_fraction(fraction, free, rec["gpu_total"]), role))
        elif args.control or rec is None or rec["served"] != rec["requests"]:
            plan.append(("off", fraction, "control"))
    print()
    print(table(records))
    tight = [r for r in records if r.get("tight")]
    if tight:
        r = tight[-1]
        free = r["gpu_total"] - r["gpu_used_idle"]
        print(
            f"\ntight: {TIGHT_CONFIG} at --mem-fraction-static {r['fraction']}: "
            f"{free / GIB:.2f} GiB free after start-up, served {r['served']}/{r['requests']} "
            f"requests of {r['prompt_tokens']}+{r['output_tokens']} tokens "
            f"({r['max_total_num_tokens']:,}-token pool)"
        )
        if free >= TIGHT_LIMIT:
            failed.append(f"tight (left {free / GIB:.2f} GiB free)")
    if "tight" in crashed and "control" in crashed:
        failed.append(
            "the canary-off control at the same fraction exited too: what ran out is sglang's "
            "own memory outside the pool, not the canary's (see both logs)"
        )
    failed += [
        f"{r['config']} (served {r['served']} of {r['requests']})"
        for r in records
        if r["served"] != r["requests"]
    ]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
