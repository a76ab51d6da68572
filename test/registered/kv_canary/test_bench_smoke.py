"""The benchmarks' CPU smoke modes run in CPU CI, so a benchmark cannot rot between GPU
sessions: ``bench_kernels.py --smoke`` (every public launcher on the script's own state,
byte-compared with its torch reference), ``bench_sweep.py --smoke --layers 2`` (the radix sweep
and the per-layer check on a clean cache) and ``bench_serving_overhead.py --smoke-cpu
--breakdown`` (the canary's launches of a decode step, per config, on real CPU pools). The
numbers of a CPU run mean nothing; what is checked is that each script still builds valid
inputs for today's kernels and runtime and that its table says what it measured.
(``bench_kernels.py`` once built an 8-column violation ring after the ring grew to
``VIOLATION_NUM_FIELDS`` columns, and failed at its first verify; nothing ran it.)
``bench_interleaved.py`` has its own test; ``bench_serving_overhead.py --smoke-cpu`` (Engine
runs, ~3 min) and ``bench_hicache.py`` (GPU only) are not run here; of its Engine runs, the
checks of each ``--speculative`` mode are (its refusals, an Engine's canary lines)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from typing import Dict, List, Optional

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=205, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow  # three subprocess runs, ~2 min together

BENCH_DIR = pathlib.Path(__file__).resolve().parents[3] / "benchmark" / "kv_canary"


def _run(script: str, *args: str, interpret: bool = False) -> str:
    """``script``'s stdout (it must exit 0). ``interpret``: the kernels in Triton's interpreter
    (the scripts that compare kernels' bytes); else the torch references on the CPU tensors, as
    a CPU server runs them (the interpreter costs a benchmark of the runtime minutes here)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _table(text: str, first_header_cell: str) -> List[Dict[str, str]]:
    """The markdown table of ``text`` whose header starts with ``first_header_cell``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header_cell} |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def test_bench_kernels_smoke_checks_every_kernel_in_every_mode(tmp_path):
    out = tmp_path / "kernels.md"
    _run("bench_kernels.py", "--smoke", "--out", str(out), interpret=True)
    rows = _table(out.read_text(), "kernel")
    measured = [r for r in rows if r["kernel"] != "all"]
    scenarios = {r["scenario"] for r in measured}
    assert any(s.startswith("decode") for s in scenarios)
    assert any(s.startswith("prefill") for s in scenarios)
    for scenario in scenarios:
        got = {
            (r["kernel"], r["mode"]): r["checked"] for r in measured if r["scenario"] == scenario
        }
        assert got[("plan", "n/a")] == "ref(cpu)" and got[("scatter", "n/a")] == "ref(cpu)"
        for mode in ("none", "partial", "all"):
            assert got[("verify", mode)] == "ref(cpu)+clean", (scenario, mode, got)
            assert got[("write", mode)] in ("ref(cpu)+clean", "clean"), (scenario, mode, got)
    # the shapes too large for the smoke run say so instead of vanishing
    skipped = [r for r in rows if r["kernel"] == "all"]
    assert skipped and all(r["µs eager (median)"].startswith("skipped: pool") for r in skipped)


def test_bench_chain_walk_compares_two_kernels_only_when_they_write_the_same(tmp_path):
    """The paired walk benchmark first checks that the two kernels leave the same bytes: a
    copy of this tree's kernel passes (laid out as a server's launch: a larger plan, padded
    inputs), one that counts its launches twice stops it."""
    own = BENCH_DIR.parents[1] / "python/sglang/jit_kernel/kv_canary/write.py"
    out = _run(
        "bench_chain_walk.py",
        "--against",
        str(own),
        "--smoke-cpu",
        "--tokens",
        "64",
        "--req-capacity",
        "40",
        "--token-capacity",
        "300",
        interpret=True,
    )
    assert "capacities {'req_capacity': 40, 'token_capacity': 300}" in out, out
    assert out.count("records, ring and counters identical") == 2, out
    for flags, said in (
        (["--tokens", "5x"], "--tokens: expected"),
        (["--req-capacity", "-4"], "--req-capacity: a count"),
    ):
        refused = subprocess.run(
            [sys.executable, str(BENCH_DIR / "bench_chain_walk.py"), "--against", str(own)]
            + ["--smoke-cpu", *flags],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert refused.returncode != 0 and said in refused.stderr, (flags, refused.stderr)
    bad = tmp_path / "write.py"
    text = own.read_text()
    count = "tl.atomic_add(kc0_ptr, 1)"
    assert text.count(count) == 1
    bad.write_text(text.replace(count, count.replace("1)", "2)")))
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_chain_walk.py"), "--against", str(bad)]
        + ["--smoke-cpu"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0 and "kernel_run_counter differ" in proc.stdout + proc.stderr


def test_bench_chain_scan_times_the_scan_only_when_it_writes_the_reference_chain(tmp_path):
    """The scan prototype's records are checked against its serial Python reference before
    anything is timed: this tree's script passes (a prefill of three blocks: the carry between
    them), a copy whose blocks do not carry the chain state stops with the difference named.
    The copy runs beside this tree's script."""
    text = (BENCH_DIR / "bench_chain_scan.py").read_text()
    carry = "state_h = tl.sum(tl.where(last, after_h, 0), axis=0)"
    assert text.count(carry) == 1
    bad = tmp_path / "bench_chain_scan.py"
    bad.write_text(text.replace(carry, "state_h = state_h"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR), env.get("PYTHONPATH", "")])
    with subprocess.Popen(
        [sys.executable, str(bad), "--smoke-cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    ) as proc:
        out = _run("bench_chain_scan.py", "--smoke-cpu", interpret=True)
        bad_out, _ = proc.communicate(timeout=600)
    assert out.count("the scan's records equal the reference's") == 2, out
    assert proc.returncode != 0, bad_out
    assert "the scan's records differ from the reference" in bad_out


def test_bench_sweep_smoke_sweeps_a_clean_cache_in_every_mode(tmp_path):
    out = tmp_path / "sweep.md"
    _run("bench_sweep.py", "--smoke", "--layers", "2", "--out", str(out))
    rows = _table(out.read_text(), "cached tokens")
    assert [r["mode"] for r in rows] == ["none", "partial", "all"]
    for r in rows:
        assert int(r["cached tokens"]) > 0 and r["violations"] == "0"
        assert float(r["total ms"]) > 0
        per_layer = r["every layer (plan + per-layer check) ms"]
        assert (per_layer == "-") == (r["mode"] == "none"), r


def test_bench_serving_overhead_breakdown_smoke_times_every_launch():
    text = _run("bench_serving_overhead.py", "--smoke-cpu", "--breakdown")
    rows = {r["launch"]: r for r in _table(text, "launch")}
    configs = [c for c in rows["plan kernels"] if c != "launch"]
    assert {"raise bs1", "raise+token bs1", "raise+token+partial bs4"} <= set(configs)
    for launch in (
        "plan kernels",
        "HEAD verify",
        "HEAD + TAIL chain write",
        "TAIL verify",
        "**forward-stream total (sum)**",
    ):
        assert all(float(rows[launch][c]) > 0 for c in configs), (launch, rows[launch])
    # the fingerprint part of the TAIL write launches only with real data
    sys.path.insert(0, str(BENCH_DIR))
    from common import CONFIGS

    fingerprints = rows["TAIL fingerprint write"]
    for c in configs:
        if CONFIGS[c.rsplit(" bs", 1)[0]].real_data != "none":
            assert float(fingerprints[c]) > 0, (c, fingerprints[c])
        else:
            assert fingerprints[c] == "—", (c, fingerprints[c])
    # the token-id upload (snapshot + scatter) ran in every config with token checks
    scatter = rows["token-id scatter (outside graph)"]
    for c in configs:
        if "token" in c:
            assert float(scatter[c]) > 0, (c, scatter[c])
        else:
            assert scatter[c] == "—", (c, scatter[c])


def test_bench_serving_overhead_host_breakdown_detail_times_each_method():
    """``--host-breakdown --host-breakdown-detail --host-breakdown-cprofile``: the phase table,
    per config and prompt a table of the canary's per-forward methods, each called once per
    prefill of one chunk (the token snapshot only with token checks), and the two cProfile
    listings (before the forward, after it) after the detail table."""
    text = _run(
        "bench_serving_overhead.py",
        "--smoke-cpu",
        "--host-breakdown",
        "32",
        "--configs",
        "raise,raise+token",
        "--host-breakdown-detail",
        "--host-breakdown-cprofile",
    )
    for config in ("raise", "raise+token"):
        for part in ("batch init + outside pre-ops", "inside post-ops + outside post-ops"):
            head = f"[{config} isl 32] cProfile of 2 prefills' {part}"  # 2 in a smoke run
            assert text.count(head) == 1, (head, text[-3000:])
            listing = text.split(head, 1)[1][:6000]
            assert "(top 30 by own time):\n| function | calls per prefill" in listing[:200], listing
            assert "| (all " in listing, listing
    phases = _table(text, "config")
    assert [r["config"] for r in phases] == ["raise", "raise+token"]
    for r in phases:
        # the host ruler beside each row: the sum of the phases (as printed) and its ratio
        phases_of_row = list(r)[2:-4]  # between the prompt and "before the forward"
        assert len(phases_of_row) == 5 and list(r)[-4] == "before the forward", r
        phase_sum = sum(float(r[p]) for p in phases_of_row)
        assert abs(float(r["sum"]) - phase_sum) <= len(phases_of_row), r
        ruler, ratio = float(r["ruler µs"]), float(r["sum / ruler"])
        assert ruler > 0 and ratio > 0, r
    tables = text.split("host µs per call of the canary's methods")[1:]
    assert len(tables) == 2
    for config, part in zip(("raise", "raise+token"), tables):
        rows = {r["method"]: r for r in _table(part, "method")}
        for method in (
            "CanaryManager.after_forward",
            "device_host.stage",
            "device_host._gather",
            "sfm.post_ops_maybe_inside_graph",
        ):
            assert rows[method]["calls per prefill"] == "1.0", (config, rows.get(method))
            assert float(rows[method]["µs per call (median)"]) > 0
        assert ("token_history.snapshot" in rows) == (config == "raise+token"), rows.keys()


def test_bench_prefill_device_time_smoke_runs_and_traces_every_stand_in(tmp_path):
    """``bench_prefill_device_time.py --smoke-cpu --trace DIR``: per prompt a row for canary
    off, the A/A control and each config (the canary's no-model time only for canary-on rows),
    with the same figures in the JSON lines; a Chrome trace per prompt and stand-in, and its
    timeline printed with the host phases in order (on the CPU no kernels: the phases only)."""
    out = tmp_path / "d.jsonl"
    traces = tmp_path / "traces"
    traces.mkdir()
    text = _run(
        "bench_prefill_device_time.py",
        "--smoke-cpu",
        "--isls",
        "32,48",
        "--configs",
        "raise,raise+token",
        "--out",
        str(out),
        "--trace",
        str(traces),
    )
    rows = _table(text, "prompt")
    assert [(r["prompt"], r["config"]) for r in rows] == [
        (isl, c) for isl in ("32", "48") for c in ("off", "off (A/A)", "raise", "raise+token")
    ]
    for r in rows:
        assert float(r["prefill median ms"]) >= float(r["results median ms"]) > 0
        assert (r["paired overhead, results (median)"] == "(baseline)") == (r["config"] == "off")
        assert (r["canary alone, no model (ms)"] == "—") == r["config"].startswith("off")
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["isl"], r["config"]) for r in recs] == [
        (int(a), b) for a, b in ((r["prompt"], r["config"]) for r in rows)
    ]
    names = sorted(f.name for f in traces.iterdir())
    assert len(names) == 8 and all(n.endswith(".json") for n in names), names  # 2 prompts x 4
    for isl in ("32", "48"):
        assert {f"trace_{isl}_off.json", f"trace_{isl}_off_A_A_.json"} <= set(names), names
        assert f"trace_{isl}_raise.json" in names, names
    timeline = text.split("-- timeline 32_raise ")[1].split("--")[0]
    phases = [line.split()[-1] for line in timeline.splitlines()[1:] if "host" in line]
    assert phases == [
        "canary.pre",
        "model",
        "canary.post",
        "canary.post_outside+read-back",
        "results",
        "token_wait",
        "sync",
    ], phases
    assert "-- timeline 32_off " in text and "-- timeline 32_off (A/A) " in text


