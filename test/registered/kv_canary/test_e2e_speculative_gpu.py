"""On the GPU: EAGLE speculative decoding served by sglang 0.5.12 with the canary on
the target and the draft pools, CUDA graphs on (the target's verify graphs, the draft round's
graph, the draft-extend graph), spec v2 (overlap scheduler on, sglang's default) and spec v1
(``--disable-overlap-schedule``).

Models (dummy weights: the draft's guesses are mostly rejected, every round still drafts,
verifies and extends), ``speculative_num_steps`` 3, ``topk`` 1, 4 draft tokens:

- ``EAGLE``: the tiny Llama target and a one-layer ``LlamaForCausalLMEagle`` draft;
- ``EAGLE3``: a four-layer tiny Llama target (three of its layers' hidden states feed the
  draft) and a one-layer ``LlamaForCausalLMEagle3`` draft (``draft_vocab_size``, the aux
  layers in ``eagle_config``);
- ``NEXTN`` (MTP): a tiny DeepSeek-V3 (MLA, ``MLATokenToKVPool``) with one NextN layer, which
  sglang loads as the draft (``DeepseekV3ForCausalLMNextN``, MLA too);
- ``STANDALONE``: the tiny Llama target and a separate tiny plain ``LlamaForCausalLM`` draft of
  another shape (3 layers, 1 KV head), its own ``MHATokenToKVPool``; Triton attention.
- ``DFLASH`` (spec v1: sglang runs it only there): a four-layer tiny Llama target and a
  one-layer ``DFlashDraftModel`` (block size 4, fed by the hidden states of target layers 0
  and 1, an explicit mask token id), its own ``MHATokenToKVPool`` written by the draft KV appends,
  without and with a draft window of 16 (sglang's compact draft table); Triton attention.
- ``FROZEN_KV_MTP`` (spec v1 only): a four-layer tiny Gemma4 target whose last sliding and full
  layers are KV-shared (an ``SWAKVPool``) and a two-layer Gemma4 MTP assistant that reads the
  target's KV and writes none: the target canary only (no fault in a draft pool: it has
  none); Triton attention.

- clean: raise + sweep + real data + token checks give zero violations and the greedy outputs
  of the canary off, with the draft worker's canary installed;
- faults: every fault class of the perturbation framework, injected into the draft pool only
  (``SGLANG_KV_CANARY_PERTURB_TARGET_WORKER=draft``) and into the target pool only, each
  caught;
- STANDALONE's radix keys: sglang 0.5.12 keys its radix cache by single tokens, and each
  shared prefix that diverges is reported in the draft pool (docs/user_guide.md, "Speculative
  decoding"); a raise server logs and counts those reports and serves on (a draft pool's
  reports are not acted on by default); its clean runs keep the radix cache off;
- the regression suite of real sglang bugs (one test per upstream PR, the bug re-introduced by
  a test-only hook in ``e2e_support/sitecustomize.py``).

sglang 0.5.12's CPU engine cannot run EAGLE (docs/user_guide.md, "Speculative decoding"): the
planning of every speculative forward is tested in CPU CI on real pools (test_speculative.py).
Needs the device bundles a, b, c (docs/testing.md, "The CPU suite")."""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import pytest
from e2e_checks import (
    EVERY_FAULT_ENV,
    assert_every_fault_caught,
    pool_reports,
    run_workload,
    violations_by_pool,
)
from e2e_workload import assert_memory_reserved_as_allocated, workload_info

from sglang.srt.kv_canary.perturb.report import parse_perturb_line
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.kv_canary.demo.server_harness import write_tiny_llama
from canary_support.script_run import load_support_script
from canary_support.tiny_models import (
    DEEPSEEK_V3_MLA_DIMS,
    write_tiny_deepseek_v2,
    write_tiny_dflash_pair,
    write_tiny_gemma4_pair,
    write_tiny_step3p5,
)
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=11170, stage="base-b", runner_config="1-gpu-small")
# its lanes in the GPU suite (test/gpu_lanes.py): name -> (pytest -k, est. seconds)
GPU_LANES = {
    "spec_clean_v2": ("clean and spec_v2 and not standalone", 190),
    "spec_clean_v1": ("clean and spec_v1 and not standalone", 190),
    "spec_pr25015": ("pr25015", 340),
    "spec_pr26329": ("pr26329", 370),
    "spec_pr28254_v2": ("pr28254 and spec_v2", 450),
    "spec_pr28254_v1": ("pr28254 and spec_v1 and chain", 450),
    "spec_pr28254_tree": ("pr28254 and tree", 480),
    "spec_faults_v2": ("fault and spec_v2 and not standalone", 210),
    "spec_faults_v1": ("fault and spec_v1 and not standalone", 360),
    "spec_adaptive_v2": ("adaptive and spec_v2", 330),
    "spec_adaptive_v1": ("adaptive and spec_v1", 330),
    "spec_eagle3_clean": ("other_algorithms and clean and EAGLE3", 200),
    "spec_eagle3_faults": ("other_algorithms and every_fault and EAGLE3", 130),
    "spec_nextn_clean": ("other_algorithms and clean and NEXTN", 220),
    "spec_nextn_faults": ("other_algorithms and every_fault and NEXTN", 140),
    "spec_standalone_clean": ("standalone and clean", 380),
    "spec_standalone_faults_v1": ("standalone and every_fault and spec_v1", 350),
    "spec_standalone_faults_v2": ("standalone and every_fault and spec_v2", 220),
    "spec_standalone_radix_keys": ("standalone and radix_keys", 200),
    "spec_tree_clean": ("tree and clean and not paged", 220),
    "spec_tree_faults": ("tree and every_fault and not paged", 180),
    "spec_tree_paged": ("tree and paged and clean", 420),
    "spec_tree_paged_rounds": ("tree and paged and rounds", 300),
    "spec_tree_paged_faults": ("tree and paged and every_fault", 220),
    "spec_ngram_clean": ("ngram and clean and not paged", 220),
    "spec_ngram_faults": ("ngram and every_fault and not paged", 150),
    "spec_ngram_paged": ("ngram and paged", 480),
    "spec_dflash_clean": ("dflash and clean and not paged and not window", 300),
    "spec_dflash_faults": ("dflash and every_fault and not paged and not window", 250),
    "spec_dflash_paged": ("dflash and paged", 320),
    "spec_dflash_window": ("dflash and window", 420),
    "spec_oracle": ("token_oracle and outputs", 530),
    "spec_oracle_swap": ("token_oracle and swap", 260),
    "spec_frozen_kv_mtp_clean": ("frozen_kv_mtp and clean", 200),
    "spec_frozen_kv_mtp_faults": ("frozen_kv_mtp and every_fault", 200),
    "spec_multi_layer_clean": ("multi_layer and clean", 360),
    "spec_multi_layer_faults": ("multi_layer and every_fault", 300),
    "spec_multi_layer_radix": ("multi_layer and radix", 150),
    "spec_multi_layer_oracle": ("multi_layer and token_oracle", 150),
}

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

