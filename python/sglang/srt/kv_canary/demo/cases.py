"""The demo's cases and how a run is judged (``python -m sglang.srt.kv_canary.demo``,
docs/user_guide.md, "Self-tests: fault injection, the token oracle, the demo"): the settings every
run shares, one :class:`DemoCase` per fault class, the workload, reading a run's output (its
violation lines, injections and stats) into a :class:`CaseResult`, and the table.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Dict, List, Optional, Sequence, Tuple

from sglang.srt.kv_canary.perturb.config import FaultKind
from sglang.srt.kv_canary.perturb.report import parse_perturb_line
from sglang.srt.kv_canary.manager.stats import STATS_LINE_PREFIX
from sglang.srt.kv_canary.violations.containment import parse_healed_rids
from sglang.srt.kv_canary.violations.lines import ViolationLine, parse_violation_lines


RESULT_PREFIX = "DEMO_RESULT "
# what heal mode's runs leave off: the token oracle samples by request id and position, so its
# outputs would not show what a corrupt KV read changes; the model samples instead
HEAL_ENV_LEFT_OUT = (
    "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE",
    "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT",
)
# heal mode's real-KV faults: an exponent bit of layer 0's V row (its half guarded), which
# changes what attention computes; the demo's tiny dummy-weight model follows its last token,
# and a mantissa bit of a K row hardly moves a greedy token
HEAL_FAULT_TARGET = {
    "SGLANG_KV_CANARY_ENABLE_MHA_V": "1",
    "SGLANG_KV_CANARY_PERTURB_TARGET_HALF": "v",
    "SGLANG_KV_CANARY_PERTURB_FLIP": "exponent",
}
# heal mode's faults per run: each is healed (taken back, computed again); at one fault a step
# the same request would be hit past SGLANG_KV_CANARY_MAX_HEALS and aborted
HEAL_MAX_FAULTS = 2

# settings shared by every run (clean and faulty)
DEMO_ENV = {
    "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE": "1",
    "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT": "1",
    "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
    "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "10",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "30",
    "SGLANG_KV_CANARY_RING_CAPACITY": "64",
}
# what a PD pair's servers run without: the token oracle samples on each server by itself, and
# a PD request's first token is the prefill server's (not tried on a pair yet); the token-id
# check stays on
PD_ENV_LEFT_OUT = (
    "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE",
    "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT",
)
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
    # a PD pair (prefill and decode server, Mooncake's transfer engine), the fault on the
    # decode server: GPU and Mooncake only
    pd: bool = False
    extra_env: Tuple[Tuple[str, str], ...] = ()
    # the fault changes a sampled token itself (not KV): heal mode recomputes KV, and the
    # token already in the output stays, so its outputs are not compared with the clean run's
    output_fault: bool = False

    @property
    def env(self) -> Dict[str, str]:
        """The canary variables of this run: :data:`DEMO_ENV` (less :data:`PD_ENV_LEFT_OUT`
        for a PD pair) and the fault's."""
        env = {k: v for k, v in DEMO_ENV.items() if not (self.pd and k in PD_ENV_LEFT_OUT)}
        if self.fault is None:
            return env
        env.update({self.fault.env_var: "1", **dict(self.extra_env)})
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
        output_fault=True,
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
    # PD: a byte flipped in a page the decode server received, after the transfer and before
    # its first forward; found by that forward's verify at the flipped slot
    DemoCase(
        "pd_transfer",
        FaultKind.PD_TRANSFER,
        reasons=("verify_real_kv_hash",),
        tags=("HEAD_", "TAIL_", "SWEEP_"),
        match_slot=True,
        pd=True,
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


# the PD pair's pools: room for every request of a wave at once (a decode server admits a
# request only once its whole prompt fits; the demo's small pool would serve one at a time)
PD_MAX_TOTAL_TOKENS = 4096


def demo_engine_args(
    mode: str = "raise", page_size: int = 1, hicache: bool = False, pd: bool = False
) -> Dict[str, object]:
    """The Engine arguments of every run: :data:`DEMO_ENGINE_ARGS` with ``--kv-canary mode``
    and ``--page-size``; sglang wants the chunked-prefill size a multiple of the page size, and
    the pool keeps room for at least 12 pages. ``hicache``: HiCache on with sglang's defaults
    (a host pool twice the device pool, write-through), so pages the small device pool evicts
    stay in host memory and come back on a prefix hit. ``pd``: the pools of a PD pair
    (:data:`PD_MAX_TOTAL_TOKENS`)."""
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
    if pd:
        args["max_total_tokens"] = max(args["max_total_tokens"], PD_MAX_TOTAL_TOKENS)
    return args


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
    outputs_digest: Optional[str] = None  # the worker's digest of every output, in order
    healed: int = 0  # heal mode's heals (requests taken back and computed again)
    same_output: Optional[bool] = None  # heal mode: outputs equal the clean run's (None: n/a)

    @property
    def alive(self) -> bool:
        """The server served the whole workload and shut down cleanly."""
        return self.returncode == 0 and self.finished

    @property
    def ok(self) -> bool:
        """Clean run: alive and quiet. A fault: detected; in ``log`` and ``heal`` mode the
        server must also have kept serving to the end (fault injection must not break sglang's
        own state), and in ``heal`` mode every output must equal the clean run's (where the
        fault is in KV)."""
        if self.fault is None:
            return self.alive and self.violations == 0
        if self.mode == "heal":
            return self.detected and self.alive and self.same_output is not False
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
    result_line = next((line for line in text.splitlines() if line.startswith(RESULT_PREFIX)), None)
    digest = (
        json.loads(result_line[len(RESULT_PREFIX) :]).get("outputs_digest") if result_line else None
    )
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
        outputs_digest=digest,
        healed=len(parse_healed_rids(text)),
    )


def compare_with_clean(results: Sequence[CaseResult]) -> List[CaseResult]:
    """Heal mode: each fault row's ``same_output`` (its outputs' digest against the clean
    row's; None for a fault in the sampled output itself, or without a clean row). Other modes:
    the rows as they are."""
    clean = next((r for r in results if r.fault is None), None)
    out = []
    for r in results:
        case = CASES_BY_NAME.get(r.name)
        if r.mode != "heal" or r.fault is None or clean is None or case is None:
            out.append(r)
        elif case.output_fault:
            out.append(dataclasses.replace(r, same_output=None))
        else:
            same = r.outputs_digest is not None and r.outputs_digest == clean.outputs_digest
            out.append(dataclasses.replace(r, same_output=same))
    return out


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
    ) + (("healed", "output = clean run") if mode == "heal" else ())
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
            + (
                (
                    str(r.healed),
                    "-"
                    if r.fault is None or r.same_output is None
                    else ("yes" if r.same_output else "NO"),
                )
                if mode == "heal"
                else ()
            )
        )
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [
        f"kv_canary demo on {device}: --kv-canary {mode}, page size {page_size}, real data "
        "partial, sweep every 2 steps, "
        + (
            "token-id checks, the model sampling (greedy)"
            if mode == "heal"
            else "token oracle + write-input + token-id checks"
        ),
        line(head),
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    out += [line(r) for r in rows]
    return "\n".join(out)


# ---- the parent ------------------------------------------------------------------------------