@pytest.mark.parametrize(
    "script, message",
    [
        ("bench_host_primitives.py", "bench_host_primitives.py needs a CUDA GPU"),
        ("probe_graph_event_wait.py", "probe_graph_event_wait: needs a CUDA GPU"),
        ("diag_multi_layer_eagle.py", "diag_multi_layer_eagle: needs a CUDA GPU"),
    ],
)
def test_a_cuda_only_script_says_it_needs_a_gpu(script, message):
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / script)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert message in proc.stderr


def test_the_multi_layer_eagle_diagnostic_refuses_an_unknown_case_and_reads_sglangs_error():
    """``diag_multi_layer_eagle.py``: an unknown ``--cases`` entry is refused naming the flag,
    the value and the cases allowed; each case runs EAGLE with its spec version and graphs; a
    case's error is the last exception line of its output."""
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "diag_multi_layer_eagle.py"), "--cases", "spec_v3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "--cases 'spec_v3': unknown ['spec_v3']; allowed: spec_v2-graphs" in proc.stderr
    sys.path.insert(0, str(BENCH_DIR))
    from diag_multi_layer_eagle import CASES, case_kwargs, last_error

    for case in CASES:  # EAGLE on the Step-3.5's own directory, the case's spec and graphs
        kw = case_kwargs(case, "/step3p5")
        assert (kw["speculative_algorithm"], kw["speculative_draft_model_path"]) == (
            "EAGLE",
            "/step3p5",
        )
        assert kw.get("disable_overlap_schedule", False) == case.startswith("spec_v1"), kw
        assert kw.get("disable_cuda_graph", False) == case.endswith("eager"), kw

    out = (
        "Traceback (most recent call last):\n  File x\nKeyError: 3\nduring handling\n"
        "Traceback (most recent call last):\nAttributeError: 'X' object has no attribute "
        "'buffers'\n[2026] scheduler exited\n"
    )
    assert last_error(out) == "AttributeError: 'X' object has no attribute 'buffers'"
    assert last_error("served 12 requests\n") == ""


