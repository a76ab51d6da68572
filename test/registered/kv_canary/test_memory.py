"""The canary's memory (docs/user_guide.md, "Memory"): the formula counts every tensor a built
canary holds, part by part, on every pool family; the groups predicted before sglang sizes the
pool are the ones the adapters then build; the KV budget is cut by exactly the canary's bytes
(sglang's own configurator); the reservation, report and gauge."""

from __future__ import annotations

import dataclasses
import sys
import logging

import pytest
import torch

from canary_support.tiny_models import write_tiny_deepseek_v2, write_tiny_gpt_oss
from memory_walk import canary_bytes_by_part, formula_bytes_by_part
from serving_driver import ServingDriver
from sglang.jit_kernel.kv_canary.types import PoolKind
from sglang.srt.kv_canary import install, memory_budget
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.builder import build_canary
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.kv_canary.memory import CanaryMemory, GroupGeometry, MemoryPart
from sglang.srt.kv_canary.memory_budget import (
    CanaryMemoryReservation,
    capacity_inputs_from_server_args,
    predicted_groups,
    predicted_memory,
    reserve_canary_memory,
)
from sglang.srt.kv_canary.sglang_seam import PoolFamily, PoolTokens
from sglang.srt.kv_canary.demo.server_harness import write_tiny_llama
from sglang.srt.kv_canary.token_oracle.expected_tokens import TokenOracleManager
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


def _foreign(d: ServingDriver):
    return [d.kv_pool, d.allocator, d.req_to_token_pool]


DRIVER_CONFIGS = {
    "mha": dict(),
    "mha_v_layers_tokens_sweep": dict(
        enable_mha_v=True,
        real_data="all",
        real_data_layers="all",
        verify_tokens=True,
        sweep_interval=4,
        ring_capacity=77,
    ),
    "swa_divergence_stats": dict(
        pool="swa",
        swa_window=8,
        num_swa_slots=64,
        swa_divergence_interval=3,
        enable_mha_v=True,
        real_data_layers="all",
    ),
    "dsv4": dict(pool="dsv4", swa_window=8, num_swa_slots=256, num_slots=1024),
    "mla_layers": dict(pool="mla", real_data_layers="all"),
    "nsa_layers_tokens": dict(pool="nsa", real_data_layers="all", verify_tokens=True),
    "hybrid_layers": dict(pool="hybrid", real_data_layers="all"),
}


@pytest.mark.parametrize("name", sorted(DRIVER_CONFIGS))
def test_the_formula_counts_every_tensor_a_built_canary_holds(name):
    d = ServingDriver(**DRIVER_CONFIGS[name])
    held = canary_bytes_by_part(d.manager, foreign=_foreign(d))
    assert formula_bytes_by_part(d.manager.memory) == held
    assert held[MemoryPart.RECORDS] > 0 and held[MemoryPart.PLANS] > 0
    d.step()  # a forward allocates nothing lasting
    assert canary_bytes_by_part(d.manager, foreign=_foreign(d)) == held


def _mha_pool(size=96, page_size=1, layers=3):
    return MHATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )


@pytest.mark.parametrize("sfms", [1, 3])
def test_the_formula_counts_each_single_forward_manager_and_the_write_input_check(sfms):
    """An EAGLE draft runner's canary (one manager per draft forward) and the token oracle's
    write-input check."""
    pool = _mha_pool()
    r2t = ReqToTokenPool(size=6, max_context_len=80, device="cpu", enable_memory_saver=False)
    config = CanaryConfig(
        mode="raise",
        enable_token_oracle=True,
        enable_write_input_assert=True,
        enable_verify_token_assert=True,
    )
    manager = build_canary(
        pool=pool,
        req_to_token=r2t.req_to_token,
        config=config,
        device="cpu",
        vocab_size=100,
        token_oracle=TokenOracleManager(vocab_size=100, device="cpu"),
        ranks=RankFacts(draft=True, draft_steps=sfms + 1),  # a draft round of sfms forwards
        capacity_inputs=CanaryCapacityInputs(context_len=80, chunked_prefill_size=16),
    )
    held = canary_bytes_by_part(manager, foreign=[pool, r2t])
    assert formula_bytes_by_part(manager.memory) == held
    one = CanaryMemory.for_inputs(
        dataclasses.replace(manager._memory_inputs, single_forward_managers=1)
    )
    plans = dict(manager.memory.device)[MemoryPart.PLANS]
    assert plans == sfms * dict(one.device)[MemoryPart.PLANS]


