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
from typing import TYPE_CHECKING, Optional, Tuple

from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.builder import build_canary
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode, DraftViolations
from sglang.srt.kv_canary.memory import format_bytes
from sglang.srt.kv_canary.memory_budget import CanaryMemoryReservation, reserve_canary_memory
from sglang.srt.kv_canary.perturb.config import TARGET_WORKER_VAR, WORKER_DRAFT, FaultKind
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.kv_canary.manager import CanaryManager
from sglang.srt.kv_canary.token_oracle.expected_tokens import TokenOracleManager
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
    config = CanaryConfig.of_server(server_args)
    if not config.enabled:
        return config
    value = sglang_seam.server_args_value
    if value(server_args, "enable_torch_compile", False):
        raise ValueError(
            "--kv-canary does not support --enable-torch-compile (the canary's "
            "launches must stay outside the compiled model); drop that flag"
        )
    if config.mode == CanaryMode.ABORT:
        _check_abort_mode(server_args)
    storage = value(server_args, "hicache_storage_backend", None)
    if value(server_args, "enable_hierarchical_cache", False) and storage:
        raise ValueError(
            f"--kv-canary does not support --hicache-storage-backend {storage} yet: pages "
            "prefetched back from that storage tier would come without their canary rows and "
            "fail their checks. HiCache's host tier alone is covered: drop "
            "--hicache-storage-backend, or run without --kv-canary"
        )
    if FaultKind.HOST_KV in config.perturb.active_faults and not value(
        server_args, "enable_hierarchical_cache", False
    ):
        raise ValueError(
            f"{FaultKind.HOST_KV.env_var} > 0 corrupts HiCache's host memory: "
            "pass --enable-hierarchical-cache (or drop the variable)"
        )
    pd_mode = value(server_args, "disaggregation_mode", "null")
    if FaultKind.PD_TRANSFER in config.perturb.active_faults and pd_mode != "decode":
        raise ValueError(
            f"{FaultKind.PD_TRANSFER.env_var} > 0 corrupts KV a PD decode server received "
            f"from its prefill server: set it on the server started with --disaggregation-mode "
            f"decode (this one has --disaggregation-mode {pd_mode})"
        )
    _check_speculative(server_args, config)
    config.perturb.check_ranks(
        RankFacts(
            tp_size=int(value(server_args, "tp_size", 1) or 1),
            pp_size=int(value(server_args, "pp_size", 1) or 1),
            dp_size=int(value(server_args, "dp_size", 1) or 1),
        )
    )
    return config


# speculative algorithms whose draft and verify forwards the canary plans (NEXTN is resolved
# to EAGLE by sglang; STANDALONE runs EAGLE's forwards with a separate small LM as the draft)
COVERED_SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE")
_COVERED_FLAGS = "EAGLE, EAGLE3, NEXTN or STANDALONE"


def draft_worker_name(algorithm: Optional[str]) -> str:
    """The draft worker's name in messages and reports: STANDALONE, else EAGLE (sglang's EAGLE
    workers run EAGLE, EAGLE3 and NEXTN)."""
    return "STANDALONE" if algorithm == "STANDALONE" else "EAGLE"


