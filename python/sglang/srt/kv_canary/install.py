"""``install_canary``: put the canary on one ``ModelRunner`` (docs/architecture.md, "Start-up").

Called by the plugin's hook right after ``ModelRunner.init_memory_pool`` (the KV pool exists,
CUDA graphs are not captured yet). Reads what it needs off the runner through the sglang seam,
builds the canary with :func:`~sglang.srt.kv_canary.builder.build_canary`, stores the manager
on the runner and wraps the runner's ``model.forward`` (instance attribute) with the HEAD /
TAIL bracket, so eager forwards run the launches and decode CUDA-graph capture records them
into the graphs. Also what ``/server_info`` shows of the installed canaries.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.builder import build_canary
from sglang.srt.kv_canary.memory import format_bytes
from sglang.srt.kv_canary.memory_budget import (
    CanaryMemoryReservation,
    capacity_inputs_from_server_args,
)
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.kv_canary.manager import CanaryManager
from sglang.srt.kv_canary.startup_checks import (
    check_server_args_for_canary,
    check_standalone_draft_pool,
    draft_worker_name,
    warn_multi_layer_radix_reuse,
    warn_standalone_radix_keys,
)
from sglang.srt.kv_canary.token_oracle.expected_tokens import TokenOracleManager
from sglang.srt.kv_canary.token_oracle.oracle import TOKEN_ORACLE_BACKEND
from sglang.srt.kv_canary.token_oracle.sampler import TokenOracleSampler

if TYPE_CHECKING:
    import torch

    from sglang.srt.kv_canary.sglang_seam import ModelRunner, ServerArgs

logger = logging.getLogger(__name__)


def get_canary_manager(model_runner: Optional["ModelRunner"]) -> Optional[CanaryManager]:
    """The runner's manager, or None when the canary is off (or not installed there)."""
    return sglang_seam.runner_canary(model_runner)


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


def _share_mtp_layer_0_canary(model_runner: "ModelRunner", mtp_layer: int) -> CanaryManager:
    """Multi-layer EAGLE's runner of MTP layer ``mtp_layer`` (>= 1). sglang 0.5.12 runs each
    MTP step eagerly on the batch it built for layer 0's runner, so every step's attention
    writes and reads layer 0's pool, never this runner's own
    (docs/speculative_multilayer_adaptive_dflash_mtp.md, "1.4 Changes to the canary"). This
    runner therefore takes layer 0's canary; its model's forwards run that canary's launches,
    after checking that the batch's pool is layer 0's (``RuntimeError`` otherwise: a
    forward the canary would plan against the wrong records). Start-up only; the check is a
    host-side identity test (CUDA-graph safe)."""
    shared = sglang_seam.mtp_layer_0_canary(model_runner)
    if shared is None:
        raise RuntimeError(
            f"kv_canary: multi-layer EAGLE's MTP layer {mtp_layer} runner got no canary to "
            "share: MTP layer 0's runner has none (sglang builds layer 0's runner first)"
        )
    manager, guarded_pool = shared

    def before(forward_batch) -> None:
        if sglang_seam.batch_kv_pool(forward_batch) is not guarded_pool:
            raise RuntimeError(
                f"kv_canary: a forward of multi-layer EAGLE's MTP layer {mtp_layer} runner "
                "writes a KV pool other than MTP layer 0's, the one its canary guards (sglang "
                "0.5.12 runs every MTP step on layer 0's batch and pool); this sglang routes it "
                "elsewhere: run this server without --kv-canary"
            )
        manager.pre_ops_maybe_inside_graph(forward_batch)

    sglang_seam.set_runner_canary(model_runner, manager)
    sglang_seam.wrap_model_forward(
        model_runner, before=before, after=manager.post_ops_maybe_inside_graph
    )
    logger.info(
        "kv_canary: multi-layer EAGLE's MTP layer %d runner shares MTP layer 0's canary (its "
        "steps write layer 0's pool)",
        mtp_layer,
    )
    return manager


