"""Host (CPU) time of the canary's phases and methods around one request's eager bs 1
prefill, in process on real pools (``bench_serving_overhead.py --host-breakdown``,
docs/user_guide.md, "Overhead"): ``run_host_breakdown`` and the per-method timers of
``--host-breakdown-detail``."""

from __future__ import annotations

import cProfile
import gc
import os
import pstats
import statistics
import time

from common import (
    append_jsonl,
    bench_device,
    canary_on_configs,
    now_utc,
    parse_ints,
)
from prefill_canary import PREFILL_SHAPES, _Req, build_prefill_canary, prefill_chunk_batch
from serving_report import (
    HOST_PHASES,
    host_breakdown_table,
)


RULER_PYTHON_ITEMS = 256  # the ruler's pure-Python part: a list of this many ints, summed
RULER_TORCH_CALLS = 8  # the ruler's torch part: this many small device ops of each kind


# prefills run under cProfile per row with --host-breakdown-cprofile (not timed; 2 with
# --smoke-cpu)
PROFILED_PREFILLS = 20


def host_ruler_us(torch, scratch) -> float:
    """Host µs of a fixed workload of the kinds of calls the canary's host work makes (Python
    built-ins, torch's dispatch of small device ops: an in-place op, a sliced copy, an
    allocation), timed right before each prefill: the host's speed at that moment. The
    canary's phases divided by it compare runs (and runtimes) across a machine whose speed
    changes from one minute to the next (benchmark/results/latency_h100.md). ``scratch``: a
    1-D int64 tensor of at least 32 elements on the bench device."""
    t0 = time.perf_counter()
    sum(list(range(RULER_PYTHON_ITEMS)))
    for _ in range(RULER_TORCH_CALLS):
        scratch.add_(1)
        scratch[:16].copy_(scratch[16:32])
        torch.empty(16, dtype=torch.int64, device=scratch.device)
    return (time.perf_counter() - t0) * 1e6


def run_host_breakdown(args) -> None:
    """Host (CPU) time of each canary phase around one request's eager prefill, what a bs1
    time to first token pays: real pools with the Qwen3 shapes, the canary from the
    runtime's builder, a new request per prefill (chunked like the Engine), the model stood
    in for by a GPU sleep long enough that the host is never waiting for the device (so the
    phases' host time is all that is measured). ``batch init``, ``outside pre-ops`` and
    ``inside pre-ops`` run before the model's kernels are queued: their sum is what the
    forward waits for. Medians over ``--host-breakdown-runs`` prefills after two warm-ups;
    beside them the :func:`host_ruler_us` of each prefill, the median of the per-prefill
    ratios of the phases' sum to it, and the load average before and after the row."""
    import torch

    smoke = args.smoke_cpu
    device = bench_device(smoke, "--host-breakdown")
    isls = parse_ints(args.host_breakdown, "--host-breakdown")
    configs = canary_on_configs(args.configs, "--host-breakdown")
    chunk = 32 if smoke else args.chunked_prefill_size
    vocab = PREFILL_SHAPES[smoke][3]
    max_ctx = max(isls) + 8
    num_slots = max(4 * max(isls), 4096)
    runs = 2 if smoke else args.host_breakdown_runs
    profiled_prefills = 2 if smoke else PROFILED_PREFILLS
    name = torch.cuda.get_device_name() if not smoke else "cpu (smoke)"
    print(
        f"KV-canary host time per phase of a bs1 eager prefill — {name} — {now_utc()} — "
        f"chunk {chunk}, {runs} runs",
        flush=True,
    )
    rows = []
    for cname in configs:
        mgr, r2t, kv = build_prefill_canary(
            cname, device=device, smoke=smoke, max_ctx=max_ctx, num_slots=num_slots, chunk=chunk
        )
        gen = torch.Generator().manual_seed(0)

        scratch = torch.zeros(32, dtype=torch.int64, device=device)
        for isl in isls:
            times = {p: [] for p in HOST_PHASES}
            rulers, ratios = [], []
            load_before = os.getloadavg()
            profiler = pre_profiler = None  # enabled around the cProfile prefills
            # the profilers of the cProfile prefills, for printing once they are done
            profiled = None
            detail = None
            extra = (profiled_prefills if args.host_breakdown_cprofile else 0) + (
                runs if args.host_breakdown_detail else 0
            )
            for run in range(-2, runs + extra):
                # two warm-ups (Triton JIT, allocator), the timed runs, then (with
                # --host-breakdown-cprofile) 20 more under cProfile, not timed, and (with
                # --host-breakdown-detail) as many again with the canary's methods timed
                if run == runs and args.host_breakdown_cprofile:
                    profiler, pre_profiler = cProfile.Profile(), cProfile.Profile()
                    profiled = (pre_profiler, profiler)
                if args.host_breakdown_detail and run == runs + (
                    profiled_prefills if args.host_breakdown_cprofile else 0
                ):
                    profiler = pre_profiler = None  # the profiled prefills are done
                    detail = MethodTimers(mgr)
                row = 1 + (run % 4)
                req = _Req(row, torch.randint(100, vocab - 100, (isl,), generator=gen).tolist())
                slots = torch.randperm(num_slots - 1, generator=gen)[:isl] + 1
                r2t.req_to_token[row, :isl] = slots.to(torch.int32).to(device)
                per_run = {p: 0.0 for p in HOST_PHASES}
                ruler = host_ruler_us(torch, scratch)
                for start in range(0, isl, chunk):
                    n = min(chunk, isl - start)
                    fb = prefill_chunk_batch(req, slots, start, n, device=device, r2t=r2t, kv=kv)
                    tick = time.perf_counter
                    if pre_profiler is not None:
                        pre_profiler.enable()
                    t1 = tick()
                    mgr.on_forward_batch_init(fb, [req])
                    t2 = tick()
                    with mgr.with_active_single_forward_manager(0), mgr.with_ops_outside_graph(fb):
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
                    for phase, dt in zip(
                        HOST_PHASES, (t2 - t1, t3 - t2, t4 - t3, t6 - t5, t7 - t6)
                    ):
                        per_run[phase] += dt * 1e6
                if not smoke:
                    torch.cuda.synchronize()
                if 0 <= run < runs:
                    for p in HOST_PHASES:
                        times[p].append(per_run[p])
                    rulers.append(ruler)
                    ratios.append(sum(per_run.values()) / ruler)
            if mgr.count_violations():
                raise SystemExit(f"host breakdown {cname} isl {isl}: violations on a clean run")
            med = {p: statistics.median(v) for p, v in times.items()}
            before = sum(med[p] for p in HOST_PHASES[:3])
            rec = dict(
                kind="host_breakdown",
                time=now_utc(),
                gpu=name,
                config=cname,
                isl=isl,
                chunk=chunk,
                runs=runs,
                median_us=med,
                before_forward_us=before,
                ruler_us=statistics.median(rulers),
                sum_per_ruler=statistics.median(ratios),
                loadavg_before=load_before,
                loadavg_after=os.getloadavg(),
                # snapshots that found every reusable host buffer held (None: no such buffers)
                own_snapshot_buffers=_own_snapshot_buffers(mgr),
            )
            append_jsonl(args.out, rec)
            rows.append(rec)
            print(
                f"[{cname} isl {isl}] before the forward {before:.0f} µs; "
                + "; ".join(f"{p} {med[p]:.0f}" for p in HOST_PHASES)
                + f"; ruler {rec['ruler_us']:.1f} µs, sum / ruler {rec['sum_per_ruler']:.2f}",
                flush=True,
            )
            if detail is not None:
                detail.remove()
                print(
                    f"[{cname} isl {isl}] host µs per call of the canary's methods "
                    f"(inclusive: a method's time holds its callees'), {runs} prefills:"
                )
                print(detail.table(prefills=runs), flush=True)
                rec["methods_median_us"] = detail.medians()
                append_jsonl(args.out, dict(rec, kind="host_breakdown_detail"))
            if profiled is not None:
                pre_profiler, profiler = profiled
                print(
                    f"[{cname} isl {isl}] cProfile of {profiled_prefills} prefills' batch init "
                    "+ outside pre-ops + inside pre-ops (top 30 by own time):",
                    flush=True,
                )
                print(profile_table(pstats.Stats(pre_profiler), profiled_prefills), flush=True)
                print(
                    f"[{cname} isl {isl}] cProfile of {profiled_prefills} prefills' inside "
                    "post-ops + outside post-ops + read-back (top 30 by own time):",
                    flush=True,
                )
                print(profile_table(pstats.Stats(profiler), profiled_prefills), flush=True)
        del mgr, kv, r2t
        gc.collect()
    print()
    print(host_breakdown_table(rows))


