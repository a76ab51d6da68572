"""Each speculative forward mode (topk 1) verifies what it reads and writes what it stores,
on real sglang 0.5.12 pools and ForwardBatch objects (:mod:`eagle_driver`).

The modes: the target model's ``TARGET_VERIFY``, the draft model's ``DRAFT_EXTEND`` (spec
v1) and ``DRAFT_EXTEND_V2`` (spec v2), and the draft round's ``DECODE`` forwards on the draft
worker. A fault in a slot is caught by whichever later forward reads it, so a workload's
detections alone cannot tell that a given mode checks anything. Here, per mode:

- a fault planted just before one forward of that mode, in a committed slot (or the
  ``req_to_token`` entry) one of its requests reads, is reported by that very forward (its
  step), by the launch of the phase that reads the corrupted buffer (HEAD: the chain-only
  records; TAIL: the fingerprinted records and the KV bytes), at the planted slot, position
  and ``req_to_token`` row, naming the request;
- after every forward of that mode, each slot it wrote holds the full record of what it
  wrote (token, position, the hash of its predecessor's record, the KV fingerprint), and
  enough of those slots held something else before that forward for a skipped write to show.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from eagle_driver import EagleDriver
from sglang.jit_kernel.kv_canary._hash_torch import (
    CHAIN_HEAD_HASH_I64,
    real_kv_fingerprint_t,
    record_hash_t,
)
from sglang.jit_kernel.kv_canary.consts import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
)
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag, CanaryPhase
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")

HEAD, TAIL = CanaryLaunchTag.HEAD_K_FULL.name, CanaryLaunchTag.TAIL_K_FULL.name


@dataclasses.dataclass(frozen=True)
class SpecMode:
    v2: bool  # the driver's speculative version
    draft: bool  # the forward runs on the draft worker (its pool and canary)
    forward_mode: ForwardMode


MODES = {
    "target_verify": SpecMode(False, False, ForwardMode.TARGET_VERIFY),
    "draft_decode": SpecMode(False, True, ForwardMode.DECODE),
    "draft_extend": SpecMode(False, True, ForwardMode.DRAFT_EXTEND),
    "draft_extend_v2": SpecMode(True, True, ForwardMode.DRAFT_EXTEND_V2),
}


def _driver(label: str, seed: int) -> EagleDriver:
    return EagleDriver(steps=3, v2=MODES[label].v2, seed=seed, mode="raise", verify_tokens=True)


def _canary_and_pool(d: EagleDriver, label: str):
    return (d.draft, d.draft_pool) if MODES[label].draft else (d.target, d.target_pool)


class ModeForwards:
    """Calls ``before(fb)`` / ``after(fb)`` around each forward of mode ``label`` an
    :class:`EagleDriver` runs (its eager forwards and the draft round's), and remembers the
    mode of the forward an exception left (``raised_in``; ``"prefill"`` for an ``EXTEND``)."""

    def __init__(self, d: EagleDriver, label: str, *, before=None, after=None):
        self.raised_in = None
        mode = MODES[label]
        eager, around = d._eager, d.around_forward

        def run(draft: bool, fb, body):
            this = (draft, fb.forward_mode) == (mode.draft, mode.forward_mode)
            if this and before is not None:
                before(fb)
            try:
                body()
            except BaseException:
                self.raised_in = next(
                    (
                        k
                        for k, m in MODES.items()
                        if (m.draft, m.forward_mode) == (draft, fb.forward_mode)
                    ),
                    "prefill",
                )
                raise
            if this and after is not None:
                after(fb)

        d._eager = lambda canary, pool, fb: run(
            canary is d.draft, fb, lambda: eager(canary, pool, fb)
        )
        d.around_forward = lambda fb, body: run(True, fb, lambda: around(fb, body))


def _read_prefix(fb, i: int) -> int:
    """Positions ``[0, prefix)`` of request ``i`` of ``fb`` that the forward reads and does
    not write."""
    if fb.forward_mode.is_extend() and fb.forward_mode != ForwardMode.TARGET_VERIFY:
        return int(fb.extend_prefix_lens[i])
    per_req = fb.out_cache_loc.shape[0] // fb.req_pool_indices.shape[0]
    return int(fb.positions[per_req * i])


# ---- a fault in what a forward reads is reported by that forward --------------------------

# fault: (the launch tags that report it, the fail reason at the planted slot)
FAULTS = {
    "kv_byte": ({TAIL}, "verify_real_kv_hash"),  # layer 0's K bytes: TAIL fingerprint
    "head_record": ({HEAD}, "verify_position"),  # the chain-only record
    "tail_record": ({TAIL}, "verify_position"),  # the fingerprinted record
    "req_to_token": ({HEAD, TAIL}, "verify_position"),  # the entry points at another slot
}


def _plant(d: EagleDriver, label: str, fault: str, fb) -> dict:
    """Corrupt one committed position a request of ``fb`` reads; {} if none has one."""
    canary, pool = _canary_and_pool(d, label)
    r2t = d.req_to_token_pool.req_to_token
    for i, row in enumerate(fb.req_pool_indices.tolist()):
        prefix = _read_prefix(fb, i)
        if prefix < 3:
            continue
        p = d.rng.randrange(1, prefix - 1)  # a predecessor and a successor, both read
        slot = int(r2t[row, p])
        if fault == "kv_byte":
            pool.k_buffer[0][slot].view(torch.uint8).view(-1)[0] ^= 0xFF
        elif fault in ("head_record", "tail_record"):
            buffer = "k_head" if fault == "head_record" else "k_tail"
            words = getattr(canary.groups[0], buffer).view(torch.int64)
            words[slot, CANARY_FIELD_POSITION] ^= 1 << 3
        else:  # the entry names the slot of another position of the same request
            q = d.rng.choice([x for x in range(prefix) if x != p])
            slot = int(r2t[row, q])
            r2t[row, p] = slot
        rid = next(r.rid for r in d.running if r.row == row)
        return {"row": row, "position": p, "slot": slot, "rid": rid, "step": canary.step + 1}
    return {}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("label", sorted(MODES))
def test_a_fault_a_forward_reads_is_reported_by_that_forward(label, fault):
    """Planted just before the first forward of ``label`` whose batch reads a committed
    prefix: that forward raises, at its own step, and only the phase that reads the corrupted
    buffer reports it (at the planted slot, position, row and request)."""
    d = _driver(label, seed=21)
    d.run(12)
    canary, _ = _canary_and_pool(d, label)
    other = d.target if MODES[label].draft else d.draft
    planted = {}

    def before(fb):
        if not planted:
            planted.update(_plant(d, label, fault, fb))

    watch = ModeForwards(d, label, before=before)
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        for _ in range(40):
            d.step()
    assert planted, f"no {label} forward read a committed prefix of 3 positions"
    assert watch.raised_in == label, (watch.raised_in, str(exc.value)[:400])
    lines = parse_violation_lines(str(exc.value))
    tags, reason = FAULTS[fault]
    assert lines and {v.forward_step for v in lines} == {planted["step"]}, lines
    assert {t for v in lines for t in v.seen_by} == tags, lines
    at_slot = [v for v in lines if v.slot_idx == planted["slot"]]
    assert at_slot, (planted, lines)
    for v in at_slot:
        assert reason in v.fail_reasons, v
        assert (v.read_position, v.req_to_token_row) == (planted["position"], planted["row"])
        assert str(planted["rid"]) in v.rids, v
    assert {v.launch_tag for v in at_slot} <= tags
    assert canary.violations.total >= 1 and other.violations.total == 0


# ---- every forward writes the full records of its slots ------------------------------------


def _expected_records(d: EagleDriver, label: str, fb) -> dict:
    """The records ``fb`` must have left in each record buffer of its pool's group, after
    it ran: int64 ``[n, 4]`` per buffer, and the slots ``[n]``."""
    canary, _ = _canary_and_pool(d, label)
    group = canary.groups[0]
    n = fb.out_cache_loc.shape[0]
    slots = fb.out_cache_loc.reshape(-1)[:n].long()
    positions = fb.positions[:n].long()
    r2t = d.req_to_token_pool.req_to_token
    rows = fb.req_pool_indices.tolist()
    preds = []
    for slot, pos in zip(slots.tolist(), positions.tolist()):
        owners = [row for row in rows if int(r2t[row, pos]) == slot]
        assert len(owners) == 1, (label, slot, pos, owners)
        preds.append(int(r2t[owners[0], pos - 1]) if pos > 0 else -1)
    preds = torch.tensor(preds, dtype=torch.int64)
    tail = next(
        ep.context for ep in canary.endpoints if ep.group is group and ep.phase == CanaryPhase.TAIL
    )
    sources = tail.real_kv_sources
    fingerprint = real_kv_fingerprint_t(
        sources, [s.words_to_fold(tail.fingerprint_mode) for s in sources], slots
    )
    want = {}
    for name in ("k_head", "k_tail"):
        words = getattr(group, name).view(torch.int64)
        rec = torch.zeros(n, 4, dtype=torch.int64)
        rec[:, CANARY_FIELD_TOKEN] = fb.input_ids[:n].long()
        rec[:, CANARY_FIELD_POSITION] = positions
        prev = torch.full((n,), CHAIN_HEAD_HASH_I64, dtype=torch.int64)
        has_pred = preds >= 0
        prev[has_pred] = record_hash_t(words[preds[has_pred]])
        rec[:, CANARY_FIELD_PREV_HASH] = prev
        if name == "k_tail":  # HEAD records are chain-only
            rec[:, CANARY_FIELD_REAL_KV_HASH] = fingerprint
        want[name] = rec
    return {"slots": slots, "want": want}


@pytest.mark.parametrize("label", sorted(MODES))
def test_each_forward_leaves_the_full_records_of_the_slots_it_wrote(label):
    """After each forward of ``label``: every slot it wrote holds token, position, its
    predecessor's record hash (HEAD and TAIL) and the KV fingerprint (TAIL), and the whole
    workload reads clean. Slots that held another record before the forward (chain fields,
    and separately the fingerprint) are counted: without this mode's writes they stay wrong."""
    d = _driver(label, seed=22)
    canary, _ = _canary_and_pool(d, label)
    group = canary.groups[0]
    before_words = {}
    forwards = []
    stale = {"chain": 0, "fingerprint": 0}

    def before(fb):
        n = fb.out_cache_loc.shape[0]
        slots = fb.out_cache_loc.reshape(-1)[:n].long()
        for name in ("k_head", "k_tail"):
            before_words[name] = getattr(group, name).view(torch.int64)[slots].clone()

    def after(fb):
        exp = _expected_records(d, label, fb)
        slots = exp["slots"]
        forwards.append(slots.shape[0])
        for name, want in exp["want"].items():
            got = getattr(group, name).view(torch.int64)[slots]
            bad = [s for s, ok in zip(slots.tolist(), (got == want).all(dim=1).tolist()) if not ok]
            # fails here, before a later forward's verify reads the slots
            assert not bad, f"{label} forward {len(forwards)}: {name} records of slots {bad}"
            old = before_words[name]
            stale["chain"] += int((old[:, :3] != want[:, :3]).any(dim=1).sum())
            if name == "k_tail":
                diff = old[:, CANARY_FIELD_REAL_KV_HASH] != want[:, CANARY_FIELD_REAL_KV_HASH]
                stale["fingerprint"] += int(diff.sum())

    ModeForwards(d, label, before=before, after=after)
    d.run(45)
    assert len(forwards) >= 10 and sum(forwards) >= 30, forwards
    # what a forward that skipped its writes would have left in place
    assert stale["chain"] >= 10 and stale["fingerprint"] >= 10, stale
    assert d.target.count_violations() == 0 and d.draft.count_violations() == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
