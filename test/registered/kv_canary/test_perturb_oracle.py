"""Fault injection (``perturb/``) and the token oracle (``token_oracle/``) on real sglang 0.5.12
objects: configuration and its errors, the oracle function and sampler, the expected written
tokens, byte flips, and each runtime-injectable fault detected by the canary in the serving
loop with the reason the fault must cause (docs/subsystems.md, "Self-tests"). The CPU-server detection matrix is in
``test_e2e_detection_matrix.py``."""

from __future__ import annotations

import logging
import random
import sys
import types

import pytest
import torch

from serving_driver import ServingDriver
from sglang.jit_kernel.kv_canary._hash_torch import real_kv_fingerprint_t
from sglang.jit_kernel.kv_canary.consts import FailReason, splitmix64, to_uint64
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag, PoolKind
from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.batch_state import CanaryBatchState, batch_state, batch_state_for
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.demo.cases import CASES_BY_NAME, evaluate, exit_status
from sglang.srt.kv_canary.expected_inputs import ExpectedInputs
from sglang.srt.kv_canary.perturb import (
    FaultKind,
    PerturbConfig,
    format_perturb_line,
    parse_perturb_line,
)
from sglang.srt.kv_canary.perturb.real_kv import flip_first_byte
from sglang.srt.kv_canary.pool_patcher import attach_canary_buffers
from sglang.srt.kv_canary.violations.lines import format_violation_line, parse_violation_lines
from sglang.srt.kv_canary.token_oracle import OracleBatch, oracle_tokens, request_oracle_key
from sglang.srt.kv_canary.token_oracle.expected_tokens import TokenOracleManager
from sglang.srt.kv_canary.token_oracle.sampler import TokenOracleSampler
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")


def _server_args(mode="raise", real_data="partial", sweep=0, sampling_backend="pytorch"):
    return types.SimpleNamespace(
        kv_canary=mode,
        kv_canary_real_data=real_data,
        kv_canary_sweep_interval=sweep,
        sampling_backend=sampling_backend,
    )


# ---- configuration ------------------------------------------------------------------------


def test_perturb_settings_parsed_from_the_environment(monkeypatch):
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS", "7")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB", "0.25")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB", "1")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_GROUP", "SWA")
    config = CanaryConfig.from_server_args(_server_args())
    p = config.perturb
    assert (p.warmup_steps, p.real_kv_used_prob, p.req_to_token_prob) == (7, 0.25, 1.0)
    assert p.target_group == PoolKind.SWA
    assert p.active_faults == (FaultKind.REQ_TO_TOKEN, FaultKind.REAL_KV_USED)
    assert CanaryConfig.from_server_args(_server_args(mode="raise")).perturb.enabled


def test_perturbations_off_by_default(monkeypatch):
    for var in [k.env_var for k in FaultKind] + ["SGLANG_KV_CANARY_PERTURB_TARGET_GROUP"]:
        monkeypatch.delenv(var, raising=False)
    config = CanaryConfig.from_server_args(_server_args())
    assert not config.perturb.enabled and config.perturb.warmup_steps == 50
    assert not config.enable_token_oracle


