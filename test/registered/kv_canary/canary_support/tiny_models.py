"""Tiny dummy-weight model shapes for the end-to-end tests and benchmarks beyond the demo's
Llama: DeepSeek-V2 (MLA), DeepSeek-V3's MLA dimensions, DeepSeek-V3.2 (MLA + DSA indexer) and
Qwen3-Next (hybrid linear attention), GPT-OSS (one sliding-window and one full-attention
layer), a Gemma4 target with its MTP assistant (FROZEN_KV_MTP) and a Step-3.5 target with its
three MTP layers (multi-layer EAGLE). Each ``write_tiny_*``
writes a bare ``config.json``
(``load_format="dummy"``, requests pass ``input_ids``)."""

from __future__ import annotations

from sglang.srt.kv_canary.demo.server_harness import write_model_config, write_tiny_llama

# A tiny DeepSeek-V2-shaped MLA model (dense MLP on every layer: first_k_dense_replace = the
# layer count). sglang 0.5.12's CPU engine builds its MLATokenToKVPool; it serves it with the
# triton attention backend under TRITON_INTERPRET=1 when kv_lora_rank + qk_rope_head_dim is
# 288 or 576, and needs yarn rope scaling.
TINY_DEEPSEEK_V2_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 256,
    "q_lora_rank": None,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# DeepSeek-V3's own MLA head dimensions, for a tiny model whose attention should take the
# shapes sglang's MLA kernels are tuned for (the tiny DeepSeek-V2 above has dims of 32)
DEEPSEEK_V3_MLA_DIMS = dict(
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
)

# A tiny DeepSeek-V3.2-shaped model (DSA: NSATokenToKVPool, page 64). Its shapes are the ones
# sglang's NSA kernels take on a Hopper GPU (FlashMLA sparse: a 512 + 64 latent row, 64 query
# heads; the indexer: 64 heads of 128, top-2048); everything else is tiny and dense.
TINY_DEEPSEEK_V32_CONFIG = {
    **TINY_DEEPSEEK_V2_CONFIG,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "kv_lora_rank": 512,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}

# A tiny Qwen3-Next-shaped hybrid model (HybridLinearKVPool): four layers, every second one
# full attention (an inner MHATokenToKVPool), the others gated delta-net linear attention with
# per-request Mamba state; a small MoE on every layer.
TINY_QWEN3_NEXT_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# A tiny GPT-OSS (hybrid sliding window: layer 0 sliding, layer 1 full attention; sglang builds
# an SWAKVPool for it; GPU only: sglang 0.5.12's CPU attention has no sliding window)
TINY_GPT_OSS_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention"],
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


