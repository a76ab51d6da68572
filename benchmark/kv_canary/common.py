"""What the KV-canary benchmarks share (docs/user_guide.md, "Overhead"): the model shapes
(dummy weights, a ``config.json`` each), the scenarios, the canary configs and the Engine
settings every config is served with, the inputs of a scenario's run, sglang's own prefill
time of a request, each ``--speculative`` mode's settings, draft model and canary-installation
check, the JSON-lines helpers and a CUDA-event timer. Imported by ``bench_serving_overhead.py``,
``bench_interleaved.py`` and ``bench_prefill_device_time.py``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import zlib
from collections.abc import Sequence

# ---- model, scenarios, configs ----------------------------------------------------------------

QWEN3_0_6B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

# ``--model qwen3-30b-a3b``: the upstream-shaped MoE rows: Qwen3-30B-A3B's shapes
# (48 layers, hidden 2048, 32 heads, 4 KV heads x 128, 128 experts of 768, 8 per token),
# dummy weights (about 61 GB in bf16: one H200)
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# ``--model deepseek-v3-mtp`` (``--speculative nextn``'s target: NEXTN drafts with the target's
# own MTP layer, which sglang reads from the target's directory): DeepSeek-V3's MLA with its
# head dimensions (the shapes sglang's MLA kernels are tuned for) and one MTP layer, at about
# Qwen3-0.6B's scale: 28 dense layers of hidden 1024, 16 heads, Qwen3's vocabulary; the MTP
# layer (sglang builds it at layer 28, past ``first_k_dense_replace``) a small MoE
DEEPSEEK_V3_MTP_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 28,
    "first_k_dense_replace": 28,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": 40960,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# ``--model gemma4-mtp`` (``--speculative frozen-kv-mtp``'s target): a Gemma4 text model of about
# Qwen3-0.6B's scale (28 layers of hidden 1024, 16 heads, 8 KV heads of 128, sliding and full
# attention alternating, a 1024-token window; the last two layers KV-shared with the last
# owner of their type), the GPU suite's tiny FROZEN_KV_MTP target scaled up
# (test/registered/kv_canary/canary_support/tiny_models.py says why each field is written
# out); Qwen3's vocabulary (the benchmarks' token ids)
GEMMA4_MTP_CONFIG = {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "global_head_dim": 128,
    "num_global_key_value_heads": 8,
    "swa_num_key_value_heads": 8,
    "swa_head_dim": 128,
    "swa_v_head_dim": 128,
    "v_head_dim": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 14,
    "num_kv_shared_layers": 2,
    "sliding_window": 1024,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 151936,
    "moe_intermediate_size": 3072,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 0,
}
# ``--model step3p5-mtp`` (``--speculative multi-layer``'s target: sglang 0.5.12 runs
# ``--speculative-algorithm EAGLE`` on a Step-3.5 as multi-layer EAGLE, each of its three MTP
# layers a draft runner read from the target's directory): the GPU suite's tiny Step-3.5
# (test/registered/kv_canary/canary_support/tiny_models.py says why each field is written out,
# and why 45 layers: sglang builds every MTP block at layer_id 45) at about Qwen3-0.6B's
# scale: hidden 1024, 16 heads in 8 groups of 128, sliding and full attention 3:1 with a
# 512-token window, a small MoE on layers 3 and 4; Qwen3's vocabulary (the benchmarks' ids)
_STEP3P5_LAYERS, _STEP3P5_MTP = 45, 3
STEP3P5_MTP_CONFIG = {
    "architectures": ["Step3p5ForCausalLM"],
    "model_type": "step3p5",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_attention_groups": 8,
    "head_dim": 128,
    "num_hidden_layers": _STEP3P5_LAYERS,
    "num_nextn_predict_layers": _STEP3P5_MTP,
    "layer_types": [
        "full_attention" if i % 4 == 3 and i < _STEP3P5_LAYERS else "sliding_attention"
        for i in range(_STEP3P5_LAYERS + _STEP3P5_MTP)
    ],
    "sliding_window": 512,
    "attention_other_setting": {"num_attention_heads": 16, "num_attention_groups": 8},
    "use_head_wise_attn_gate": False,
    "partial_rotary_factors": [1.0] * (_STEP3P5_LAYERS + _STEP3P5_MTP),
    "rope_theta": [10000.0] * (_STEP3P5_LAYERS + _STEP3P5_MTP),
    "rope_scaling": None,
    "yarn_only_types": [],
    "moe_layers_enum": "3,4",
    "moe_num_experts": 8,
    "moe_top_k": 2,
    "moe_intermediate_size": 768,
    "share_expert_dims": 768,
    "moe_router_scaling_factor": 1.0,
    "use_moe_router_bias": True,
    "need_fp32_gate": False,
    "norm_expert_weight": True,
    "swiglu_limits": [0.0] * (_STEP3P5_LAYERS + _STEP3P5_MTP),
    "swiglu_limits_shared": [0.0] * (_STEP3P5_LAYERS + _STEP3P5_MTP),
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "max_seq_len": 40960,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
MODELS = {
    "qwen3-0.6b": QWEN3_0_6B_CONFIG,
    "qwen3-30b-a3b": QWEN3_30B_A3B_CONFIG,
    "deepseek-v3-mtp": DEEPSEEK_V3_MTP_CONFIG,
    "gemma4-mtp": GEMMA4_MTP_CONFIG,
    "step3p5-mtp": STEP3P5_MTP_CONFIG,
}
DEFAULT_MODEL = "qwen3-0.6b"

# ---- speculative decoding (``--speculative``) -------------------------------------------------
# Each mode's draft model is a ``config.json`` (dummy weights) written into a draft directory
# beside the target's (:func:`write_speculative_files`); every such draft has the Qwen3-0.6B
# shapes but FROZEN_KV_MTP's assistant (``--model gemma4-mtp``'s). NEXTN's draft is the
# target's own MTP layer (``--model deepseek-v3-mtp``, read from the target's directory), and
# multi-layer EAGLE's the three MTP layers of ``--model step3p5-mtp`` (likewise).

# ``--speculative eagle``: a one-layer EAGLE draft of the same shapes (hidden 1024, 16 heads,
# 8 KV heads x 128, the target's vocabulary; sglang hands it the target's embedding and head)
QWEN3_EAGLE_DRAFT_CONFIG = {
    **{k: v for k, v in QWEN3_0_6B_CONFIG.items() if k not in ("attention_bias",)},
    "architectures": ["LlamaForCausalLMEagle"],
    "model_type": "llama",
    "num_hidden_layers": 1,
    "tie_word_embeddings": False,
}
# ``--speculative eagle3``: a one-layer EAGLE3 draft of the same shapes, fed by the outputs of
# target layers 1, 13 and 24 (what sglang captures when a draft names none: before layers 2,
# 14 and 25 of 28; each below the last layer, whose output Qwen3 never captures), with its own
# head over the whole vocabulary (``draft_vocab_size``; the embedding is the target's)
QWEN3_EAGLE3_DRAFT_CONFIG = {
    **QWEN3_EAGLE_DRAFT_CONFIG,
    "architectures": ["LlamaForCausalLMEagle3"],
    "draft_vocab_size": QWEN3_0_6B_CONFIG["vocab_size"],
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 13, 24], "use_aux_hidden_state": True},
}
# ``--speculative standalone``: a separate small LM of the target's family and vocabulary (2
# layers of the target's shapes), with its own embedding, head and KV pool
QWEN3_STANDALONE_DRAFT_CONFIG = {**QWEN3_0_6B_CONFIG, "num_hidden_layers": 2}
# ``--speculative dflash``: a one-layer DFlash block draft of the target's hidden size and
# heads, block size 4, fed by the outputs of target layers 1 and 25 (sglang's own pick for two
# layers of 28; below the last layer, whose output Qwen3 never captures); an explicit mask
# token id (the servers skip the tokenizer, from which sglang would otherwise take it): an id
# below the vocabulary size past Qwen3's last token (151668)
QWEN3_DFLASH_DRAFT_CONFIG = {
    **QWEN3_0_6B_CONFIG,
    "architectures": ["DFlashDraftModel"],
    "num_hidden_layers": 1,
    "dflash_config": {
        "block_size": 4,
        "mask_token_id": 151669,
        "num_target_layers": QWEN3_0_6B_CONFIG["num_hidden_layers"],
        "target_layer_ids": [1, 25],
    },
}
# ``--speculative frozen-kv-mtp``: Gemma4's MTP assistant for ``--model gemma4-mtp`` (one sliding
# and one full layer reading the target's KV, writing none; ``backbone_hidden_size`` the
# target's), as the GPU suite's tiny assistant, scaled up
GEMMA4_ASSISTANT_DRAFT_CONFIG = {
    "architectures": ["Gemma4AssistantForCausalLM"],
    "model_type": "gemma4",
    "backbone_hidden_size": GEMMA4_MTP_CONFIG["hidden_size"],
    "text_config": {
        **{k: v for k, v in GEMMA4_MTP_CONFIG.items() if k != "architectures"},
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_kv_shared_layers": 0,
    },
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": GEMMA4_MTP_CONFIG["bos_token_id"],
    "eos_token_id": GEMMA4_MTP_CONFIG["eos_token_id"],
    "pad_token_id": 0,
}
# ``--speculative adaptive``: sglang's adaptive step counts (``--speculative-adaptive-config``,
# written beside the draft's config as ADAPTIVE_CONFIG_FILE): the candidates of the GPU suite's
# adaptive lanes (1, 2, 4; sglang adds the initial 3), sglang's defaults for the rest
ADAPTIVE_CONFIG_FILE = "adaptive.json"
QWEN3_ADAPTIVE_CONFIG = {"candidate_steps": [1, 2, 4]}

# the EAGLE chain of every EAGLE-family mode: 3 steps, topk 1, 4 draft tokens
_EAGLE_CHAIN = dict(
    speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4
)
# each mode's Engine / launch_server settings (the draft's path and the adaptive config's are
# added by EngineSettings.engine_kwargs); ``disable_overlap_schedule``: spec v1, as the GPU
# suite runs each mode that sglang runs on v1 only (it would turn the overlap off itself)
SPECULATIVE = {
    "none": {},
    "eagle": dict(speculative_algorithm="EAGLE", **_EAGLE_CHAIN),
    # draft trees: spec v1 (sglang runs topk > 1 on v1 only), page size 1
    "eagle-tree": dict(
        speculative_algorithm="EAGLE",
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=6,
        disable_overlap_schedule=True,
    ),
    "eagle3": dict(speculative_algorithm="EAGLE3", **_EAGLE_CHAIN),
    # the radix cache off: sglang 0.5.12 keys STANDALONE's radix cache by single tokens, and
    # the draft canary reports each divergent shared prefix
    # (docs/user_guide.md, "Speculative decoding")
    "standalone": dict(
        speculative_algorithm="STANDALONE", disable_radix_cache=True, **_EAGLE_CHAIN
    ),
    # no draft model: trees of 6 tokens, 3 per level, drafted from an n-gram corpus (sglang
    # sets topk to the breadth; 3 steps as every server of the GPU suite); spec v1
    "ngram": dict(
        speculative_algorithm="NGRAM",
        speculative_num_steps=3,
        speculative_num_draft_tokens=6,
        speculative_ngram_max_bfs_breadth=3,
        disable_overlap_schedule=True,
    ),
    # one step, topk 1, the block size as draft tokens; spec v1; page size 1 (the canary
    # covers DFLASH there only)
    "dflash": dict(
        speculative_algorithm="DFLASH",
        speculative_num_steps=1,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        page_size=1,
        disable_overlap_schedule=True,
    ),
    "adaptive": dict(speculative_algorithm="EAGLE", speculative_adaptive=True, **_EAGLE_CHAIN),
    # the target's own MTP layer as the draft, the chain, spec v2 (the GPU suite's NEXTN lanes)
    "nextn": dict(speculative_algorithm="NEXTN", **_EAGLE_CHAIN),
    # Gemma4's assistant reading the target's KV, the chain, spec v1 (sglang runs FROZEN_KV_MTP
    # there only), as the GPU suite's FROZEN_KV_MTP lanes
    "frozen-kv-mtp": dict(
        speculative_algorithm="FROZEN_KV_MTP", disable_overlap_schedule=True, **_EAGLE_CHAIN
    ),
    # EAGLE on a Step-3.5 target: sglang turns on --enable-multi-layer-eagle itself (each MTP
    # layer a draft step); spec v2 without CUDA graphs (the canary covers it there only) and
    # the radix cache off (with it, the draft canary reports each shared-prefix boundary:
    # docs/user_guide.md, "Speculative decoding"), as the GPU suite's multi-layer lanes
    "multi-layer": dict(
        speculative_algorithm="EAGLE",
        disable_cuda_graph=True,
        disable_radix_cache=True,
        **_EAGLE_CHAIN,
    ),
}
# each mode's target (``--model``): the Qwen3-0.6B shapes of the written drafts, NEXTN's the
# model whose MTP layer it drafts with, FROZEN_KV_MTP's the model its assistant reads
SPECULATIVE_MODELS = {
    **{mode: DEFAULT_MODEL for mode in SPECULATIVE if mode != "none"},
    "nextn": "deepseek-v3-mtp",
    "frozen-kv-mtp": "gemma4-mtp",
    "multi-layer": "step3p5-mtp",
}
# the modes whose draft sglang reads from the target's own directory (none written)
SPECULATIVE_DRAFT_IN_TARGET = ("nextn", "multi-layer")
# each mode's draft model written beside the target (None: none written)
SPECULATIVE_DRAFT_CONFIGS = {
    "none": None,
    "eagle": QWEN3_EAGLE_DRAFT_CONFIG,
    "eagle-tree": QWEN3_EAGLE_DRAFT_CONFIG,
    "eagle3": QWEN3_EAGLE3_DRAFT_CONFIG,
    "standalone": QWEN3_STANDALONE_DRAFT_CONFIG,
    "ngram": None,
    "dflash": QWEN3_DFLASH_DRAFT_CONFIG,
    "adaptive": QWEN3_EAGLE_DRAFT_CONFIG,
    "nextn": None,
    "frozen-kv-mtp": GEMMA4_ASSISTANT_DRAFT_CONFIG,
    "multi-layer": None,
}
# the draft worker whose canary a canary-on server of each mode logs (install.py's
# "kv_canary installed on the <worker> draft worker: "; sglang's EAGLE workers run EAGLE and
# EAGLE3); None: no draft KV pool, the target's canary only (NGRAM, FROZEN_KV_MTP)
SPECULATIVE_DRAFT_WORKERS = {
    "none": None,
    "eagle": "EAGLE",
    "eagle-tree": "EAGLE",
    "eagle3": "EAGLE",
    "standalone": "STANDALONE",
    "ngram": None,
    "dflash": "DFLASH",
    "adaptive": "EAGLE",
    "nextn": "EAGLE",
    "frozen-kv-mtp": None,  # its assistant writes no KV: the target's canary only
    "multi-layer": "EAGLE",  # MTP layer 0's runner (the other layers share its canary)
}
# ``--speculative``'s help in both benchmarks: what each mode serves with
SPECULATIVE_HELP = (
    "every server decodes with: none (default); eagle: EAGLE, a one-layer "
    "LlamaForCausalLMEagle draft of the model's shapes, chains of 3 steps, topk 1, 4 draft "
    "tokens (spec v2, sglang's default); eagle-tree: the same draft, trees of 3 steps, topk 2, 6 draft tokens (spec v1); "
    "eagle3: a one-layer LlamaForCausalLMEagle3 draft fed by target layers 1, 13, 24, the "
    "chain; standalone: a 2-layer Qwen3ForCausalLM draft, the chain, radix cache off; ngram: "
    "no draft model, trees of 6 tokens, breadth 3 (spec v1); dflash: a one-layer "
    "DFlashDraftModel fed by target layers 1, 25, blocks of 4 (spec v1, page size 1); "
    "adaptive: the eagle chain with --speculative-adaptive (candidate steps 1, 2, 4); "
    "nextn: NEXTN, the chain, drafted by the MTP layer of --model deepseek-v3-mtp (a "
    "DeepSeek-V3-shaped MLA model of Qwen3-0.6B's scale); frozen-kv-mtp: FROZEN_KV_MTP, "
    "the chain (spec v1), a two-layer Gemma4 assistant reading the KV of --model gemma4-mtp "
    "(a Gemma4 text model of Qwen3-0.6B's scale); multi-layer: EAGLE on --model step3p5-mtp "
    "(a Step-3.5 of Qwen3-0.6B's scale), which sglang runs as multi-layer EAGLE, its 3 MTP "
    "layers the chain's steps (spec v2, CUDA graphs and the radix cache off)"
)
# which draft worker's canary line each mode's canary-on server must show (in the help)
DRAFT_WORKERS_HELP = "; ".join(
    f"{worker or 'no draft canary'}: "
    + ", ".join(m for m, w in SPECULATIVE_DRAFT_WORKERS.items() if w == worker and m != "none")
    for worker in sorted(
        {w for m, w in SPECULATIVE_DRAFT_WORKERS.items() if m != "none"},
        key=lambda w: (w is None, list(SPECULATIVE_DRAFT_WORKERS.values()).index(w)),
    )
)


def speculative_mode(value: str) -> str:
    """``--speculative``'s value (argparse's ``type``: its error names the flag): a key of
    :data:`SPECULATIVE`, else refused naming the value and the allowed values."""
    if value in SPECULATIVE:
        return value
    raise argparse.ArgumentTypeError(f"unknown value {value!r}; allowed: {', '.join(SPECULATIVE)}")


def speculative_model(speculative: str, model: str | None) -> str:
    """``--model``'s value: as given, else the target mode ``speculative`` is made for
    (:data:`SPECULATIVE_MODELS`; :data:`DEFAULT_MODEL` without a mode)."""
    return model or SPECULATIVE_MODELS.get(speculative, DEFAULT_MODEL)


def speculative_model_problem(speculative: str, model: str) -> str | None:
    """Why ``--speculative speculative`` cannot measure ``--model model`` (None: it can): each
    mode serves the target its draft is made for (:data:`SPECULATIVE_MODELS`)."""
    if speculative == "none" or model == SPECULATIVE_MODELS[speculative]:
        return None
    why = (
        "its draft is that model's MTP layer"
        if speculative in SPECULATIVE_DRAFT_IN_TARGET
        else "the draft's shape is that model's"
    )
    return (
        f"--speculative {speculative} needs --model {SPECULATIVE_MODELS[speculative]} ({why}), "
        f"got --model {model}"
    )


# the models whose prefill sglang 0.5.12's piecewise CUDA graphs cannot capture, canary on or
# off, and sglang's own error (its servers stop at start-up with it)
MODELS_WITHOUT_PIECEWISE = {
    "gemma4-mtp": (
        "sglang 0.5.12's piecewise capture stops on the model's KV-sharing layers "
        "(num_kv_shared_layers, whose attention gets no key: \"Piecewise CUDA Graph failed "
        "with error: 'NoneType' object is not subscriptable\" in radix_attention.py, "
        "canary off too)"
    ),
}


def piecewise_setting(model: str, piecewise: str | None) -> str:
    """``--piecewise``'s value (``on``/``off``) for ``--model model``: as given, else sglang's
    default (on) where sglang can capture the model's prefill, off where it cannot
    (:data:`MODELS_WITHOUT_PIECEWISE`); ``on`` for such a model is refused (SystemExit)."""
    if piecewise not in (None, "on", "off"):
        raise SystemExit(f"--piecewise {piecewise}: allowed on, off")
    why = MODELS_WITHOUT_PIECEWISE.get(model)
    if why is None:
        return piecewise or "on"
    if piecewise == "on":
        raise SystemExit(
            f"--piecewise on cannot serve --model {model}: {why}; pass --piecewise off"
        )
    return "off"


def write_speculative_files(speculative: str, draft_dir: str) -> str | None:
    """Write mode ``speculative``'s draft ``config.json`` (and, for ``adaptive``, its
    ADAPTIVE_CONFIG_FILE) into ``draft_dir``, created; returns ``draft_dir``, or None (nothing
    written) for a mode without a draft model."""
    draft = SPECULATIVE_DRAFT_CONFIGS[speculative]
    if draft is None:
        return None
    os.makedirs(draft_dir, exist_ok=True)
    pathlib.Path(draft_dir, "config.json").write_text(json.dumps(draft, indent=1))
    if SPECULATIVE[speculative].get("speculative_adaptive"):
        pathlib.Path(draft_dir, ADAPTIVE_CONFIG_FILE).write_text(
            json.dumps(QWEN3_ADAPTIVE_CONFIG, indent=1)
        )
    return draft_dir


# the log lines of a server whose canary was installed (install.py's), on the target and on a
# draft worker
INSTALLED_LINE = "kv_canary installed: "
DRAFT_INSTALLED_PREFIX = "kv_canary installed on the "


def draft_installed_line(worker: str) -> str:
    """The log line of the canary installed on ``worker``'s draft runner."""
    return f"{DRAFT_INSTALLED_PREFIX}{worker} draft worker: "