@pytest.mark.parametrize(
    "env,args,message",
    [
        (
            {"SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB": "1.5"},
            {},
            "SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB",
        ),
        ({"SGLANG_KV_CANARY_PERTURB_NEXT_TOKEN_SWAP_PROB": "-0.1"}, {}, "probability in [0, 1]"),
        ({"SGLANG_KV_CANARY_PERTURB_TARGET_GROUP": "mid"}, {}, "'full', 'swa'"),
        (
            {"SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "-3"},
            {},
            "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS",
        ),
        (
            {"SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.5"},
            {},
            "needs SGLANG_KV_CANARY_PERTURB_TARGET_GROUP=full or swa",
        ),
        (
            {
                "SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB": "1",
                "SGLANG_KV_CANARY_PERTURB_TARGET_GROUP": "full",
            },
            {"real_data": "none"},
            "--kv-canary-real-data partial or all",
        ),
        (
            {
                "SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB": "1",
                "SGLANG_KV_CANARY_PERTURB_TARGET_GROUP": "full",
            },
            {"sweep": 0},
            "--kv-canary-sweep-interval N",
        ),
        (
            {"SGLANG_KV_CANARY_PERTURB_NEXT_TOKEN_SWAP_PROB": "1"},
            {},
            "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE=1",
        ),
        (
            {"SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_KEPT_PROB": "1"},
            {"mode": "log"},
            "SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_KEPT_PROB > 0 leaves a corrupt req_to_token entry "
            "in place, as a server bug would, and only --kv-canary abort or heal contains",
        ),
        (
            {"SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT": "1"},
            {},
            "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT=1 checks written tokens against the token oracle",
        ),
        (
            {},
            {"mode": "none", "real_data": "none", "sampling_backend": "token_oracle"},
            "the token oracle (--sampling-backend token_oracle or",
        ),
    ],
)
def test_bad_perturb_or_oracle_settings_are_refused(monkeypatch, env, args, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as exc:
        CanaryConfig.from_server_args(_server_args(**args))
    assert message in str(exc.value)


@pytest.mark.parametrize(
    "env",
    [
        {"SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB": "1"},
        {"SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE": "1"},
    ],
)
def test_canary_off_ignores_self_test_variables(monkeypatch, env):
    """With the canary off no SGLANG_KV_CANARY_* variable is read (they are named in a
    warning, see test_startup.py): a self-test variable then changes nothing."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config = CanaryConfig.from_server_args(_server_args(mode="none", real_data="none"))
    assert not config.enabled and not config.perturb.enabled
    assert not config.enable_token_oracle


def test_token_oracle_on_from_the_sampling_backend_flag_or_its_recorded_request(monkeypatch):
    monkeypatch.delenv("SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE", raising=False)
    assert CanaryConfig.from_server_args(
        _server_args(sampling_backend="token_oracle")
    ).enable_token_oracle
    # sglang's CPU engine rewrites sampling_backend to pytorch; the plugin records the request
    args = _server_args(sampling_backend="pytorch")
    args.kv_canary_token_oracle_requested = True
    assert CanaryConfig.from_server_args(args).enable_token_oracle
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE", "yes")
    assert CanaryConfig.from_server_args(_server_args()).enable_token_oracle


def test_real_kv_target_group_must_exist_in_the_pool():
    d = ServingDriver(seed=1, mode="raise", real_data="partial")
    with pytest.raises(ValueError, match="TARGET_GROUP=swa but this pool has only full"):
        from sglang.srt.kv_canary.perturb import CanaryPerturber

        CanaryPerturber(
            config=PerturbConfig(real_kv_used_prob=1.0, target_group=PoolKind.SWA),
            groups=d.groups,
            req_to_token=d.req_to_token_pool.req_to_token,
            radix_cache=lambda: None,
        )


# ---- the oracle ---------------------------------------------------------------------------


def test_oracle_tokens_match_the_python_definition():
    rng = random.Random(3)
    keys = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(200)] + [0, -1, (1 << 63) - 1]
    pos = [rng.randrange(0, 1 << 20) for _ in keys]
    for vocab in (1, 3, 512, 151936, (1 << 31) - 1):
        got = oracle_tokens(torch.tensor(keys), torch.tensor(pos), vocab).tolist()
        want = [splitmix64(to_uint64(k ^ p)) % vocab for k, p in zip(keys, pos)]
        assert got == want
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        oracle_tokens(torch.tensor(keys), torch.tensor(pos), 0)


def test_request_keys_are_stable_and_distinct():
    keys = {request_oracle_key(f"req-{i}") for i in range(1000)}
    assert len(keys) == 1000
    assert request_oracle_key("abc") == request_oracle_key("abc")
    assert all(-(1 << 63) <= k < (1 << 63) for k in keys)


def test_oracle_sampler_ignores_logits_and_follows_the_oracle():
    sampler = TokenOracleSampler()
    keys = torch.tensor([request_oracle_key(r) for r in ("a", "b", "c")])
    info = types.SimpleNamespace()
    holder = types.SimpleNamespace(sampling_info=info)  # what the init_new hook attaches to
    sglang_seam.set_sampling_oracle(holder, OracleBatch(keys=keys, vocab_size=512))
    assert sglang_seam.sampling_oracle(info).vocab_size == 512
    logits = types.SimpleNamespace(next_token_logits=torch.randn(3, 512))
    positions = torch.tensor([4, 17, 0])
    out = sampler(logits, info, False, [], [], positions)
    assert out.dtype == torch.int64
    assert out.tolist() == oracle_tokens(keys, positions + 1, 512).tolist()

    swapped = []

    def swap(tokens):
        swapped.append(tokens.tolist())
        tokens[0], tokens[1] = int(tokens[1]), int(tokens[0])

    sglang_seam.set_sampling_oracle(
        holder, OracleBatch(keys=keys, vocab_size=512, after_sample=swap)
    )
    out2 = sampler(logits, info, False, [], [], positions)
    assert out2.tolist() == [out[1], out[0], out[2]] and swapped == [out.tolist()]

    with pytest.raises(RuntimeError, match="does not compute log-probs"):
        sampler(logits, info, True, [0, 0, 0], [], positions)
    with pytest.raises(RuntimeError, match="without oracle keys"):
        sampler(logits, types.SimpleNamespace(), False, [], [], positions)


def test_token_oracle_backend_is_registered_with_sglang():
    from sglang.srt.kv_canary.token_oracle.sampler import register_token_oracle_backend as register
    from sglang.srt.layers import sampler as sampler_mod
    from sglang.srt.server_args import SAMPLING_BACKEND_CHOICES

    register()
    assert "token_oracle" in SAMPLING_BACKEND_CHOICES
    assert sampler_mod._CUSTOM_SAMPLER_FACTORIES["token_oracle"] is TokenOracleSampler
    register()  # idempotent: registering again keeps the one factory, no override warning
    assert sampler_mod._CUSTOM_SAMPLER_FACTORIES["token_oracle"] is TokenOracleSampler


def _batch(mode, rows, prefix, extend, reqs):
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    n = sum(extend)
    seq = [p + e for p, e in zip(prefix, extend)]
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=i64([0] * n),
        req_pool_indices=i64(rows),
        seq_lens=i64(seq),
        out_cache_loc=i64(list(range(1, n + 1))),
        seq_lens_sum=sum(seq),
        positions=i64([p for a, b in zip(prefix, extend) for p in range(a, a + b)]),
    )
    if mode == ForwardMode.EXTEND:
        fb.extend_prefix_lens, fb.extend_seq_lens = i64(prefix), i64(extend)
        fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = list(prefix), list(extend)
    fb.sampling_info = types.SimpleNamespace()
    return fb


def test_expected_written_tokens_are_prompt_then_oracle():
    reqs = [
        types.SimpleNamespace(rid="r0", origin_input_ids=[11, 12, 13, 14, 15]),
        types.SimpleNamespace(rid="r1", origin_input_ids=[21, 22]),
    ]
    mgr = TokenOracleManager(vocab_size=97, device="cpu")
    # r0: chunk at prefix 3 of 4 tokens (2 prompt + 2 generated: a retracted request's
    # re-prefill); r1: chunk at 0 of 2 (its whole prompt)
    fb = _batch(ForwardMode.EXTEND, [5, 2], [3, 0], [4, 2], reqs)
    mgr.attach_batch(fb, batch_state_for(fb), reqs)
    tokens, positions = mgr.expected_inputs(fb)
    k0, k1 = request_oracle_key("r0"), request_oracle_key("r1")
    oracle = lambda k, p: int(oracle_tokens(torch.tensor([k]), torch.tensor([p]), 97))  # noqa: E731
    assert positions.tolist() == [3, 4, 5, 6, 0, 1]
    assert tokens.tolist() == [14, 15, oracle(k0, 5), oracle(k0, 6), 21, 22]
    batch = sglang_seam.sampling_oracle(fb.sampling_info)
    assert batch.keys.tolist() == [k0, k1] and batch.vocab_size == 97
    rows = batch_state(fb).oracle_rows  # the host rows live in the batch's canary state
    assert rows.keys.tolist() == [k0, k1] and rows.prompts == (
        reqs[0].origin_input_ids,
        reqs[1].origin_input_ids,
    )

    # decode: each row writes its last position, a generated token
    fb = _batch(ForwardMode.DECODE, [5, 2], [9, 4], [1, 1], reqs)
    mgr.attach_batch(fb, batch_state_for(fb), reqs)
    exp = ExpectedInputs(write_entry_capacity=8, device="cpu")
    mgr.fill_expected_inputs(fb, exp)
    assert exp.positions[:2].tolist() == [9, 4]
    assert exp.tokens[:2].tolist() == [oracle(k0, 9), oracle(k1, 4)]

    # a batch the hook never saw, and a count mismatch, are refused
    bare = _batch(ForwardMode.DECODE, [5], [9], [1], reqs[:1])
    with pytest.raises(RuntimeError, match="carries no oracle rows"):
        mgr.fill_expected_inputs(bare, exp)
    mgr.attach_batch(bare, CanaryBatchState(), reqs)  # a state the batch does not carry
    with pytest.raises(RuntimeError, match="carries no oracle rows"):
        mgr.fill_expected_inputs(bare, exp)
    mgr.attach_batch(bare, batch_state_for(bare), reqs)
    with pytest.raises(RuntimeError, match="oracle rows cover 2 requests"):
        mgr.fill_expected_inputs(bare, exp)


# ---- perturbation pieces --------------------------------------------------------------------


@pytest.mark.parametrize(
    "draft, mode, flipped",
    [
        (False, ForwardMode.TARGET_VERIFY, True),  # the target's verify: its slots are kept
        (False, ForwardMode.EXTEND, True),
        (True, ForwardMode.EXTEND, True),  # a draft extend writes slots later forwards read
        (True, ForwardMode.DECODE, False),  # a draft round: rewritten by the draft extend
        (True, ForwardMode.TARGET_VERIFY, False),  # DFLASH's draft block: borrowed slots
    ],
)
def test_post_forward_faults_skip_the_draft_forwards_whose_slots_nothing_reads(
    draft, mode, flipped
):
    """A post-forward fault flips a slot the forward wrote, for a later read to catch; a
    draft runner's DECODE (a draft round) and TARGET_VERIFY (DFLASH's draft block, on slots
    borrowed for the block and rewritten by the verify's draft KV append) forwards write slots
    no later forward reads as written, so they draw none."""
    from sglang.srt.kv_canary.perturb import CanaryPerturber

    d = ServingDriver(seed=1, mode="raise", real_data="partial")
    perturber = CanaryPerturber(
        config=PerturbConfig(real_kv_post_forward_prob=1.0, target_group=PoolKind.FULL),
        groups=d.groups,
        req_to_token=d.req_to_token_pool.req_to_token,
        radix_cache=lambda: None,
        draft=draft,
    )
    fb = _batch(mode, [1, 2], [3, 5], [2, 2], None)
    perturber.after_forward(fb, step=60)  # past the warm-up (50 steps)
    assert bool(perturber.injected) == flipped, perturber.injected


def test_flip_first_byte_changes_exactly_one_bit_of_the_slot():
    pool = MHATokenToKVPool(
        size=16,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0]))
    group = attach_canary_buffers(pool=pool, config=CanaryConfig(mode="raise"), device="cpu")[0]
    source = group.real_kv_sources_k[0]
    before = pool.k_buffer[0].clone()
    slots = torch.arange(1, 17)
    fp_before = real_kv_fingerprint_t([source], [2], slots)
    flip = flip_first_byte(source, 5)
    changed = (pool.k_buffer[0].view(torch.uint8) != before.view(torch.uint8)).nonzero().tolist()
    assert changed == [[5, 0, 0]]  # slot 5, head 0, byte 0 of element 0 only
    assert (flip.row, flip.byte, flip.new) == (5, 0, flip.old ^ 1)
    fp_after = real_kv_fingerprint_t([source], [2], slots)
    assert (fp_before != fp_after).nonzero().flatten().tolist() == [4]  # only slot 5's
    flip_first_byte(source, 5)
    assert torch.equal(pool.k_buffer[0], before)
    with pytest.raises(IndexError, match="outside the real-KV source"):
        flip_first_byte(source, 10_000)
    # SGLANG_KV_CANARY_PERTURB_FLIP=exponent: the first element's top exponent bit (byte 1,
    # 0x40): a small value becomes huge, still in the fingerprinted bytes
    from sglang.srt.kv_canary.perturb.config import FlipBit

    byte, mask = FlipBit.EXPONENT.byte_and_mask
    pool.k_buffer[0][5, 0, 0] = 0.01
    before = pool.k_buffer[0].clone()
    fp_before = real_kv_fingerprint_t([source], [2], slots)
    flip = flip_first_byte(source, 5, mask=mask, byte=byte)
    changed = (pool.k_buffer[0].view(torch.uint8) != before.view(torch.uint8)).nonzero().tolist()
    assert changed == [[5, 0, 1]] and flip.byte == 1 and flip.new == flip.old ^ 0x40
    assert float(pool.k_buffer[0][5, 0, 0]) > 1e30  # 0.01 * 2**128
    assert (
        real_kv_fingerprint_t([source], [2], slots) != fp_before
    ).nonzero().flatten().tolist() == [4]
    flip_first_byte(source, 5, mask=mask, byte=byte)
    assert torch.equal(pool.k_buffer[0], before)


def test_perturb_line_round_trip():
    line = format_perturb_line(FaultKind.REAL_KV_USED, step=12, slot=7, old="0x20", new="0x21")
    assert line == ("kv_canary perturb: fault=real_kv_used step=12 slot=7 old=0x20 new=0x21")
    assert parse_perturb_line("[ts] " + line + "\n") == {
        "fault": "real_kv_used",
        "step": "12",
        "slot": "7",
        "old": "0x20",
        "new": "0x21",
    }
    assert parse_perturb_line("kv_canary stats: step=3") is None


# ---- each fault in the serving loop ---------------------------------------------------------

RUNTIME_FAULTS = {
    # fault -> (perturb kwargs, tags allowed first, reasons, report must name an injected slot)
    "req_to_token": (
        dict(req_to_token_prob=1.0),
        {"HEAD_K_FULL"},
        {"verify_chain_hash", "verify_position"},
        True,
    ),
    "real_kv_used": (
        dict(real_kv_used_prob=1.0, target_group="full"),
        {"TAIL_K_FULL"},
        {"verify_real_kv_hash"},
        True,
    ),
    "real_kv_post_forward": (
        dict(real_kv_post_forward_prob=1.0, target_group="full"),
        {"TAIL_K_FULL"},
        {"verify_real_kv_hash"},
        True,
    ),
}


def _injected(d: ServingDriver):
    return [parse_perturb_line(line) for line in d.manager.perturber.injected]


@pytest.mark.usefixtures("reference_kernels_on_cpu")
@pytest.mark.parametrize("fault", sorted(RUNTIME_FAULTS))
def test_runtime_fault_detected_with_its_reason(fault):
    kwargs, tags, reasons, match_slot = RUNTIME_FAULTS[fault]
    d = ServingDriver(
        seed=4, mode="raise", real_data="partial", perturb=PerturbConfig(warmup_steps=25, **kwargs)
    )
    with pytest.raises(RuntimeError, match="kv_canary detected KV-cache corruption") as exc:
        d.run(60)
    injected = _injected(d)
    assert injected and all(i["fault"] == fault for i in injected)
    assert int(injected[0]["step"]) == 26  # first step after the warm-up
    assert d.manager.step - int(injected[0]["step"]) <= 3
    lines = parse_violation_lines(str(exc.value))
    assert lines and lines[0].launch_tag in tags, lines
    assert reasons & {r for v in lines for r in v.fail_reasons}
    if match_slot:
        slots = {int(i.get("slot", i.get("new_slot"))) for i in injected}
        assert lines[0].slot_idx in slots, (lines, injected)


@pytest.mark.usefixtures("reference_kernels_on_cpu")
def test_real_kv_fault_on_the_swa_group_is_reported_with_swa_tags():
    d = ServingDriver(
        seed=3,
        pool="swa",
        num_slots=640,
        num_swa_slots=400,
        swa_window=16,
        mode="raise",
        real_data="partial",
        perturb=PerturbConfig(warmup_steps=30, real_kv_used_prob=1.0, target_group="swa"),
    )
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.run(80)
    injected = _injected(d)
    assert injected and injected[0]["group"] == "swa"
    lines = parse_violation_lines(str(exc.value))
    assert {v.launch_tag for v in lines} == {"TAIL_K_SWA"}
    assert lines[0].slot_idx in {int(i["slot"]) for i in injected}


@pytest.mark.usefixtures("reference_kernels_on_cpu")
@pytest.mark.parametrize(
    "fault,kwargs",
    [
        ("real_kv_used", dict(real_kv_used_prob=1.0)),
        ("req_to_token", dict(req_to_token_prob=1.0)),
    ],
)
def test_the_gpu_suites_fault_matching_reads_an_swa_only_pool_by_its_window_slots(fault, kwargs):
    """An MTP draft model's kind of pool (one sliding-window layer, no full one: the window
    group alone): the runtime's own fault injection is reported there with ``*_SWA`` tags
    naming the window pool's slot, not the full slot the perturbation line also logs; the GPU
    suite's matcher (``e2e_checks.fault_caught``) reads it so: each fault caught. A
    ``req_to_token`` fault lands inside the window (no forward reads a position before it)."""
    from e2e_checks import fault_caught

    d = ServingDriver(
        seed=3,
        pool="swa",
        swa_only=True,
        num_slots=640,
        num_swa_slots=400,
        swa_window=16,
        mode="raise",
        real_data="partial",
        perturb=PerturbConfig(warmup_steps=60, target_group="swa", **kwargs),
    )
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.run(110)
    injected = _injected(d)
    lines = parse_violation_lines(str(exc.value))
    assert injected and {i["fault"] for i in injected} == {fault}
    assert lines and {v.launch_tag for v in lines} <= {"HEAD_K_SWA", "TAIL_K_SWA"}, lines
    assert all(fault_caught(i, lines) for i in injected), (injected, lines)
    # the full slot the line logs is not the reported one: a matcher reading it would miss
    full = "full_slot" if fault == "real_kv_used" else "new_slot"
    assert not any(v.slot_idx == int(i[full]) for i in injected for v in lines), (injected, lines)


@pytest.mark.usefixtures("reference_kernels_on_cpu")
@pytest.mark.parametrize("real_data,detected", [("all", True), ("partial", False), ("none", False)])
def test_real_data_mode_decides_which_bytes_are_covered(real_data, detected):
    """The last byte of a slot's K row: fingerprinted with ``all`` only (``partial`` reads the
    first 16 bytes, ``none`` no bytes)."""
    d = ServingDriver(seed=6, mode="raise", real_data=real_data)
    d.run(40)
    d.settle()
    info = d.fault_flip_kv_byte(byte=-1)
    if not detected:
        d.run(5)
        assert d.manager.count_violations() == 0
        return
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.run(5)
    lines = parse_violation_lines(str(exc.value))
    assert (lines[0].launch_tag, lines[0].fail_reasons, lines[0].slot_idx) == (
        "TAIL_K_FULL",
        ("verify_real_kv_hash",),
        info["slot"],
    )


@pytest.mark.usefixtures("reference_kernels_on_cpu")
def test_no_perturbation_before_the_warm_up_ends():
    d = ServingDriver(
        seed=4,
        mode="raise",
        real_data="partial",
        perturb=PerturbConfig(
            warmup_steps=10_000, req_to_token_prob=1.0, real_kv_used_prob=1.0, target_group="full"
        ),
    )
    d.run(120)
    assert d.manager.perturber.injected == []
    assert d.manager.count_violations() == 0


# ---- the demo's verdicts --------------------------------------------------------------------


def _report(tag, reason, slot, step):
    """What the runtime prints for a violation of ``slot`` reported at forward ``step`` (the
    structured line, then the explanation block)."""
    from sglang.jit_kernel.kv_canary.consts import FailReason
    from sglang.srt.kv_canary.violations.lines import format_violation_block

    bits = FailReason[reason.upper() + "_MISMATCH"]
    from sglang.srt.kv_canary.violations.records import ViolationRecord

    rec = ViolationRecord(
        launch_tag=int(CanaryLaunchTag[tag]),
        slot_idx=slot,
        position=3,
        stored_token=1,
        expected_token=1,
        stored_chain_hash=0,
        expected_aux=0,
        fail_bits=int(bits),
        read_position=3,
        req_to_token_row=1,
    )
    return format_violation_line(rec, step=step) + "\n" + format_violation_block(rec, step) + "\n"


def test_demo_verdicts():
    inj = format_perturb_line(FaultKind.REAL_KV_USED, step=31, slot=11, row=11) + "\n"
    case = CASES_BY_NAME["real_kv_used"]
    hit = evaluate(case, inj + _report("TAIL_K_FULL", "verify_real_kv_hash", 11, 32), 1)
    assert hit.detected and hit.steps_to_report == 1 and hit.ok
    # a report of another slot, or with another reason, does not count
    assert not evaluate(case, inj + _report("TAIL_K_FULL", "verify_real_kv_hash", 12, 32), 1).ok
    assert not evaluate(case, inj + _report("HEAD_K_FULL", "verify_position", 11, 32), 1).ok
    assert not evaluate(case, "nothing happened", 0).ok  # never injected
    clean = CASES_BY_NAME["clean"]
    quiet = evaluate(clean, "DEMO_RESULT {}\n", 0)
    noisy = evaluate(clean, "DEMO_RESULT {}\n" + _report("HEAD_K_FULL", "verify_position", 3, 9), 0)
    crashed = evaluate(clean, "Traceback", 1)
    assert quiet.ok and not noisy.ok and not crashed.ok
    assert exit_status([quiet, hit]) == 0
    assert exit_status([noisy, hit]) == 1 and exit_status([quiet, crashed]) == 1
    assert exit_status([]) == 1
    # a report counts through any tag that saw it (seen_by), and the row lists them all
    from sglang.srt.kv_canary.violations.records import decode_ring_rows, merge_incidents

    bits = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
    both = merge_incidents(
        decode_ring_rows(
            [
                [int(CanaryLaunchTag[t]), 11, 3, 1, 1, 0, 0, bits, 3, 1, -1]
                for t in ("HEAD_K_FULL", "TAIL_K_FULL")
            ]
        )
    )
    assert len(both) == 1
    seen = evaluate(case, inj + format_violation_line(both[0], step=32) + "\n", 1)
    assert seen.ok and seen.tags == ("HEAD_K_FULL", "TAIL_K_FULL")
    # log mode: a detected fault only counts if the server also served to the end
    died = inj + _report("TAIL_K_FULL", "verify_real_kv_hash", 11, 32) + "Traceback\n"
    assert not evaluate(case, died, 1, mode="log").ok
    assert evaluate(case, died, 1, mode="raise").ok  # raise: stopping is the point
    served = inj + _report("TAIL_K_FULL", "verify_real_kv_hash", 11, 32) + "DEMO_RESULT {}\n"
    assert evaluate(case, served, 0, mode="log").ok


def test_demo_heal_verdicts_compare_each_fault_runs_outputs_with_the_clean_runs(capsys):
    """``--mode heal``: a fault row is ok only when detected, served to the end and its
    outputs' digest equals the clean run's; the heal lines are counted; the rows the mode
    cannot run are left out, each saying why."""
    from sglang.srt.kv_canary.demo.cases import compare_with_clean, format_table
    from sglang.srt.kv_canary.demo.cli import choose_cases

    def result_line(digest):
        return 'DEMO_RESULT {"outputs_digest": "%s"}\n' % digest

    inj = format_perturb_line(FaultKind.REAL_KV_USED, step=31, slot=11, row=11) + "\n"
    report = _report("TAIL_K_FULL", "verify_real_kv_hash", 11, 32)
    healed = "kv_canary heal: took back rids=demo-3,demo-4 (their KV freed; ...)\n"
    clean = evaluate(CASES_BY_NAME["clean"], result_line("abc"), 0, mode="heal")
    case = CASES_BY_NAME["real_kv_used"]
    same = evaluate(case, inj + report + healed + result_line("abc"), 0, mode="heal")
    other = evaluate(case, inj + report + result_line("abd"), 0, mode="heal")
    rows = compare_with_clean([clean, same])
    assert rows[1].same_output is True and rows[1].healed == 2 and rows[1].ok
    rows_bad = compare_with_clean([clean, other])
    assert rows_bad[1].same_output is False and not rows_bad[1].ok
    assert exit_status(rows) == 0 and exit_status(rows_bad) == 1
    table = format_table(rows_bad, "cpu", mode="heal")
    assert "output = clean run" in table.splitlines()[1] and "| NO " in table
    names, notes = choose_cases(None, "cuda", "heal")
    assert "next_token_swap" not in names and "host_kv" not in names
    assert any("pd_transfer, which cannot run in heal mode" in n for n in notes), notes


def test_demo_refuses_paged_runs_without_a_gpu(capsys):
    from sglang.srt.kv_canary.demo.cli import main
    from sglang.srt.kv_canary.demo.cases import DEMO_ENGINE_ARGS, demo_engine_args

    assert demo_engine_args() == dict(DEMO_ENGINE_ARGS, page_size=1)
    paged = demo_engine_args("log", 64)
    assert paged["kv_canary"] == "log" and paged["chunked_prefill_size"] % 64 == 0
    assert paged["max_total_tokens"] >= 12 * 64

    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--page-size", "16"])
    assert "--page-size 16 needs --device cuda" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--page-size", "0"])
    assert "--page-size must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # HiCache's host pool needs CUDA in sglang 0.5.12
        main(["--device", "cpu", "--cases", "clean,host_kv"])
    assert "--cases host_kv needs --device cuda" in capsys.readouterr().err
    hicache = demo_engine_args(hicache=True)
    assert hicache == dict(DEMO_ENGINE_ARGS, page_size=1, enable_hierarchical_cache=True)


def test_demo_pd_case_needs_a_gpu_and_mooncake_and_says_so(capsys, monkeypatch):
    """The ``pd_transfer`` row runs a PD pair: refused on the CPU and where Mooncake does not
    import, each time naming what is missing; its servers keep the token-id check and leave
    out the token oracle; the fault goes to the decode server only (``_pd_worker``)."""
    from sglang.srt.kv_canary.demo import cli, pd_pair
    from sglang.srt.kv_canary.demo.cases import DEMO_ENV, PD_ENV_LEFT_OUT

    with pytest.raises(SystemExit):
        cli.main(["--device", "cpu", "--cases", "clean,pd_transfer"])
    assert "--cases pd_transfer needs --device cuda" in capsys.readouterr().err
    monkeypatch.setattr(pd_pair.importlib.util, "find_spec", lambda name: None)
    assert "package 'mooncake') is not importable" in pd_pair.transfer_engine_missing("mooncake")
    assert "allowed mooncake, nixl" in pd_pair.transfer_engine_missing("tcp")
    with pytest.raises(SystemExit):
        cli.main(["--device", "cuda", "--cases", "pd_transfer"])
    err = capsys.readouterr().err
    assert "--cases pd_transfer needs Mooncake" in err and "pd_a/install.sh" in err

    pd_env = CASES_BY_NAME["pd_transfer"].env
    assert pd_env["SGLANG_KV_CANARY_PERTURB_PD_TRANSFER_PROB"] == "1"
    assert pd_env["SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT"] == "1"
    assert not set(PD_ENV_LEFT_OUT) & set(pd_env)
    assert CASES_BY_NAME["req_to_token"].env.items() >= DEMO_ENV.items()
    assert CASES_BY_NAME["clean"].env == DEMO_ENV


def test_pd_pair_flags_and_environment():
    """Each side's ``launch_server`` flags (the bootstrap port on the prefill server only) and
    the pair's environment (the loopback, no forward behind ``/health`` when asked)."""
    from sglang.srt.kv_canary.demo.pd_pair import PdRole, pair_env, role_flags

    prefill = role_flags(PdRole.PREFILL, "mooncake", 4242, skip_warmup=True)
    decode = role_flags(PdRole.DECODE, "mooncake", 4242)
    assert prefill[prefill.index("--disaggregation-mode") + 1] == "prefill"
    assert prefill[prefill.index("--disaggregation-bootstrap-port") + 1] == "4242"
    assert "--skip-server-warmup" in prefill and "--skip-server-warmup" not in decode
    assert decode[decode.index("--disaggregation-mode") + 1] == "decode"
    assert "4242" not in decode
    assert decode[decode.index("--disaggregation-transfer-backend") + 1] == "mooncake"
    env = pair_env({"PATH": "/bin"}, no_fake_requests=True)
    assert env["SGLANG_HOST_IP"] == "127.0.0.1" and env["PATH"] == "/bin"
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION" not in pair_env({})


