"""The token oracle under speculative decoding (docs/speculative_coverage.md, "The token oracle
with speculative decoding"): the verify commits the oracle's tokens.

Two hooks, both pass-through unless the verify's ``sampling_info`` carries the target's
:class:`~sglang.srt.kv_canary.token_oracle.oracle.OracleBatch` (the oracle is on):

- :func:`verify_with_oracle`, around each verify (spec v1 ``EagleVerifyInput.verify``, which
  FROZEN_KV_MTP's calls; spec v2 ``EagleVerifyInputV2Mixin.sample``; NGRAM's
  ``NgramVerifyInput.verify``): computes each tree node's prediction, the oracle's token of
  the node's position + 1 (``[bs, draft_token_num]``; the next-token-swap self-test swaps two
  requests' root predictions), and runs the verify with ``is_all_greedy`` set, so sglang takes
  its greedy tree walk for every request; raises if the walk did not take the predictions.
- :func:`greedy_walk_with_oracle`, around the greedy walk as each verify module looks it up:
  its ``target_predict`` (the argmax of the target's logits) replaced by those predictions.

The walk then accepts the draft's tokens where they equal the oracle's and commits the
oracle's token after the last one (the bonus): every committed token is the oracle's, as
without speculative decoding. Host work and element-wise device ops, outside CUDA graphs.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Optional

import torch

from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.token_oracle.oracle import OracleBatch, oracle_tokens


@dataclasses.dataclass(eq=False)
class _OracleWalk:
    """The predictions one verify hands its greedy walk; ``taken`` once the walk read them."""

    target_predict: torch.Tensor
    taken: bool = False
    handed: Optional[torch.Tensor] = None  # what the walk got (a nested walk hook sees it)


_ACTIVE_WALK: contextvars.ContextVar[Optional[_OracleWalk]] = contextvars.ContextVar(
    "kv_canary_oracle_walk", default=None
)


def oracle_target_predict(oracle: OracleBatch, spec_info) -> torch.Tensor:
    """int64 ``[bs, draft_token_num]``: node i of request b predicts the oracle's token of
    ``positions[b * draft_token_num + i] + 1``. ``oracle.after_sample`` (the next-token-swap
    self-test) may swap two requests' root predictions (column 0) in place."""
    bs = sglang_seam.verify_rows(spec_info)
    n = sglang_seam.verify_draft_token_num(spec_info)
    positions = sglang_seam.verify_node_positions(spec_info)
    if oracle.keys.shape[0] != bs:
        raise RuntimeError(
            f"kv_canary: the token oracle's batch has {oracle.keys.shape[0]} requests but the "
            f"speculative verify has {bs}"
        )
    if positions.numel() != bs * n:
        raise RuntimeError(
            f"kv_canary: the speculative verify's positions hold {positions.numel()} nodes, "
            f"not {bs} requests x {n} draft tokens"
        )
    keys = oracle.keys.to(positions.device).repeat_interleave(n)
    target = oracle_tokens(keys, positions.reshape(-1).to(torch.int64) + 1, oracle.vocab_size)
    target = target.reshape(bs, n)
    if oracle.after_sample is not None:
        oracle.after_sample(target[:, 0])
    return target


def verify_with_oracle(original, spec_info, batch, *args, **kwargs):
    """AROUND a verify ``(spec_info, batch, logits_output, ...)`` (module docstring)."""
    if sglang_seam.verify_batch_idle(batch) or _ACTIVE_WALK.get() is not None:
        # idle, or inside a verify the oracle already feeds (a subclass's verify calling its
        # base's, or the hook applied twice)
        return original(spec_info, batch, *args, **kwargs)
    sampling_info = sglang_seam.verify_sampling_info(batch)
    oracle = sglang_seam.sampling_oracle(sampling_info) if sampling_info is not None else None
    if oracle is None:  # the oracle is off
        return original(spec_info, batch, *args, **kwargs)
    walk = _OracleWalk(oracle_target_predict(oracle, spec_info))
    token = _ACTIVE_WALK.set(walk)
    try:
        with sglang_seam.greedy_verify(sampling_info):
            result = original(spec_info, batch, *args, **kwargs)
    finally:
        _ACTIVE_WALK.reset(token)
    if not walk.taken:
        raise RuntimeError(
            "kv_canary: the token oracle is on but this speculative verify did not run sglang's "
            "greedy tree walk with the oracle's predictions, so its committed tokens are not "
            "the oracle's: run without --sampling-backend token_oracle / "
            "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE, or without --speculative-algorithm"
        )
    return result


def greedy_walk_with_oracle(original, *args, **kwargs):
    """AROUND the greedy tree walk (called with keywords): ``target_predict`` replaced by the
    active verify's oracle predictions (module docstring)."""
    walk = _ACTIVE_WALK.get()
    if walk is None:
        return original(*args, **kwargs)
    name = sglang_seam.TARGET_PREDICT_KWARG
    given = kwargs.get(name)
    if given is None or args:
        raise RuntimeError(
            f"kv_canary: the greedy tree walk was called without the keyword {name!r} (the "
            "token oracle replaces it); this sglang is not the one the canary was built for"
        )
    if tuple(given.shape) != tuple(walk.target_predict.shape):
        raise RuntimeError(
            f"kv_canary: the greedy tree walk's {name} has shape {tuple(given.shape)}, the "
            f"token oracle's predictions {tuple(walk.target_predict.shape)}"
        )
    if walk.taken:
        if given is walk.handed:  # the hook applied twice: the outer one already replaced it
            return original(*args, **kwargs)
        raise RuntimeError("kv_canary: one speculative verify ran its greedy tree walk twice")
    walk.taken = True
    walk.handed = kwargs[name] = walk.target_predict.to(device=given.device, dtype=given.dtype)
    return original(*args, **kwargs)