def canary_lines_problem(log: str, *, canary_on: bool, speculative: str) -> str | None:
    """What is wrong with a server's canary, from its log (``log``: the whole log, or its lines
    that name ``kv_canary installed``), or None. A canary-on server must have installed the
    canary on the target and, for a mode with a draft KV pool, on that mode's draft worker
    (:data:`SPECULATIVE_DRAFT_WORKERS`: otherwise the draft pool ran unguarded and its figures
    mean nothing), and on no other draft worker; a canary-off server on neither."""
    target = INSTALLED_LINE in log
    drafts = set(re.findall(re.escape(DRAFT_INSTALLED_PREFIX) + r"(\S+) draft worker: ", log))
    if not canary_on:
        return (
            "the canary was installed on a server of a canary-off config"
            if target or drafts
            else None
        )
    if not target:
        return f"no '{INSTALLED_LINE.strip()}' line: the canary did not run"
    worker = SPECULATIVE_DRAFT_WORKERS[speculative]
    if worker is not None and worker not in drafts:
        return f"no '{draft_installed_line(worker).strip()}' line: the draft pool ran unguarded"
    others = sorted(drafts - {worker})
    if others:
        return (
            f"a '{draft_installed_line(others[0]).strip()}' line, and --speculative "
            f"{speculative} "
            + (f"drafts on the {worker} draft worker" if worker else "has no draft KV pool")
            + ": the server ran another speculative algorithm"
        )
    return None


