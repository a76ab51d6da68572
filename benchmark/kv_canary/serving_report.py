"""The tables of ``bench_serving_overhead.py`` (``--report FILE...`` and the end of each run):
Engine runs, the scheduler's prefill time, the per-launch GPU breakdown."""

from __future__ import annotations

from collections.abc import Sequence

from common import (
    CONFIGS,
    DEFAULT_MODEL,
    SCENARIOS,
    quantile,
    read_jsonl,
)

HOST_PHASES = (
    "batch init (token snapshot)",
    "outside pre-ops",
    "inside pre-ops",
    "inside post-ops",
    "outside post-ops + read-back",
)


# ---- report ----------------------------------------------------------------------------------


def pct(on: float, off: float) -> str:
    return f"{(on - off) / off * 100:+.2f} %"


def _latest_rows(records: list[dict]) -> list[dict]:
    """The latest record per (model, scenario, speculative, config, invocation), in table
    order (model, speculative, scenario, config)."""
    latest: dict[tuple, dict] = {}
    for r in records:
        latest[
            (
                r.get("model", DEFAULT_MODEL),
                r["scenario"],
                r.get("speculative", "none"),
                r["config"],
                r["invocation"],
            )
        ] = r
    order = {n: i for i, n in enumerate(CONFIGS)}
    sc_order = {n: i for i, n in enumerate(SCENARIOS)}
    return sorted(
        latest.values(),
        key=lambda r: (
            r.get("model", DEFAULT_MODEL),
            r.get("speculative", "none"),
            sc_order.get(r["scenario"], 99),
            order.get(r["config"], 99),
            r["time"],
        ),
    )


def _baseline(rows: list[dict], r: dict) -> tuple[dict | None, bool]:
    """The ``off`` row ``r`` is compared with: the same invocation's (same model, scenario
    and speculative setting) when there is one, else the latest; and whether it is from
    another invocation."""
    offs = [
        o
        for o in rows
        if o["config"] == "off"
        and o["scenario"] == r["scenario"]
        and o.get("speculative", "none") == r.get("speculative", "none")
        and o.get("model", DEFAULT_MODEL) == r.get("model", DEFAULT_MODEL)
    ]
    same = [o for o in offs if o["invocation"] == r["invocation"]]
    if same:
        return same[-1], False
    return (offs[-1], True) if offs else (None, False)


