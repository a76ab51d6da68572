"""``python -m sglang.srt.kv_canary.demo``: watch the canary catch every fault class.

Starts a tiny dummy-weight sglang server with ``--kv-canary raise`` (on the CPU through
the harness of :mod:`~sglang.srt.kv_canary.testing.server_harness` when no GPU is present,
else on the GPU with CUDA graphs), runs a clean workload (shared prefixes → radix hits,
chunked prefill, a small pool → evictions), then the same workload once per fault class
(docs/architecture.md, "Self-tests") with that fault injected after a warm-up
(docs/user_guide.md, "Self-tests: fault injection, the token oracle, the demo"). Every run has
real-data fingerprints (``partial``), the radix sweep, the token oracle with the write-input
check and the token-id check on, so the clean run shows that none of them reports anything on
a healthy server. The ``host_kv`` case runs its server with HiCache (a host pool behind the
small device pool) and flips a byte in host memory; sglang 0.5.12's host pool needs CUDA, so
the demo runs it on a GPU only.

It prints one row per run: fault, injected (count, first step), detected, forward steps from
injection to the first matching report, the launch tags and fail reasons reported, and the
protected-token / sweep counts of the last stats line. A report "matches" a fault when its fail
reason is one the fault must cause (and, for real-KV faults, its slot is a slot the fault
changed). Exit status 0 only if the clean run reports nothing and every fault is detected.

``--mode log`` runs every server with ``--kv-canary log`` instead: a fault row then also needs
the server to have served its whole workload (fault injection undoes what it changed in
sglang's bookkeeping once the forward has read it). ``--page-size N`` sets sglang's page size
(N > 1 needs a GPU). ``--worker`` is the per-run child process (one server each: in raise mode
the first violation stops the server, as it would in production).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from sglang.srt.kv_canary.perturb.config import FaultKind
from sglang.srt.kv_canary.perturb.report import parse_perturb_line
from sglang.srt.kv_canary.runner.stats import STATS_LINE_PREFIX
from sglang.srt.kv_canary.runner.violation_line import ViolationLine, parse_violation_lines

RESULT_PREFIX = "DEMO_RESULT "

# settings shared by every run (clean and faulty)
DEMO_ENV = {
    "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE": "1",
    "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT": "1",
    "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
    "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "10",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "30",
    "SGLANG_KV_CANARY_RING_CAPACITY": "64",
}
DEMO_ENGINE_ARGS = dict(
    kv_canary="raise",
    kv_canary_real_data="partial",
    kv_canary_sweep_interval=2,
    chunked_prefill_size=32,
    max_total_tokens=384,
    max_running_requests=8,
    log_level="info",
)


@dataclasses.dataclass(frozen=True)
class DemoCase:
    """One run. ``fault`` None = the clean run. A report detects the fault when its fail reason
    contains one of ``reasons`` and its tag one of ``tags`` (substrings); with ``match_slot`` its
    slot must also be one the fault changed."""

    name: str
    fault: Optional[FaultKind]
    reasons: Tuple[str, ...] = ()
    tags: Tuple[str, ...] = ()
    match_slot: bool = False
    hicache: bool = False  # the server runs HiCache (--enable-hierarchical-cache): GPU only
    extra_env: Tuple[Tuple[str, str], ...] = ()

    @property
    def env(self) -> Dict[str, str]:
        if self.fault is None:
            return {}
        env = {self.fault.env_var: "1", **dict(self.extra_env)}
        if self.fault.is_real_kv:
            env["SGLANG_KV_CANARY_PERTURB_TARGET_GROUP"] = "full"
        return env


CASES = (
    DemoCase("clean", None),
    DemoCase(
        "req_to_token",
        FaultKind.REQ_TO_TOKEN,
        reasons=("verify_chain_hash", "verify_position", "verify_token"),
        tags=("HEAD_",),
    ),
    DemoCase(
        "real_kv_used",
        FaultKind.REAL_KV_USED,
        reasons=("verify_real_kv_hash",),
        tags=("TAIL_",),
        match_slot=True,
    ),
    DemoCase(
        "real_kv_unused_cache",
        FaultKind.REAL_KV_UNUSED_CACHE,
        reasons=("verify_real_kv_hash",),
        tags=("SWEEP_",),
        match_slot=True,
    ),
    DemoCase(
        "real_kv_post_forward",
        FaultKind.REAL_KV_POST_FORWARD,
        reasons=("verify_real_kv_hash",),
        tags=("TAIL_", "SWEEP_"),
        match_slot=True,
    ),
    DemoCase(
        "next_token_swap",
        FaultKind.NEXT_TOKEN_SWAP,
        reasons=("write_token",),
        tags=("HEAD_", "TAIL_"),
    ),
    # HiCache: a byte flipped in host memory, found by the host-tier sweep (every host page
    # each pass here) or when the page is loaded back; the report's slot is the host index
    DemoCase(
        "host_kv",
        FaultKind.HOST_KV,
        reasons=("verify_real_kv_hash",),
        tags=("SWEEP_", "TAIL_"),
        hicache=True,
        extra_env=(("SGLANG_KV_CANARY_HOST_SWEEP_PAGES", "4096"),),
    ),
)
CASES_BY_NAME = {c.name: c for c in CASES}


# ---- the workload (child process) ------------------------------------------------------------


def demo_requests(seed: int = 0) -> List[Tuple[List[int], int]]:
    """48 ``(input_ids, max_new_tokens)`` over three shared prefixes (vocab of the tiny model:
    512), in four waves of 12."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(n)] for n in (120, 90, 60)]
    reqs = []
    for i in range(48):
        p = prefixes[i % 3]
        tail = [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
        reqs.append((p[: rng.randint(len(p) // 2, len(p))] + tail, rng.randint(8, 24)))
    return reqs


def demo_engine_args(
    mode: str = "raise", page_size: int = 1, hicache: bool = False
) -> Dict[str, object]:
    """The Engine arguments of every run: :data:`DEMO_ENGINE_ARGS` with ``--kv-canary mode``
    and ``--page-size``; sglang wants the chunked-prefill size a multiple of the page size, and
    the pool keeps room for at least 12 pages. ``hicache``: HiCache on with sglang's defaults
    (a host pool twice the device pool, write-through), so pages the small device pool evicts
    stay in host memory and come back on a prefix hit."""
    base = DEMO_ENGINE_ARGS["chunked_prefill_size"]
    args = dict(
        DEMO_ENGINE_ARGS,
        kv_canary=mode,
        page_size=page_size,
        chunked_prefill_size=-(-base // page_size) * page_size,
        max_total_tokens=max(DEMO_ENGINE_ARGS["max_total_tokens"], 12 * page_size),
    )
    if hicache:
        args["enable_hierarchical_cache"] = True
    return args


def _worker(
    model_dir: str, device: str, mode: str = "raise", page_size: int = 1, hicache: bool = False
) -> None:
    import sglang
    from sglang.srt.kv_canary.testing.server_harness import cpu_engine_kwargs, gpu_engine_kwargs

    make = gpu_engine_kwargs if device == "cuda" else cpu_engine_kwargs
    engine = sglang.Engine(**make(model_dir, **demo_engine_args(mode, page_size, hicache)))
    reqs = demo_requests()
    generated = 0
    for b in range(0, len(reqs), 12):
        wave = reqs[b : b + 12]
        outs = engine.generate(
            input_ids=[r[0] for r in wave],
            sampling_params=[
                {"max_new_tokens": r[1], "temperature": 0, "ignore_eos": True} for r in wave
            ],
        )
        generated += sum(len(o["output_ids"]) for o in outs)
    print(
        RESULT_PREFIX + json.dumps({"requests": len(reqs), "generated_tokens": generated}),
        flush=True,
    )
    engine.shutdown()


# ---- reading a run's output ------------------------------------------------------------------

_STATS_RE = re.compile(
    re.escape(STATS_LINE_PREFIX) + r" step=(\d+) protected_tokens=(\d+) sweep_passes=(\d+)"
)


def parse_violations(text: str) -> List[ViolationLine]:
    """Every distinct violation report in ``text``: a slot reported by the same launch for the
    same reasons at the same step counts once (raise mode prints a report twice, and one
    corrupted record can be reported for several entries of one plan)."""
    seen, out = set(), []
    for v in parse_violation_lines(text):
        key = (v.launch_tag, v.fail_reasons, v.slot_idx, v.forward_step)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def parse_injections(text: str) -> List[Dict[str, str]]:
    seen, out = set(), []
    for line in text.splitlines():
        fields = parse_perturb_line(line)
        if fields is not None and line not in seen:
            seen.add(line)
            out.append(fields)
    return out


def _injected_slots(injections: Sequence[Dict[str, str]]) -> set:
    return {int(i[k]) for i in injections for k in ("slot", "new_slot") if k in i}


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """One row of the demo table."""

    name: str
    fault: Optional[str]
    returncode: int
    injections: int
    first_injection_step: Optional[int]
    detected: bool
    steps_to_report: Optional[int]
    tags: Tuple[str, ...]
    reasons: Tuple[str, ...]
    violations: int
    protected_tokens: Optional[int]
    sweep_passes: Optional[int]
    finished: bool
    mode: str = "raise"

    @property
    def alive(self) -> bool:
        """The server served the whole workload and shut down cleanly."""
        return self.returncode == 0 and self.finished

    @property
    def ok(self) -> bool:
        """Clean run: alive and quiet. A fault: detected; in ``log`` mode the server must also
        have kept serving to the end (fault injection must not break sglang's own state)."""
        if self.fault is None:
            return self.alive and self.violations == 0
        return self.detected and (self.mode == "raise" or self.alive)


def evaluate(case: DemoCase, text: str, returncode: int, *, mode: str = "raise") -> CaseResult:
    """Judge one run (``--kv-canary mode``) from its combined output."""
    violations = parse_violations(text)
    injections = [
        i
        for i in parse_injections(text)
        if case.fault is not None and i.get("fault") == case.fault.value
    ]
    first = min((int(i["step"]) for i in injections), default=None)
    slots = _injected_slots(injections)
    matching = [
        v
        for v in violations
        if first is not None
        and v.forward_step >= first
        and any(r in v.fail_reasons for r in case.reasons)
        and any(seen.startswith(t) for t in case.tags for seen in v.seen_by)
        and (not case.match_slot or v.slot_idx in slots)
    ]
    stats = _STATS_RE.findall(text)
    last = stats[-1] if stats else None
    return CaseResult(
        name=case.name,
        fault=case.fault.value if case.fault else None,
        returncode=returncode,
        injections=len(injections),
        first_injection_step=first,
        detected=bool(matching),
        steps_to_report=(min(v.forward_step for v in matching) - first) if matching else None,
        tags=tuple(sorted({tag for v in violations for tag in v.seen_by})),
        reasons=tuple(sorted({r for v in violations for r in v.fail_reasons})),
        violations=len(violations),
        protected_tokens=int(last[1]) if last else None,
        sweep_passes=int(last[2]) if last else None,
        finished=RESULT_PREFIX in text,
        mode=mode,
    )


def exit_status(results: Sequence[CaseResult]) -> int:
    """0 when every row is ok (clean run quiet, every fault detected), else 1."""
    return 0 if results and all(r.ok for r in results) else 1


def format_table(
    results: Sequence[CaseResult], device: str, *, mode: str = "raise", page_size: int = 1
) -> str:
    head = (
        "fault",
        "injected",
        "detected",
        "steps to report",
        "tags",
        "reasons",
        "protected tokens",
        "sweeps",
        "served to the end",
    )
    rows = []
    for r in results:
        injected = (
            "-"
            if r.fault is None
            else (
                f"{r.injections}x from step {r.first_injection_step}" if r.injections else "never"
            )
        )
        detected = (
            ("no violation" if r.violations == 0 else "FALSE POSITIVE")
            if r.fault is None
            else ("yes" if r.detected else "NO")
        )
        rows.append(
            (
                r.name,
                injected,
                detected,
                "-" if r.steps_to_report is None else str(r.steps_to_report),
                ",".join(r.tags) or "-",
                ",".join(r.reasons) or "-",
                "-" if r.protected_tokens is None else str(r.protected_tokens),
                "-" if r.sweep_passes is None else str(r.sweep_passes),
                "yes" if r.alive else "no",
            )
        )
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [
        f"kv_canary demo on {device}: --kv-canary {mode}, page size {page_size}, real data "
        "partial, sweep every 2 steps, token oracle + write-input + token-id checks",
        line(head),
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    out += [line(r) for r in rows]
    return "\n".join(out)


# ---- the parent ------------------------------------------------------------------------------


def _detect_device(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - no usable torch CUDA: the CPU path
        return "cpu"


def run_case(
    case: DemoCase,
    *,
    model_dir: str,
    device: str,
    base_env: Dict[str, str],
    timeout: float,
    mode: str = "raise",
    page_size: int = 1,
) -> Tuple[CaseResult, str]:
    env = dict(base_env, **DEMO_ENV, **case.env)
    cmd = [
        sys.executable,
        "-m",
        "sglang.srt.kv_canary.demo",
        "--worker",
        "--model",
        model_dir,
        "--device",
        device,
        "--mode",
        mode,
        "--page-size",
        str(page_size),
    ]
    if case.hicache:
        cmd.append("--hicache")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or "") + (e.stderr or "") if isinstance(e.stdout, str) else ""
        rc = -9
    return evaluate(case, text, rc, mode=mode), text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang.srt.kv_canary.demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--cases",
        default=None,
        help=f"comma-separated subset of: {', '.join(CASES_BY_NAME)} (default: "
        "all; on the CPU all but the HiCache ones: "
        f"{', '.join(c.name for c in CASES if c.hicache)})",
    )
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--logs", help="directory to keep each run's full output in")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time (default 1); each run is its own server, so on a GPU they share it",
    )
    parser.add_argument(
        "--mode",
        choices=("raise", "log"),
        default="raise",
        help="--kv-canary of every run; with log, a fault run must also serve "
        "its whole workload (the server survives the injection)",
    )
    parser.add_argument(
        "--page-size",
        type=int,
        default=1,
        help="sglang --page-size of every run (> 1 needs a GPU: sglang's paged "
        "allocator runs Triton kernels)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hicache", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.page_size < 1:
        parser.error(f"--page-size must be >= 1, got {args.page_size}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.worker:
        _worker(args.model, args.device, args.mode, args.page_size, args.hicache)
        return 0

    device = _detect_device(args.device)
    if args.cases is None:
        names = [c.name for c in CASES if device == "cuda" or not c.hicache]
        if device == "cpu":
            print(
                "kv_canary demo: on the CPU without the HiCache case(s) "
                f"{', '.join(c.name for c in CASES if c.hicache)}: sglang 0.5.12's HiCache host "
                "pool needs CUDA (run the demo on a GPU for them)",
                flush=True,
            )
    else:
        names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES_BY_NAME]
    if unknown or not names:
        parser.error(
            f"--cases: unknown {', '.join(unknown) or '(empty)'}; allowed: "
            f"{', '.join(CASES_BY_NAME)}"
        )
    if device == "cpu" and args.page_size > 1:
        parser.error(
            f"--page-size {args.page_size} needs --device cuda: sglang 0.5.12's paged "
            "allocator runs Triton kernels, which its CPU engine cannot"
        )
    on_host = [n for n in names if CASES_BY_NAME[n].hicache]
    if device == "cpu" and on_host:
        parser.error(
            f"--cases {','.join(on_host)} needs --device cuda: it runs HiCache "
            "(--enable-hierarchical-cache), whose host pool sglang 0.5.12 pins with "
            "CUDA"
        )
    from sglang.srt.kv_canary.testing.server_harness import (
        build_libcuda_stub,
        cpu_server_env,
        write_tiny_llama,
    )

    with tempfile.TemporaryDirectory(prefix="kv_canary_demo_") as root:
        if device == "cuda":
            model = write_tiny_llama(
                os.path.join(root, "model"), hidden_size=256, intermediate_size=512
            )
            env = dict(os.environ)
        else:
            model = write_tiny_llama(os.path.join(root, "model"))
            env = cpu_server_env(build_libcuda_stub(os.path.join(root, "stub")))
        for k in list(env):  # the demo sets its own canary variables
            if k.startswith("SGLANG_KV_CANARY_"):
                del env[k]

        def one(name: str) -> Tuple[CaseResult, str]:
            print(f"kv_canary demo: running {name} ...", flush=True)
            return run_case(
                CASES_BY_NAME[name],
                model_dir=model,
                device=device,
                base_env=env,
                timeout=args.timeout,
                mode=args.mode,
                page_size=args.page_size,
            )

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            runs = list(pool.map(one, names))  # in the order of names
        results = []
        for name, (result, text) in zip(names, runs):
            results.append(result)
            if args.logs:
                os.makedirs(args.logs, exist_ok=True)
                with open(os.path.join(args.logs, f"{name}.log"), "w") as f:
                    f.write(text)
            if not result.ok and result.fault is None:
                print(text[-3000:], file=sys.stderr)
    print(format_table(results, device, mode=args.mode, page_size=args.page_size))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    status = exit_status(results)
    print(
        "kv_canary demo: "
        + (
            "every fault detected, clean run quiet"
            if status == 0
            else "FAILED: " + ", ".join(r.name for r in results if not r.ok)
        )
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