@pytest.mark.parametrize(
    "draft, topk, depth, page_size",
    [(True, 3, 5, 1), (True, 3, 5, 16), (False, 3, 5, 1), (False, 1, 12, 1)],
    ids=["draft_lanes", "draft_lanes_paged", "target_trees", "ngram_target"],
)
def test_the_formula_counts_a_draft_trees_lanes_and_parent_table(draft, topk, depth, page_size):
    """``--speculative-eagle-topk`` 3 (draft trees, 4 steps): the draft runner's canary (its
    plan rows per lane, its lane buffers, at page size 16 also each row's page stride) and the
    target's (its verify's parent table); NGRAM's target (trees of up to 12 tokens at any
    breadth): each holds exactly what the formula says, more than the same runner without
    trees."""
    r2t = ReqToTokenPool(size=6, max_context_len=80, device="cpu", enable_memory_saver=False)
    pools = []

    def built(trees):
        ranks = RankFacts(
            draft=draft,
            draft_steps=4 if draft else 0,
            **RankFacts.tree_fields(
                topk=topk if trees else 1,
                verify_tree_depth=depth if trees else 0,
                draft=draft,
                page_size=page_size,
            ),
        )
        pools.append(_mha_pool())
        return build_canary(
            pool=pools[-1],
            req_to_token=r2t.req_to_token,
            config=CanaryConfig(mode="raise", enable_verify_token_assert=True),
            device="cpu",
            ranks=ranks,
            capacity_inputs=CanaryCapacityInputs(context_len=80, chunked_prefill_size=16),
        )

    manager = built(True)
    held = canary_bytes_by_part(manager, foreign=[pools[0], r2t])
    assert formula_bytes_by_part(manager.memory) == held
    assert manager.memory.device_bytes > built(False).memory.device_bytes


# ---- the groups predicted before the pool exists ------------------------------------------------


_SWA_V_LAYERS = dict(
    pool="swa",
    swa_window=8,
    num_slots=640,
    num_swa_slots=64,
    enable_mha_v=True,
    real_data_layers="all",
)
PREDICTED = {
    # driver kwargs, family, layers, swa layers
    "mha": (dict(num_slots=640), PoolFamily.MHA, 2, 0),
    "mha_v_layers": (
        dict(num_slots=640, enable_mha_v=True, real_data_layers="all"),
        PoolFamily.MHA,
        2,
        0,
    ),
    "swa_v_layers": (_SWA_V_LAYERS, PoolFamily.SWA, 1, 1),
    # an MTP draft model's one-layer pool (Step3p5MTP, MiMoV2MTP): one sliding-window layer
    "swa_only_v_layers": (dict(_SWA_V_LAYERS, swa_only=True), PoolFamily.SWA, 0, 1),
    "mla_layers": (dict(pool="mla", num_slots=640, real_data_layers="all"), PoolFamily.MLA, 2, 0),
    "nsa_layers": (dict(pool="nsa", num_slots=640, real_data_layers="all"), PoolFamily.MLA, 2, 0),
    "hybrid_layers": (
        dict(pool="hybrid", num_slots=640, real_data_layers="all"),
        PoolFamily.MHA,
        2,
        0,
    ),
}


@pytest.mark.parametrize("name", sorted(PREDICTED))
def test_the_predicted_groups_are_the_groups_the_adapters_build(name):
    kw, family, layers, swa_layers = PREDICTED[name]
    d = ServingDriver(real_data="partial", **kw)
    page = seam.kv_pool_page_size(d.kv_pool)
    tokens = PoolTokens(max_total=kw["num_slots"], swa_total=kw.get("num_swa_slots"))
    want = predicted_groups(
        family=family,
        tokens=tokens,
        page_size=page,
        config=d.config,
        layers=layers,
        swa_layers=swa_layers,
    )
    assert want == tuple(GroupGeometry.of(g) for g in d.manager.groups)


# ---- the KV budget -----------------------------------------------------------------------------


class _ProfiledRunner:
    """What sglang's pool configurator and ``ModelRunner._resolve_max_num_reqs`` read off a
    ``ModelRunner`` whose model is loaded and whose pool is not built yet: real
    ``ServerArgs`` and ``ModelConfig`` of the tiny Llama (2 layers, 2 KV heads of 16: 256
    bytes of KV per token)."""

    from sglang.srt.model_executor.model_runner import ModelRunner as _MR

    _resolve_max_num_reqs = _MR._resolve_max_num_reqs

    def __init__(self, model_dir, **server_kw):
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.server_args = ServerArgs(
            model_path=model_dir,
            device="cpu",
            load_format="dummy",
            skip_tokenizer_init=True,
            **server_kw,
        )
        self.model_config = ModelConfig.from_server_args(self.server_args)
        self.kv_cache_dtype = torch.bfloat16
        self.mambaish_config = None
        self.num_effective_layers = self.end_layer = 2
        self.start_layer = 0
        self.is_hybrid_swa = self.use_mla_backend = self.is_draft_worker = False
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.dp_size = 1
        self.device = "cpu"


