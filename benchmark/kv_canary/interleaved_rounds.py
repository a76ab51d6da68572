"""The interleaved rounds of ``bench_interleaved.py`` and what is read from them
(docs/user_guide.md, "Overhead"): each round's order (rotated, reversed every other cycle), one
scenario's rounds over every server, each server's baseline, the paired overheads with their
bootstrap intervals, the A/A control's verdict, the records and their Markdown table."""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence

from common import (
    UPSTREAM_PREFIX,
    UPSTREAM_STACK,
    Scenario,
    make_inputs,
    quantile,
    server_prefill_ms,
)
from interleaved_servers import CONTROL_SUFFIX, Server, server_config

BOOTSTRAP_SAMPLES = 2000
AA_LIMIT = 0.003  # a run resolves 0.5 % only where its A/A control stays within +-0.3 %
# no decode step of any model takes less: a decode time under this per token is not one (sglang
# 0.5.12's STANDALONE servers with every dummy draft accepted report about 4 ns per token)
MIN_DECODE_S_PER_TOKEN = 1e-5


# ---- statistics -------------------------------------------------------------------------------


def server_decode_ms(outs: list[dict]) -> float | None:
    """The decode time of one ``generate`` call as sglang's tokenizer manager measured it
    (first output token to finish, per request: ``(completion_tokens - 1) /
    decode_throughput``), the batch's median, in ms; None when the outputs have a single
    token or no such figures, or when a request's figure is under
    ``MIN_DECODE_S_PER_TOKEN`` per token (not a decode time: the record then has no decode
    figure, as for a prefill)."""
    times = []
    for o in outs:
        meta = o.get("meta_info", {})
        n, tput = meta.get("completion_tokens"), meta.get("decode_throughput")
        if not n or n < 2 or not tput:
            return None
        if (n - 1) / tput < (n - 1) * MIN_DECODE_S_PER_TOKEN:
            return None
        times.append((n - 1) / tput * 1e3)
    return statistics.median(times) if times else None


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


# ---- the rounds -------------------------------------------------------------------------------


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


ISOLATE_SETTLE_S = 0.05  # after a server is continued, before its request


def measure(
    servers: dict[str, Server],
    sc: Scenario,
    *,
    rounds: int,
    warmup: int,
    vocab: int,
    isolate: bool = False,
    repeat: int = 1,
) -> tuple[dict[str, list[float]], dict[str, list], dict[str, list], int]:
    """Warm-up rounds, then ``rounds`` rounds of ``sc`` over ``servers``: per server the wall
    ms, the server's prefill ms and its decode ms per round (None where sglang gave none), and
    the number of rounds whose outputs disagreed between servers of one stack (another sglang's
    outputs differ by design). ``repeat``: each server is sent the round's request that many
    times in a row, and its figures of the round are the medians of those requests' (a
    request's own noise shrinks, the rounds' pairing stays). ``isolate``: every server but the
    one being sent its requests is paused (``Server.pause``; continued ``ISOLATE_SETTLE_S``
    before them, paused after them), and all are continued when the rounds end, however they
    end."""
    if repeat < 1:
        raise ValueError(f"--repeat {repeat}: allowed 1 or more")
    wall = {n: [] for n in servers}
    server = {n: [] for n in servers}
    decode = {n: [] for n in servers}
    mismatched = 0
    if isolate:
        for srv in servers.values():
            srv.pause()
    try:
        for k in range(-warmup, rounds):
            mismatched += _one_round(
                servers,
                sc,
                k,
                vocab,
                isolate=isolate,
                repeat=repeat,
                wall=wall,
                server=server,
                decode=decode,
            )
    finally:
        if isolate:
            for srv in servers.values():
                srv.resume()
    return wall, server, decode, mismatched


def _median_or_none(values: list) -> float | None:
    """The median of ``values``, None if any is None (sglang gave no such figure)."""
    return None if None in values else statistics.median(values)