def install_canary(
    *,
    server_args: "ServerArgs",
    model_runner: "ModelRunner",
    token_oracle_manager: Optional[TokenOracleManager] = None,
    req_to_token: Optional["torch.Tensor"] = None,
) -> Optional[CanaryManager]:
    """Install the canary on ``model_runner`` if ``--kv-canary`` is on; returns the manager
    (also stored on the runner, see :func:`get_canary_manager`) or None.

    ``req_to_token``: the table the canary maps positions through, in place of the runner's
    own (DFLASH's draft runner: the target's, given by the plugin's ``DFlashWorker.__init__``
    hook; with ``--speculative-draft-window-size`` its own is a compact window).

    With the token oracle on (``--sampling-backend token_oracle`` or
    ``SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE=1``) a :class:`TokenOracleManager` is created unless
    ``token_oracle_manager`` is given, and the runner samples with the oracle."""
    config = check_server_args_for_canary(server_args)
    if not config.enabled:
        return None
    if get_canary_manager(model_runner) is not None:
        raise RuntimeError("kv_canary is already installed on this model runner")
    runner = sglang_seam.RunnerFacts(model_runner, req_to_token=req_to_token)
    draft = sglang_seam.is_draft_worker(model_runner)
    spec = sglang_seam.speculative_facts(server_args)
    if draft and not spec.has_draft_pool:
        # FROZEN_KV_MTP: the draft's layers read the target's KV and write none; its runner's
        # pool is a stand-in the target's slot numbers would index past. The target's verify
        # checks every slot the draft read, one forward later (docs/user_guide.md,
        # "Speculative decoding")
        logger.info(
            "kv_canary: no canary on the %s draft worker: it writes no KV (its reads of the "
            "target's KV are checked by the target's verify)",
            draft_worker_name(spec.algorithm),
        )
        return None
    mtp_layer = sglang_seam.mtp_layer_index(model_runner)
    if mtp_layer:  # multi-layer EAGLE's MTP layers 1 .. steps - 1
        return _share_mtp_layer_0_canary(model_runner, mtp_layer)
    if draft and spec.algorithm == "STANDALONE":
        check_standalone_draft_pool(server_args, runner.kv_pool)
    runner_config = (
        config.for_draft(
            token_checks=spec.draft_token_checks, write_input_check=spec.draft_write_input_check
        )
        if draft
        else config
    )
    if runner_config is not config and not spec.draft_token_checks:
        logger.info(
            "kv_canary: no token checks on the multi-layer EAGLE draft pool (on reads or, with "
            "the token oracle, on writes): its MTP steps write the token of p + k + 1 at p and "
            "leave each round's last positions holding the KV of predicted tokens "
            "(docs/speculative_multilayer_adaptive_dflash_mtp.md, \"1.3 Record semantics\")"
        )
    elif runner_config is not config:
        logger.info(
            "kv_canary: no write-input check on the %s draft pool: its forwards write no "
            "records; the committed tokens its appends record are compared with the request's "
            "by the next draft block's token checks (docs/speculative_coverage.md, \"The token "
            "oracle with speculative decoding\")",
            draft_worker_name(spec.algorithm),
        )
    manager = build_canary(
        pool=runner.kv_pool,
        req_to_token=runner.req_to_token,
        config=runner_config,
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
            # draft trees (--speculative-eagle-topk > 1): the draft round's lanes (their
            # req_to_token columns laid out by --page-size), and the verify's paths of at most
            # steps + 1 nodes (docs/speculative_trees.md); NGRAM's verify trees
            # (docs/speculative_standalone_ngram.md, "2.3 Record semantics")
            **RankFacts.tree_fields(
                topk=spec.topk,
                verify_tree_depth=spec.verify_tree_depth,
                draft=draft,
                page_size=spec.page_size,
            ),
            disaggregation_mode=sglang_seam.server_args_value(
                server_args, "disaggregation_mode", "null"
            ),
        ),
    )
    if manager.token_oracle is not None and not draft:
        # a draft runner never samples (EAGLE's draft takes the top-k of its logits); the
        # verify commits the oracle's tokens (token_oracle.spec_verify)
        _use_token_oracle_sampler(model_runner)
    sglang_seam.set_runner_canary(model_runner, manager)
    sglang_seam.wrap_model_forward(
        model_runner,
        before=manager.pre_ops_maybe_inside_graph,
        after=manager.post_ops_maybe_inside_graph,
    )
    if mtp_layer == 0:
        sglang_seam.set_mtp_layer_0_canary(model_runner, manager)
    if not draft:
        sglang_seam.share_memory_reservation(model_runner)
    elif not sglang_seam.server_args_value(server_args, "disable_radix_cache", False):
        if spec.algorithm == "STANDALONE":
            warn_standalone_radix_keys(config)
        elif spec.multi_layer_eagle:
            warn_multi_layer_radix_reuse(config, spec.max_steps)
    memory = _check_reserved(
        manager, sglang_seam.runner_memory_reservation(model_runner), draft=draft
    )
    logger.info(
        "kv_canary installed%s: %s pool=%s groups=%d capacities=%s %s",
        f" on the {draft_worker_name(spec.algorithm)} draft worker" if draft else "",
        manager.config.describe(),
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
