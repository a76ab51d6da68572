"""Start-up checks: the canary's flags, environment and the server's other settings validated
once (every start-up route: ``ServerArgs.__init__`` / ``from_cli_args`` through the plugin),
and the install-time checks of a runner's pool (docs/user_guide.md, "Turning it on"). Each
refusal raises ``ValueError`` naming the flag or variable and what to change.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode, DraftViolations
from sglang.srt.kv_canary.perturb.config import TARGET_WORKER_VAR, WORKER_DRAFT, FaultKind
from sglang.srt.kv_canary.ranks import RankFacts

if TYPE_CHECKING:
    from sglang.srt.kv_canary.sglang_seam import ServerArgs

logger = logging.getLogger(__name__)


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
    if config.mode.contains:
        _check_abort_mode(server_args, config.mode)
    if config.mode == CanaryMode.HEAL:
        _check_heal_mode(server_args)
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
# to EAGLE by sglang, or to FROZEN_KV_MTP with a Gemma4 assistant draft; STANDALONE runs
# EAGLE's forwards with a separate small LM as the draft; NGRAM has no draft model: the target
# verifies trees drafted from an n-gram corpus; FROZEN_KV_MTP's draft reads the target's KV and
# writes none: the target's verify checks what it read; DFLASH's draft pool is written from
# the target's hidden states outside any forward, and read by its block forwards)
COVERED_SPECULATIVE_ALGORITHMS = (
    "EAGLE",
    "EAGLE3",
    "STANDALONE",
    "NGRAM",
    "FROZEN_KV_MTP",
    "DFLASH",
)
_COVERED_FLAGS = "EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM, FROZEN_KV_MTP or DFLASH"
# those with a draft model (its own runner and KV pool)
_DRAFT_MODEL_FLAGS = "EAGLE, EAGLE3, NEXTN, STANDALONE or DFLASH"
# the workers that are not sglang's EAGLE workers, named as themselves
_OWN_WORKER_NAMES = ("STANDALONE", "NGRAM", "FROZEN_KV_MTP", "DFLASH")


def draft_worker_name(algorithm: Optional[str]) -> str:
    """The draft worker's name in messages and reports: STANDALONE, NGRAM, FROZEN_KV_MTP or
    DFLASH, else EAGLE (sglang's EAGLE workers run EAGLE, EAGLE3 and NEXTN)."""
    return algorithm if algorithm in _OWN_WORKER_NAMES else "EAGLE"


def _check_speculative(server_args: "ServerArgs", config: CanaryConfig) -> None:
    """Speculative decoding: EAGLE / EAGLE3 / NEXTN / STANDALONE, with a draft chain (``topk``
    1) or draft trees (``topk`` > 1), target and draft pools, NGRAM's tree verifies (the
    target's pool: it has no draft model) and FROZEN_KV_MTP (the target's pool: its draft
    writes no KV) and DFLASH (its draft pool mapped through the target's ``req_to_token``,
    with or without ``--speculative-draft-window-size``), at any page size, are guarded, also
    with the token oracle
    (docs/user_guide.md, "Speculative decoding"); the rest is refused with the flag to
    change."""
    spec = sglang_seam.speculative_facts(server_args)
    if not spec.has_draft_pool:
        if spec.algorithm is None:
            what = "this server has none"
        elif spec.algorithm == "FROZEN_KV_MTP":
            what = (
                "--speculative-algorithm FROZEN_KV_MTP has none (its draft reads the target's "
                "KV and writes none)"
            )
        else:
            what = (
                f"--speculative-algorithm {spec.algorithm} has none (its drafts come from an "
                "n-gram corpus)"
            )
        if config.perturb.target_worker == WORKER_DRAFT:
            raise ValueError(
                f"{TARGET_WORKER_VAR}=draft corrupts a speculative draft model's KV, and {what}: "
                f"pass --speculative-algorithm {_DRAFT_MODEL_FLAGS} (or unset the variable)"
            )
        if config.draft_violations == DraftViolations.ACT:
            raise ValueError(
                "SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act acts on a speculative draft model's KV "
                f"pool, and {what}: pass --speculative-algorithm {_DRAFT_MODEL_FLAGS} (or unset "
                "the variable)"
            )
    if spec.algorithm is None:
        return
    if spec.algorithm not in COVERED_SPECULATIVE_ALGORITHMS:
        raise ValueError(
            f"--kv-canary does not cover --speculative-algorithm {spec.algorithm} yet (covered: "
            f"{_COVERED_FLAGS.replace(' or', ',')}); run it without --kv-canary"
        )
    # spec v1 multi-layer EAGLE is not refused here: sglang 0.5.12's own worker module fails
    # to import, canary or not, and its error is the one to see:
    # docs/speculative_multilayer_adaptive_dflash_mtp.md, "1.5 Tests and open questions"
    _check_multi_layer_eagle(server_args, spec, config)
    if config.enable_token_oracle or config.enable_write_input_assert:
        _check_token_oracle_speculative(config)


def _check_multi_layer_eagle(server_args: "ServerArgs", spec, config: CanaryConfig) -> None:
    """``--enable-multi-layer-eagle`` with the overlap scheduler (spec v2): covered with
    ``--disable-cuda-graph``, every eager MTP step then writing MTP layer 0's one-layer pool,
    whose canary every MTP runner shares (``install._share_mtp_layer_0_canary``). Refused with
    CUDA graphs (each layer's draft-extend graph writes its own pool outside any guarded
    forward), and with ``SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act`` in abort mode (that pool has
    sliding-window layers only, no records to find a slot's request by). Spec v1 is
    left to sglang 0.5.12's own import error
    (docs/speculative_multilayer_adaptive_dflash_mtp.md, "1.4 Changes to the canary")."""
    if not spec.multi_layer_eagle or spec.spec_v1:
        return
    by_sglang = (
        " sglang also turns it on by itself for MiMoV2 and Step-3.5 targets (MiMoV2ForCausalLM, "
        "MiMoV2FlashForCausalLM, Step3p5ForCausalLM) with --speculative-algorithm EAGLE."
    )
    if not sglang_seam.server_args_value(server_args, "disable_cuda_graph", False):
        raise ValueError(
            "--kv-canary covers --enable-multi-layer-eagle with the overlap scheduler (spec v2) "
            "only with --disable-cuda-graph: its per-layer draft-extend CUDA graphs write each "
            "MTP layer's own pool outside the forwards the canary guards." + by_sglang + " Add "
            "--disable-cuda-graph, or serve such a model without --kv-canary or without "
            "speculative decoding"
        )
    if config.draft_violations == DraftViolations.ACT and config.mode.contains:
        raise ValueError(
            f"--kv-canary {config.mode.value} with SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act cannot "
            "act on --enable-multi-layer-eagle's draft pool: its MTP layers' pools hold "
            "sliding-window layers only, with no record of which request owns a slot."
            + by_sglang
            + " Unset SGLANG_KV_CANARY_DRAFT_VIOLATIONS (draft reports are then logged and "
            "counted), or use --kv-canary raise or log"
        )


def _check_token_oracle_speculative(config: CanaryConfig) -> None:
    """The token oracle with speculative decoding: every covered algorithm's verify commits
    the oracle's tokens (``token_oracle.spec_verify``; docs/speculative_coverage.md, "The token
    oracle with speculative decoding"). sglang's simulated acceptance replaces the verify's
    tokens with a constant, and the next-token swap on the draft model alone injects nothing:
    both refused naming the variable."""
    simulated = sglang_seam.simulated_acceptance_length()
    if simulated > 0:
        raise ValueError(
            f"the token oracle (--sampling-backend token_oracle, SGLANG_KV_CANARY_ENABLE_TOKEN_"
            f"ORACLE, SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT) does not work with "
            f"SGLANG_SIMULATE_ACC_LEN={simulated:g}: sglang's simulated acceptance commits a "
            "constant token, not the verify's; unset SGLANG_SIMULATE_ACC_LEN (or drop the "
            "token oracle)"
        )
    if FaultKind.NEXT_TOKEN_SWAP in config.perturb.active_faults and (
        config.perturb.target_worker == WORKER_DRAFT
    ):
        raise ValueError(
            f"{FaultKind.NEXT_TOKEN_SWAP.env_var} > 0 swaps the target verify's oracle "
            f"predictions, and {TARGET_WORKER_VAR}=draft injects on the draft model only: unset "
            f"{TARGET_WORKER_VAR} or set it to target"
        )


def warn_standalone_radix_keys(config: CanaryConfig) -> None:
    """STANDALONE with the radix cache on: sglang 0.5.12 keys that cache by single tokens
    (EAGLE's keys are token pairs), so a prefix hit of m tokens reuses the draft slot of
    position m - 1, computed from the other request's token m (docs/user_guide.md,
    "Speculative decoding"). Logged once, by the draft runner's install; says what the
    server's mode does with those reports (:meth:`CanaryConfig.acting_mode`)."""
    logger.warning(
        "kv_canary: --speculative-algorithm STANDALONE with the radix cache on: sglang 0.5.12 "
        "keys STANDALONE's radix cache by single tokens (EAGLE's by token pairs), so a request "
        "that shares a cached prefix of m tokens with another and differs at token m reuses "
        "the draft KV of position m - 1 computed from the other request's token m. The draft "
        "pool's canary reports every such divergence (verify_token at m - 1 with token checks, "
        "verify_chain_hash at m), %s",
        _what_draft_reports_get(config),
    )


def warn_multi_layer_radix_reuse(config: CanaryConfig, steps: int) -> None:
    """Multi-layer EAGLE with the radix cache on: sglang 0.5.12 keys the cache by token pairs
    (one draft step's KV at position p comes from tokens p and p + 1), but every MTP step
    rewrites MTP layer 0's pool, the last from the token at p + ``steps``, and a prefill
    chunk's last positions from predicted tokens; a request that takes over another's cached
    slots reuses draft KV computed from the other's later tokens
    (docs/speculative_multilayer_adaptive_dflash_mtp.md, "1.4 Changes to the canary").
    Logged once, by MTP layer 0's install; says what the server's mode does with those
    reports."""
    logger.warning(
        "kv_canary: --enable-multi-layer-eagle with the radix cache on: sglang 0.5.12 keys "
        "the radix cache by token pairs, but each of the %d MTP steps rewrites MTP layer 0's "
        "draft KV at position p, the last one from the token at p + %d, and a prefill chunk's "
        "last positions from predicted tokens; so a request that takes over another's cached "
        "slots of a shared prefix reuses draft KV computed from the other request's later "
        "tokens. The draft pool's canary reports each such boundary (verify_chain_hash at the "
        "request's first position past the shared slots), %s",
        steps,
        steps,
        _what_draft_reports_get(config),
    )


def _what_draft_reports_get(config: CanaryConfig) -> str:
    """The end of a radix-cache warning: what the server's mode does with the draft pool's
    reports (:meth:`CanaryConfig.acting_mode`), and how to avoid them."""
    if config.acting_mode(draft=True) == config.mode and config.mode != CanaryMode.LOG:
        return (
            f"and --kv-canary {config.mode.value} acts on each one "
            f"(SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act): unset that variable to log and count "
            "them without acting, or pass --disable-radix-cache"
        )
    return (
        "each logged and counted (pool=draft), not acted on: they cost draft acceptance, "
        "not output correctness; --disable-radix-cache avoids them"
    )


def check_standalone_draft_pool(server_args: "ServerArgs", kv_pool) -> None:
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


def _check_heal_mode(server_args: "ServerArgs") -> None:
    """``--kv-canary heal`` takes a touched request back before sglang appends a token of the
    batch whose result comes next. sglang's overlap loop skips a taken-back request's row in
    every launched batch; its other loop (``--disable-overlap-schedule``, and speculative
    decoding, whose spec v1 runs there and whose verify commits tokens inside the forward)
    appends it: refused. Several ranks: refused until the ranks agree on a retraction as they
    do on an abort (docs/user_guide.md, "Self-healing: --kv-canary heal")."""
    value = sglang_seam.server_args_value
    tp = int(value(server_args, "tp_size", 1) or 1)
    if tp > 1:
        raise ValueError(
            f"--kv-canary heal runs with one scheduler rank, got --tp-size {tp}: the ranks would "
            "have to take back the same requests at the same step (abort mode agrees on that; "
            "heal does not yet); use --kv-canary abort with --tp-size"
        )
    algorithm = value(server_args, "speculative_algorithm", None)
    if algorithm:
        raise ValueError(
            f"--kv-canary heal does not support --speculative-algorithm {algorithm} yet (the "
            "verify commits accepted tokens inside the forward, before heal can take the request "
            "back); use --kv-canary abort, raise or log with speculative decoding"
        )
    if value(server_args, "disable_overlap_schedule", False):
        raise ValueError(
            "--kv-canary heal needs sglang's overlap scheduler (it skips a taken-back "
            "request's row of a launched batch; the other loop appends it): drop "
            "--disable-overlap-schedule, or use --kv-canary abort"
        )


def _check_abort_mode(server_args: "ServerArgs", mode: CanaryMode = CanaryMode.ABORT) -> None:
    """``--kv-canary abort`` changes the scheduler's batch (it aborts requests) on what one
    rank's canary saw, and sglang's schedulers of several ranks must make identical
    decisions. Tensor parallelism on one node is served: the detecting rank's report reaches
    every TP rank through TP rank 0's input broadcast, and decisions read from a rank's own
    view are agreed (docs/multi_rank_abort_design.md). Pipeline stages, data-parallel
    schedulers and DP attention pass inputs differently, and a relay across nodes is not
    built: those are refused. PD disaggregation moves a request between servers (prefill's
    running batch hands it to a transfer queue the abort path does not drain): refused
    (docs/user_guide.md, "Containment: --kv-canary abort"). ``mode``: abort or heal (named in
    the refusal)."""
    value = sglang_seam.server_args_value
    flag = f"--kv-canary {mode.value}"
    multi = [
        f"{flag} {v}"
        for flag, name in (
            ("--pp-size", "pp_size"),
            ("--dp-size", "dp_size"),
            ("--nnodes", "nnodes"),
        )
        if (v := int(value(server_args, name, 1) or 1)) > 1
    ]
    if value(server_args, "enable_dp_attention", False):
        multi.append("--enable-dp-attention")
    if multi:
        raise ValueError(
            f"{flag} runs with one scheduler rank or with tensor parallelism on one "
            "node (--tp-size), got "
            + ", ".join(multi)
            + ": the ranks must abort the same requests at the same step, and the canary "
            "carries a report to every rank only through TP rank 0's inputs on one node; use "
            "--kv-canary raise or log there"
        )
    pd = value(server_args, "disaggregation_mode", "null")
    if pd not in (None, "null"):
        raise ValueError(
            f"{flag} does not support --disaggregation-mode {pd} (a request moves "
            "between the prefill and decode servers, outside the abort path the canary uses); "
            "use --kv-canary raise or log there"
        )
