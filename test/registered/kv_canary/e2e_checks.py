"""Shared checks of the end-to-end tests (model shapes, HiCache, tensor parallelism; CPU and
GPU): the perturbation settings that inject every fault class into the FULL group, the check
that each injected fault was reported with its reason at its slot, the HiCache host-tier
checks, and the TP 2 servers' settings and per-rank checks."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

from canary_support.script_run import run_support_script
from e2e_support.engine_main import CLEAN_TAG, PHASE_END_TAG
from sglang.srt.kv_canary.manager.stats import STATS_LINE_PREFIX
from sglang.srt.kv_canary.perturb.report import PERTURB_LINE_PREFIX, parse_perturb_line
from sglang.srt.kv_canary.violations.lines import (
    VIOLATION_LINE_PREFIX,
    parse_violation_line,
    parse_violation_lines,
)


def run_workload(
    script: str, model: str, engine_kwargs: dict, env: dict, *extra: str, timeout: float = 900
):
    """``e2e_support/<script> MODEL KWARGS_JSON [extra...]`` in a fresh process
    (:func:`canary_support.script_run.run_support_script`): ``(returncode, stdout + stderr,
    the RESULT json or None)``."""
    return run_support_script(
        script, model, json.dumps(engine_kwargs), *extra, env=env, timeout=timeout
    )


def demo_failure(out: str, logs, case: str, *, chars: int = 4000) -> str:
    """What a failed ``python -m sglang.srt.kv_canary.demo ... --logs LOGS`` run leaves to read:
    the tail of its own output and of the case's server log (``LOGS/CASE.log``, which the
    demo writes; said when missing), for an assertion message."""
    log = pathlib.Path(logs) / f"{case}.log"
    server = log.read_text(errors="replace")[-chars:] if log.exists() else f"(no {log})"
    return f"{out[-chars:]}\n---- {case}.log, the last {chars} characters ----\n{server}"


# the demo's fault cases (python -m sglang.srt.kv_canary.demo, raise mode): fault -> (launch
# tags a matching report may carry, reasons of which one must appear)
DEMO_EXPECTED = {
    "req_to_token": (
        {"HEAD_K_FULL", "TAIL_K_FULL"},
        {"verify_chain_hash", "verify_position", "verify_token"},
    ),
    "real_kv_used": ({"TAIL_K_FULL", "SWEEP_K_FULL"}, {"verify_real_kv_hash"}),
    "real_kv_unused_cache": ({"SWEEP_K_FULL"}, {"verify_real_kv_hash"}),
    "real_kv_post_forward": ({"TAIL_K_FULL", "SWEEP_K_FULL"}, {"verify_real_kv_hash"}),
    "next_token_swap": ({"HEAD_K_FULL", "TAIL_K_FULL"}, {"write_token"}),
}
DEMO_WARMUP_STEPS = 30  # the demo's cases inject from the forward after these


def run_demo(device: str, cases, out: pathlib.Path, *, env=None, timeout: float = 1500):
    """``python -m sglang.srt.kv_canary.demo --device DEVICE --cases CASES`` (raise mode, two
    runs at a time), its rows as JSON and each run's server log under ``out``:
    ``(CompletedProcess, rows by case name, logs directory)``."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.srt.kv_canary.demo", "--device", device]
        + ["--cases", ",".join(cases), "--jobs", "2", "--json", str(out / "rows.json")]
        + ["--logs", str(out / "logs")],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    rows = json.loads((out / "rows.json").read_text()) if (out / "rows.json").exists() else []
    return proc, {r["name"]: r for r in rows}, out / "logs"


def assert_demo_fault_caught(row: dict, fault: str, logs: pathlib.Path) -> None:
    """A demo row of ``fault`` in raise mode: injected from the first forward after the
    warm-up, reported within three forwards with a reason the fault must cause by a launch that
    can see it, and the server stopped; a ``req_to_token`` report names the entry the
    injection changed (row, position, slot)."""
    tags, reasons = DEMO_EXPECTED[fault]
    assert row["injections"] >= 1 and row["first_injection_step"] == DEMO_WARMUP_STEPS + 1, row
    assert row["detected"], row
    assert 0 <= row["steps_to_report"] <= 3, row
    assert set(row["tags"]) & tags and set(row["reasons"]) & reasons, row
    assert row["returncode"] != 0 and not row["finished"], row  # raise mode stopped the server
    text = (logs / f"{fault}.log").read_text()
    assert f"FAULT INJECTION ON ({fault})" in text
    assert f"kv_canary perturb: fault={fault} step={DEMO_WARMUP_STEPS + 1}" in text
    if fault == "req_to_token":
        inj = next(f for f in map(parse_perturb_line, text.splitlines()) if f is not None)
        assert any(
            (v.req_to_token_row, v.read_position, v.slot_idx)
            == (int(inj["req_pool_idx"]), int(inj["position"]), int(inj["new_slot"]))
            and "HEAD_K_FULL" in v.seen_by
            for v in parse_violation_lines(text)
        ), text[-3000:]


