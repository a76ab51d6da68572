"""A storm of self-test faults on a real HTTP server with many clients, for containment
(docs/user_guide.md, "Containment: --kv-canary abort"). Used by
``benchmark/kv_canary/abort_storm.py`` (the 10-minute runs) and by the CPU soak test
(``test_soak_server.py``, a shorter one in CI): :func:`run_storm` with a
:class:`StormSettings`.

The tiny dummy-weight Llama of ``server_harness`` on the CPU (``device="cuda"``: on the GPU,
page size 1 or 16). First a canary-off server (plugin loaded, ``--kv-canary`` unset)
answers every request of a fixed list once: its greedy outputs are the reference. Then a
server with ``--kv-canary MODE --enable-metrics``, a small KV pool, small prefill chunks and
faults injected with the given probabilities per forward (after a warm-up) serves the same
list in rounds, ``clients`` requests at a time, for ``seconds``; then it idles and is asked
``/health``. sglang's own pool checks are strict: after every batch
(``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1``) and when idle (its default), a slot
missing from the accounting stops the server; at page size > 1 its paged allocator also
asserts that no page is free twice (``SGLANG_DEBUG_MEMORY_POOL=1``). At page size 1 sglang
has no such check, and a slot freed twice while another leaks keeps its count right: there
the release guard's own figures (held back, reclaimed, unattributed) and the violation lines
per fault show it.

The requests share a few prefixes (radix-cache hits: one corrupt prefix touches several
requests) and most are longer than one prefill chunk. The checks (the figures' ``checks``):

- the server is alive at the end, after idling, and ``/health`` answers 200; no
  ``Traceback``, no sglang leak report, no out-of-memory stop in its log;
- every fault class of :func:`storm_faults` was injected (abort mode adds
  ``req_to_token_kept``, a corrupt entry left in place, which its release guard contains);
- abort: every request that did not complete ended with one of the canary's two abort
  messages; every completed one equals the reference; the Prometheus counter of aborted
  requests, read when the clients are done (before ``/health``, whose own generate request the
  canary may abort too), equals the aborts the clients saw;
- log: every request completes (outputs may differ from the reference: log mode serves what
  it reads, and says so).

Not injected: ``next_token_swap`` (it swaps the token oracle's samples, so it needs the
oracle in place of the model's sampling, and a swap of a request's last token is caught by the
next forward's token check only if the request has one) and ``host_kv`` (HiCache, which abort
mode refuses).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import random
import re
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from sglang.srt.kv_canary.perturb.config import FaultKind
from sglang.srt.kv_canary.perturb.report import parse_perturb_line
from sglang.srt.kv_canary.violations.containment import (
    ABORT_MESSAGE_PREFIX,
    HEALS_SUFFIX_RE,
    PREFIX_ABORT_MESSAGE,
    RETIRE_LINE_PREFIX,
    parse_healed_rids,
)
from sglang.srt.kv_canary.violations.metrics import (
    ABORTED_REQUESTS,
    HEAL_SECONDS,
    HEALED_REQUESTS,
    RETIRED_SLOTS,
    HELD_BACK_SLOTS,
    RECLAIMED_SLOTS,
)
from sglang.srt.kv_canary.violations.release_guard import (
    EVICTION_LINE_PREFIX,
    RELEASE_LINE_PREFIX,
    parse_unattributed,
)
from sglang.srt.kv_canary.violations.lines import ViolationLine, parse_violation_lines
from sglang.srt.kv_canary.demo.cases import HEAL_FAULT_TARGET
from sglang.srt.kv_canary.demo.server_harness import (
    build_libcuda_stub,
    cpu_engine_kwargs,
    cpu_server_env,
    free_port,
    gpu_engine_kwargs,
    write_tiny_llama,
)
from sglang.srt.kv_canary.demo.server_process import ServerProcess, http_call, launch_server_flags
from canary_support.server_process import metric_series, metric_total

# heal mode's line when it retires a slot (violations/containment.RETIRE_LINE_PREFIX)
RETIRED_RE = re.compile(re.escape(RETIRE_LINE_PREFIX) + r" (?:slot|page of \d+ slots) (\d+) ")
# heal mode retires at most this fraction of the pool (SGLANG_KV_CANARY_RETIRE_MAX_FRACTION's
# default), in whole pages
RETIRE_MAX_FRACTION = 0.01
# the message of a request the canary aborted for a violation it touches (violations/containment)
ABORT_MESSAGE = f"{ABORT_MESSAGE_PREFIX} (launch_tag="
LEAK_MARKERS = ("memory leak", "Out of memory", "Traceback")
FAULTS = {  # probability per forward step, after the warm-up
    FaultKind.REQ_TO_TOKEN: 0.02,
    FaultKind.REAL_KV_USED: 0.02,
    FaultKind.REAL_KV_UNUSED_CACHE: 0.01,
    FaultKind.REAL_KV_POST_FORWARD: 0.01,
}
# heal mode's heals of one request before it aborts it (SGLANG_KV_CANARY_MAX_HEALS)
MAX_HEALS = 3
# abort mode also gets the corrupt entry left in place (what its release guard contains)
ABORT_FAULTS = {**FAULTS, FaultKind.REQ_TO_TOKEN_KEPT: 0.01}


# a stuck bit (heal mode's slot retirement): the one fault, from the first step past warm-up
STUCK_FAULTS = {FaultKind.REAL_KV_STUCK: 1.0}


def storm_faults(mode: str, stuck: bool = False) -> Dict[FaultKind, float]:
    """The fault classes and probabilities of a storm in ``mode`` (heal mode contains as abort
    mode does: the kept entry too); ``stuck``: a stuck bit alone."""
    if stuck:
        return STUCK_FAULTS
    return ABORT_FAULTS if mode in ("abort", "heal") else FAULTS


@dataclasses.dataclass(frozen=True)
class StormSettings:
    """One storm. ``mode``: ``abort``, ``heal`` or ``log``; ``seconds`` of traffic from ``clients``
    concurrent clients over a list of ``requests`` distinct requests; the server's KV pool
    (``pool`` tokens, ``--max-total-tokens``), prefill chunk and page size; faults from forward
    step ``warmup_steps`` on; ``idle_seconds`` idle at the end (sglang's idle leak check);
    ``out``: where the logs and ``results.json`` go (None: a new temporary directory);
    ``stream``: every other request streams (heal mode checks every chunk it receives);
    ``stuck``: the only fault is a stuck bit (heal mode must retire its slot);
    ``deferred_readback``: a CPU server reads each forward's checks back one forward later, as
    a GPU server does (``SGLANG_KV_CANARY_CPU_DEFERRED_READBACK``)."""

    mode: str
    seconds: float = 600
    clients: int = 8
    requests: int = 48
    pool: int = 1024
    chunk: int = 32
    page_size: int = 1
    warmup_steps: int = 50
    idle_seconds: float = 15
    device: str = "cpu"
    seed: int = 7
    stream: bool = False
    stuck: bool = False
    deferred_readback: bool = False
    out: Optional[pathlib.Path] = None

    def __post_init__(self):
        if self.mode not in ("abort", "heal", "log"):
            raise ValueError(f"storm mode must be 'abort', 'heal' or 'log', got {self.mode!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"storm device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.seconds <= 0 or self.idle_seconds < 0:
            raise ValueError(
                f"storm seconds must be > 0 and idle seconds >= 0, got "
                f"{self.seconds!r} and {self.idle_seconds!r}"
            )
        for name in ("clients", "requests", "pool", "chunk", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"storm {name} must be >= 1, got {getattr(self, name)!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"storm warmup_steps must be >= 0, got {self.warmup_steps!r}")


def request_list(n: int, seed: int) -> List[Tuple[List[int], int]]:
    """``n`` requests (prompt ids, max new tokens): six shared prefixes of 16-96 tokens, a
    tail of 4-60, 4-24 new tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randrange(16, 97))] for _ in range(6)]
    return [
        (
            rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(4, 61))],
            rng.randrange(4, 25),
        )
        for _ in range(n)
    ]


