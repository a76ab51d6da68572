"""What a violation in a speculative draft model's KV pool does (docs/user_guide.md,
"Speculative decoding", "Draft-pool reports"): with ``SGLANG_KV_CANARY_DRAFT_VIOLATIONS``
``report`` (the default) it is logged, counted (the metrics' ``pool="draft"``, ``/server_info``'s
live ``kv_canary``) and never raises or aborts; with ``act`` it is handled as a target pool's.
On real sglang 0.5.12 pools and ForwardBatch objects (:mod:`eagle_driver`), with
sglang's ``RadixCache`` for STANDALONE's single-token keys."""

from __future__ import annotations

import logging
import sys

import pytest

from e2e_checks import pool_reports
from eagle_driver import STANDALONE_DRAFT, EagleDriver
from plugin_hooks_support import (
    SchedulerStandIn,
    TpWorkerStandIn,
    as_sglang_applies,
    model_runner_with,
)
from serving_driver import VOCAB
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.violations.metrics import CanaryMetrics
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")

NOT_ACTED_ON = "Not acted on (--kv-canary raise)"


def _committed(d: EagleDriver) -> None:
    d.run(30)
    d.step_until_committed()


def _messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("draft_violations", ["report", "act"])
def test_a_draft_pool_fault_under_raise_is_logged_and_counted_unless_act(draft_violations, caplog):
    """A flipped byte in the draft pool, ``--kv-canary raise``: with ``report`` the draft
    canary logs the line (its pool named, the reason it is not acted on) and counts it, and
    serving goes on to finish every request; with ``act`` the server stops on it."""
    d = EagleDriver(steps=3, seed=6, mode="raise", draft_violations=draft_violations)
    _committed(d)
    info = d.flip_byte(d.draft_pool)
    if draft_violations == "act":
        with pytest.raises(RuntimeError, match="in the EAGLE draft model's KV pool") as exc:
            for _ in range(10):
                d.step()
        assert NOT_ACTED_ON not in str(exc.value)
        assert d.draft.reporter.counts()["acting_mode"] == "raise"
        return
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        for _ in range(10):
            d.step()
        finished = len(d.finished)
        d.run(40, arrivals=0)
    text = _messages(caplog)
    lines = parse_violation_lines(text)
    assert {(v.slot_idx, v.fail_reasons) for v in lines} == {
        (info["slot"], ("verify_real_kv_hash",))
    }
    assert "Pool: the EAGLE draft model's KV pool" in text and NOT_ACTED_ON in text, text
    assert "SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act" in text
    counts = d.draft.reporter.counts()
    assert counts["violations"] == len(lines) and counts["acting_mode"] == "log", counts
    assert d.target.reporter.counts() == {
        "violations": 0,
        "dropped_violations": 0,
        "aborted_requests": 0,
        "healed_requests": 0,
        "retired_slots": 0,
        "acting_mode": "raise",
    }
    assert len(d.finished) > finished and not d.running and not d.waiting


def test_a_target_pool_fault_still_stops_a_raise_server_that_reports_draft_faults():
    d = EagleDriver(steps=3, seed=6, mode="raise", draft_violations="report")
    _committed(d)
    info = d.flip_byte(d.target_pool)
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        for _ in range(10):
            d.step()
    assert "draft model's KV pool" not in str(exc.value)
    assert {v.slot_idx for v in parse_violation_lines(str(exc.value))} == {info["slot"]}


def test_a_req_to_token_fault_the_draft_round_reads_first_still_stops_the_server(caplog):
    """The pools share ``req_to_token``: the next draft round reads a corrupt entry first
    (logged, not acted on), and the target's verify in the same round reads it too: the
    server stops on the target's report."""
    d = EagleDriver(steps=3, seed=8, mode="raise", draft_violations="report")
    d.run(30)
    while not any(r.prefilled and r.kv_len >= 4 for r in d.running) or any(
        not r.prefilled for r in d.running
    ):
        d.step()
    info = d.swap_req_to_token()
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
            d.step()
    assert "draft model's KV pool" not in str(exc.value).split("\n")[0]
    assert info["new_slot"] in {v.slot_idx for v in parse_violation_lines(str(exc.value))}
    drafted = parse_violation_lines(_messages(caplog))
    assert info["new_slot"] in {v.slot_idx for v in drafted} and NOT_ACTED_ON in _messages(caplog)
    assert d.draft.violations.total >= 1 and d.target.violations.total >= 1


@pytest.mark.parametrize("draft_violations", ["report", "act"])
def test_abort_mode_contains_draft_faults_only_when_told_to(draft_violations):
    """``--kv-canary abort``: the target canary always contains (aborts, evicts); the draft
    canary only with ``act`` (with ``report`` it has no containment to run)."""
    d = EagleDriver(steps=3, seed=6, mode="abort", draft_violations=draft_violations)
    assert d.target.reporter.containment is not None
    assert (d.draft.reporter.containment is not None) == (draft_violations == "act")
    assert d.draft.reporter.mode.value == ("abort" if draft_violations == "act" else "log")


