"""``CanaryMetrics``: the canary's Prometheus series, through sglang's own metrics machinery
(docs/monitoring/README.md; docs/architecture.md, "Violation pipeline").

With ``--enable-metrics`` sglang points ``PROMETHEUS_MULTIPROC_DIR`` at a directory shared by
its processes and serves every process's series at the HTTP server's ``/metrics``; a
scheduler creates its ``prometheus_client`` metrics with its own labels (model name, engine
type, ranks). The canary's metrics live in the scheduler process next to them, with the same
labels, so they appear at the same ``/metrics``. Built once per scheduler when the scheduler
is attached (``prometheus_client`` is imported then, after sglang set the directory); None
when metrics are off. Host only, a few counter updates per forward.
"""

from __future__ import annotations

import functools
from typing import Dict, Sequence

from sglang.jit_kernel.kv_canary.consts import FailReason
from sglang.srt.kv_canary.memory import CanaryMemory
from sglang.srt.kv_canary.violations.records import ViolationIncident

VIOLATIONS = "sglang:kv_canary_violations_total"
VERIFIED_SLOTS = "sglang:kv_canary_verified_slots_total"
PROTECTED_TOKENS = "sglang:kv_canary_protected_tokens"
SWEEP_PASSES = "sglang:kv_canary_sweep_passes_total"
DROPPED_VIOLATIONS = "sglang:kv_canary_dropped_violations_total"
ABORTED_REQUESTS = "sglang:kv_canary_aborted_requests_total"
HEALED_REQUESTS = "sglang:kv_canary_healed_requests_total"
RETIRED_SLOTS = "sglang:kv_canary_retired_slots"
HEAL_SECONDS = "sglang:kv_canary_heal_seconds"
HELD_BACK_SLOTS = "sglang:kv_canary_held_back_slots_total"
RECLAIMED_SLOTS = "sglang:kv_canary_reclaimed_slots_total"
MEMORY_BYTES = "sglang:kv_canary_memory_bytes"
METRIC_NAMES = (
    VIOLATIONS,
    VERIFIED_SLOTS,
    PROTECTED_TOKENS,
    SWEEP_PASSES,
    DROPPED_VIOLATIONS,
    ABORTED_REQUESTS,
    HEALED_REQUESTS,
    RETIRED_SLOTS,
    HEAL_SECONDS,
    HELD_BACK_SLOTS,
    RECLAIMED_SLOTS,
    MEMORY_BYTES,
)


# a heal recomputes a request's KV (a prefill of its tokens) and waits for the next batch
HEAL_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _RunningTotal:
    """A Prometheus counter fed with a running total the canary keeps: each update advances
    it by the growth since the last one."""

    def __init__(self, counter):
        self.counter = counter
        self.last = 0

    def to(self, total: int) -> None:
        if total > self.last:
            self.counter.inc(total - self.last)
            self.last = total