# forward steps at least between a clean phase's last forward and the fault warm-up's end: the
# phase must end before a fault can be injected (one step more in case the stats line's step
# and the perturber's count differ by one); a phase that takes more forwards on a loaded
# machine (its requests batched otherwise) fails only past the warm-up
CLEAN_PHASE_MARGIN = 2


def assert_clean_phase_then_faults(out: str, *, warmup: int, phase: str = "clean") -> str:
    """A log-mode CPU server's run as a clean phase, then faults (fault warm-up ``warmup``
    steps, ``SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS=1``: on the CPU a forward's stats line
    is logged in that forward). The phase's last forward is the step of the last stats line
    before the workload's ``KV_CANARY_TEST_PHASE_END <phase>`` line: it counts no violation and
    lies at least :data:`CLEAN_PHASE_MARGIN` steps before the warm-up's end; a fault was
    injected, the first past the warm-up, and nothing was reported before it. Returns the
    phase's last stats line."""
    lines = out.splitlines()
    ends = [i for i, text in enumerate(lines) if text.startswith(PHASE_END_TAG + phase)]
    assert len(ends) == 1, (phase, ends, out[-3000:])
    stats = [text for text in lines[: ends[0]] if STATS_LINE_PREFIX in text]
    assert stats, out[-3000:]
    fields = dict(w.split("=", 1) for w in stats[-1].split() if "=" in w)
    last_clean = int(fields["step"])
    assert fields["violations"] == "0", stats[-1]
    assert last_clean + CLEAN_PHASE_MARGIN <= warmup, (last_clean, warmup)
    injected = [f for f in map(parse_perturb_line, lines) if f]
    assert injected, out[-3000:]
    first_fault = min(int(f["step"]) for f in injected)
    assert first_fault > warmup, (first_fault, warmup)
    early = [v for v in parse_violation_lines(out) if v.forward_step < first_fault]
    assert early == [], early[:5]
    return stats[-1]


# every fault class of the perturbation framework, in the FULL group, from step 8 on
EVERY_FAULT_ENV = {
    "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "8",
    "SGLANG_KV_CANARY_PERTURB_MAX_FAULTS": "12",
    "SGLANG_KV_CANARY_PERTURB_TARGET_GROUP": "full",
    "SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB": "0.3",
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.15",
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB": "0.15",
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB": "0.15",
}


def violations_by_pool(out: str):
    """Every violation line of a server's output with the pool it is about: ``("draft",
    line)`` when the report names a draft model's pool (the ``Pool:`` line a draft runner's
    canary adds after its report, before the next violation line), else ``("target", line)``."""
    found = []
    for text in out.splitlines():
        line = parse_violation_line(text)
        if line is not None:
            found.append(["target", line])
        elif found and "Pool: " in text and "draft model's KV pool" in text:
            found[-1][0] = "draft"
    return [tuple(f) for f in found]


def pool_reports(out: str) -> set:
    """``(pool, fail reason, position)`` of every violation line in ``out`` (a server's output
    or the canaries' log messages joined), the pool as :func:`violations_by_pool` reads it."""
    return {
        (pool, reason, v.position)
        for pool, v in violations_by_pool(out)
        for reason in v.fail_reasons
    }


# EVERY_FAULT_ENV plus two sampled tokens swapped between rows, which the token oracle's
# write-input check reports at the next forward (the oracle on: the swap needs it); with five
# kinds drawing on one budget of faults, a larger budget and a likelier real_kv_used (each kind
# must be injected at least once)
EVERY_FAULT_WITH_ORACLE_ENV = dict(
    EVERY_FAULT_ENV,
    SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE="1",
    SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT="1",
    SGLANG_KV_CANARY_PERTURB_NEXT_TOKEN_SWAP_PROB="0.3",
    SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB="0.3",
    SGLANG_KV_CANARY_PERTURB_MAX_FAULTS="40",
)

