"""Multi-layer EAGLE (``--enable-multi-layer-eagle``, spec v2 without CUDA graphs) on real
sglang 0.5.12 pools and ForwardBatch objects (:mod:`multi_layer_eagle_driver`): the MTP
layers' runners share MTP layer 0's canary, every MTP step's write of layer 0's pool gets
its records, a fault there is caught, a step routed to another pool is refused, and the
draft pool runs without token checks (docs/speculative_multilayer_adaptive_dflash_mtp.md,
"1.4 Changes to the canary"). sglang's own runs: ``test_multi_layer_eagle_sglang.py`` (CPU)
and ``test_e2e_speculative_gpu.py`` (GPU)."""

from __future__ import annotations

import logging
import os
import sys

import pytest

from multi_layer_eagle_driver import MultiLayerEagleDriver
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from e2e_checks import pool_reports
from serving_driver import VOCAB
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


@pytest.fixture
def canary_env(monkeypatch):
    """Token checks on (the target's; the draft's are turned off by the install) and draft
    violations acted on, so that a raise-mode driver stops at the draft pool's first one."""
    for name in [n for n in os.environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT", "1")
    monkeypatch.setenv("SGLANG_KV_CANARY_DRAFT_VIOLATIONS", "act")
    return monkeypatch


def _reasons(exc) -> set:
    lines = parse_violation_lines(str(exc.value))
    assert lines, str(exc.value)[:2000]
    return {r for v in lines for r in v.fail_reasons}


def test_every_mtp_step_writes_layer_0s_pool_under_its_canary(canary_env, caplog):
    """A clean run: every MTP layer's runner ran each draft extend's step, all through MTP
    layer 0's canary (one installed, shared by the others, its start-up ended by the hook
    after the worker's ``init_cuda_graphs``), which verified the reads of that pool and
    reported nothing; the other layers' pools were never written; the target kept
    its token checks, the draft pool has none."""
    with caplog.at_level(logging.INFO, logger="sglang.srt.kv_canary"):
        d = MultiLayerEagleDriver(monkeypatch=canary_env, steps=3, seed=2)
        d.run(45)
    assert d.draft.count_violations() == 0 and d.target.count_violations() == 0
    assert d.rounds >= 10 and d.chunked >= 3 and len(d.finished) >= 5
    assert d.mtp_forwards[0] >= 30 and len(set(d.mtp_forwards)) == 1, d.mtp_forwards
    assert all(m is d.draft for m in d.installed), "an MTP runner got a canary of its own"
    assert [seam.runner_canary(r) for r in d.mtp_runners] == [d.draft] * 3
    assert int(d.draft.state.slot_run_counters[CanaryLaunchTag.HEAD_K_FULL]) > 500
    # start-up ended by the worker's init_cuda_graphs hook: the chain-position check is on
    assert int(d.draft.state.enable_chain_position_assert[0]) == 1
    for pool in d.mtp_pools[1:]:
        assert not any(b.abs().sum() for b in (*pool.k_buffer, *pool.v_buffer))
    assert d.target.config.enable_verify_token_assert
    assert not d.draft.config.enable_verify_token_assert
    messages = [r.getMessage() for r in caplog.records]
    assert any("no token checks on the multi-layer EAGLE draft pool" in m for m in messages)
    assert sum("shares MTP layer 0's canary" in m for m in messages) == 2, messages
    # the draft's installed line says what that canary checks (its own config)
    installed = [m for m in messages if m.startswith("kv_canary installed on the EAGLE draft")]
    assert len(installed) == 1 and " token_checks=off " in installed[0], installed


def test_an_mtp_step_without_the_canary_leaves_records_the_kv_disagrees_with(canary_env):
    """Why the later MTP runners share layer 0's canary: without it their steps rewrite
    layer 0's pool with no records, and the next read of a rewritten slot fails its real-KV
    check on a clean run."""
    d = MultiLayerEagleDriver(monkeypatch=canary_env, steps=3, seed=2, unshared=True)
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.run(45)
    assert _reasons(exc) == {"verify_real_kv_hash"}
    assert "in the EAGLE draft model's KV pool" in str(exc.value)


def test_draft_token_checks_would_report_sglangs_predicted_token_kv(canary_env):
    """Why the draft pool has no token checks: with them, a clean run's draft records (the
    last MTP step's token, p + steps, and predicted tokens at each round's last positions)
    fail the check against token p + 1."""
    canary_env.setattr(seam.SpeculativeFacts, "draft_token_checks", property(lambda self: True))
    d = MultiLayerEagleDriver(monkeypatch=canary_env, steps=3, seed=2)
    assert d.draft.config.enable_verify_token_assert
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.run(45)
    assert _reasons(exc) == {"verify_token"}


def test_a_flipped_byte_in_layer_0s_pool_is_caught(canary_env):
    d = MultiLayerEagleDriver(monkeypatch=canary_env, steps=3, seed=6)
    d.run(30)
    d.step_until_committed()
    info = d.flip_byte(d.draft_pool)
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        for _ in range(10):  # prefills of new arrivals first, then the victim's next extend
            d.step()
    lines = parse_violation_lines(str(exc.value))
    assert {(v.slot_idx, v.fail_reasons) for v in lines} == {
        (info["slot"], ("verify_real_kv_hash",))
    }
    assert d.target.violations.total == 0


def test_an_mtp_step_writing_another_pool_is_refused(canary_env):
    """A step whose batch carries MTP layer k's own pool (not what sglang 0.5.12 does) would
    be planned against layer 0's records: refused, naming the layer."""
    d = MultiLayerEagleDriver(monkeypatch=canary_env, steps=3, seed=2, bug_own_pool=True)
    with pytest.raises(RuntimeError, match="MTP layer 1 runner writes a KV pool other than"):
        d.run(10)


def test_layer_0s_canary_must_exist_before_the_others(canary_env):
    from serving_driver import stand_in_model_runner
    from sglang.srt.kv_canary import install
    from multi_layer_eagle_driver import multi_layer_server_args
    from eagle_driver import tiny_mha_pool
    import torch

    runner = stand_in_model_runner(
        tiny_mha_pool(63),
        req_to_token=torch.zeros((8, 64), dtype=torch.int32),
        context_len=64,
        draft=True,
    )
    runner.draft_model_idx = 2
    with pytest.raises(RuntimeError, match="MTP layer 2 runner got no canary to share"):
        install.install_canary(
            server_args=multi_layer_server_args(steps=3, chunk=24, max_reqs=8),
            model_runner=runner,
        )


def test_the_token_oracle_checks_the_target_s_writes_and_not_the_mtp_steps(canary_env, caplog):
    """The token oracle and its write-input check (a self-test) with multi-layer EAGLE: the
    target's writes are checked against the oracle's tokens, the shared draft canary's are not
    (each MTP step k writes the token of p + k + 1 at p, the rotated ids: no one token a
    write at p must hold); a clean run has no report in either pool."""
    canary_env.setenv("SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE", "1")
    canary_env.setenv("SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT", "1")
    with caplog.at_level(logging.INFO, logger="sglang.srt.kv_canary"):
        d = MultiLayerEagleDriver(monkeypatch=canary_env, steps=3, seed=2, token_oracle=True)
        d.run(45)
    assert d.rounds >= 10 and len(d.finished) >= 5
    assert d.draft.count_violations() == 0 and d.target.count_violations() == 0
    assert d.target.config.enable_write_input_assert and d.target.token_oracle is not None
    assert not d.draft.config.enable_write_input_assert
    assert not d.draft.config.enable_verify_token_assert


SHARED = 12  # prompt tokens the two requests of the radix tests share


@pytest.mark.parametrize("together", [True, False], ids=["one_batch", "prefix_hit"])
def test_a_shared_prefix_s_draft_kv_comes_from_the_first_request_s_later_tokens(
    canary_env, caplog, together
):
    """With the radix cache on (EAGLE's token-pair keys), two prompts equal on ``[0,
    SHARED)``: sglang shares slots up to ``SHARED - 2``, but MTP layer 0's pool holds there the
    last MTP step's KV, computed from the first request's token at ``p + steps``. Served in
    one prefill batch, the tree insert swaps the second request's slots for the first one's,
    and its own record at ``SHARED - 1`` no longer chains: the draft canary reports that
    ``verify_chain_hash`` (not acted on under ``raise``, the draft's default), nothing in the
    target pool, and the start-up warning says why; admitted after the first finished, the
    second chains from the shared records: nothing to see without the draft's token checks."""
    canary_env.delenv("SGLANG_KV_CANARY_DRAFT_VIOLATIONS")
    first = [(7 * i + 3) % VOCAB for i in range(20)]
    second = first[:SHARED] + [(first[SHARED] + 1) % VOCAB] + [(11 * i) % VOCAB for i in range(7)]
    with caplog.at_level(logging.INFO, logger="sglang.srt.kv_canary"):
        d = MultiLayerEagleDriver(monkeypatch=canary_env, steps=3, seed=4, radix_is_eagle=True)
        a = d.add_request(0, 6, prompt=first)
        while not together and a not in d.finished:
            d.step()
        b = d.add_request(0, 6, prompt=second)
        while a not in d.finished or b not in d.finished:
            d.step()
    assert b.shared_prefix >= SHARED - 1
    messages = [r.getMessage() for r in caplog.records]
    reports = pool_reports("\n".join(messages))
    assert reports == ({("draft", "verify_chain_hash", SHARED - 1)} if together else set()), reports
    assert d.target.count_violations() == 0
    assert any("Not acted on (--kv-canary raise)" in m for m in messages) == together
    (warning,) = [m for m in messages if "--enable-multi-layer-eagle with the radix cache on" in m]
    assert "from the token at p + 3" in warning and "not acted on" in warning


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