def _check_speculative(server_args: "ServerArgs", config: CanaryConfig) -> None:
    """Speculative decoding: EAGLE / EAGLE3 / NEXTN / STANDALONE with a draft chain (``topk``
    1) are guarded, target and draft pools (docs/user_guide.md, "Speculative decoding"); the
    rest is refused with the flag to change."""
    spec = sglang_seam.speculative_facts(server_args)
    if spec.algorithm is None:
        if config.perturb.target_worker == WORKER_DRAFT:
            raise ValueError(
                f"{TARGET_WORKER_VAR}=draft corrupts a speculative draft model's KV: "
                f"pass --speculative-algorithm {_COVERED_FLAGS} (or unset the variable)"
            )
        if config.draft_violations == DraftViolations.ACT:
            raise ValueError(
                "SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act acts on a speculative draft model's KV "
                f"pool, and this server has none: pass --speculative-algorithm {_COVERED_FLAGS} "
                "(or unset the variable)"
            )
        return
    if spec.algorithm not in COVERED_SPECULATIVE_ALGORITHMS:
        raise ValueError(
            f"--kv-canary does not cover --speculative-algorithm {spec.algorithm} yet (covered: "
            f"{_COVERED_FLAGS.replace(' or', ',')}); run it without --kv-canary"
        )
    if spec.topk > 1:
        raise ValueError(
            f"--kv-canary covers {draft_worker_name(spec.algorithm)} with "
            f"--speculative-eagle-topk 1 only (got {spec.topk}): "
            "a draft tree's tokens share positions and are accepted along one branch, which "
            "the canary's per-request chain cannot follow yet; use --speculative-eagle-topk 1"
        )
    if spec.multi_layer_eagle:
        raise ValueError(
            "--kv-canary does not cover --enable-multi-layer-eagle yet (its draft "
            "layers run outside the draft worker's forwards); drop that flag"
        )
    if config.enable_token_oracle or config.enable_write_input_assert:
        raise ValueError(
            "the token oracle (--sampling-backend token_oracle, SGLANG_KV_CANARY_ENABLE_TOKEN_"
            "ORACLE, SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT) does not work with speculative "
            f"decoding: {draft_worker_name(spec.algorithm)} accepts the target's verified "
            "tokens, not the sampler's; drop it or --speculative-algorithm"
        )


def _warn_standalone_radix_keys(config: CanaryConfig) -> None:
    """STANDALONE with the radix cache on: sglang 0.5.12 keys that cache by single tokens
    (EAGLE's keys are token pairs), so a prefix hit of m tokens reuses the draft slot of
    position m - 1, computed from the other request's token m (docs/user_guide.md,
    "Speculative decoding"). Logged once, by the draft runner's install; says what the
    server's mode does with those reports (:meth:`CanaryConfig.acting_mode`)."""
    if config.acting_mode(draft=True) == config.mode and config.mode != CanaryMode.LOG:
        what = (
            f"and --kv-canary {config.mode.value} acts on each one "
            f"(SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act): unset that variable to log and count "
            "them without acting, or pass --disable-radix-cache"
        )
    else:
        what = (
            "each logged and counted (pool=draft), not acted on: they cost draft acceptance, "
            "not output correctness; --disable-radix-cache avoids them"
        )
    logger.warning(
        "kv_canary: --speculative-algorithm STANDALONE with the radix cache on: sglang 0.5.12 "
        "keys STANDALONE's radix cache by single tokens (EAGLE's by token pairs), so a request "
        "that shares a cached prefix of m tokens with another and differs at token m reuses "
        "the draft KV of position m - 1 computed from the other request's token m. The draft "
        "pool's canary reports every such divergence (verify_token at m - 1 with token checks, "
        "verify_chain_hash at m), %s",
        what,
    )


def _check_standalone_draft_pool(server_args: "ServerArgs", kv_pool) -> None:
    """A STANDALONE draft runner's pool must be one the canary guards as a draft model's:
    sglang gives the draft runner of a hybrid-linear model a one-layer ``HybridLinearKVPool``
    (meant for MTP heads), and a DeepSeek-V4 draft pool is not planned for separate drafts;
    both are refused naming the flag."""
    refused = sglang_seam.hybrid_linear_or_dsv4_pool(kv_pool)
    if refused is not None:
        path = sglang_seam.server_args_value(server_args, "speculative_draft_model_path", None)
        raise ValueError(
            f"--kv-canary does not cover a STANDALONE draft model whose runner builds a "
            f"{refused} (--speculative-draft-model-path {path!r}): use a draft model with "
            "plain attention layers (an MHA, MLA or sliding-window pool), or run without "
            "--kv-canary"
        )