def test_abort_storm_classifies_what_a_client_gets():
    """The storm of ``abort_storm.py`` (``canary_support/storm.py``; its server runs are in the soak
    test): how it reads a response. Completed, aborted by the canary (HTTP 500 with either of
    its messages, or a 200 whose finish reason is an abort), and anything else an error."""
    from sglang.srt.kv_canary.violations.containment import PREFIX_ABORT_MESSAGE
    from canary_support import storm

    ok = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}}}
    assert storm.outcome(200, ok) == ("ok", [5, 6])
    direct = {"error": {"message": storm.ABORT_MESSAGE + "HEAD_K_FULL, fail_reason=x)"}}
    assert storm.outcome(500, direct)[0] == "aborted"
    assert storm.outcome(500, {"error": {"message": PREFIX_ABORT_MESSAGE}})[0] == "aborted"
    streamed = {
        "output_ids": [5],
        "meta_info": {"finish_reason": {"type": "abort", "message": PREFIX_ABORT_MESSAGE}},
    }
    assert storm.outcome(200, streamed) == ("aborted", PREFIX_ABORT_MESSAGE)
    assert storm.outcome(500, {"error": {"message": "Out of memory"}})[0] == "error"
    assert storm.outcome(400, {"raw": "bad"})[0] == "error"
    # the request list: deterministic, shared prefixes, longer than a 32-token chunk mostly
    reqs = storm.request_list(48, seed=7)
    assert reqs == storm.request_list(48, seed=7) and len(reqs) == 48
    assert len({tuple(ids[:16]) for ids, _ in reqs}) <= 6
    assert sum(len(ids) > 32 for ids, _ in reqs) > 24
    assert all(4 <= n <= 24 for _, n in reqs)