@pytest.fixture
def profiled(tmp_path, monkeypatch):
    from sglang.srt.model_executor import pool_configurator

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.setattr(pool_configurator, "get_attention_tp_size", lambda: 1)
    model = write_tiny_llama(tmp_path / "tiny")
    return lambda **kw: _ProfiledRunner(model, **kw)


CELL = 2 * 2 * 16 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16


@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(
            enable_mha_v=True,
            real_data_layers="all",
            real_kv_hash_mode="partial",
            enable_verify_token_assert=True,
            sweep_interval=2,
        ),
    ],
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_the_kv_budget_shrinks_by_exactly_the_canarys_bytes(profiled, config, page_size):
    runner = profiled(page_size=page_size, max_running_requests=16, context_length=256)
    sizing = seam.KvPoolSizing(runner)
    available = 48 << 20
    off = sizing.tokens_for(available)
    assert off.max_total == available // CELL // page_size * page_size  # sglang's own sizing
    kv, reservation = reserve_canary_memory(
        runner,
        server_args=runner.server_args,
        config=CanaryConfig(mode="raise", **config),
        capacity_inputs=CanaryCapacityInputs(context_len=256),
        available_bytes=available,
    )
    on = sizing.tokens_for(kv)
    canary = reservation.target.device_bytes
    assert reservation.tokens == on and reservation.kv_bytes == kv
    assert reservation.reserved_bytes == available - kv
    # the pool and its canary fit the budget ...
    assert on.max_total * CELL + canary <= available
    # ... and one more page would not: the pool gave up exactly the canary's bytes
    grown = PoolTokens(on.max_total + page_size)
    grown_canary, _ = predicted_memory(
        sizing,
        grown,
        config=CanaryConfig(mode="raise", **config),
        capacity_inputs=CanaryCapacityInputs(context_len=256),
        draft=None,
        device="cpu",
    )
    assert grown.max_total * CELL + grown_canary.device_bytes > available
    # what the pool gave up is the canary's bytes, to sglang's own rounding (a page of KV;
    # the canary of a page more)
    shrink = (off.max_total - on.max_total) * CELL
    assert canary < shrink + page_size * CELL
    assert shrink < grown_canary.device_bytes + page_size * CELL


def test_an_adaptive_draft_is_reserved_for_its_largest_step_count(profiled):
    """``--speculative-adaptive`` may switch the draft worker to its largest candidate step
    count (sglang's defaults: 1, 3, 7): the draft canary's memory is that count's, as for a
    fixed ``--speculative-num-steps 7``, and more than the initial 3 steps'."""
    import types

    runner = profiled(max_running_requests=8, context_length=256)

    def draft_bytes(**spec):
        args = types.SimpleNamespace(
            **{
                **vars(runner.server_args),
                "speculative_algorithm": "EAGLE",
                "speculative_eagle_topk": 1,
                "speculative_adaptive_config": None,
                **spec,
            }
        )
        _, reservation = reserve_canary_memory(
            runner,
            server_args=args,
            config=CanaryConfig(mode="raise"),
            capacity_inputs=CanaryCapacityInputs(context_len=256),
            available_bytes=48 << 20,
        )
        return reservation.draft.device_bytes

    adaptive = draft_bytes(speculative_num_steps=3, speculative_adaptive=True)
    assert adaptive == draft_bytes(speculative_num_steps=7, speculative_adaptive=False)
    assert adaptive > draft_bytes(speculative_num_steps=3, speculative_adaptive=False)