def _check_abort_mode(server_args: "ServerArgs") -> None:
    """``--kv-canary abort`` changes the scheduler's batch (it aborts requests) on what one
    rank's canary saw. sglang's schedulers of several ranks must make identical decisions,
    and a corruption (one GPU's memory, one rank's ``req_to_token``) is seen by one rank
    only: each rank would abort different requests and the ranks would fall out of step.
    PD disaggregation moves a request between servers (prefill's running batch hands it to a
    transfer queue the abort path does not drain). Both are refused rather than run unsound
    (docs/user_guide.md, "Containment: --kv-canary abort")."""
    value = sglang_seam.server_args_value
    multi = [
        f"{flag} {v}"
        for flag, name in (
            ("--tp-size", "tp_size"),
            ("--pp-size", "pp_size"),
            ("--dp-size", "dp_size"),
        )
        if (v := int(value(server_args, name, 1) or 1)) > 1
    ]
    if value(server_args, "enable_dp_attention", False):
        multi.append("--enable-dp-attention")
    if multi:
        raise ValueError(
            "--kv-canary abort needs a single scheduler rank: with "
            + ", ".join(multi)
            + " each rank's canary sees its own corruption and the ranks would abort different "
            "requests (their schedulers must agree); use --kv-canary raise or log there"
        )
    mode = value(server_args, "disaggregation_mode", "null")
    if mode not in (None, "null"):
        raise ValueError(
            f"--kv-canary abort does not support --disaggregation-mode {mode} (a request moves "
            "between the prefill and decode servers, outside the abort path the canary uses); "
            "use --kv-canary raise or log there"
        )


def capacity_inputs_from_server_args(
    server_args: "ServerArgs", *, context_len: int
) -> CanaryCapacityInputs:
    value = sglang_seam.server_args_value
    return CanaryCapacityInputs(
        context_len=context_len,
        chunked_prefill_size=value(server_args, "chunked_prefill_size", None),
        max_prefill_tokens=int(value(server_args, "max_prefill_tokens", 0) or 0),
        cuda_graph_max_bs=value(server_args, "cuda_graph_max_bs", None),
    )


def reserve_kv_budget(
    *, server_args: "ServerArgs", model_runner: "ModelRunner", available_bytes: int
) -> int:
    """The plugin's ``ModelRunner._profile_available_bytes`` hook: with the canary on, the
    KV pool's budget less the canary's share (docs/user_guide.md, "Memory"), the reservation
    kept for ``install_canary``'s check and ``/server_info``; ``available_bytes`` untouched
    with the canary off."""
    config = check_server_args_for_canary(server_args)
    if not config.enabled:
        return available_bytes
    kv_bytes, reservation = reserve_canary_memory(
        model_runner,
        server_args=server_args,
        config=config,
        capacity_inputs=capacity_inputs_from_server_args(
            server_args, context_len=sglang_seam.runner_context_len(model_runner)
        ),
        available_bytes=available_bytes,
    )
    sglang_seam.set_runner_memory_reservation(model_runner, reservation)
    if reservation is not None:
        logger.info(
            "kv_canary: %s of the KV pool's %s budget reserved for the canary (target: %s%s); "
            "the pool holds %d tokens",
            format_bytes(reservation.reserved_bytes),
            format_bytes(available_bytes),
            reservation.target.describe(),
            f"; draft: {reservation.draft.describe()}" if reservation.draft else "",
            reservation.tokens.max_total,
        )
    return kv_bytes


