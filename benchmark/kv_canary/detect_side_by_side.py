"""Detection and deployments side by side: this project's canary (sglang 0.5.12) and upstream
sglang's own (0.5.17, run as a black box from its wheel), each tried on the same workload with
the same faults injected, each through its own ``SGLANG_KV_CANARY_*`` variables (both stacks
read the same names: ``..._PERTURB_<FAULT>_PROB``, ``..._PERTURB_TARGET_GROUP``,
``..._PERTURB_WARMUP_STEPS``, ``..._ENABLE_TOKEN_ORACLE`` and the two token checks; upstream's
server builds the token oracle only with ``--sampling-backend token_oracle``, which its runs
that ask for the oracle get: :func:`stack_kwargs`).

Two tables (docs/user_guide.md, "Self-tests: fault injection, the token oracle, the demo"):

- **detection**: for each fault class (and a clean run), one ``sglang.Engine`` per stack with
  ``--kv-canary raise``, real data ``partial``, the sweep every 2 steps, the token oracle and
  both token checks, on the demo's workload (shared prefixes, chunked prefill, a small pool).
  A row says whether the fault was injected (the stack's ``kv_canary perturb`` lines, skips
  not counted), whether a report with a reason that fault must cause came after it (both
  stacks print the ``kv_canary violation: launch_tag=... fail_reason=... slot_idx=...`` line of
  the record format), the first such report, and how the run ended.
- **deployments**: MLA (a tiny DeepSeek-V2), HiCache, EAGLE and ``--kv-canary abort``, each
  started with the canary off (the control), clean and with a ``req_to_token`` fault: whether
  the stack's sglang serves it at all, whether the stack refuses the deployment at start-up
  (and its message), installs the canary (its start-up line) and catches the fault, runs
  without guarding, or crashes.

Each run is a child process (``side_by_side_workload.py``) with the stack's ``PYTHONPATH``
(upstream's: ``benchmark/kv_canary/upstream_site`` first, as ``bench_interleaved.py`` does);
the child imports nothing of this project. Upstream's runs need ``--upstream-site`` (the
directory ``upstream_bundle.sh``'s bundles install into); without it only this project's stack
runs, which is what CPU CI checks (``--device cpu``: no MLA, HiCache or EAGLE on the CPU)::

    python benchmark/kv_canary/detect_side_by_side.py --upstream-site /tmp/site_up \\
        --jobs 4 --logs /tmp/sbs_logs --json /tmp/sbs.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import PROJECT_STACK, UPSTREAM_STACK, upstream_env, use_test_support  # noqa: E402
from side_by_side_workload import INFO_PREFIX, RESULT_PREFIX  # noqa: E402

from sglang.srt.kv_canary.demo.cases import (  # noqa: E402
    CASES,
    DEMO_ENGINE_ARGS,
    DEMO_ENV,
    PD_ENV_LEFT_OUT,
    DemoCase,
    demo_requests,
)

WORKLOAD = HERE / "side_by_side_workload.py"

# the fault classes both stacks inject: the demo's cases (its variables, the reasons a report
# of each must carry) but the HiCache host tier's, which is this project's alone
FAULTS = {c.name: c for c in CASES if c.fault is not None and not c.hicache and not c.pd}
CLEAN = "clean"


@dataclasses.dataclass(frozen=True)
class Deployment:
    """A deployment tried on both stacks: its model, engine arguments over the run's, and
    whether sglang 0.5.12 can serve it on the CPU."""

    name: str
    model: str  # "llama" or "deepseek_v2"
    engine_args: Tuple[Tuple[str, object], ...] = ()
    cpu: bool = True
    draft: bool = False  # an EAGLE draft model beside the target
    # canary variables of the run's that this deployment runs without, on both stacks
    env_left_out: Tuple[str, ...] = ()


# longer than any of the demo's prompts, so no prompt of the EAGLE deployment is split
EAGLE_CHUNKED_PREFILL_SIZE = 512

DEPLOYMENTS = {
    d.name: d
    for d in (
        # sglang's CPU attention (torch_native) has no MLA and its Triton backend runs there only
        # under the interpreter, too slow for this workload (test_e2e_mla_server covers MLA on CPU)
        Deployment("mla", "deepseek_v2", (("attention_backend", "triton"),), cpu=False),
        Deployment(
            "hicache",
            "llama",
            (("enable_hierarchical_cache", True), ("hicache_ratio", 4)),
            cpu=False,
        ),
        Deployment(
            "eagle",
            "llama",
            (
                ("speculative_algorithm", "EAGLE"),
                ("speculative_num_steps", 3),
                ("speculative_eagle_topk", 1),
                ("speculative_num_draft_tokens", 4),
                # unchunked: sglang 0.5.12 computes a non-final prefill chunk's last draft KV
                # from the sampled token (upstream's fix is in 0.5.17), which this canary
                # reports before any fault (docs/user_guide.md, "Speculative decoding")
                ("chunked_prefill_size", EAGLE_CHUNKED_PREFILL_SIZE),
            ),
            cpu=False,
            draft=True,
            # the token oracle samples the target's tokens itself, which EAGLE's verify
            # replaces (this project refuses the two together at start-up: a self-test
            # setting, not the deployment this row is about)
            env_left_out=PD_ENV_LEFT_OUT,
        ),
        Deployment("abort", "llama", (("kv_canary", "abort"),)),
    )
}
PROBE_FAULT = "req_to_token"  # the fault each deployment is also started with
OFF_SUFFIX = ":off"  # a deployment's control run: the same server with the canary off

# how each stack's canary says it is on (its start-up line): one per worker it guards
INSTALLED_MARK = {PROJECT_STACK: "kv_canary installed", UPSTREAM_STACK: "install_canary:"}

_VIOLATION_RE = re.compile(
    r"kv_canary violation: launch_tag=(\w+) fail_reason=([\w+]+) "
    r"slot_idx=(-?\d+)"
)
_PERTURB_RE = re.compile(r"kv_canary perturb\b[^:]*:(.*)$")


@dataclasses.dataclass(frozen=True)
class Report:
    """One ``kv_canary violation:`` line: the fields both stacks print first."""

    launch_tag: str
    fail_reasons: Tuple[str, ...]
    slot_idx: int

    def __str__(self) -> str:
        return f"{self.launch_tag} {'+'.join(self.fail_reasons)} slot {self.slot_idx}"


def parse_reports(text: str) -> List[Report]:
    """Every distinct violation report in a run's output, in order (raise mode logs a report
    and raises it again: one entry)."""
    out: List[Report] = []
    for m in _VIOLATION_RE.finditer(text):
        r = Report(m.group(1), tuple(m.group(2).split("+")), int(m.group(3)))
        if r not in out:
            out.append(r)
    return out


def parse_injections(text: str) -> List[str]:
    """The lines that say a fault was injected: ``kv_canary perturb ...:`` lines, less the
    ones that say it was skipped or that the warm-up window opened or closed."""
    out = []
    for line in text.splitlines():
        m = _PERTURB_RE.search(line)
        if m is None:
            continue
        body = m.group(1)
        if "skipped" in body or "warmup" in body or "warm-up" in body:
            continue
        out.append(line[m.start() :].strip())
    return out


def last_error(text: str) -> Optional[str]:
    """The last ``SomethingError: message`` line of a traceback in ``text``, or None."""
    errors = [
        line.strip()
        for line in text.splitlines()
        if re.match(r"\s*[\w.]*(Error|Exception|Exit)\b.*:", line)
    ]
    return errors[-1][:300] if errors else None


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One run's facts, read from its output and exit status."""

    stack: str
    case: str  # a fault's name, "clean", or "<deployment>" / "<deployment>+<fault>"
    returncode: int
    version: Optional[str]
    installed: int  # start-up lines of the stack's canary (one per guarded worker)
    injections: int
    reports: Tuple[Report, ...]
    served: bool  # every wave sent and the server still up at the end (the RESULT line)
    error: Optional[str]
    failed_waves: Tuple[str, ...] = ()  # the error of each wave whose call failed

    def caught(self, fault: Optional[DemoCase]) -> bool:
        """A report carrying a reason ``fault`` must cause (any report when ``fault`` has no
        fixed reasons, i.e. is None: the clean run's false positives)."""
        if fault is None:
            return bool(self.reports)
        return any(set(r.fail_reasons) & set(fault.reasons) for r in self.reports)

    @property
    def ended(self) -> str:
        if self.served and self.returncode == 0:
            if not self.failed_waves:
                return "served every request"
            return f"kept serving; {len(self.failed_waves)} wave(s) failed: {self.failed_waves[0]}"
        return f"stopped (exit {self.returncode}): {self.error or 'no error line'}"