@pytest.mark.usefixtures("reference_kernels_on_cpu")
def test_before_forward_faults_are_undone_after_the_forward_read_them(caplog):
    """A ``req_to_token`` / ``real_kv_used`` fault is reported in the
    forward it was injected for (located at the changed entry) and undone right after, so
    sglang's bookkeeping (each request's ``req_to_token`` row) stays the scheduler's own and
    a forward without a new fault reports nothing."""
    d = ServingDriver(
        seed=9,
        mode="log",
        real_data="partial",
        perturb=PerturbConfig(
            warmup_steps=20, req_to_token_prob=0.3, real_kv_used_prob=0.3, target_group="full"
        ),
    )
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        for _ in range(120):
            d.run(1)
            r2t = d.req_to_token_pool.req_to_token
            for r in d.running:  # the scheduler's view and the table agree after every step
                assert r2t[r.row, : r.kv_len].tolist() == r.slots[: r.kv_len], (d.manager.step, r)
    injected = _injected(d)
    kinds = {i["fault"] for i in injected}
    assert kinds == {"req_to_token", "real_kv_used"}, injected
    assert d.manager.perturber.restored == len(injected)
    lines = parse_violation_lines("\n".join(r.getMessage() for r in caplog.records))
    injection_steps = {int(i["step"]) for i in injected}
    assert lines and {v.forward_step for v in lines} <= injection_steps
    for i in injected:
        if i["fault"] != "req_to_token":
            continue
        step, row, pos = int(i["step"]), int(i["req_pool_idx"]), int(i["position"])
        assert any(
            v.forward_step == step
            and v.slot_idx == int(i["new_slot"])
            and (v.req_to_token_row, v.read_position) == (row, pos)
            for v in lines
        ), i