@pytest.mark.parametrize("algorithm", ["EAGLE", "STANDALONE"])
def test_the_budget_holds_the_pool_and_the_target_and_draft_canaries(profiled, tmp_path, algorithm):
    """With speculative decoding the pool gives up both canaries' bytes: the pool, the target
    runner's canary and the draft runner's fit sglang's budget together, and a page more of
    pool (with the larger canaries it would carry) would not."""
    from sglang.srt.kv_canary.memory_budget import DraftPool

    runner = profiled(max_running_requests=8, context_length=256)
    spec = dict(speculative_algorithm=algorithm)
    if algorithm == "STANDALONE":
        spec["speculative_draft_model_path"] = write_tiny_llama(
            tmp_path / "draft", **STANDALONE_DRAFT
        )
    args = _spec_args(runner, **spec)
    config = CanaryConfig(
        mode="raise",
        real_kv_hash_mode="partial",
        real_data_layers="all",
        enable_verify_token_assert=True,
    )
    caps = CanaryCapacityInputs(context_len=256)
    available = 48 << 20
    kv, reservation = reserve_canary_memory(
        runner, server_args=args, config=config, capacity_inputs=caps, available_bytes=available
    )
    sizing = seam.KvPoolSizing(runner)
    target, draft = reservation.target.device_bytes, reservation.draft.device_bytes
    assert draft > 0 and reservation.tokens == sizing.tokens_for(kv)
    assert reservation.tokens.max_total * CELL + target + draft <= available
    grown = PoolTokens(reservation.tokens.max_total + 1)
    grown_target, grown_draft = predicted_memory(
        sizing,
        grown,
        config=config,
        capacity_inputs=caps,
        draft=RankFacts(draft=True, draft_steps=3),
        device="cpu",
        draft_pool=DraftPool.for_server(sizing, args, algorithm),
    )
    assert grown_draft.device_bytes >= draft
    assert grown.max_total * CELL + grown_target.device_bytes + grown_draft.device_bytes > available


def test_a_multi_layer_eagle_draft_is_reserved_without_token_checks(profiled):
    """Multi-layer EAGLE's draft canary is built without token checks
    (``CanaryConfig.for_draft``): the budget reserves it so, and only it (the target keeps
    its token-check pool)."""
    runner = profiled(max_running_requests=8, context_length=256)
    caps = CanaryCapacityInputs(context_len=256)

    def reserve(token_checks: bool, **spec):
        return reserve_canary_memory(
            runner,
            server_args=_spec_args(runner, speculative_algorithm="EAGLE", **spec),
            config=CanaryConfig(mode="raise", enable_verify_token_assert=token_checks),
            capacity_inputs=caps,
            available_bytes=48 << 20,
        )[1]

    multi_layer = reserve(True, enable_multi_layer_eagle=True, disable_cuda_graph=True)
    sizing = seam.KvPoolSizing(runner)

    def predicted(token_checks: bool):
        return predicted_memory(
            sizing,
            multi_layer.tokens,
            config=CanaryConfig(mode="raise", enable_verify_token_assert=token_checks),
            capacity_inputs=caps,
            draft=RankFacts(draft=True, draft_steps=3),
            device="cpu",
        )

    (target_checked, draft_checked), (_, draft_unchecked) = predicted(True), predicted(False)
    assert multi_layer.draft.device_bytes == draft_unchecked.device_bytes
    assert draft_unchecked.device_bytes < draft_checked.device_bytes
    assert multi_layer.target.device_bytes == target_checked.device_bytes
    # plain EAGLE keeps the draft's token checks
    assert reserve(True).draft.device_bytes > reserve(False).draft.device_bytes


@pytest.mark.parametrize("family", [PoolFamily.SWA, PoolFamily.MHA])
def test_a_multi_layer_eagle_draft_pool_is_predicted_as_one_sliding_window_layer(family):
    """sglang gives each multi-layer EAGLE MTP runner (``Step3p5MTP``, ``MiMoV2MTP``) of a
    hybrid sliding-window target a one-layer ``SWAKVPool`` whose layer is sliding-window
    (``get_hybrid_layer_ids``: ``[0]`` and ``[]``): the budget predicts that pool, not an EAGLE
    head's; behind a target of another family the EAGLE head's prediction stands."""
    import types

    from sglang.srt.kv_canary.memory_budget import DraftPool

    sizing = types.SimpleNamespace(family=family)
    args = types.SimpleNamespace(
        speculative_algorithm="EAGLE",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        enable_multi_layer_eagle=True,
    )
    want = DraftPool(PoolFamily.SWA, 0, 1) if family == PoolFamily.SWA else DraftPool(family, 1)
    assert DraftPool.for_server(sizing, args, "EAGLE") == want
    args.enable_multi_layer_eagle = False
    assert DraftPool.for_server(sizing, args, "EAGLE") == DraftPool(PoolFamily.MHA, 1)


def _reserve_raise(runner, **spec):
    """The reservation of a raise canary on ``runner``'s pool under 48 MiB, with ``spec``'s
    speculative settings."""
    args = _spec_args(runner, **spec)
    return reserve_canary_memory(
        runner,
        server_args=args,
        config=CanaryConfig(mode="raise"),
        capacity_inputs=capacity_inputs_from_server_args(args, context_len=256),
        available_bytes=48 << 20,
    )[1]