def evaluate(stack: str, case: str, text: str, returncode: int) -> RunResult:
    info = [
        json.loads(line[len(INFO_PREFIX) :])
        for line in text.splitlines()
        if line.startswith(INFO_PREFIX)
    ]
    result = [
        json.loads(line[len(RESULT_PREFIX) :])
        for line in text.splitlines()
        if line.startswith(RESULT_PREFIX)
    ]
    return RunResult(
        stack=stack,
        case=case,
        returncode=returncode,
        version=info[0].get("version") if info else None,
        installed=text.count(INSTALLED_MARK[stack]),
        injections=len(parse_injections(text)),
        reports=tuple(parse_reports(text)),
        served=bool(result),
        error=last_error(text),
        failed_waves=tuple(w["error"] for w in result[0].get("failed_waves", ())) if result else (),
    )


# ---- one run ---------------------------------------------------------------------------------


def stack_env(base_env: Dict[str, str], stack: str, upstream_site: Optional[str]) -> Dict[str, str]:
    """A run's environment: ``base_env`` less every ``SGLANG_KV_CANARY_*`` (each run sets its
    own) and, for upstream's runs, upstream's ``PYTHONPATH`` (``common.upstream_env``)."""
    env = {k: v for k, v in base_env.items() if not k.startswith("SGLANG_KV_CANARY_")}
    if stack == UPSTREAM_STACK:
        if not upstream_site:
            raise ValueError(
                "upstream's stack needs --upstream-site (the directory "
                "benchmark/kv_canary/upstream_bundle.sh's bundles install into)"
            )
        env = upstream_env(env, upstream_site)
    return env


