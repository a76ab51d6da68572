"""EAGLE speculative decoding (spec v1 and v2, ``topk`` 1) on real sglang 0.5.12 pools and
ForwardBatch objects (:mod:`eagle_driver`): the target and the draft pools both guarded,
clean rounds clean, faults in either pool caught by that pool's canary, two historical
sglang bugs re-introduced at the unit level, and the plugin's speculative hooks wired as
sglang applies them. sglang 0.5.12's CPU engine cannot run EAGLE (docs/user_guide.md,
"Speculative decoding"); the served end-to-end tests are ``test_e2e_speculative_gpu.py``."""

from __future__ import annotations

import contextlib
import logging
import sys

import pytest
import torch

from eagle_driver import STANDALONE_DRAFT, EagleDriver, tiny_mha_pool
from plugin_hooks_support import registered_hook
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=35, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


def _lines(exc) -> list:
    lines = parse_violation_lines(str(exc.value))
    assert lines, str(exc.value)
    return lines


# ---- clean --------------------------------------------------------------------------------


@pytest.mark.parametrize("v2", [False, True], ids=["spec_v1", "spec_v2"])
@pytest.mark.parametrize("steps", [1, 3])
def test_eagle_rounds_run_clean_with_token_checks(v2, steps, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        d = EagleDriver(steps=steps, v2=v2, seed=2, verify_tokens=True)
        d.run(45)
    # nothing to warn about either (a draft round of one step builds a batch it never runs:
    # its token snapshot must not be taken, or the uploads fall out of order)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert d.target.count_violations() == 0
    assert d.draft.count_violations() == 0
    # the workload covered what it claims to
    assert d.rounds >= 10 and d.accepted >= 10 and d.rejected >= 10
    assert d.chunked >= 3, "no chunked prefill"
    assert len(d.finished) >= 5
    for manager in (d.target, d.draft):
        counters = manager.state.slot_run_counters
        assert int(counters[CanaryLaunchTag.HEAD_K_FULL]) > 500
    # every draft forward of a round used its own single-forward manager
    assert len(d.draft.sfms) == max(1, steps - 1)
    assert d.draft.draft_forwards_per_round == steps - 1


def test_the_draft_pool_needs_the_token_offset(monkeypatch):
    """The draft model's KV at position p was computed from token p + 1: with the target's
    offset (0) the draft pool's token checks fail on a clean run, so offset 1 is what makes
    them agree."""
    d = EagleDriver(steps=3, seed=4, mode="raise", verify_tokens=True)
    from sglang.srt.kv_canary.builder import build_canary
    from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
    from sglang.srt.kv_canary.ranks import RankFacts

    pool = tiny_mha_pool(1024)
    d.draft_pool = pool
    # the draft's canary as the builder makes it, with the target's offset
    monkeypatch.setattr(RankFacts, "kv_token_id_vs_position_offset", property(lambda self: 0))
    d.draft = build_canary(
        pool=pool,
        req_to_token=d.req_to_token_pool.req_to_token,
        config=d.config,
        device="cpu",
        capacity_inputs=CanaryCapacityInputs(context_len=256, chunked_prefill_size=24),
        ranks=RankFacts(draft=True, draft_steps=3),
    )
    assert [g.kv_token_id_vs_position_offset for g in d.draft.groups] == [0]
    d.draft.mark_init_finished()
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.run(30)
    assert {r for v in _lines(exc) for r in v.fail_reasons} == {"verify_token"}


# ---- faults in either pool -----------------------------------------------------------------


@pytest.mark.parametrize("which", ["draft", "target"])
def test_a_flipped_byte_is_caught_by_its_pool_canary(which):
    d = EagleDriver(steps=3, seed=6, mode="raise", verify_tokens=True)
    d.run(30)
    d.step_until_committed()
    pool = d.draft_pool if which == "draft" else d.target_pool
    info = d.flip_byte(pool)
    manager = d.draft if which == "draft" else d.target
    other = d.target if which == "draft" else d.draft
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        for _ in range(10):  # prefills of new arrivals first, then the victim's next round
            d.step()
    lines = _lines(exc)
    assert {(v.slot_idx, v.fail_reasons) for v in lines} == {
        (info["slot"], ("verify_real_kv_hash",))
    }
    assert manager.violations.total >= 1 and other.violations.total == 0
    # the report says which pool (a server with EAGLE has two canaries)
    named = "in the EAGLE draft model's KV pool" in str(exc.value)
    assert named == (which == "draft"), str(exc.value)[:300]


def test_a_req_to_token_fault_is_caught_in_the_draft_round():
    """The pools share ``req_to_token``: the first forward reading the corrupt entry is the
    next draft round's, so the draft canary names it (chain / position)."""
    d = EagleDriver(steps=3, seed=8, mode="raise", verify_tokens=True)
    d.run(30)
    while not any(r.prefilled and r.kv_len >= 4 for r in d.running) or any(
        not r.prefilled for r in d.running
    ):
        d.step()
    info = d.swap_req_to_token()
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.step()
    lines = _lines(exc)
    assert info["new_slot"] in {v.slot_idx for v in lines}
    assert {r for v in lines for r in v.fail_reasons} & {"verify_chain_hash", "verify_position"}
    assert d.draft.violations.total >= 1


# ---- STANDALONE: a separate draft LM of its own shape, single-token radix keys --------------

STANDALONE_CANARY = dict(real_data_layers="all")


@pytest.mark.parametrize("v2", [False, True], ids=["spec_v1", "spec_v2"])
def test_a_standalone_draft_of_another_shape_runs_clean(v2, caplog):
    """STANDALONE runs EAGLE's forwards with a draft LM of its own shape (3 layers, 1 KV head
    of 16, float16, against the target's 2 layers, 2 KV heads of 8, bfloat16): raise mode,
    every byte fingerprinted, per-layer columns, token checks: clean, the draft pool at
    offset 1 with a column per layer half; a byte flipped in the draft's last layer is caught
    at that layer."""
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        d = EagleDriver(
            steps=3,
            v2=v2,
            seed=2,
            real_data="all",
            verify_tokens=True,
            draft_pool=STANDALONE_DRAFT,
            canary_settings=STANDALONE_CANARY,
        )
        d.run(45)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert d.target.count_violations() == 0 and d.draft.count_violations() == 0
    assert d.rounds >= 10 and d.accepted >= 10 and d.rejected >= 10 and d.chunked >= 3
    assert (d.draft_pool.layer_num, d.draft_pool.head_num, d.draft_pool.head_dim) == (3, 1, 16)
    assert d.draft_pool.k_buffer[0].dtype == torch.float16
    assert [g.kv_token_id_vs_position_offset for g in d.draft.groups] == [1]
    assert [g.kv_token_id_vs_position_offset for g in d.target.groups] == [0]
    while not any(r.prefilled and r.kv_len >= 4 for r in d.running):
        d.run(1)
    info = d.flip_byte(d.draft_pool, layer=2)
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        for _ in range(10):
            d.step()
    lines = _lines(exc)
    assert {(v.slot_idx, v.fail_reasons) for v in lines} == {
        (info["slot"], ("verify_real_kv_hash",))
    }
    assert {v.kv_layer for v in lines} == {2}
    assert d.target.violations.total == 0


# ---- every speculative forward mode verifies and writes its own slots ----------------------
#
# A fault is caught by whichever later forward reads the slot, so a workload's detections alone
# do not show that a given mode checks anything: a draft extend that verified nothing would
# leave the next draft round to catch its faults. These tests pin each mode down: a fault
# planted just before a forward of that mode, in a committed slot of a request of its batch,
# must be reported by that very forward; and after every forward of that mode, each slot it
# wrote must hold a record of the token and position it wrote.

_SPEC_MODES = {  # label: (spec v2, the pool the forward reads and writes)
    "target_verify": (False, "target"),
    "draft_decode": (False, "draft"),
    "draft_extend": (False, "draft"),
    "draft_extend_v2": (True, "draft"),
}


def _forward_label(manager_is_draft: bool, mode) -> str:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return {
        (False, ForwardMode.TARGET_VERIFY): "target_verify",
        (True, ForwardMode.DRAFT_EXTEND): "draft_extend",
        (True, ForwardMode.DRAFT_EXTEND_V2): "draft_extend_v2",
        (True, ForwardMode.DECODE): "draft_decode",
    }.get((manager_is_draft, mode), "prefill")


class _ForwardWatch:
    """Wraps an :class:`EagleDriver`'s forwards (eager ones and the draft round's) to call
    ``before(label, fb)`` / ``after(label, fb)`` around each and to remember the label of a
    forward an exception left."""

    def __init__(self, d: EagleDriver, before=None, after=None):
        self.raised_in = None
        eager, around = d._eager, d.around_forward

        def run(label, fb, body):
            if before is not None:
                before(label, fb)
            try:
                body()
            except BaseException:
                self.raised_in = label
                raise
            if after is not None:
                after(label, fb)

        d._eager = lambda manager, pool, fb: run(
            _forward_label(manager is d.draft, fb.forward_mode),
            fb,
            lambda: eager(manager, pool, fb),
        )
        d.around_forward = lambda fb, body: run("draft_decode", fb, lambda: around(fb, body))


@pytest.mark.parametrize("label", sorted(_SPEC_MODES))
def test_each_speculative_forward_mode_verifies_what_it_reads(label):
    v2, which = _SPEC_MODES[label]
    d = EagleDriver(steps=3, v2=v2, seed=11, mode="raise", verify_tokens=True)
    d.run(20)
    planted = {}

    def before(lab, fb):
        if lab != label or planted:
            return
        pool = d.target_pool if which == "target" else d.draft_pool
        rows = fb.req_pool_indices.tolist()
        per_req = fb.out_cache_loc.shape[0] // len(rows)
        for i, row in enumerate(rows):
            # this forward reads the request's committed prefix [0, L)
            prefix = (
                int(fb.extend_prefix_lens[i])
                if lab.startswith("draft_extend")
                else int(fb.positions[per_req * i])
            )
            if prefix >= 3:
                p = d.rng.randrange(0, prefix - 1)
                slot = int(d.req_to_token_pool.req_to_token[row, p])
                pool.k_buffer[0][slot].view(torch.uint8).view(-1)[0] ^= 0xFF
                planted.update(row=row, position=p, slot=slot)
                return

    watch = _ForwardWatch(d, before=before)
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        for _ in range(40):
            d.step()
    assert "slot" in planted, "no forward of this mode had a request with a committed prefix"
    # reported by the forward the fault was planted for, not by a later reader
    assert watch.raised_in == label
    assert planted["slot"] in {v.slot_idx for v in _lines(exc)}
    manager = d.target if which == "target" else d.draft
    assert manager.violations.total >= 1


@pytest.mark.parametrize("label", sorted(_SPEC_MODES))
def test_each_speculative_forward_mode_writes_the_records_of_its_slots(label):
    from sglang.jit_kernel.kv_canary.consts import CANARY_FIELD_POSITION, CANARY_FIELD_TOKEN

    v2, which = _SPEC_MODES[label]
    d = EagleDriver(steps=3, v2=v2, seed=12, mode="raise", verify_tokens=True)
    manager = d.target if which == "target" else d.draft
    group = manager.groups[0]
    checked, wrong = [], []

    def after(lab, fb):
        if lab != label:
            return
        n = fb.out_cache_loc.shape[0]
        slots = fb.out_cache_loc.reshape(-1)[:n].long()
        want = torch.stack([fb.input_ids[:n].long(), fb.positions[:n].long()], dim=1)
        for name in ("k_head", "k_tail"):
            words = getattr(group, name).view(torch.int64)[slots]
            got = words[:, [CANARY_FIELD_TOKEN, CANARY_FIELD_POSITION]]
            wrong.extend((name, int(s)) for s, ok in zip(slots, (got == want).all(dim=1)) if not ok)
        checked.append(n)

    _ForwardWatch(d, after=after)
    d.run(60)
    assert len(checked) >= 10 and sum(checked) >= 30, checked
    assert wrong == []
    assert d.target.count_violations() == 0 and d.draft.count_violations() == 0


# ---- historical sglang bugs, re-introduced at the unit level -------------------------------


@pytest.mark.parametrize("v2", [False, True], ids=["spec_v1", "spec_v2"])
def test_pr25015_draft_positions_advanced_before_the_forward(v2):
    """Upstream PR 25015: the draft round advanced positions before each draft forward, so
    draft token i was written at position L + i + 1. The draft canary reports the stored
    position; the same workload without the bug is clean (the test above)."""
    d = EagleDriver(steps=3, v2=v2, seed=10, mode="raise", bug_positions_before_forward=True)
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.run(40)
    reasons = {r for v in _lines(exc) for r in v.fail_reasons}
    assert reasons & {"verify_position", "write_position"}, reasons
    assert d.target.violations.total == 0 and d.draft.violations.total >= 1


@pytest.mark.parametrize("v2", [False, True], ids=["spec_v1", "spec_v2"])
def test_pr26329_chunk_end_draft_input_uses_the_sampled_token(v2):
    """Upstream PRs 26329 / 26800: at a non-final prefill chunk's end the draft input took
    the target's sampled token instead of the next prompt token, so the draft KV of the
    chunk's last position was computed from the wrong token. The draft canary's token check
    reports it when the next chunk reads that position."""
    d = EagleDriver(
        steps=3,
        v2=v2,
        seed=12,
        mode="raise",
        verify_tokens=True,
        bug_chunk_end_uses_sampled_token=True,
    )
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.run(40)
    lines = _lines(exc)
    assert {r for v in lines for r in v.fail_reasons} == {"verify_token"}
    assert all(v.position % d.chunk == d.chunk - 1 for v in lines), [v.position for v in lines]
    assert d.target.violations.total == 0


# ---- the draft-round API -------------------------------------------------------------------


def test_a_draft_round_refuses_more_forwards_than_it_was_sized_for():
    d = EagleDriver(steps=2, seed=1)
    d.run(8)
    while any(not r.prefilled for r in d.running) or not d.running:
        d.step()
    real = d.around_forward
    calls = []

    def twice(fb, body):  # a round that runs one forward more than steps - 1
        calls.append(1)
        real(fb, body)
        if len(calls) == 1:
            real(fb, body)

    d.around_forward = twice
    with pytest.raises(RuntimeError, match=r"more than its 1 draft forwards \(the worker's"):
        d.step()


def test_draft_forwards_outside_a_round_and_nested_rounds_are_refused():
    d = EagleDriver(steps=3, seed=1)
    fb = object()
    with pytest.raises(RuntimeError, match="outside an EAGLE draft round"):
        with d.draft.with_draft_forward(fb):
            pass
    with d.draft.with_draft_round(2):
        with pytest.raises(RuntimeError, match="inside another one"):
            with d.draft.with_draft_round(2):
                pass
    assert not d.draft.in_draft_round


# ---- the plugin's hooks, as sglang applies them ----------------------------------------------


class _DraftWorkerV2:  # stand-in: spec v2's EagleDraftWorker keeps its runner as draft_runner
    def __init__(self, runner, steps=3):
        self.draft_runner = runner
        self.speculative_num_steps = steps


class _DraftWorkerV1:  # stand-in: spec v1's EAGLEWorker is the draft TpModelWorker
    def __init__(self, runner, steps=3):
        self.model_runner = runner
        self.speculative_num_steps = steps


@pytest.mark.parametrize("v2", [False, True], ids=["spec_v1", "spec_v2"])
def test_draft_rounds_through_the_plugin_hooks(monkeypatch, v2):
    """``draft_forward`` (AROUND) opens the round on the draft runner's canary and each
    ``ModelRunner.forward`` (AROUND) inside it takes the round's next single-forward manager;
    a served-like loop through them is clean and still catches a draft-pool fault."""
    d = EagleDriver(steps=3, v2=v2, seed=14, mode="raise", verify_tokens=True)
    runner = ModelRunner.__new__(ModelRunner)  # sglang's class; __init__ loads a model
    runner.is_draft_worker = True
    seam.set_runner_canary(runner, d.draft)
    worker = _DraftWorkerV2(runner) if v2 else _DraftWorkerV1(runner)
    target = seam.HOOK_EAGLE_V2_DRAFT_FORWARD if v2 else seam.HOOK_EAGLE_V1_DRAFT_FORWARD
    hook, kind = registered_hook(monkeypatch, target)
    draft_forward = _wrap_fn(lambda self, fb, body: body(), hook, HookType[kind])
    hook, kind = registered_hook(monkeypatch, seam.HOOK_MODEL_RUNNER_FORWARD)
    runner_forward = _wrap_fn(lambda self, fb, body: body(), hook, HookType[kind])
    used = []
    real_with_active = d.draft.with_active_single_forward_manager

    def spy(index):
        used.append(index)
        return real_with_active(index)

    monkeypatch.setattr(d.draft, "with_active_single_forward_manager", spy)
    d.around_round = lambda fb, body: draft_forward(worker, fb, body)
    d.around_forward = lambda fb, body: runner_forward(runner, fb, body)
    d.run(40)
    assert d.draft.count_violations() == 0 and d.target.count_violations() == 0
    assert d.rounds >= 5
    assert {0, 1} <= set(used), used  # forward i of a round: single-forward manager i
    d.step_until_committed()
    info = d.flip_byte(d.draft_pool)
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        for _ in range(10):  # prefills of new arrivals first, then the victim's next round
            d.step()
    assert info["slot"] in {v.slot_idx for v in _lines(exc)}


def test_draft_runner_init_leaves_the_chain_check_to_the_worker(monkeypatch):
    """A draft runner's graphs are captured by its EAGLE worker after ``ModelRunner.__init__``:
    its chain-position check turns on after the worker's ``init_cuda_graphs``, not before."""
    d = EagleDriver(steps=3, seed=1)
    flag = d.draft.state.enable_chain_position_assert
    flag.zero_()
    runner = ModelRunner.__new__(ModelRunner)
    runner.is_draft_worker = True
    seam.set_runner_canary(runner, d.draft)
    hook, kind = registered_hook(monkeypatch, seam.HOOK_MODEL_RUNNER_INIT)
    _wrap_fn(lambda self: None, hook, HookType[kind])(runner)
    assert int(flag[0]) == 0
    for target in (seam.HOOK_EAGLE_V1_INIT_CUDA_GRAPHS, seam.HOOK_EAGLE_V2_INIT_CUDA_GRAPHS):
        hook, kind = registered_hook(monkeypatch, target)
        flag.zero_()
        worker = (
            _DraftWorkerV2(runner)
            if target == seam.HOOK_EAGLE_V2_INIT_CUDA_GRAPHS
            else _DraftWorkerV1(runner)
        )
        _wrap_fn(lambda self: None, hook, HookType[kind])(worker)
        assert int(flag[0]) == 1, target


def test_scheduler_draft_runner_is_found_for_both_spec_versions():
    runner = object()

    class Sched:
        pass

    s = Sched()
    assert seam.scheduler_draft_model_runner(s) is None
    s.draft_worker = _DraftWorkerV1(runner)  # spec v1: the EAGLEWorker itself
    assert seam.scheduler_draft_model_runner(s) is runner

    class V2:  # spec v2: EAGLEWorkerV2.draft_worker is the EagleDraftWorker
        draft_worker = _DraftWorkerV2(runner)

    s.draft_worker = V2()
    assert seam.scheduler_draft_model_runner(s) is runner

    class StandaloneDraftWorker(_DraftWorkerV2):  # spec v2: also holds its TpModelWorker
        def __init__(self, runner):
            super().__init__(runner)
            self.draft_worker = _DraftWorkerV1(object())

    class StandaloneV2:  # StandaloneWorkerV2.draft_worker is the StandaloneDraftWorker
        draft_worker = StandaloneDraftWorker(runner)

    s.draft_worker = StandaloneV2()
    assert seam.scheduler_draft_model_runner(s) is runner


def test_perturbation_can_target_the_draft_worker_only():
    from sglang.srt.kv_canary.perturb.config import PerturbConfig
    from sglang.srt.kv_canary.ranks import RankFacts

    cfg = PerturbConfig(req_to_token_prob=1.0, target_worker="draft")
    assert cfg.injects_on(RankFacts(draft=True)) and not cfg.injects_on(RankFacts())
    cfg = PerturbConfig(req_to_token_prob=1.0, target_worker="target")
    assert cfg.injects_on(RankFacts()) and not cfg.injects_on(RankFacts(draft=True))
    both = PerturbConfig(req_to_token_prob=1.0)
    assert both.injects_on(RankFacts()) and both.injects_on(RankFacts(draft=True))
    with pytest.raises(
        ValueError, match="SGLANG_KV_CANARY_PERTURB_TARGET_WORKER must be target or draft"
    ):
        PerturbConfig(req_to_token_prob=1.0, target_worker="both")


@pytest.mark.parametrize("v2", [False, True], ids=["spec_v1", "spec_v2"])
def test_adaptive_rounds_switch_step_counts_through_the_plugin_hooks(monkeypatch, v2):
    """An adaptive worker switches its step count between rounds (sglang's
    ``apply_runtime_state``): the ``draft_forward`` hook opens each round with the worker's
    current count, so rounds of 0 to 6 draft forwards on a canary sized for 7 steps are
    clean, each uses single-forward managers 0 .. count - 1, and a draft-pool fault after
    the switches is caught. A round longer than the canary's size is refused, naming it."""
    d = EagleDriver(steps=3, max_steps=7, v2=v2, seed=21, mode="raise", verify_tokens=True)
    runner = ModelRunner.__new__(ModelRunner)
    runner.is_draft_worker = True
    seam.set_runner_canary(runner, d.draft)

    lag = {}  # a worker whose count says other than what its round runs: {steps: reported}

    class Worker(_DraftWorkerV2 if v2 else _DraftWorkerV1):
        # the switch sglang makes (apply_runtime_state): the driver's current step count
        speculative_num_steps = property(
            lambda self: lag.get(d.steps, d.steps), lambda self, value: None
        )

    worker = Worker(runner)
    target = seam.HOOK_EAGLE_V2_DRAFT_FORWARD if v2 else seam.HOOK_EAGLE_V1_DRAFT_FORWARD
    hook, kind = registered_hook(monkeypatch, target)
    draft_forward = _wrap_fn(lambda self, fb, body: body(), hook, HookType[kind])
    hook, kind = registered_hook(monkeypatch, seam.HOOK_MODEL_RUNNER_FORWARD)
    runner_forward = _wrap_fn(lambda self, fb, body: body(), hook, HookType[kind])
    used: dict = {}
    real_with_active = d.draft.with_active_single_forward_manager

    def spy(index):
        if d.draft.in_draft_round:  # not the draft extends (manager 0 outside rounds)
            used.setdefault(d.steps, set()).add(index)
        return real_with_active(index)

    monkeypatch.setattr(d.draft, "with_active_single_forward_manager", spy)
    d.around_round = lambda fb, body: draft_forward(worker, fb, body)
    d.around_forward = lambda fb, body: runner_forward(runner, fb, body)
    rounds = 0
    for steps in (3, 7, 1, 4, 7, 2, 1, 5):
        d.steps = steps
        before = d.rounds
        while d.rounds < before + 3:
            d.run(1)
        rounds += d.rounds - before
    assert d.draft.count_violations() == 0 and d.target.count_violations() == 0
    # a one-step round runs no draft forward; otherwise forward i uses manager i
    assert {s: used.get(s, set()) for s in (1, 2, 5, 7)} == {
        1: set(),
        2: {0},
        5: {0, 1, 2, 3},
        7: {0, 1, 2, 3, 4, 5},
    }
    # the round opens with the worker's count: one that runs more forwards is refused
    lag[5] = 2
    d.steps = 5
    with pytest.raises(RuntimeError, match="more than its 1 draft forwards"):
        for _ in range(10):
            d.run(1)
    lag.clear()
    d.steps = 6
    while not any(r.prefilled and r.kv_len >= 4 for r in d.running):
        d.run(1)
    info = d.flip_byte(d.draft_pool)
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        for _ in range(10):
            d.step()
    assert info["slot"] in {v.slot_idx for v in _lines(exc)}
    with pytest.raises(RuntimeError, match="sized for at most 6"):
        with d.draft.with_draft_round(7):
            pass
    assert not d.draft.in_draft_round


def test_a_replayed_draft_round_brackets_its_graph_s_forwards_only(monkeypatch):
    """A draft graph replay brackets the forwards its graph holds (the graph runner's step
    count - 1, fixed at its capture): with adaptive steps, fewer than the canary's size; a
    count beyond the size is refused."""
    d = EagleDriver(steps=3, max_steps=7, seed=3)
    seen = []

    @contextlib.contextmanager
    def outside(sfms, forward_batch, *, replayed):
        seen.append((len(sfms), replayed))
        yield

    monkeypatch.setattr(d.draft, "_outside_graph", outside)
    fb = object()
    for forwards in (2, 6, 0):
        with d.draft.with_replayed_draft_round(fb, forwards):
            pass
    assert seen == [(2, True), (6, True)]  # zero forwards: nothing to bracket
    with pytest.raises(RuntimeError, match="sized for at most 6"):
        with d.draft.with_replayed_draft_round(fb, 7):
            pass


def test_graphs_captured_after_start_up_warm_up_without_the_chain_position_check(monkeypatch):
    """``--speculative-adaptive`` captures each candidate's target-verify, draft and
    draft-extend graphs after the runners' init: sglang's warm-up forwards of those captures
    run dummy batches of arbitrary positions, so through the capture hooks the chain-position
    check is off during the call and on again after it (and stays off for a capture during
    start-up)."""
    d = EagleDriver(steps=3, max_steps=4, seed=2)
    seen = []

    def original(self, *args, **kwargs):  # sglang's capture_one_batch_size: warm-up + capture
        seen.append(int(seam.runner_canary(self.model_runner).state.enable_chain_position_assert))

    runners = {}
    for name, manager in (("target", d.target), ("draft", d.draft)):
        runner = ModelRunner.__new__(ModelRunner)
        runner.is_draft_worker = name == "draft"
        seam.set_runner_canary(runner, manager)
        runners[name] = type("GraphRunner", (), {"model_runner": runner})()
    captures = [
        (seam.HOOK_GRAPH_CAPTURE_ONE_BATCH_SIZE, "target"),
        (seam.HOOK_DRAFT_EXTEND_GRAPH_CAPTURE_ONE_BATCH_SIZE, "draft"),
        (seam.HOOK_DRAFT_GRAPH_CAPTURE_ONE_BATCH_SIZE, "draft"),
    ]
    for target, name in captures:
        hook, kind = registered_hook(monkeypatch, target)
        _wrap_fn(original, hook, HookType[kind])(runners[name])
        flag = seam.runner_canary(runners[name].model_runner).state.enable_chain_position_assert
        assert int(flag) == 1, target
    assert seen == [0, 0, 0]
    # during start-up (before mark_init_finished) a capture leaves the check off
    fresh = EagleDriver(steps=3, seed=2)
    fresh.target.state.enable_chain_position_assert.zero_()
    fresh.target._init_finished = False
    with fresh.target.graph_capture_setup():
        pass
    assert int(fresh.target.state.enable_chain_position_assert) == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