@pytest.mark.usefixtures("reference_kernels_on_cpu")
def test_pd_transfer_fault_hits_a_prefix_at_its_first_read_and_is_caught_there(caplog):
    """``pd_transfer``: a byte of a page the request did not write (on a PD decode server,
    one it received; here a prefix shared through the radix cache) flipped right before the
    first forward that reads the request, never later: caught by that forward's verify at
    the flipped slot. Requests whose transfer sglang faked are left alone."""
    faked = set()
    d = ServingDriver(
        seed=4,
        mode="log",
        real_data="partial",
        perturb=PerturbConfig(warmup_steps=20, pd_transfer_prob=1.0, target_group="full"),
    )
    perturber = d.manager.perturber
    perturber._faked_transfer = lambda req: req.rid in faked
    first_read = {}  # rid -> (the step of the first forward that read it, its shared prefix)
    real_before = perturber.before_forward

    def before_forward(forward_batch, *, step, **kw):
        for req in batch_state(forward_batch).requests.reqs:
            first_read.setdefault(req.rid, (step, req.shared_prefix))
            if req.rid % 3 == 0:
                faked.add(req.rid)
        return real_before(forward_batch, step=step, **kw)

    perturber.before_forward = before_forward
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        d.run(150)
        d.settle()
    injected = _injected(d)
    assert len(injected) >= 3 and {i["fault"] for i in injected} == {"pd_transfer"}, injected
    lines = parse_violation_lines("\n".join(r.getMessage() for r in caplog.records))
    for i in injected:
        rid, step = int(i["rid"]), int(i["step"])
        assert rid % 3 and first_read[rid][0] == step, (i, first_read.get(rid))
        assert int(i["position"]) < first_read[rid][1], (i, first_read[rid])
        assert any(
            v.forward_step == step
            and v.slot_idx == int(i["slot"])
            and "verify_real_kv_hash" in v.fail_reasons
            for v in lines
        ), (i, lines)
    assert {v.forward_step for v in lines} <= {int(i["step"]) for i in injected}