TOKEN_ENV = "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT"
RESULT_PREFIX = "BENCH "  # lines the Engine child prints for the parent to echo


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    bs: int
    isl: int
    osl: int

    @property
    def kind(self) -> str:
        return "prefill" if self.osl == 1 else "decode"


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("decode_bs128", bs=128, isl=512, osl=1024),
        Scenario("decode_bs1", bs=1, isl=512, osl=1024),
        Scenario("prefill_bs32", bs=32, isl=16384, osl=1),
        Scenario("prefill_bs1_4k", bs=1, isl=4096, osl=1),
        Scenario("decode_bs32", bs=32, isl=512, osl=1024),
        Scenario("prefill_bs1_512", bs=1, isl=512, osl=1),
        Scenario("prefill_bs1_16k", bs=1, isl=16384, osl=1),
        Scenario("decode_bs64", bs=64, isl=256, osl=512),
    )
}
# scenarios run when --scenarios is not given
DEFAULT_SCENARIOS = {
    "none": ("decode_bs128", "decode_bs1", "prefill_bs32", "prefill_bs1_4k"),
    # every speculative mode: decode bs 1 and bs 32
    **{mode: ("decode_bs1", "decode_bs32") for mode in SPECULATIVE if mode != "none"},
}
SMOKE_SCENARIOS = {
    s.name: s
    for s in (
        Scenario("decode_bs128", bs=2, isl=16, osl=8),
        Scenario("decode_bs1", bs=1, isl=16, osl=8),
        Scenario("prefill_bs32", bs=2, isl=64, osl=1),
        Scenario("prefill_bs1_4k", bs=1, isl=64, osl=1),
        Scenario("decode_bs32", bs=2, isl=16, osl=8),
        Scenario("prefill_bs1_512", bs=1, isl=16, osl=1),
        Scenario("prefill_bs1_16k", bs=1, isl=96, osl=1),
        Scenario("decode_bs64", bs=2, isl=16, osl=8),
    )
}


