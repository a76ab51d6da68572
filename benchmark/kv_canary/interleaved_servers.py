"""The servers of ``bench_interleaved.py`` (docs/user_guide.md, "Overhead"): the configs a
server can run (this project's, upstream's, the A/A control), one ``launch_server`` process with
its ``/generate`` (radix cache flushed first), the checks of its canary and of its sglang
(``/server_info``), and its engine kwargs, memory share and environment."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Sequence

from common import (
    CONFIGS,
    DRAFT_INSTALLED_PREFIX,
    INSTALLED_LINE,
    PACING_PROBE_DIR,
    PROJECT_STACK,
    SIDE_BY_SIDE_CONFIGS,
    SIDE_KERNEL_CONFIG,
    UPSTREAM_CONFIGS,
    UPSTREAM_PREFIX,
    UPSTREAM_SITE_DIR,
    UPSTREAM_STACK,
    BenchConfig,
    Scenario,
    canary_lines_problem,
    upstream_env,
)

from sglang.srt.kv_canary.demo.server_harness import free_port
from sglang.srt.kv_canary.demo.server_process import ServerProcess, http_call, launch_server_flags

REQUEST_TIMEOUT_S = 600.0
FLUSH_ATTEMPTS = 100
CONTROL_SUFFIX = "~aa"  # the A/A control: a second server of the baseline's config
# every config a server can run: this project's, and upstream's canary under the same flags
CONFIG_TABLE = {
    **CONFIGS,
    **{c.name: c for c in SIDE_BY_SIDE_CONFIGS},
    SIDE_KERNEL_CONFIG.name: SIDE_KERNEL_CONFIG,
    **UPSTREAM_CONFIGS,
}
# first on an upstream server's PYTHONPATH: keeps this project out of that process


def server_config(name: str) -> BenchConfig:
    """The config a server runs (``name``: a config's, or its A/A control's)."""
    return CONFIG_TABLE[name.removesuffix(CONTROL_SUFFIX)]


# ---- one server ---------------------------------------------------------------------------


def http_json(
    port: int, method: str, path: str, body=None, timeout: float = REQUEST_TIMEOUT_S
) -> tuple[int, object]:
    """One HTTP exchange with the server; ``(status, decoded JSON or raw text)``."""
    status, raw = http_call(port, method, path, body, timeout=timeout)
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


# the pacing probe's line once it forked a model runner's forward (kv_pacing_probe.py)
SIDE_FORK_LINE = "kv_pacing_probe: forked the model's forward"


def canary_install_problem(
    log: str,
    *,
    canary_on: bool,
    speculative: str,
    stack: str = PROJECT_STACK,
    side_fork: str = "",
) -> str | None:
    """What is wrong with a server's canary, from its log, or None. A config with a
    ``side_fork`` must show the pacing probe's fork (``SIDE_FORK_LINE``). An upstream server
    (``stack``) must not have installed this project's canary at all (its own canary is
    upstream's business: the server took its flags). This project's servers:
    ``common.canary_lines_problem`` (a canary-on server logs the target's canary and, where the
    ``--speculative`` mode has a draft KV pool, its draft worker's, and no other; a canary-off
    server neither)."""
    if side_fork and f"{SIDE_FORK_LINE} ({side_fork})" not in log:
        return f"no '{SIDE_FORK_LINE} ({side_fork})' line: the pacing probe did not fork"
    if stack == UPSTREAM_STACK:
        return (
            "this project's canary was installed on an upstream server (its plugin ran "
            f"there: {UPSTREAM_SITE_DIR} must come first on its PYTHONPATH)"
            if INSTALLED_LINE in log or DRAFT_INSTALLED_PREFIX in log
            else None
        )
    return canary_lines_problem(log, canary_on=canary_on, speculative=speculative)


def pause_group(proc) -> None:
    """Stop the process group of ``proc`` (started with ``start_new_session=True``: a server,
    its scheduler and detokenizer) with SIGSTOP: none of them runs, a spinning scheduler
    included, so another server being measured has the host to itself."""
    os.killpg(proc.pid, signal.SIGSTOP)


def resume_group(proc) -> None:
    """Continue a process group :func:`pause_group` stopped (SIGCONT); harmless on a running
    one."""
    os.killpg(proc.pid, signal.SIGCONT)


class Server(ServerProcess):
    """One ``python -m sglang.launch_server`` process of config ``cfg`` (own session, log in
    ``log_path``), its HTTP port and its ``nccl_port`` (unless ``kwargs`` names one) picked
    here (:func:`free_port`: left to sglang, ``nccl_port`` is an ephemeral port bound only
    later, which another server starting beside it may take first)."""

    def __init__(
        self, name: str, cfg: BenchConfig, kwargs: dict, env: dict[str, str], log_path: str
    ):
        self.cfg = cfg
        port = free_port()
        kwargs = {"nccl_port": free_port(), **kwargs}
        super().__init__(
            name,
            [sys.executable, "-m", "sglang.launch_server", *launch_server_flags(port, kwargs)],
            port=port,
            env=env,
            log_path=log_path,
        )

    def pause(self) -> None:
        """:func:`pause_group` of this server, between its requests."""
        pause_group(self.proc)

    def resume(self) -> None:
        """:func:`resume_group` of this server."""
        resume_group(self.proc)

    def stop(self) -> None:
        """Continue the server first (a stopped process group would hold SIGTERM pending
        until the SIGKILL), then stop it."""
        if self.alive():
            self.resume()
        super().stop()

    def generate(self, input_ids: list[list[int]], osl: int) -> tuple[float, list[dict]]:
        """Flush the radix cache, then one ``/generate`` of the batch: ``(wall ms,
        outputs)``."""
        for _ in range(FLUSH_ATTEMPTS):  # refused while the scheduler still holds a request
            status, body = http_json(self.port, "POST", "/flush_cache")
            if status == 200:
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(
                f"[{self.name}] /flush_cache answered {status} {FLUSH_ATTEMPTS} times: {body}"
            )
        params = [{"max_new_tokens": osl, "ignore_eos": True, "temperature": 0} for _ in input_ids]
        t0 = time.perf_counter()
        status, outs = http_json(
            self.port, "POST", "/generate", {"input_ids": input_ids, "sampling_params": params}
        )
        ms = (time.perf_counter() - t0) * 1e3
        if status != 200 or not isinstance(outs, list) or len(outs) != len(input_ids):
            raise RuntimeError(f"[{self.name}] /generate answered {status}: {str(outs)[:500]}")
        lens = sorted({len(o["output_ids"]) for o in outs})
        if lens != [osl]:
            raise RuntimeError(
                f"[{self.name}] expected outputs of {osl} tokens, got lengths {lens}"
            )
        return ms, outs


START_MODES = ("serial", "together")


def memory_fractions(n: int, share: float, start: str = "serial") -> list[float]:
    """``--mem-fraction-static`` of each of ``n`` servers (``bench_interleaved.py``'s
    docstring, "What it measures"). sglang sizes a server as if alone on the GPU, minus what is
    in use when it starts: started one after the other (``serial``), server i gets
    ``(i + 1) * share``; started together (``together``), every server gets ``n * share``, the
    whole run's, and the pool cap (``--max-total-tokens``) keeps each pool to its share
    (:func:`pool_note` refuses a run whose pools came out unequal)."""
    if start not in START_MODES:
        raise ValueError(f"--start {start!r}: allowed {', '.join(START_MODES)}")
    total = round(n * share, 4)
    if total > 0.95:
        raise ValueError(
            f"--gpu-share {share} x {n} servers = {total} of the GPU; "
            "allowed: at most 0.95 in all (lower --gpu-share)"
        )
    if start == "together":
        return [total] * n
    return [round((i + 1) * share, 4) for i in range(n)]


def pool_note(facts: dict[str, dict], start: str) -> str | None:
    """The servers' KV pools (``max_total_num_tokens`` of each :func:`server_facts`) checked:
    ``None`` if they are equal; if they differ, servers started ``together`` refuse the run
    (``SystemExit``: their memory profiles raced, the cap did not hold) and ``serial`` ones
    give a line naming each server's pool, printed beside the results (a pool sized by the
    memory profile rather than the cap)."""
    pools = {name: f.get("max_total_num_tokens") for name, f in facts.items()}
    if len(set(pools.values())) <= 1:
        return None
    listed = ", ".join(f"{name} {tokens}" for name, tokens in pools.items())
    if start == "together":
        raise SystemExit(
            f"the servers' KV pools differ ({listed} tokens): started together, a memory "
            "profile was not capped by --max-total-tokens; rerun with --start serial or a "
            "smaller --max-total-tokens"
        )
    return f"note: the servers' KV pools differ ({listed} tokens)"


def tokens_needed(scenarios: Sequence[Scenario], chunk: int) -> int:
    """A KV pool that holds the largest scenario's batch, with margin."""
    need = max(sc.bs * (sc.isl + sc.osl) for sc in scenarios)
    return int(need * 1.25) + chunk


