"""KV pool sizing before the pool exists (``ModelRunner._profile_available_bytes``): the pool family and token counts sglang will size.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| KV pool sizing (``ModelRunner._profile_available_bytes``, before the pool exists) | hook target; :class:`KvPoolSizing` calls ``create_memory_pool_configurator`` (``calculate_pool_sizes`` / ``_from_max_tokens``, ``MemoryPoolConfig``'s token counts) and ``ModelRunner._resolve_max_num_reqs``; reads ``server_args.page_size`` / ``max_total_tokens`` / ``speculative_num_draft_tokens`` / ``disaggregation_mode``, ``model_config`` (context length, layer ids, ``hf_config``), ``use_mla_backend``, ``is_hybrid_swa``, ``mambaish_config``, ``num_effective_layers``, ``start_layer`` / ``end_layer``, ``device``; sets ``kv_canary_memory_reservation`` on the target ``ModelRunner`` and its ``memory_pool_config`` (the draft runner's, shared) | ``memory_budget``, ``install``, ``plugin`` |
| ``ModelConfig.from_server_args(server_args, model_path=..., is_draft_model=True)`` (what ``TpModelWorker._init_model_config`` builds for a draft worker); reads ``server_args.speculative_draft_model_path`` / ``speculative_draft_model_revision`` / ``model_path``, the config's ``hf_config``, ``attention_arch``, ``is_hybrid_swa``, ``full_attention_layer_ids`` / ``swa_attention_layer_ids``, ``num_nextn_predict_layers``, ``num_hidden_layers`` / ``num_attention_layers``, ``hf_config.loop_num`` | :func:`draft_model_shape`: a STANDALONE draft pool's family and layers, before the draft worker exists | ``memory_budget`` |
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:  # annotations only
    from sglang.srt.model_executor.model_runner import ModelRunner


class PoolFamily(str, enum.Enum):
    """How the pool sglang is about to build lays out its slots (what the canary's groups
    follow): one slot space (MHA-like: K and V rows; MLA-like: one latent row), or a full and
    a sliding-window space (hybrid SWA; DeepSeek-V4)."""

    MHA = "mha"
    MLA = "mla"
    SWA = "swa"
    DSV4 = "dsv4"


@dataclasses.dataclass(frozen=True)
class PoolTokens:
    """Token counts of one candidate pool: ``max_total`` (sglang's ``max_total_num_tokens``;
    for SWA pools the full space's) and ``swa_total`` (the SWA space's; None without one)."""

    max_total: int
    swa_total: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class DraftModelShape:
    """What a separate draft model's KV pool will look like: its ``family`` and attention
    layers (``layers``: the full ones, ``swa_layers``: the sliding-window ones of an SWA
    pool, else 0)."""

    family: PoolFamily
    layers: int
    swa_layers: int = 0


def draft_model_shape(server_args) -> DraftModelShape:
    """The KV pool shape sglang's draft ``ModelRunner`` will build for a separate draft
    model (STANDALONE): from the draft's own config, as ``TpModelWorker`` reads it
    (``--speculative-draft-model-path``, else the target's ``model_path``), with the layer
    count ``ModelRunner`` derives (no pipeline parallelism). Raises ``ValueError`` naming
    ``--speculative-draft-model-path`` when that config cannot be read."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig, is_deepseek_v4

    path = getattr(server_args, "speculative_draft_model_path", None) or server_args.model_path
    try:
        config = ModelConfig.from_server_args(
            server_args,
            model_path=path,
            model_revision=getattr(server_args, "speculative_draft_model_revision", None),
            is_draft_model=True,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, AssertionError) as exc:
        raise ValueError(
            f"--speculative-draft-model-path {path!r}: sglang cannot read the draft model's "
            f"config ({type(exc).__name__}: {exc}); the canary sizes the draft pool's share "
            "of the KV budget from it"
        ) from exc
    hf = config.hf_config
    nextn = getattr(config, "num_nextn_predict_layers", None)
    layers = (
        int(nextn)
        if nextn is not None
        else max(int(config.num_hidden_layers), int(config.num_attention_layers))
    )
    layers *= int(getattr(hf, "loop_num", 1) or 1)
    if getattr(config, "is_hybrid_swa", False):
        if is_deepseek_v4(hf):
            return DraftModelShape(PoolFamily.DSV4, layers)
        return DraftModelShape(
            PoolFamily.SWA,
            len(config.full_attention_layer_ids),
            len(config.swa_attention_layer_ids),
        )
    if config.attention_arch == AttentionArch.MLA:
        return DraftModelShape(PoolFamily.MLA, layers)
    return DraftModelShape(PoolFamily.MHA, layers)


class KvPoolSizing:
    """sglang's sizing of one ``ModelRunner``'s KV pool, for the canary to size itself into
    it, inside ``_profile_available_bytes`` (the model is loaded, the pool not yet built).
    Reads ``server_args.page_size`` / ``max_total_tokens`` / ``speculative_num_draft_tokens``
    / ``disaggregation_mode``, ``model_config`` (context length, layer ids), ``use_mla_backend``,
    ``is_hybrid_swa``, ``mambaish_config``, ``num_effective_layers``, ``start_layer`` /
    ``end_layer``; calls ``create_memory_pool_configurator`` (``calculate_pool_sizes`` /
    ``_from_max_tokens``) and ``ModelRunner._resolve_max_num_reqs``, as sglang's own
    ``_resolve_memory_pool_config`` does next."""

    def __init__(self, model_runner: "ModelRunner"):
        from sglang.srt.configs.model_config import is_deepseek_v4
        from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

        mr = model_runner
        self._runner = mr
        self._args = mr.server_args
        self.device = mr.device
        self._configurator = create_memory_pool_configurator(mr)
        self.page_size = int(self._args.page_size or 1)
        self.context_len = int(mr.model_config.context_len)
        hf = mr.model_config.hf_config
        if is_deepseek_v4(hf) and mr.is_hybrid_swa:
            self.family = PoolFamily.DSV4
        elif mr.is_hybrid_swa:
            self.family = PoolFamily.SWA
        elif mr.use_mla_backend:
            self.family = PoolFamily.MLA
        else:
            self.family = PoolFamily.MHA
        mamba = mr.mambaish_config
        if self.family == PoolFamily.SWA:
            self.layers = len(mr.model_config.full_attention_layer_ids)
            self.swa_layers = len(mr.model_config.swa_attention_layer_ids)
        elif mamba is not None:
            self.layers = sum(
                1 for i in mamba.full_attention_layer_ids if mr.start_layer <= i < mr.end_layer
            )
            self.swa_layers = 0
        else:
            self.layers = int(mr.num_effective_layers)
            self.swa_layers = 0
        self._user_cap = self._args.max_total_tokens
        self._draft_tokens = int(self._args.speculative_num_draft_tokens or 0)
        self._decode = self._args.disaggregation_mode == "decode"

    def tokens_for(self, kv_bytes: int) -> Optional[PoolTokens]:
        """What sglang's configurator makes of ``kv_bytes`` (then ``--max-total-tokens``);
        None when that is no pool at all (sglang then stops with "Not enough memory")."""
        if kv_bytes <= 0:
            return None
        try:
            config = self._configurator.calculate_pool_sizes(int(kv_bytes), self.page_size)
            if self._user_cap is not None and self._user_cap < config.max_total_num_tokens:
                config = self._configurator.calculate_pool_sizes_from_max_tokens(
                    int(self._user_cap), self.page_size
                )
        except RuntimeError:  # MemoryPoolConfig: max_total_num_tokens <= 0
            return None
        swa = config.swa_max_total_num_tokens
        full = config.full_max_total_num_tokens
        if swa is not None and full is not None:
            return PoolTokens(max_total=int(full), swa_total=int(swa))
        return PoolTokens(max_total=int(config.max_total_num_tokens))

    def req_to_token_shape(self, tokens: PoolTokens) -> Tuple[int, int]:
        """``ReqToTokenPool.req_to_token``'s shape for a pool of ``tokens``: a row per request
        sglang admits (plus the padding row, plus PD decode's pre-allocated rows) and the
        context length plus sglang's extra columns (4, plus the draft tokens)."""
        reqs = int(self._runner._resolve_max_num_reqs(tokens.max_total))
        rows = reqs + 1
        if self._decode:
            from sglang.srt.environ import envs

            rows += (
                reqs * 2
                if reqs <= 32
                else int(envs.SGLANG_DISAGGREGATION_NUM_PRE_ALLOCATE_REQS.get())
            )
        return rows, self.context_len + 4 + self._draft_tokens