class CanaryMetrics:
    """``labels``: the scheduler's metric labels (name -> value), applied to every series;
    ``registry``: a ``prometheus_client`` registry (default: the process's, which sglang's
    multiprocess collector reads; tests pass their own)."""

    def __init__(self, labels: Dict[str, object], registry=None):
        import prometheus_client

        reg = {"registry": registry if registry is not None else prometheus_client.REGISTRY}
        Counter = functools.partial(prometheus_client.Counter, **reg)  # noqa: N806
        Gauge = functools.partial(prometheus_client.Gauge, **reg)  # noqa: N806
        Histogram = functools.partial(prometheus_client.Histogram, **reg)  # noqa: N806
        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)
        self._violations = Counter(
            name=VIOLATIONS,
            labelnames=names + ["pool", "launch_tag", "fail_reason"],
            documentation="KV-canary violation reports (one per structured log line), by the "
            "guarded pool (target, draft), the launch tag that saw it first and its fail "
            "reasons.",
        )
        self._verified = _RunningTotal(
            Counter(
                name=VERIFIED_SLOTS,
                labelnames=names,
                documentation="KV slot checks made by the canary's verify launches (forward reads "
                "and the radix sweep).",
            ).labels(**self.labels)
        )
        self._protected = Gauge(
            name=PROTECTED_TOKENS,
            labelnames=names,
            multiprocess_mode="mostrecent",
            documentation="Full-attention KV slots in use (running requests and the radix "
            "cache), each guarded by a canary record.",
        ).labels(**self.labels)
        self._sweeps = _RunningTotal(
            Counter(
                name=SWEEP_PASSES,
                labelnames=names,
                documentation="Radix-cache sweep passes of the KV canary.",
            ).labels(**self.labels)
        )
        self._dropped = Counter(
            name=DROPPED_VIOLATIONS,
            labelnames=names,
            documentation="KV-canary violation rows past the ring's per-step capacity "
            "(counted, not detailed).",
        ).labels(**self.labels)
        self._aborted = Counter(
            name=ABORTED_REQUESTS,
            labelnames=names,
            documentation="Requests aborted by --kv-canary abort (and by heal, past "
            "SGLANG_KV_CANARY_MAX_HEALS heals of one request).",
        ).labels(**self.labels)
        self._healed = Counter(
            name=HEALED_REQUESTS,
            labelnames=names,
            documentation="Requests --kv-canary heal took back to compute again from their "
            "tokens (a request healed twice counts twice).",
        ).labels(**self.labels)
        self._heal_seconds = Histogram(
            name=HEAL_SECONDS,
            labelnames=names,
            buckets=HEAL_SECONDS_BUCKETS,
            documentation="Seconds from a request's take-back by --kv-canary heal to its next "
            "token (its KV computed again from its tokens): what a heal adds to the request's "
            "latency; one observation per interruption (a request taken back again before "
            "that token counts once).",
        ).labels(**self.labels)
        self._retired = Gauge(
            name=RETIRED_SLOTS,
            labelnames=names,
            multiprocess_mode="mostrecent",
            documentation="KV slots --kv-canary heal retired (found corrupt again after their "
            "corrupt content was freed: never handed out again).",
        ).labels(**self.labels)
        self._held_back = _RunningTotal(
            Counter(
                name=HELD_BACK_SLOTS,
                labelnames=names,
                documentation="KV slots --kv-canary abort kept an aborted request's release from "
                "freeing (its corrupt req_to_token row named another holder's "
                "slots).",
            ).labels(**self.labels)
        )
        self._reclaimed = _RunningTotal(
            Counter(
                name=RECLAIMED_SLOTS,
                labelnames=names,
                documentation="KV slots --kv-canary abort freed for an aborted request whose "
                "corrupt req_to_token row no longer named them.",
            ).labels(**self.labels)
        )
        self._memory = Gauge(
            name=MEMORY_BYTES,
            labelnames=names + ["pool", "memory", "part"],
            multiprocess_mode="mostrecent",
            documentation="Bytes the KV canary holds for the server's life, by guarded pool "
            "(target, draft), memory (device: the GPU's; host: pinned) and part "
            "(docs/user_guide.md, \"Memory\").",
        )
        self._sets_protected = True

    def sibling(self) -> "CanaryMetrics":
        """The same series for a second canary of the scheduler (an EAGLE draft pool's): its
        violations, checks and sweeps add to these counters (they are one server's); the
        protected-tokens gauge stays the first canary's (the pools share their slots)."""
        twin = object.__new__(CanaryMetrics)
        twin.__dict__.update(self.__dict__)
        for name in ("_verified", "_sweeps", "_held_back", "_reclaimed"):  # own totals
            setattr(twin, name, _RunningTotal(getattr(self, name).counter))
        twin._sets_protected = False
        return twin

    def set_memory(self, memory: CanaryMemory, *, draft: bool) -> None:
        """The canary's bytes by part (start-up; again when HiCache's host mirror is
        attached)."""
        pool = "draft" if draft else "target"
        for where, parts in (("device", memory.device), ("host", memory.host)):
            for part, n in parts:
                self._memory.labels(**self.labels, pool=pool, memory=where, part=part.value).set(n)

    def on_incidents(
        self, incidents: Sequence[ViolationIncident], *, dropped: int, pool: str
    ) -> None:
        """One increment per reported line, labelled as the line is and by its ``pool``
        (``target``, or ``draft``: a speculative draft model's)."""
        for inc in incidents:
            self._violations.labels(
                **self.labels,
                pool=pool,
                launch_tag=inc.record.tag_name,
                fail_reason=FailReason.describe(inc.fail_bits),
            ).inc()
        if dropped:
            self._dropped.inc(dropped)

    def on_aborted(self, count: int) -> None:
        if count:
            self._aborted.inc(count)

    def set_retired(self, slots: int) -> None:
        self._retired.set(slots)

    def on_healed(self, count: int) -> None:
        if count:
            self._healed.inc(count)

    def on_heal_seconds(self, seconds: Sequence[float]) -> None:
        """Heal mode: each healed request's time from its take-back to its next token."""
        for value in seconds:
            self._heal_seconds.observe(value)

    def on_release_guard(self, *, held_back_slots: int, reclaimed_slots: int) -> None:
        """The release guard's running totals."""
        self._held_back.to(held_back_slots)
        self._reclaimed.to(reclaimed_slots)

    def on_step(self, *, verified_slots: int, sweep_passes: int, protected_tokens: int) -> None:
        """Running totals as the canary counts them."""
        self._verified.to(verified_slots)
        self._sweeps.to(sweep_passes)
        if self._sets_protected:
            self._protected.set(protected_tokens)
