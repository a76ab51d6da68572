"""``python -m sglang.srt.kv_canary.demo``: watch the canary catch every fault class.

Starts a tiny dummy-weight sglang server with ``--kv-canary raise`` (on the CPU through
the harness of :mod:`~sglang.srt.kv_canary.demo.server_harness` when no GPU is present,
else on the GPU with CUDA graphs), runs a clean workload (shared prefixes → radix hits,
chunked prefill, a small pool → evictions), then the same workload once per fault class
(docs/subsystems.md, "Self-tests") with that fault injected after a warm-up
(docs/user_guide.md, "Self-tests: fault injection, the token oracle, the demo"). Every run has
real-data fingerprints (``partial``), the radix sweep, the token oracle with the write-input
check and the token-id check on, so the clean run shows that none of them reports anything on
a healthy server. The ``host_kv`` case runs its server with HiCache (a host pool behind the
small device pool) and flips a byte in host memory; sglang 0.5.12's host pool needs CUDA, so
the demo runs it on a GPU only. The ``pd_transfer`` case runs a prefill/decode pair
(:mod:`~sglang.srt.kv_canary.demo.pd_pair`: two ``launch_server`` processes, Mooncake's
transfer engine) and flips a byte of a page the decode server received; it needs a GPU and
Mooncake.

It prints one row per run: fault, injected (count, first step), detected, forward steps from
injection to the first matching report, the launch tags and fail reasons reported, and the
protected-token / sweep counts of the last stats line. A report "matches" a fault when its fail
reason is one the fault must cause (and, for real-KV faults, its slot is a slot the fault
changed). Exit status 0 only if the clean run reports nothing and every fault is detected.

``--mode log`` runs every server with ``--kv-canary log`` instead: a fault row then also needs
the server to have served its whole workload (fault injection undoes what it changed in
sglang's bookkeeping once the forward has read it). ``--mode heal`` runs ``--kv-canary heal``
with at most ``HEAL_MAX_FAULTS`` faults per run and the model's own greedy sampling (the token
oracle off: its tokens do not depend on the KV read): a fault row also needs the whole workload
served with every output equal to the clean run's (two more columns: the heals, and whether
the outputs match); the HiCache and PD cases are left out (heal mode refuses both), and
``next_token_swap`` (it needs the oracle). ``--page-size N`` sets sglang's page size
(N > 1 needs a GPU). ``--worker`` is the per-run child process (one server each: in raise mode
the first violation stops the server, as it would in production).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple


from sglang.srt.kv_canary.demo.cases import (
    CASES,
    CASES_BY_NAME,
    RESULT_PREFIX,
    CaseResult,
    DemoCase,
    HEAL_ENV_LEFT_OUT,
    HEAL_FAULT_TARGET,
    HEAL_MAX_FAULTS,
    compare_with_clean,
    demo_engine_args,
    demo_requests,
    evaluate,
    exit_status,
    format_table,
)


def _worker(
    model_dir: str, device: str, mode: str = "raise", page_size: int = 1, hicache: bool = False
) -> None:
    import sglang
    from sglang.srt.kv_canary.demo.server_harness import cpu_engine_kwargs, gpu_engine_kwargs

    make = gpu_engine_kwargs if device == "cuda" else cpu_engine_kwargs
    engine = sglang.Engine(**make(model_dir, **demo_engine_args(mode, page_size, hicache)))
    reqs = demo_requests()
    generated = 0
    digest = hashlib.sha256()
    for b in range(0, len(reqs), 12):
        wave = reqs[b : b + 12]
        outs = engine.generate(
            input_ids=[r[0] for r in wave],
            # fixed request ids: the token oracle's tokens are a function of the rid, so every
            # run of the demo samples the same outputs (heal mode compares them)
            rid=[f"demo-{b + i}" for i in range(len(wave))],
            sampling_params=[
                {"max_new_tokens": r[1], "temperature": 0, "ignore_eos": True} for r in wave
            ],
        )
        generated += sum(len(o["output_ids"]) for o in outs)
        for o in outs:
            digest.update(json.dumps(o["output_ids"]).encode())
    print(
        RESULT_PREFIX
        + json.dumps(
            {
                "requests": len(reqs),
                "generated_tokens": generated,
                "outputs_digest": digest.hexdigest()[:16],
            }
        ),
        flush=True,
    )
    engine.shutdown()


# a request of the PD workload: the decode server's answer comes within this (a wave waits
# for its requests; a decode server stopped by a report ends the run at once)
PD_REQUEST_TIMEOUT_S = 120.0
PD_START_TIMEOUT_S = 420.0


def _pd_worker(model_dir: str, mode: str, page_size: int) -> None:
    """The demo workload through a PD pair: a prefill and a decode ``launch_server`` on this
    GPU (Mooncake), every request sent to both the way a router does. The fault variables go
    to the decode server only (the prefill server injects nothing). Prints both servers' logs
    (prefill first), then the result line if every request was served."""
    from sglang.srt.kv_canary.demo.pd_pair import PdRole, pair_env, pd_request, role_flags
    from sglang.srt.kv_canary.demo.server_harness import free_port, gpu_engine_kwargs
    from sglang.srt.kv_canary.demo.server_process import (
        ServerProcess,
        http_call,
        launch_server_flags,
    )

    decode_env = pair_env(dict(os.environ), no_fake_requests=True)
    prefill_env = {
        k: v for k, v in decode_env.items() if not k.startswith("SGLANG_KV_CANARY_PERTURB_")
    }
    engine_args = demo_engine_args(mode, page_size, pd=True)
    bootstrap_port = free_port()
    servers: List[ServerProcess] = []
    reqs = demo_requests()
    served = generated = 0
    with tempfile.TemporaryDirectory(prefix="kv_canary_demo_pd_") as logs:
        try:
            for role, env in ((PdRole.PREFILL, prefill_env), (PdRole.DECODE, decode_env)):
                port = free_port()
                argv = [
                    sys.executable,
                    "-m",
                    "sglang.launch_server",
                    *launch_server_flags(port, gpu_engine_kwargs(model_dir, **engine_args)),
                    *role_flags(role, "mooncake", bootstrap_port, skip_warmup=True),
                ]
                log = os.path.join(logs, f"{role.value}.log")
                servers.append(ServerProcess(role.value, argv, port=port, env=env, log_path=log))
            for server in servers:
                server.wait_ready(PD_START_TIMEOUT_S, "/health")
            prefill, decode = servers
            ports = (http_call, prefill.port, decode.port, bootstrap_port)
            with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
                for b in range(0, len(reqs), 12):
                    wave = [
                        pool.submit(pd_request, *ports, ids, n, PD_REQUEST_TIMEOUT_S)
                        for ids, n in reqs[b : b + 12]
                    ]
                    while not all(f.done() for f in wave) and decode.alive():
                        time.sleep(0.2)
                    if not decode.alive():
                        break  # stopped by a report (raise): what is in flight fails now
                    answers = [f.result() for f in wave]
                    ok = [a for a in answers if "error" not in a and a["output_ids"]]
                    served += len(ok)
                    generated += sum(len(a["output_ids"]) for a in ok)
                    if len(ok) < len(wave):
                        break
                for server in servers:  # the pending requests of a stopped pair fail
                    server.stop()
        finally:
            for server in servers:
                server.stop()
                print(f"---- {server.name} server log ----\n{server.log()}", flush=True)
    if served == len(reqs):
        print(
            RESULT_PREFIX + json.dumps({"requests": served, "generated_tokens": generated}),
            flush=True,
        )


def choose_cases(
    cases: Optional[str], device: str, mode: str = "raise"
) -> Tuple[List[str], List[str]]:
    """The case names a run makes, in order, and the notes it prints: ``--cases`` as given
    (checked by the caller), or else every case ``device`` can run, each left out one said."""
    if cases is not None:
        return [n.strip() for n in cases.split(",") if n.strip()], []
    left_out = _cases_left_out(device, mode)
    names = [c.name for c in CASES if c.name not in left_out]
    return names, [f"kv_canary demo: leaving out {n}, which {why}" for n, why in left_out.items()]


def _cases_left_out(device: str, mode: str = "raise") -> Dict[str, str]:
    """The cases that cannot run on ``device`` here (in ``mode``), each with what it needs and
    why."""
    from sglang.srt.kv_canary.demo.pd_pair import transfer_engine_missing

    out = {}
    for case in CASES:
        if mode == "heal" and (case.hicache or case.pd):
            out[case.name] = (
                "cannot run in heal mode: --kv-canary heal refuses "
                + ("HiCache's tree cache" if case.hicache else "PD disaggregation")
                + " (docs/user_guide.md, \"Self-healing: --kv-canary heal\")"
            )
        elif mode == "heal" and case.output_fault:
            out[case.name] = (
                "needs the token oracle (heal mode's runs leave it off: their outputs come "
                "from the model, so they show what reading corrupt KV would have changed)"
            )
        elif case.hicache and device == "cpu":
            out[case.name] = (
                "needs --device cuda: it runs HiCache (--enable-hierarchical-cache), whose "
                "host pool sglang 0.5.12 pins with CUDA"
            )
        elif case.pd and device == "cpu":
            out[case.name] = (
                "needs --device cuda: it runs a PD pair on the GPU "
                "(benchmark/kv_canary/pd_one_gpu.py --cpu rehearses PD with the CPU engine)"
            )
        elif case.pd and (missing := transfer_engine_missing("mooncake")) is not None:
            out[case.name] = f"needs Mooncake for its PD pair: {missing}"
    return out


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
    env = dict(base_env, **case.env)
    if mode == "heal":  # the model samples (its outputs depend on the KV it reads)
        for name in HEAL_ENV_LEFT_OUT:
            env.pop(name, None)
        if case.fault is not None:  # a fault every step would outrun the heals
            env["SGLANG_KV_CANARY_PERTURB_MAX_FAULTS"] = str(HEAL_MAX_FAULTS)
            # an exponent bit of a V row: a corrupt read kept would change the output
            env.update(HEAL_FAULT_TARGET)
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
    if case.pd:
        cmd.append("--pd")
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
        choices=("raise", "log", "heal"),
        default="raise",
        help="--kv-canary of every run; with log, a fault run must also serve "
        "its whole workload (the server survives the injection); with heal, also with "
        "outputs equal to the clean run's",
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
    parser.add_argument("--pd", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.page_size < 1:
        parser.error(f"--page-size must be >= 1, got {args.page_size}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.worker:
        if args.pd:
            _pd_worker(args.model, args.mode, args.page_size)
        else:
            _worker(args.model, args.device, args.mode, args.page_size, args.hicache)
        return 0

    device = _detect_device(args.device)
    left_out = _cases_left_out(device, args.mode)
    names, notes = choose_cases(args.cases, device, args.mode)
    for note in notes:
        print(note, flush=True)
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
    cannot = [f"{n} {left_out[n]}" for n in names if n in left_out]
    if cannot:
        parser.error("--cases " + "; ".join(cannot))
    from sglang.srt.kv_canary.demo.server_harness import (
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
    results = compare_with_clean(results)
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
