"""Abort mode end to end: a real sglang 0.5.12 HTTP server on the CPU (127.0.0.1) with
``--kv-canary abort`` and ``--enable-metrics`` (docs/user_guide.md, "Containment: --kv-canary
abort"; docs/monitoring/README.md): a clean run aborts nothing and exports growing counters;
under ``req_to_token`` fault injection the touched requests end with the abort reason and
message, every other request and every later one completes, ``/health`` stays OK, and the
Prometheus counters match the log lines. One ``sglang serve`` server (the suite's other CLI
servers start with ``python -m sglang.launch_server``) serves a clean phase and then the
faults; an Engine serves the abort in the middle of a chunked prefill."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import subprocess
import sys
import pytest

from canary_support.script_run import run_support_script
from cli_server import CliServer, http_call
from sglang.srt.kv_canary.manager.stats import STATS_LINE_PREFIX
from sglang.srt.kv_canary.perturb.report import parse_perturb_line
from sglang.srt.kv_canary.violations.containment import (
    PREFIX_ABORT_MESSAGE,
    parse_prefix_abort_rids,
)
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from canary_support.storm import ABORT_MESSAGE
from sglang.srt.kv_canary.demo.server_harness import (
    build_libcuda_stub,
    cpu_server_env,
    write_tiny_llama,
)
from canary_support.server_process import metric_series, metric_total
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=80, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow

SUPPORT = pathlib.Path(__file__).parent / "e2e_support"
# small chunks (chunked prefill) and a small pool (radix evictions)
SERVER_ARGS = dict(
    chunked_prefill_size=32, max_total_tokens=384, max_running_requests=8, log_level="info"
)
MAX_NEW = 16
CLEAN_WAVES = 3
WAVE_SIZE = 6  # concurrent requests a wave


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("abort_server")
    model = write_tiny_llama(root / "model")
    env = cpu_server_env(build_libcuda_stub(root / "stub"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), env.get("PYTHONPATH", "")) if p)
    env["SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT"] = "1"
    return dict(model=model, env=env, root=root)


def generate(port: int, rid: str, input_ids) -> tuple:
    status, body = http_call(
        port,
        "POST",
        "/generate",
        {
            "rid": rid,
            "input_ids": input_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
        },
        timeout=300,
    )
    return status, body.decode(errors="replace")


def wave(port: int, tag: str, prefix_len: int = 40, n: int = WAVE_SIZE) -> dict:
    """``n`` concurrent requests sharing a prefix: rid -> (status, body)."""
    prefix = list(range(10, 10 + prefix_len))
    jobs = {f"{tag}-{i}": prefix + [200 + i, 300 + len(tag) + i] for i in range(n)}
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = {rid: pool.submit(generate, port, rid, ids) for rid, ids in jobs.items()}
        return {rid: f.result() for rid, f in futures.items()}


def completed(status: int, body: str) -> bool:
    return status == 200 and len(json.loads(body)["output_ids"]) == MAX_NEW


def check_aborts(errors: dict, log: str) -> None:
    """``errors``: rid -> the error text of each aborted request. Each was aborted either for
    a violation line naming it (the launch tag's message) or, after it, for locking the
    corrupt prefix (the prefix message, its id in a prefix-abort line); at least one for a
    violation."""
    named = {rid for v in parse_violation_lines(log) for rid in v.rids}
    by_prefix = set(parse_prefix_abort_rids(log))
    direct = {rid for rid, e in errors.items() if ABORT_MESSAGE in e}
    shared = {rid for rid, e in errors.items() if PREFIX_ABORT_MESSAGE in e}
    assert direct, "no request was aborted for a violation"
    assert direct | shared == set(errors) and not direct & shared, errors
    assert direct <= named and shared <= by_prefix, (direct, named, shared, by_prefix)


def clean_prefix_len(w: int) -> int:
    return 40 + 8 * w


def fault_prefix_len(w: int) -> int:
    return 32 + 4 * (w % 8)


def most_forwards(prompt_len: int) -> int:
    """The most forwards one request of ``prompt_len`` tokens can take: each forward serves
    at least one of its prefill chunks or decoded tokens (the first comes with the prefill)."""
    chunk = SERVER_ARGS["chunked_prefill_size"]
    return -(-prompt_len // chunk) + MAX_NEW - 1


# the faults start after this many forwards: past every forward the clean phase can take
# however sglang batches its requests (sglang's warm-up request of 8 tokens, then the clean
# waves one request after another; about 60 as they are batched), checked by the stats lines
# (one per forward) and the log holding no injection when that phase ends
CLEAN_PHASE_WARMUP_STEPS = 8 + sum(
    WAVE_SIZE * most_forwards(clean_prefix_len(w) + 2) for w in range(CLEAN_WAVES)
)
# a fault wave takes at least MAX_NEW forwards (its requests decode one token a forward): the
# waves that reach the warm-up, and room for both faults after it
FAULT_WAVES = -(-CLEAN_PHASE_WARMUP_STEPS // MAX_NEW) + 10


def stats_steps(log: str) -> list:
    """The steps of the stats lines in ``log`` (one a forward here)."""
    return [
        int(m.group(1)) for m in re.finditer(re.escape(STATS_LINE_PREFIX) + r" step=(\d+) ", log)
    ]


@pytest.fixture(scope="module")
def abort_run(server):
    """One ``sglang serve`` server in abort mode (sweep every 4, real data ``partial``,
    metrics): a clean phase of three waves, its metrics, ``/server_info`` and ``/health``
    read, then ``req_to_token`` faults from forward ``CLEAN_PHASE_WARMUP_STEPS`` on (two, at
    0.5 a step) in waves until both are injected, then one more wave."""
    env = dict(
        server["env"],
        SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB="0.5",
        SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS=str(CLEAN_PHASE_WARMUP_STEPS),
        SGLANG_KV_CANARY_PERTURB_MAX_FAULTS="2",
        SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS="1",
    )
    srv = CliServer(
        "abort",
        server["root"],
        server["model"],
        env,
        [
            "--kv-canary",
            "abort",
            "--kv-canary-sweep-interval",
            "4",
            "--kv-canary-real-data",
            "partial",
            "--enable-metrics",
        ],
        launcher="serve",
        **SERVER_ARGS,
    )
    run = {}
    try:
        srv.wait_ready()
        run["first"] = metric_series(srv.port)
        clean = {}
        for w in range(CLEAN_WAVES):
            clean.update(wave(srv.port, f"clean{w}", prefix_len=clean_prefix_len(w)))
        run["clean"] = clean
        run["second"] = metric_series(srv.port)
        status, body = http_call(srv.port, "GET", "/server_info", timeout=60)
        run["info_status"], run["info"] = status, json.loads(body)["kv_canary"]
        run["clean_health"] = http_call(srv.port, "GET", "/health", timeout=60)[0]
        run["clean_log"] = srv.log()
        results = {}
        for w in range(FAULT_WAVES):  # until both faults are injected and contained
            results.update(wave(srv.port, f"f{w}", prefix_len=fault_prefix_len(w)))
            if len([f for f in map(parse_perturb_line, srv.log().splitlines()) if f]) >= 2:
                break
        run["results"] = results
        run["later"] = wave(srv.port, "later", prefix_len=36)  # after the faults: all complete
        run["health"] = http_call(srv.port, "GET", "/health", timeout=60)[0]
        run["series"] = metric_series(srv.port)
        run["alive"] = srv.alive()
    finally:
        srv.stop()
    run["log"] = srv.log()
    return run


def test_abort_server_clean_phase_exports_metrics_and_settings(abort_run):
    """The clean phase: every request completes, nothing reported or injected before its end
    (the log then), the counters grow, none of violations, aborts or drops, sglang's scheduler
    labels, and the settings in ``/server_info`` and sglang's ``server_args`` line."""
    run = abort_run
    clean_log = run["clean_log"]
    steps = stats_steps(clean_log)
    assert steps == list(range(1, len(steps) + 1)), steps
    assert 0 < len(steps) < CLEAN_PHASE_WARMUP_STEPS, (len(steps), CLEAN_PHASE_WARMUP_STEPS)
    assert not [f for f in map(parse_perturb_line, clean_log.splitlines()) if f], clean_log[-3000:]
    assert parse_violation_lines(clean_log) == [] and "Traceback" not in clean_log
    assert all(completed(*r) for r in run["clean"].values()), run["clean"]
    first, second, info = run["first"], run["second"], run["info"]
    assert run["info_status"] == 200 and run["clean_health"] == 200
    verified = "sglang:kv_canary_verified_slots_total"
    # it checks, and keeps on
    assert metric_total(second, verified) > metric_total(first, verified) > 0
    assert metric_total(second, "sglang:kv_canary_sweep_passes_total") > 0
    assert metric_total(second, "sglang:kv_canary_violations_total") == 0
    assert metric_total(second, "sglang:kv_canary_aborted_requests_total") == 0
    assert metric_total(second, "sglang:kv_canary_dropped_violations_total") == 0
    assert any(n == "sglang:kv_canary_protected_tokens" for n, _ in second)
    # the series carry sglang's scheduler labels
    assert all(dict(labels).get("tp_rank") == "0" for (_, labels) in second)
    assert info["kv_canary"] == "abort" and info["kv_canary_sweep_interval"] == 4
    assert info["config"].startswith(
        "mode=abort real_data=partial real_data_layers=first layers_per_forward=1 sweep_interval=4 "
    )
    assert info["kv_canary_real_data_layers"] == "first"
    assert "token_checks=on" in info["config"]
    assert "kv_canary_config='mode=abort real_data=partial" in clean_log  # repr(server_args)


def test_abort_server_contains_faults_and_keeps_serving(abort_run):
    """The faults: the touched requests end with HTTP 500 and the canary's message (for a
    violation naming them, or for locking the corrupt prefix), every other request and every
    later one completes, ``/health`` stays OK, each fault is reported at its step naming the
    changed row, and the counters match the log lines."""
    run = abort_run
    log, results, later, series = run["log"], run["results"], run["later"], run["series"]
    assert run["health"] == 200 and run["alive"]
    assert "Traceback" not in log and "memory leak" not in log, log[-3000:]
    injected = [f for f in map(parse_perturb_line, log.splitlines()) if f]
    assert len(injected) == 2, log[-3000:]
    assert all(int(f["step"]) > CLEAN_PHASE_WARMUP_STEPS for f in injected), injected
    assert all(completed(*r) for r in later.values()), later
    aborted = {rid for rid, (status, body) in results.items() if status != 200}
    assert all(results[rid][0] == 500 for rid in aborted), {r: results[r] for r in aborted}
    check_aborts({rid: results[rid][1] for rid in aborted}, log)
    assert all(completed(*results[rid]) for rid in set(results) - aborted)
    lines = parse_violation_lines(log)
    assert {rid for v in lines for rid in v.rids} <= set(results)  # the names are ours
    # each fault is reported at its step, naming the row the perturbation changed
    for f in injected:
        assert any(
            v.forward_step == int(f["step"])
            and v.slot_idx == int(f["new_slot"])
            and v.req_to_token_row == int(f["req_pool_idx"])
            for v in lines
        ), (f, lines)
    # the counters match the log: one violation per line (by tag and reason), one abort per
    # aborted request
    by_label = {}
    for v in lines:
        key = (v.launch_tag, "+".join(v.fail_reasons))
        by_label[key] = by_label.get(key, 0) + 1
    got = {}
    for (name, labels), value in series.items():
        if name == "sglang:kv_canary_violations_total":
            d = dict(labels)
            got[(d["launch_tag"], d["fail_reason"])] = value
    assert got == by_label
    assert metric_total(series, "sglang:kv_canary_aborted_requests_total") == len(aborted)


def run_abort_engine(
    model: str, env: dict, device: str, mode: str = "waves", timeout: float = 600, **engine_kwargs
):
    """``e2e_support/abort_workload.py`` (``mode``: ``waves`` or ``long``) on an
    ``sglang.Engine`` (keyword arguments path): ``(returncode, output, result)``; returncode
    None when it ran past ``timeout`` seconds."""
    try:
        return run_support_script(
            "abort_workload.py",
            model,
            json.dumps(engine_kwargs),
            device,
            mode,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        return None, out.decode(errors="replace") if isinstance(out, bytes) else out, None


def check_engine_abort_run(rc: int, out: str, res) -> None:
    """The checks of an abort-mode Engine run under two injected ``req_to_token`` faults."""
    assert rc == 0 and res is not None, out[-4000:]
    injected = [f for f in map(parse_perturb_line, out.splitlines()) if f]
    assert len(injected) == 2, out[-4000:]
    results = res["results"]
    aborted = {rid for rid, r in results.items() if "error" in r}
    check_aborts({rid: results[rid]["error"] for rid in aborted}, out)
    assert all(r.get("ok") == MAX_NEW for rid, r in results.items() if rid not in aborted)
    assert all(r.get("ok") == MAX_NEW for r in res["later"].values()), res["later"]
    assert {rid for v in parse_violation_lines(out) for rid in v.rids} <= set(results)
    assert res["server_info"]["kv_canary"] == "abort"
    assert res["server_info"]["config"].startswith("mode=abort real_data=partial")


def test_abort_mid_chunked_prefill_finishes_the_request_and_keeps_serving(server):
    """On ``sglang.Engine(kv_canary="abort", ...)`` (its requests sent with
    ``async_generate``; the same workload's waves under two faults: ``test_e2e_abort_gpu.py``).
    A request aborted between the chunks of its chunked prefill: sglang stashes each chunk
    through the same radix-insert flag abort mode sets to keep corrupt KV out of the tree, so
    the canary lifts its mark around the stash. The request (160 tokens, chunks of 16) takes
    a ``req_to_token`` fault in its second chunk (the first forward with a prefix to point
    elsewhere), is aborted there, prefills to its last chunk and ends with the canary's
    message, and a later wave completes. Without the lift the stash is skipped, the same
    chunk is prefilled again and again with new slots, and the 384-token pool runs out."""
    env = dict(
        server["env"],
        SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB="1.0",
        SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS="0",
        SGLANG_KV_CANARY_PERTURB_MAX_FAULTS="1",
    )
    rc, out, res = run_abort_engine(
        server["model"],
        env,
        "cpu",
        mode="long",
        timeout=300,
        **dict(SERVER_ARGS, chunked_prefill_size=16),
    )
    assert rc == 0 and res is not None, out[-4000:]
    assert "Out of memory" not in out and "memory leak" not in out, out[-4000:]
    injected = [f for f in map(parse_perturb_line, out.splitlines()) if f]
    assert len(injected) == 1 and int(injected[0]["step"]) == 2, injected
    long = res["results"]["long"]
    assert ABORT_MESSAGE in long.get("error", ""), long
    assert all(r.get("ok") == MAX_NEW for r in res["later"].values()), res["later"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
