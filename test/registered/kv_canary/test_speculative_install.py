"""Speculative decoding at start-up and install (docs/user_guide.md, "Speculative decoding"):
the canary installed on a draft runner (real sglang ``MHATokenToKVPool`` on the CPU), what the
speculative coverage refuses (naming the flag), STANDALONE at topk 1 and its radix-key warning,
the draft pools it refuses, an adaptive draft sized for its largest step count, the draft
fault target's own check, and the tiny Gemma4 FROZEN_KV_MTP pair as sglang reads its configs.
The forwards themselves: ``test_speculative.py``."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest
import torch

from eagle_driver import tiny_mha_pool
from serving_driver import speculative_server_args, stand_in_model_runner
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.plan_input import LaneLayout
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


def _runner(pool, *, draft: bool):
    return stand_in_model_runner(
        pool, req_to_token=torch.zeros((16, 64), dtype=torch.int32), context_len=64, draft=draft
    )


def _spec_server_args(**kw):
    return speculative_server_args(**kw)


def test_install_canary_guards_the_draft_runner(monkeypatch, caplog):
    """``install_canary`` on an EAGLE draft runner: a canary with the draft token offset, one
    single-forward manager per draft forward of a round, the draft flag for the perturbation
    target, and no warning about an unguarded draft pool."""
    from sglang.srt.kv_canary import install

    for name in [n for n in __import__("os").environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)
    pools = [tiny_mha_pool(63) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        target = install.install_canary(
            server_args=_spec_server_args(), model_runner=_runner(pools[0], draft=False)
        )
        draft = install.install_canary(
            server_args=_spec_server_args(), model_runner=_runner(pools[1], draft=True)
        )
    assert draft is not None, "the draft runner got no canary"
    assert [g.kv_token_id_vs_position_offset for g in draft.groups] == [1]
    assert [g.kv_token_id_vs_position_offset for g in target.groups] == [0]
    assert (len(draft.sfms), draft.draft_forwards_per_round) == (3, 3)
    assert (len(target.sfms), target.draft_forwards_per_round) == (1, 0)
    assert draft.ranks.draft and not target.ranks.draft
    assert not [r for r in caplog.records if "draft" in r.getMessage()], caplog.records


def test_a_dflash_draft_canary_maps_positions_through_the_targets_req_to_token(monkeypatch):
    """``DFlashWorker.__init__`` (sglang's own arguments, its body replaced by what it does
    that the canary sees: a draft runner built with its own table, as with
    ``--speculative-draft-window-size``, whose ``init_memory_pool`` installs the canary),
    through the plugin's hook: the draft canary maps positions through the target's
    ``req_to_token``, not the draft's compact one, and is marked initialised after the call;
    a runner built outside the call keeps its own table."""
    import ast
    import importlib.util
    import inspect

    from sglang.srt.kv_canary import plugin

    for name in [n for n in __import__("os").environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)
    server_args = _spec_server_args(
        speculative_algorithm="DFLASH",
        speculative_num_steps=1,
        speculative_num_draft_tokens=4,
        speculative_draft_window_size=8,
    )
    target_table = torch.zeros((16, 64), dtype=torch.int32)
    target_worker = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(
            req_to_token_pool=types.SimpleNamespace(req_to_token=target_table)
        )
    )
    compact = torch.zeros((16, 64), dtype=torch.int32)

    def body(self, server_args, gpu_id, tp_rank, dp_rank, moe_ep_rank, attn_cp_rank,
             moe_dp_rank, nccl_port, target_worker):  # fmt: skip
        runner = stand_in_model_runner(
            tiny_mha_pool(63), req_to_token=compact, context_len=64, draft=True
        )
        runner.server_args = server_args
        plugin._after_init_memory_pool(None, runner)  # ModelRunner.init_memory_pool's hook
        assert not seam.runner_canary(runner)._init_finished  # its graphs: still to capture
        self.draft_model_runner = runner

    # the stand-in body takes sglang 0.5.12's own arguments (read from its source: importing
    # dflash_worker needs sgl_kernel's CUDA library)
    spec = importlib.util.find_spec("sglang.srt.speculative.dflash_worker")
    tree = ast.parse(open(spec.origin).read())
    init = next(
        f
        for c in tree.body
        if isinstance(c, ast.ClassDef) and c.name == "DFlashWorker"
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "__init__"
    )
    assert [a.arg for a in init.args.args] == list(inspect.signature(body).parameters)
    worker = types.SimpleNamespace()
    kwargs = dict(gpu_id=0, tp_rank=0, dp_rank=None, moe_ep_rank=0, attn_cp_rank=0)
    kwargs.update(moe_dp_rank=0, nccl_port=0, target_worker=target_worker)
    plugin._dflash_init(body, worker, server_args=server_args, **kwargs)
    draft = seam.runner_canary(worker.draft_model_runner)
    assert draft.sfms[0].req_to_token is target_table and draft._init_finished
    assert draft.ranks.block_prefix_from_positions
    assert draft.sfms[0].plan_input.block_prefix_from_positions
    outside = stand_in_model_runner(tiny_mha_pool(63), req_to_token=compact, context_len=64)
    outside.server_args = server_args
    plugin._after_init_memory_pool(None, outside)  # the target's own runner
    assert seam.runner_canary(outside).sfms[0].req_to_token is compact
    with pytest.raises(TypeError, match="without the target_worker argument"):
        plugin._dflash_init(body, worker, server_args, 0, 0)


@pytest.mark.parametrize("algorithm", ["DFLASH", "EAGLE"])
def test_a_draft_canary_under_the_oracle_keeps_token_checks_and_drops_only_dflash_write_check(
    monkeypatch, caplog, algorithm
):
    """With the token oracle's write-input check and token checks on: the DFLASH draft canary
    keeps its token checks and runs no write-input check (its forwards write no records; the
    start-up log says why), an EAGLE draft canary keeps both, the target keeps both."""
    from sglang.srt.kv_canary import install

    for name in [n for n in __import__("os").environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT", "1")
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT", "1")
    kw = dict(speculative_algorithm=algorithm, sampling_backend="token_oracle")
    if algorithm == "DFLASH":
        kw.update(speculative_num_steps=1, speculative_num_draft_tokens=4)
    args = _spec_server_args(**kw)
    with caplog.at_level(logging.INFO, logger="sglang.srt.kv_canary"):
        target = install.install_canary(
            server_args=args, model_runner=_runner(tiny_mha_pool(63), draft=False)
        )
        draft = install.install_canary(
            server_args=args, model_runner=_runner(tiny_mha_pool(63), draft=True)
        )
    configs = [(m.config.enable_verify_token_assert, m.config.enable_write_input_assert)
               for m in (target, draft)]  # fmt: skip
    said = [r.getMessage() for r in caplog.records if "no write-input check" in r.getMessage()]
    if algorithm == "DFLASH":
        assert configs == [(True, True), (True, False)]
        assert said and "on the DFLASH draft pool" in said[0], said
        assert all(sfm.expected_inputs is None for sfm in draft.sfms)
    else:
        assert configs == [(True, True), (True, True)] and not said


@pytest.mark.parametrize(
    "kw,match", [(dict(enable_multi_layer_eagle=True), "--enable-multi-layer-eagle")]
)
def test_what_speculative_coverage_refuses_names_the_flag(monkeypatch, kw, match):
    from sglang.srt.kv_canary import startup_checks

    for name in [n for n in __import__("os").environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)
    with pytest.raises(ValueError, match=match):
        startup_checks.check_server_args_for_canary(_spec_server_args(**kw))
    startup_checks.check_server_args_for_canary(_spec_server_args())  # the covered setting starts


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("algorithm", ["EAGLE", "STANDALONE"])
def test_a_draft_tree_server_guards_its_lanes_and_its_trees(monkeypatch, algorithm, page_size):
    """``--speculative-eagle-topk`` 3 starts at page size 1 and 16; the draft runner's canary
    plans its round's forwards by lane (3 lanes of 4 steps, rows for 3 per request; the
    lanes' columns laid out by the page size: a static shift at page size 1, whole pages per
    lane filled per forward at 16) and the target's writes its verify's trees (paths of at
    most steps + 1 nodes); each pool's ``move_kv_cache`` (the draft round's partial-page copy,
    the verify's compaction) is bound to that pool's own canary groups."""
    from sglang.srt.kv_canary import install, startup_checks

    for name in [n for n in __import__("os").environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)
    args = _spec_server_args(
        speculative_algorithm=algorithm,
        speculative_eagle_topk=3,
        speculative_num_draft_tokens=8,
        page_size=page_size,
    )
    startup_checks.check_server_args_for_canary(args)
    pools = [tiny_mha_pool(63) for _ in range(2)]
    target = install.install_canary(server_args=args, model_runner=_runner(pools[0], draft=False))
    draft = install.install_canary(server_args=args, model_runner=_runner(pools[1], draft=True))
    assert (draft.ranks.draft_topk, target.ranks.verify_tree_depth) == (3, 5)
    plan_input = draft.sfms[0].plan_input
    assert plan_input.lane_layout == LaneLayout(topk=3, steps=4, page_size=page_size)
    assert draft.ranks.draft_page_size == page_size and target.ranks.draft_page_size == 1
    static_shift = [0, 4, 8, 0, 4, 8] if page_size == 1 else [0] * 6
    assert plan_input.lanes.branch_shift[:6].tolist() == static_shift
    assert seam.kv_move_groups(pools[1]) == tuple(draft.groups)
    assert seam.kv_move_groups(pools[0]) == tuple(target.groups)
    assert draft.sfms[0].tree is None and target.sfms[0].plan_input.lanes is None
    assert target.sfms[0].tree.max_depth == 5
    assert draft.capacities.write_req_capacity == 3 * target.capacities.write_req_capacity


def _draft_settings_refused(monkeypatch, args, algorithm: str):
    """The start-up messages refusing the draft fault target and
    ``SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act`` on ``args`` (a server without a draft pool),
    each naming its variable and that ``algorithm`` has none."""
    from sglang.srt.kv_canary import startup_checks

    messages = []
    for var, value in (
        ("SGLANG_KV_CANARY_PERTURB_TARGET_WORKER", "draft"),
        ("SGLANG_KV_CANARY_DRAFT_VIOLATIONS", "act"),
    ):
        monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB", "0.1")
        monkeypatch.setenv(var, value)
        with pytest.raises(ValueError, match=f"{var}=.*{algorithm} has none") as exc:
            startup_checks.check_server_args_for_canary(args)
        messages.append(str(exc.value))
        monkeypatch.delenv(var)
    return messages


def test_an_ngram_server_guards_its_target_verify_trees(monkeypatch):
    """NGRAM (no draft model; sglang sets topk to the BFS breadth, 10, and 12 draft tokens)
    starts at page size 1 and 16; the target's canary writes its verify's trees (paths of up
    to 12 nodes), plans no lanes, names NGRAM, holds a verify of every request (12 tokens
    each) and is bound to its pool's ``move_kv_cache``; a draft fault target or
    ``SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act`` is refused naming the variable and that NGRAM
    has no draft model."""
    from sglang.srt.kv_canary import install, startup_checks

    _clean_canary_env(monkeypatch)
    args = _spec_server_args(
        speculative_algorithm="NGRAM",
        speculative_num_steps=None,
        speculative_eagle_topk=10,
        speculative_num_draft_tokens=12,
    )
    startup_checks.check_server_args_for_canary(args)
    paged = _spec_server_args(
        speculative_algorithm="NGRAM",
        speculative_num_steps=None,
        speculative_eagle_topk=10,
        speculative_num_draft_tokens=12,
        page_size=16,
    )
    startup_checks.check_server_args_for_canary(paged)
    pool = tiny_mha_pool(63)
    target = install.install_canary(server_args=args, model_runner=_runner(pool, draft=False))
    assert seam.kv_move_groups(pool) == tuple(target.groups)
    assert target.ranks.verify_tree_depth == 12 and target.ranks.draft_topk == 1
    assert target.sfms[0].tree.max_depth == 12 and target.sfms[0].plan_input.lanes is None
    assert target.ranks.draft_worker == "NGRAM"
    caps = target.capacities
    assert caps.write_entry_capacity >= 12 * caps.write_req_capacity
    for message in _draft_settings_refused(monkeypatch, args, "NGRAM"):
        assert "--speculative-algorithm EAGLE, EAGLE3, NEXTN, STANDALONE or DFLASH" in message


@pytest.mark.parametrize("topk,page_size", [(1, 1), (2, 1), (2, 16)])
def test_a_frozen_kv_mtp_server_guards_its_target_pool_and_installs_no_draft_canary(
    monkeypatch, caplog, topk, page_size
):
    """FROZEN_KV_MTP (its draft's layers read the target's KV and write none) starts with
    chains and trees, at page size 1 and 16 (its trees' accepted nodes are compacted in the
    target's pool, which the records follow); the target's canary writes its verify's chains
    or trees and names FROZEN_KV_MTP; the draft runner gets no canary (its pool is a stand-in)
    and says so; a draft fault target or ``SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act`` is refused
    naming the variable and that FROZEN_KV_MTP's draft writes no KV."""
    from sglang.srt.kv_canary import install, startup_checks

    _clean_canary_env(monkeypatch)
    args = _spec_server_args(
        speculative_algorithm="FROZEN_KV_MTP",
        speculative_num_steps=3,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=4 if topk == 1 else 6,
        page_size=page_size,
    )
    startup_checks.check_server_args_for_canary(args)
    pools = [tiny_mha_pool(63) for _ in range(2)]
    target = install.install_canary(server_args=args, model_runner=_runner(pools[0], draft=False))
    draft_runner = _runner(pools[1], draft=True)
    with caplog.at_level(logging.INFO, logger="sglang.srt.kv_canary"):
        draft = install.install_canary(server_args=args, model_runner=draft_runner)
    assert draft is None and seam.runner_canary(draft_runner) is None
    assert seam.kv_move_groups(pools[1]) == ()
    assert "no canary on the FROZEN_KV_MTP draft worker: it writes no KV" in caplog.text
    assert target.ranks.draft_worker == "FROZEN_KV_MTP" and not target.ranks.draft
    assert seam.kv_move_groups(pools[0]) == tuple(target.groups)
    assert target.ranks.verify_tree_depth == (0 if topk == 1 else 4)
    assert (target.sfms[0].tree is None) == (topk == 1)
    for message in _draft_settings_refused(monkeypatch, args, "FROZEN_KV_MTP"):
        assert "its draft reads the target's KV and writes none" in message


def test_the_tiny_gemma4_pair_is_read_by_sglangs_config_path(tmp_path):
    """The tiny FROZEN_KV_MTP pair of the GPU lanes
    (docs/speculative_multilayer_adaptive_dflash_mtp.md, "4.1 What sglang 0.5.12 runs") as
    sglang 0.5.12 reads it: the assistant's architecture
    promotes EAGLE to FROZEN_KV_MTP; the target is hybrid SWA (sliding layers 0 and 2, full 1
    and 3) with the ``swa_*`` fields its ``SWAKVPool`` reads; the assistant's two layers (one
    of each type) have the target's heads of 16 and 2 KV heads, and its ``backbone_hidden_size``
    is the target's hidden size."""
    from canary_support.tiny_models import write_tiny_gemma4_pair
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import _resolve_speculative_algorithm_alias

    target_dir, draft_dir = write_tiny_gemma4_pair(tmp_path / "target", tmp_path / "draft")
    assert _resolve_speculative_algorithm_alias("EAGLE", draft_dir) == "FROZEN_KV_MTP"
    target = ModelConfig(target_dir, dtype="bfloat16")
    text = target.hf_text_config
    assert target.hf_config.architectures == ["Gemma4ForCausalLM"] and target.is_hybrid_swa
    assert (target.swa_attention_layer_ids, target.full_attention_layer_ids) == ([0, 2], [1, 3])
    assert (text.num_kv_shared_layers, text.sliding_window) == (2, 32)
    assert (text.swa_num_key_value_heads, text.swa_head_dim, text.swa_v_head_dim) == (2, 16, 16)
    assert (target.head_dim, target.get_total_num_kv_heads(), text.hidden_size) == (16, 2, 64)
    draft = ModelConfig(draft_dir, dtype="bfloat16", is_draft_model=True)
    assert draft.hf_config.architectures == ["Gemma4AssistantForCausalLM"]
    assert draft.hf_config.backbone_hidden_size == text.hidden_size
    assert draft.hf_text_config.layer_types == ["sliding_attention", "full_attention"]
    assert (draft.head_dim, draft.swa_head_dim, draft.get_total_num_kv_heads()) == (16, 16, 2)
    assert draft.hf_text_config.swa_num_key_value_heads == 2


def test_the_tiny_step3p5_is_read_by_sglangs_config_path(tmp_path):
    """The tiny Step-3.5 for multi-layer EAGLE's diagnostic
    (docs/speculative_multilayer_adaptive_dflash_mtp.md, "1.1 What sglang 0.5.12 runs") as
    sglang 0.5.12 reads it: the target hybrid SWA (three sliding layers to one full) over 45
    layers, so that the MTP block sglang builds at ``layer_id = 45`` attends through layer 0
    of a draft pool; the same directory read as the draft is ``Step3p5MTP`` with one sliding
    layer; three MTP layers (one draft runner each)."""
    from canary_support.tiny_models import write_tiny_step3p5
    from sglang.srt.configs.model_config import ModelConfig

    model_dir = write_tiny_step3p5(tmp_path / "step3p5")
    target = ModelConfig(model_dir, dtype="bfloat16")
    assert target.hf_config.architectures == ["Step3p5ForCausalLM"] and target.is_hybrid_swa
    assert target.full_attention_layer_ids == list(range(3, 45, 4))
    assert len(target.swa_attention_layer_ids) == 45 - 11
    assert target.hf_config.num_hidden_layers == 45
    assert target.hf_config.num_nextn_predict_layers == 3
    assert len(target.hf_config.layer_types) == 48 and target.hf_config.layer_types[45] == (
        "sliding_attention"
    )
    draft = ModelConfig(model_dir, dtype="bfloat16", is_draft_model=True)
    assert draft.hf_config.architectures == ["Step3p5MTP"] and draft.is_hybrid_swa
    assert (draft.swa_attention_layer_ids, draft.full_attention_layer_ids) == ([0], [])
    assert (draft.head_dim, draft.get_total_num_kv_heads()) == (16, 2)


def _e2e_support_module(name):
    """A module of ``e2e_support`` (the server processes' ``PYTHONPATH``), loaded by path."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent / "e2e_support" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"e2e_support_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pr26859_a_frozen_kv_mtp_round_that_finished_every_request_leaves_an_empty_draft_input():
    """The GPU lanes' work-around of sglang 0.5.12's FROZEN_KV_MTP defect (upstream PR 26859;
    ``e2e_support/pr26859.py``): a round whose verify finished every request leaves the batch
    its ``FrozenKVMTPVerifyInput``, which has no ``merge_batch`` (the scheduler's merge of the
    next prefill stops the server); with the hook the batch holds the worker's empty draft
    input, on which the scheduler's merge of a 4-request prefill and its filter of the 4
    finished requests (spec v1) leave the prefill's rows. A round with an unfinished request
    keeps its draft input."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.frozen_kv_mtp_info import (
        FrozenKVMTPDraftInput,
        FrozenKVMTPVerifyInput,
    )

    pr26859 = _e2e_support_module("pr26859")
    empty = torch.empty((0, 4), dtype=torch.long)
    verify = FrozenKVMTPVerifyInput(
        draft_token=torch.empty((0,), dtype=torch.long),
        custom_mask=torch.empty((0,), dtype=torch.bool),
        positions=torch.empty((0,), dtype=torch.int64),
        retrieve_index=empty,
        retrieve_next_token=empty,
        retrieve_next_sibling=empty,
        retrieve_cum_len=None,
        topk=1,
        draft_token_num=4,
        spec_steps=3,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=0,
        seq_lens_cpu=torch.empty((0,), dtype=torch.int32),
    )
    assert not hasattr(verify, "merge_batch")  # sglang 0.5.12's defect: the merge would raise
    worker = SimpleNamespace(
        device="cpu",
        _recurrent_hidden_size=64,
        model_config=SimpleNamespace(dtype=torch.bfloat16),
        topk=1,
    )
    batch = SimpleNamespace(spec_info=verify)
    result = object()
    assert pr26859.idle_draft_input_after_all_finished(result, worker, batch) is result
    running = batch.spec_info
    assert type(running) is FrozenKVMTPDraftInput and running.topk_index.shape == (0, 1)
    assert running.hidden_states.shape == (0, 64)
    assert running.hidden_states.dtype == torch.bfloat16

    def prefill_input(n):
        return FrozenKVMTPDraftInput(
            bonus_tokens=torch.arange(n, dtype=torch.int64) + 100,
            hidden_states=torch.randn(n, 64).to(torch.bfloat16),
            topk_p=torch.rand(n, 1),
            topk_index=torch.arange(n, dtype=torch.int64).view(n, 1),
            capture_hidden_mode=CaptureHiddenMode.LAST,
        )

    prefill = prefill_input(4)
    running.merge_batch(prefill)  # ScheduleBatch.merge_batch: 4 finished + 4 new requests
    running.filter_batch(new_indices=torch.arange(4, 8), has_been_filtered=True)
    assert torch.equal(running.bonus_tokens, prefill.bonus_tokens)
    assert torch.equal(running.hidden_states, prefill.hidden_states)
    assert torch.equal(running.topk_index, prefill.topk_index)
    # a round that left a request unfinished: its draft input kept
    unfinished = prefill_input(2)
    batch = SimpleNamespace(spec_info=unfinished)
    pr26859.idle_draft_input_after_all_finished(result, worker, batch)
    assert batch.spec_info is unfinished
    # the hook's target is a method of sglang 0.5.12's worker (its module imports sgl_kernel's
    # CUDA ops: read from its source, not imported)
    import ast
    import importlib.util

    module, cls, method = pr26859.TARGET.rsplit(".", 2)
    tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
    (worker_class,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    assert method in [n.name for n in worker_class.body if isinstance(n, ast.FunctionDef)]


class _NgramWorkerStandIn:  # stand-in: NGRAMWorker's runner is its target worker's
    def __init__(self, target_worker):
        self.target_worker = target_worker
        self.model_runner = target_worker.model_runner


class _EagleWorkerStandIn:  # stand-in: spec v1's EAGLEWorker is the draft runner's worker
    def __init__(self, model_runner):
        self.model_runner = model_runner


def test_an_ngram_scheduler_has_no_draft_runner():
    """An ``NGRAMWorker``'s ``model_runner`` is the target's: the seam finds no draft runner
    (the plugin would otherwise install, run and report the target's canary twice), while an
    EAGLE worker's own runner is found. (sglang's scheduler and worker classes load
    ``sgl_kernel``'s CUDA ops on import: stand-ins with the attributes the seam reads.)"""
    from plugin_hooks_support import SchedulerStandIn, model_runner_with

    target_runner, draft_runner = model_runner_with(None), model_runner_with(None)
    scheduler = SchedulerStandIn(target_runner, tree_cache=None)
    scheduler.draft_worker = _NgramWorkerStandIn(scheduler.tp_worker)
    assert seam.scheduler_draft_model_runner(scheduler) is None
    scheduler.draft_worker = _EagleWorkerStandIn(draft_runner)
    assert seam.scheduler_draft_model_runner(scheduler) is draft_runner


def _clean_canary_env(monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("radix", [True, False], ids=["radix_on", "radix_off"])
def test_standalone_topk_1_is_covered_and_named(monkeypatch, caplog, radix):
    """STANDALONE (a separate draft LM, EAGLE's forwards): topk 1 starts, both runners get
    their canary (the draft's with offset 1 and one manager per draft forward), the start-up
    line and the draft pool's reports name STANDALONE, and with the radix cache on one warning
    explains its single-token keys' reports, that they are not acted on (or, with
    ``SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act``, that raise acts on each) and the flag to pass."""
    from sglang.srt.kv_canary import install, startup_checks

    _clean_canary_env(monkeypatch)
    args = _spec_server_args(speculative_algorithm="STANDALONE", disable_radix_cache=not radix)
    startup_checks.check_server_args_for_canary(args)
    pools = [tiny_mha_pool(63) for _ in range(2)]
    with caplog.at_level(logging.INFO, logger="sglang.srt.kv_canary"):
        target = install.install_canary(
            server_args=args, model_runner=_runner(pools[0], draft=False)
        )
        draft = install.install_canary(server_args=args, model_runner=_runner(pools[1], draft=True))
    assert [g.kv_token_id_vs_position_offset for g in draft.groups] == [1]
    assert [g.kv_token_id_vs_position_offset for g in target.groups] == [0]
    assert (len(draft.sfms), draft.draft_forwards_per_round) == (3, 3)
    messages = [r.getMessage() for r in caplog.records]
    assert any("kv_canary installed on the STANDALONE draft worker" in m for m in messages)
    assert not any("EAGLE draft worker" in m for m in messages), messages
    warnings = [m for m in messages if "radix cache" in m]
    if radix:
        (warning,) = warnings
        for text in (
            "STANDALONE",
            "single tokens",
            "verify_token at m - 1",
            "verify_chain_hash at m",
            "--disable-radix-cache",
            "not acted on",
        ):
            assert text in warning, warning
        # with SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act the warning says raise acts on each one
        from sglang.srt.kv_canary.config import CanaryConfig

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
            startup_checks.warn_standalone_radix_keys(
                CanaryConfig(mode="raise", draft_violations="act")
            )
        (acting,) = [r.getMessage() for r in caplog.records]
        assert "--kv-canary raise acts on each one" in acting and "not acted on" not in acting
        assert "SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act" in acting, acting
    else:
        assert warnings == []
    assert draft.ranks.describe().endswith("STANDALONE draft worker")
    assert "the STANDALONE draft model's KV pool" in draft.reporter.violations.reporter.pool


def test_a_standalone_draft_on_a_hybrid_linear_or_dsv4_pool_is_refused(monkeypatch):
    """sglang gives the draft runner of a hybrid-linear model a one-layer
    ``HybridLinearKVPool`` (meant for MTP heads); neither it nor a DeepSeek-V4 pool is guarded
    as a separate draft model's: refused at install, naming the flag. EAGLE's draft runner on
    the same pool classes is not refused here."""
    from sglang.srt.kv_canary import install
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    _clean_canary_env(monkeypatch)
    args = _spec_server_args(
        speculative_algorithm="STANDALONE", speculative_draft_model_path="/models/draft"
    )
    for cls in (HybridLinearKVPool, DeepSeekV4TokenToKVPool):
        pool = cls.__new__(cls)  # the class is what is refused; nothing else is read
        with pytest.raises(ValueError, match=f"builds a {cls.__name__}") as exc:
            install.install_canary(server_args=args, model_runner=_runner(pool, draft=True))
        assert "--speculative-draft-model-path '/models/draft'" in str(exc.value)
        assert seam.hybrid_linear_or_dsv4_pool(pool) == cls.__name__
    assert seam.hybrid_linear_or_dsv4_pool(tiny_mha_pool(15)) is None


def test_adaptive_steps_size_the_draft_canary_for_the_largest_candidate(monkeypatch, tmp_path):
    """``--speculative-adaptive``: the canary starts, and the draft runner's canary has one
    single-forward manager per draft forward of the largest step count sglang may switch to
    (its own candidates: the config file's ``candidate_steps`` or its defaults, plus the
    initial count); a config file sglang cannot read is refused naming the flag."""
    from sglang.srt.kv_canary import install, startup_checks

    for name in [n for n in __import__("os").environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)
    config = tmp_path / "adaptive.json"
    config.write_text(json.dumps({"candidate_steps": [1, 2, 6]}))
    cases = [
        (dict(speculative_adaptive=True, speculative_adaptive_config=str(config)), (1, 2, 4, 6)),
        (dict(speculative_adaptive=True, speculative_adaptive_config=None), (1, 3, 4, 7)),
        (dict(speculative_adaptive=False, speculative_adaptive_config=str(config)), (4,)),
    ]
    for kw, counts in cases:
        args = _spec_server_args(**kw)
        assert seam.speculative_facts(args).step_counts == counts
        startup_checks.check_server_args_for_canary(args)
        pool = tiny_mha_pool(63)
        draft = install.install_canary(server_args=args, model_runner=_runner(pool, draft=True))
        assert draft.draft_forwards_per_round == max(counts) - 1, kw
        assert len(draft.sfms) == max(counts) - 1, kw
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match="--speculative-adaptive-config"):
        seam.speculative_facts(
            _spec_server_args(speculative_adaptive=True, speculative_adaptive_config=str(config))
        )


def test_draft_fault_target_needs_speculative_decoding(monkeypatch):
    from sglang.srt.kv_canary import startup_checks

    for name in [n for n in __import__("os").environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB", "0.1")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_WORKER", "draft")
    startup_checks.check_server_args_for_canary(_spec_server_args())
    startup_checks.check_server_args_for_canary(
        _spec_server_args(speculative_algorithm="STANDALONE")
    )
    with pytest.raises(ValueError, match="TARGET_WORKER=draft corrupts a speculative draft"):
        startup_checks.check_server_args_for_canary(_spec_server_args(speculative_algorithm=None))
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_WORKER", "drafts")
    with pytest.raises(ValueError, match="SGLANG_KV_CANARY_PERTURB_TARGET_WORKER"):
        startup_checks.check_server_args_for_canary(_spec_server_args())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
