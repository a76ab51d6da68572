"""``install_canary``: put the canary on one ``ModelRunner`` (docs/architecture.md, "Start-up").

Called by the plugin's hook right after ``ModelRunner.init_memory_pool`` (the KV pool exists,
CUDA graphs are not captured yet). Reads what it needs off the runner through the sglang seam,
builds the canary with :func:`~sglang.srt.kv_canary.builder.build_canary`, stores the manager
on the runner and wraps the runner's ``model.forward`` (instance attribute) with the HEAD /
TAIL bracket, so eager forwards run the launches and decode CUDA-graph capture records them
into the graphs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.builder import build_canary
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode
from sglang.srt.kv_canary.perturb.config import FaultKind, RankFacts
from sglang.srt.kv_canary.runner import CanaryManager
from sglang.srt.kv_canary.token_oracle.manager import TokenOracleManager
from sglang.srt.kv_canary.token_oracle.oracle import TOKEN_ORACLE_BACKEND
from sglang.srt.kv_canary.token_oracle.sampler import TokenOracleSampler

if TYPE_CHECKING:
    from sglang.srt.kv_canary.sglang_seam import ModelRunner, ServerArgs

logger = logging.getLogger(__name__)


def get_canary_manager(model_runner: Optional["ModelRunner"]) -> Optional[CanaryManager]:
    """The runner's manager, or None when the canary is off (or not installed there)."""
    return sglang_seam.runner_canary(model_runner)


def check_server_args_for_canary(server_args: "ServerArgs") -> CanaryConfig:
    """Validate the canary flags and environment (and refuse what the canary does not
    support); returns the config. Raises ``ValueError`` naming the flag or variable."""
    config = CanaryConfig.from_server_args(server_args)
    if not config.enabled:
        return config
    value = sglang_seam.server_args_value
    if (value(server_args, "device", "cuda") in ("cuda", None)
            and not value(server_args, "disable_piecewise_cuda_graph", True)):
        raise ValueError(
            "--kv-canary does not support piecewise CUDA graphs for prefill: add "
            "--disable-piecewise-cuda-graph"
        )
    if value(server_args, "enable_torch_compile", False):
        raise ValueError("--kv-canary does not support --enable-torch-compile (the canary's "
                         "launches must stay outside the compiled model); drop that flag")
    if config.mode == CanaryMode.ABORT:
        _check_abort_mode(server_args)
    storage = value(server_args, "hicache_storage_backend", None)
    if value(server_args, "enable_hierarchical_cache", False) and storage:
        raise ValueError(
            f"--kv-canary does not support --hicache-storage-backend {storage} yet: pages "
            "prefetched back from that storage tier would come without their canary rows and "
            "fail their checks. HiCache's host tier alone is covered: drop "
            "--hicache-storage-backend, or run without --kv-canary")
    if (FaultKind.HOST_KV in config.perturb.active_faults
            and not value(server_args, "enable_hierarchical_cache", False)):
        raise ValueError(f"{FaultKind.HOST_KV.env_var} > 0 corrupts HiCache's host memory: "
                         "pass --enable-hierarchical-cache (or drop the variable)")
    config.perturb.check_ranks(RankFacts(
        tp_size=int(value(server_args, "tp_size", 1) or 1),
        pp_size=int(value(server_args, "pp_size", 1) or 1),
        dp_size=int(value(server_args, "dp_size", 1) or 1)))
    return config


def _check_abort_mode(server_args: "ServerArgs") -> None:
    """``--kv-canary abort`` changes the scheduler's batch (it aborts requests) on what one
    rank's canary saw. sglang's schedulers of several ranks must make identical decisions,
    and a corruption (one GPU's memory, one rank's ``req_to_token``) is seen by one rank
    only: each rank would abort different requests and the ranks would fall out of step.
    PD disaggregation moves a request between servers (prefill's running batch hands it to a
    transfer queue the abort path does not drain). Both are refused rather than run unsound
    (docs/user_guide.md, "Containment: --kv-canary abort")."""
    value = sglang_seam.server_args_value
    multi = [f"{flag} {v}" for flag, name in (("--tp-size", "tp_size"), ("--pp-size", "pp_size"),
                                               ("--dp-size", "dp_size"))
             if (v := int(value(server_args, name, 1) or 1)) > 1]
    if value(server_args, "enable_dp_attention", False):
        multi.append("--enable-dp-attention")
    if multi:
        raise ValueError(
            "--kv-canary abort needs a single scheduler rank: with " + ", ".join(multi)
            + " each rank's canary sees its own corruption and the ranks would abort different "
            "requests (their schedulers must agree); use --kv-canary raise or log there")
    mode = value(server_args, "disaggregation_mode", "null")
    if mode not in (None, "null"):
        raise ValueError(
            f"--kv-canary abort does not support --disaggregation-mode {mode} (a request moves "
            "between the prefill and decode servers, outside the abort path the canary uses); "
            "use --kv-canary raise or log there")


