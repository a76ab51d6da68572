#!/usr/bin/env python3
"""Paired, interleaved serving overhead of the KV-canary: every config's server up
at once on the same GPU, requests alternated between them round by round, overhead read from
the per-round ratios.

Why
---
``bench_serving_overhead.py`` runs one Engine after another. Between two Engines the GPU's
clocks, the host's frequency and the process layout differ, and a short scenario (one prompt
of 512 tokens, about 10 ms) is bimodal inside one Engine: its results moved by 10-50 % from one
Engine to the next with identical code (``benchmark/results/ttft_h100.md``), far more than the
0.5 % the latency target asks to show. Here the servers of all configs run side by side; round k sends
the same request to each of them, one after the other, in the config order (even rounds) or
its reverse (odd rounds: ABBA), so every pair of measurements shares the machine's state of
that moment. The overhead of a config is the median over the rounds of its time divided by
the baseline's time of the same round, minus one, with a bootstrap 95 % interval (rounds
resampled, seeded) that says whether the difference is resolved.

What it measures
----------------
Servers: ``python -m sglang.launch_server`` (the CLI path), one per config of
``bench_serving_overhead.py``'s ``CONFIGS`` (``off``, ``raise``, ``raise+token``, ...: the
same model, settings and canary flags, token checks through
``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT`` in that server's environment), started one
after the other (``--start serial``, the default) or all at once (``--start together``: the
servers' start-ups, about a minute each, overlap). Their memory: sglang sizes a server's
memory as if it were alone on the GPU (``--mem-fraction-static`` of the total, minus what is
in use when it starts), so started one after the other server i (from 0) gets ``(i + 1) *
--gpu-share`` (default ``0.8 / number of configs``): each ends up with about one share;
started together, each gets the whole run's fraction and is held to its share by the KV
pool's cap, ``--max-total-tokens`` (default: what the scenarios need), and a run whose
servers report pools of different sizes (``/server_info``'s ``max_total_num_tokens``) is
refused (serial: the sizes are printed). The model's weights are loaded once per server:
the Qwen3-0.6B shape fits five times on one H100; the Qwen3-30B-A3B shape (about 61 GB) does
not fit twice on one GPU, so its rows stay with ``bench_serving_overhead.py``. ``--osl N``
sets every decode scenario's output length (a mode whose decode is slow, such as
``multi-layer`` without CUDA graphs, fits its rounds in a device call); each record holds the
``osl`` it ran.

The A/A control (on unless ``--no-control``): a second server of the baseline's config
(``<baseline>~aa``) runs beside the others and is measured like them. Its paired difference
from the baseline is the run's resolution: two identical servers differ by that much on this
machine at this moment (their memory, their cores, their place in the round). It is printed
beside each scenario's table; an overhead is claimed only where the A/A difference and its
interval lie within +-0.3 % (``A/A_LIMIT``), and then only if the config's interval clears it.
``--twins raise`` adds a second server of a canary config the same way (``raise~aa``, compared
with ``raise``): where a config differs from its baseline in a direction no canary explains
(faster), its twin tells a server difference from a config's.

Idle schedulers: every server here runs ``--idle spin`` (the default): sglang's own default,
a scheduler polling its sockets in a busy loop while it has nothing to run. With
``--idle sleep`` (sglang's ``--sleep-on-idle``, which the test servers use: an idle scheduler
blocks in ``zmq.Poller.poll``) two identical canary-off servers' 512-token prefills came out in
regimes of many rounds, about 10 or 17-20 ms, and their medians 2-48 % apart; spinning, the
same servers gave 8-10 ms every round and an A/A difference of +1.6 % at 512 tokens and
-0.5 % at 4096 (``benchmark/results/latency_h100.md``, H200, 2026-11-26). A short prefill is
paced by the host, and a scheduler woken from a blocking poll runs it on a core that has
been idle. (Pinning each server to three cores of its own, tried with sleeping schedulers,
did not bring the servers closer.) The choice is in every record (``idle``).

Repeats (``--repeat K``): each server is sent the round's request K times in a row (each
after a radix-cache flush) and its figures of the round are the medians of the K: a short
prefill's own noise (a request that meets a busy core) shrinks while every round still pairs
the servers at one moment; with ``--isolate`` a server is continued once for its K requests.
The choice is in every record (``repeat``).

Isolation (``--isolate``): every server but the one being sent a request is paused
(SIGSTOP to its process group: its scheduler, spinning or not, its tokenizer and detokenizer
stop), continued 50 ms before its request and paused again after it. A short prefill is paced
by the host, and with eight or ten servers up their spinning schedulers alone hold most of
the cores; paused, they hold none, and each server is measured on a quiet host in the same
rounds as the others. The choice is in every record (``isolate``).

Order: the servers start in the config order rotated by ``--start-rotation`` (default: a
different rotation for each invocation, recorded in the results), so no config always starts
first (and gets the first memory share, the first cores). Within a run, round k sends to the
servers in the order rotated by k (each server takes each place equally often), reversed in
every other cycle (a server that follows another also precedes it).

Per scenario (``bench_serving_overhead.py``'s: the same inputs per round, ``max_new_tokens``
= osl, ``ignore_eos``, temperature 0): ``--warmup`` rounds (not recorded), then ``--rounds``
rounds; before each request the server's radix cache is flushed (``/flush_cache``), so no
request hits a cached prefix. Recorded per request: the wall time of the ``/generate`` call
(client side) and the scheduler's prefill time from the output's ``meta_info`` (sglang's
request metrics, ``--enable-metrics``: first forward entry to last prefill result
processed; see ``server_prefill_ms``) and, for scenarios with more than one output token, the
decode time sglang's tokenizer manager measured (first token to finish: ``decode_throughput``
in ``meta_info``; see ``server_decode_ms``), not the client's wall time of a long request.
Greedy outputs must agree between the configs of a
round (the canary changes no output); disagreements are counted and printed.

Run it on the device (bundles as in ``bench_serving_overhead.py``; about a minute per server
to start, then seconds per scenario)::

    . .device/c/setup.sh && python benchmark/kv_canary/bench_interleaved.py \
        --configs off,raise,raise+token,raise+partial,raise+token+partial \
        --scenarios prefill_bs1_512,prefill_bs1_4k,prefill_bs1_16k --rounds 30 \
        --out $OUT/interleaved.jsonl

``--speculative MODE`` (``eagle``, ``eagle-tree``, ``eagle3``, ``standalone``, ``ngram``,
``dflash``, ``adaptive``: ``bench_serving_overhead.py``'s modes and drafts, Qwen3-0.6B shapes
only; ``nextn`` on ``--model deepseek-v3-mtp`` (its default), whose MTP layer drafts; ``frozen-kv-mtp``
on ``--model gemma4-mtp``, whose KV its Gemma4 assistant reads (piecewise prefill graphs off:
sglang 0.5.12 cannot capture its KV-sharing layers, ``common.MODELS_WITHOUT_PIECEWISE``); ``multi-layer`` on ``--model
step3p5-mtp``, whose three MTP layers sglang runs as multi-layer EAGLE, CUDA graphs off): every
server decodes with that mode; default scenarios decode bs 1 and bs 32, decode
graphs for bs 1 and 32. A canary-on server must log the canary installed on the target and,
for a mode with a draft KV pool, on that mode's draft worker (``common.SPECULATIVE_DRAFT_WORKERS``;
``ngram`` and ``frozen-kv-mtp`` have none) and on no other; a canary-off server on neither;
otherwise the run stops. One mode's decode rows against ``off`` and its A/A control::

    . .device/c/setup.sh && python benchmark/kv_canary/bench_interleaved.py \
        --speculative eagle3 --configs off,raise --rounds 30 --out $OUT/spec_eagle3.jsonl

Side by side with upstream's own canary (``--upstream-site DIR``): configs named ``up:<config>``
(``up:off``, ``up:raise``, ``up:raise+token``, ``up:raise+partial``, ``up:raise+token+partial``,
``up:raise+all``, ``up:raise+all+sweep`` (the radix sweep every 100 forwards); ``raise+all`` and
``raise+all+sweep`` are this project's same settings) run upstream sglang 0.5.17 and its
canary, installed in its own site directory DIR by ``upstream_bundle.sh``, as a black box: the
same ``launch_server`` flags (``--kv-canary``, ``--kv-canary-real-data``; token checks through the
same variable), ``PYTHONPATH`` = ``benchmark/kv_canary/upstream_site`` (which keeps this
project's editable install and plugin out of that process), DIR, then the machine's. Each
stack's overhead is against its own baseline (``up:`` + ``--baseline``, which must be named
too); greedy outputs are compared within a stack only. Upstream's canary refuses sglang's
piecewise prefill graphs, so a canary-on ``up:`` config needs ``--piecewise off`` (for every
server alike). Each server's sglang version (``/server_info``) is recorded; an ``up:`` server
that reports this project's sglang version stops the run (outside ``--smoke-cpu``, whose CPU
check may stand any site directory in for upstream's)::

    python benchmark/kv_canary/bench_interleaved.py --upstream-site /tmp/site_up \
        --configs off,raise,raise+token+partial,up:off,up:raise,up:raise+token+partial \
        --piecewise off --scenarios prefill_bs1_512,prefill_bs1_4k --rounds 30

Results go to ``--out`` as JSON lines (one per scenario x config); ``--report FILE...``
prints the tables of earlier runs. Each server's log: ``<out>.<config>.log``.

Without a GPU (``--smoke-cpu``): sglang's CPU server (tiny dummy Llama, libcuda stub) with the
smoke scenarios of ``bench_serving_overhead.py``; the numbers mean nothing, the run checks
that the script works (CPU CI runs it: ``test/registered/kv_canary/test_bench_interleaved.py``)::

    python benchmark/kv_canary/bench_interleaved.py --smoke-cpu --configs off,raise \
        --scenarios prefill_bs1_512 --rounds 2 --warmup 1 --out /tmp/i.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import (  # noqa: E402  (a sibling module)
    CONFIGS,
    DEFAULT_SCENARIOS as SERVING_DEFAULT_SCENARIOS,
    DRAFT_WORKERS_HELP,
    MODELS,
    MODELS_WITHOUT_PIECEWISE,
    SCENARIOS,
    SMOKE_SCENARIOS,
    SMOKE_SETTINGS,
    SPECULATIVE,
    SPECULATIVE_HELP,
    UPSTREAM_PREFIX,
    UPSTREAM_SITE_DIR,
    UPSTREAM_STACK,
    EngineSettings,
    Scenario,
    append_jsonl,
    gpu_name,
    now_utc,
    parse_ints,
    parse_names,
    read_jsonl,
    speculative_mode,
    speculative_model,
    piecewise_setting,
    speculative_model_problem,
    write_speculative_files,
)
from interleaved_servers import (  # noqa: E402  (the servers: configs, start-up, checks)
    CONFIG_TABLE,
    IDLE_MODES,
    INSTALLED_LINE,
    START_MODES,
    SIDE_FORK_LINE,
    Server,
    canary_install_problem,
    check_upstream,
    http_json,
    memory_fractions,
    pool_note,
    server_config,
    server_env,
    server_facts,
    server_kwargs,
    tokens_needed,
)
from interleaved_rounds import (  # noqa: E402  (the rounds, their statistics, the table)
    control_names,
    measure,
    paired_overhead,
    resolved,
    rotated,
    round_order,
    scenario_records,
    server_decode_ms,
    stack_baselines,
    table,
    twin_names,
)

# what other code reads from this module (test_bench_interleaved.py,
# profile_server_prefill.py), the sibling modules' names included
__all__ = [
    "CONFIGS",
    "CONFIG_TABLE",
    "INSTALLED_LINE",
    "SIDE_FORK_LINE",
    "SCENARIOS",
    "SMOKE_SCENARIOS",
    "UPSTREAM_SITE_DIR",
    "EngineSettings",
    "Server",
    "build_parser",
    "canary_install_problem",
    "control_names",
    "graph_batch_sizes",
    "http_json",
    "main",
    "measure",
    "memory_fractions",
    "pool_note",
    "start_servers",
    "with_osl",
    "paired_overhead",
    "resolved",
    "rotated",
    "round_order",
    "server_decode_ms",
    "server_env",
    "server_kwargs",
    "stack_baselines",
    "twin_names",
]

START_TIMEOUT_S = 900.0
# the prefill set of the latency target; with a speculative mode, bench_serving_overhead.py's
# decode set
DEFAULT_SCENARIOS = {
    "none": "prefill_bs1_512,prefill_bs1_4k,prefill_bs1_16k",
    **{mode: ",".join(SERVING_DEFAULT_SCENARIOS[mode]) for mode in SPECULATIVE if mode != "none"},
}


def graph_batch_sizes(args, scenarios: Sequence) -> tuple:
    """The decode graphs every server captures: ``--cuda-graph-bs`` if given; with a
    speculative mode bs 1 and 32; else bs 1 and each decode scenario's batch size, so a decode
    scenario replays a graph of its own size (not one padded up to a larger size) and a server
    captures no graph the run does not use (each capture is start-up time, times every
    server)."""
    if args.cuda_graph_bs:
        return tuple(parse_ints(args.cuda_graph_bs, "--cuda-graph-bs"))
    if args.speculative != "none":
        return (1, 32)
    return tuple(sorted({1} | {sc.bs for sc in scenarios if sc.osl > 1}))


def with_osl(scenarios: Sequence[Scenario], osl: int | None) -> list[Scenario]:
    """``scenarios`` with every decode scenario's output length set to ``osl`` (``--osl``;
    None: as they are); prefill scenarios (one output token) stay as they are. Refused: an
    ``osl`` under 2 (one token is a prefill) or one no chosen scenario would use."""
    if osl is None:
        return list(scenarios)
    if osl < 2:
        raise SystemExit(f"--osl {osl}: a decode scenario's output length, allowed: 2 or more")
    if not any(sc.kind == "decode" for sc in scenarios):
        raise SystemExit(
            f"--osl {osl}: no decode scenario in --scenarios "
            f"({', '.join(sc.name for sc in scenarios)}) to apply it to"
        )
    return [dataclasses.replace(sc, osl=osl) if sc.kind == "decode" else sc for sc in scenarios]


def start_servers(
    order: Sequence[str],
    launch: Callable[[str], Server],
    up: Callable[[Server, float], None],
    start: str,
    started: dict[str, Server],
) -> None:
    """Launch the servers named in ``order`` (``launch(name)``), each into ``started`` as soon
    as its process exists (the caller stops them, however the start ends), and wait for each
    (``up(server, launched)``, ``launched`` its ``time.perf_counter()`` at launch): ``serial``
    waits for each before launching the next; ``together`` launches all, then waits for each
    in ``order``."""
    if start not in START_MODES:
        raise ValueError(f"--start {start!r}: allowed {', '.join(START_MODES)}")
    launched = {}
    for name in order:
        launched[name] = time.perf_counter()
        started[name] = launch(name)
        if start == "serial":
            up(started[name], launched[name])
    if start == "together":
        for name in order:
            up(started[name], launched[name])


def server_up(srv: Server, args, launched: float, frac: float | None) -> None:
    """Wait for ``srv`` (launched at ``launched``, ``time.perf_counter``) to answer, within
    ``--start-timeout`` of its launch, then refuse it if its canary is not what its config
    says; prints how long it took."""
    srv.wait_ready(max(1.0, args.start_timeout - (time.perf_counter() - launched)))
    cfg = srv.cfg
    problem = canary_install_problem(
        srv.log(),
        canary_on=cfg.canary_on,
        speculative=args.speculative,
        stack=cfg.stack,
        side_fork=cfg.side_fork,
    )
    if problem:
        raise SystemExit(
            f"[{srv.name}] {problem} (log {srv.log_path}); its results would be invalid"
        )
    print(
        f"[{srv.name}] up in {time.perf_counter() - launched:.0f} s on port {srv.port} "
        f"(mem fraction {frac}; log {srv.log_path})",
        flush=True,
    )


def run(args) -> int:
    names = parse_names(args.configs, CONFIG_TABLE, "--configs")
    if args.baseline not in names:
        raise SystemExit(
            f"--baseline {args.baseline!r} must be one of --configs ({', '.join(names)})"
        )
    if len(names) < 2:
        raise SystemExit("--configs: name the baseline and at least one more config")
    if args.rounds < 1 or args.warmup < 0 or args.repeat < 1:
        raise SystemExit(
            f"--rounds and --repeat must be >= 1 and --warmup >= 0 (got {args.rounds}, "
            f"{args.repeat}, {args.warmup})"
        )
    smoke = args.smoke_cpu
    if args.speculative != "none" and smoke:
        raise SystemExit(
            f"--speculative {args.speculative} cannot run with --smoke-cpu: "
            "sglang 0.5.12's CPU server has no speculative decoding"
        )
    args.model = speculative_model(args.speculative, args.model)
    args.piecewise = piecewise_setting(args.model, args.piecewise)
    problem = speculative_model_problem(args.speculative, args.model)
    if problem:
        raise SystemExit(problem)
    check_upstream(
        names,
        upstream_site=args.upstream_site,
        piecewise=args.piecewise,
        speculative=args.speculative,
    )
    table_of = SMOKE_SCENARIOS if smoke else SCENARIOS
    scenario_names = args.scenarios or DEFAULT_SCENARIOS[args.speculative]
    scenarios = with_osl(
        [table_of[n] for n in parse_names(scenario_names, SCENARIOS, "--scenarios")], args.osl
    )
    gpu = gpu_name(smoke)
    invocation = uuid.uuid4().hex[:12]
    tmp = tempfile.mkdtemp(prefix="kv_canary_interleaved_")
    out = os.path.abspath(args.out or os.path.join(tmp, "interleaved.jsonl"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    settings = (
        SMOKE_SETTINGS
        if smoke
        else EngineSettings(
            model=args.model,
            max_total_tokens=args.max_total_tokens
            or tokens_needed(scenarios, EngineSettings.chunked_prefill_size),
            speculative=args.speculative,
            piecewise=args.piecewise == "on",
            cuda_graph_bs=graph_batch_sizes(args, scenarios),
        )
    )
    draft_dir = None
    if smoke:
        from sglang.srt.kv_canary.demo.server_harness import (
            TINY_LLAMA_CONFIG,
            build_libcuda_stub,
            cpu_server_env,
            write_tiny_llama,
        )

        model_dir, vocab = (
            write_tiny_llama(os.path.join(tmp, "model")),
            TINY_LLAMA_CONFIG["vocab_size"],
        )
        base_env = cpu_server_env(build_libcuda_stub(os.path.join(tmp, "stub")))
    else:
        model_dir = os.path.join(tmp, "model")
        os.makedirs(model_dir)
        pathlib.Path(model_dir, "config.json").write_text(json.dumps(MODELS[args.model], indent=1))
        vocab = MODELS[args.model]["vocab_size"]
        base_env = dict(os.environ)
        draft_dir = write_speculative_files(args.speculative, os.path.join(tmp, "draft"))
    # the servers: each config's, plus the A/A controls (a second server of each stack's
    # baseline: upstream's stack has its own when an up: config runs)
    server_names = (
        names
        + (control_names(names, args.baseline) if args.control else [])
        + twin_names(
            names,
            parse_names(args.twins, CONFIG_TABLE, "--twins") if args.twins else [],
            args.baseline,
        )
    )
    baselines = stack_baselines(server_names, args.baseline)
    rotation = (
        args.start_rotation
        if args.start_rotation is not None
        else int(invocation, 16) % len(server_names)
    )
    start_order = rotated(server_names, rotation)
    if not smoke:
        fracs = memory_fractions(
            len(server_names), args.gpu_share or 0.8 / len(server_names), args.start
        )
    else:
        fracs = [None] * len(server_names)
    base_env.pop("SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT", None)  # per config below
    print(
        f"KV-canary interleaved overhead — {gpu} — {now_utc()} — configs {', '.join(names)} "
        f"(baseline {args.baseline}"
        + (
            f", A/A control {', '.join(control_names(names, args.baseline))}"
            if args.control
            else ""
        )
        + (f", twins {args.twins}" if args.twins else "")
        + f") — started {'together' if args.start == 'together' else 'one after the other'}, "
        f"in the order {', '.join(start_order)} — {args.rounds} rounds after "
        f"{args.warmup} warm-up — idle schedulers: {args.idle}"
        + (" — every other server paused during a request" if args.isolate else "")
        + f" — results to {out}",
        flush=True,
    )
    started: dict[str, Server] = {}
    try:
        frac_of = dict(zip(start_order, fracs))

        def launch(name: str) -> Server:
            cfg = server_config(name)
            kwargs = server_kwargs(
                settings.engine_kwargs(model_dir, smoke=smoke, draft_dir=draft_dir),
                cfg,
                mem_fraction=frac_of[name],
                idle=args.idle,
            )
            log_path = f"{out}.{name.replace('+', '_').replace('~', '_').replace(':', '_')}.log"
            return Server(
                name, cfg, kwargs, server_env(base_env, cfg, args.upstream_site), log_path
            )

        start_servers(
            start_order,
            launch,
            lambda srv, launched: server_up(srv, args, launched, frac_of[srv.name]),
            args.start,
            started,
        )
        servers = {name: started[name] for name in server_names}  # rounds rotate from here
        facts = {name: server_facts(srv.port) for name, srv in servers.items()}
        note = pool_note(facts, args.start)
        if note:
            print(note, flush=True)
        versions = {name: f["version"] for name, f in facts.items()}
        upstream = {n for n in server_names if server_config(n).stack == UPSTREAM_STACK}
        ours = {versions[n] for n in server_names if n not in upstream}
        same = [n for n in server_names if n in upstream and versions[n] in ours]
        if same and not smoke:
            raise SystemExit(
                f"{', '.join(same)}: upstream's servers report sglang "
                f"{versions[same[0]]}, this project's version: --upstream-site "
                f"{args.upstream_site} did not put upstream's sglang first"
            )
        common = dict(
            invocation=invocation,
            time=now_utc(),
            gpu=gpu,
            smoke=smoke,
            model="tiny-llama (smoke)" if smoke else args.model,
            speculative=args.speculative,
            warmup_rounds=args.warmup,
            order=server_names,
            start_order=start_order,
            start=args.start,
            repeat=args.repeat,
            idle=args.idle,
            piecewise=args.piecewise,
            cuda_graph_bs=list(settings.cuda_graph_bs),
            isolate=args.isolate,
        )
        records = []
        for sc in scenarios:
            t0 = time.perf_counter()
            wall, server, decode, mismatched = measure(
                servers,
                sc,
                rounds=args.rounds,
                warmup=args.warmup,
                vocab=vocab,
                isolate=args.isolate,
                repeat=args.repeat,
            )
            recs = scenario_records(
                sc,
                wall,
                server,
                decode,
                mismatched,
                baselines=baselines,
                ports={n: srv.port for n, srv in servers.items()},
                common=common,
                facts=facts,
            )
            for rec in recs:
                append_jsonl(out, rec)
            records += recs
            print(
                f"{sc.name}: {args.rounds} rounds in {time.perf_counter() - t0:.0f} s", flush=True
            )
    finally:
        for srv in started.values():
            srv.stop()
        for sub in ("model", "draft", "stub"):  # the results and logs stay
            shutil.rmtree(os.path.join(tmp, sub), ignore_errors=True)
    print()
    print(table(records))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line (``main``'s)."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--configs",
        default="off,raise,raise+token",
        help=f"comma-separated, from: {', '.join(CONFIG_TABLE)}",
    )
    ap.add_argument("--baseline", default="off", help="the config the others are compared with")
    ap.add_argument(
        "--scenarios",
        default=None,
        help=f"comma-separated, from: {', '.join(SCENARIOS)} (default "
        f"{DEFAULT_SCENARIOS['none']}; with a --speculative mode "
        f"{DEFAULT_SCENARIOS['eagle']})",
    )
    ap.add_argument(
        "--speculative",
        default="none",
        type=speculative_mode,
        metavar="{" + ",".join(SPECULATIVE) + "}",
        help=SPECULATIVE_HELP + "; each canary-on server must report the canary installed on "
        "the target and on the mode's draft worker (" + DRAFT_WORKERS_HELP + ")",
    )
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="unrecorded rounds first")
    ap.add_argument(
        "--model",
        default=None,
        choices=sorted(MODELS),
        help="the dummy-weight model's shapes (default: the --speculative mode's target, "
        "else qwen3-0.6b)",
    )
    ap.add_argument(
        "--gpu-share",
        type=float,
        default=None,
        help="each server's share of the GPU's memory (default 0.8 / #configs)",
    )
    ap.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="each server's KV pool (default: what the scenarios need)",
    )
    ap.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the A/A control: a second server of the baseline's config "
        "(default on; its difference from the baseline is the resolution)",
    )
    ap.add_argument(
        "--twins",
        default="",
        help="comma-separated configs of --configs (not a baseline) that get a second "
        "server, compared with the first: how far two servers of that config differ",
    )
    ap.add_argument(
        "--start-rotation",
        type=int,
        default=None,
        help="start the servers in the config order rotated by this much "
        "(default: a rotation drawn from the run's id)",
    )
    ap.add_argument(
        "--piecewise",
        default=None,
        choices=("on", "off"),
        help="sglang's piecewise CUDA graphs for prefill, every server alike "
        "(default on, sglang's default; off for a --model sglang 0.5.12 cannot capture: "
        + ", ".join(MODELS_WITHOUT_PIECEWISE)
        + ")",
    )
    ap.add_argument(
        "--idle",
        default="spin",
        choices=IDLE_MODES,
        help="spin (default, sglang's default): an idle scheduler polls in a busy "
        "loop; sleep: every server with sglang's --sleep-on-idle",
    )
    ap.add_argument(
        "--cuda-graph-bs",
        default=None,
        help="comma-separated decode graph batch sizes, every server alike (default: 1 and "
        "each decode scenario's batch size; with a --speculative mode 1 and 32)",
    )
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="pause (SIGSTOP) every server but the one being sent a request, so it has the "
        "host to itself; the servers are continued when the rounds end",
    )
    ap.add_argument(
        "--start",
        default="serial",
        choices=START_MODES,
        help="serial (default): each server started once the one before answers, its memory "
        "fraction the shares so far; together: all at once, each held to its share by "
        "--max-total-tokens (a run whose pools differ is refused)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="requests per server per round, sent one after the other; the round's figures "
        "are their medians (default 1)",
    )
    ap.add_argument(
        "--osl",
        type=int,
        default=None,
        help="the output length of every decode scenario run (default: each scenario's own, "
        "1024); recorded as each record's osl",
    )
    ap.add_argument(
        "--start-timeout",
        type=float,
        default=START_TIMEOUT_S,
        help="seconds from a server's launch until it must answer",
    )
    ap.add_argument(
        "--upstream-site",
        default=None,
        metavar="DIR",
        help=f"sglang 0.5.17's site directory, for the {UPSTREAM_PREFIX}configs",
    )
    ap.add_argument("--out", default=None, help="JSON lines file (appended)")
    ap.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="sglang's CPU server with tiny scenarios: checks the script only",
    )
    ap.add_argument(
        "--report",
        nargs="+",
        metavar="FILE",
        help="print the table of earlier runs' records and exit",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.report:
        missing = [p for p in args.report if not os.path.exists(p)]
        if missing:
            ap.error(f"--report: no such file(s): {', '.join(missing)}")
        print(table([r for r in read_jsonl(args.report) if r.get("kind") == "interleaved"]))
        return 0
    if args.gpu_share is not None and not 0 < args.gpu_share < 1:
        ap.error(f"--gpu-share must be in (0, 1), got {args.gpu_share}")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