def test_an_ngram_budget_reserves_the_target_canary_alone(profiled):
    """NGRAM has no draft model: the reservation holds no draft canary, and its target
    canary (a tree verify of 12 nodes per request) equals what install builds on the target
    runner: more than a server without speculative decoding reserves."""
    runner = profiled(max_running_requests=8, context_length=256)

    def reserve(**spec):
        return _reserve_raise(runner, **spec)

    ngram = reserve(
        speculative_algorithm="NGRAM",
        speculative_num_steps=None,
        speculative_eagle_topk=10,
        speculative_num_draft_tokens=12,
    )
    assert ngram.draft is None
    plain = reserve(speculative_algorithm=None)
    assert ngram.target.device_bytes > plain.target.device_bytes


def test_a_frozen_kv_mtp_budget_reserves_the_target_canary_alone(profiled):
    """FROZEN_KV_MTP's draft writes no KV (its layers read the target's): the reservation
    holds no draft canary, where EAGLE's of the same steps holds one, so the pool keeps those
    bytes."""
    runner = profiled(max_running_requests=8, context_length=256)

    def reserve(algorithm):
        return _reserve_raise(
            runner,
            speculative_algorithm=algorithm,
            speculative_num_steps=3,
            speculative_num_draft_tokens=4,
        )

    frozen, eagle = reserve("FROZEN_KV_MTP"), reserve("EAGLE")
    assert frozen.draft is None and eagle.draft is not None and eagle.draft.device_bytes > 0
    # the pool keeps what EAGLE's draft canary takes
    assert frozen.kv_bytes > eagle.kv_bytes
    assert frozen.tokens.max_total * CELL + frozen.target.device_bytes <= 48 << 20


# a STANDALONE draft of another shape than the tiny Llama target: 3 layers, 1 KV head of 16
STANDALONE_DRAFT = dict(num_hidden_layers=3, num_key_value_heads=1, torch_dtype="float16")


def _spec_args(runner, **spec):
    import types

    return types.SimpleNamespace(
        **{
            **vars(runner.server_args),
            "speculative_eagle_topk": 1,
            "speculative_num_steps": 3,
            "speculative_adaptive": False,
            "speculative_adaptive_config": None,
            **spec,
        }
    )


def _draft_canary_memory(pool, sizing, reservation, config, caps) -> CanaryMemory:
    """The memory of the draft canary ``build_canary`` allocates on ``pool`` (a draft pool of
    the reserved tokens), as ``install_canary`` builds a 3-step draft runner's."""
    manager = build_canary(
        pool=pool,
        req_to_token=torch.zeros(sizing.req_to_token_shape(reservation.tokens), dtype=torch.int32),
        config=config,
        device="cpu",
        capacity_inputs=caps,
        ranks=RankFacts(draft=True, draft_steps=3),
    )
    return manager.memory