def _post_generate(port: int, rid: str, ids: List[int], max_new: int, *, stream: bool):
    """sglang's ``/generate`` of ``ids`` (greedy, ``max_new`` tokens, no early EOS): the HTTP
    status and the body's bytes."""
    payload = {
        "rid": rid,
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True},
    }
    if stream:
        payload["stream"] = True
    return http_call(port, "POST", "/generate", payload, timeout=600)


def generate(port: int, rid: str, ids: List[int], max_new: int) -> Tuple[int, dict]:
    status, body = _post_generate(port, rid, ids, max_new, stream=False)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, {"raw": body.decode(errors="replace")[:300]}


def generate_stream(port: int, rid: str, ids: List[int], max_new: int) -> Tuple[int, dict]:
    """:func:`generate` with ``stream: true``: the final chunk's fields, plus ``chunks``: the
    output ids of every chunk received, in order (each the whole output so far)."""
    status, body = _post_generate(port, rid, ids, max_new, stream=True)
    chunks, last = [], {}
    for line in body.decode(errors="replace").splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        try:
            last = json.loads(line[len("data:") :])
        except ValueError:
            return status, {"raw": line[:300]}
        if "output_ids" in last:
            chunks.append(list(last["output_ids"]))
    return status, dict(last, chunks=chunks)