# faults the forward itself reads: caught every time
ALWAYS_CAUGHT = ("req_to_token", "real_kv_used")


def fault_caught(fault: dict, lines) -> bool:
    """Was the injected ``fault`` (a parsed perturbation line) reported? A report of a
    sliding-window group (``*_SWA`` tags) names the window pool's slot: a flipped byte's is
    the line's ``slot`` (``full_slot`` for a full-attention group), and a changed
    ``req_to_token`` entry (logged as a full slot) is matched by its row and position there."""
    step = int(fault["step"])
    if fault["fault"] == "req_to_token":  # the changed entry, reported at its forward
        row, position = int(fault["req_pool_idx"]), int(fault["position"])
        return any(
            v.forward_step == step
            and (v.req_to_token_row, v.read_position) == (row, position)
            and (v.launch_tag.endswith("_SWA") or v.slot_idx == int(fault["new_slot"]))
            for v in lines
        )
    if fault["fault"] == "next_token_swap":  # the token oracle's write-input check
        return any(v.forward_step >= step and "write_token" in v.fail_reasons for v in lines)
    # a byte of the slot's KV row flipped: its fingerprint no longer matches
    return any(
        v.forward_step >= step
        and v.slot_idx == int(fault["slot"])
        and v.launch_tag.endswith("_SWA") == (fault["group"] == "swa")
        and "verify_real_kv_hash" in v.fail_reasons
        for v in lines
    )


def assert_every_fault_caught(out: str, also_injected=(), post_forward: bool = True) -> None:
    """Each fault the forward reads is caught; a byte flipped after a forward is caught when
    the slot is next read or swept (a slot freed and rewritten first erases it), as is a token
    swap at a later forward: each of those kinds at least once. Every kind of
    :data:`ALWAYS_CAUGHT`, ``real_kv_post_forward`` (unless ``post_forward`` is False: a pool
    whose forwards' slots nothing reads as written draws none, e.g. DFLASH's draft pool) and
    ``also_injected`` must have been injected."""
    injected = [f for f in map(parse_perturb_line, out.splitlines()) if f]
    lines = parse_violation_lines(out)
    kinds = {f["fault"] for f in injected}
    required = {*ALWAYS_CAUGHT, *also_injected} | (
        {"real_kv_post_forward"} if post_forward else set()
    )
    assert required <= kinds, injected
    for f in injected:
        if f["fault"] in ALWAYS_CAUGHT:
            # on failure: the reports of the fault's forward and its neighbours
            near = [v for v in lines if abs(v.forward_step - int(f["step"])) <= 1]
            assert fault_caught(f, lines), (f, near[:20])
    for kind in kinds - set(ALWAYS_CAUGHT):
        assert any(fault_caught(f, lines) for f in injected if f["fault"] == kind), (kind, injected)


# one host_kv fault (a byte flipped in HiCache's host memory) once host-only pages exist; every
# host page checked by each host-tier sweep pass
HOST_KV_FAULT_ENV = {
    "SGLANG_KV_CANARY_PERTURB_HOST_KV_PROB": "1",
    "SGLANG_KV_CANARY_PERTURB_MAX_FAULTS": "1",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "12",
    "SGLANG_KV_CANARY_PERTURB_TARGET_GROUP": "full",
    "SGLANG_KV_CANARY_HOST_SWEEP_PAGES": "4096",
}


def assert_host_pool_made_room(
    out: str, *, ratio: float, device_tokens: int, page_size: int = 1
) -> None:
    """The HiCache host pool's KV and the canary's rows of its slots take what
    ``--hicache-ratio`` gives the KV alone (docs/user_guide.md, "Memory"), to sglang's rounding
    of the pool to whole pages."""
    kv, mirror = map(
        int,
        re.search(
            r"HiCache host pool: (\d+) bytes of KV and (\d+) canary "
            r"bytes per host slot",
            out,
        ).groups(),
    )
    slots = int(
        re.search(r"HiCache host tier mirrored \(\w+ host pool, (\d+) host slots", out).group(1)
    )
    budget, slot = ratio * device_tokens * kv, kv + mirror
    assert budget - page_size * slot < slots * slot <= budget + page_size * slot, (
        slots,
        kv,
        mirror,
        budget,
    )


