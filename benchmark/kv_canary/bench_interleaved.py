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
after the other. Their memory: sglang sizes a server's memory as if it were alone on the GPU
(``--mem-fraction-static`` of the total, minus what is in use when it starts), so server i
(from 0) gets ``(i + 1) * --gpu-share`` (default ``0.8 / number of configs``): each ends up
with about one share. ``--max-total-tokens`` defaults to what the scenarios need. The model's
weights are loaded once per server: the Qwen3-0.6B shape fits five times on one H100; the
Qwen3-30B-A3B shape (about 61 GB) does not fit twice on one GPU, so its rows stay with
``bench_serving_overhead.py``.

The A/A control (on unless ``--no-control``): a second server of the baseline's config
(``<baseline>~aa``) runs beside the others and is measured like them. Its paired difference
from the baseline is the run's resolution: two identical servers differ by that much on this
machine at this moment (their memory, their cores, their place in the round). It is printed
beside each scenario's table; an overhead is claimed only where the A/A difference and its
interval lie within +-0.3 % (``A/A_LIMIT``), and then only if the config's interval clears it.

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

``--speculative eagle``: every server decodes with EAGLE (the one-layer draft of
``bench_serving_overhead.py --speculative eagle``, Qwen3-0.6B shapes only; default scenarios
decode bs 1 and bs 32, decode graphs for bs 1 and 32). A canary-on server whose log does not
say the canary was installed on its draft worker too stops the run, as does any canary-on
server without the canary or a canary-off server with it.

