"""Adversarial soak: a real sglang 0.5.12 HTTP server on the CPU, started from the command line
(``python -m sglang.launch_server``) with ``--kv-canary raise --kv-canary-sweep-interval 2
--kv-canary-real-data all`` and token checks on, hammered for ``SOAK_SECONDS`` by concurrent
clients; at the end the server must still be alive and healthy, must have reported no
violation (in raise mode one report stops it), and its greedy outputs must equal, token for
token, those of a second CLI server with the canary off (same model, same arguments).

The tiny dummy-weight Llama, the libcuda stub and the CPU environment come from
``sglang.srt.kv_canary.demo.server_harness``; the server's flags are that module's
``cpu_engine_kwargs`` written as command-line flags. The KV pool is small
(``POOL_TOKENS``) so decodes run it full and the scheduler retracts requests; prefill is
chunked (``CHUNK_TOKENS``) and ``--enable-mixed-chunk`` puts prefill chunks and decodes into
the same forward.

Traffic kinds (every client thread runs each kind once first, then picks at random with a
seeded RNG; counted per kind and printed; each must happen at least once):

- ``shared_prefix``: prompts cut from a few shared prefixes plus a random tail, random
  sampling parameters. Radix-cache hits: requests reading KV that other requests wrote, the
  case the chain hash and the token check are for.
- ``chunked_prefill``: prompts of 2.5-6 chunks. Chunked prefill (EXTEND with a prefix of the
  request's own earlier chunks) mixed into forwards with running decodes.
- ``parallel_n``: ``sampling_params.n`` = 2..4. sglang first prefills the prompt once, then
  forks n requests onto the cached prefix: n readers of one set of slots.
- ``long_decode``: a batch of 2-4 prompts in one call (``input_ids`` a list of lists),
  ``ignore_eos`` and long outputs. Fills the pool during decode, so the
  scheduler retracts requests (their slots are freed and reused, their prompt re-prefilled
  later from whatever the radix cache still holds). Retractions are counted from sglang's
  own log line and asserted. Whether the random traffic gets there depends on the machine's
  speed, so before the clients start a fill phase (``Soak.fill_pool``: 24 short greedy
  prompts decoding 120 tokens each in one call) overruns the pool on purpose and must cause
  a retraction.
- ``stream_early_close``: streaming requests whose client reads a few events and hangs up
  (half of them also abort their rid). The server keeps or drops the request on its own
  schedule: slots freed mid-decode.
- ``abort_by_rid``: ``/abort_request`` with the request's rid after a random delay: aborts
  in the waiting queue, mid chunked prefill or mid decode.
- ``client_timeout``: the client gives up after a fraction of a second: sglang notices the
  disconnection later and aborts the request itself.
- ``over_context``: inputs longer than the context length: a 400 error response from the
  tokenizer manager, nothing scheduled.
- ``over_pool``: inputs shorter than the context but longer than the pool allows: the
  scheduler turns the request into a one-token prefill and aborts it (a 400 response).

And from the controller (the test's main thread): ``/flush_cache`` every ``FLUSH_EVERY_S``
(refused with 400 while requests run, which is tolerated and counted), and every
``ABORT_ALL_EVERY_S`` an ``abort_all`` (``/abort_request`` with ``{"abort_all": true}``),
after which new requests are held back until a flush succeeds: the radix cache is emptied
while warm and refilled afterwards (the sweep walks a tree that was just reset).

Expected error responses are checked explicitly (status and message); anything else - a 5xx,
an unexpected 4xx, a transport error while the server is alive, an abort that no abort of
ours explains, a malformed result - is recorded and fails the test. Not sent:
``min_new_tokens`` (it stops sglang 0.5.12's CPU scheduler even with the canary off: an
AttributeError on ``additional_stop_token_ids``), ``return_logprob`` (reported to crash the
CPU engine too), ``sampling_seed`` and ``repetition_penalty`` (each triggers a
``torch.compile`` of seconds on the CPU).

To see the test fail, plant a fault through the environment the servers inherit, e.g.
``SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB=0.05 SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS=400``
(it strikes a few seconds into the soak; with a warm-up under ~150 steps it strikes during
the greedy probes before it): the canary reports a violation, the server stops and the
violation assertion fails.

Abort and heal mode's storms are ``test_storm_server.py`` (a file of its own: the two run side
by side on CI's two workers).
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import random
import re
import sys
import threading
import time
import uuid

import pytest
from cli_server import CliServer, http_call
from sglang.srt.kv_canary.violations.lines import VIOLATION_LINE_PREFIX, parse_violation_lines
from sglang.srt.kv_canary.demo.server_harness import (
    TINY_LLAMA_CONFIG,
    build_libcuda_stub,
    cpu_server_env,
    write_tiny_llama,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=110, suite="stage-a-test-cpu")

pytestmark = [pytest.mark.slow, pytest.mark.soak]


def _soak_seconds() -> float:
    """The traffic phase's length: CI's size, or ``KV_CANARY_SOAK_SECONDS`` for a long run
    (docs/testing.md, "The CPU suite")."""
    raw = os.environ.get("KV_CANARY_SOAK_SECONDS", "45")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not seconds >= 20:
        raise ValueError(f"KV_CANARY_SOAK_SECONDS={raw!r}; allowed: a number of seconds >= 20")
    return seconds


# the traffic phase; with CI's 45 s the whole test (two server start-ups included) is ~1.5 min
SOAK_SECONDS = _soak_seconds()
SEED = 20261123
CLIENT_THREADS = 6
POOL_TOKENS = 2048  # --max-total-tokens: small enough that decodes fill it (retractions)
CHUNK_TOKENS = 64  # --chunked-prefill-size
SERVER_KWARGS = dict(
    max_total_tokens=POOL_TOKENS,
    chunked_prefill_size=CHUNK_TOKENS,
    enable_mixed_chunk=True,
    log_level="info",
)
CONTEXT_LEN = TINY_LLAMA_CONFIG["max_position_embeddings"]  # 4096, sglang's context_len
VOCAB = TINY_LLAMA_CONFIG["vocab_size"]
FLUSH_EVERY_S = 10.0
ABORT_ALL_EVERY_S = min(45.0, SOAK_SECONDS / 2)  # at least one mid-soak abort_all
STATS_EVERY_N_STEPS = 100
HTTP_TIMEOUT_S = 150.0  # generous: abort_all every 45 s bounds every request's life
PROBE_MAX_NEW = 16
FILL_PROMPTS = 24  # the fill phase: 24 x (8-16 + 120) tokens, well over the pool
FILL_MAX_NEW = 120

RETRACT_LOG = "KV cache pool is full. Retract requests."  # sglang scheduler's warning
STATS_RE = re.compile(
    r"kv_canary stats: step=(\d+) protected_tokens=(\d+) sweep_passes=(\d+) "
    r"violations=(\d+)"
)
CANARY_FLAGS = [
    "--kv-canary",
    "raise",
    "--kv-canary-sweep-interval",
    "2",
    "--kv-canary-real-data",
    "all",
]
CANARY_ENV = {
    "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
    "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": str(STATS_EVERY_N_STEPS),
}

KINDS = (
    "shared_prefix",
    "chunked_prefill",
    "parallel_n",
    "long_decode",
    "stream_early_close",
    "abort_by_rid",
    "client_timeout",
    "over_context",
    "over_pool",
)
KIND_WEIGHTS = (24, 12, 12, 14, 10, 10, 6, 4, 4)
ABORT_MESSAGES = ("Aborted", "Abort in waiting queue")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]  # 0..2: pad / bos / eos


_PREFIX_RNG = random.Random(SEED)
SHARED_PREFIXES = [_tokens(_PREFIX_RNG, n) for n in (40, 96, 150, 230)]


def _probe_prompts() -> list[list[int]]:
    """8 greedy probes: three sharing a prefix (radix hits), one of 2.3 chunks."""
    rng = random.Random(SEED + 1)
    common = _tokens(rng, 48)
    prompts = [common + _tokens(rng, k) for k in (5, 17, 30)]
    prompts += [_tokens(rng, n) for n in (3, 20, 64, 150)]
    prompts.append(SHARED_PREFIXES[1][:70] + _tokens(rng, 9))
    return prompts


def _flush_until_idle(port: int, timeout: float = 60.0) -> None:
    """``/flush_cache`` until it succeeds (it refuses while requests run or wait)."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = http_call(port, "POST", "/flush_cache", timeout=30)
        if status == 200:
            return
        assert status == 400 and b"Flush cache failed" in body, (status, body[:300])
        if time.monotonic() > deadline:
            pytest.fail(f"server never went idle for a flush in {timeout:.0f} s")
        time.sleep(0.25)


