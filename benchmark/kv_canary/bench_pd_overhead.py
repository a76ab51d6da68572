#!/usr/bin/env python3
"""Paired, interleaved overhead of the KV-canary on prefill/decode disaggregation
(docs/user_guide.md, "Deployments"; the method of ``bench_interleaved.py``): one PD pair
(prefill and decode server, ``pd_one_gpu.py``'s tiny Llama with seeded random weights and
transfer engine) per config of ``common.CONFIGS``, plus an A/A twin of the baseline's pair, all
up at once on one GPU. Round k sends one prompt (new each round: no prefix is cached) to every
pair, in the order ``interleaved_rounds.round_order`` gives, twice: one new token (the wall
time of that request is the pair's time to first token: prefill, transfer and the decode
server's first token) and ``--osl`` tokens (from the decode server's ``meta_info``, with
``--enable-metrics`` on every server: its time from receipt to first token and its decode time,
sglang's ``decode_throughput``; ``round_figures``). A config's overhead is the median over the rounds of its time
divided by the baseline's in the same round, minus one, with a bootstrap 95 % interval; the
twin's is the run's resolution (an overhead is claimed only where it lies within +-0.3 %).

    python benchmark/kv_canary/bench_pd_overhead.py --configs off,raise,raise+token+partial \\
        --rounds 30 --out $OUT/pd_overhead.jsonl

Servers start together; server i (of 2 per pair) gets ``--mem-fraction-static`` (i + 1) x
``--gpu-share`` (``interleaved_servers.memory_fractions``: sglang sizes each as if alone on the
GPU) and ``--max-total-tokens``; every scheduler spins when idle (sglang's default; see
``bench_interleaved.py`` on sleeping schedulers). The last line printed is ``PD_OVERHEAD_RESULT {json}``;
``--dry-run`` writes the model and prints each server's command line and canary variables,
starting nothing. Logs: ``--log-dir`` (default ``$OUT/pd_overhead_logs``, else a temporary
folder). Bundles: ``test/device_bundle_pd.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import CONFIGS, append_jsonl, now_utc, parse_names  # noqa: E402
from interleaved_rounds import paired_overhead, round_order, server_decode_ms  # noqa: E402
from interleaved_servers import CONTROL_SUFFIX, memory_fractions, server_config  # noqa: E402
from pd_processes import PdProcesses, log_dir_for, write_random_llama_weights  # noqa: E402
from pd_requests import make_prompts, pd_request  # noqa: E402

from sglang.srt.kv_canary.demo.pd_pair import PdRole, pair_env, role_flags  # noqa: E402

A_A_LIMIT = 0.003  # an overhead is claimed only where the A/A twin lies within this
METRICS = ("ttft", "ttft_server", "decode")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs",
        default="off,raise,raise+token+partial",
        help="the first is the baseline (default off,raise,raise+token+partial)",
    )
    p.add_argument("--no-control", action="store_true", help="no A/A twin of the baseline")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="rounds first, not recorded")
    p.add_argument("--isl", type=int, default=512, help="prompt tokens")
    p.add_argument("--osl", type=int, default=64, help="output tokens of the decode request")
    p.add_argument("--backend", choices=["mooncake", "nixl"], default="mooncake")
    p.add_argument("--gpu-share", type=float, default=None, help="default 0.8 / servers")
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--start-timeout", type=float, default=420.0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--out", default=None, help="append the records (JSON lines) here")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.isl < 2 or args.osl < 2:
        p.error("--rounds >= 1, --warmup >= 0, --isl >= 2 and --osl >= 2 are required")
    for kv in args.env:
        if "=" not in kv:
            p.error(f"--env wants KEY=VALUE, got {kv!r}")
    # what PdProcesses.start_server reads
    args.cpu, args.weights, args.mem_fraction_static = False, "random", None
    return args


def pair_names(args) -> list[str]:
    """The pairs of the run: the configs, then the baseline's twin (unless --no-control)."""
    names = parse_names(args.configs, CONFIGS, "--configs")
    return names + ([] if args.no_control else [names[0] + CONTROL_SUFFIX])


def round_figures(ttft_ms: float, full: dict) -> dict[str, float | None]:
    """One pair's figures of one round, ms: ``ttft`` the client's wall time of the one-token
    request; of the ``--osl`` request (``pd_request``'s answer, the decode server's
    ``meta_info``, which ``--enable-metrics`` fills): ``decode`` first token to finish
    (``server_decode_ms``) and ``ttft_server`` the decode server's receipt to first token
    (``e2e_latency`` less that), both None where sglang gave no such figures."""
    decode = server_decode_ms([full])
    e2e = full.get("meta_info", {}).get("e2e_latency")
    server_ttft = e2e * 1e3 - decode if decode is not None and e2e else None
    return {"ttft": ttft_ms, "ttft_server": server_ttft, "decode": decode}


def canary_flags(name: str) -> list[str]:
    """The canary's server flags of a pair's config (the same on both servers)."""
    flags = []
    for key, value in server_config(name).engine_kwargs().items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def overheads(times: dict[str, list], baseline: str) -> dict[str, dict]:
    """Per pair and metric: the paired overhead against ``baseline`` (median, 95 % interval),
    or None where a round lacks a figure."""
    out = {}
    for name in times:
        if name == baseline:
            continue
        out[name] = {}
        for metric in METRICS:
            on, off = times[name][metric], times[baseline][metric]
            if None in on or None in off:
                out[name][metric] = None
                continue
            med, lo, hi = paired_overhead(on, off)
            out[name][metric] = {"median": med, "lo": lo, "hi": hi}
    return out


