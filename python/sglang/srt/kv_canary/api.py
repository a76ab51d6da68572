"""``install_canary``: build the canary for one ``ModelRunner`` (SPEC §14).

Called by the plugin's hook right after ``ModelRunner.init_memory_pool`` (the KV pool exists,
CUDA graphs are not captured yet). Attaches canary buffers to the runner's KV pool, builds the
:class:`CanaryManager`, and wraps the runner's ``model.forward`` (instance attribute) with the
HEAD / TAIL bracket, so eager forwards run the launches and decode CUDA-graph capture records
them into the graphs.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

from sglang.srt.kv_canary.capacities import CanaryLaunchCapacities
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.pool_patcher import attach_canary_buffers
from sglang.srt.kv_canary.runner import CanaryManager
from sglang.srt.kv_canary.token_oracle.manager import TokenOracleManager
from sglang.srt.kv_canary.token_oracle.oracle import TOKEN_ORACLE_BACKEND

logger = logging.getLogger(__name__)

MANAGER_ATTR = "kv_canary_manager"
_WRAPPED_FORWARD_MARK = "_kv_canary_wrapped_forward"


def get_canary_manager(model_runner) -> Optional[CanaryManager]:
    """The runner's manager, or None when the canary is off (or not installed there)."""
    return getattr(model_runner, MANAGER_ATTR, None)


def check_server_args_for_canary(server_args) -> CanaryConfig:
    """Validate the canary flags and environment (and refuse what the canary does not
    support); returns the config. Raises ``ValueError`` naming the flag or variable."""
    config = CanaryConfig.from_server_args(server_args)
    if not config.enabled:
        return config
    if (getattr(server_args, "device", "cuda") in ("cuda", None)
            and not getattr(server_args, "disable_piecewise_cuda_graph", True)):
        raise ValueError(
            "--kv-canary does not support piecewise CUDA graphs for prefill: add "
            "--disable-piecewise-cuda-graph"
        )
    if getattr(server_args, "enable_torch_compile", False):
        raise ValueError("--kv-canary does not support --enable-torch-compile (the canary's "
                         "launches must stay outside the compiled model); drop that flag")
    return config


def _capacities(server_args, model_runner, num_slots: int) -> CanaryLaunchCapacities:
    max_reqs = int(model_runner.req_to_token_pool.req_to_token.shape[0])
    context = int(model_runner.model_config.context_len)
    chunk = getattr(server_args, "chunked_prefill_size", None) or -1
    prefill = max(int(getattr(server_args, "max_prefill_tokens", 0) or 0), chunk)
    return CanaryLaunchCapacities.from_args(
        num_slots=num_slots,
        max_running_requests=max_reqs,
        # a prefill batch (or one unchunked prompt) plus the decodes mixed into it
        max_tokens_per_forward=max(prefill, context) + max_reqs,
        cuda_graph_max_bs=getattr(server_args, "cuda_graph_max_bs", None),
    )


def wrap_model_forward(model, manager: CanaryManager) -> None:
    """Wrap ``model.forward`` (as an instance attribute, once) with the HEAD/TAIL bracket."""
    if getattr(model, _WRAPPED_FORWARD_MARK, False):
        return
    original = model.forward

    @functools.wraps(original)
    def forward(input_ids, positions, forward_batch, *args, **kwargs):
        manager.pre_ops_maybe_inside_graph(forward_batch)
        out = original(input_ids, positions, forward_batch, *args, **kwargs)
        manager.post_ops_maybe_inside_graph(forward_batch)
        return out

    model.forward = forward
    setattr(model, _WRAPPED_FORWARD_MARK, True)


def _use_token_oracle_sampler(model_runner) -> None:
    """Make the runner sample with the token oracle. sglang builds its sampler from
    ``--sampling-backend`` but forces ``pytorch`` on some devices (the CPU engine): then the
    oracle is swapped in here, with a log line saying so."""
    from sglang.srt.kv_canary.token_oracle.sampler import TokenOracleSampler

    current = getattr(model_runner, "sampler", None)
    if isinstance(current, TokenOracleSampler):
        return
    logger.info("kv_canary: token oracle on; replacing sglang's %s with the %s sampler",
                type(current).__name__, TOKEN_ORACLE_BACKEND)
    model_runner.sampler = TokenOracleSampler()


def install_canary(*, server_args, model_runner, token_oracle_manager=None
                   ) -> Optional[CanaryManager]:
    """Install the canary on ``model_runner`` if ``--kv-canary`` is on; returns the manager
    (also stored as ``model_runner.kv_canary_manager``) or None.

    With the token oracle on (``--sampling-backend token_oracle`` or
    ``SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE=1``) a :class:`TokenOracleManager` is created unless
    ``token_oracle_manager`` is given, and the runner samples with the oracle."""
    config = check_server_args_for_canary(server_args)
    if not config.enabled:
        return None
    if getattr(model_runner, "is_draft_worker", False):
        logger.warning("kv_canary: EAGLE draft workers are not covered yet; the draft pool "
                       "runs without the canary")
        return None
    if get_canary_manager(model_runner) is not None:
        raise RuntimeError("kv_canary is already installed on this model runner")
    pool = model_runner.token_to_kv_pool
    device = model_runner.device
    # the SWA layers' window, as the scheduler's SWA eviction uses it (None without SWA)
    window = getattr(model_runner, "sliding_window_size", None)
    groups = attach_canary_buffers(pool=pool, config=config, device=device,
                                   kv_token_id_vs_position_offset=0,
                                   swa_window_size=int(window) if window else None)
    capacities = _capacities(server_args, model_runner, groups[0].num_slots)
    if config.enable_token_oracle and token_oracle_manager is None:
        token_oracle_manager = TokenOracleManager(
            vocab_size=int(model_runner.model_config.vocab_size), device=device)
    manager = CanaryManager(config=config, groups=groups, capacities=capacities,
                            req_to_token=model_runner.req_to_token_pool.req_to_token,
                            device=device, token_oracle=token_oracle_manager)
    if token_oracle_manager is not None:
        _use_token_oracle_sampler(model_runner)
    setattr(model_runner, MANAGER_ATTR, manager)
    wrap_model_forward(model_runner.model, manager)
    logger.info("kv_canary installed: mode=%s real_data=%s groups=%d token_oracle=%s "
                "capacities=%s", config.mode.value, config.real_kv_hash_mode.name.lower(),
                len(groups), token_oracle_manager is not None, capacities)
    if config.perturb.enabled:
        logger.warning("kv_canary: FAULT INJECTION ON (%s) after %d warm-up steps: this server "
                       "corrupts its own KV cache on purpose (self-test)",
                       ", ".join(k.value for k in config.perturb.active_faults),
                       config.perturb.warmup_steps)
    return manager