@pytest.mark.usefixtures("reference_kernels_on_cpu")
def test_the_kept_req_to_token_fault_stays_and_picks_requests_with_tokens_left():
    """``req_to_token_kept``: the entry stays rewritten after the forward (nothing undoes it)
    and its request had more than two tokens left, so the report finds it running; abort mode
    accepts it (the other modes refuse it, above)."""
    d = ServingDriver(
        seed=9,
        mode="abort",
        real_data="partial",
        perturb=PerturbConfig(warmup_steps=10, req_to_token_kept_prob=1.0),
    )
    left_at = {}  # step -> {row: tokens left} when the fault is injected
    perturber = d.manager.perturber
    before = perturber.before_forward

    def snapshot(forward_batch, *, step, **kwargs):
        left_at[step] = {r.row: r.max_new - len(r.output) for r in d.running}
        before(forward_batch, step=step, **kwargs)

    perturber.before_forward = snapshot
    for _ in range(80):
        seen = len(d.manager.perturber.injected)
        d.run(1)
        if len(d.manager.perturber.injected) > seen:
            inj = _injected(d)[-1]
            row, pos = int(inj["req_pool_idx"]), int(inj["position"])
            assert int(d.req_to_token_pool.req_to_token[row, pos]) == int(inj["new_slot"])
    injected = _injected(d)
    assert len(injected) >= 10 and {i["fault"] for i in injected} == {"req_to_token_kept"}
    assert all(left_at[int(i["step"])][int(i["req_pool_idx"])] > 2 for i in injected)
    assert d.manager.perturber.restored == 0


