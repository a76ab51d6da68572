#!/usr/bin/env python3
"""A prefill/decode (PD) disaggregated pair of sglang 0.5.12 servers on ONE GPU with a real KV
transfer engine (Mooncake or NIXL), a few greedy requests through it, and the same prompts on
a plain (non-PD) server for comparison.

What runs (all ``python -m sglang.launch_server`` on 127.0.0.1, GPU 0, the tiny Llama of
``server_harness`` with seeded random weights (``--weights``), ``server_harness``'s GPU engine
settings (``--attention-backend triton`` ...), each server in its own process group):

* a prefill server: ``--disaggregation-mode prefill --disaggregation-transfer-backend B
  --disaggregation-bootstrap-port P`` (the bootstrap server, an aiohttp app in its tokenizer
  manager, listens on P);
* a decode server: ``--disaggregation-mode decode --disaggregation-transfer-backend B``;
* a reference server (no disaggregation), started beside them unless ``--reference none``.

Every server process gets ``SGLANG_HOST_IP=127.0.0.1``: sglang's ``get_local_ip_auto`` reads it
first, so the KV managers' ZMQ sockets, the prefill's registration and Mooncake's
TransferEngine hostname all stay on the loopback.

Requests (``input_ids``, temperature 0, ``ignore_eos``), in rounds of ``--requests`` distinct
prompts each (no two prompts share a first token, so no radix-cache hit changes a forward):

* ``direct``: one request at a time, sent to BOTH servers at once with the same
  ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` (what a PD router adds); the decode
  server's answer is the result (its ``output_ids`` start with the prefill's first token);
* ``concurrent``: the same, all requests of the round in flight together (informational: the
  decode batch differs from the reference's one-at-a-time batches);
* ``router``: through sglang-router (``python -m sglang_router.launch_router
  --pd-disaggregation``) when it is importable (``.device/pd_c``) or ``--router rust|mini``.

``identical`` is true when every ``direct`` answer equals the reference server's output for
the same prompt. ``context_sensitive`` counts the prompts whose reference output changes when
every prompt token but the last is replaced: where it is > 0, equal outputs mean the prompt's
KV reached the decode server (a lost transfer leaves it reading a prefix nobody wrote).

The last line printed is ``PD_RESULT {json}`` (backend, served, identical, one summary per
round, context_sensitive, errors, log_hints: counts of telling log lines per server, leftover
process groups); the exit status is 0 when every direct request was served and, with a
reference, identical. Logs go to ``--log-dir`` (default ``$OUT/pd_logs`` when ``$OUT`` is set,
else a temporary folder). Bundles: ``test/device_bundle_pd.sh``. Server flags:
``--extra-args="--kv-canary raise"`` (every server; note the ``=``: the value starts with
``--``), ``--prefill-args=...``, ``--decode-args=...``. ``--no-fake-requests`` leaves out the
requests whose transfer sglang fakes (its PD warmup and ``/health_generate``: nothing moves;
the canary sets aside what they read). Transfer-engine settings travel in the environment (``--env MC_FORCE_TCP=1``, ``--env
UCX_TLS=tcp,cuda_copy``) or the calling shell's. ``--cpu`` rehearses the whole run with sglang's
CPU engine (Mooncake only: sglang registers NIXL buffers as VRAM).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import pathlib
import random
import shlex
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# sibling modules: the model, the --cpu stub and the processes; the prompts and requests
from pd_processes import (  # noqa: E402
    PdProcesses,
    cpu_stub,
    log_dir_for,
    write_random_llama_weights,
)
from pd_requests import body_for, generate, make_prompts, pd_request, perturbed  # noqa: E402

from sglang.srt.kv_canary.demo.pd_pair import PdRole, pair_env, role_flags  # noqa: E402

START_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 120.0
LOG_HINTS = {  # substring -> name in PD_RESULT's log_hints (counts per server log)
    "Using TCP transport": "mooncake_tcp",
    "Using RDMA transport": "mooncake_rdma",
    "MC_FORCE_TCP is set": "mooncake_forced_tcp",
    "Intra-Node NVLink transport": "mooncake_nvlink_intra",
    "No RDMA devices found": "no_rdma_devices",
    "NIXL KVManager initialized with backend": "nixl_backend",
    "Backend UCX was instantiated": "nixl_ucx",
    "KVTransferError": "kv_transfer_error",
    "Traceback (most recent call last)": "traceback",
    "Decode transfer failed": "decode_transfer_failed",
    "Prefill transfer failed": "prefill_transfer_failed",
    "bootstrap failed": "bootstrap_failed",
    "handshake failed": "handshake_failed",
    "kv_canary installed": "canary_installed",
    "kv_canary violation": "canary_violations",
    "kv_canary detected KV-cache corruption": "canary_raised",
    "are not reported: nothing was sent for them": "faked_transfers_set_aside",
    "kv_canary perturb:": "faults_injected",
}


class OverallTimeout(BaseException):
    """The ``--timeout`` alarm (a BaseException: no ``except Exception`` swallows it)."""


class Stop(BaseException):
    """SIGTERM / SIGINT: stop everything and report."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--backend",
        choices=["mooncake", "nixl"],
        default="mooncake",
        help="--disaggregation-transfer-backend of both PD servers",
    )
    p.add_argument(
        "--weights",
        choices=["random", "dummy"],
        default="random",
        help="random: a model.safetensors of seeded N(0, 1/fan_in) weights and unit "
        "norms, so that outputs depend on the whole prompt (sglang's dummy "
        "weights, U(-1e-3, 1e-3) norms included, leave attention's share of the "
        "residual near 1e-5: the next token then depends on the last token "
        "only, and a lost KV transfer would go unseen); dummy: --load-format dummy",
    )
    p.add_argument("--requests", type=int, default=4, help="prompts per round")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument(
        "--reference",
        choices=["parallel", "before", "none"],
        default="parallel",
        help="the non-PD server: started beside the PD pair (parallel), run and "
        "stopped before it (before), or not at all",
    )
    p.add_argument(
        "--router",
        choices=["auto", "rust", "mini", "none"],
        default="auto",
        help="the router round: auto = the Rust router when sglang_router imports",
    )
    p.add_argument("--no-concurrent", action="store_true", help="skip the concurrent round")
    p.add_argument("--mem-fraction-static", type=float, default=0.3)
    p.add_argument("--max-total-tokens", type=int, default=4096)
    p.add_argument("--log-level", default="info", help="--log-level of the PD servers")
    p.add_argument("--extra-args", default="", help="flags added to every server (shlex-split)")
    p.add_argument("--prefill-args", default="", help="flags added to the prefill server")
    p.add_argument("--decode-args", default="", help="flags added to the decode server")
    p.add_argument(
        "--no-fake-requests",
        action="store_true",
        help="send the PD servers no request with sglang's fake bootstrap host "
        "(2.2.2.2: a transfer that moves nothing): --skip-server-warmup on both, "
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0, readiness read from /health "
        "(no forward), router health checks then generate nothing",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the PD servers (repeatable), e.g. MC_FORCE_TCP=1",
    )
    p.add_argument(
        "--decode-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the decode server only (repeatable, after --env), e.g. a "
        "SGLANG_KV_CANARY_PERTURB_* fault injected on the decode side",
    )
    p.add_argument(
        "--log-dir",
        default=None,
        help="server logs and the model dir (default $OUT/pd_logs, else a temp dir)",
    )
    p.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S)
    p.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S)
    p.add_argument(
        "--timeout",
        type=float,
        default=480.0,
        help="hard limit of the whole run in seconds (everything is stopped then; "
        "keep it well under the device call's limit: a server left running "
        "there outlives the call)",
    )
    p.add_argument(
        "--kill-stale",
        action="store_true",
        help="first SIGKILL the process groups a previous run recorded in "
        "LOG_DIR/pgids.json (one cut off before its clean-up)",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="rehearsal on a machine without a GPU: sglang's CPU engine "
        "(server_harness.cpu_engine_kwargs) and a libcuda.so.1 stub that also "
        "covers the transfer engine's libraries; same requests and checks",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="write the model dir and the command lines (LOG_DIR/*.argv), start nothing",
    )
    args = p.parse_args(argv)
    for flag, values in (("--env", args.env), ("--decode-env", args.decode_env)):
        for kv in values:
            if "=" not in kv:
                p.error(f"{flag} wants KEY=VALUE, got {kv!r}")
    if args.requests < 1 or args.prompt_len < 2 or args.max_new_tokens < 2:
        p.error("--requests >= 1, --prompt-len >= 2 and --max-new-tokens >= 2")
    return args