def test_host_breakdown_profile_table_is_per_prefill(monkeypatch):
    """``--host-breakdown-cprofile``'s table: a function's calls and times divided by the
    prefills profiled, most own time first, the total of every function last."""
    import cProfile
    import pstats

    monkeypatch.syspath_prepend(str(BENCH_DIR))
    from host_breakdown import profile_table

    def busy():
        return sum(range(20_000))

    def light():
        return 1

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(40):
        busy()
        light()
    prof.disable()
    stats = pstats.Stats(prof)
    lines = profile_table(stats, prefills=20).splitlines()
    assert lines[0].startswith("| function | calls per prefill | own µs per prefill")
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    rows = {r[0]: r for r in cells[2:-1]}
    busy = next(r for k, r in rows.items() if k.endswith("(busy)"))
    light = next(r for k, r in rows.items() if k.endswith("(light)"))
    assert busy[1] == "2.0" and light[1] == "2.0", (busy, light)
    own = [float(r[2]) for r in cells[2:-1]]
    assert own == sorted(own, reverse=True), own
    busy_key = next(k for k in stats.stats if k[2] == "busy")
    assert abs(float(busy[2]) - stats.stats[busy_key][2] / 20 * 1e6) < 0.1, busy
    total = sum(v[2] for v in stats.stats.values()) / 20 * 1e6
    assert cells[-1][0].startswith("(all ") and abs(float(cells[-1][2]) - total) < 0.1, cells[-1]