Side by side with upstream's own canary (``--upstream-site DIR``): configs named ``up:<config>``
(``up:off``, ``up:raise``, ``up:raise+token``, ``up:raise+partial``, ``up:raise+token+partial``,
``up:raise+all``; ``raise+all`` is this project's same setting) run upstream sglang 0.5.17 and its
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
import json
import os
import pathlib
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import (  # noqa: E402  (a sibling module)
    use_test_support,
    ALL_DATA_CONFIG,
    CONFIGS,
    DEFAULT_MODEL,
    DEFAULT_SCENARIOS as SERVING_DEFAULT_SCENARIOS,
    MODELS,
    QWEN3_EAGLE_DRAFT_CONFIG,
    SCENARIOS,
    SMOKE_SCENARIOS,
    SMOKE_SETTINGS,
    SPECULATIVE,
    PROJECT_STACK,
    UPSTREAM_CONFIGS,
    UPSTREAM_PREFIX,
    UPSTREAM_SITE_DIR,
    UPSTREAM_STACK,
    BenchConfig,
    EngineSettings,
    Scenario,
    append_jsonl,
    gpu_name,
    make_inputs,
    now_utc,
    parse_names,
    upstream_env,
    quantile,
    read_jsonl,
    server_prefill_ms,
)

from sglang.srt.kv_canary.testing.server_harness import free_port  # noqa: E402

use_test_support()
from canary_support.server_process import (  # noqa: E402
    ServerProcess,
    http_call,
    launch_server_flags,
)

START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0
BOOTSTRAP_SAMPLES = 2000
FLUSH_ATTEMPTS = 100
# the prefill set of the latency target; with EAGLE, bench_serving_overhead.py's decode set
DEFAULT_SCENARIOS = {
    "none": "prefill_bs1_512,prefill_bs1_4k,prefill_bs1_16k",
    "eagle": ",".join(SERVING_DEFAULT_SCENARIOS["eagle"]),
}
# the log lines of a server whose canary was installed (api.install's), on the target and,
# with EAGLE, on the draft worker
INSTALLED_LINE = "kv_canary installed: "
DRAFT_INSTALLED_LINE = "kv_canary installed on the EAGLE draft worker: "
CONTROL_SUFFIX = "~aa"  # the A/A control: a second server of the baseline's config
# every config a server can run: this project's, and upstream's canary under the same flags
CONFIG_TABLE = {**CONFIGS, ALL_DATA_CONFIG.name: ALL_DATA_CONFIG, **UPSTREAM_CONFIGS}
# first on an upstream server's PYTHONPATH: keeps this project out of that process


def server_config(name: str) -> BenchConfig:
    """The config a server runs (``name``: a config's, or its A/A control's)."""
    return CONFIG_TABLE[name.removesuffix(CONTROL_SUFFIX)]


AA_LIMIT = 0.003  # a run resolves 0.5 % only where its A/A control stays within +-0.3 %


# ---- one server ---------------------------------------------------------------------------


def http_json(
    port: int, method: str, path: str, body=None, timeout: float = REQUEST_TIMEOUT_S
) -> tuple[int, object]:
    """One HTTP exchange with the server; ``(status, decoded JSON or raw text)``."""
    status, raw = http_call(port, method, path, body, timeout=timeout)
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def server_decode_ms(outs: list[dict]) -> float | None:
    """The decode time of one ``generate`` call as sglang's tokenizer manager measured it
    (first output token to finish, per request: ``(completion_tokens - 1) /
    decode_throughput``), the batch's median, in ms; None when the outputs have a single
    token or no such figures."""
    times = []
    for o in outs:
        meta = o.get("meta_info", {})
        n, tput = meta.get("completion_tokens"), meta.get("decode_throughput")
        if not n or n < 2 or not tput:
            return None
        times.append((n - 1) / tput * 1e3)
    return statistics.median(times) if times else None


def canary_install_problem(
    log: str, *, canary_on: bool, speculative: str, stack: str = PROJECT_STACK
) -> str | None:
    """What is wrong with a server's canary, from its log, or None: a canary-on server must
    have installed the canary (and, with EAGLE, on the draft worker too: otherwise the draft
    pool ran unguarded and its figures mean nothing); a canary-off server must not have. An
    upstream server (``stack``) must not have installed this project's canary at all (its
    own canary is upstream's business: the server took its flags)."""
    target = INSTALLED_LINE in log
    draft = DRAFT_INSTALLED_LINE in log
    if stack == UPSTREAM_STACK:
        return (
            "this project's canary was installed on an upstream server (its plugin ran "
            f"there: {UPSTREAM_SITE_DIR} must come first on its PYTHONPATH)"
            if target or draft
            else None
        )
    if canary_on and not target:
        return f"no '{INSTALLED_LINE.strip()}' line: the canary did not run"
    if canary_on and speculative != "none" and not draft:
        return f"no '{DRAFT_INSTALLED_LINE.strip()}' line: the draft pool ran unguarded"
    if not canary_on and (target or draft):
        return "the canary was installed on a server of a canary-off config"
    return None


class Server(ServerProcess):
    """One ``python -m sglang.launch_server`` process of config ``cfg`` (own session, log in
    ``log_path``)."""

    def __init__(
        self, name: str, cfg: BenchConfig, kwargs: dict, env: dict[str, str], log_path: str
    ):
        self.cfg = cfg
        port = free_port()
        super().__init__(
            name,
            [sys.executable, "-m", "sglang.launch_server", *launch_server_flags(port, kwargs)],
            port=port,
            env=env,
            log_path=log_path,
        )

    def generate(self, input_ids: list[list[int]], osl: int) -> tuple[float, list[dict]]:
        """Flush the radix cache, then one ``/generate`` of the batch: ``(wall ms,
        outputs)``."""
        for _ in range(FLUSH_ATTEMPTS):  # refused while the scheduler still holds a request
            status, body = http_json(self.port, "POST", "/flush_cache")
            if status == 200:
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(
                f"[{self.name}] /flush_cache answered {status} {FLUSH_ATTEMPTS} times: {body}"
            )
        params = [{"max_new_tokens": osl, "ignore_eos": True, "temperature": 0} for _ in input_ids]
        t0 = time.perf_counter()
        status, outs = http_json(
            self.port, "POST", "/generate", {"input_ids": input_ids, "sampling_params": params}
        )
        ms = (time.perf_counter() - t0) * 1e3
        if status != 200 or not isinstance(outs, list) or len(outs) != len(input_ids):
            raise RuntimeError(f"[{self.name}] /generate answered {status}: {str(outs)[:500]}")
        lens = sorted({len(o["output_ids"]) for o in outs})
        if lens != [osl]:
            raise RuntimeError(
                f"[{self.name}] expected outputs of {osl} tokens, got lengths {lens}"
            )
        return ms, outs


# ---- statistics -------------------------------------------------------------------------------


def paired_overhead(
    on: Sequence[float], off: Sequence[float], *, seed: int = 0
) -> tuple[float, float, float]:
    """Median over the rounds of ``on[k] / off[k] - 1`` and its bootstrap 95 % interval
    (rounds resampled ``BOOTSTRAP_SAMPLES`` times, seeded), as fractions."""
    if len(on) != len(off) or not on:
        raise ValueError(
            f"paired_overhead needs two equal non-empty series, got {len(on)} and {len(off)} values"
        )
    ratios = [a / b - 1.0 for a, b in zip(on, off)]
    rng = random.Random(seed)
    n = len(ratios)
    meds = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(BOOTSTRAP_SAMPLES))
    return statistics.median(ratios), quantile(meds, 0.025), quantile(meds, 0.975)