def _overheads(
    r: dict, base: dict | None, cross: bool, median: str, minimum: str
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
    lines = [
        f"{title}",
        "",
        (
            "| scenario | config | runs | median ms | min ms | p10 / p90 ms | "
            "ms / output token (median) | overhead (median) | overhead (min) |"
        ),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = _latest_rows(records)
    any_cross = False
    for r in rows:
        base, cross = _baseline(rows, r)
        any_cross |= cross
        ov_med, ov_min = _overheads(r, base, cross, "median_ms", "min_ms")
        per_tok = f"{r['median_ms'] / r['osl']:.3f}" if r["osl"] > 1 else "—"
        spec = "" if r.get("speculative", "none") == "none" else f", {r['speculative']}"
        spread = (
            f"{r['p10_ms']:.1f} / {r['p90_ms']:.1f}"
            if "p10_ms" in r
            else f"{quantile(r['runs_ms'], 0.1):.1f} / {quantile(r['runs_ms'], 0.9):.1f}"
        )
        pw = "" if r.get("settings", {}).get("piecewise", False) else ", pw off"
        if r.get("model", DEFAULT_MODEL) != DEFAULT_MODEL:
            pw += f", {r['model']}"
        lines.append(
            f"| {r['scenario']} (bs{r['bs']} isl{r['isl']} osl{r['osl']}{spec}{pw}) | "
            f"{r['config']} | {len(r['runs_ms'])} | {r['median_ms']:.1f} | "
            f"{r['min_ms']:.1f} | {spread} | {per_tok} | {ov_med} | "
            f"{ov_min} |"
        )
    if any_cross:
        lines += [
            "",
            (
                "\\* overhead against an `off` measured in another invocation (another "
                "Engine start, possibly another machine)."
            ),
        ]
    return "\n".join(lines)


def server_table(records: list[dict], title: str) -> str:
    """Per scenario x config with server-side prefill times: their median / min and the
    overhead against ``off`` of the same invocation (else the latest ``off``, marked *)."""
    rows = _latest_rows([r for r in records if "server_median_ms" in r])
    if not rows:
        return f"{title}: no server-side times (run with --server-timing on)"
    lines = [
        title,
        "",
        (
            "| scenario | config | runs | server median ms | server min ms | "
            "p10 / p90 ms | overhead (median) | overhead (min) |"
        ),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        base, cross = _baseline(rows, r)
        ov_med, ov_min = _overheads(r, base, cross, "server_median_ms", "server_min_ms")
        model = "" if r.get("model", DEFAULT_MODEL) == DEFAULT_MODEL else f", {r['model']}"
        lines.append(
            f"| {r['scenario']} (bs{r['bs']} isl{r['isl']} osl{r['osl']}{model}) | "
            f"{r['config']} | {len(r['server_runs_ms'])} | "
            f"{r['server_median_ms']:.2f} | {r['server_min_ms']:.2f} | "
            f"{r['server_p10_ms']:.2f} / {r['server_p90_ms']:.2f} | {ov_med} | "
            f"{ov_min} |"
        )
    return "\n".join(lines)


BREAKDOWN_ORDER = (
    "token-id scatter (outside graph)",
    "plan input fill",
    "plan kernels",
    "HEAD verify",
    "HEAD + TAIL chain write",
    "TAIL verify",
    "TAIL fingerprint write",
    "status copy + rest of post-ops",
    "rest of pre-ops",
    "forward-stream total (sum)",
    "CUDA-graph replay of the in-graph ops",
    "D2H staging (side stream, copy engine)",
    "unattributed device time",
)


def breakdown_table(records: list[dict]) -> str:
    if not records:
        return "Breakdown: no results"
    unit = records[0]["unit"]
    keys = sorted(
        {(r["config"], r["bs"]) for r in records},
        key=lambda k: (list(CONFIGS).index(k[0]) if k[0] in CONFIGS else 99, k[1]),
    )
    latest = {(r["config"], r["bs"]): r for r in records}
    head = " | ".join(f"{c} bs{bs}" for c, bs in keys)
    lines = [
        (
            f"Canary {unit} per decode step (context {records[0]['ctx']} tokens; "
            f"{records[0]['steps']} steps; {records[0]['gpu']}, {records[0]['time']})"
        ),
        "",
        f"| launch | {head} |",
        "| --- |" + " ---: |" * len(keys),
    ]
    for label in BREAKDOWN_ORDER:
        vals = [latest[k]["launches"].get(label) for k in keys]
        if all(v is None for v in vals):
            continue
        cells = " | ".join("—" if v is None else f"{v:.1f}" for v in vals)
        bold = "**" if label == "forward-stream total (sum)" else ""
        lines.append(f"| {bold}{label}{bold} | {cells} |")
    lines += [
        "",
        ("Kernels by name (same steps, µs per step; HEAD and TAIL launches of one kernel add up):"),
        "",
    ]
    for k in keys:
        by = latest[k]["by_kernel"]
        top = sorted(by.items(), key=lambda kv: -kv[1])[:8]
        lines.append(
            f"- {k[0]} bs{k[1]}: "
            + ("; ".join(f"`{n[:60]}` {v:.1f}" for n, v in top) or "(no device kernels recorded)")
        )
    lines += [
        "",
        (
            "The model's own decode step time: the Engine runs (ms / output token of "
            "the decode scenarios)."
        ),
    ]
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
        out += [
            "",
            (
                "Settings: Qwen3-0.6B-shaped dummy model, "
                f"attention {kw.get('attention_backend')}, CUDA graphs "
                f"{'off' if kw.get('disable_cuda_graph') else 'bs ' + str(kw.get('cuda_graph_bs'))}, "
                f"piecewise graphs {'off' if kw.get('disable_piecewise_cuda_graph') else 'on'}, "
                f"chunked prefill {kw.get('chunked_prefill_size')}, "
                f"max running requests {kw.get('max_running_requests')}, KV pool "
                f"{kw.get('max_total_tokens')} tokens, mem fraction {kw.get('mem_fraction_static')}; "
                "radix cache flushed before every run; latency = wall time of one "
                "`Engine.generate` over the batch; median / min over the runs after one warm-up."
            ),
            "",
        ]
        out.append(engine_table(eng, title="## End-to-end latency"))
        out += ["", server_table(eng, title="## Server-side prefill time")]
    if hbd:
        out += ["", "## Canary host time per bs1 prefill", "", host_breakdown_table(hbd)]
    if brk:
        out += ["", "## Canary GPU time per decode step", "", breakdown_table(brk)]
        step_ms = {
            r["bs"]: r["median_ms"] / r["osl"] for r in eng if r["config"] == "off" and r["osl"] > 1
        }
        shares = []
        for r in brk:
            graph = r["launches"].get("CUDA-graph replay of the in-graph ops")
            if graph is not None and r["bs"] in step_ms:
                shares.append(
                    f"{r['config']} bs{r['bs']}: {graph:.1f} µs / "
                    f"{step_ms[r['bs']] * 1e3:.0f} µs = "
                    f"{graph / (step_ms[r['bs']] * 1e3) * 100:.2f} %"
                )
        if shares:
            out += [
                "",
                (
                    "In-graph canary time as a share of the `off` decode step (Engine "
                    "latency / osl, which includes the prefill):"
                ),
                "",
            ]
            out += [f"- {line}" for line in shares]
    print("\n".join(out))


def host_breakdown_table(rows: list[dict]) -> str:
    if not rows:
        return "Host breakdown: no results"
    head = " | ".join(HOST_PHASES)
    lines = [
        f"Host µs per bs1 prefill (median of {rows[0]['runs']}; {rows[0]['gpu']}, "
        f"{rows[0]['time']}; chunk {rows[0]['chunk']})",
        "",
        f"| config | prompt | {head} | before the forward | sum | ruler µs | sum / ruler |",
        "| --- | ---: |" + " ---: |" * (len(HOST_PHASES) + 4),
    ]
    for r in rows:
        cells = " | ".join(f"{r['median_us'][p]:.0f}" for p in HOST_PHASES)
        total = sum(r["median_us"][p] for p in HOST_PHASES)
        # records from before the ruler have none
        ruler = f"{r['ruler_us']:.1f} | {r['sum_per_ruler']:.2f}" if "ruler_us" in r else "— | —"
        lines.append(
            f"| {r['config']} | {r['isl']} | {cells} | **{r['before_forward_us']:.0f}** | "
            f"{total:.0f} | {ruler} |"
        )
    lines.append(
        "\nsum / ruler: the median over the prefills of the phases' sum divided by the host "
        "ruler timed just before each (a fixed workload of Python and small torch calls): "
        "comparable across runs on a machine whose host speed changes."
    )
    return "\n".join(lines)