def _one_round(servers, sc, k, vocab, *, isolate, repeat, wall, server, decode) -> int:
    """Round ``k`` of :func:`measure`: 1 if its outputs disagreed within a stack (between
    servers, or between one server's ``repeat`` requests), else 0."""
    ids = make_inputs(sc, k, vocab)
    by_stack: dict[str, set] = {}
    for name in round_order(list(servers), k):
        if isolate:
            servers[name].resume()
            time.sleep(ISOLATE_SETTLE_S)
        answers = []
        try:
            for _ in range(repeat):
                answers.append(servers[name].generate(ids, sc.osl))
        finally:
            if isolate:
                servers[name].pause()
        seen = by_stack.setdefault(server_config(name).stack, set())
        for _, outs in answers:
            seen.add(json.dumps([o["output_ids"] for o in outs]))
        if k >= 0:
            wall[name].append(statistics.median(ms for ms, _ in answers))
            server[name].append(_median_or_none([server_prefill_ms(o) for _, o in answers]))
            decode[name].append(_median_or_none([server_decode_ms(o) for _, o in answers]))
    return int(k >= 0 and any(len(seen) > 1 for seen in by_stack.values()))


def control_names(names: Sequence[str], baseline: str) -> list[str]:
    """The A/A controls of a run of ``names``: a second server of this project's baseline and,
    where an ``up:`` config other than upstream's baseline runs, of upstream's (each stack's
    overheads are resolved by its own pair)."""
    base = baseline.removeprefix(UPSTREAM_PREFIX)
    up_base = UPSTREAM_PREFIX + base
    out = [base + CONTROL_SUFFIX]
    if any(server_config(n).stack == UPSTREAM_STACK and n != up_base for n in names):
        out.append(up_base + CONTROL_SUFFIX)
    return out


def twin_names(names: Sequence[str], twins: Sequence[str], baseline: str) -> list[str]:
    """A second server of each config in ``twins`` (``<config>~aa``), compared with its
    config, not its stack's baseline: how far two servers of a canary config differ. Each must
    be among ``names`` and not a stack's baseline (those twins are the A/A controls)."""
    base = baseline.removeprefix(UPSTREAM_PREFIX)
    out = []
    for t in twins:
        if t not in names:
            raise SystemExit(f"--twins {t}: not among --configs ({', '.join(names)})")
        if t in (base, UPSTREAM_PREFIX + base):
            raise SystemExit(
                f"--twins {t}: a stack's baseline; its twin is the A/A control (--control)"
            )
        out.append(t + CONTROL_SUFFIX)
    return out


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
    ``decode_overhead``. The A/A control's record (``control``: true, the twin of a stack's
    baseline) is the run's resolution; another config's twin (``twin``: true) is compared
    with that config. ``facts``: each server's :func:`server_facts`, recorded."""
    recs = []
    for name in wall:
        baseline = baselines[name]
        config = name.removesuffix(CONTROL_SUFFIX)
        twin = name.endswith(CONTROL_SUFFIX)
        control = twin and baselines.get(config) == config
        rec = dict(
            kind="interleaved",
            config=config,
            server_name=name,
            control=control,
            twin=twin and not control,
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
    # each stack's A/A control decides for that stack's configs
    controls = {
        (r["invocation"], r["scenario"], r.get("stack")): r for r in records if r.get("control")
    }
    for r in records:
        w, s, d = r["wall"], r.get("server"), r.get("decode")
        control = controls.get((r.get("invocation"), r["scenario"], r.get("stack")))
        name = (
            f"{r['config']} (A/A control)"
            if r.get("control")
            else f"{r['config']} (twin)"
            if r.get("twin")
            else r["config"]
        )
        spec = "" if r.get("speculative", "none") == "none" else f", {r['speculative']}"

        def cell(key: str) -> str:
            if f"{key}_overhead" not in r:
                return (
                    "(baseline)"
                    if r["config"] == r["baseline"] and not (r.get("control") or r.get("twin"))
                    else "—"
                )
            text = _interval(r[f"{key}_overhead"])
            if r.get("control"):
                return text
            if r.get("twin"):
                return f"{text} (against {r['config']})"
            return f"{text} ({resolved(r, control, key)})"

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