def summarise(values: Sequence[float]) -> dict:
    return dict(
        median=statistics.median(values),
        min=min(values),
        p10=quantile(values, 0.1),
        p90=quantile(values, 0.9),
    )


# ---- the run ----------------------------------------------------------------------------------


def rotated(names: Sequence[str], r: int) -> list[str]:
    """``names`` rotated left by ``r`` (any integer)."""
    names = list(names)
    r %= len(names)
    return names[r:] + names[:r]


def round_order(names: Sequence[str], k: int) -> list[str]:
    """Round ``k``'s order (warm-up rounds have k < 0): ``names`` rotated by k, so each takes
    each place equally often, reversed in every other cycle of ``len(names)`` rounds, so a
    server that follows another also precedes it. For two servers: AB, BA, BA, AB (ABBA)."""
    order = rotated(names, k)
    return order if (k // len(names)) % 2 == 0 else order[::-1]


def measure(
    servers: dict[str, Server], sc: Scenario, *, rounds: int, warmup: int, vocab: int
) -> tuple[dict[str, list[float]], dict[str, list], dict[str, list], int]:
    """Warm-up rounds, then ``rounds`` rounds of ``sc`` over ``servers``: per server the wall
    ms, the server's prefill ms and its decode ms per round (None where sglang gave none), and
    the number of rounds whose outputs disagreed between servers of one stack (another sglang's
    outputs differ by design)."""
    wall = {n: [] for n in servers}
    server = {n: [] for n in servers}
    decode = {n: [] for n in servers}
    mismatched = 0
    for k in range(-warmup, rounds):
        ids = make_inputs(sc, k, vocab)
        outputs = {}
        for name in round_order(list(servers), k):
            ms, outs = servers[name].generate(ids, sc.osl)
            outputs[name] = [o["output_ids"] for o in outs]
            if k >= 0:
                wall[name].append(ms)
                server[name].append(server_prefill_ms(outs))
                decode[name].append(server_decode_ms(outs))
        by_stack: dict[str, set] = {}
        for name, v in outputs.items():
            by_stack.setdefault(server_config(name).stack, set()).add(json.dumps(v))
        if k >= 0 and any(len(seen) > 1 for seen in by_stack.values()):
            mismatched += 1
    return wall, server, decode, mismatched


def stack_baselines(server_names: Sequence[str], baseline: str) -> dict[str, str]:
    """Each server's baseline: ``baseline`` for this project's configs (and the A/A
    control), ``up:`` + ``baseline`` for upstream's; refuses a stack whose baseline is not
    among the servers."""
    base = baseline.removeprefix(UPSTREAM_PREFIX)
    out = {}
    for name in server_names:
        want = UPSTREAM_PREFIX + base if server_config(name).stack == UPSTREAM_STACK else base
        if name.endswith(CONTROL_SUFFIX):
            want = name.removesuffix(CONTROL_SUFFIX)
        if want not in server_names:
            raise SystemExit(
                f"--configs: {name} is compared with its stack's baseline {want}, "
                "which is not among them: name it too"
            )
        out[name] = want
    return out


def scenario_records(
    sc: Scenario,
    wall: dict,
    server: dict,
    decode: dict,
    mismatched: int,
    *,
    baselines: dict[str, str],
    ports: dict,
    common: dict,
    facts: dict,
) -> list[dict]:
    """One record per server of one scenario; every server but a baseline carries its paired
    overheads against its baseline (``baselines``: per server, its stack's,
    :func:`stack_baselines`): ``wall_overhead``, ``server_overhead`` for the prefill,
    ``decode_overhead``. The A/A control's record (``control``: true) is the run's
    resolution. ``facts``: each server's :func:`server_facts`, recorded."""
    recs = []
    for name in wall:
        baseline = baselines[name]
        config = name.removesuffix(CONTROL_SUFFIX)
        rec = dict(
            kind="interleaved",
            config=config,
            server_name=name,
            control=name.endswith(CONTROL_SUFFIX),
            scenario=sc.name,
            bs=sc.bs,
            isl=sc.isl,
            osl=sc.osl,
            baseline=baseline,
            stack=server_config(name).stack,
            **facts[name],
            rounds=len(wall[name]),
            port=ports[name],
            mismatched_rounds=mismatched,
            wall_runs_ms=wall[name],
            wall=summarise(wall[name]),
            **common,
        )
        for key, series in (("server", server), ("decode", decode)):
            if None in series[name] or None in series[baseline]:
                continue
            rec[f"{key}_runs_ms"] = series[name]
            rec[key] = summarise(series[name])
            if name != baseline:
                rec[f"{key}_overhead"] = paired_overhead(series[name], series[baseline])
        if name != baseline:
            rec["wall_overhead"] = paired_overhead(wall[name], wall[baseline])
        recs.append(rec)
    return recs


def resolved(rec: dict, control: dict | None, key: str) -> str:
    """Whether ``rec``'s ``key`` overhead (``wall``, ``server``, ``decode``) is a claim: the
    A/A control's median and interval lie within +-``AA_LIMIT`` and the config's interval
    does not include 0. ``no control`` / ``control too wide`` / ``within noise`` /
    ``resolved``."""
    if control is None or f"{key}_overhead" not in control:
        return "no control"
    med, lo, hi = control[f"{key}_overhead"]
    if max(abs(med), abs(lo), abs(hi)) > AA_LIMIT:
        return "control too wide"
    _, clo, chi = rec[f"{key}_overhead"]
    return "within noise" if clo <= 0.0 <= chi else "resolved"


def _pct(x: float) -> str:
    return f"{x * 100:+.2f} %"


def _interval(t) -> str:
    return f"{_pct(t[0])} [{_pct(t[1])}, {_pct(t[2])}]"


def table(records: list[dict]) -> str:
    """Markdown table of interleaved records (in their order)."""
    out = [
        "| scenario | config | rounds | wall median / min ms | server prefill median / min "
        "ms | server decode median ms | paired overhead, server prefill (median [95 % CI]) "
        "| paired overhead, server decode | paired overhead, wall |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    controls = {(r["invocation"], r["scenario"]): r for r in records if r.get("control")}
    for r in records:
        w, s, d = r["wall"], r.get("server"), r.get("decode")
        control = controls.get((r.get("invocation"), r["scenario"]))
        name = f"{r['config']} (A/A control)" if r.get("control") else r["config"]
        spec = "" if r.get("speculative", "none") == "none" else f", {r['speculative']}"

        def cell(key: str) -> str:
            if f"{key}_overhead" not in r:
                return (
                    "(baseline)" if r["config"] == r["baseline"] and not r.get("control") else "—"
                )
            text = _interval(r[f"{key}_overhead"])
            return text if r.get("control") else f"{text} ({resolved(r, control, key)})"

        out.append(
            f"| {r['scenario']}{spec} (bs{r['bs']} isl{r['isl']} osl{r['osl']}) | {name} | "
            f"{r['rounds']} | {w['median']:.2f} / {w['min']:.2f} | "
            + (f"{s['median']:.2f} / {s['min']:.2f} | " if s else "— | ")
            + (f"{d['median']:.2f} | " if d else "— | ")
            + f"{cell('server')} | {cell('decode')} | {cell('wall')} |"
        )
    out.append(
        f"\nAn overhead is a claim (\"resolved\") only where the A/A control's median "
        f"and 95 % interval lie within +-{AA_LIMIT * 100:.1f} % and the config's "
        "interval excludes 0."
    )
    mism = {(r["scenario"], r["mismatched_rounds"]) for r in records if r["mismatched_rounds"]}
    for scn, m in sorted(mism):
        out.append(f"\n{scn}: greedy outputs disagreed between configs in {m} round(s)")
    return "\n".join(out)


def memory_fractions(n: int, share: float) -> list[float]:
    """``--mem-fraction-static`` of each of ``n`` servers started one after the other (see
    the module docstring)."""
    fracs = [round((i + 1) * share, 4) for i in range(n)]
    if fracs[-1] > 0.95:
        raise ValueError(
            f"--gpu-share {share} x {n} servers = {fracs[-1]} of the GPU; "
            "allowed: at most 0.95 in all (lower --gpu-share)"
        )
    return fracs


def tokens_needed(scenarios: Sequence[Scenario], chunk: int) -> int:
    """A KV pool that holds the largest scenario's batch, with margin."""
    need = max(sc.bs * (sc.isl + sc.osl) for sc in scenarios)
    return int(need * 1.25) + chunk


IDLE_MODES = ("sleep", "spin")


def server_kwargs(
    settings_kwargs: dict, cfg: BenchConfig, *, mem_fraction: float | None, idle: str
) -> dict:
    """One server's engine kwargs: the run's settings, the config's canary flags, its memory
    fraction (None: sglang's default) and its idle scheduler (``idle``, one of
    ``IDLE_MODES``: ``sleep`` sets sglang's ``sleep_on_idle``, ``spin`` clears it)."""
    if idle not in IDLE_MODES:
        raise ValueError(f"--idle {idle!r}: allowed {', '.join(IDLE_MODES)}")
    kwargs = {**settings_kwargs, **cfg.engine_kwargs()}
    if mem_fraction is not None:
        kwargs["mem_fraction_static"] = mem_fraction
    kwargs["sleep_on_idle"] = idle == "sleep"
    return kwargs


def check_upstream(
    names: Sequence[str], *, upstream_site: str | None, piecewise: str, speculative: str
) -> None:
    """Refuse what a run with upstream's configs cannot measure (module docstring)."""
    upstream = [n for n in names if CONFIG_TABLE[n].stack == UPSTREAM_STACK]
    if not upstream:
        if upstream_site:
            raise SystemExit(
                f"--upstream-site {upstream_site}: no {UPSTREAM_PREFIX}config in "
                "--configs runs there"
            )
        return
    if not upstream_site or not os.path.isdir(upstream_site):
        raise SystemExit(
            f"--configs {', '.join(upstream)}: upstream's servers need "
            "--upstream-site DIR, the site directory of sglang 0.5.17 "
            f"(upstream_bundle.sh), got {upstream_site!r}"
        )
    if piecewise == "on" and any(CONFIG_TABLE[n].canary_on for n in upstream):
        raise SystemExit(
            "--piecewise on: upstream's canary refuses sglang's piecewise prefill "
            "graphs; pass --piecewise off (every server alike)"
        )
    if speculative != "none":
        raise SystemExit(
            f"--speculative {speculative}: the side by side with upstream "
            "measures prefill and decode without speculative decoding"
        )


def server_env(
    base_env: dict[str, str], cfg: BenchConfig, upstream_site: str | None
) -> dict[str, str]:
    """A server's environment: the run's, the config's variables and, for upstream's
    configs, ``PYTHONPATH`` = ``upstream_site``'s isolation folder, ``upstream_site``, then
    the run's."""
    env = {**base_env, **cfg.env()}
    if cfg.stack == UPSTREAM_STACK:
        env = upstream_env(env, upstream_site)
    return env


def server_facts(port: int) -> dict:
    """What a server's ``/server_info`` says of its stack: ``version`` (sglang's, None if it
    gave none) and ``kv_canary_info`` (whether it carries a ``kv_canary`` entry, which this
    project's plugin adds on every server it runs in)."""
    status, info = http_json(port, "GET", "/server_info")
    if status != 200 or not isinstance(info, dict):
        return dict(version=None, kv_canary_info=None)
    return dict(version=info.get("version"), kv_canary_info="kv_canary" in info)


def run(args) -> int:
    names = parse_names(args.configs, CONFIG_TABLE, "--configs")
    if args.baseline not in names:
        raise SystemExit(
            f"--baseline {args.baseline!r} must be one of --configs ({', '.join(names)})"
        )
    if len(names) < 2:
        raise SystemExit("--configs: name the baseline and at least one more config")
    if args.rounds < 1 or args.warmup < 0:
        raise SystemExit(
            f"--rounds must be >= 1 and --warmup >= 0 (got {args.rounds}, {args.warmup})"
        )
    smoke = args.smoke_cpu
    if args.speculative != "none" and smoke:
        raise SystemExit(
            f"--speculative {args.speculative} cannot run with --smoke-cpu: "
            "sglang 0.5.12's CPU server has no speculative decoding"
        )
    if args.speculative != "none" and args.model != DEFAULT_MODEL:
        raise SystemExit(
            f"--speculative {args.speculative} needs --model {DEFAULT_MODEL} "
            f"(the draft's shape is that model's), got --model {args.model}"
        )
    check_upstream(
        names,
        upstream_site=args.upstream_site,
        piecewise=args.piecewise,
        speculative=args.speculative,
    )
    table_of = SMOKE_SCENARIOS if smoke else SCENARIOS
    scenario_names = args.scenarios or DEFAULT_SCENARIOS[args.speculative]
    scenarios = [table_of[n] for n in parse_names(scenario_names, SCENARIOS, "--scenarios")]
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
            cuda_graph_bs=(1, 32) if args.speculative != "none" else EngineSettings.cuda_graph_bs,
        )
    )
    draft_dir = None
    if smoke:
        from sglang.srt.kv_canary.testing.server_harness import (
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
        if args.speculative != "none":
            draft_dir = os.path.join(tmp, "draft")
            os.makedirs(draft_dir)
            pathlib.Path(draft_dir, "config.json").write_text(
                json.dumps(QWEN3_EAGLE_DRAFT_CONFIG, indent=1)
            )
    # the servers: each config's, plus the A/A control (a second server of the baseline's)
    server_names = names + ([args.baseline + CONTROL_SUFFIX] if args.control else [])
    baselines = stack_baselines(server_names, args.baseline)
    rotation = (
        args.start_rotation
        if args.start_rotation is not None
        else int(invocation, 16) % len(server_names)
    )
    start_order = rotated(server_names, rotation)
    if not smoke:
        fracs = memory_fractions(len(server_names), args.gpu_share or 0.8 / len(server_names))
    else:
        fracs = [None] * len(server_names)
    base_env.pop("SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT", None)  # per config below
    print(
        f"KV-canary interleaved overhead — {gpu} — {now_utc()} — configs {', '.join(names)} "
        f"(baseline {args.baseline}"
        + (f", A/A control {args.baseline + CONTROL_SUFFIX}" if args.control else "")
        + f") — started in the order {', '.join(start_order)} — {args.rounds} rounds after "
        f"{args.warmup} warm-up — idle schedulers: {args.idle} — results to {out}",
        flush=True,
    )
    started: dict[str, Server] = {}
    try:
        for name, frac in zip(start_order, fracs):
            cfg = server_config(name)
            kwargs = server_kwargs(
                settings.engine_kwargs(model_dir, smoke=smoke, draft_dir=draft_dir),
                cfg,
                mem_fraction=frac,
                idle=args.idle,
            )
            log_path = f"{out}.{name.replace('+', '_').replace('~', '_').replace(':', '_')}.log"
            t0 = time.perf_counter()
            srv = Server(name, cfg, kwargs, server_env(base_env, cfg, args.upstream_site), log_path)
            started[name] = srv
            srv.wait_ready(args.start_timeout)
            problem = canary_install_problem(
                srv.log(), canary_on=cfg.canary_on, speculative=args.speculative, stack=cfg.stack
            )
            if problem:
                raise SystemExit(
                    f"[{name}] {problem} (log {log_path}); its results would be invalid"
                )
            print(
                f"[{name}] up in {time.perf_counter() - t0:.0f} s on port {srv.port} "
                f"(mem fraction {frac}; log {log_path})",
                flush=True,
            )
        servers = {name: started[name] for name in server_names}  # rounds rotate from here
        facts = {name: server_facts(srv.port) for name, srv in servers.items()}
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
            idle=args.idle,
            piecewise=args.piecewise,
        )
        records = []
        for sc in scenarios:
            t0 = time.perf_counter()
            wall, server, decode, mismatched = measure(
                servers, sc, rounds=args.rounds, warmup=args.warmup, vocab=vocab
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
        f"{DEFAULT_SCENARIOS['none']}; with --speculative eagle "
        f"{DEFAULT_SCENARIOS['eagle']})",
    )
    ap.add_argument(
        "--speculative",
        default="none",
        choices=sorted(SPECULATIVE),
        help="eagle: every server decodes with EAGLE (a one-layer "
        "LlamaForCausalLMEagle draft of the model's shapes, topk 1, 3 steps, 4 "
        "draft tokens); each canary-on server must report the canary installed on "
        "its draft worker too",
    )
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="unrecorded rounds first")
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
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
        "--start-rotation",
        type=int,
        default=None,
        help="start the servers in the config order rotated by this much "
        "(default: a rotation drawn from the run's id)",
    )
    ap.add_argument(
        "--piecewise",
        default="on",
        choices=("on", "off"),
        help="sglang's piecewise CUDA graphs for prefill, every server alike "
        "(default on, sglang's default)",
    )
    ap.add_argument(
        "--idle",
        default="spin",
        choices=IDLE_MODES,
        help="spin (default, sglang's default): an idle scheduler polls in a busy "
        "loop; sleep: every server with sglang's --sleep-on-idle",
    )
    ap.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S)
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
