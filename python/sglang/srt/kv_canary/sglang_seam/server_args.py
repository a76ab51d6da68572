"""``ServerArgs``: the canary's own attributes on an instance, and sglang's resolved speculative-decoding settings.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| ``ServerArgs`` instance | sets ``kv_canary``, ``kv_canary_sweep_interval``, ``kv_canary_real_data``, ``kv_canary_token_oracle_requested``; reads ``device``, ``enable_torch_compile``, ``chunked_prefill_size``, ``max_prefill_tokens``, ``cuda_graph_max_bs``, ``sampling_backend``, ``disaggregation_mode`` (the reports' PD server role) | ``server_args_ext``, ``config``, ``startup_checks``, ``install`` |
| ``speculative.adaptive_spec_params.load_adaptive_config``, ``AdaptiveSpeculativeParams(...).candidate_steps`` | the step counts ``--speculative-adaptive`` may switch between (its config file and sglang's defaults, the initial count added) | ``speculative_facts`` |
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Tuple

if TYPE_CHECKING:  # annotations only
    from sglang.srt.server_args import ServerArgs


def server_args_value(server_args: "ServerArgs", name: str, default: Any = None) -> Any:
    """``server_args.<name>``, or ``default`` when the object lacks it (a ServerArgs built
    before the plugin was loaded, or a test's namespace)."""
    return getattr(server_args, name, default)


def set_server_args_values(server_args: "ServerArgs", values: dict) -> None:
    """Set the canary's own attributes on a ``ServerArgs`` instance (the dataclass is sglang's;
    the canary's fields live on the instance, so they are pickled to the scheduler)."""
    for name, value in values.items():
        setattr(server_args, name, value)


# speculative algorithms without a draft KV pool to guard: NGRAM has no draft model;
# FROZEN_KV_MTP's draft reads the target's KV (``save_kv_cache=False``) and writes none
NO_DRAFT_POOL_ALGORITHMS = ("NGRAM", "FROZEN_KV_MTP")


@dataclasses.dataclass(frozen=True)
class SpeculativeFacts:
    """sglang's resolved speculative-decoding settings (``ServerArgs`` after its own
    defaults): ``algorithm`` upper-case or None; ``num_steps`` / ``topk`` /
    ``num_draft_tokens`` 0 when unset; ``page_size`` sglang's ``--page-size`` (1 when unset);
    ``spec_v1`` sglang's overlap scheduler off (``--disable-overlap-schedule``, which sglang
    also sets itself, e.g. for NGRAM, DFLASH and FROZEN_KV_MTP): its spec v1 workers;
    ``step_counts`` every ``--speculative-num-steps`` the
    worker may run: the initial one, and with ``--speculative-adaptive`` each candidate
    (sglang captures every candidate's graphs at start-up and switches between them while
    serving)."""

    algorithm: Optional[str]
    num_steps: int
    topk: int
    num_draft_tokens: int
    multi_layer_eagle: bool
    adaptive: bool
    step_counts: Tuple[int, ...] = ()
    page_size: int = 1
    spec_v1: bool = False

    @property
    def max_steps(self) -> int:
        """The largest step count a draft round may run (what sizes the draft canary)."""
        return max(self.step_counts, default=self.num_steps)

    @property
    def draft_token_checks(self) -> bool:
        """Whether a draft canary may check its records' tokens (token checks on): not with
        multi-layer EAGLE, whose eager MTP steps all write MTP layer 0's pool in sglang 0.5.12
        (step k feeds position p the token p + 1 + k, the last step's stays) and leave the last
        positions of every round holding the KV of predicted tokens, which no later round
        rewrites (docs/speculative_multilayer_adaptive_dflash_mtp.md, "1.3 Record
        semantics")."""
        return not self.multi_layer_eagle

    @property
    def draft_write_input_check(self) -> bool:
        """Whether a draft canary's forwards may run the token oracle's write-input check: not
        where its token checks are off, nor for DFLASH, whose draft forwards are blocks that
        write no records (its records come from the appends of committed tokens, which the
        next block's token checks compare with the request's: docs/speculative_coverage.md,
        "The token oracle with speculative decoding")."""
        return self.draft_token_checks and self.algorithm != "DFLASH"

    @property
    def has_draft_pool(self) -> bool:
        """A draft model whose runner writes a KV pool of its own (the draft canary's): every
        algorithm but NGRAM (its drafts come from an n-gram corpus; its worker's
        ``model_runner`` is the target's) and FROZEN_KV_MTP (its draft layers read the
        target's KV and write none; its runner's pool is a 64-token stand-in)."""
        return self.algorithm is not None and self.algorithm not in NO_DRAFT_POOL_ALGORITHMS

    @property
    def verify_tree_depth(self) -> int:
        """The most tokens on one path of a target verify's tree (root included), 0 when
        the verify is a chain: NGRAM's trees always (its corpus pads a short match with
        siblings of the root), at most ``--speculative-num-draft-tokens`` deep; EAGLE's draft
        trees (``--speculative-eagle-topk`` > 1), ``max_steps + 1``."""
        if self.algorithm == "NGRAM":
            return self.num_draft_tokens
        return self.max_steps + 1 if self.topk > 1 else 0


def speculative_facts(server_args: "ServerArgs") -> SpeculativeFacts:
    """Raises ``ValueError`` naming ``--speculative-adaptive-config`` when sglang cannot read
    that file (sglang itself would fail on it while building the worker)."""
    algo = getattr(server_args, "speculative_algorithm", None)
    num_steps = int(getattr(server_args, "speculative_num_steps", None) or 0)
    adaptive = bool(getattr(server_args, "speculative_adaptive", False))
    return SpeculativeFacts(
        algorithm=str(algo).upper() if algo else None,
        num_steps=num_steps,
        topk=int(getattr(server_args, "speculative_eagle_topk", None) or 0),
        num_draft_tokens=int(getattr(server_args, "speculative_num_draft_tokens", None) or 0),
        multi_layer_eagle=bool(getattr(server_args, "enable_multi_layer_eagle", False)),
        adaptive=adaptive,
        step_counts=(
            _adaptive_step_counts(
                num_steps, getattr(server_args, "speculative_adaptive_config", None)
            )
            if adaptive and algo
            else (num_steps,)
        ),
        page_size=int(getattr(server_args, "page_size", None) or 1),
        spec_v1=bool(getattr(server_args, "disable_overlap_schedule", False)),
    )


def _adaptive_step_counts(initial_steps: int, config_path: Optional[str]) -> Tuple[int, ...]:
    """sglang's own candidate step counts for ``--speculative-adaptive`` (its defaults, or
    ``candidate_steps`` of the config file, with the initial count added)."""
    from sglang.srt.speculative.adaptive_spec_params import (
        AdaptiveSpeculativeParams,
        load_adaptive_config,
    )

    try:
        params = AdaptiveSpeculativeParams(initial_steps, load_adaptive_config(config_path))
    except (OSError, ValueError, TypeError, AssertionError) as exc:
        raise ValueError(
            f"--speculative-adaptive-config {config_path!r}: sglang cannot read its step "
            f"counts ({type(exc).__name__}: {exc}); the canary sizes its draft rounds for the "
            "largest of them"
        ) from exc
    return tuple(int(s) for s in params.candidate_steps)