def table(result: dict, baseline: str, control: str | None) -> str:
    def cell(o):
        if o is None:
            return "-"
        return f"{100 * o['median']:+.2f} % [{100 * o['lo']:+.2f}, {100 * o['hi']:+.2f}]"

    aa = result.get(control) if control else None
    resolved = aa is not None and all(
        aa[m] is not None and max(abs(aa[m]["lo"]), abs(aa[m]["hi"])) <= A_A_LIMIT for m in METRICS
    )
    lines = [
        f"PD overhead against {baseline} (median [95 %]); A/A twin "
        + ("within" if resolved else "NOT within")
        + f" +-{100 * A_A_LIMIT:.1f} %",
        "| pair | time to first token (client) | time to first token (decode server) | decode |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {n} | {cell(o['ttft'])} | {cell(o['ttft_server'])} | {cell(o['decode'])} |"
        for n, o in result.items()
    ]
    return "\n".join(lines)


class PdPairs(PdProcesses):
    def main(self) -> int:
        from sglang.srt.kv_canary.demo.server_process import http_call
        from sglang.srt.kv_canary.demo.server_harness import (
            TINY_LLAMA_CONFIG,
            free_port,
            write_tiny_llama,
        )

        a = self.args
        names = pair_names(a)
        share = a.gpu_share if a.gpu_share is not None else 0.8 / (2 * len(names))
        fractions = memory_fractions(2 * len(names), share)
        model_dir = write_tiny_llama(self.log_dir / "model")
        write_random_llama_weights(model_dir, TINY_LLAMA_CONFIG, a.seed)
        base_env = pair_env(dict(os.environ))
        for kv in a.env:
            k, v = kv.split("=", 1)
            base_env[k] = v
        pairs = {}
        for i, name in enumerate(names):
            env = {**base_env, **server_config(name).env()}
            flags = canary_flags(name)
            boot = free_port()
            prefill, decode = (
                self.start_server(
                    f"{name}.{role.value}",
                    model_dir,
                    free_port(),
                    [*role_flags(role, a.backend, boot), *flags],
                    env,
                    "warning",
                    mem_fraction=fractions[2 * i + j],
                    sleep_on_idle=False,  # spinning schedulers (bench_interleaved.py: --idle)
                    enable_metrics=True,  # meta_info's timing (round_figures)
                )
                for j, role in enumerate((PdRole.PREFILL, PdRole.DECODE))
            )
            pairs[name] = (prefill, decode, boot)
        if a.dry_run:
            return 0
        t0 = time.monotonic()
        for prefill, decode, _ in pairs.values():
            for s in (prefill, decode):
                s.wait_ready(max(1.0, a.start_timeout - (time.monotonic() - t0)))
        self.result["start_s"] = round(time.monotonic() - t0, 1)
        vocab = TINY_LLAMA_CONFIG["vocab_size"]
        prompts = make_prompts(a.warmup + a.rounds, a.isl, vocab, a.seed)
        times = {n: {m: [] for m in METRICS} for n in names}
        for k in range(-a.warmup, a.rounds):
            prompt = prompts[k + a.warmup]
            for name in round_order(names, k):
                prefill, decode, boot = pairs[name]
                args3 = (http_call, prefill.port, decode.port, boot)
                start = time.perf_counter()
                first = pd_request(*args3, prompt, 1, a.request_timeout)
                ttft_ms = (time.perf_counter() - start) * 1e3
                full = pd_request(*args3, prompt, a.osl, a.request_timeout)
                for ans in (first, full):
                    if "error" in ans:
                        raise RuntimeError(f"pair {name}, round {k}: {ans['error']}")
                if k >= 0:
                    for metric, value in round_figures(ttft_ms, full).items():
                        times[name][metric].append(value)
        self.result.update(
            time=now_utc(),
            idle="spin",
            pairs=names,
            isl=a.isl,
            osl=a.osl,
            rounds=a.rounds,
            times_ms=times,
            overhead=overheads(times, names[0]),
        )
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = log_dir_for(args.log_dir, "pd_overhead")
    run = PdPairs(args)
    run.log_dir = log_dir
    rc = 1
    try:
        rc = run.main()
    except BaseException as e:  # noqa: BLE001  (reported in the result)
        run.errors.append(f"{type(e).__name__}: {e}")
    finally:
        leftovers = run.stop_all() if run.servers else []
    run.result.update(errors=run.errors, leftover_process_groups=leftovers, log_dir=str(log_dir))
    if "overhead" in run.result:
        control = None if args.no_control else run.result["pairs"][0] + CONTROL_SUFFIX
        print(table(run.result["overhead"], run.result["pairs"][0], control), flush=True)
        append_jsonl(args.out, dict(kind="pd_overhead", **run.result))
    if run.errors or leftovers:
        rc = 1
    print("PD_OVERHEAD_RESULT " + json.dumps(run.result, sort_keys=True), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