def profile_table(stats: "pstats.Stats", prefills: int, top: int = 30) -> str:
    """A cProfile's ``top`` functions by own time as a table in µs per prefill (pstats' own
    listing rounds to milliseconds, coarser than one prefill's host work): calls, own time and
    time with callees, each divided by ``prefills``."""
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    lines = [
        "| function | calls per prefill | own µs per prefill | with callees, µs per prefill |",
        "| --- | ---: | ---: | ---: |",
    ]
    for (path, line, func), (_, ncalls, own, cum, _) in rows:
        where = f"{os.path.basename(path)}:{line}({func})" if line else func
        lines.append(
            f"| {where} | {ncalls / prefills:.1f} | {own / prefills * 1e6:.1f} | "
            f"{cum / prefills * 1e6:.1f} |"
        )
    total = sum(v[2] for v in stats.stats.values())
    lines.append(f"| (all {len(stats.stats)} functions) | | {total / prefills * 1e6:.1f} | |")
    return "\n".join(lines)


def _own_snapshot_buffers(mgr):
    """Token checks: how many snapshots got a host buffer of their own (every reusable one
    held); None without token checks or reusable buffers."""
    uploader = mgr.token_history
    buffers = getattr(uploader.rows, "buffers", None) if uploader is not None else None
    return buffers.own_buffers if buffers is not None else None


class MethodTimers:
    """Wraps the per-forward methods of a built canary (``mgr``: its ``CanaryManager``) with
    timers, on the instances (the classes are untouched; :meth:`remove` restores them): what
    each costs the host per call, for ``--host-breakdown-detail``. A wrapper adds about 0.3
    µs to each call it wraps and to every caller's figure."""

    def __init__(self, mgr):
        sfm = mgr.sfms[0]
        targets = [
            (
                mgr,
                "CanaryManager",
                ("on_forward_batch_init", "after_forward", "_on_host_copies", "_stage"),
            ),
            (mgr.device_host, "device_host", ("fence", "stage", "_gather", "consume")),
            (mgr.sweep, "sweep", ("maybe_run_sweep",)),
            (
                sfm,
                "sfm",
                (
                    "pre_ops_outside_graph",
                    "pre_ops_maybe_inside_graph",
                    "post_ops_maybe_inside_graph",
                    "post_ops_outside_graph",
                    "upload_tokens_before_replay",
                    "_join",
                ),
            ),
        ]
        if sfm.eager_graphs is not None:
            targets.append((sfm.eager_graphs, "eager_graphs", ("stage", "run_side", "run_tail")))
        if mgr.token_history is not None:
            targets.append(
                (mgr.token_history, "token_history", ("stage_for_replay", "upload", "snapshot"))
            )
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