def test_a_standalone_draft_is_reserved_as_the_builder_allocates_it(profiled, tmp_path):
    """STANDALONE: the draft pool is the separate draft model's own (its layers, from its
    config): with per-layer fingerprint columns (``layers all``) the predicted draft canary is
    what ``build_canary`` then allocates on that 3-layer pool of the reserved tokens, and more
    than an EAGLE head's; the draft path defaults to the target's model; an unreadable draft
    config is refused naming the flag."""
    from sglang.srt.kv_canary.memory_budget import DraftPool

    runner = profiled(max_running_requests=8, context_length=256)
    draft_dir = write_tiny_llama(tmp_path / "draft", **STANDALONE_DRAFT)
    config = CanaryConfig(mode="raise", real_data_layers="all", real_kv_hash_mode="all")
    caps = CanaryCapacityInputs(context_len=256)

    def reserve(**spec):
        return reserve_canary_memory(
            runner,
            server_args=_spec_args(runner, **spec),
            config=config,
            capacity_inputs=caps,
            available_bytes=48 << 20,
        )[1]

    standalone = reserve(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft_dir)
    sizing = seam.KvPoolSizing(runner)
    args = _spec_args(
        runner, speculative_algorithm="STANDALONE", speculative_draft_model_path=draft_dir
    )
    assert DraftPool.for_server(sizing, args, "STANDALONE") == DraftPool(PoolFamily.MHA, 3)
    pool = MHATokenToKVPool(
        size=standalone.tokens.max_total,
        page_size=1,
        dtype=torch.float16,
        head_num=1,
        head_dim=16,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    built = _draft_canary_memory(pool, sizing, standalone, config, caps)
    assert built.as_dict() == standalone.draft.as_dict()
    eagle = reserve(speculative_algorithm="EAGLE")
    assert standalone.draft.device_bytes > eagle.draft.device_bytes
    # no --speculative-draft-model-path: sglang loads the target's checkpoint as the draft
    assert DraftPool.for_server(
        sizing, _spec_args(runner, speculative_draft_model_path=None), "STANDALONE"
    ) == DraftPool(PoolFamily.MHA, 2)
    assert DraftPool.for_server(sizing, args, "EAGLE") == DraftPool(PoolFamily.MHA, 1)
    assert DraftPool.for_server(sizing, args, None) is None
    with pytest.raises(ValueError, match="--speculative-draft-model-path"):
        reserve(
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(tmp_path / "missing"),
        )


# a DFLASH draft: the tiny Llama's fields as a DFlashDraftModel, fed by target layers 0 and 1
DFLASH_DRAFT = dict(
    architectures=["DFlashDraftModel"],
    dflash_config={
        "block_size": 4,
        "mask_token_id": 3,
        "num_target_layers": 4,
        "target_layer_ids": [0, 1],
    },
)


def test_a_dflash_draft_is_reserved_for_its_own_layers(profiled, tmp_path):
    """DFLASH: the draft pool is the ``DFlashDraftModel``'s own, of its ``num_hidden_layers``
    (docs/speculative_multilayer_adaptive_dflash_mtp.md, "3.4 Changes to the canary"), read
    from its config as sglang's draft runner builds it. With per-layer fingerprint columns the
    predicted draft canary of a one-layer and of a two-layer draft is what ``build_canary``
    allocates on an MHA pool of that many layers holding the reserved tokens; the two-layer
    draft's is the larger, and leaves the pool fewer tokens."""
    from sglang.srt.kv_canary.memory_budget import DraftPool

    runner = profiled(max_running_requests=8, context_length=256)
    config = CanaryConfig(mode="raise", real_data_layers="all", real_kv_hash_mode="all")
    caps = CanaryCapacityInputs(context_len=256)
    sizing = seam.KvPoolSizing(runner)
    reserved = {}
    for layers in (1, 2):
        draft_dir = write_tiny_llama(
            tmp_path / f"dflash{layers}", num_hidden_layers=layers, **DFLASH_DRAFT
        )
        args = _spec_args(
            runner,
            speculative_algorithm="DFLASH",
            speculative_draft_model_path=draft_dir,
            speculative_num_steps=1,
            speculative_num_draft_tokens=4,
        )
        shape = seam.draft_model_shape(args)
        assert (shape.family, shape.layers, shape.swa_layers) == (PoolFamily.MHA, layers, 0)
        assert DraftPool.for_server(sizing, args, "DFLASH") == DraftPool(PoolFamily.MHA, layers)
        reservation = reserve_canary_memory(
            runner, server_args=args, config=config, capacity_inputs=caps, available_bytes=48 << 20
        )[1]
        pool = MHATokenToKVPool(
            size=reservation.tokens.max_total,
            page_size=1,
            dtype=torch.bfloat16,
            head_num=2,
            head_dim=16,
            layer_num=layers,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        built = build_canary(
            pool=pool,
            req_to_token=torch.zeros(
                sizing.req_to_token_shape(reservation.tokens), dtype=torch.int32
            ),
            config=config,
            device="cpu",
            capacity_inputs=caps,
            ranks=RankFacts(draft=True, draft_steps=seam.speculative_facts(args).max_steps),
        ).memory
        assert built.as_dict() == reservation.draft.as_dict(), layers
        reserved[layers] = reservation
    one, two = reserved[1], reserved[2]
    assert two.draft.device_bytes > one.draft.device_bytes
    # the second draft layer's KV and canary come out of the same budget: fewer tokens
    assert two.tokens.max_total < one.tokens.max_total


@pytest.mark.parametrize("kind", ["mla", "swa"])
def test_a_standalone_draft_of_another_attention_kind_is_read_as_that_pool(
    profiled, tmp_path, kind
):
    """STANDALONE with a draft whose attention is not the target's: the draft pool's family
    and layer counts are read from the draft's own config, as sglang's draft runner builds
    its pool: a DeepSeek-V2-shaped draft behind an MHA target gives an MLA pool of its
    layers; a GPT-OSS draft (one sliding-window, one full-attention layer) behind a
    sliding-window target an SWA pool of one full and one sliding layer."""
    from sglang.srt.kv_canary.memory_budget import DraftPool

    if kind == "mla":
        runner = profiled(max_running_requests=8, context_length=256)
        path, expected = write_tiny_deepseek_v2(tmp_path / "mla"), DraftPool(PoolFamily.MLA, 2)
    else:
        runner = _sliding_window_target(tmp_path)
        path, expected = write_tiny_gpt_oss(tmp_path / "swa"), DraftPool(PoolFamily.SWA, 1, 1)
    args = _spec_args(runner, speculative_algorithm="STANDALONE", speculative_draft_model_path=path)
    assert DraftPool.for_server(seam.KvPoolSizing(runner), args, "STANDALONE") == expected


def _sliding_window_target(tmp_path) -> _ProfiledRunner:
    """A profiled runner of the tiny GPT-OSS (hybrid sliding window), as sglang sizes it."""
    runner = _ProfiledRunner(
        write_tiny_gpt_oss(tmp_path / "target"),
        max_running_requests=8,
        context_length=256,
        attention_backend="triton",  # GPT-OSS's server arguments refuse the CPU's default
    )
    runner.is_hybrid_swa = True
    return runner


def test_a_sliding_window_standalone_draft_behind_a_target_without_one_is_refused(
    profiled, tmp_path
):
    """sglang 0.5.12 sizes a STANDALONE draft's pool from the target's pool sizes and shares
    the target's allocator, neither of which has a sliding-window part when the target has
    no sliding-window layers: the reservation refuses that pair naming
    ``--speculative-draft-model-path``, both models and what would work, instead of failing
    on the missing sizes."""
    from sglang.srt.kv_canary.memory_budget import DraftPool

    runner = profiled(max_running_requests=8, context_length=256)
    draft = write_tiny_gpt_oss(tmp_path / "swa")
    args = _spec_args(
        runner, speculative_algorithm="STANDALONE", speculative_draft_model_path=draft
    )
    with pytest.raises(ValueError) as refused:
        reserve_canary_memory(
            runner,
            server_args=args,
            config=CanaryConfig(mode="raise"),
            capacity_inputs=CanaryCapacityInputs(context_len=256),
            available_bytes=48 << 20,
        )
    message = str(refused.value)
    assert (
        f"--speculative-draft-model-path {draft!r} has sliding-window attention layers" in message
    )
    assert "(1 of 2)" in message and repr(runner.server_args.model_path) in message
    assert "use a draft model without sliding-window layers, or a target with them" in message
    # sglang's own draft runner for that pair: the target's pool config has no sliding-window
    # sizes, and the draft's SWAKVPool cannot be built from them
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    target_config = create_memory_pool_configurator(runner).calculate_pool_sizes(48 << 20, 1)
    assert target_config.swa_max_total_num_tokens is None
    with pytest.raises(TypeError, match="NoneType"):
        SWAKVPool(
            size=target_config.full_max_total_num_tokens,
            size_swa=target_config.swa_max_total_num_tokens,
            page_size=1,
            dtype=torch.bfloat16,
            head_num=1,
            head_dim=16,
            swa_attention_layer_ids=[0],
            full_attention_layer_ids=[1],
            enable_kvcache_transpose=False,
            device="cpu",
        )
    # the same draft behind the tiny Llama as EAGLE's head: no separate draft model, no refusal
    assert DraftPool.for_server(seam.KvPoolSizing(runner), args, "EAGLE") == DraftPool(
        PoolFamily.MHA, 1
    )


def test_an_mla_standalone_draft_is_reserved_as_the_builder_allocates_it(profiled, tmp_path):
    """A DeepSeek-V2-shaped STANDALONE draft behind an MHA target: the predicted draft canary
    (per-layer fingerprint columns on) is what ``build_canary`` allocates on an
    ``MLATokenToKVPool`` of the draft's layers holding the reserved tokens."""
    from sglang.srt.kv_canary.memory_budget import DraftPool
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    runner = profiled(max_running_requests=8, context_length=256)
    draft_dir = write_tiny_deepseek_v2(tmp_path / "mla")
    config = CanaryConfig(mode="raise", real_data_layers="all", real_kv_hash_mode="all")
    caps = CanaryCapacityInputs(context_len=256)
    args = _spec_args(
        runner, speculative_algorithm="STANDALONE", speculative_draft_model_path=draft_dir
    )
    reserved = reserve_canary_memory(
        runner, server_args=args, config=config, capacity_inputs=caps, available_bytes=48 << 20
    )[1]
    sizing = seam.KvPoolSizing(runner)
    assert DraftPool.for_server(sizing, args, "STANDALONE") == DraftPool(PoolFamily.MLA, 2)
    pool = MLATokenToKVPool(
        size=reserved.tokens.max_total,
        page_size=1,
        dtype=torch.bfloat16,
        kv_lora_rank=256,
        qk_rope_head_dim=32,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    built = _draft_canary_memory(pool, sizing, reserved, config, caps)
    assert built.as_dict() == reserved.draft.as_dict()


def test_a_user_cap_below_the_budget_keeps_the_pool(profiled):
    runner = profiled(max_total_tokens=4096, max_running_requests=8, context_length=256)
    kv, reservation = reserve_canary_memory(
        runner,
        server_args=runner.server_args,
        config=CanaryConfig(mode="raise"),
        capacity_inputs=CanaryCapacityInputs(context_len=256),
        available_bytes=48 << 20,
    )
    assert reservation.tokens.max_total == 4096
    assert seam.KvPoolSizing(runner).tokens_for(kv).max_total == 4096


def test_a_budget_without_room_for_pool_and_canary_names_the_flag(profiled):
    runner = profiled(max_running_requests=8, context_length=256)
    with pytest.raises(RuntimeError, match="--mem-fraction-static"):
        reserve_canary_memory(
            runner,
            server_args=runner.server_args,
            config=CanaryConfig(mode="raise", enable_verify_token_assert=True),
            capacity_inputs=CanaryCapacityInputs(context_len=256),
            available_bytes=CELL * 64,
        )


def test_the_budget_hook_leaves_sglang_alone_with_the_canary_off(profiled):
    runner = profiled(max_running_requests=8)
    assert (
        memory_budget.reserve_kv_budget(
            server_args=runner.server_args, model_runner=runner, available_bytes=12345678
        )
        == 12345678
    )
    assert seam.runner_memory_reservation(runner) is None


def test_the_budget_hook_reserves_and_keeps_the_reservation(profiled):
    runner = profiled(max_running_requests=8, context_length=256)
    runner.server_args.kv_canary = "raise"
    kv = memory_budget.reserve_kv_budget(
        server_args=runner.server_args, model_runner=runner, available_bytes=48 << 20
    )
    reservation = seam.runner_memory_reservation(runner)
    assert reservation is not None and reservation.kv_bytes == kv < 48 << 20
    assert reservation.draft is None
    # the EAGLE draft runner finds it through the pool config sglang hands it
    runner.memory_pool_config = type("MemoryPoolConfig", (), {})()
    seam.share_memory_reservation(runner)
    draft = type("DraftRunner", (), {"memory_pool_config": runner.memory_pool_config})()
    assert seam.runner_memory_reservation(draft) is reservation


# ---- the install's check, the report, the gauge ------------------------------------------------


def test_an_install_that_holds_more_than_was_reserved_says_so(caplog):
    d = ServingDriver()
    reserved = dataclasses.replace(
        d.manager._memory_inputs, groups=(GroupGeometry(PoolKind.FULL, 8),)
    )
    small = CanaryMemoryReservation(
        profiled_bytes=1 << 30,
        kv_bytes=(1 << 30) - 4096,
        tokens=PoolTokens(7),
        target=CanaryMemory.for_inputs(reserved),
    )
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        text = install._check_reserved(d.manager, small, draft=False)
    assert "more GPU memory than was reserved" in caplog.text
    assert "reserved" in text
    caplog.clear()
    exact = dataclasses.replace(small, target=d.manager.memory)
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        install._check_reserved(d.manager, exact, draft=False)
        install._check_reserved(d.manager, None, draft=False)
    assert "than was reserved" not in caplog.text
    assert "no KV-pool budget was reserved" in caplog.text


def test_the_gauge_exports_the_bytes_by_part():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    labels = {"model_name": "tiny"}
    d = ServingDriver(real_data_layers="all", verify_tokens=True)
    d.manager.attach_scheduler(
        radix_cache=None,
        running_reqs=lambda: [],
        metrics_labels=labels,
        kv_slots_in_use=lambda: 0,
        metrics_registry=registry,
    )
    memory = d.manager.memory
    assert {p for p, _ in memory.device} >= {
        MemoryPart.RECORDS,
        MemoryPart.TOKEN_TABLE,
        MemoryPart.LAYER_FINGERPRINTS,
    }
    for where, parts in (("device", memory.device), ("host", memory.host)):
        for part, n in parts:
            got = registry.get_sample_value(
                "sglang:kv_canary_memory_bytes",
                {**labels, "pool": "target", "memory": where, "part": part.value},
            )
            assert got == n, (where, part)


def test_the_server_info_report_has_both_figures():
    d = ServingDriver()
    assert install.canary_memory_info(None, target=d.manager, draft=None) == {
        "reservation": None,
        "target": {"allocated": d.manager.memory.as_dict(), "reserved": None},
    }


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