def test_storm_counts_kept_faults_on_positions_the_request_owned():
    """The storm's reclaim check counts only the kept faults that rewrote an entry its
    request owned (decoded past its prompt's last full page; the prompt's pages are the radix
    tree's): the request is the first rid of the violation its forward reported at a rewritten
    position of that row; a fault no violation names is not counted, nor one on a request heal
    mode took back before it (its recomputation cached its output's pages in the tree)."""
    from sglang.srt.kv_canary.perturb.config import FaultKind
    from sglang.srt.kv_canary.perturb.report import format_perturb_line
    from sglang.srt.kv_canary.violations.lines import ViolationLine
    from canary_support.storm import kept_faults_on_own_positions

    def kept(step, row, pos, **extra):
        return format_perturb_line(
            FaultKind.REQ_TO_TOKEN_KEPT, step=step, req_pool_idx=row, position=pos, **extra
        )

    def seen(step, row, read_position, *rids):
        return ViolationLine(
            launch_tag="HEAD_K_FULL",
            fail_reasons=("verify_position",),
            slot_idx=7,
            position=0,
            stored_token=1,
            expected_token=1,
            stored_chain_hash=0,
            expected_aux=0,
            forward_step=step,
            read_position=read_position,
            req_to_token_row=row,
            seen_by=("HEAD_K_FULL",),
            kv_layer=-1,
            rids=rids,
        )

    prompts = {"r0-0": 40, "r1-1": 40}
    log = "\n".join(
        [
            kept(10, 3, 41),  # decoded position of r0-0: its own
            kept(11, 3, 39),  # the prompt's last token: the tree's
            kept(12, 4, 45),  # no violation names it
            format_perturb_line(FaultKind.REQ_TO_TOKEN, step=13, req_pool_idx=3, position=42),
            "an unrelated line",
        ]
    )
    violations = [
        seen(10, 3, 41, "r0-0", "r1-1"),
        seen(11, 3, 39, "r0-0"),
        seen(12, 5, 45, "r1-1"),  # another row
        seen(13, 3, 42, "r0-0"),  # the undone fault
    ]
    assert kept_faults_on_own_positions(log, violations, prompts, 1) == 1
    # the row's own request is the first rid: r1-1's prompt is longer than position 41
    violations[0] = seen(10, 3, 41, "r1-1", "r0-0")
    assert kept_faults_on_own_positions(log, violations, {"r0-0": 40, "r1-1": 50}, 1) == 0
    # page size 16: a page-wide fault owns from the prompt's last full page (40 // 16 * 16)
    paged = "\n".join([kept(20, 2, 32, entries=16), kept(21, 2, 16, entries=16)])
    pages = [seen(20, 2, 37, "r0-0"), seen(21, 2, 20, "r0-0")]
    assert kept_faults_on_own_positions(paged, pages, prompts, 16) == 1
    # heal mode took r0-0 back before the fault: its recomputation's prefill cached its
    # output's pages too, so the decoded position is no longer known to be its own; a take-back
    # after the fault changes nothing
    took_back = "kv_canary heal: took back rids=r0-0 (their KV freed; computed again)"
    violations[0] = seen(10, 3, 41, "r0-0", "r1-1")
    assert kept_faults_on_own_positions(log + "\n" + took_back, violations, prompts, 1) == 1
    assert kept_faults_on_own_positions(took_back + "\n" + log, violations, prompts, 1) == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("mode", "raise"),
        ("device", "tpu"),
        ("seconds", 0),
        ("clients", 0),
        ("page_size", 0),
        ("warmup_steps", -1),
    ],
)
def test_storm_settings_name_the_bad_value(field, value):
    from canary_support.storm import StormSettings

    with pytest.raises(ValueError, match=f"storm {field} must be"):
        StormSettings(**{"mode": "abort", field: value})
    argv = ["--mode", "abort", f"--{field.replace('_', '-')}", str(value)]
    if field in ("mode", "device"):  # argparse's own choices refuse these first
        return
    spec = importlib.util.spec_from_file_location("abort_storm", BENCH_DIR / "abort_storm.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    with pytest.raises(SystemExit):
        cli.parse_args(argv)


def test_profile_server_prefill_prints_the_last_requests_timeline(tmp_path, monkeypatch):
    """``profile_server_prefill.py``'s reading of a trace (its servers need a GPU): only the
    last request's events (after the last gap of ``REQUEST_GAP_US`` between kernels), the
    canary's kernels by name, other kernels folded per stream, the ordering host calls."""
    import gzip

    monkeypatch.syspath_prepend(str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(
        "profile_server_prefill", BENCH_DIR / "profile_server_prefill.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def kernel(ts, dur, stream, name):
        return dict(ph="X", cat="kernel", ts=ts, dur=dur, name=name, args=dict(stream=stream))

    events = [
        kernel(0, 10, 7, "gemm_first_request"),  # an earlier request
        kernel(10_000, 50, 7, "nvjet_gemm"),
        kernel(10_060, 40, 7, "flash_attn"),
        dict(ph="X", cat="cuda_runtime", ts=10_105, dur=20, name="cudaGraphLaunch"),
        dict(ph="X", cat="cuda_runtime", ts=10_106, dur=2, name="cudaLaunchKernel"),
        kernel(10_110, 5, 13, "plan_offsets_kernel"),
        kernel(10_120, 100, 13, "_canary_write_kernel"),
        kernel(10_230, 3, 7, "_canary_verify_kernel"),
    ]
    trace = tmp_path / "x.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    text = mod.last_request_timeline(
        mod.trace_rows(trace, annotations=False, host_calls=mod.SHOWN_CALLS)
    )
    import re

    lines = [
        re.match(r"\s*[\d.]+\.\.\s*[\d.]+\s+(stream \S+|host) (.*)$", line).groups()
        for line in text.splitlines()[:-1]
    ]
    assert [w for w, _ in lines] == ["stream 7", "host", "stream 13", "stream 13", "stream 7"], text
    assert [n for _, n in lines] == [
        "(other kernels) x2",
        "cudaGraphLaunch",
        "plan_offsets_kernel",
        "_canary_write_kernel",
        "_canary_verify_kernel",
    ], text
    assert text.splitlines()[0].startswith("      0.0..    100.0")
    assert text.endswith("(last kernel ends at 233.0 µs)")


def _fake_upstream(root: pathlib.Path) -> pathlib.Path:
    """A site directory whose sglang has its own ``sglang.srt.kv_canary`` (as 0.5.17 does),
    without this project's modules."""
    site = root / "up"
    (site / "sglang" / "srt" / "kv_canary").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("__version__ = 'upstream'\n")
    (site / "sglang" / "srt" / "__init__.py").write_text("")
    (site / "sglang" / "srt" / "kv_canary" / "__init__.py").write_text("UPSTREAM = True\n")
    return site


_PROBE = (
    "import importlib.util, os, sglang.srt.kv_canary as m; "
    "s = importlib.util.find_spec('sglang.srt.kv_canary.plugin'); "
    "print(m.__file__); print(s.origin if s else None); "
    "print(os.environ.get('SGLANG_PLUGINS'))"
)


def _probe(pythonpath: list, env_extra: dict | None = None) -> list:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SGLANG_PLUGINS")}
    env.update(env_extra or {}, PYTHONPATH=os.pathsep.join(map(str, pythonpath)))
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=str(pythonpath[-1]),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


def test_upstream_site_keeps_this_projects_modules_out_of_upstreams_packages(tmp_path):
    """``benchmark/kv_canary/upstream_site`` (first on an upstream server's PYTHONPATH): this
    project's editable install would load its ``plugin`` module into upstream's own
    ``sglang.srt.kv_canary`` (upstream has none of that name); with the folder first it is not
    found, and sglang's plugin allow-list leaves this project's entry point out."""
    up = _fake_upstream(tmp_path)
    isolation = BENCH_DIR / "upstream_site"
    from sglang.srt.kv_canary import plugin as ours  # this project's, as installed

    pkg, plugin, plugins = _probe([up])  # the hazard, on this (editable) install
    assert pkg.startswith(str(up)) and plugin == ours.__file__, (pkg, plugin)
    assert plugins == "None"
    pkg, plugin, plugins = _probe([isolation, up])
    assert pkg.startswith(str(up)) and plugin == "None" and plugins == "none"
    *_, plugins = _probe([isolation, up], {"SGLANG_PLUGINS": "kv_canary, other"})
    assert plugins == "other"
    # a sitecustomize it shadows still runs
    chained = tmp_path / "chained"
    chained.mkdir()
    (chained / "sitecustomize.py").write_text("print('chained')\n")
    assert _probe([isolation, chained, up])[0] == "chained"


def test_kernel_time_per_forward_sets_the_canarys_kernels_apart():
    """``trace_kernels.kernel_time`` (``--host-profile``'s GPU line): this project's Triton
    kernels by name apart from the rest, per forward, the span from the first kernel's start
    to the last one's end, and the most frequent other kernel's median as a probe; CPU events
    and other phases left out; a trace without kernels refused."""
    sys.path.insert(0, str(BENCH_DIR))
    from trace_kernels import canary_kernel_names, kernel_time

    names = canary_kernel_names()
    assert {"_canary_write_kernel", "_canary_verify_kernel", "_stage_inputs_kernel"} <= names

    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [
        kernel("gemm", 0, 10),
        kernel("_canary_write_kernel", 5, 4),
        kernel("gemm", 20, 12),
        kernel("norm", 40, 2),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
        {"ph": "i", "cat": "kernel", "name": "gemm", "ts": 90},
    ]
    kt = kernel_time(events, 2, names)
    assert (kt.canary_us, kt.other_us, kt.span_us) == (2.0, 12.0, 21.0)
    assert (kt.probe_name, kt.probe_median_us) == ("gemm", 11.0)
    with pytest.raises(ValueError, match="no kernel events"):
        kernel_time(events[4:], 2, names)
    with pytest.raises(ValueError, match="forwards must be positive"):
        kernel_time(events, 0, names)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def _dry_run_servers(*args: str, envs: Optional[dict] = None) -> Dict[str, List[str]]:
    """``pd_one_gpu.py --dry-run``'s server command lines, by role, and its PD_RESULT;
    ``envs``, when given, gets each server's canary variables, by role."""
    out = _run("pd_one_gpu.py", "--dry-run", *args)
    servers = {}
    for line in out.splitlines():
        for role in ("reference", "prefill", "decode"):
            if line.startswith(f"pd_one_gpu: {role}: "):
                servers[role] = line.split(": ", 2)[2].split()
            if envs is not None and line.startswith(f"pd_one_gpu: {role} env: "):
                envs[role] = json.loads(line.split(": ", 2)[2])
    result = json.loads(
        next(line for line in out.splitlines() if line.startswith("PD_RESULT "))[10:]
    )
    return servers, result


def _flag(argv: List[str], name: str):
    return argv[argv.index(name) + 1] if name in argv else None


def test_pd_one_gpu_builds_a_prefill_and_a_decode_server_that_find_each_other():
    """The PD pair of ``pd_one_gpu.py`` (run on a GPU with a real transfer engine; here only
    its command lines): one prefill and one decode server with the same transfer backend, the
    prefill's bootstrap port, canary flags on both, a reference server without PD; with
    ``--no-fake-requests`` no request of sglang's own (warm-up, health) fakes a transfer."""
    servers, result = _dry_run_servers(
        "--backend", "nixl", "--no-fake-requests", "--extra-args=--kv-canary raise"
    )
    prefill, decode, reference = servers["prefill"], servers["decode"], servers["reference"]
    assert _flag(prefill, "--disaggregation-mode") == "prefill"
    assert _flag(decode, "--disaggregation-mode") == "decode"
    assert _flag(reference, "--disaggregation-mode") is None
    for argv in (prefill, decode):
        assert _flag(argv, "--disaggregation-transfer-backend") == "nixl"
        assert _flag(argv, "--kv-canary") == "raise" and "--skip-server-warmup" in argv
    assert _flag(prefill, "--disaggregation-bootstrap-port") is not None
    assert len({_flag(a, "--port") for a in servers.values()}) == 3
    assert result["dry_run"] and result["env"]["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    servers, result = _dry_run_servers("--backend", "mooncake")
    assert "--skip-server-warmup" not in servers["decode"]
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION" not in result["env"]


def test_bench_pd_overhead_builds_one_pd_pair_per_config_and_a_twin_of_the_baseline(tmp_path):
    """``bench_pd_overhead.py`` (run on a GPU; here its command lines): a prefill and a decode
    server per config and for the baseline's A/A twin, each pair with its own bootstrap port,
    the config's canary flags and variables on both of its servers, the memory fractions
    growing server after server, every scheduler spinning when idle."""
    out = _run("bench_pd_overhead.py", "--dry-run", "--log-dir", str(tmp_path))
    argv, envs = {}, {}
    for line in out.splitlines():
        head, _, rest = line.partition(": ")
        if not head.startswith("pd_one_gpu") or not rest:
            continue
        name, _, value = rest.partition(": ")
        if name.endswith(" env"):
            envs[name[: -len(" env")]] = json.loads(value)
        else:
            argv[name] = value.split()
    pairs = ["off", "raise", "raise+token+partial", "off~aa"]
    assert sorted(argv) == sorted(f"{p}.{r}" for p in pairs for r in ("prefill", "decode"))
    boots = set()
    fractions = [
        float(_flag(argv[f"{p}.{r}"], "--mem-fraction-static"))
        for p in pairs
        for r in ("prefill", "decode")
    ]
    assert fractions == sorted(fractions) and len(set(fractions)) == len(fractions)
    for pair in pairs:
        prefill, decode = argv[f"{pair}.prefill"], argv[f"{pair}.decode"]
        assert _flag(prefill, "--disaggregation-mode") == "prefill"
        assert _flag(decode, "--disaggregation-mode") == "decode"
        boots.add(_flag(prefill, "--disaggregation-bootstrap-port"))
        for a in (prefill, decode):
            assert "--sleep-on-idle" not in a
            assert "--enable-metrics" in a  # the decode server's meta_info timing
            assert _flag(a, "--kv-canary") == ("none" if pair.startswith("off") else "raise")
        token = pair == "raise+token+partial"
        assert _flag(decode, "--kv-canary-real-data") == (
            "partial" if token else (None if pair.startswith("off") else "none")
        )
        for role in ("prefill", "decode"):
            assert (
                "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT" in envs[f"{pair}.{role}"]
            ) == token
    assert len(boots) == len(pairs)
    result = json.loads(out.splitlines()[-1].split(" ", 1)[1])
    assert result["errors"] == [] and result["backend"] == "mooncake"


def test_pd_one_gpu_gives_a_fault_to_the_decode_server_only():
    """``--env`` reaches both PD servers, ``--decode-env`` the decode server alone (a fault
    injected on the decode side), after ``--env``."""
    envs = {}
    _, result = _dry_run_servers(
        "--env",
        "KV_CANARY_TEST_SPLICE_DROPPED=1",
        "--env",
        "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS=5",
        "--decode-env",
        "SGLANG_KV_CANARY_PERTURB_PD_TRANSFER_PROB=1",
        "--decode-env",
        "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS=0",
        envs=envs,
    )
    both = {"KV_CANARY_TEST_SPLICE_DROPPED": "1"}
    assert envs["prefill"] == dict(both, SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS="5"), envs
    assert envs["decode"] == dict(
        both,
        SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS="0",
        SGLANG_KV_CANARY_PERTURB_PD_TRANSFER_PROB="1",
    ), envs
    assert "KV_CANARY_TEST_SPLICE_DROPPED" not in envs["reference"], envs
    assert result["decode_env"]["SGLANG_KV_CANARY_PERTURB_PD_TRANSFER_PROB"] == "1"


def test_pacing_probe_is_an_sglang_plugin_and_refuses_bad_settings(monkeypatch):
    """The decode bisect's probe (``benchmark/kv_canary/pacing_probe``): its folder on
    ``PYTHONPATH`` makes it an entry point of sglang's plugin group, and its settings parse
    from the environment, a bad value naming the variable."""
    probe_dir = BENCH_DIR / "pacing_probe"
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlib.metadata import entry_points; "
            "print([e.value for e in entry_points(group='sglang.srt.plugins')])",
        ],
        env=dict(os.environ, PYTHONPATH=str(probe_dir)),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "kv_pacing_probe:register" in found, found
    spec = importlib.util.spec_from_file_location(
        "kv_pacing_probe", probe_dir / "kv_pacing_probe.py"
    )
    probe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kv_pacing_probe", probe)  # its dataclass looks it up
    spec.loader.exec_module(probe)
    assert probe.parse_settings({}) == probe.ProbeSettings()
    settings = probe.parse_settings(
        {
            "KV_PACING_PROBE_WAIT": " Forward ",
            "KV_PACING_PROBE_STREAMS": "2",
            "KV_PACING_PROBE_MIB": "40",
            "KV_PACING_PROBE_FORK": "Kernel",
        }
    )
    assert settings == probe.ProbeSettings(wait="forward", streams=2, mib=40, fork="kernel")
    assert probe.parse_settings({"KV_PACING_PROBE_FORK": "empty"}).fork == "empty"
    for env, name in (
        ({"KV_PACING_PROBE_FORK": "both"}, "KV_PACING_PROBE_FORK"),
        ({"KV_PACING_PROBE_WAIT": "later"}, "KV_PACING_PROBE_WAIT"),
        ({"KV_PACING_PROBE_STREAMS": "-1"}, "KV_PACING_PROBE_STREAMS"),
        ({"KV_PACING_PROBE_MIB": "9999999"}, "KV_PACING_PROBE_MIB"),
    ):
        with pytest.raises(ValueError, match=name):
            probe.parse_settings(env)


def _serving_overhead():
    """``bench_serving_overhead.py`` as a module (its siblings importable)."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    import bench_serving_overhead

    return bench_serving_overhead


# a canary-on Engine's log lines per speculative mode (install.py's lines: the target's and,
# with a draft KV pool, its draft worker's; NGRAM has none)
_TARGET = "[INFO] kv_canary installed: mode=raise pool=MHATokenToKVPool ...\n"
_DRAFTS = {
    "eagle": "EAGLE",
    "eagle-tree": "EAGLE",
    "eagle3": "EAGLE",
    "adaptive": "EAGLE",
    "standalone": "STANDALONE",
    "dflash": "DFLASH",
    "ngram": None,
    "nextn": "EAGLE",
    "frozen-kv-mtp": None,
    "multi-layer": "EAGLE",
}


def _draft(worker: str) -> str:
    return f"[INFO] kv_canary installed on the {worker} draft worker: mode=raise ...\n"


@pytest.mark.parametrize("mode", sorted(_DRAFTS))
def test_bench_serving_overhead_checks_each_modes_canary_lines(monkeypatch, tmp_path, mode):
    """An Engine child's log decides whether its config's results stand: for each
    ``--speculative`` mode, a canary-on Engine must log the target's canary and its mode's
    draft canary (none for NGRAM), and no other draft worker's; a canary-off Engine neither;
    else the config fails (exit 3). The child's command line carries the mode and the model."""
    bso = _serving_overhead()
    import common

    commands = []

    class FakeChild:  # the Engine child: its output is the given log, its exit status 0
        def __init__(self, cmd, **kwargs):
            commands.append(cmd)
            self.stdout, self.pid = iter(self.log.splitlines(keepends=True)), 0

        def wait(self):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(bso.subprocess, "Popen", FakeChild)
    args = bso.argparse.Namespace(
        invocation="i",
        gpu="g",
        scenarios="decode_bs1",
        runs=1,
        out=str(tmp_path / "o.jsonl"),
        chunked_prefill_size=8192,
        max_total_tokens=4096,
        mem_fraction_static=0.5,
        speculative=mode,
        model=common.SPECULATIVE_MODELS[mode],
        piecewise="on",
        smoke_cpu=False,
        host_profile=0,
        child_timeout=60,
    )

    def rc(config, log):
        FakeChild.log = log
        return bso.run_child(args, bso.CONFIGS[config], str(tmp_path / "c.log"), None)

    worker = _DRAFTS[mode]
    other = "STANDALONE" if worker != "STANDALONE" else "EAGLE"
    right = _TARGET + (_draft(worker) if worker else "")
    assert rc("raise", right) == 0
    assert commands[-1][commands[-1].index("--speculative") + 1] == mode
    # and the model: the child builds the Engine on it (its default is another model)
    assert commands[-1][commands[-1].index("--model") + 1] == args.model
    assert rc("off", "") == 0
    assert rc("raise", "") == 3  # the canary did not run
    assert rc("raise", right + _draft(other)) == 3  # another algorithm's draft worker
    assert rc("off", _draft(worker or "EAGLE")) == 3  # a canary on a canary-off Engine
    if worker:
        assert rc("raise", _TARGET) == 3  # the draft pool unguarded


@pytest.mark.parametrize("mode", sorted(_DRAFTS))
def test_bench_serving_overhead_refuses_what_a_speculative_mode_cannot_measure(
    capsys, monkeypatch, mode
):
    """Each mode: no CPU dry run (sglang 0.5.12's CPU engine has no speculative decoding), the
    target its draft is made for only, each refusal naming the mode (before any Engine);
    without ``--model`` the Engines get that target, with piecewise prefill graphs unless
    sglang 0.5.12 cannot capture it."""
    bso = _serving_overhead()
    started = []

    def no_engines(args):
        started.append(args)
        raise AssertionError(f"Engines started for {args.speculative}")

    monkeypatch.setattr(bso, "run_engines", no_engines)
    import common

    model = common.SPECULATIVE_MODELS[mode]
    for argv, message in (
        (["--smoke-cpu"], f"--speculative {mode} cannot run with --smoke-cpu"),
        (["--model", "qwen3-30b-a3b"], f"--speculative {mode} needs --model {model}"),
    ):
        with pytest.raises(SystemExit):
            bso.main(["--speculative", mode, "--model", model, *argv])
        assert message in capsys.readouterr().err
    assert not started
    with pytest.raises(AssertionError, match="Engines started"):
        bso.main(["--speculative", mode])
    assert started[-1].model == model and started[-1].settings.model == model
    # piecewise prefill graphs: sglang's default, off where sglang cannot capture the target
    cannot = model in common.MODELS_WITHOUT_PIECEWISE
    assert started[-1].piecewise == ("off" if cannot else "on")
    assert started[-1].settings.piecewise is not cannot
    if cannot:
        with pytest.raises(SystemExit, match=f"--piecewise on cannot serve --model {model}"):
            bso.main(["--speculative", mode, "--piecewise", "on"])