def capacity_inputs_from_server_args(server_args: "ServerArgs", *, context_len: int
                                     ) -> CanaryCapacityInputs:
    value = sglang_seam.server_args_value
    return CanaryCapacityInputs(
        context_len=context_len,
        chunked_prefill_size=value(server_args, "chunked_prefill_size", None),
        max_prefill_tokens=int(value(server_args, "max_prefill_tokens", 0) or 0),
        cuda_graph_max_bs=value(server_args, "cuda_graph_max_bs", None),
    )


def _use_token_oracle_sampler(model_runner: "ModelRunner") -> None:
    """Make the runner sample with the token oracle. sglang builds its sampler from
    ``--sampling-backend`` but forces ``pytorch`` on some devices (the CPU engine): then the
    oracle is swapped in here, with a log line saying so."""
    current = sglang_seam.runner_sampler(model_runner)
    if isinstance(current, TokenOracleSampler):
        return
    logger.info("kv_canary: token oracle on; replacing sglang's %s with the %s sampler",
                type(current).__name__, TOKEN_ORACLE_BACKEND)
    sglang_seam.set_runner_sampler(model_runner, TokenOracleSampler())


def install_canary(*, server_args: "ServerArgs", model_runner: "ModelRunner",
                   token_oracle_manager: Optional[TokenOracleManager] = None
                   ) -> Optional[CanaryManager]:
    """Install the canary on ``model_runner`` if ``--kv-canary`` is on; returns the manager
    (also stored on the runner, see :func:`get_canary_manager`) or None.

    With the token oracle on (``--sampling-backend token_oracle`` or
    ``SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE=1``) a :class:`TokenOracleManager` is created unless
    ``token_oracle_manager`` is given, and the runner samples with the oracle."""
    config = check_server_args_for_canary(server_args)
    if not config.enabled:
        return None
    if sglang_seam.is_draft_worker(model_runner):
        logger.warning("kv_canary: EAGLE draft workers are not covered yet; the draft pool "
                       "runs without the canary")
        return None
    if get_canary_manager(model_runner) is not None:
        raise RuntimeError("kv_canary is already installed on this model runner")
    runner = sglang_seam.RunnerFacts(model_runner)
    manager = build_canary(
        pool=runner.kv_pool, req_to_token=runner.req_to_token, config=config,
        capacity_inputs=capacity_inputs_from_server_args(server_args,
                                                         context_len=runner.context_len),
        device=runner.device,
        # the SWA layers' window, as the scheduler's SWA eviction uses it (None without SWA)
        swa_window_size=runner.sliding_window_size,
        vocab_size=runner.vocab_size, token_oracle=token_oracle_manager,
        ranks=RankFacts(tp_rank=runner.tp_rank, tp_size=runner.tp_size, pp_rank=runner.pp_rank,
                        pp_size=runner.pp_size, dp_rank=runner.dp_rank,
                        dp_size=int(sglang_seam.server_args_value(server_args, "dp_size", 1)
                                    or 1)))
    if manager.token_oracle is not None:
        _use_token_oracle_sampler(model_runner)
    sglang_seam.set_runner_canary(model_runner, manager)
    sglang_seam.wrap_model_forward(model_runner, before=manager.pre_ops_maybe_inside_graph,
                                   after=manager.post_ops_maybe_inside_graph)
    logger.info("kv_canary installed: %s pool=%s groups=%d capacities=%s", config.describe(),
                type(runner.kv_pool).__name__, len(manager.groups), manager.capacities)
    if config.perturb.enabled and manager.perturber is None:
        logger.info("kv_canary: fault injection is set for another rank; none on this one "
                    "(%s)", manager.ranks.describe())
    elif config.perturb.enabled:
        logger.warning("kv_canary: FAULT INJECTION ON (%s) after %d warm-up steps: this server "
                       "corrupts its own KV cache on purpose (self-test)",
                       ", ".join(k.value for k in config.perturb.active_faults),
                       config.perturb.warmup_steps)
    return manager