IDLE_MODES = ("sleep", "spin")


def server_kwargs(
    settings_kwargs: dict, cfg: BenchConfig, *, mem_fraction: float | None, idle: str
) -> dict:
    """One server's engine kwargs: the run's settings, the config's canary flags, its memory
    fraction (None: sglang's default) and its idle scheduler (``idle``, one of
    ``IDLE_MODES``: ``sleep`` sets sglang's ``sleep_on_idle``, ``spin`` clears it)."""
    if idle not in IDLE_MODES:
        raise ValueError(f"--idle {idle!r}: allowed {', '.join(IDLE_MODES)}")
    kwargs = {**settings_kwargs, **cfg.engine_kwargs()}
    if mem_fraction is not None:
        kwargs["mem_fraction_static"] = mem_fraction
    kwargs["sleep_on_idle"] = idle == "sleep"
    return kwargs


def check_upstream(
    names: Sequence[str], *, upstream_site: str | None, piecewise: str, speculative: str
) -> None:
    """Refuse what a run with upstream's configs cannot measure (``bench_interleaved.py``'s docstring)."""
    upstream = [n for n in names if CONFIG_TABLE[n].stack == UPSTREAM_STACK]
    if not upstream:
        if upstream_site:
            raise SystemExit(
                f"--upstream-site {upstream_site}: no {UPSTREAM_PREFIX}config in "
                "--configs runs there"
            )
        return
    if not upstream_site or not os.path.isdir(upstream_site):
        raise SystemExit(
            f"--configs {', '.join(upstream)}: upstream's servers need "
            "--upstream-site DIR, the site directory of sglang 0.5.17 "
            f"(upstream_bundle.sh), got {upstream_site!r}"
        )
    if piecewise == "on" and any(CONFIG_TABLE[n].canary_on for n in upstream):
        raise SystemExit(
            "--piecewise on: upstream's canary refuses sglang's piecewise prefill "
            "graphs; pass --piecewise off (every server alike)"
        )
    if speculative != "none":
        raise SystemExit(
            f"--speculative {speculative}: the side by side with upstream "
            "measures prefill and decode without speculative decoding"
        )