SUPPORT = pathlib.Path(__file__).parent / "e2e_support"
COMMON = dict(
    chunked_prefill_size=64,
    max_total_tokens=4096,
    max_running_requests=8,
    log_level="info",
    decode_log_interval=1,
    mem_fraction_static=0.85,
    speculative_num_steps=3,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=4,
)
SPEC = {"spec_v2": {}, "spec_v1": dict(disable_overlap_schedule=True)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = write_tiny_llama(tmp_path_factory.mktemp("target"))
    draft = write_tiny_llama(
        tmp_path_factory.mktemp("draft"),
        architectures=["LlamaForCausalLMEagle"],
        num_hidden_layers=1,
    )
    return target, draft


@pytest.fixture(scope="module")
def head_dim_128_models(tmp_path_factory):
    """The tiny target and EAGLE draft with heads of 128 (hidden 256, 2 heads, 1 KV head):
    flashinfer's prefill kernels, which run a tree's verify (its custom mask), have no
    configuration for the tiny model's heads of 16 (the canary-off server stopped capturing
    its verify graph: "Invalid configuration : NUM_MMA_Q=2 NUM_MMA_D_QK=1 ...")."""
    wide = dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1
    )
    target = write_tiny_llama(tmp_path_factory.mktemp("target128"), **wide)
    draft = write_tiny_llama(
        tmp_path_factory.mktemp("draft128"),
        architectures=["LlamaForCausalLMEagle"],
        num_hidden_layers=1,
        **wide,
    )
    return target, draft


def models_for(request, backend: str):
    """The models a tree or NGRAM run on ``backend`` uses: the tiny ones on triton, heads
    of 128 on flashinfer (:func:`head_dim_128_models`)."""
    return request.getfixturevalue("models" if backend == "triton" else "head_dim_128_models")


def write_models(tmp_path_factory, algorithm):
    """(target dir, draft dir or None) of ``algorithm``."""
    if algorithm == "EAGLE3":
        target = write_tiny_llama(tmp_path_factory.mktemp("target3"), num_hidden_layers=4)
        draft = write_tiny_llama(
            tmp_path_factory.mktemp("draft3"),
            architectures=["LlamaForCausalLMEagle3"],
            num_hidden_layers=1,
            draft_vocab_size=512,
            eagle_config={
                "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
                "use_aux_hidden_state": True,
            },
        )
        return target, draft
    if algorithm == "NEXTN":  # sglang takes the NextN layer of the target's dir as the draft
        # DeepSeek-V3's own MLA head dimensions (everything else tiny): with head dims of 32
        # the canary-off server stopped in sglang's Triton extend attention (docs/user_guide.md,
        # "Speculative decoding"); these are the shapes its kernels are tuned for
        return write_tiny_deepseek_v2(
            tmp_path_factory.mktemp("mtp"),
            architectures=["DeepseekV3ForCausalLM"],
            model_type="deepseek_v3",
            num_nextn_predict_layers=1,
            **DEEPSEEK_V3_MLA_DIMS,
        ), None
    if algorithm == "STANDALONE":  # a separate plain LM of its own shape as the draft
        target = write_tiny_llama(tmp_path_factory.mktemp("target_standalone"))
        draft = write_tiny_llama(
            tmp_path_factory.mktemp("standalone_draft"),
            num_hidden_layers=3,
            num_key_value_heads=1,
        )
        return target, draft
    raise ValueError(algorithm)


def run(
    models, spec, env_extra=None, script="small_workload.py", algorithm="EAGLE", **engine_kwargs
):
    target, draft = models
    env = dict(os.environ, **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), env.get("PYTHONPATH", "")) if p)
    kwargs = dict(COMMON, speculative_algorithm=algorithm, **SPEC[spec], **engine_kwargs)
    if draft is not None:
        kwargs["speculative_draft_model_path"] = draft
    return run_workload(script, target, kwargs, env, "cuda", timeout=600)


# no prompt is split into prefill chunks (see the PR 26329 test)
UNCHUNKED = dict(chunked_prefill_size=512)


def assert_clean_and_both_canaries_reserved(out: str, on, off) -> None:
    """A clean speculative run: no violation, outputs equal to the canary off's (12 requests),
    every stats line at zero violations, and both canaries' memory reserved out of the KV
    budget (the target's profile sizes the draft pool too) as they were then built."""
    assert parse_violation_lines(out) == []
    assert on == off and len(on) == 12
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert stats and all("violations=0" in s for s in stats)
    info = workload_info(out)
    assert_memory_reserved_as_allocated(info)
    draft = info["kv_canary"]["memory"]["draft"]
    assert draft["allocated"]["device_bytes"] > 0 and draft["allocated"] == draft["reserved"], info[
        "kv_canary"
    ]["memory"]


def run_clean_pair(models, spec, env_extra=None, **engine_kwargs):
    """A clean test's two runs of the workload: the canary off, then ``--kv-canary raise``
    with real data partial, a sweep every 3 steps and token checks; both must exit 0, both
    with ``env_extra``. Returns (the canary-on run's output, its results, the canary-off run's
    results)."""
    rc, out, off = run(models, spec, env_extra, **engine_kwargs)
    assert rc == 0 and off is not None, out[-4000:]
    rc, out, on = run(
        models,
        spec,
        {
            **(env_extra or {}),
            "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
            "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "5",
        },
        kv_canary="raise",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=3,
        **engine_kwargs,
    )
    assert rc == 0, out[-4000:]
    return out, on, off


@pytest.mark.parametrize("spec", sorted(SPEC))
def test_clean_matches_canary_off(models, spec):
    out, on, off = run_clean_pair(models, spec, **UNCHUNKED)
    assert "kv_canary installed on the EAGLE draft worker: mode=raise" in out, out[-4000:]
    assert "not covered yet" not in out
    assert_clean_and_both_canaries_reserved(out, on, off)


def assert_every_fault_caught_in_a_log_run(
    models, spec, env, drafter: str, post_forward: bool = True, **engine_kwargs
):
    """The fault tests' run: ``--kv-canary log``, real data partial, a sweep every 2 steps,
    faults as ``env`` injects them; all 12 requests served, the draft canary installed on the
    ``drafter``'s worker (``EAGLE``, ``STANDALONE``, ``DFLASH``), every fault caught
    (:func:`~e2e_checks.assert_every_fault_caught`, ``post_forward`` passed on). Returns the
    run's output."""
    rc, out, res = run(
        models,
        spec,
        env,
        kv_canary="log",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
        **engine_kwargs,
    )
    assert rc == 0 and res is not None and len(res) == 12, out[-4000:]
    assert f"kv_canary installed on the {drafter} draft worker" in out
    assert_every_fault_caught(out, post_forward=post_forward)
    return out


@pytest.mark.parametrize("worker", ["draft", "target"])
@pytest.mark.parametrize("spec", sorted(SPEC))
def test_every_fault_class_is_caught_in_each_pool(models, spec, worker):
    env = dict(EVERY_FAULT_ENV, SGLANG_KV_CANARY_PERTURB_TARGET_WORKER=worker)
    assert_every_fault_caught_in_a_log_run(models, spec, env, "EAGLE")


# draft trees (docs/speculative_trees.md): spec v1 (sglang runs trees on v1 only), page size 1
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_tree_clean_matches_canary_off(request, backend):
    """A draft tree (topk 2, 3 steps, 6 draft tokens) with the canary in raise mode, real
    data, a sweep and token checks: outputs equal to the canary off's, no violation, both
    canaries reserved; the draft runner's canary plans its round by lane, the target's
    writes the verify's trees."""
    models = models_for(request, backend)
    out, on, off = run_clean_pair(models, "spec_v1", **UNCHUNKED, attention_backend=backend, **TREE)
    assert "kv_canary installed on the EAGLE draft worker: mode=raise" in out, out[-4000:]
    assert_clean_and_both_canaries_reserved(out, on, off)