@pytest.mark.usefixtures("reference_kernels_on_cpu")
@pytest.mark.parametrize("pool", ["mha", "nsa"])
def test_a_kept_fault_never_rewrites_its_requests_seed_page(pool):
    """The kept ``req_to_token`` fault leaves its rewrite in place, so it must never touch the
    position the forward's new KV chains from (the seed, ``prefix - 1``) nor, at page size
    > 1, any entry of the seed's page: each injection is checked against the prefix its row
    had in that forward's batch."""
    from sglang.srt.kv_canary.plan_input import host_prefix_extend

    d = ServingDriver(
        seed=5,
        mode="abort",
        pool=pool,
        perturb=PerturbConfig(warmup_steps=5, req_to_token_kept_prob=1.0),
    )
    ps = d.kv_pool.page_size
    prefix_at = {}  # step -> {row: prefix length}
    perturber = d.manager.perturber
    before = perturber.before_forward

    def snapshot(forward_batch, *, step, **kwargs):
        rows, prefix, _ = host_prefix_extend(forward_batch)
        prefix_at[step] = dict(zip(rows, prefix))
        before(forward_batch, step=step, **kwargs)

    perturber.before_forward = snapshot
    if ps > 1:  # requests long enough for a full page before the seed's
        for _ in range(3):
            d.add_request(2 * ps + 8, 10)
    d.run(120)
    injected = [i for i in _injected(d) if i["fault"] == "req_to_token_kept"]
    assert len(injected) >= 3, injected
    for i in injected:
        row, pos = int(i["req_pool_idx"]), int(i["position"])
        seed = prefix_at[int(i["step"])][row] - 1
        entries = int(i.get("entries", 1))
        assert entries == ps and pos % ps == 0, i
        # the rewritten entries [pos, pos + entries) end before the seed's page
        assert pos + entries <= seed // ps * ps, (i, seed)


@pytest.mark.parametrize("pool,page_size", [("mha", 1), ("nsa", 64)])
def test_the_kept_fault_rewrites_in_the_pools_pages(pool, page_size):
    """The runtime hands the pool's page size to the perturber: the kept fault's unit (a
    whole page at page size > 1; docs/user_guide.md, the self-test variables)."""
    d = ServingDriver(mode="abort", pool=pool, perturb=PerturbConfig(req_to_token_kept_prob=1.0))
    assert d.kv_pool.page_size == page_size
    assert d.manager.perturber.page_size == page_size


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