def test_the_metrics_label_each_violation_with_its_pool():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    d = EagleDriver(steps=3, seed=6, mode="log")
    target = CanaryMetrics({"tp_rank": 0}, registry=registry)
    d.target.reporter.metrics, d.draft.reporter.metrics = target, target.sibling()
    _committed(d)
    d.flip_byte(d.draft_pool)
    for _ in range(10):
        d.step()
    d.flip_byte(d.target_pool)
    for _ in range(10):
        d.step()

    def total(pool):
        return sum(
            s.value
            for m in registry.collect()
            if m.name == "sglang:kv_canary_violations"
            for s in m.samples
            if s.name.endswith("_total") and s.labels.get("pool") == pool
        )

    assert total("draft") == d.draft.reporter.counts()["violations"] >= 1
    assert total("target") == d.target.reporter.counts()["violations"] >= 1


def test_server_info_internal_state_has_each_pools_live_counts(monkeypatch):
    """``/server_info``'s ``internal_states``: the scheduler's ``get_internal_state`` as sglang
    applies the plugin's hook gets ``kv_canary``, each guarded pool's counts at the call."""

    class _Output:  # stand-in: sglang's GetInternalStateReqOutput
        def __init__(self):
            self.internal_state = {"last_gen_throughput": 0.0}

    d = EagleDriver(steps=3, seed=6, mode="raise", draft_violations="report")
    scheduler = SchedulerStandIn(
        model_runner_with(d.target),
        None,
        draft_worker=TpWorkerStandIn(model_runner_with(d.draft)),
    )
    get = as_sglang_applies(
        monkeypatch, seam.HOOK_SCHEDULER_GET_INTERNAL_STATE, lambda self, req: _Output()
    )
    before = get(scheduler, None).internal_state["kv_canary"]
    assert before["draft"]["violations"] == 0 and before["draft"]["acting_mode"] == "log"
    _committed(d)
    d.flip_byte(d.draft_pool)
    for _ in range(10):
        d.step()
    state = get(scheduler, None).internal_state
    assert state["last_gen_throughput"] == 0.0
    assert state["kv_canary"]["draft"] == d.draft.reporter.counts()
    assert state["kv_canary"]["draft"]["violations"] >= 1
    assert state["kv_canary"]["target"]["violations"] == 0
    assert state["kv_canary"]["target"]["acting_mode"] == "raise"
    off = SchedulerStandIn(model_runner_with(None), None)
    assert "kv_canary" not in get(off, None).internal_state


# ---- STANDALONE's single-token radix keys -----------------------------------------------------


SHARED = 12  # prompt tokens two requests share before they differ


def _divergent_pair(d: EagleDriver, *, together: bool):
    """Two 20-token prompts equal on ``[0, SHARED)`` and different at ``SHARED``: served in
    one prefill batch (``together``: the second one's prompt is swapped to the first one's
    slots by the tree insert after the prefill), or the second after the first finished (a
    prefix hit at admission)."""
    first = [(7 * i + 3) % VOCAB for i in range(20)]
    second = first[:SHARED] + [(first[SHARED] + 1) % VOCAB] + [(11 * i) % VOCAB for i in range(7)]
    a = d.add_request(0, 6, prompt=first)
    if not together:
        while a not in d.finished:
            d.step()
    b = d.add_request(0, 6, prompt=second)
    while a not in d.finished or b not in d.finished:
        d.step()
    assert b.shared_prefix >= SHARED - 1


@pytest.mark.parametrize("v2", [False, True], ids=["spec_v1", "spec_v2"])
@pytest.mark.parametrize("together", [True, False], ids=["one_batch", "prefix_hit"])
@pytest.mark.parametrize("verify_tokens", [True, False], ids=["tokens", "no_tokens"])
def test_single_token_radix_keys_report_every_divergent_shared_prefix(
    v2, together, verify_tokens, caplog
):
    """sglang 0.5.12 keys STANDALONE's radix cache by single tokens (``is_eagle`` False):
    a request sharing m prompt tokens with another and differing at m gets the other's draft
    slot of position m - 1, whose KV was computed from the other's token m. The draft canary
    reports it, nothing in the target pool: ``verify_token`` at m - 1 with token checks, and
    when the tree insert after a shared prefill batch swaps the request's own slots for the
    other's, ``verify_chain_hash`` at m (its own record at m chained from its own m - 1). With
    EAGLE's pair keys (``is_eagle`` True) the match stops at m - 1: clean. Under
    ``--kv-canary raise`` (draft reports not acted on, the default) both requests finish."""
    expected = set()
    if verify_tokens:
        expected.add(("draft", "verify_token", SHARED - 1))
    if together:
        expected.add(("draft", "verify_chain_hash", SHARED))
    for is_eagle, want in ((False, expected), (True, set())):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
            d = EagleDriver(
                steps=3,
                v2=v2,
                seed=5,
                mode="raise",
                verify_tokens=verify_tokens,
                draft_violations="report",
                draft_pool=STANDALONE_DRAFT,
                radix_is_eagle=is_eagle,
            )
            _divergent_pair(d, together=together)
        assert pool_reports(_messages(caplog)) == want, is_eagle
        assert (NOT_ACTED_ON in _messages(caplog)) == bool(want)
        assert d.target.count_violations() == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