def host_tier_stats(out: str):
    """``(host_backed_up, host_loaded)`` of the last stats line: slots the canary's rows went
    to the host with and came back with."""
    lines = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert lines, out[-3000:]
    fields = dict(w.split("=", 1) for w in lines[-1].split() if "=" in w)
    return int(fields["host_backed_up"]), int(fields["host_loaded"])


def assert_host_kv_found(out: str):
    """The one ``host_kv`` fault is reported only as ``verify_real_kv_hash``; the host-tier
    sweep reports it at the flipped host slot and position (``req_to_token_row=-2``); a report
    of the loaded-back page names that position only. Returns ``(fault, host reports,
    loaded-back reports)``."""
    (fault,) = [f for f in map(parse_perturb_line, out.splitlines()) if f]
    assert fault["fault"] == "host_kv", fault
    lines = parse_violation_lines(out)
    assert lines and all(v.fail_reasons == ("verify_real_kv_hash",) for v in lines), lines
    host = [v for v in lines if v.req_to_token_row == -2]
    assert host, out[-3000:]
    assert (host[0].launch_tag, host[0].slot_idx, host[0].read_position) == (
        "SWEEP_K_FULL",
        int(fault["host_index"]),
        int(fault["position"]),
    )
    loaded = [v for v in lines if v.req_to_token_row >= 0]
    assert all(v.position == int(fault["position"]) for v in loaded), (fault, lines)
    return fault, host, loaded


# a TP 2 workload's fault, on rank 1 only (test_e2e_tp_gpu.py; test_e2e_tp_server.py with
# TP_RANK_1_FAULT_AFTER_CLEAN)
TP_RANK_1_FAULT = {
    "SGLANG_KV_CANARY_PERTURB_TP_RANK": "1",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "6",
    "SGLANG_KV_CANARY_PERTURB_MAX_FAULTS": "2",
    "SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB": "0.5",
}


# the TP 2 CPU test's one canary-on run (clean_then_fault_workload.py): TP_RANK_1_FAULT with the
# injection's warm-up past every forward the clean phase can take (each forward serves at least
# one prefill chunk or decoded token: 12 requests of at most 3 chunks and 7 decodes, 120; about
# 32 as sglang batches them), a stats line of each rank per forward (its step count), and the
# token checks of the clean run
TP_RANK_1_FAULT_AFTER_CLEAN = dict(
    TP_RANK_1_FAULT,
    SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS="128",
    SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS="1",
    SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT="1",
)


def lines_by_tp_rank(out: str, prefix: str) -> dict:
    """Log lines holding ``prefix``, by the TP rank in their sglang log prefix (None: no
    prefix)."""
    found = {}
    for line in out.splitlines():
        if prefix in line:
            m = re.search(r" TP(\d+)\]", line)
            found.setdefault(int(m.group(1)) if m else None, []).append(line)
    return found


def assert_tp2_clean(rc: int, out: str, on, off) -> None:
    """A clean TP 2 run: a canary on each rank's pool, no violation, the canary-off outputs
    (12 requests: ``small_workload.py``)."""
    assert rc == 0, out[-3000:]
    installed = lines_by_tp_rank(out, "kv_canary installed:")
    assert sorted(installed) == [0, 1], installed
    assert parse_violation_lines(out) == []
    assert on == off and len(on) == 12


def assert_tp2_fault_on_rank_1_only(rc: int, out: str, res) -> None:
    """A raise-mode TP 2 run with :data:`TP_RANK_1_FAULT`: rank 1 injects, rank 0 says it has
    no fault injection, and the whole server stops with the structured lines in rank 1's error
    (the raise message names the rank: it carries no log prefix)."""
    assert res is None or rc != 0, out[-3000:]  # the server stopped before the workload ended
    injected = lines_by_tp_rank(out, PERTURB_LINE_PREFIX)
    assert sorted(injected) == [1] and injected[1], injected  # only rank 1 injects
    assert "fault injection is set for another rank; none on this one (tp_rank 0" in out
    assert parse_violation_lines(out), out[-3000:]
    assert "kv_canary detected KV-cache corruption on tp_rank 1, pp_rank 0, dp_rank 0:" in out
    assert "corruption on tp_rank 0" not in out  # rank 0 reported nothing
    # no rank logged a report line of its own (raise mode reports in the error only)
    assert set(lines_by_tp_rank(out, VIOLATION_LINE_PREFIX)) <= {None}