@pytest.mark.parametrize("worker", ["draft", "target"])
def test_tree_every_fault_class_is_caught_in_each_pool(models, worker):
    env = dict(EVERY_FAULT_ENV, SGLANG_KV_CANARY_PERTURB_TARGET_WORKER=worker)
    assert_every_fault_caught_in_a_log_run(models, "spec_v1", env, "EAGLE", **TREE)


# draft trees at page size 16 (docs/speculative_trees.md, "4.5 Page size > 1 (second step)"):
# each lane takes whole pages, every later lane a copy of the prefix's partial page (the draft
# pool's move_kv_cache), the verify's accepted nodes compacted (the target pool's); sglang
# runs trees at page > 1 on flashinfer or fa3 only, flashinfer's prefill needs heads of 128
PAGED_TREE = dict(page_size=16, attention_backend="flashinfer", **TREE)
# sglang 0.5.12 lays out the slots of a paged round in which no request's prefix ends inside
# a page wrongly (its assign_draft_cache_locs skips their rewrite), and may give a lane that
# spans two pages a column's earlier slot (the kernel reads back req_to_token with no barrier):
# e2e_support/sitecustomize.py reads every round's lane slots from req_to_token, in the
# canary-off and -on runs
PAGED_LANES_REWRITTEN = {"KV_CANARY_TEST_PAGED_LANES_REWRITTEN": "1"}


def test_tree_paged_clean_matches_canary_off(head_dim_128_models):
    """A draft tree (topk 2, 3 steps, 6 draft tokens) at page size 16 with the canary in raise
    mode, real data, a sweep and token checks: outputs equal to the canary off's, no violation
    (the records followed every partial-page copy and every compaction, each lane verified
    from its own pages), both canaries reserved."""
    out, on, off = run_clean_pair(
        head_dim_128_models, "spec_v1", PAGED_LANES_REWRITTEN, **UNCHUNKED, **PAGED_TREE
    )
    assert "kv_canary installed on the EAGLE draft worker: mode=raise" in out, out[-4000:]
    assert_clean_and_both_canaries_reserved(out, on, off)


@pytest.mark.parametrize("worker", ["draft", "target"])
def test_tree_paged_every_fault_class_is_caught_in_each_pool(head_dim_128_models, worker):
    env = dict(
        EVERY_FAULT_ENV, SGLANG_KV_CANARY_PERTURB_TARGET_WORKER=worker, **PAGED_LANES_REWRITTEN
    )
    assert_every_fault_caught_in_a_log_run(
        head_dim_128_models, "spec_v1", env, "EAGLE", **PAGED_TREE
    )