def host_pool_budget(
    *, device_pool, host_pool_cls: type, host_to_device_ratio: float, host_size: float
) -> Tuple[float, float]:
    """The plugin's ``HostKVCache.__init__`` hook: ``(host_to_device_ratio, host_size)`` for
    a HiCache host pool of ``device_pool`` such that its KV plus the canary's mirror of its
    slots take the host memory the operator's ``--hicache-size`` (GB) or ``--hicache-ratio``
    (of the device pool's KV bytes) gives the KV alone (docs/user_guide.md, "Memory").
    Unchanged for a pool without a canary or a host pool the canary does not mirror. Raises
    ``ValueError`` naming ``--hicache-ratio`` when the mirror leaves it no larger than the
    device pool (sglang's own minimum)."""
    manager = sglang_seam.pool_canary(device_pool)
    if manager is None or sglang_seam.host_pool_class_kind(host_pool_cls) is None:
        return host_to_device_ratio, host_size
    kv = sglang_seam.kv_pool_bytes_per_token(device_pool)
    mirror = manager.host_mirror_bytes_per_slot
    share = kv / (kv + mirror)
    if host_size > 0:
        budget = (host_to_device_ratio, host_size * share)
        what = f"--hicache-size {host_size} GB -> {budget[1]:.4f} GB of host slots"
    else:
        budget = (host_to_device_ratio * share, host_size)
        what = f"--hicache-ratio {host_to_device_ratio} -> {budget[0]:.4f}"
        if budget[0] <= 1:
            raise ValueError(
                f"--hicache-ratio {host_to_device_ratio} leaves no room for the canary's host "
                f"mirror ({mirror} bytes per host slot beside {kv} bytes of KV): the host pool "
                "would be no larger than the device pool, which sglang refuses; raise "
                f"--hicache-ratio above {(kv + mirror) / kv:.3f} or pass --hicache-size"
            )
    logger.info(
        "kv_canary: HiCache host pool: %d bytes of KV and %d canary bytes per host "
        "slot, within the KV's budget (%s)",
        kv,
        mirror,
        what,
    )
    return budget


def _check_reserved(
    manager: CanaryManager, reservation: Optional[CanaryMemoryReservation], *, draft: bool
) -> str:
    """The start-up line's memory part; warns when the canary holds more GPU memory than the
    KV pool's budget gave it."""
    allocated = manager.memory
    text = f"memory {allocated.describe()}"
    reserved = reservation.for_runner(draft=draft) if reservation is not None else None
    if reserved is None:
        logger.warning(
            "kv_canary: no KV-pool budget was reserved for this canary (%s): the "
            "server holds that much more GPU memory than --mem-fraction-static "
            "sets",
            allocated.describe(),
        )
        return text
    extra = allocated.device_bytes - reserved.device_bytes
    if extra > 0:
        logger.warning(
            "kv_canary: the canary holds %s more GPU memory than was reserved out "
            "of the KV pool's budget (reserved %s; allocated %s): the server holds "
            "that much more than --mem-fraction-static sets",
            format_bytes(extra),
            reserved.describe(),
            allocated.describe(),
        )
    return text + f"; reserved {format_bytes(reserved.device_bytes)}"


def canary_memory_info(
    reservation: Optional[CanaryMemoryReservation],
    *,
    target: Optional[CanaryManager],
    draft: Optional[CanaryManager],
) -> dict:
    """``/server_info``'s ``kv_canary.memory``: per guarded runner (``target``, ``draft``) the
    bytes it holds by part and the bytes reserved for it out of the KV pool's budget, and the
    reservation (sglang's budget, what the pool got, its tokens)."""
    out = {"reservation": reservation.as_dict() if reservation is not None else None}
    for role, manager in (("target", target), ("draft", draft)):
        if manager is None:
            continue
        reserved = (
            reservation.for_runner(draft=role == "draft") if reservation is not None else None
        )
        out[role] = {
            "allocated": manager.memory.as_dict(),
            "reserved": reserved.as_dict() if reserved is not None else None,
        }
    return out


def canary_violation_info(
    *, target: Optional[CanaryManager], draft: Optional[CanaryManager]
) -> dict:
    """``/server_info``'s ``internal_states[i].kv_canary``, read at each call: per guarded
    pool (``target``, ``draft``) the violations it reported so far and the mode they are
    handled in (:meth:`~sglang.srt.kv_canary.manager.reporting.ForwardReporter.counts`)."""
    return {
        role: manager.reporter.counts()
        for role, manager in (("target", target), ("draft", draft))
        if manager is not None
    }


def _use_token_oracle_sampler(model_runner: "ModelRunner") -> None:
    """Make the runner sample with the token oracle. sglang builds its sampler from
    ``--sampling-backend`` but forces ``pytorch`` on some devices (the CPU engine): then the
    oracle is swapped in here, with a log line saying so."""
    current = sglang_seam.runner_sampler(model_runner)
    if isinstance(current, TokenOracleSampler):
        return
    logger.info(
        "kv_canary: token oracle on; replacing sglang's %s with the %s sampler",
        type(current).__name__,
        TOKEN_ORACLE_BACKEND,
    )
    sglang_seam.set_runner_sampler(model_runner, TokenOracleSampler())