def stats_by_tp_rank(lines) -> dict:
    """``{tp_rank: {step: violations}}`` of the stats lines among ``lines`` (each with sglang's
    ``TP<n>]`` log prefix)."""
    found = {}
    for line in lines:
        m = re.search(
            r" TP(\d+)\] " + re.escape(STATS_LINE_PREFIX) + r" step=(\d+) .*violations=(\d+) ", line
        )
        if m:
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = int(m.group(3))
    return found


def assert_tp2_clean_then_fault_on_rank_1(rc: int, out: str, res, off) -> None:
    """The TP 2 CPU test's one canary-on run (``clean_then_fault_workload.py``,
    :data:`TP_RANK_1_FAULT_AFTER_CLEAN`, raise mode). Its clean phase as
    :func:`assert_tp2_clean` (a canary on each rank, the canary-off outputs ``off``, nothing
    reported), ended before the first injection: TP rank 0's stats lines before the ``CLEAN``
    line count the phase's forwards (L), both ranks logged steps 1..L with no violation, L is
    below the warm-up, and each injection and each report comes at a later step. Then the
    fault phase as :func:`assert_tp2_fault_on_rank_1_only`."""
    assert_tp2_fault_on_rank_1_only(rc, out, res)
    lines = out.splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith(CLEAN_TAG)]
    assert len(marks) == 1, out[-3000:]  # the server was up when the clean phase ended
    clean = json.loads(lines[marks[0]][len(CLEAN_TAG) :])
    installed = lines_by_tp_rank(out, "kv_canary installed:")
    assert sorted(installed) == [0, 1], installed
    assert clean["outputs"] == off and len(off) == 12, (clean["outputs"], off)
    live = clean["kv_canary_live"]
    assert live and all(s["target"]["violations"] == 0 for s in live), live
    last_clean = max(stats_by_tp_rank(lines[: marks[0]]).get(0, {}), default=0)
    steps = stats_by_tp_rank(lines)
    for rank in (0, 1):
        logged = {s: v for s, v in steps.get(rank, {}).items() if s <= last_clean}
        assert logged == dict.fromkeys(range(1, last_clean + 1), 0), (rank, last_clean, logged)
    warmup = int(TP_RANK_1_FAULT_AFTER_CLEAN["SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS"])
    assert 0 < last_clean < warmup, (last_clean, warmup)
    faults = [int(f["step"]) for f in map(parse_perturb_line, lines) if f]
    reported = [v.forward_step for v in parse_violation_lines(out)]
    assert last_clean < min(faults) <= min(reported), (last_clean, faults, reported)


# the TP 2 CPU servers' settings: small chunks, a small pool
TP2_CPU_ARGS = dict(
    tp_size=2,
    chunked_prefill_size=32,
    max_total_tokens=512,
    max_running_requests=4,
    log_level="info",
)


def tp2_cpu_server(root: pathlib.Path) -> dict:
    """The model (4 KV heads: 2 per rank) and environment of a TP 2 CPU server under ``root``:
    one core per rank, pynccl off (gloo), no canary variable inherited."""
    from sglang.srt.kv_canary.demo.server_harness import (
        build_libcuda_stub,
        cpu_server_env,
        write_tiny_llama,
    )

    env = cpu_server_env(build_libcuda_stub(root / "stub"))
    env = {k: v for k, v in env.items() if not k.startswith("SGLANG_KV_CANARY_")}
    env["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1"
    env["SGLANG_NCCL_SO_PATH"] = str(root / "no-nccl.so")
    model = write_tiny_llama(root / "model", num_attention_heads=4, num_key_value_heads=4)
    return dict(model=model, env=env)


def run_tp2_cpu(
    server: dict, env_extra=None, *extra: str, script="small_workload.py", **engine_kwargs
):
    """``e2e_support/<script>`` on a TP 2 CPU Engine (:data:`TP2_CPU_ARGS` plus
    ``engine_kwargs``); ``extra``: the script's arguments after the kwargs (device, mode)."""
    return run_workload(
        script,
        server["model"],
        dict(TP2_CPU_ARGS, **engine_kwargs),
        dict(server["env"], **(env_extra or {})),
        *extra,
        timeout=900,
    )