def server_env(
    base_env: dict[str, str], cfg: BenchConfig, upstream_site: str | None
) -> dict[str, str]:
    """A server's environment: the run's, the config's variables and, for upstream's
    configs, ``PYTHONPATH`` = ``upstream_site``'s isolation folder, ``upstream_site``, then
    the run's; for a config with a ``side_fork``, the pacing probe's folder first."""
    env = {**base_env, **cfg.env()}
    if cfg.stack == UPSTREAM_STACK:
        env = upstream_env(env, upstream_site)
    if cfg.side_fork:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(PACING_PROBE_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
    return env


def server_facts(port: int) -> dict:
    """What a server's ``/server_info`` says of its stack: ``version`` (sglang's, None if it
    gave none), ``kv_canary_info`` (whether it carries a ``kv_canary`` entry, which this
    project's plugin adds on every server it runs in) and ``max_total_num_tokens`` (its KV
    pool, from its scheduler's start-up; None if it gave none)."""
    status, info = http_json(port, "GET", "/server_info")
    if status != 200 or not isinstance(info, dict):
        return dict(version=None, kv_canary_info=None, max_total_num_tokens=None)
    return dict(
        version=info.get("version"),
        kv_canary_info="kv_canary" in info,
        max_total_num_tokens=info.get("max_total_num_tokens"),
    )