# Upstream's server builds its token oracle (the sampler its write-input check and next-token
# swap need) only for this sampling backend, whatever its SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE
# says; this project's builds it for either
ORACLE_VAR = "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE"
UPSTREAM_ORACLE_BACKEND = ("sampling_backend", "token_oracle")


# Engine arguments sglang 0.5.17 renamed: this project's (0.5.12's) name -> (upstream's name,
# its value for each of ours); upstream keeps the old name as a command-line flag only
UPSTREAM_RENAMED_KWARGS = {
    "disable_piecewise_cuda_graph": ("cuda_graph_backend_prefill", {True: "disabled"}),
    "cuda_graph_max_bs": ("cuda_graph_max_bs_decode", None),  # None: the value as it is
}


def stack_kwargs(
    stack: str, kwargs: Dict[str, object], env: Optional[Dict[str, str]] = None
) -> Dict[str, object]:
    """``kwargs`` as ``stack``'s ``sglang.Engine`` takes them for a run with variables
    ``env``: upstream's runs get :data:`UPSTREAM_RENAMED_KWARGS`' names (an old value without a
    new one, e.g. ``disable_piecewise_cuda_graph=False``, is sglang's default there and is left
    out) and, where ``env`` asks for the token oracle, :data:`UPSTREAM_ORACLE_BACKEND`."""
    if stack != UPSTREAM_STACK:
        return dict(kwargs)
    out = {}
    if (env or {}).get(ORACLE_VAR) == "1":
        out[UPSTREAM_ORACLE_BACKEND[0]] = UPSTREAM_ORACLE_BACKEND[1]
    for key, value in kwargs.items():
        if key in UPSTREAM_RENAMED_KWARGS:
            new_key, values = UPSTREAM_RENAMED_KWARGS[key]
            if values is None:
                out[new_key] = value
            elif value in values:
                out[new_key] = values[value]
            continue
        out.setdefault(key, value)
    return out


@dataclasses.dataclass(frozen=True)
class Run:
    stack: str
    case: str
    engine_kwargs: Dict[str, object]
    env: Dict[str, str]


