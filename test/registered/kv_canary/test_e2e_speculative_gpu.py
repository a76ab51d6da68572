"""Issue 18 on the GPU: EAGLE speculative decoding served by sglang 0.5.12 with the canary on
the target and the draft pools, CUDA graphs on (the target's verify graphs, the draft round's
graph, the draft-extend graph), spec v2 (overlap scheduler on, sglang's default) and spec v1
(``--disable-overlap-schedule``).

Models: the tiny Llama target and a one-layer ``LlamaForCausalLMEagle`` draft, dummy weights
(the draft's guesses are mostly rejected: every round still drafts, verifies and extends).
``speculative_num_steps`` 3, ``topk`` 1, 4 draft tokens.

- clean: raise + sweep + real data + token checks give zero violations and the greedy outputs
  of the canary off, with the draft worker's canary installed;
- faults: every fault class of the perturbation framework, injected into the draft pool only
  (``SGLANG_KV_CANARY_PERTURB_TARGET_WORKER=draft``) and into the target pool only, each
  caught.

sglang 0.5.12's CPU engine cannot run EAGLE (docs/user_guide.md, "Speculative decoding"): the
planning of every speculative forward is tested in CPU CI on real pools (test_speculative.py).
Needs the device bundles a, b, c (docs/architecture.md, "Tests")."""

from __future__ import annotations

import os
import pathlib

import pytest
from e2e_checks import EVERY_FAULT_ENV, assert_every_fault_caught, run_workload

from sglang.srt.kv_canary.runner.violation import parse_violation_lines
from sglang.srt.kv_canary.testing.server_harness import write_tiny_llama

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

SUPPORT = pathlib.Path(__file__).parent / "e2e_support"
COMMON = dict(chunked_prefill_size=64, max_total_tokens=4096, max_running_requests=8,
              log_level="info", decode_log_interval=1, mem_fraction_static=0.85,
              speculative_algorithm="EAGLE", speculative_num_steps=3,
              speculative_eagle_topk=1, speculative_num_draft_tokens=4)
SPEC = {"spec_v2": {}, "spec_v1": dict(disable_overlap_schedule=True)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = write_tiny_llama(tmp_path_factory.mktemp("target"))
    draft = write_tiny_llama(tmp_path_factory.mktemp("draft"),
                             architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    return target, draft


def run(models, spec, env_extra=None, **engine_kwargs):
    target, draft = models
    env = dict(os.environ, **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), env.get("PYTHONPATH", ""))
                                        if p)
    kwargs = dict(COMMON, speculative_draft_model_path=draft, **SPEC[spec], **engine_kwargs)
    return run_workload("small_workload.py", target, kwargs, env, "cuda", timeout=600)


# no prompt is split into prefill chunks (see the PR 26329 test)
UNCHUNKED = dict(chunked_prefill_size=512)


@pytest.mark.parametrize("spec", sorted(SPEC))
def test_clean_matches_canary_off(models, spec):
    rc, out, off = run(models, spec, **UNCHUNKED)
    assert rc == 0 and off is not None, out[-4000:]
    rc, out, on = run(models, spec, {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
                                     "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "5"},
                      kv_canary="raise", kv_canary_real_data="partial",
                      kv_canary_sweep_interval=3, **UNCHUNKED)
    assert rc == 0, out[-4000:]
    assert "kv_canary installed on the EAGLE draft worker: mode=raise" in out, out[-4000:]
    assert "not covered yet" not in out
    assert parse_violation_lines(out) == []
    assert on == off and len(on) == 12
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert stats and all("violations=0" in s for s in stats)


@pytest.mark.parametrize("worker", ["draft", "target"])
@pytest.mark.parametrize("spec", sorted(SPEC))
def test_every_fault_class_is_caught_in_each_pool(models, spec, worker):
    env = dict(EVERY_FAULT_ENV, SGLANG_KV_CANARY_PERTURB_TARGET_WORKER=worker)
    rc, out, res = run(models, spec, env, kv_canary="log", kv_canary_real_data="partial",
                       kv_canary_sweep_interval=2)
    assert rc == 0 and res is not None and len(res) == 12, out[-4000:]
    assert "kv_canary installed on the EAGLE draft worker" in out
    assert_every_fault_caught(out)


@pytest.mark.parametrize("spec", sorted(SPEC))
def test_pr25015_draft_positions_advanced_before_the_forward(models, spec):
    """Upstream PR 25015, re-introduced by a test-only hook (``KV_CANARY_TEST_PR25015``): each
    draft forward runs at the next position. The draft canary stops the server with the
    stored position; the same workload without the hook is clean (the test above)."""
    rc, out, _ = run(models, spec, {"KV_CANARY_TEST_PR25015": "1"}, kv_canary="raise",
                     **UNCHUNKED)
    assert rc != 0, out[-3000:]
    lines = parse_violation_lines(out)
    reasons = {r for v in lines for r in v.fail_reasons}
    assert reasons & {"verify_position", "write_position"}, out[-3000:]


@pytest.mark.parametrize("spec", sorted(SPEC))
def test_pr26329_chunk_end_draft_token_is_reported(models, spec):
    """Upstream PRs 26329 / 26800: sglang 0.5.12 still shifts every prefill chunk's draft
    input with the token the target sampled, also at a non-final chunk's end, where the next
    prompt token belongs: the draft KV of that chunk's last position is computed from the
    wrong token. A true positive of sglang 0.5.12 (docs/user_guide.md, "Speculative
    decoding"): with 64-token chunks the workload's second request of each wave is split after
    its position 21, and the draft canary's token check reports that position
    (``verify_token``, the prompt token after it expected). The request's later draft KV was
    computed on that wrong token; once the radix cache swaps in another request's slots for
    the identical prompt positions, the first of its own slots past them no longer chains
    (``verify_chain_hash``). Unsplit, the same prompts are clean
    (test_clean_matches_canary_off)."""
    rc, out, res = run(models, spec, {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"},
                       kv_canary="log", chunked_prefill_size=64)
    assert rc == 0 and res is not None, out[-3000:]
    lines = parse_violation_lines(out)
    summary = sorted({(v.launch_tag, v.fail_reasons, v.slot_idx, v.position, v.stored_token,
                       v.expected_token) for v in lines})
    reasons = {r for v in lines for r in v.fail_reasons}
    assert "verify_token" in reasons, summary
    assert reasons <= {"verify_token", "verify_chain_hash"}, summary
    token_lines = [v for v in lines if "verify_token" in v.fail_reasons]
    assert 21 in {v.position for v in token_lines}, summary
    # each token report expects the prompt token after its position (the draft pool's
    # offset): chunk ends inside prompts, nowhere else
    import importlib.util

    spec_ = importlib.util.spec_from_file_location("small_workload",
                                                   SUPPORT / "small_workload.py")
    workload = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(workload)
    prompts = [p for wave in workload.waves() for p in wave]
    for v in token_lines:
        assert any(v.position + 1 < len(p) and p[v.position + 1] == v.expected_token
                   for p in prompts), v