def _greedy_probes(port: int) -> list[list[int]]:
    """The probes one at a time from an empty radix cache: the same forwards every time."""
    _flush_until_idle(port)
    outputs = []
    for prompt in _probe_prompts():
        status, body = http_call(
            port,
            "POST",
            "/generate",
            {
                "input_ids": prompt,
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": PROBE_MAX_NEW,
                    "ignore_eos": True,
                },
            },
            timeout=HTTP_TIMEOUT_S,
        )
        assert status == 200, (status, body[:500])
        res = json.loads(body)
        assert res["meta_info"]["finish_reason"]["type"] == "length", res["meta_info"]
        outputs.append(res["output_ids"])
    return outputs


# ---- the soak ----------------------------------------------------------------------------------


class Soak:
    def __init__(self, server: CliServer):
        self.server = server
        self.port = server.port
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()  # kind -> done
        self.outcomes: collections.Counter = collections.Counter()  # "kind:outcome" -> n
        self.problems: list[str] = []
        # [sent, answered] of each abort_all (time.monotonic(); answered = inf until it is)
        self.abort_all_windows: list[list[float]] = []
        self.response_retractions = 0
        self.stop = threading.Event()
        self.gate = threading.Event()  # cleared while the controller quiesces for a flush
        self.gate.set()

    # -- bookkeeping
    def note(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.counts[kind] += 1
            self.outcomes[f"{kind}:{outcome}"] += 1

    def problem(self, kind: str, msg: str) -> None:
        with self.lock:
            self.problems.append(f"[{kind}] {msg}")

    def _explained_by_abort_all(self, t0: float, t1: float) -> bool:
        """Could an abort_all have hit a request alive from t0 to t1? The tokenizer manager
        forwards the abort before it answers, on the same channel as new requests, so one
        answered before t0 cannot; one sent after t1 cannot either (0.5 s of slack)."""
        with self.lock:
            return any(
                sent <= t1 + 0.5 and t0 <= answered + 0.5
                for sent, answered in self.abort_all_windows
            )

    def post(self, kind: str, path: str, body, timeout: float = HTTP_TIMEOUT_S):
        """POST; a transport error is a problem unless the server has died (then it is the
        death that gets reported)."""
        try:
            return http_call(self.port, "POST", path, body, timeout=timeout)
        except TimeoutError:
            raise
        except (OSError, http.client.HTTPException) as e:
            if self.server.alive():
                self.problem(kind, f"{path}: transport error {e!r}")
            else:
                self.stop.set()
            return None, b""

    # -- result checks
    def check_result(self, kind: str, res, sp: dict, t0: float, aborts_expected: bool) -> str:
        """Validate one generate result; returns "finished" or "aborted"."""
        if not isinstance(res, dict) or not isinstance(res.get("output_ids"), list):
            self.problem(kind, f"malformed result {str(res)[:300]}")
            return "malformed"
        ids = res["output_ids"]
        if not all(isinstance(t, int) and 0 <= t < VOCAB for t in ids):
            self.problem(kind, f"token ids out of range: {ids[:20]}")
        reason = (res.get("meta_info") or {}).get("finish_reason") or {}
        with self.lock:
            self.response_retractions += int(res["meta_info"].get("num_retractions") or 0)
        kind_of = reason.get("type")
        if kind_of == "abort":
            if reason.get("message") not in ABORT_MESSAGES or reason.get("status_code"):
                self.problem(kind, f"unexpected abort {reason}")
            elif not aborts_expected and not self._explained_by_abort_all(t0, time.monotonic()):
                self.problem(kind, f"abort without an abort of ours: {reason}")
            return "aborted"
        max_new = sp["max_new_tokens"]
        if kind_of == "length":
            if len(ids) != max_new:
                self.problem(kind, f"finish length with {len(ids)} of {max_new} tokens")
        elif kind_of == "stop":
            if sp.get("ignore_eos") or len(ids) > max_new:
                self.problem(
                    kind,
                    f"stop with ignore_eos={sp.get('ignore_eos')} after "
                    f"{len(ids)} of {max_new} tokens",
                )
        else:
            self.problem(kind, f"unknown finish reason {reason}")
        return "finished"

    def generate(
        self,
        kind: str,
        body: dict,
        *,
        aborts_expected: bool = False,
        timeout: float = HTTP_TIMEOUT_S,
    ) -> str:
        t0 = time.monotonic()
        status, raw = self.post(kind, "/generate", body, timeout=timeout)
        if status is None:
            return "transport_error"
        if status != 200:
            self.problem(kind, f"HTTP {status}: {raw[:300]!r}")
            return f"http_{status}"
        res = json.loads(raw)
        sp = body["sampling_params"]
        items = res if isinstance(res, list) else [res]
        batch = len(body["input_ids"]) if isinstance(body["input_ids"][0], list) else 1
        if len(items) != batch * sp.get("n", 1):
            self.problem(kind, f"{batch} prompt(s), n={sp.get('n', 1)}: {len(items)} results")
        outcomes = {self.check_result(kind, r, sp, t0, aborts_expected) for r in items}
        return "aborted" if "aborted" in outcomes else "finished"

    # -- traffic kinds
    @staticmethod
    def sampling(rng: random.Random, max_new: int, ignore_eos: bool | None = None) -> dict:
        sp = {"max_new_tokens": max_new}
        if rng.random() < 0.25:
            sp["temperature"] = 0.0
        else:
            sp["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.5])
            if rng.random() < 0.6:
                sp["top_p"] = round(rng.uniform(0.3, 1.0), 2)
            if rng.random() < 0.6:
                sp["top_k"] = rng.choice([1, 5, 40, -1])
            if rng.random() < 0.3:
                sp["min_p"] = rng.choice([0.01, 0.05, 0.2])
        if ignore_eos if ignore_eos is not None else rng.random() < 0.5:
            sp["ignore_eos"] = True
        return sp

    @staticmethod
    def shared_prompt(rng: random.Random) -> list[int]:
        p = rng.choice(SHARED_PREFIXES)
        return p[: rng.randint(len(p) // 2, len(p))] + _tokens(rng, rng.randint(0, 40))

    def do_shared_prefix(self, rng):
        return self.generate(
            "shared_prefix",
            {
                "input_ids": self.shared_prompt(rng),
                "sampling_params": self.sampling(rng, rng.randint(1, 96)),
            },
        )

    def do_chunked_prefill(self, rng):
        n = rng.randint(CHUNK_TOKENS * 5 // 2, CHUNK_TOKENS * 6)
        return self.generate(
            "chunked_prefill",
            {
                "input_ids": _tokens(rng, n),
                "sampling_params": self.sampling(rng, rng.randint(4, 48)),
            },
        )

    def do_parallel_n(self, rng):
        sp = self.sampling(rng, rng.randint(4, 48))
        sp["n"] = rng.randint(2, 4)
        sp["temperature"] = max(sp["temperature"], 0.7)
        return self.generate(
            "parallel_n", {"input_ids": self.shared_prompt(rng), "sampling_params": sp}
        )

    def do_long_decode(self, rng):
        # a batch of 2-4 prompts in one call, together more than the pool can decode
        prompts = [_tokens(rng, rng.randint(40, 250)) for _ in range(rng.randint(2, 4))]
        return self.generate(
            "long_decode",
            {
                "input_ids": prompts,
                "sampling_params": self.sampling(rng, rng.randint(150, 400), ignore_eos=True),
            },
        )

    def fill_pool(self) -> str:
        """One call, before the clients start, that must overrun the pool: FILL_PROMPTS short
        prompts decoding FILL_MAX_NEW tokens each (``ignore_eos``). The scheduler admits about
        ``pool / (prompt + new_token_ratio * max_new)`` of them, and their decodes need more
        slots than that, so it retracts some a few seconds in (on any machine: it does not
        hang on the random traffic's luck). Greedy, so every result is checked in full."""
        rng = random.Random(SEED + 2)
        prompts = [_tokens(rng, rng.randint(8, 16)) for _ in range(FILL_PROMPTS)]
        if FILL_PROMPTS * (16 + FILL_MAX_NEW) <= POOL_TOKENS:
            raise ValueError("the fill phase's requests fit in the pool: no retraction")
        outcome = self.generate(
            "fill_pool",
            {
                "input_ids": prompts,
                "sampling_params": {
                    "max_new_tokens": FILL_MAX_NEW,
                    "ignore_eos": True,
                    "temperature": 0.0,
                },
            },
        )
        self.note("fill_pool", outcome)
        return outcome

    def do_stream_early_close(self, rng):
        kind = "stream_early_close"
        rid = uuid.uuid4().hex
        body = {
            "rid": rid,
            "stream": True,
            "input_ids": self.shared_prompt(rng),
            "sampling_params": self.sampling(rng, rng.randint(100, 300), ignore_eos=True),
        }
        want = rng.randint(1, 6)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_TIMEOUT_S)
        got, done = 0, False
        try:
            conn.request(
                "POST",
                "/generate",
                body=json.dumps(body),
                headers={"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            if resp.status != 200:
                self.problem(kind, f"HTTP {resp.status}: {resp.read()[:300]!r}")
                return f"http_{resp.status}"
            while got < want:
                line = resp.readline()
                if not line:
                    done = True
                    break
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event or "output_ids" not in event:
                    self.problem(kind, f"bad stream event {data[:300]!r}")
                    break
                got += 1
        except TimeoutError:
            self.problem(kind, "stream stalled past the client timeout")
            return "timeout"
        except (OSError, http.client.HTTPException) as e:
            if self.server.alive():
                self.problem(kind, f"stream transport error {e!r}")
            else:
                self.stop.set()
            return "transport_error"
        finally:
            conn.close()  # hang up mid-stream
        if rng.random() < 0.5:
            status, raw = self.post(kind, "/abort_request", {"rid": rid}, timeout=30)
            if status not in (200, None):
                self.problem(kind, f"/abort_request HTTP {status}: {raw[:200]!r}")
            return "closed_then_aborted" if not done else "finished"
        return "closed" if not done else "finished"

    def do_abort_by_rid(self, rng):
        kind = "abort_by_rid"
        rid = uuid.uuid4().hex  # fixed length: sglang aborts every rid *starting with* it
        prompt = self.shared_prompt(rng) + _tokens(rng, rng.randint(0, 200))
        body = {
            "rid": rid,
            "input_ids": prompt,
            "sampling_params": self.sampling(rng, rng.randint(100, 300), ignore_eos=True),
        }
        result: dict[str, str] = {}

        def send():
            try:
                result["outcome"] = self.generate(kind, body, aborts_expected=True)
            except Exception as e:  # noqa: BLE001 - a thread must report, not die silently
                self.problem(kind, f"aborted request: client raised {e!r}")

        worker = threading.Thread(target=send, daemon=True)
        worker.start()
        time.sleep(rng.uniform(0.05, 2.0))
        status, raw = self.post(kind, "/abort_request", {"rid": rid}, timeout=30)
        if status not in (200, None):
            self.problem(kind, f"/abort_request HTTP {status}: {raw[:200]!r}")
        worker.join(HTTP_TIMEOUT_S + 10)
        if worker.is_alive():
            self.problem(kind, "aborted request never answered")
            return "hung"
        return result.get("outcome", "none")

    def do_client_timeout(self, rng):
        kind = "client_timeout"
        body = {
            "input_ids": self.shared_prompt(rng),
            "sampling_params": self.sampling(rng, rng.randint(200, 400), ignore_eos=True),
        }
        try:
            return self.generate(kind, body, timeout=rng.uniform(0.2, 1.5))
        except TimeoutError:
            return "timed_out"

    def _expect_400(self, kind: str, n_input: int, message: str) -> str:
        t0 = time.monotonic()
        status, raw = self.post(
            kind,
            "/generate",
            {"input_ids": [5] * n_input, "sampling_params": {"max_new_tokens": 4}},
        )
        if status is None:
            return "transport_error"
        if (
            status == 200
            and b'"type":"abort"' in raw
            and self._explained_by_abort_all(t0, time.monotonic())
        ):
            # an abort_all reached it in the waiting queue before the scheduler refused it
            return "aborted_by_abort_all"
        if status != 400 or message.encode() not in raw:
            self.problem(
                kind,
                f"{n_input} input tokens: expected 400 {message!r}, got {status} {raw[:300]!r}",
            )
            return f"http_{status}"
        return "rejected_400"

    def do_over_context(self, rng):
        return self._expect_400(
            "over_context",
            CONTEXT_LEN + rng.randint(0, 600),
            "longer than the model's context length",
        )

    def do_over_pool(self, rng):
        # sglang's max_req_input_len is min(context_len - 1, pool - 1) - 5
        return self._expect_400(
            "over_pool",
            rng.randint(POOL_TOKENS, CONTEXT_LEN - 8),
            "exceeds the maximum allowed length",
        )

    # -- threads
    def client(self, index: int) -> None:
        rng = random.Random(SEED * 1000 + index)
        first = list(KINDS[index % len(KINDS) :] + KINDS[: index % len(KINDS)])
        while not self.stop.is_set():
            if not self.gate.wait(timeout=0.5):
                continue
            kind = first.pop(0) if first else rng.choices(KINDS, KIND_WEIGHTS)[0]
            try:
                outcome = getattr(self, f"do_{kind}")(rng)
            except Exception as e:  # noqa: BLE001 - e.g. an undecodable answer: report it
                self.problem(kind, f"client raised {e!r}")
                outcome = "exception"
            self.note(kind, outcome)

    def abort_all(self, tag: str) -> None:
        # the window opens before the request is sent: an aborted request's answer can reach
        # its client before this abort_all's own answer does (a busy server)
        window = [time.monotonic(), float("inf")]
        with self.lock:
            self.abort_all_windows.append(window)
        try:
            status, raw = self.post("abort_all", "/abort_request", {"abort_all": True}, timeout=30)
        except TimeoutError:
            status, raw = None, b""
            self.problem("abort_all", "no answer in 30 s")
        finally:
            with self.lock:
                window[1] = time.monotonic()
        if status not in (200, None):
            self.problem("abort_all", f"HTTP {status}: {raw[:200]!r}")
        self.note("abort_all", tag)

    def flush(self, count_busy: bool = True) -> bool:
        try:
            status, raw = self.post("flush_cache", "/flush_cache", None, timeout=30)
        except TimeoutError:
            self.problem("flush_cache", "no answer in 30 s")
            return False
        if status == 200:
            self.note("flush_cache", "flushed")
            return True
        if status == 400 and b"Flush cache failed" in raw:
            if count_busy:
                self.note("flush_cache", "busy")
        elif status is not None:
            self.problem("flush_cache", f"HTTP {status}: {raw[:200]!r}")
        return False

    def quiesced_flush(self) -> None:
        """Hold new requests, abort everything, flush the (warm) radix cache, resume."""
        self.gate.clear()
        try:
            self.abort_all("mid_soak")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.server.alive():
                if self.flush(count_busy=False):
                    return
                time.sleep(0.25)
        finally:
            self.gate.set()

    def run(self, seconds: float) -> float:
        clients = [
            threading.Thread(target=self.client, args=(i,), daemon=True, name=f"soak-client-{i}")
            for i in range(CLIENT_THREADS)
        ]
        t_start = time.monotonic()
        for t in clients:
            t.start()
        next_flush = t_start + FLUSH_EVERY_S
        next_abort_all = t_start + ABORT_ALL_EVERY_S
        while time.monotonic() < t_start + seconds and not self.stop.is_set():
            if not self.server.alive():
                break
            now = time.monotonic()
            if now >= next_abort_all:
                self.quiesced_flush()
                next_abort_all = time.monotonic() + ABORT_ALL_EVERY_S
                next_flush = time.monotonic() + FLUSH_EVERY_S
            elif now >= next_flush:
                self.flush()
                next_flush = now + FLUSH_EVERY_S
            time.sleep(0.5)
        self.stop.set()
        if self.server.alive():
            self.abort_all("drain")  # ends the long requests still running
        for t in clients:
            t.join(HTTP_TIMEOUT_S + 30)
            if t.is_alive():
                self.problem("soak", f"{t.name} did not finish")
        return time.monotonic() - t_start

    def report(self, elapsed: float, retractions_logged: int) -> str:
        lines = [f"soak: {elapsed:.0f} s, {CLIENT_THREADS} clients, seed {SEED}"]
        for kind in ("fill_pool", *KINDS, "flush_cache", "abort_all"):
            detail = ", ".join(
                f"{k.split(':', 1)[1]}={v}"
                for k, v in sorted(self.outcomes.items())
                if k.split(":", 1)[0] == kind
            )
            lines.append(f"  {kind:20s} {self.counts[kind]:5d}  ({detail})")
        lines.append(
            f"  retractions: {retractions_logged} scheduler log lines, "
            f"{self.response_retractions} counted in responses' num_retractions"
        )
        lines.append(f"  problems: {len(self.problems)}")
        return "\n".join(lines)


# ---- the test ----------------------------------------------------------------------------------


def _assert_canary_silent(server: CliServer) -> str:
    """No violation report and no traceback in the server's output; returns the log."""
    log = server.log()
    violations = parse_violation_lines(log)
    assert not violations, (
        f"{len(violations)} canary violation(s), first: {violations[0]}\n{server.tail(40)}"
    )
    assert VIOLATION_LINE_PREFIX not in log, server.tail(40)
    if "Traceback" in log:
        at = log.index("Traceback")
        pytest.fail("Traceback in the server output:\n" + log[max(0, at - 2000) : at + 4000])
    return log


def _health(port: int):
    try:
        return http_call(port, "GET", "/health_generate", timeout=60)[0]
    except (OSError, http.client.HTTPException) as e:
        return repr(e)


def test_adversarial_soak_on_a_cli_server(tmp_path):
    t_test = time.monotonic()
    model_dir = write_tiny_llama(tmp_path / "model")
    env = cpu_server_env(build_libcuda_stub(tmp_path / "stub"))
    servers: list[CliServer] = []
    try:
        # both start at once (start-up is mostly imports); the baseline is stopped before
        # the soak so it takes no CPU from it
        baseline = CliServer("canary_off", tmp_path, model_dir, env, [], **SERVER_KWARGS)
        servers.append(baseline)
        canary = CliServer(
            "canary_raise",
            tmp_path,
            model_dir,
            dict(env, **CANARY_ENV),
            CANARY_FLAGS,
            **SERVER_KWARGS,
        )
        servers.append(canary)
        try:
            baseline.wait_ready()
            canary.wait_ready()
            print(f"\nservers ready after {time.monotonic() - t_test:.0f} s")
            expected = _greedy_probes(baseline.port)
            baseline_log = baseline.log()
            baseline.stop()
            assert "kv_canary installed" not in baseline_log  # the canary is really off there
            assert "Traceback" not in baseline_log, baseline_log[-3000:]

            before = _greedy_probes(canary.port)
            assert before == expected, "greedy outputs differ from canary-off before the soak"

            soak = Soak(canary)
            fill = soak.fill_pool()
            assert fill == "finished" and not soak.problems, (fill, soak.problems)
            assert RETRACT_LOG in canary.log(), (
                "the fill phase never filled the pool: no retraction in the scheduler log"
            )
            elapsed = soak.run(SOAK_SECONDS)
            alive = canary.alive()
            health = _health(canary.port) if alive else None
            after = _greedy_probes(canary.port) if alive else None
        except BaseException:
            # whatever broke (a probe, a dead server), a canary report explains it first
            _assert_canary_silent(canary)
            raise

        log = canary.log()
        retractions = log.count(RETRACT_LOG)
        print(soak.report(elapsed, retractions))
        stats = [tuple(map(int, m)) for m in STATS_RE.findall(log)]
        if stats:
            print(
                "  last canary stats: step={} protected_tokens={} sweep_passes={} "
                "violations={}".format(*stats[-1])
            )

        # 1. the canary found nothing (a raise-mode report would also have stopped the server)
        log = _assert_canary_silent(canary)
        # 2. the server survived and still serves
        assert alive, f"canary server died (rc={canary.proc.returncode}):\n{canary.tail()}"
        assert health == 200, f"/health_generate answered {health}"
        # 3. the traffic was what it claims: no unexpected answer, every kind, retractions
        assert not soak.problems, "unexpected outcomes:\n" + "\n".join(soak.problems[:40])
        missing = [k for k in (*KINDS, "abort_all") if soak.counts[k] == 0]
        assert not missing, f"traffic kinds that never ran: {missing}"
        assert soak.outcomes["flush_cache:flushed"] > 0, "no flush of a warm cache mid-soak"
        assert soak.counts["flush_cache"] >= SOAK_SECONDS / FLUSH_EVERY_S / 2, "too few flushes"
        assert retractions > 0, "the pool never filled: no retraction in the scheduler log"
        # 4. the canary really ran, with the settings asked for
        installed = [line for line in log.splitlines() if "kv_canary installed:" in line]
        assert installed, "no 'kv_canary installed:' line"
        for setting in ("mode=raise", "real_data=all", "sweep_interval=2", "token_checks=on"):
            assert setting in installed[0], installed[0]
        assert stats, "no 'kv_canary stats:' line"
        assert max(s[2] for s in stats) > 0, "the radix sweep never ran"
        assert all(s[3] == 0 for s in stats), stats
        # 5. greedy identity with the canary-off server, after the soak
        assert after == expected, "greedy outputs differ from canary-off after the soak"
        print(f"test wall time {time.monotonic() - t_test:.0f} s")
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