def test_tree_paged_rounds_without_a_partial_page_are_reported(head_dim_128_models):
    """sglang 0.5.12 as it runs, one request at a time (each prompt's draft rounds pass its
    committed length 48 alone): in a round whose request's prefix ends on a page boundary the
    lanes' steps are written to the allocation's first slots, not to the columns the draft
    attention reads; in a round whose lanes span two pages (``L % 16`` of 14 or 15) lane 1's
    steps may get their columns' earlier slots (the kernel's unsynchronised read-back, seen
    under load in GPU suite run 39; ``test_speculative_trees.py`` plants it). With the canary
    in raise mode and token checks: outputs equal to the canary off's (the draft pool's
    reports are logged, not acted on), the target pool clean, and every draft report at the
    stale step read (position L) or the step written after it (L + 1) of such a round: a
    position of 14, 15, 0 or 1 modulo 16."""
    engine = dict(UNCHUNKED, max_running_requests=1, **PAGED_TREE)
    rc, out, off = run(head_dim_128_models, "spec_v1", **engine)
    assert rc == 0 and off is not None, out[-4000:]
    rc, out, on = run(
        head_dim_128_models,
        "spec_v1",
        {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"},
        kv_canary="raise",
        kv_canary_real_data="partial",
        **engine,
    )
    assert rc == 0 and on == off and len(on) == 12, out[-4000:]
    seen = violations_by_pool(out)
    assert seen and {pool for pool, _ in seen} == {"draft"}, seen
    assert {v.read_position % 16 for _, v in seen} <= {14, 15, 0, 1}, seen


# NGRAM (docs/speculative_standalone_ngram.md, "2. NGRAM (n-gram lookup, no draft model)"):
# no draft model; sglang runs it on spec v1, its verify's trees of 6 nodes, 3 per level
NGRAM = dict(speculative_num_draft_tokens=6, speculative_ngram_max_bfs_breadth=3)


def assert_only_the_target_guarded(out: str) -> None:
    """NGRAM: the canary installed once, on the target (its worker's runner is the
    target's), with no draft pool reserved."""
    assert out.count("kv_canary installed: ") == 1, out[-4000:]
    assert "draft worker" not in out
    memory = workload_info(out)["kv_canary"]["memory"]
    assert memory.get("draft") is None, memory


@pytest.fixture
def ngram_models(models):
    """(target, no draft model)."""
    return models[0], None


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_ngram_clean_matches_canary_off(request, backend):
    """NGRAM (6 draft tokens, breadth 3; the tiny model's repetitive greedy output feeds the
    corpus) with the canary in raise mode, real data, a sweep and token checks: outputs equal
    to the canary off's, no violation, the target's canary reserved as built, none on a
    draft."""
    ngram_models = (models_for(request, backend)[0], None)
    out, on, off = run_clean_pair(
        ngram_models, "spec_v1", algorithm="NGRAM", **UNCHUNKED, attention_backend=backend, **NGRAM
    )
    assert parse_violation_lines(out) == []
    assert on == off and len(on) == 12
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert stats and all("violations=0" in s for s in stats)
    assert_memory_reserved_as_allocated(workload_info(out))
    assert_only_the_target_guarded(out)


def test_ngram_every_fault_class_is_caught_in_the_target_pool(ngram_models):
    """Every fault class injected into the target's pool (NGRAM's only one), in log mode,
    real data partial, a sweep every 2 steps: all 48 requests served, every fault caught. The
    48-request workload: NGRAM accepts so many tokens per verify that the 12 short requests
    end a few forwards after the faults' warm-up (GPU suite run 36: the one byte flipped after
    a forward was flipped after the last one, and nothing read or swept it)."""
    assert_ngram_faults_caught(ngram_models, **NGRAM)


def assert_ngram_faults_caught(models, **settings) -> None:
    """Every fault class in NGRAM's target pool (log mode, real data partial, a sweep every 2
    steps) over the 48-request workload: all served, only the target guarded, every fault
    caught."""
    env = dict(EVERY_FAULT_ENV, SGLANG_KV_CANARY_PERTURB_TARGET_WORKER="target")
    rc, out, res = run(
        models,
        "spec_v1",
        env,
        script="workload.py",
        algorithm="NGRAM",
        kv_canary="log",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
        **settings,
    )
    assert rc == 0 and res is not None and len(res) == 48, out[-4000:]
    assert_only_the_target_guarded(out)
    assert_every_fault_caught(out)


# NGRAM at page size 16: sglang compacts each verify's accepted nodes with move_kv_cache
# (docs/speculative_standalone_ngram.md, "2.6 Page size > 1"); it runs trees at page > 1 on
# flashinfer only, whose prefill needs the heads of 128
PAGED_NGRAM = dict(page_size=16, attention_backend="flashinfer", **NGRAM)


def test_ngram_paged_clean_matches_canary_off(head_dim_128_models):
    """NGRAM at page size 16 with the canary in raise mode, real data, a sweep and token
    checks: outputs equal to the canary off's, no violation (the records followed every
    compaction), the target's canary reserved as built, none on a draft."""
    models = (head_dim_128_models[0], None)
    out, on, off = run_clean_pair(models, "spec_v1", algorithm="NGRAM", **UNCHUNKED, **PAGED_NGRAM)
    assert parse_violation_lines(out) == []
    assert on == off and len(on) == 12
    assert_memory_reserved_as_allocated(workload_info(out))
    assert_only_the_target_guarded(out)


def test_ngram_paged_every_fault_class_is_caught(head_dim_128_models):
    """Every fault class injected into NGRAM's target pool at page size 16, in log mode, real
    data partial, a sweep every 2 steps, over the 48-request workload: every fault caught."""
    assert_ngram_faults_caught((head_dim_128_models[0], None), **PAGED_NGRAM)


# the PR regressions with a draft chain (spec v1 and v2) and a draft tree (spec v1)
CHAIN_AND_TREE = [("spec_v1", "chain"), ("spec_v2", "chain"), ("spec_v1", "tree")]
SHAPES = {"chain": {}, "tree": TREE}


@pytest.mark.parametrize("spec, shape", CHAIN_AND_TREE)
def test_pr25015_draft_positions_advanced_before_the_forward(models, spec, shape):
    """Upstream PR 25015, re-introduced by a test-only hook (``KV_CANARY_TEST_PR25015``): each
    draft forward runs at the next position. The draft canary stops the server with the
    stored position (``SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act``: by default a draft pool's
    reports are logged only); the same workload without the hook is clean (the test above)."""
    env = {"KV_CANARY_TEST_PR25015": "1", "SGLANG_KV_CANARY_DRAFT_VIOLATIONS": "act"}
    rc, out, _ = run(models, spec, env, kv_canary="raise", **UNCHUNKED, **SHAPES[shape])
    assert rc != 0, out[-3000:]
    lines = parse_violation_lines(out)
    reasons = {r for v in lines for r in v.fail_reasons}
    assert reasons & {"verify_position", "write_position"}, out[-3000:]


@pytest.mark.parametrize("spec, shape", CHAIN_AND_TREE)
def test_pr26329_chunk_end_draft_token_is_reported(models, spec, shape):
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
    rc, out, res = run(
        models,
        spec,
        {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"},
        kv_canary="log",
        chunked_prefill_size=64,
        **SHAPES[shape],
    )
    assert rc == 0 and res is not None, out[-3000:]
    lines = parse_violation_lines(out)
    summary = sorted(
        {
            (v.launch_tag, v.fail_reasons, v.slot_idx, v.position, v.stored_token, v.expected_token)
            for v in lines
        }
    )
    reasons = {r for v in lines for r in v.fail_reasons}
    assert "verify_token" in reasons, summary
    assert reasons <= {"verify_token", "verify_chain_hash"}, summary
    token_lines = [v for v in lines if "verify_token" in v.fail_reasons]
    assert 21 in {v.position for v in token_lines}, summary
    # each token report expects the prompt token after its position (the draft pool's
    # offset): chunk ends inside prompts, nowhere else
    prompts = [p for wave in load_support_script("small_workload.py").waves() for p in wave]
    for v in token_lines:
        assert any(
            v.position + 1 < len(p) and p[v.position + 1] == v.expected_token for p in prompts
        ), v


# ---- adaptive step counts -----------------------------------------------------------------------

# accepted drafts fed to sglang's adaptive controller, one per verify, in a cycle (the test hook
# KV_CANARY_TEST_ADAPTIVE_ACCEPT): with the candidates 1, 2, 4 (and the initial 3) and each
# verify deciding alone, the worker climbs to 4 steps, falls to 1, and passes 2 and 3 both ways
ADAPTIVE_ACCEPT = "6,6,0,0,1,2,6,1"
ADAPTIVE_CONFIG = {
    "candidate_steps": [1, 2, 4],
    "warmup_batches": 0,
    "update_interval": 1,
    "ema_alpha": 1.0,
}


@pytest.mark.parametrize("spec", sorted(SPEC))
def test_adaptive_steps_switch_while_serving(models, spec, tmp_path):
    """``--speculative-adaptive``: sglang captures every candidate's draft, draft-extend and
    target-verify graphs at start-up and switches between them while serving. With the switches
    forced both ways, the canary's servers give the outputs of the canary off with zero
    violations, and every fault class injected into the draft pool is caught."""
    config = tmp_path / "adaptive.json"
    config.write_text(json.dumps(ADAPTIVE_CONFIG))
    adaptive = dict(speculative_adaptive=True, speculative_adaptive_config=str(config))
    env = {"KV_CANARY_TEST_ADAPTIVE_ACCEPT": ADAPTIVE_ACCEPT}
    rc, out, off = run(models, spec, env, **adaptive, **UNCHUNKED)
    assert rc == 0 and off is not None, out[-4000:]
    rc, out, on = run(
        models,
        spec,
        dict(env, SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT="1"),
        kv_canary="raise",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=3,
        **adaptive,
        **UNCHUNKED,
    )
    assert rc == 0, out[-4000:]
    assert "kv_canary installed on the EAGLE draft worker: mode=raise" in out, out[-4000:]
    switches = {
        tuple(int(x) for x in m)
        for m in re.findall(r"Switch adaptive runtime state: steps (\d+) -> (\d+)", out)
    }
    # every candidate reached, up and down
    assert {to for _, to in switches} >= {1, 2, 4}, switches
    assert any(a < b for a, b in switches) and any(a > b for a, b in switches), switches
    assert parse_violation_lines(out) == []
    assert on == off
    rc, out, res = run(
        models,
        spec,
        dict(env, **EVERY_FAULT_ENV, SGLANG_KV_CANARY_PERTURB_TARGET_WORKER="draft"),
        kv_canary="log",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
        **adaptive,
    )
    assert rc == 0 and res is not None, out[-4000:]
    assert "Switch adaptive runtime state" in out
    assert_every_fault_caught(out)


# ---- EAGLE3 and NEXTN (MTP) ---------------------------------------------------------------------

OTHER_ALGORITHMS = {"EAGLE3": "MHATokenToKVPool", "NEXTN": "MLATokenToKVPool"}


@pytest.fixture(scope="module", params=sorted(OTHER_ALGORITHMS))
def algorithm_models(request, tmp_path_factory):
    return request.param, write_models(tmp_path_factory, request.param)


def test_other_algorithms_clean_matches_canary_off(algorithm_models):
    """EAGLE3 and NEXTN, spec v2: the clean test of EAGLE above, with both canaries' pools
    named in the log (NEXTN: the MLA pools of the target and of its NextN draft)."""
    algorithm, models = algorithm_models
    rc, out, off = run(models, "spec_v2", algorithm=algorithm, **UNCHUNKED)
    assert rc == 0 and off is not None, out[-4000:]
    rc, out, on = run(
        models,
        "spec_v2",
        {
            "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
            "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "5",
        },
        algorithm=algorithm,
        kv_canary="raise",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=3,
        **UNCHUNKED,
    )
    assert rc == 0, out[-4000:]
    pool = OTHER_ALGORITHMS[algorithm]
    installed = [line for line in out.splitlines() if "kv_canary installed" in line]
    assert any(
        "on the EAGLE draft worker" in line and f"pool={pool}" in line for line in installed
    ), installed
    assert any(
        "on the EAGLE draft worker" not in line and f"pool={pool}" in line for line in installed
    ), installed
    assert parse_violation_lines(out) == []
    assert on == off and len(on) == 12


@pytest.mark.parametrize("worker", ["draft", "target"])
def test_other_algorithms_every_fault_class_is_caught(algorithm_models, worker):
    algorithm, models = algorithm_models
    env = dict(EVERY_FAULT_ENV, SGLANG_KV_CANARY_PERTURB_TARGET_WORKER=worker)
    assert_every_fault_caught_in_a_log_run(models, "spec_v2", env, "EAGLE", algorithm=algorithm)


# ---- STANDALONE: a separate small draft LM --------------------------------------------------

# Triton attention (the device bundles have no FA3)
STANDALONE = dict(algorithm="STANDALONE", attention_backend="triton")
# what the start-up warning for STANDALONE with the radix cache on says
RADIX_KEYS_WARNING = "keys STANDALONE's radix cache by single tokens"


@pytest.fixture(scope="module")
def standalone_models(tmp_path_factory):
    return write_models(tmp_path_factory, "STANDALONE")


@pytest.mark.parametrize("spec", sorted(SPEC))
def test_standalone_clean_matches_canary_off(standalone_models, spec):
    """STANDALONE with the radix cache off (sglang 0.5.12's single-token keys report every
    divergent shared prefix: test_standalone_radix_keys_...): the clean test of EAGLE above,
    both canaries installed on their MHA pools, the draft's memory reserved for its own
    3-layer pool as it was then built, no radix-key warning."""
    kw = dict(STANDALONE, disable_radix_cache=True, **UNCHUNKED)
    rc, out, off = run(standalone_models, spec, **kw)
    assert rc == 0 and off is not None, out[-4000:]
    rc, out, on = run(
        standalone_models,
        spec,
        {
            "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
            "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "5",
        },
        kv_canary="raise",
        kv_canary_real_data="partial",
        **kw,
    )
    assert rc == 0, out[-4000:]
    installed = [line for line in out.splitlines() if "kv_canary installed" in line]
    assert any(
        "on the STANDALONE draft worker: mode=raise" in line and "pool=MHATokenToKVPool" in line
        for line in installed
    ), installed
    assert any(
        "draft worker" not in line and "pool=MHATokenToKVPool" in line for line in installed
    ), installed
    assert "EAGLE draft worker" not in out and RADIX_KEYS_WARNING not in out
    assert_clean_and_both_canaries_reserved(out, on, off)


@pytest.mark.parametrize("worker", ["draft", "target"])
@pytest.mark.parametrize("spec", sorted(SPEC))
def test_standalone_every_fault_class_is_caught_in_each_pool(standalone_models, spec, worker):
    """Every fault class, injected into the STANDALONE draft pool only and into the target pool
    only, is caught (the settings of EAGLE's fault test above: the radix cache on, whose
    divergent-prefix reports come on top of the faults' in log mode). A post-forward fault is
    likelier and the budget larger: a draft round's forwards draw none, and this workload's
    run is short enough that at 0.15 a pool could see none."""
    env = dict(
        EVERY_FAULT_ENV,
        SGLANG_KV_CANARY_PERTURB_TARGET_WORKER=worker,
        SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB="0.4",
        SGLANG_KV_CANARY_PERTURB_MAX_FAULTS="20",
    )
    assert_every_fault_caught_in_a_log_run(standalone_models, spec, env, "STANDALONE", **STANDALONE)


def shared_prefix_lengths() -> list:
    """The small workload's shared prefix lengths m (each wave's prompts are its shared
    prefix and two tokens of their own): 40 and 64."""
    prompts = [p for wave in load_support_script("small_workload.py").waves() for p in wave]
    lengths = sorted({len(p) - 2 for p in prompts})
    assert lengths == [40, 64], lengths
    return lengths


@pytest.mark.parametrize("spec", sorted(SPEC))
def test_standalone_radix_keys_report_each_divergent_shared_prefix(standalone_models, spec):
    """sglang 0.5.12 keys STANDALONE's radix cache by single tokens (EAGLE's by token pairs).
    The workload's waves each send 4 prompts sharing a prefix of m = 40 or 64 tokens and
    differing at m, in one prefill batch; after it the tree insert swaps the prefix of all but
    one of them to the first one's slots, whose draft KV at m - 1 was computed from that
    request's token m (and a later wave's prefix hit reuses it too). With the radix cache on,
    token checks and ``--kv-canary log``, the draft canary reports exactly ``verify_token`` at
    m - 1 and ``verify_chain_hash`` at m for each m, and nothing in the target pool; the
    start-up warning says so. Under ``--kv-canary raise`` the server serves on: a draft pool's
    reports are logged (saying why they are not acted on) and counted, the live counts in
    ``get_server_info()``'s ``internal_states`` name the pool. Unchunked prompts: no
    chunk-end report of PR 26329 mixes in."""
    rc, out, res = run(
        standalone_models,
        spec,
        {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"},
        kv_canary="raise",
        **STANDALONE,
        **UNCHUNKED,
    )
    assert rc == 0 and res is not None and len(res) == 12, out[-4000:]
    assert RADIX_KEYS_WARNING in out and "not acted on" in out, out[-4000:]
    assert "Not acted on (--kv-canary raise)" in out, out[-4000:]
    (live,) = workload_info(out)["kv_canary_live"]
    assert live["draft"]["acting_mode"] == "log" and live["draft"]["violations"] >= 2, live
    assert live["target"] == dict(live["target"], violations=0, acting_mode="raise"), live
    # each wave's prompts are its shared prefix and two tokens of their own
    divergences = shared_prefix_lengths()
    want = {("draft", "verify_token", m - 1) for m in divergences} | {
        ("draft", "verify_chain_hash", m) for m in divergences
    }
    got = pool_reports(out)
    assert got == want, sorted(got)


# ---- PR 28254: a resumed request's chunk end inside its output ----------------------------------

RETRACT_ENV = {
    "SGLANG_TEST_RETRACT": "1",
    "SGLANG_TEST_RETRACT_INTERVAL": "12",
    "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
}


def _output_chunk_ends(out: str) -> set:
    """Positions at which a re-prefill chunk ended inside a request's output (the hook's
    lines)."""
    return {
        int(line.split("chunk end at position ")[1].split()[0])
        for line in out.splitlines()
        if line.startswith("KV_CANARY_TEST_PR28254:") and " inside the output " in line
    }


@pytest.mark.parametrize("spec, shape", CHAIN_AND_TREE)
def test_pr28254_resumed_request_chunk_end_inside_its_output(models, spec, shape):
    """Upstream PR 28254. sglang 0.5.12 lacks the chunk-end fix of PRs 26329 / 26800 (the
    test above); the hook ``KV_CANARY_TEST_PR28254`` applies it. ``fixed``: the draft input
    of a non-final chunk ends with the next token of the prompt followed by the output, as
    upstream does since PR 28254. ``buggy``: with the next prompt token only, so where a
    retracted and resumed request's re-prefill chunk ends inside its output, the draft keeps
    the token the target sampled (PR 28254's bug). Workload: sglang's test retraction every
    12 forwards, 64-token chunks, 6 requests x (40 prompt + 160 output tokens) at temperature
    1, the radix cache off (with it on, sglang 0.5.12 finds most of a resumed request's
    prompt and output in the tree and re-prefills a few tokens: no chunk ends inside the
    output). Both runs reach chunk ends inside outputs (the hook prints each); the fixed run
    is clean; the buggy one reports ``verify_token`` in the draft pool at those positions.
    With a draft chain (spec v1 and v2) and a draft tree (spec v1, topk 2: the same draft
    extend of each prefill chunk)."""
    ends, lines = {}, {}
    for variant in ("fixed", "buggy"):
        rc, out, res = run(
            models,
            spec,
            dict(RETRACT_ENV, KV_CANARY_TEST_PR28254=variant),
            script="retract_workload.py",
            kv_canary="log",
            chunked_prefill_size=64,
            disable_radix_cache=True,
            **SHAPES[shape],
        )
        assert rc == 0 and res == [160] * 6, out[-4000:]
        assert "Testing retraction" in out, out[-4000:]
        ends[variant] = _output_chunk_ends(out)
        assert ends[variant], (variant, out[-4000:])  # the workload reached the bug's case
        lines[variant] = parse_violation_lines(out)
    assert lines["fixed"] == [], sorted({(v.fail_reasons, v.position) for v in lines["fixed"]})
    buggy = lines["buggy"]
    summary = sorted(
        {
            (v.launch_tag, v.fail_reasons, v.position, v.stored_token, v.expected_token)
            for v in buggy
        }
    )
    token_positions = {v.position for v in buggy if "verify_token" in v.fail_reasons}
    assert token_positions, summary
    assert token_positions <= ends["buggy"], (summary, sorted(ends["buggy"]))
    assert {r for v in buggy for r in v.fail_reasons} <= {"verify_token", "verify_chain_hash"}, (
        summary
    )


# the token oracle with speculative decoding (its design: docs/speculative_coverage.md,
# "The token oracle with speculative decoding"): the verify commits the oracle's tokens, the
# write-input check runs in both pools
ORACLE_CASES = {
    "spec_v2-chain": ("spec_v2", "EAGLE", {}),
    "spec_v1-chain": ("spec_v1", "EAGLE", {}),
    "spec_v1-tree": ("spec_v1", "EAGLE", TREE),
    "spec_v1-ngram": ("spec_v1", "NGRAM", NGRAM),
}
ORACLE_ENV = {
    "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT": "1",
    "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
}


def run_oracle(models, case: str, env_extra=None, **engine_kwargs):
    spec, algorithm, shape = ORACLE_CASES[case]
    if algorithm == "NGRAM":
        models = (models[0], None)
    return run(
        models,
        spec,
        {**ORACLE_ENV, **(env_extra or {})},
        script="oracle_workload.py",
        algorithm=algorithm,
        attention_backend="triton",
        **UNCHUNKED,
        **shape,
        **engine_kwargs,
    )


def oracle_outputs(results) -> list:
    """What each request's output must be: the oracle's token at each position after its
    prompt."""
    import torch

    from sglang.srt.kv_canary.token_oracle import oracle_tokens, request_oracle_key

    want = []
    for r in results:
        n = len(r["output_ids"])
        keys = torch.full((n,), request_oracle_key(r["rid"]))
        positions = torch.arange(r["prompt_len"], r["prompt_len"] + n)
        want.append(oracle_tokens(keys, positions, 512).tolist())
    return want


@pytest.mark.parametrize("case", sorted(ORACLE_CASES))
def test_token_oracle_outputs_are_the_oracles_tokens(models, case):
    """``--sampling-backend token_oracle`` with the write-input check and token checks, raise
    mode: every request's output is the oracle's (the verify's walk took the oracle's
    predictions: none of the target's argmax), no violation in either pool (the verify's
    roots and the draft extends checked against the oracle, the proposals not), the draft
    canary installed where there is a draft model."""
    rc, out, res = run_oracle(models, case, kv_canary_real_data="partial")
    assert rc == 0 and res is not None, out[-4000:]
    assert parse_violation_lines(out) == []
    assert "token_oracle=on" in out and "write_input_check=on" in out, out[-4000:]
    assert [len(r["output_ids"]) for r in res] == [12] * len(res)
    assert [r["output_ids"] for r in res] == oracle_outputs(res)
    if ORACLE_CASES[case][1] == "EAGLE":
        assert "kv_canary installed on the EAGLE draft worker" in out, out[-4000:]


@pytest.mark.parametrize("case", ["spec_v1-chain", "spec_v2-chain"])
def test_token_oracle_swap_is_a_write_token_violation(models, case):
    """The next-token-swap self-test on a speculative server: two requests' root predictions
    swapped in the verify; the swapped tokens are written by the next verify (target) and the
    draft extend (draft), where the write-input check reports ``write_token``."""
    env = {
        "SGLANG_KV_CANARY_PERTURB_NEXT_TOKEN_SWAP_PROB": "0.3",
        "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "4",
    }
    rc, out, res = run_oracle(models, case, env, kv_canary="log")
    assert rc == 0 and res is not None, out[-4000:]
    injected = [f for f in map(parse_perturb_line, out.splitlines()) if f]
    assert any(f["fault"] == "next_token_swap" for f in injected), out[-4000:]
    found = violations_by_pool(out)
    assert any("write_token" in v.fail_reasons for _, v in found), out[-4000:]


# ---- DFLASH: a block draft fed by the target's hidden states -------------------------------

# sglang runs DFLASH with one step, topk 1, and the block size as its draft tokens (spec v1:
# it turns the overlap scheduler off itself); Triton attention (the bundles have no FA3)
DFLASH = dict(
    algorithm="DFLASH",
    attention_backend="triton",
    speculative_num_steps=1,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=4,
)


@pytest.fixture(scope="module")
def dflash_models(tmp_path_factory):
    """The tiny DFLASH pair (``write_tiny_dflash_pair``): a two-layer target with
    ``target_layer_ids`` [0, 1] stopped the canary-off server ("DFLASH target_hidden feature
    dim mismatch ... got shape=(64, 64)"): its last layer's output is never captured."""
    return write_tiny_dflash_pair(
        tmp_path_factory.mktemp("target_dflash"), tmp_path_factory.mktemp("dflash_draft")
    )


def assert_dflash_faults_caught(models, worker: str, **engine_kwargs) -> None:
    """Every fault class injected into the DFLASH pool ``worker`` names is caught (a log run).
    The draft runner's forwards are draft blocks on borrowed slots, which draw no post-forward
    fault (the verify's append rewrites them): its pool's faults are the req_to_token entries
    and bytes its blocks read and the cached slots the sweep reads."""
    env = dict(
        EVERY_FAULT_ENV,
        SGLANG_KV_CANARY_PERTURB_TARGET_WORKER=worker,
        SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB="0.4",
        SGLANG_KV_CANARY_PERTURB_MAX_FAULTS="20",
    )
    assert_every_fault_caught_in_a_log_run(
        models, "spec_v1", env, "DFLASH", post_forward=worker == "target", **engine_kwargs
    )


@pytest.mark.parametrize("chunks", ["unchunked", "chunked"])
def test_dflash_clean_matches_canary_off(dflash_models, chunks):
    """DFLASH with the radix cache on (its keys are plain tokens: a shared prefix's draft KV
    was appended from the same tokens): the clean test of EAGLE above, both canaries installed
    on their MHA pools, the draft's memory reserved for its own pool; chunked: prompts split
    into prefill chunks of 64, each followed by its draft KV append."""
    kw = dict(DFLASH, **(UNCHUNKED if chunks == "unchunked" else {}))
    out, on, off = run_clean_pair(dflash_models, "spec_v1", **kw)
    installed = [line for line in out.splitlines() if "kv_canary installed" in line]
    assert any(
        "on the DFLASH draft worker: mode=raise" in line and "pool=MHATokenToKVPool" in line
        for line in installed
    ), installed
    assert any(
        "draft worker" not in line and "pool=MHATokenToKVPool" in line for line in installed
    ), installed
    assert "EAGLE draft worker" not in out
    assert_clean_and_both_canaries_reserved(out, on, off)


@pytest.mark.parametrize("worker", ["draft", "target"])
def test_dflash_every_fault_class_is_caught_in_each_pool(dflash_models, worker):
    """Every fault class, injected into the DFLASH draft pool only and into the target pool
    only, is caught."""
    assert_dflash_faults_caught(dflash_models, worker, **DFLASH)


def test_dflash_token_oracle_outputs_are_the_oracles_tokens(dflash_models):
    """``--sampling-backend token_oracle`` with DFLASH, the write-input check and token checks,
    raise mode: DFLASH's verify (``DFlashVerifyInput.verify``) commits the oracle's tokens, so
    every output is the oracle's; no violation in either pool; the draft canary keeps its
    token checks and runs no write-input check (its forwards write no records)."""
    rc, out, res = run(
        dflash_models,
        "spec_v1",
        ORACLE_ENV,
        script="oracle_workload.py",
        kv_canary_real_data="partial",
        **UNCHUNKED,
        **DFLASH,
    )
    assert rc == 0 and res is not None, out[-4000:]
    assert parse_violation_lines(out) == []
    assert "kv_canary: no write-input check on the DFLASH draft pool" in out, out[-4000:]
    assert [len(r["output_ids"]) for r in res] == [12] * len(res)
    assert [r["output_ids"] for r in res] == oracle_outputs(res)


# DFLASH at page size 16: the draft block and the verify each continue a request's last page
# (alloc_extend from its slot at L - 1), and a verify keeps the uncommitted slots up to the
# committed length's page end, which the next round's block and verify take again
PAGED_DFLASH = dict(DFLASH, page_size=16)


def test_dflash_paged_clean_matches_canary_off(dflash_models):
    """DFLASH at page size 16, chunked prefills of 64 (whole pages), the radix cache on: the
    clean test above, outputs equal to the canary off's, no violation in either pool."""
    out, on, off = run_clean_pair(dflash_models, "spec_v1", **PAGED_DFLASH)
    assert "kv_canary installed on the DFLASH draft worker: mode=raise" in out, out[-4000:]
    assert_clean_and_both_canaries_reserved(out, on, off)


@pytest.mark.parametrize("worker", ["draft", "target"])
def test_dflash_paged_every_fault_class_is_caught_in_each_pool(dflash_models, worker):
    assert_dflash_faults_caught(dflash_models, worker, **PAGED_DFLASH)


# DFLASH with a draft window: the draft runner keeps its own compact req_to_token (a request's
# last W' = min(16, L) committed positions, widened to a page boundary at page size 16); its
# blocks carry seq_lens W' and the absolute positions, and the draft canary maps positions
# through the target's table (docs/speculative_multilayer_adaptive_dflash_mtp.md,
# "3.4 Changes to the canary")
WINDOW_DFLASH = dict(DFLASH, speculative_draft_window_size=16)


@pytest.mark.parametrize("page_size", [1, 16])
def test_dflash_window_clean_matches_canary_off(dflash_models, page_size):
    """DFLASH with ``--speculative-draft-window-size 16`` (prompts longer than the window,
    the radix cache on): sglang's compact draft cache on (its own start-up line), outputs
    equal to the canary off's, no violation in either pool."""
    kw = dict(WINDOW_DFLASH, page_size=page_size)
    out, on, off = run_clean_pair(dflash_models, "spec_v1", **kw)
    assert "draft_window_size=16, compact_cache=True" in out, out[-4000:]
    assert "kv_canary installed on the DFLASH draft worker: mode=raise" in out, out[-4000:]
    assert_clean_and_both_canaries_reserved(out, on, off)


def test_dflash_window_every_fault_class_is_caught_in_the_draft_pool(dflash_models):
    """Every fault class injected into the draft pool of a DFLASH server with a draft window
    is caught (the target pool's faults do not depend on the draft's window)."""
    assert_dflash_faults_caught(dflash_models, "draft", **WINDOW_DFLASH)


# ---- FROZEN_KV_MTP: a Gemma4 MTP assistant reading the target's KV ---------------------------

# sglang runs FROZEN_KV_MTP on spec v1 only (it turns the overlap scheduler off itself) and
# sets no default for steps, topk or draft tokens: all three given; Triton attention
FROZEN_KV_MTP = dict(
    algorithm="FROZEN_KV_MTP",
    attention_backend="triton",
    speculative_num_steps=3,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=4,
)
# sglang 0.5.12 stops a FROZEN_KV_MTP server when a verify finishes every running request and
# the next requests' prefill is merged before the scheduler filtered them (upstream PR 26859;
# with the canary on or off, timing-dependent: GPU suite run 40): both runs of each test with
# the work-around (e2e_support/pr26859.py)
PR26859 = {"KV_CANARY_TEST_PR26859": "1"}
# install_canary's line for the assistant's runner (its pool is a 64-slot stand-in)
NO_FROZEN_KV_MTP_DRAFT_CANARY = (
    "kv_canary: no canary on the FROZEN_KV_MTP draft worker: it writes no KV"
)


@pytest.fixture(scope="module")
def frozen_kv_mtp_models(tmp_path_factory):
    """A four-layer tiny Gemma4 target (sliding, full, sliding, full; the last two KV-shared
    with the first two: an ``SWAKVPool``, window 32) and a two-layer MTP assistant (one
    sliding, one full layer, bound to target layers 0 and 1)."""
    return write_tiny_gemma4_pair(
        tmp_path_factory.mktemp("gemma4_target"), tmp_path_factory.mktemp("gemma4_assistant")
    )


def assert_only_the_frozen_kv_mtp_target_guarded(out: str) -> None:
    """FROZEN_KV_MTP: the canary installed once, on the target's ``SWAKVPool``; the
    assistant's runner logged without one; no draft canary reserved."""
    installed = [line for line in out.splitlines() if "kv_canary installed" in line]
    assert len(installed) == 1 and "draft worker" not in installed[0], installed
    assert "pool=SWAKVPool" in installed[0], installed
    assert NO_FROZEN_KV_MTP_DRAFT_CANARY in out, out[-4000:]
    assert "EAGLE draft worker" not in out
    memory = workload_info(out)["kv_canary"]["memory"]
    assert memory.get("draft") is None, memory


def test_frozen_kv_mtp_clean_matches_canary_off(frozen_kv_mtp_models):
    """FROZEN_KV_MTP (topk 1, 3 steps, 4 draft tokens; the assistant's seed and draft steps
    read the target's committed KV at layers 0 and 1 and write none) with the canary in raise
    mode, real data partial, a sweep every 3 steps and token checks: outputs equal to the
    canary off's, no violation, every stats line at zero, the target's canary reserved as
    built, none on the assistant (docs/speculative_multilayer_adaptive_dflash_mtp.md, "4.4
    Changes to the canary")."""
    out, on, off = run_clean_pair(
        frozen_kv_mtp_models, "spec_v1", PR26859, **UNCHUNKED, **FROZEN_KV_MTP
    )
    assert parse_violation_lines(out) == []
    assert on == off and len(on) == 12
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert stats and all("violations=0" in s for s in stats)
    assert_memory_reserved_as_allocated(workload_info(out))
    assert_only_the_frozen_kv_mtp_target_guarded(out)


def test_frozen_kv_mtp_every_fault_class_is_caught_in_the_target_pool(frozen_kv_mtp_models):
    """Every fault class injected into the target's pool (FROZEN_KV_MTP's only one; the
    ``draft`` perturbation target is refused at start-up), in log mode, real data partial, a
    sweep every 2 steps: all 12 requests served, every fault caught, the assistant unguarded."""
    env = dict(EVERY_FAULT_ENV, SGLANG_KV_CANARY_PERTURB_TARGET_WORKER="target", **PR26859)
    rc, out, res = run(
        frozen_kv_mtp_models,
        "spec_v1",
        env,
        kv_canary="log",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
        **FROZEN_KV_MTP,
    )
    assert rc == 0 and res is not None and len(res) == 12, out[-4000:]
    assert_only_the_frozen_kv_mtp_target_guarded(out)
    assert_every_fault_caught(out)


# ---- multi-layer EAGLE: the tiny Step-3.5's three MTP layers, spec v2 without CUDA graphs ----

# sglang turns --enable-multi-layer-eagle on by itself for a Step-3.5 target with EAGLE; the
# canary covers it with the overlap scheduler on and CUDA graphs off, its MTP steps then all
# running eagerly on MTP layer 0's pool (design:
# docs/speculative_multilayer_adaptive_dflash_mtp.md, "1.4 Changes to the canary"); sglang
# 0.5.12's own capture of the per-layer draft-extend graphs stops on the tiny model with
# Triton attention (the GPU diagnostic)
MULTI_LAYER = dict(disable_cuda_graph=True)


@pytest.fixture(scope="module")
def multi_layer_models(tmp_path_factory):
    """The tiny Step-3.5 (45 hybrid-SWA layers, three MTP layers, dummy weights): the
    target, and the draft read from the same directory."""
    step = write_tiny_step3p5(tmp_path_factory.mktemp("step3p5"))
    return step, step


def assert_multi_layer_guarded(out: str) -> None:
    """sglang ran multi-layer EAGLE; the canary installed on the target and on MTP layer 0's
    runner (an ``SWAKVPool`` each), which MTP layers 1 and 2 share."""
    assert "enable_multi_layer_eagle=True" in out, out[-4000:]
    installed = [line for line in out.splitlines() if "kv_canary installed" in line]
    assert len(installed) == 2, installed
    assert sum("on the EAGLE draft worker" in line for line in installed) == 1, installed
    assert all("pool=SWAKVPool" in line for line in installed), installed
    for layer in (1, 2):
        assert f"MTP layer {layer} runner shares MTP layer 0's canary" in out, out[-4000:]


@pytest.mark.parametrize("chunks", ["unchunked", "chunked"])
def test_multi_layer_eagle_clean_matches_canary_off(multi_layer_models, chunks):
    """Multi-layer EAGLE (3 MTP layers, topk 1, 4 draft tokens; spec v2, eager) with the canary
    in raise mode, real data partial, a sweep every 3 steps and token checks (the target's;
    none on the draft pool, whose MTP steps leave predicted tokens' KV): outputs equal to the
    canary off's, no violation, both canaries reserved as built; chunked: prompts split into
    prefill chunks of 64, each chunk's MTP steps writing its last positions from predictions.
    The radix cache off: with it on, shared prefixes reuse draft KV of another request's
    tokens (the radix test below)."""
    kw = dict(MULTI_LAYER, disable_radix_cache=True, **(UNCHUNKED if chunks == "unchunked" else {}))
    out, on, off = run_clean_pair(multi_layer_models, "spec_v2", **kw)
    assert_multi_layer_guarded(out)
    assert "no token checks on the multi-layer EAGLE draft pool" in out
    assert_clean_and_both_canaries_reserved(out, on, off)


@pytest.mark.parametrize("worker", ["draft", "target"])
def test_multi_layer_eagle_every_fault_class_is_caught_in_each_pool(multi_layer_models, worker):
    """Every fault class, injected into MTP layer 0's pool only (the one every MTP step
    writes: its sliding-window group, the only one it has) and into the target pool only (its
    full-attention group), is caught, in log mode."""
    env = dict(
        EVERY_FAULT_ENV,
        SGLANG_KV_CANARY_PERTURB_TARGET_WORKER=worker,
        SGLANG_KV_CANARY_PERTURB_TARGET_GROUP="swa" if worker == "draft" else "full",
    )
    out = assert_every_fault_caught_in_a_log_run(
        multi_layer_models, "spec_v2", env, "EAGLE", **MULTI_LAYER
    )
    assert_multi_layer_guarded(out)


MULTI_LAYER_RADIX_WARNING = "--enable-multi-layer-eagle with the radix cache on"


def test_multi_layer_eagle_radix_cache_reports_each_shared_prefix_boundary(multi_layer_models):
    """The radix cache on (sglang's token-pair keys), the workload's waves each sending 4
    prompts that share a prefix of m = 40 or 64 tokens in one prefill batch: the tree insert
    after it swaps all but one request's slots up to m - 2 for the first one's, whose MTP
    layer 0 KV there came from that request's tokens up to p + 3. The draft canary reports
    exactly ``verify_chain_hash`` at m - 1 for each m (each request's first own slot), nothing
    in the target pool; under ``--kv-canary raise`` the server serves every request, the
    reports logged as not acted on and counted per pool, the start-up warning says why
    (docs/speculative_multilayer_adaptive_dflash_mtp.md, "1.4 Changes to the canary")."""
    rc, out, res = run(
        multi_layer_models,
        "spec_v2",
        {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"},
        kv_canary="raise",
        **MULTI_LAYER,
        **UNCHUNKED,
    )
    assert rc == 0 and res is not None and len(res) == 12, out[-4000:]
    assert_multi_layer_guarded(out)
    assert MULTI_LAYER_RADIX_WARNING in out and "not acted on" in out, out[-4000:]
    assert "Not acted on (--kv-canary raise)" in out, out[-4000:]
    (live,) = workload_info(out)["kv_canary_live"]
    assert live["draft"]["acting_mode"] == "log" and live["draft"]["violations"] >= 2, live
    assert live["target"] == dict(live["target"], violations=0, acting_mode="raise"), live
    got = pool_reports(out)
    assert got == {("draft", "verify_chain_hash", m - 1) for m in shared_prefix_lengths()}, got


def test_multi_layer_eagle_token_oracle_commits_the_oracles_tokens(multi_layer_models):
    """``--sampling-backend token_oracle`` with the write-input check and token checks, raise
    mode, multi-layer EAGLE (spec v2, eager, the radix cache off): every request's output is
    the oracle's, no violation in either pool; the target's writes and verify are checked
    against the oracle, the shared MTP draft canary has neither check (each MTP step k writes
    the token of p + k + 1 at p)."""
    rc, out, res = run(
        multi_layer_models,
        "spec_v2",
        ORACLE_ENV,
        script="oracle_workload.py",
        kv_canary_real_data="partial",
        disable_radix_cache=True,
        **MULTI_LAYER,
        **UNCHUNKED,
    )
    assert rc == 0 and res is not None, out[-4000:]
    assert parse_violation_lines(out) == []
    assert_multi_layer_guarded(out)
    installed = [line for line in out.splitlines() if "kv_canary installed" in line]
    draft = [line for line in installed if "on the EAGLE draft worker" in line]
    target = [line for line in installed if line not in draft]
    assert all("token_oracle=on" in line for line in installed), installed
    checks = [(" token_checks=on " in x, " write_input_check=on " in x) for x in target + draft]
    assert checks == [(True, True), (False, False)], installed
    assert [len(r["output_ids"]) for r in res] == [12] * len(res)
    assert [r["output_ids"] for r in res] == oracle_outputs(res)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