def run_one(run: Run, requests_file: str, timeout: float) -> Tuple[RunResult, str]:
    cmd = [sys.executable, str(WORKLOAD), json.dumps(run.engine_kwargs), requests_file]
    try:
        proc = subprocess.run(cmd, env=run.env, capture_output=True, text=True, timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        text, rc = out + err + f"\nTimeoutExpired: no end after {timeout:.0f} s", -9
    return evaluate(run.stack, run.case, text, rc), text


# ---- the plan --------------------------------------------------------------------------------


def plan(
    *,
    stacks: Sequence[str],
    faults: Sequence[str],
    deployments: Sequence[str],
    models: Dict[str, str],
    draft_dir: Optional[str],
    make_kwargs,
    base_env: Dict[str, str],
    upstream_site: Optional[str],
) -> List[Run]:
    """Every run, stack by stack: the clean run and each fault (the detection table), then each
    deployment with the canary off (no canary flag or variable), clean, and with
    :data:`PROBE_FAULT`."""
    runs = []
    for stack in stacks:
        bare = stack_env(base_env, stack, upstream_site)  # no canary variable at all
        env0 = {**bare, **DEMO_ENV}
        for case in faults:
            env = {**env0, **(FAULTS[case].env if case in FAULTS else {})}
            runs.append(
                Run(
                    stack,
                    case,
                    stack_kwargs(stack, make_kwargs(models["llama"], **DEMO_ENGINE_ARGS), env),
                    env,
                )
            )
        for name in deployments:
            d = DEPLOYMENTS[name]
            args = dict(DEMO_ENGINE_ARGS, **dict(d.engine_args))
            if d.draft:
                args["speculative_draft_model_path"] = draft_dir
            off = {k: v for k, v in args.items() if not k.startswith("kv_canary")}
            runs.append(
                Run(
                    stack,
                    name + OFF_SUFFIX,
                    stack_kwargs(stack, make_kwargs(models[d.model], kv_canary="none", **off)),
                    bare,
                )
            )
            for fault in (None, FAULTS[PROBE_FAULT]):
                env = {**env0, **(fault.env if fault else {})}
                env = {k: v for k, v in env.items() if k not in d.env_left_out}
                runs.append(
                    Run(
                        stack,
                        name if fault is None else f"{name}+{fault.name}",
                        stack_kwargs(stack, make_kwargs(models[d.model], **args), env),
                        env,
                    )
                )
    return runs


# ---- tables ----------------------------------------------------------------------------------


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    out += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(out)


def detection_table(results: Sequence[RunResult]) -> str:
    rows = []
    for r in results:
        if r.case != CLEAN and r.case not in FAULTS:
            continue
        fault = FAULTS.get(r.case)
        if fault is None:
            verdict = "FALSE POSITIVE" if r.reports else "quiet"
        else:
            verdict = (
                "caught"
                if r.caught(fault)
                else ("not injected" if r.injections == 0 else "NOT caught")
            )
        first = next(
            (
                str(x)
                for x in r.reports
                if fault is None or set(x.fail_reasons) & set(fault.reasons)
            ),
            "-",
        )
        rows.append((r.case, r.stack, r.version or "?", str(r.injections), verdict, first, r.ended))
    return _table(
        ("fault", "stack", "sglang", "injections", "verdict", "first report", "the run"), rows
    )


def deployment_verdict(
    clean: RunResult, probed: Optional[RunResult], off: Optional[RunResult] = None
) -> str:
    """What a stack does with a deployment, from its clean run, its ``req_to_token`` run and
    its canary-off control (a deployment the stack's sglang cannot serve with the canary off
    says nothing of the canary)."""
    if off is not None and (not off.served or off.failed_waves):
        return f"sglang itself fails it (canary off): {off.error or off.ended}"
    if not clean.served:
        text = clean.error or "no error line"
        return (
            f"refuses at start-up: {text}"
            if clean.installed == 0
            else f"crashes (canary installed): {text}"
        )
    if clean.failed_waves:
        return (
            f"fails requests of a clean run ({len(clean.failed_waves)} wave(s)): "
            f"{clean.failed_waves[0]}"
        )
    if clean.reports:
        return f"false positive: {clean.reports[0]}"
    if clean.installed == 0:
        return "serves, canary not installed"
    if probed is None:
        return f"serves, canary installed ({clean.installed} worker(s))"
    if probed.caught(FAULTS[PROBE_FAULT]):
        return (
            f"guards: canary on {clean.installed} worker(s), {PROBE_FAULT} caught "
            f"({probed.reports[0]}); with the fault the server {probed.ended}"
        )
    return (
        f"canary on {clean.installed} worker(s) but {PROBE_FAULT} NOT caught "
        f"({probed.injections} injections; {probed.ended})"
    )


def deployment_table(results: Sequence[RunResult]) -> str:
    by_key = {(r.stack, r.case): r for r in results}
    rows = []
    for (stack, case), r in by_key.items():
        if case not in DEPLOYMENTS:
            continue
        probed = by_key.get((stack, f"{case}+{PROBE_FAULT}"))
        off = by_key.get((stack, case + OFF_SUFFIX))
        rows.append((case, stack, r.version or "?", deployment_verdict(r, probed, off)))
    return _table(("deployment", "stack", "sglang", "what it does"), rows)


# ---- main ------------------------------------------------------------------------------------


def _names(value: str, allowed: Sequence[str], flag: str) -> List[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown {', '.join(bad)}; allowed: {', '.join(allowed)}")
    return names


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--stacks",
        default=None,
        help=f"comma-separated from {PROJECT_STACK}, {UPSTREAM_STACK} (default: both "
        "with --upstream-site, else the project's)",
    )
    p.add_argument("--upstream-site", metavar="DIR", help="upstream sglang's site directory")
    p.add_argument(
        "--faults",
        default=",".join((CLEAN, *FAULTS)),
        help=f"comma-separated from {', '.join((CLEAN, *FAULTS))} (default: all)",
    )
    p.add_argument(
        "--deployments",
        default=None,
        help=f"comma-separated from {', '.join(DEPLOYMENTS)} (default: all on a GPU, "
        "the CPU ones on the CPU; '' for none)",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each its own Engine)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--logs", help="directory for each run's whole output")
    p.add_argument("--json", help="write every run's facts here")
    args = p.parse_args(argv)

    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    default_stacks = f"{PROJECT_STACK},{UPSTREAM_STACK}" if args.upstream_site else PROJECT_STACK
    stacks = _names(args.stacks or default_stacks, (PROJECT_STACK, UPSTREAM_STACK), "--stacks")
    if UPSTREAM_STACK in stacks and not args.upstream_site:
        p.error(f"--stacks {UPSTREAM_STACK} needs --upstream-site DIR")
    if UPSTREAM_STACK in stacks and args.device == "cpu":
        p.error(
            f"--stacks {UPSTREAM_STACK} needs --device cuda: its bundle is built for the "
            "GPU machines"
        )
    faults = _names(args.faults, (CLEAN, *FAULTS), "--faults")
    if args.deployments is None:
        deployments = [d.name for d in DEPLOYMENTS.values() if args.device == "cuda" or d.cpu]
    else:
        deployments = _names(args.deployments, tuple(DEPLOYMENTS), "--deployments")
    gpu_only = [d for d in deployments if args.device == "cpu" and not DEPLOYMENTS[d].cpu]
    if gpu_only:
        p.error(
            f"--deployments {','.join(gpu_only)} needs --device cuda: sglang 0.5.12 runs "
            "HiCache's host pool and EAGLE's CUDA graphs only there, and its CPU attention "
            "has no MLA"
        )

    from sglang.srt.kv_canary.demo.server_harness import (
        build_libcuda_stub,
        cpu_engine_kwargs,
        cpu_server_env,
        gpu_engine_kwargs,
        write_tiny_llama,
    )

    use_test_support()
    from canary_support.tiny_models import write_tiny_deepseek_v2

    with tempfile.TemporaryDirectory(prefix="kv_canary_sbs_") as root:
        models = {
            "llama": write_tiny_llama(os.path.join(root, "llama")),
            "deepseek_v2": write_tiny_deepseek_v2(os.path.join(root, "deepseek_v2")),
        }
        draft = write_tiny_llama(
            os.path.join(root, "draft"),
            architectures=["LlamaForCausalLMEagle"],
            num_hidden_layers=1,
        )
        if args.device == "cuda":
            make, base_env = gpu_engine_kwargs, dict(os.environ)
        else:
            make = cpu_engine_kwargs
            base_env = cpu_server_env(build_libcuda_stub(os.path.join(root, "stub")))
        requests_file = os.path.join(root, "requests.json")
        with open(requests_file, "w") as f:
            json.dump(demo_requests(), f)
        runs = plan(
            stacks=stacks,
            faults=faults,
            deployments=deployments,
            models=models,
            draft_dir=draft,
            make_kwargs=make,
            base_env=base_env,
            upstream_site=args.upstream_site,
        )

        def one(run: Run) -> Tuple[RunResult, str]:
            print(f"side by side: {run.stack} {run.case} ...", flush=True)
            return run_one(run, requests_file, args.timeout)

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            done = list(pool.map(one, runs))
    results = [r for r, _ in done]
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
        for r, text in done:
            with open(os.path.join(args.logs, f"{r.stack}_{r.case}.log"), "w") as f:
                f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    print("\n## Detection\n\n" + detection_table(results))
    if deployments:
        print("\n## Deployments\n\n" + deployment_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