def outcome(status: int, out: dict) -> Tuple[str, object]:
    """("ok", output ids) or ("aborted", message) or ("error", text)."""
    if status == 200 and "output_ids" in out:
        reason = (out.get("meta_info") or {}).get("finish_reason") or {}
        if reason.get("type") == "abort":
            return "aborted", str(reason.get("message"))
        return "ok", out["output_ids"]
    text = json.dumps(out)[:300]
    if ABORT_MESSAGE in text or PREFIX_ABORT_MESSAGE[:-1] in text:
        return "aborted", str(out.get("message", text))
    return "error", f"HTTP {status}: {text}"


def run_clients(
    port: int,
    requests,
    *,
    clients: int,
    until: Optional[float],
    rounds: int,
    stream: bool = False,
    chunks: Optional[Dict[str, List[List[int]]]] = None,
    seconds: Optional[Dict[str, float]] = None,
):
    """Send ``requests`` in order, ``clients`` at a time, ``rounds`` times over (or until the
    monotonic deadline ``until``): a list of (request index, rid, outcome). ``stream``: every
    other request streams, its chunks' output ids put in ``chunks`` by rid; ``seconds``: each
    request's time from send to its last byte, by rid."""
    lock = threading.Lock()
    state = {"next": 0}
    results: List[Tuple[int, str, Tuple[str, object]]] = []

    def client() -> None:
        while True:
            with lock:
                k = state["next"]
                state["next"] += 1
            if (until is None and k >= rounds * len(requests)) or (
                until is not None and time.monotonic() > until
            ):
                return
            i = k % len(requests)
            ids, max_new = requests[i]
            rid = f"r{i}-{k}"
            sent = time.monotonic()
            try:
                if stream and k % 2:
                    status, out = generate_stream(port, rid, ids, max_new)
                    if chunks is not None:
                        with lock:
                            chunks[rid] = out.pop("chunks", [])
                    res = outcome(status, out)
                else:
                    res = outcome(*generate(port, rid, ids, max_new))
            except OSError as e:
                res = ("error", f"transport: {e}")
            with lock:
                results.append((i, rid, res))
                if seconds is not None:
                    seconds[rid] = time.monotonic() - sent

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def start(
    name: str,
    root: pathlib.Path,
    model: str,
    env: Dict[str, str],
    device: str,
    extra: List[str],
    **kwargs,
) -> ServerProcess:
    port = free_port()
    make = gpu_engine_kwargs if device == "cuda" else cpu_engine_kwargs
    argv = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        *launch_server_flags(port, make(model, **kwargs)),
        *extra,
    ]
    server = ServerProcess(name, argv, port=port, env=env, log_path=root / f"{name}.log")
    server.wait_ready(600)
    return server