# A tiny Gemma4 text target (``Gemma4ForCausalLM``; sglang builds an ``SWAKVPool`` for it,
# GPU only as GPT-OSS above) for FROZEN_KV_MTP (docs/speculative_multilayer_adaptive_dflash_mtp.md,
# "4.1 What sglang 0.5.12 runs"): layers sliding, full, sliding, full, the last two KV-shared
# (``num_kv_shared_layers``) with layers 0 and 1, whose KV the assistant reads. Heads of 16 as
# the tiny Llama's, on every layer of either type; no per-layer embeddings
# (``hidden_size_per_layer_input`` 0: transformers' default is 256), default rope on both types
# (transformers' default for full attention is a "proportional" partial rope). sglang 0.5.12
# copies a Gemma4 config's ``swa_*`` and ``v_head_dim`` fields from its base ones only for
# ``model_type`` "gemma4" (``utils/hf_transformers/config.py``), while ``Gemma4ForCausalLM`` takes
# the text config itself ("gemma4_text"), so they are written out here: its SWAKVPool reads them.
GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
}
TINY_GEMMA4_TEXT_CONFIG = {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 16,
    "num_global_key_value_heads": 2,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "swa_v_head_dim": 16,
    "v_head_dim": 16,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "num_kv_shared_layers": 2,
    "sliding_window": 32,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 512,
    # no MoE block; set because sglang's CPU start-up pads it (None stops the CPU server:
    # "unsupported operand type(s) for %: 'NoneType' and 'int'", configs/update_config.py)
    "moe_intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": GEMMA4_ROPE,
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# Its MTP assistant (``Gemma4AssistantForCausalLM``): one sliding and one full layer, each
# bound to the target's KV owner of that type. No library has an assistant config class and
# transformers 5.6.0 knows no "gemma4_assistant", so it is a "gemma4" config (the assistant
# reads its ``text_config``; sglang maps ``global_head_dim`` / ``num_global_key_value_heads``
# to the full layers' heads), with ``backbone_hidden_size`` the target's hidden size.
TINY_GEMMA4_ASSISTANT_CONFIG = {
    "architectures": ["Gemma4AssistantForCausalLM"],
    "model_type": "gemma4",
    "backbone_hidden_size": 64,
    "text_config": {
        **{k: v for k, v in TINY_GEMMA4_TEXT_CONFIG.items() if k != "architectures"},
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_kv_shared_layers": 0,
    },
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def write_tiny_deepseek_v2(model_dir, **overrides) -> str:
    """Write the tiny DeepSeek-V2 (MLA) ``config.json`` into ``model_dir``; returns it."""
    return write_model_config(model_dir, {**TINY_DEEPSEEK_V2_CONFIG, **overrides})


def write_tiny_deepseek_v32(model_dir, **overrides) -> str:
    """Write the tiny DeepSeek-V3.2 (MLA + DSA indexer, ``NSATokenToKVPool``) ``config.json``
    into ``model_dir``; returns it."""
    return write_model_config(model_dir, {**TINY_DEEPSEEK_V32_CONFIG, **overrides})


def write_tiny_qwen3_next(model_dir, **overrides) -> str:
    """Write the tiny Qwen3-Next (hybrid linear attention, ``HybridLinearKVPool``)
    ``config.json`` into ``model_dir``; returns it."""
    return write_model_config(model_dir, {**TINY_QWEN3_NEXT_CONFIG, **overrides})


def write_tiny_gpt_oss(model_dir, **overrides) -> str:
    """Write the tiny GPT-OSS (hybrid sliding window, ``SWAKVPool``) ``config.json`` into
    ``model_dir``; returns it."""
    return write_model_config(model_dir, {**TINY_GPT_OSS_CONFIG, **overrides})


def write_tiny_gemma4_pair(target_dir, draft_dir) -> tuple:
    """Write the tiny Gemma4 target and its MTP assistant draft (FROZEN_KV_MTP) ``config.json``
    files; returns (target dir, draft dir)."""
    return (
        write_model_config(target_dir, TINY_GEMMA4_TEXT_CONFIG),
        write_model_config(draft_dir, TINY_GEMMA4_ASSISTANT_CONFIG),
    )


def write_tiny_dflash_pair(target_dir, draft_dir) -> tuple:
    """Write a four-layer tiny Llama target and a one-layer ``DFlashDraftModel`` (block size 4,
    fed by target layers 0 and 1: sglang 0.5.12's Llama captures layer k's output before layer
    k + 1 runs, so the last layer's output is never captured) ``config.json`` files; returns
    (target dir, draft dir)."""
    draft = write_tiny_llama(
        draft_dir,
        architectures=["DFlashDraftModel"],
        num_hidden_layers=1,
        dflash_config={
            "block_size": 4,
            "mask_token_id": 3,
            "num_target_layers": 4,
            "target_layer_ids": [0, 1],
        },
    )
    return write_tiny_llama(target_dir, num_hidden_layers=4), draft


# A tiny Step-3.5 (``Step3p5ForCausalLM``: hybrid sliding window 3:1, MoE on two layers, three
# MTP layers after the last). sglang 0.5.12 turns ``--speculative-algorithm EAGLE`` into
# multi-layer EAGLE for this architecture, loads the draft from the same directory as
# ``Step3p5MTP`` (one sliding-window layer per MTP runner) and builds every MTP block with
# ``layer_id = 45`` (a FIXME in ``step3p5_mtp.py``): its attention layer is ``45 -
# num_hidden_layers``, the one layer of a draft pool only with 45 target layers. Per-layer lists
# have the 48 entries of the target's layers and the MTP layers.
_STEP3P5_LAYERS, _STEP3P5_MTP = 45, 3
TINY_STEP3P5_CONFIG = {
    "architectures": ["Step3p5ForCausalLM"],
    "model_type": "step3p5",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_attention_groups": 2,
    "head_dim": 16,
    "num_hidden_layers": _STEP3P5_LAYERS,
    "num_nextn_predict_layers": _STEP3P5_MTP,
    "layer_types": [
        "full_attention" if i % 4 == 3 and i < _STEP3P5_LAYERS else "sliding_attention"
        for i in range(_STEP3P5_LAYERS + _STEP3P5_MTP)
    ],
    "sliding_window": 32,
    "attention_other_setting": {"num_attention_heads": 4, "num_attention_groups": 2},
    "use_head_wise_attn_gate": False,
    "partial_rotary_factors": [1.0] * (_STEP3P5_LAYERS + _STEP3P5_MTP),
    "rope_theta": [10000.0] * (_STEP3P5_LAYERS + _STEP3P5_MTP),
    "rope_scaling": None,
    "yarn_only_types": [],
    "moe_layers_enum": "3,4",
    "moe_num_experts": 4,
    "moe_top_k": 2,
    "moe_intermediate_size": 32,
    "share_expert_dims": 32,
    "moe_router_scaling_factor": 1.0,
    # as Step-3.5-Flash sets it: sglang 0.5.12's Step3p5MoEMLP reads its router bias even
    # without it (AttributeError: 'Step3p5MoEMLP' object has no attribute 'router_bias')
    "use_moe_router_bias": True,
    "need_fp32_gate": False,
    "norm_expert_weight": True,
    "swiglu_limits": [0.0] * (_STEP3P5_LAYERS + _STEP3P5_MTP),
    "swiglu_limits_shared": [0.0] * (_STEP3P5_LAYERS + _STEP3P5_MTP),
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "max_seq_len": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_step3p5(model_dir, **overrides) -> str:
    """Write the tiny Step-3.5 (hybrid sliding window, three MTP layers: multi-layer EAGLE's
    target and, from the same directory, its draft) ``config.json`` into ``model_dir``;
    returns it."""
    return write_model_config(model_dir, {**TINY_STEP3P5_CONFIG, **overrides})