PROJECT_STACK, UPSTREAM_STACK = "project", "upstream"
UPSTREAM_PREFIX = "up:"  # upstream's configs: its own canary, the same flags
# the isolation folder (its sitecustomize) that goes first on an upstream process's PYTHONPATH
UPSTREAM_SITE_DIR = pathlib.Path(__file__).resolve().parent / "upstream_site"
# the decode pacing probe (an sglang plugin: its folder on PYTHONPATH loads it); a config's
# ``side_fork`` runs it with KV_PACING_PROBE_FORK (latency_h200.md: why raise decodes faster)
PACING_PROBE_DIR = pathlib.Path(__file__).resolve().parent / "pacing_probe"
PACING_PROBE_FORK_ENV = "KV_PACING_PROBE_FORK"
# the test suites' directory: its support package ``canary_support`` (support scripts, the
# tiny model shapes, the containment storm) serves the benchmarks too
TEST_DIR = pathlib.Path(__file__).resolve().parents[2] / "test" / "registered" / "kv_canary"


def use_test_support() -> None:
    """Make the test suites' ``canary_support`` package importable (appended to ``sys.path``:
    no test module shadows a benchmark's); call it before importing from it."""
    if str(TEST_DIR) not in sys.path:
        sys.path.append(str(TEST_DIR))