def failure_excerpt(figures: dict, lines: int = 40) -> str:
    """The last ``lines`` lines of the storm server's log that say what went wrong: the
    canary's abort-mode lines, sglang's leak reports and tracebacks (for a failed check's
    message, where the log itself stays behind)."""
    log = pathlib.Path(figures["root"]) / "storm.log"
    if not log.exists():
        return "(no storm.log)"
    keep = [
        line
        for line in log.read_text(errors="replace").splitlines()
        if '"POST /' not in line
        and any(
            m in line for m in ("kv_canary abort:", "kv_canary heal:", "Leak", "Traceback", "Error")
        )
    ]
    return "\n".join(keep[-lines:])


def assert_storm_passed(figures: dict, label: str) -> None:
    """A storm test's verdict: print the figures (after ``label``), and when a check failed the
    storm server log's telling lines (pytest shows a failing test's output), then fail naming
    the failed checks."""
    print(f"\n{label}: {json.dumps({k: v for k, v in figures.items() if k != 'checks'})}")
    failed = [name for name, ok in figures["checks"].items() if not ok]
    if failed:
        print("storm server, what it said:\n" + failure_excerpt(figures))
    assert not failed, (failed, figures)


def kept_faults_on_own_positions(
    log: str,
    violations: Sequence[ViolationLine],
    prompt_len_of: Dict[str, int],
    page_size: int,
) -> int:
    """The ``req_to_token_kept`` faults of ``log`` that rewrote an entry its request owned:
    sglang caches a prompt's full pages in the radix tree once prefilled, so only a page from
    ``prompt_len // page_size`` on (decoded since) is the request's own, and only there does a
    kept entry lose the request a slot for the release guard to reclaim. A fault's request is
    the first rid (the row's own request) of the violation its forward reported at one of the
    rewritten positions of that row; ``prompt_len_of``: rid -> prompt length. A fault no
    violation names counts as not owned, and so does one on a request heal mode took back
    earlier in the log: its recomputation prefilled its prompt and the output it had, and
    sglang cached those pages in the tree too (how many the log does not say)."""
    by_read = collections.defaultdict(list)
    for v in violations:
        if v.rids:
            by_read[(v.forward_step, v.req_to_token_row)].append(v)
    own = 0
    taken_back = set()
    for line in log.splitlines():
        taken_back.update(parse_healed_rids(line))
        fault = parse_perturb_line(line)
        if not fault or fault["fault"] != FaultKind.REQ_TO_TOKEN_KEPT.value:
            continue
        step, row, pos = int(fault["step"]), int(fault["req_pool_idx"]), int(fault["position"])
        span = range(pos, pos + int(fault.get("entries", 1)))
        rids = [v.rids[0] for v in by_read[(step, row)] if v.read_position in span]
        if rids and rids[0] in prompt_len_of and rids[0] not in taken_back:
            owned_from = prompt_len_of[rids[0]] // page_size * page_size
            own += pos >= owned_from
    return own


