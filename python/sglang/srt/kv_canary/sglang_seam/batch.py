"""``ForwardBatch``, ``SamplingBatchInfo`` and ``Req``: the canary's batch state, the token oracle's batch, and what the canary reads of a request.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| ``ForwardBatch`` | sets one attribute, ``kv_canary_batch_state`` (:func:`set_batch_state`); reads ``spec_info.draft_token_num`` and, of a tree verify (``--speculative-eagle-topk`` > 1's ``EagleVerifyInput``, NGRAM's ``NgramVerifyInput``), ``spec_info.retrieve_next_token`` / ``retrieve_next_sibling``; ``ForwardMode`` | ``batch_state``, ``plan_input`` |
| ``SamplingBatchInfo`` | sets / reads ``kv_canary_oracle_batch`` | ``token_oracle`` |
| ``Req`` | caches ``kv_canary_oracle_key``; reads ``rid``, ``origin_input_ids``, ``output_ids``, ``req_pool_idx``, ``kv_allocated_len``, ``finished()``, ``to_finish``; histories are kept by identity (sglang replaces, never edits, a rewritten list); abort mode sets ``to_finish = FINISH_ABORT(...)`` (sglang's abort of a running request), ``skip_radix_cache_insert`` and ``kv_canary_no_radix_insert`` (lifts the former around ``Scheduler.stash_chunked_request``, whose ``maybe_cache_unfinished_req`` also honours it; abort mode refuses PD, so PD prefill's copy of the stash never sees the mark) | ``token_oracle``, ``token_history``, ``violations.resolver``, ``violations.containment`` |
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

if TYPE_CHECKING:  # annotations only
    import torch

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: F401


_BATCH_STATE_ATTR = "kv_canary_batch_state"


_BATCH_STATE_ATTR = "kv_canary_batch_state"
_SAMPLING_ORACLE_ATTR = "kv_canary_oracle_batch"


_SAMPLING_ORACLE_ATTR = "kv_canary_oracle_batch"
_REQ_ORACLE_KEY_ATTR = "kv_canary_oracle_key"


def batch_state(forward_batch: "ForwardBatch"):
    """The canary's per-batch state object set by :func:`set_batch_state`, or None."""
    return getattr(forward_batch, _BATCH_STATE_ATTR, None)


def set_batch_state(forward_batch: "ForwardBatch", state) -> None:
    setattr(forward_batch, _BATCH_STATE_ATTR, state)


def draft_token_num(forward_batch: "ForwardBatch") -> int:
    """Draft tokens per request of a TARGET_VERIFY batch (EAGLE)."""
    return int(forward_batch.spec_info.draft_token_num)


def verify_tree_lists(forward_batch: "ForwardBatch") -> Tuple["torch.Tensor", "torch.Tensor"]:
    """A tree TARGET_VERIFY batch's linked lists (``EagleVerifyInput``'s, built by sgl-kernel's
    ``build_tree_efficient``; ``NgramVerifyInput``'s, by ``reconstruct_indices_from_tree_mask``):
    ``(retrieve_next_token, retrieve_next_sibling)``, int64 ``[bs, draft_token_num]`` each,
    local node indices, -1 for none."""
    spec_info = forward_batch.spec_info
    return spec_info.retrieve_next_token, spec_info.retrieve_next_sibling


def sampling_oracle(sampling_info: "SamplingBatchInfo"):
    return getattr(sampling_info, _SAMPLING_ORACLE_ATTR, None)


def set_sampling_oracle(forward_batch: "ForwardBatch", oracle_batch) -> None:
    """Attach ``oracle_batch`` to the batch's ``sampling_info`` (no-op without one)."""
    sampling_info = getattr(forward_batch, "sampling_info", None)
    if sampling_info is not None:
        setattr(sampling_info, _SAMPLING_ORACLE_ATTR, oracle_batch)


def req_cached_value(req: "Req", compute: Callable[["Req"], int]) -> int:
    """``compute(req)``, cached on the request (the oracle key of its ``rid``)."""
    value = getattr(req, _REQ_ORACLE_KEY_ATTR, None)
    if value is None:
        value = compute(req)
        setattr(req, _REQ_ORACLE_KEY_ATTR, value)
    return value


def req_rid(req: "Req") -> str:
    return str(req.rid)


def req_pool_row(req: "Req") -> Optional[int]:
    """The request's ``req_to_token`` row (None once freed)."""
    idx = req.req_pool_idx
    return int(idx) if idx is not None else None


def req_kv_len(req: "Req") -> int:
    """Entries of the request's ``req_to_token`` row that hold its KV slots now
    (``kv_allocated_len``: later entries are a previous occupant's leftovers)."""
    return int(req.kv_allocated_len)


def req_tokens_left(req: "Req") -> int:
    """New tokens the request may still generate (``sampling_params.max_new_tokens`` less its
    outputs so far; it may stop earlier, at a stop token)."""
    return int(req.sampling_params.max_new_tokens or 0) - len(req.output_ids)


def req_output_count(req: "Req") -> int:
    """Tokens the request has generated so far (``len(output_ids)``; a retraction keeps
    them: they are prefilled again with the prompt)."""
    return len(req.output_ids)


def req_done(req: "Req") -> bool:
    """Finished, or already told to finish (``to_finish``) at its next result."""
    return bool(req.finished() or req.to_finish is not None)


def req_token_ids(req: "Req") -> List[int]:
    """The request's tokens by position (``origin_input_ids + output_ids``)."""
    return list(req.origin_input_ids) + list(req.output_ids)