# ---- the run ------------------------------------------------------------------------------------


class Run(PdProcesses):
    # -- steps --
    def reference_outputs(self, server, prompts: list[list[int]]) -> list[list[int] | None]:
        from sglang.srt.kv_canary.demo.server_process import http_call

        outs = []
        for prompt in prompts:
            ans = generate(
                http_call,
                server.port,
                body_for(prompt, self.args.max_new_tokens),
                self.args.request_timeout,
            )
            if "error" in ans:
                self.errors.append(f"reference: {ans['error']}")
            outs.append(ans.get("output_ids"))
        return outs

    def main(self) -> int:
        from sglang.srt.kv_canary.demo.server_process import http_call
        from sglang.srt.kv_canary.demo.server_harness import (
            TINY_LLAMA_CONFIG,
            free_port,
            write_tiny_llama,
        )

        a = self.args
        vocab = TINY_LLAMA_CONFIG["vocab_size"]
        rounds = ["direct"] + ([] if a.no_concurrent else ["concurrent"])
        want_router = a.router != "none"
        if a.router == "auto":
            try:
                import sglang_router.router  # noqa: F401  (the Rust extension)
            except Exception as e:  # noqa: BLE001
                want_router = False
                self.result["router_skipped"] = f"sglang_router not importable: {e}"
        if want_router:
            rounds.append("router")
        n = a.requests
        all_prompts = make_prompts(n * len(rounds), a.prompt_len, vocab, a.seed)
        prompts = {r: all_prompts[i * n : (i + 1) * n] for i, r in enumerate(rounds)}
        rng, taken = random.Random(a.seed + 1), {p[0] for p in all_prompts}
        controls = [perturbed(p, vocab, rng, taken) for p in prompts["direct"]]

        model_dir = write_tiny_llama(self.log_dir / "model")
        if a.weights == "random":
            write_random_llama_weights(model_dir, TINY_LLAMA_CONFIG, a.seed)
        base_env = dict(os.environ)
        if a.cpu:
            from sglang.srt.kv_canary.demo.server_harness import cpu_server_env

            base_env = cpu_server_env(cpu_stub(self.log_dir / "stub", a.backend), base_env)
        base_env.setdefault("PYTHONUNBUFFERED", "1")
        base_env["SGLANG_HOST_IP"] = "127.0.0.1"
        pd_env = pair_env(base_env, no_fake_requests=a.no_fake_requests)
        for kv in a.env:
            k, v = kv.split("=", 1)
            pd_env[k] = v
        self.result["env"] = {
            k: pd_env[k]
            for k in sorted(pd_env)
            if k.startswith(
                (
                    "MC_",
                    "UCX_",
                    "NIXL_",
                    "SGLANG_DISAGG",
                    "SGLANG_MOONCAKE",
                    "SGLANG_HOST_IP",
                    "SGLANG_ENABLE_HEALTH",
                )
            )
        }
        self.result["decode_env"] = dict(kv.split("=", 1) for kv in a.decode_env)
        extra = shlex.split(a.extra_args)

        # reference server
        ref_out: dict[str, list[list[int] | None]] = {}
        ctl_out: list[list[int] | None] = []
        ref = None
        if a.reference != "none":
            ref = self.start_server("reference", model_dir, free_port(), extra, base_env, "warning")
        if ref is not None and a.reference == "before":
            t0 = time.monotonic()
            ref.wait_ready(a.start_timeout)
            self.result["reference_start_s"] = round(time.monotonic() - t0, 1)
            ref_out = {r: self.reference_outputs(ref, prompts[r]) for r in rounds}
            ctl_out = self.reference_outputs(ref, controls)
            ref.stop()
            self.servers.remove(ref)

        # PD pair
        bootstrap_port, skip = free_port(), a.no_fake_requests
        prefill = self.start_server(
            "prefill",
            model_dir,
            free_port(),
            [
                *role_flags(PdRole.PREFILL, a.backend, bootstrap_port, skip_warmup=skip),
                *extra,
                *shlex.split(a.prefill_args),
            ],
            pd_env,
            a.log_level,
        )
        decode_env = dict(pd_env)
        for kv in a.decode_env:
            k, v = kv.split("=", 1)
            decode_env[k] = v
        decode = self.start_server(
            "decode",
            model_dir,
            free_port(),
            [
                *role_flags(PdRole.DECODE, a.backend, bootstrap_port, skip_warmup=skip),
                *extra,
                *shlex.split(a.decode_args),
            ],
            decode_env,
            a.log_level,
        )
        if a.dry_run:
            if want_router:
                print(
                    "pd_one_gpu: router: "
                    + shlex.join(self.router_argv(0, bootstrap_port, 0, 0, a.router == "mini")),
                    flush=True,
                )
            self.result["dry_run"] = True
            return 0
        self.result["ports"] = {
            "prefill": prefill.port,
            "decode": decode.port,
            "bootstrap": bootstrap_port,
        }
        t0 = time.monotonic()
        for s in [prefill, decode] + (
            [ref] if ref is not None and a.reference == "parallel" else []
        ):
            left = max(1.0, a.start_timeout - (time.monotonic() - t0))
            # /health answers without a forward when SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0
            if a.no_fake_requests and s is not ref:
                s.wait_ready(left, "/health")
            else:
                s.wait_ready(left)
        self.result["start_s"] = round(time.monotonic() - t0, 1)
        print(f"pd_one_gpu: servers ready after {self.result['start_s']} s", flush=True)
        if ref is not None and a.reference == "parallel":
            ref_out = {r: self.reference_outputs(ref, prompts[r]) for r in rounds}
            ctl_out = self.reference_outputs(ref, controls)
            ref.stop()
            self.servers.remove(ref)

        # rounds
        got: dict[str, list[dict]] = {}
        args3 = (http_call, prefill.port, decode.port, bootstrap_port)
        got["direct"] = [
            pd_request(*args3, p, a.max_new_tokens, a.request_timeout) for p in prompts["direct"]
        ]
        if "concurrent" in rounds:
            res: list[dict | None] = [None] * n

            def one(i: int) -> None:
                res[i] = pd_request(
                    *args3, prompts["concurrent"][i], a.max_new_tokens, a.request_timeout
                )

            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(a.request_timeout + 10)
            got["concurrent"] = [r or {"error": "no answer"} for r in res]
        if "router" in rounds:
            got["router"] = self.router_round(
                prefill.port, bootstrap_port, decode.port, prompts["router"], pd_env
            )

        # verdict
        for r in rounds:
            answers = got.get(r, [])
            refs = ref_out.get(r)
            served = [x for x in answers if x.get("output_ids") is not None and "error" not in x]
            summary = {"sent": len(prompts[r]), "served": len(served)}
            if refs is not None:
                same = [
                    x.get("output_ids") is not None and x.get("output_ids") == y
                    for x, y in zip(answers, refs)
                ]
                summary["identical"] = bool(same) and all(same) and len(served) == n
                summary["mismatches"] = [
                    {
                        "i": i,
                        "pd": x.get("output_ids"),
                        "reference": y,
                        **({"error": x["error"]} if "error" in x else {}),
                    }
                    for i, (x, y, ok) in enumerate(zip(answers, refs, same))
                    if not ok
                ][:3]
            errs = sorted(
                {x["error"] for x in answers if "error" in x}
                | {"prefill: " + x["prefill_error"] for x in answers if "prefill_error" in x}
            )
            if errs:
                summary["errors"] = errs[:5]
            self.result[r] = summary
            for i, x in enumerate(answers):
                ref_ids = refs[i] if refs is not None else None
                print(
                    f"pd_one_gpu: {r}[{i}] pd={x.get('output_ids')} ref={ref_ids}"
                    + (f" error={x['error']}" if "error" in x else ""),
                    flush=True,
                )
        if ctl_out:
            base = ref_out.get("direct", [])
            self.result["context_sensitive"] = sum(
                1 for x, y in zip(base, ctl_out) if x is not None and y is not None and x != y
            )
        d = self.result["direct"]
        self.result["served"] = d["served"]
        self.result["identical"] = d.get("identical")
        ok = d["served"] == n and (d.get("identical") is not False)
        return 0 if ok else 1

    def router_round(
        self,
        prefill_port: int,
        bootstrap_port: int,
        decode_port: int,
        prompts: list[list[int]],
        env: dict[str, str],
    ) -> list[dict]:
        from sglang.srt.kv_canary.demo.server_process import http_call
        from sglang.srt.kv_canary.demo.server_harness import free_port

        port = free_port()
        self.start_router(
            prefill_port, bootstrap_port, decode_port, port, self.args.router == "mini", env
        )
        # the Rust router answers /readiness once a worker is healthy; the mini_lb has /health
        deadline, path = time.monotonic() + 150, "/readiness"
        while time.monotonic() < deadline:
            if self.router_proc.poll() is not None:
                return [
                    {"error": f"router exited ({self.router_proc.returncode}), see router.log"}
                ] * len(prompts)
            try:
                status = http_call(port, "GET", path, timeout=5)[0]
                if status == 200:
                    break
                if status == 404:
                    path = "/health"
            except Exception:  # noqa: BLE001, S110  (not up yet / best effort)
                pass
            time.sleep(1.0)
        else:
            return [{"error": "router not ready after 150 s"}] * len(prompts)
        out = []
        for i, prompt in enumerate(prompts):
            for attempt in range(6 if i == 0 else 1):  # workers may register a little later
                ans = generate(
                    http_call,
                    port,
                    body_for(prompt, self.args.max_new_tokens),
                    self.args.request_timeout,
                )
                if "error" not in ans:
                    break
                time.sleep(3.0)
            out.append(
                {
                    "output_ids": ans.get("output_ids"),
                    **({"error": "router: " + ans["error"]} if "error" in ans else {}),
                }
            )
        return out

    def log_hints(self) -> dict[str, dict[str, int]]:
        hints: dict[str, dict[str, int]] = {}
        for path in sorted(self.log_dir.glob("*.log")):
            text = path.read_text(errors="replace")
            counts = {name: text.count(s) for s, name in LOG_HINTS.items() if s in text}
            if counts:
                hints[path.stem] = counts
        return hints


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = log_dir_for(args.log_dir, "pd")
    if args.kill_stale and (log_dir / "pgids.json").exists():
        for name, pgid in json.loads((log_dir / "pgids.json").read_text()).items():
            try:
                os.killpg(int(pgid), signal.SIGKILL)
                print(f"pd_one_gpu: killed stale {name} process group {pgid}", flush=True)
            except (ProcessLookupError, PermissionError, ValueError):
                pass
        (log_dir / "pgids.json").unlink()
    run = Run(args)
    run.log_dir = log_dir
    t_start = time.monotonic()

    def on_alarm(signum, frame):
        raise OverallTimeout(f"overall timeout of {args.timeout:.0f} s")

    def on_stop(signum, frame):
        raise Stop(f"signal {signum}")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    atexit.register(lambda: run.stop_all() if (run.servers or run.router_proc) else None)
    signal.setitimer(signal.ITIMER_REAL, args.timeout)
    rc = 1
    try:
        rc = run.main()
    except (OverallTimeout, Stop) as e:
        run.errors.append(str(e))
    except BaseException as e:  # noqa: BLE001  (reported in PD_RESULT)
        run.errors.append(f"{type(e).__name__}: {e}")
        traceback.print_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if rc != 0:
            for s in run.servers:
                try:
                    print(f"---- {s.name} log tail ({s.log_path})\n{s.tail(40)}", flush=True)
                except Exception:  # noqa: BLE001, S110  (not up yet / best effort)
                    pass
        leftovers = run.stop_all()
    run.result.setdefault("served", 0)
    run.result.setdefault("identical", None)
    # a start-up error carries the server's log tail (printed above): keep its end here
    run.result["errors"] = [e if len(e) <= 1500 else "..." + e[-1500:] for e in run.errors]
    run.result["leftover_process_groups"] = leftovers
    run.result["log_hints"] = run.log_hints()
    run.result["log_dir"] = str(log_dir)
    run.result["elapsed_s"] = round(time.monotonic() - t_start, 1)
    if run.errors or leftovers:
        rc = 1
    print("PD_RESULT " + json.dumps(run.result, sort_keys=True), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