def upstream_env(env: dict[str, str], upstream_site: str) -> dict[str, str]:
    """``env`` for a process of upstream's stack: ``PYTHONPATH`` = :data:`UPSTREAM_SITE_DIR`,
    ``upstream_site`` (the directory ``upstream_bundle.sh``'s bundles install into), then
    ``env``'s own."""
    paths = [str(UPSTREAM_SITE_DIR), os.path.abspath(upstream_site)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    name: str
    kv_canary: str = "none"
    real_data: str = "none"
    verify_tokens: bool = False
    real_data_layers: str = "first"  # "all" = per-layer fingerprints
    sweep_interval: int = 0  # --kv-canary-sweep-interval (0: sweep off, both stacks' default)
    # whose canary: this project's on sglang 0.5.12 (PROJECT_STACK) or upstream sglang's own
    # (UPSTREAM_STACK, 0.5.17, run as a black box by bench_interleaved.py --upstream-site)
    stack: str = PROJECT_STACK
    # "" or the pacing probe's fork ("empty", "kernel"): a side stream forked and joined
    # around the model's forward, as the canary's (the probe's folder goes first on the
    # server's PYTHONPATH: interleaved_servers.server_env)
    side_fork: str = ""

    @property
    def canary_on(self) -> bool:
        return self.kv_canary != "none"

    def engine_kwargs(self) -> dict:
        """The canary's server arguments (upstream's canary has the same ``--kv-canary`` and
        ``--kv-canary-real-data`` and no per-layer fingerprints; its canary-off servers get
        none, the default there)."""
        if self.stack == UPSTREAM_STACK and not self.canary_on:
            return {}
        kw = {"kv_canary": self.kv_canary}
        if self.canary_on:
            kw["kv_canary_real_data"] = self.real_data
            if self.stack == PROJECT_STACK:
                kw["kv_canary_real_data_layers"] = self.real_data_layers
            if self.sweep_interval:
                kw["kv_canary_sweep_interval"] = self.sweep_interval
        return kw

    def env(self) -> dict[str, str]:
        env = {TOKEN_ENV: "1"} if self.verify_tokens else {}
        if self.side_fork:
            env[PACING_PROBE_FORK_ENV] = self.side_fork
        return env


CONFIGS = {
    c.name: c
    for c in (
        BenchConfig("off"),
        BenchConfig("raise", kv_canary="raise"),
        BenchConfig("abort", kv_canary="abort"),
        # heal against abort on a clean run: what holding a result until its forward's
        # read-back costs; the design:
        # docs/heal_design.md, "When: before sglang takes the corrupt forward's tokens"
        BenchConfig("heal", kv_canary="heal"),
        BenchConfig("raise+partial", kv_canary="raise", real_data="partial"),
        BenchConfig("raise+token", kv_canary="raise", verify_tokens=True),
        BenchConfig(
            "raise+token+partial", kv_canary="raise", real_data="partial", verify_tokens=True
        ),
        BenchConfig(
            "raise+partial+layers", kv_canary="raise", real_data="partial", real_data_layers="all"
        ),
        BenchConfig("raise+all+layers", kv_canary="raise", real_data="all", real_data_layers="all"),
    )
}
# canary off with one small kernel on a side stream forked and joined around the model, as the
# canary's: the decode baseline the canary's cost is read against (latency_h200.md); served
# by bench_interleaved.py only (a server's environment carries the probe)
SIDE_KERNEL_CONFIG = BenchConfig("off+sidekernel", side_fork="kernel")
# every slot's real-data fingerprint without per-layer fingerprints: the setting both canaries
# have (bench_interleaved.py's side by side with upstream)
ALL_DATA_CONFIG = BenchConfig("raise+all", kv_canary="raise", real_data="all")
# the same with the radix sweep every SWEEP_INTERVAL forwards (both canaries' flag)
SWEEP_INTERVAL = 100
SWEEP_CONFIG = BenchConfig(
    "raise+all+sweep", kv_canary="raise", real_data="all", sweep_interval=SWEEP_INTERVAL
)
# the configs beyond CONFIGS that the side by side runs on both stacks
SIDE_BY_SIDE_CONFIGS = (ALL_DATA_CONFIG, SWEEP_CONFIG)
# upstream's canary under the same flags (token checks through the same variable), for the
# servers of bench_interleaved.py --upstream-site: every config of a mode upstream has (none,
# log, raise: no abort) without per-layer fingerprints
UPSTREAM_CONFIGS = {
    UPSTREAM_PREFIX + c.name: dataclasses.replace(
        c, name=UPSTREAM_PREFIX + c.name, stack=UPSTREAM_STACK
    )
    for c in (*CONFIGS.values(), *SIDE_BY_SIDE_CONFIGS)
    if c.real_data_layers == "first" and c.kv_canary in ("none", "log", "raise")
}


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """Server settings shared by every config (only the canary differs)."""

    chunked_prefill_size: int = 8192
    max_total_tokens: int = 262144
    max_running_requests: int = 128
    mem_fraction_static: float = 0.7
    cuda_graph_bs: tuple = (1, 128)
    speculative: str = "none"  # a key of SPECULATIVE (write_speculative_files: its draft)
    piecewise: bool = True  # sglang's piecewise CUDA graphs for prefill (its default: on)
    model: str = DEFAULT_MODEL  # a key of MODELS
    # sglang's request metrics on (every config): each output's meta_info then carries the
    # scheduler's forward-entry and prefill-finished times (the server-side prefill time)
    server_timing: bool = True

    def engine_kwargs(self, model_dir: str, *, smoke: bool, draft_dir: str | None = None) -> dict:
        from sglang.srt.kv_canary.demo.server_harness import cpu_engine_kwargs, gpu_engine_kwargs

        if smoke:
            return cpu_engine_kwargs(
                model_dir,
                chunked_prefill_size=self.chunked_prefill_size,
                max_total_tokens=self.max_total_tokens,
                max_running_requests=self.max_running_requests,
                enable_metrics=self.server_timing,
                log_level="info",
            )
        spec = dict(SPECULATIVE[self.speculative])
        if SPECULATIVE_DRAFT_CONFIGS[self.speculative] is not None:
            spec["speculative_draft_model_path"] = draft_dir
        if self.speculative in SPECULATIVE_DRAFT_IN_TARGET:
            spec["speculative_draft_model_path"] = model_dir
        if spec.get("speculative_adaptive"):
            spec["speculative_adaptive_config"] = (
                os.path.join(draft_dir, ADAPTIVE_CONFIG_FILE) if draft_dir else None
            )
        return gpu_engine_kwargs(
            model_dir,
            chunked_prefill_size=self.chunked_prefill_size,
            max_total_tokens=self.max_total_tokens,
            max_running_requests=self.max_running_requests,
            mem_fraction_static=self.mem_fraction_static,
            cuda_graph_bs=list(self.cuda_graph_bs),
            cuda_graph_max_bs=max(self.cuda_graph_bs),
            disable_piecewise_cuda_graph=not self.piecewise,
            enable_metrics=self.server_timing,
            # sglang's default: an idle scheduler spins (the test
            # servers sleep; a sleeping one ran short prefills in slow
            # regimes: benchmark/results/latency_h100.md)
            sleep_on_idle=False,
            log_level="info",
            **spec,
        )


SMOKE_SETTINGS = EngineSettings(
    chunked_prefill_size=32,
    max_total_tokens=4096,
    max_running_requests=8,
    mem_fraction_static=0.05,
    cuda_graph_bs=(1, 2),
)


def parse_names(value: str, allowed: dict[str, object], flag: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SystemExit(
            f"{flag}: unknown value(s) {', '.join(map(repr, bad)) or '(empty)'}; "
            f"allowed (comma-separated): {', '.join(allowed)}"
        )
    return names


def bench_device(smoke: bool, what: str):
    """The device of an in-process benchmark: the CPU for a ``--smoke-cpu`` dry run, else the
    GPU (``what`` names the benchmark when there is none)."""
    import torch

    if not smoke and not torch.cuda.is_available():
        raise SystemExit(f"{what} needs a CUDA GPU (or pass --smoke-cpu for a CPU dry run)")
    return torch.device("cpu" if smoke else "cuda")


def canary_on_configs(value: str, what: str) -> list[str]:
    """``--configs`` without ``off`` (a breakdown of the canary's own time needs it on)."""
    configs = [c for c in parse_names(value, CONFIGS, "--configs") if c != "off"]
    if not configs:
        raise SystemExit(
            f"{what}: --configs names no canary-on config (allowed: "
            f"{', '.join(c for c in CONFIGS if c != 'off')})"
        )
    return configs


def gpu_name(smoke: bool) -> str:
    """GPU name without initialising CUDA in this process (sglang spawns its own)."""
    if smoke:
        return "cpu (smoke)"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.strip()
        return out.splitlines()[0] if out else "unknown GPU"
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def append_jsonl(path: str | None, record: dict) -> None:
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(paths: Sequence[str]) -> list[dict]:
    records = []
    for p in paths:
        with open(p) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


# ---- GPU timing ---------------------------------------------------------------------------------


def cuda_event_ms(fn, reps: int, *, warmup: int = 0) -> list[float]:
    """The device time of each of ``reps`` calls of ``fn``, in ms, each call between two CUDA
    events on the current stream; first ``warmup`` untimed calls and a synchronize (none
    when 0)."""
    import torch

    for _ in range(warmup):
        fn()
    if warmup:
        torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


# ---- torch profiler traces ----------------------------------------------------------------------

# the canary's kernels by name (its Triton kernels, the staging / read-back copies' kernels): a
# timeline names them, and folds runs of other kernels on one stream into one line
CANARY_KERNELS = (
    "_canary",
    "plan_",
    "_scatter_packed",
    "memcpy32_post",
    "_deep_",
    "multi_tensor_apply",
    "FillFunctor",
)
_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

TraceRow = tuple  # (start µs, duration µs, where: "stream N" or "host", name)


def trace_rows(trace_path, *, annotations: bool, host_calls: Sequence[str] = ()) -> list:
    """A Chrome trace's (``torch.profiler``; ``.json`` or ``.json.gz``) device events (kernels,
    copies: where = "stream N") and host events (where = "host"): the ``record_function``
    ranges when ``annotations``, and the CUDA runtime calls whose names start with one of
    ``host_calls``; sorted by start."""
    import gzip

    opener = gzip.open if str(trace_path).endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    calls = tuple(host_calls)
    rows = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), str(e.get("name", ""))
        if cat in _DEVICE_CATEGORIES:
            where = f"stream {e.get('args', {}).get('stream', '?')}"
        elif (annotations and cat == "user_annotation" and not name.startswith("ProfilerStep")) or (
            calls and cat == "cuda_runtime" and name.startswith(calls)
        ):
            where = "host"
        else:
            continue
        rows.append((float(e["ts"]), float(e["dur"]), where, name))
    rows.sort()
    return rows


def timeline(rows: Sequence[TraceRow], t0: float) -> list[str]:
    """One line per event, µs from ``t0``: ``start..end where name``; consecutive kernels on
    one stream that are not the canary's (:data:`CANARY_KERNELS`) fold into one
    ``(other kernels) xN`` line."""

    def label(where: str, name: str) -> str:
        if where == "host" or any(k in name for k in CANARY_KERNELS):
            return name[:100]
        return "(other kernels)"

    folded = []  # [start, end, where, count, label]
    for ts, dur, where, name in rows:
        text = label(where, name)
        last = folded[-1] if folded else None
        if last is not None and where != "host" and last[2] == where and last[4] == text:
            last[1] = max(last[1], ts + dur - t0)
            last[3] += 1
            continue
        folded.append([ts - t0, ts + dur - t0, where, 1, text])
    return [
        f"{a:9.1f}..{b:9.1f} {w:>10} {n}" + (f" x{c}" if c > 1 else "") for a, b, w, c, n in folded
    ]


# ---- a scenario's inputs and sglang's timings ------------------------------------------------


def make_inputs(scenario: Scenario, run: int, vocab: int) -> list[list[int]]:
    """Random token ids, fixed per (scenario, run): every config sees the same inputs, every
    request and run differs (no radix hits)."""
    import numpy as np

    rng = np.random.default_rng(zlib.crc32(f"{scenario.name}/{run}".encode()))
    lo, hi = min(100, vocab // 8), vocab - min(100, vocab // 8)
    return rng.integers(lo, hi, size=(scenario.bs, scenario.isl)).tolist()


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between the order statistics)."""
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def server_prefill_ms(outs: list[dict]) -> float | None:
    """The scheduler's own prefill time of one ``generate`` call (``--server-timing``): from
    the first request's entry into a forward batch to the last request's prefill result
    processed (sglang's ``forward_entry_time`` / ``prefill_finished_time``, meta_info with
    request metrics on), in ms; None without them. What a time to first token pays in the
    scheduler, without the tokenizer / detokenizer processes and their queues."""
    metas = [o.get("meta_info", {}) for o in outs]
    starts = [m.get("forward_entry_time") for m in metas]
    ends = [m.get("prefill_finished_time") for m in metas]
    if not metas or None in starts or None in ends:
        return None
    return (max(ends) - min(starts)) * 1e3


def server_stats(server: list) -> dict:
    """The JSON fields of the server-side prefill times of one scenario (none if missing)."""
    if not server or None in server:
        return {}
    return dict(
        server_runs_ms=server,
        server_median_ms=statistics.median(server),
        server_min_ms=min(server),
        server_p10_ms=quantile(server, 0.1),
        server_p90_ms=quantile(server, 0.9),
    )


def parse_ints(value: str, flag: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or any(v < 1 for v in out):
        raise SystemExit(f"{flag}: expected comma-separated positive integers, got {value!r}")
    return out