def install_canary(
    *,
    server_args: "ServerArgs",
    model_runner: "ModelRunner",
    token_oracle_manager: Optional[TokenOracleManager] = None,
) -> Optional[CanaryManager]:
    """Install the canary on ``model_runner`` if ``--kv-canary`` is on; returns the manager
    (also stored on the runner, see :func:`get_canary_manager`) or None.

    With the token oracle on (``--sampling-backend token_oracle`` or
    ``SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE=1``) a :class:`TokenOracleManager` is created unless
    ``token_oracle_manager`` is given, and the runner samples with the oracle."""
    config = check_server_args_for_canary(server_args)
    if not config.enabled:
        return None
    if get_canary_manager(model_runner) is not None:
        raise RuntimeError("kv_canary is already installed on this model runner")
    runner = sglang_seam.RunnerFacts(model_runner)
    draft = sglang_seam.is_draft_worker(model_runner)
    spec = sglang_seam.speculative_facts(server_args)
    if draft and spec.algorithm == "STANDALONE":
        _check_standalone_draft_pool(server_args, runner.kv_pool)
    manager = build_canary(
        pool=runner.kv_pool,
        req_to_token=runner.req_to_token,
        config=config,
        capacity_inputs=capacity_inputs_from_server_args(
            server_args, context_len=runner.context_len
        ),
        device=runner.device,
        # the SWA layers' window, as the scheduler's SWA eviction uses it (None without SWA)
        swa_window_size=runner.sliding_window_size,
        vocab_size=runner.vocab_size,
        token_oracle=token_oracle_manager,
        ranks=RankFacts(
            tp_rank=runner.tp_rank,
            tp_size=runner.tp_size,
            pp_rank=runner.pp_rank,
            pp_size=runner.pp_size,
            dp_rank=runner.dp_rank,
            dp_size=int(sglang_seam.server_args_value(server_args, "dp_size", 1) or 1),
            draft=draft,
            draft_worker=draft_worker_name(spec.algorithm),
            # the draft model reads (hidden state of p, token p + 1) at position p; one
            # single-forward manager per forward of a draft round (steps - 1 of them, for the
            # largest step count --speculative-adaptive may switch to)
            draft_steps=spec.max_steps if draft else 0,
            disaggregation_mode=sglang_seam.server_args_value(
                server_args, "disaggregation_mode", "null"
            ),
        ),
    )
    if manager.token_oracle is not None:
        _use_token_oracle_sampler(model_runner)
    sglang_seam.set_runner_canary(model_runner, manager)
    sglang_seam.wrap_model_forward(
        model_runner,
        before=manager.pre_ops_maybe_inside_graph,
        after=manager.post_ops_maybe_inside_graph,
    )
    if not draft:
        sglang_seam.share_memory_reservation(model_runner)
    elif spec.algorithm == "STANDALONE" and not sglang_seam.server_args_value(
        server_args, "disable_radix_cache", False
    ):
        _warn_standalone_radix_keys(config)
    memory = _check_reserved(
        manager, sglang_seam.runner_memory_reservation(model_runner), draft=draft
    )
    logger.info(
        "kv_canary installed%s: %s pool=%s groups=%d capacities=%s %s",
        f" on the {draft_worker_name(spec.algorithm)} draft worker" if draft else "",
        config.describe(),
        type(runner.kv_pool).__name__,
        len(manager.groups),
        manager.capacities,
        memory,
    )
    if config.perturb.enabled and manager.perturber is None:
        logger.info(
            "kv_canary: fault injection is set for another rank; none on this one (%s)",
            manager.ranks.describe(),
        )
    elif config.perturb.enabled:
        logger.warning(
            "kv_canary: FAULT INJECTION ON (%s) after %d warm-up steps: this server "
            "corrupts its own KV cache on purpose (self-test)",
            ", ".join(k.value for k in config.perturb.active_faults),
            config.perturb.warmup_steps,
        )
    return manager