def _median(values: List[float]) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[len(ordered) // 2], 3)


@dataclasses.dataclass(frozen=True)
class StormReference:
    """The canary-off server's outputs for a storm's request list (request index -> outcome),
    with the model directory and the server environment they came from: what a storm
    compares its outputs with. One reference serves every storm of the same ``key``."""

    key: Tuple
    model: pathlib.Path
    env: Dict[str, str]
    outputs: Dict[int, Tuple[str, object]]


def _reference_key(settings: StormSettings) -> Tuple:
    s = settings
    return (s.device, s.pool, s.chunk, s.page_size, s.clients, s.requests, s.seed)


def _server_kwargs(settings: StormSettings) -> dict:
    return dict(
        max_total_tokens=settings.pool,
        chunked_prefill_size=settings.chunk,
        page_size=settings.page_size,
        max_running_requests=settings.clients,
        log_level="info",
    )


def storm_reference(settings: StormSettings, root: pathlib.Path) -> StormReference:
    """Write the tiny model under ``root`` and serve the storm's request list once on a
    canary-off server (greedy): the reference of every storm with these settings' server,
    clients and request list (:func:`run_storm`'s ``reference``)."""
    root.mkdir(parents=True, exist_ok=True)
    model = write_tiny_llama(root / "model")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if settings.device == "cpu":
        env = cpu_server_env(build_libcuda_stub(root / "stub"), base=env)
    requests = request_list(settings.requests, settings.seed)
    off = start("off", root, model, env, settings.device, [], **_server_kwargs(settings))
    try:
        outputs = {
            i: res
            for i, _, res in run_clients(
                off.port, requests, clients=settings.clients, until=None, rounds=1
            )
        }
    finally:
        off.stop()
    return StormReference(_reference_key(settings), model, env, outputs)


def run_storm(settings: StormSettings, reference: Optional[StormReference] = None) -> dict:
    """Run one storm; returns its figures (JSON-ready), with ``checks`` (check name ->
    passed) and ``root`` (where the logs and ``results.json`` (rid -> outcome) are).
    ``reference``: the canary-off outputs to compare with (:func:`storm_reference`, for the
    same server, clients and request list); None: a reference server runs first."""
    root = settings.out or pathlib.Path(tempfile.mkdtemp(prefix="kv_canary_storm_"))
    root.mkdir(parents=True, exist_ok=True)
    if reference is None:
        reference = storm_reference(settings, root)
    elif reference.key != _reference_key(settings):
        raise ValueError(
            f"the storm's reference was served with (device, pool, chunk, page_size, clients, "
            f"requests, seed) = {reference.key}, this storm's are {_reference_key(settings)}"
        )
    model, env, ref = reference.model, reference.env, reference.outputs
    server_kwargs = _server_kwargs(settings)
    requests = request_list(settings.requests, settings.seed)
    bad_ref = {i: r for i, r in ref.items() if r[0] != "ok"}
    if bad_ref:
        return dict(
            root=str(root),
            checks={"the canary-off server served every request": False},
            reference_failures={str(i): r for i, r in bad_ref.items()},
        )

    storm_env = dict(
        env,
        SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS=str(settings.warmup_steps),
        SGLANG_KV_CANARY_PERTURB_TARGET_GROUP="full",
        SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT="1",
        SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY="1",
        SGLANG_DEBUG_MEMORY_POOL="1",
        SGLANG_KV_CANARY_MAX_HEALS=str(MAX_HEALS),
        # heal mode: real-KV faults flip an exponent bit of a V row (the V half guarded too),
        # so a corrupt read kept changes the output (with heal's take-back removed, 38 of 329
        # outputs and 249 streamed chunks differed from the canary-off server's; with the
        # default, a mantissa bit of the K row, none did: the tiny dummy-weight model's greedy
        # tokens follow the last token)
        **(HEAL_FAULT_TARGET if settings.mode == "heal" else {}),
        **(
            {"SGLANG_KV_CANARY_CPU_DEFERRED_READBACK": "1"}
            if settings.deferred_readback and settings.device == "cpu"
            else {}
        ),
        **{k.env_var: str(p) for k, p in storm_faults(settings.mode, settings.stuck).items()},
    )
    storm = start(
        "storm",
        root,
        model,
        storm_env,
        settings.device,
        [
            "--kv-canary",
            settings.mode,
            "--kv-canary-real-data",
            "partial",
            "--kv-canary-sweep-interval",
            "4",
            "--enable-metrics",
        ],
        **server_kwargs,
    )
    checks: Dict[str, bool] = {}
    t0 = time.monotonic()
    try:
        chunks: Dict[str, List[List[int]]] = {}
        seconds: Dict[str, float] = {}
        results = run_clients(
            storm.port,
            requests,
            clients=settings.clients,
            until=time.monotonic() + settings.seconds,
            rounds=0,
            stream=settings.stream,
            chunks=chunks,
            seconds=seconds,
        )
        served_s = time.monotonic() - t0
        # read before /health: sglang's health check is a generate request of its own, which
        # the canary aborts like any other if it reads a corrupt prefix (no client sees it)
        series = metric_series(storm.port) if storm.alive() else None
        aborted_metric = metric_total(series, ABORTED_REQUESTS) if series is not None else -1
        held_back = metric_total(series, HELD_BACK_SLOTS) if series is not None else -1
        reclaimed = metric_total(series, RECLAIMED_SLOTS) if series is not None else -1
        healed_metric = metric_total(series, HEALED_REQUESTS) if series is not None else -1
        retired_metric = metric_total(series, RETIRED_SLOTS) if series is not None else -1
        heal_timed = metric_total(series, f"{HEAL_SECONDS}_count") if series is not None else -1
        heal_timed_s = metric_total(series, f"{HEAL_SECONDS}_sum") if series is not None else -1
        time.sleep(settings.idle_seconds)  # idle: sglang's leak check runs
        checks["alive after idle"] = storm.alive()
        health = http_call(storm.port, "GET", "/health", timeout=60)[0] if storm.alive() else 0
        checks["/health 200 after idle"] = health == 200
        aborted_metric_after_health = (
            metric_total(metric_series(storm.port), ABORTED_REQUESTS) if storm.alive() else -1
        )
    finally:
        storm.stop()
    log = storm.log()
    (root / "results.json").write_text(json.dumps({rid: res for _, rid, res in results}))
    kinds = collections.Counter(r[0] for _, _, r in results)
    injected = collections.Counter(
        f["fault"] for f in map(parse_perturb_line, log.splitlines()) if f
    )
    violations = parse_violation_lines(log)
    kept_own = kept_faults_on_own_positions(
        log,
        violations,
        {rid: len(requests[i][0]) for i, rid, _ in results},
        settings.page_size,
    )
    mismatched = sum(1 for i, _, (kind, out) in results if kind == "ok" and out != ref[i][1])
    aborted = [out for _, _, (kind, out) in results if kind == "aborted"]
    checks["no Traceback, leak or out-of-memory in the log"] = not any(
        m in log for m in LEAK_MARKERS
    )
    checks["no request failed otherwise"] = kinds["error"] == 0
    checks["every fault class was injected"] = set(injected) == {
        k.value for k in storm_faults(settings.mode, settings.stuck)
    }
    healed = parse_healed_rids(log)
    over_max = [m for m in aborted if HEALS_SUFFIX_RE.search(m)]
    retired = [int(m.group(1)) for m in map(RETIRED_RE.search, log.splitlines()) if m]
    stuck_lines = [
        (i, f)
        for i, f in enumerate(map(parse_perturb_line, log.splitlines()))
        if f and f["fault"] == FaultKind.REAL_KV_STUCK.value
    ]
    stuck = [int(f["full_slot"]) for _, f in stuck_lines[:1]]
    retire_at = next(
        (i for i, line in enumerate(log.splitlines()) if RETIRED_RE.search(line)), None
    )
    stuck_repeats_after_retire = (
        sum(1 for i, _ in stuck_lines if i > retire_at) if retire_at is not None else -1
    )
    index_of = {rid: i for i, rid, _ in results}
    diverged_chunks = sum(
        1 for rid, seen in chunks.items() for c in seen if c != ref[index_of[rid]][1][: len(c)]
    )
    streamed = sum(1 for seen in chunks.values() if seen)
    # a healed request's latency against the others' (completed ones, by their list entry:
    # the same prompt and output length), medians in seconds
    healed_set = set(healed)
    latency = {"healed": [], "others": []}
    for _, rid, (kind, _out) in results:
        if kind == "ok" and rid in seconds:
            latency["healed" if rid in healed_set else "others"].append(seconds[rid])
    if settings.mode == "heal":
        # past SGLANG_KV_CANARY_MAX_HEALS heals a request is aborted (faults that keep hitting
        # the same request: at the storm's rates a long request may be hit again after each
        # heal); no other abort
        checks["every abort is of a request healed the most times"] = all(
            int(HEALS_SUFFIX_RE.search(m).group(1)) == MAX_HEALS for m in over_max
        ) and len(over_max) == len(aborted)
        checks["every completed output equals canary off"] = mismatched == 0
        # a streaming client never sees a token computed from corrupt KV: every chunk is a
        # prefix of the canary-off output, the aborted requests' chunks included
        checks["every streamed chunk is a prefix of the canary-off output"] = diverged_chunks == 0
        checks["requests streamed"] = not settings.stream or streamed > 0
        checks["healed_requests_total equals the heal lines"] = healed_metric == len(healed)
        checks["aborted_requests_total equals the aborts seen"] = aborted_metric == len(aborted)
        # one time per interruption: each healed request that completed was timed at least
        # once (its next token after its last take-back), and no more times than its heals
        completed_healed = sum(
            1 for _, rid, (kind, _o) in results if kind == "ok" and rid in healed_set
        )
        checks["heal_seconds timed every completed healed request"] = (
            completed_healed <= heal_timed <= len(healed)
        )
        checks["every guarded release found the slots its row lost"] = not any(
            parse_unattributed(line) for line in log.splitlines()
        )
        checks["the release guard reclaimed slots"] = kept_own == 0 or reclaimed > 0
        checks["retired_slots equals the retire lines"] = (
            retired_metric == len(retired) * settings.page_size
        )
        budget = int(RETIRE_MAX_FRACTION * settings.pool) // settings.page_size
        checks["no more pages retired than the budget allows"] = len(retired) <= budget
        if settings.stuck:  # the stuck slot is retired, and nothing else
            checks["the stuck slot was retired, alone"] = bool(stuck) and retired == stuck[:1]
            checks["the stuck slot stopped being written"] = stuck_repeats_after_retire == 0
    elif settings.mode == "abort":
        checks["every abort carries the canary's message"] = all(
            ABORT_MESSAGE in m or PREFIX_ABORT_MESSAGE in m for m in aborted
        )
        checks["every completed output equals canary off"] = mismatched == 0
        checks["aborted_requests_total equals the aborts seen"] = aborted_metric == len(aborted)
        # a kept entry's own slot has its record: the guard finds every one
        checks["every guarded release found the slots its row lost"] = not any(
            parse_unattributed(line) for line in log.splitlines()
        )
        # only a kept entry the request owned loses it a slot (kept_faults_on_own_positions)
        checks["the release guard reclaimed slots"] = kept_own == 0 or reclaimed > 0
    else:
        checks["every request completed"] = kinds["ok"] == len(results)
    figures = dict(
        mode=settings.mode,
        device=settings.device,
        page_size=settings.page_size,
        seconds=round(served_s),
        clients=settings.clients,
        pool_tokens=settings.pool,
        chunk=settings.chunk,
        requests=len(results),
        completed=kinds["ok"],
        aborted=len(aborted),
        errors=kinds["error"],
        completed_differing_from_off=mismatched,
        faults_injected=dict(injected),
        violation_lines=len(violations),
        aborted_metric=aborted_metric,
        aborted_metric_after_health=aborted_metric_after_health,
        healed=len(healed),
        healed_requests=len(set(healed)),
        healed_metric=healed_metric,
        heal_seconds_count=heal_timed,
        heal_seconds_mean=round(heal_timed_s / heal_timed, 3) if heal_timed > 0 else -1,
        retired_slots=retired,
        retired_metric=retired_metric,
        stuck_slot=stuck,
        stuck_flips=len(stuck_lines),
        median_seconds_healed=_median(latency["healed"]),
        median_seconds_others=_median(latency["others"]),
        streamed_requests=streamed,
        streamed_chunks=sum(map(len, chunks.values())),
        streamed_chunks_diverged=diverged_chunks,
        aborted_after_max_heals=len(over_max),
        prefix_evictions=log.count("kv_canary abort: evicted a radix-cache prefix"),
        kept_faults_on_own_positions=kept_own,
        held_back_slots=held_back,
        reclaimed_slots=reclaimed,
        guarded_release_lines=log.count(RELEASE_LINE_PREFIX),
        guarded_eviction_lines=log.count(EVICTION_LINE_PREFIX),
        unattributed_entries=sum(map(parse_unattributed, log.splitlines())),
        checks=checks,
        root=str(root),
    )
    return figures
