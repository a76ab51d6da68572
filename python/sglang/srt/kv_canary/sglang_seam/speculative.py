"""Speculative verify inputs and sampling: what the token oracle reads of a verify and the greedy walk it feeds (docs/speculative_coverage.md, "The token oracle with speculative decoding").

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| ``EagleVerifyInput`` (v1 ``verify``, v2 ``EagleVerifyInputV2Mixin.sample``; FROZEN_KV_MTP's ``verify`` calls EAGLE's), ``NgramVerifyInput`` (``verify``), ``DFlashVerifyInput`` (``verify``) | reads ``positions`` (each tree node's position), ``draft_token_num``, ``retrieve_index`` (its rows: the requests; DFLASH has none: ``draft_token``'s length over ``draft_token_num``, a chain per request) | ``token_oracle.spec_verify`` |
| their ``batch`` argument (``ScheduleBatch`` v1 / NGRAM, ``ModelWorkerBatch`` v2) | reads ``forward_mode.is_idle()``, ``sampling_info`` | ``token_oracle.spec_verify`` |
| ``SamplingBatchInfo.is_all_greedy`` | set True for the verify call while the oracle runs (the greedy walk), then restored | ``token_oracle.spec_verify`` |
| ``eagle_info.verify_tree_greedy_func``, ``eagle_info_v2.verify_tree_greedy_func``, ``ngram_info.verify_tree_greedy`` (sgl-kernel's op, bound only on CUDA / MUSA / HIP), ``dflash_info.compute_dflash_correct_drafts_and_bonus`` | the ``target_predict`` keyword replaced by the oracle's (the greedy walk; called with keywords only) | ``token_oracle.spec_verify`` |
| ``sglang.srt.environ.envs.SGLANG_SIMULATE_ACC_LEN`` | read at start-up: the token oracle refuses sglang's simulated acceptance | ``startup_checks`` |
| ``ForwardBatch.spec_info.num_accept_tokens`` of a ``DRAFT_EXTEND_V2`` forward | how many of each request's ``draft_token_num`` entries hold accepted tokens | ``token_oracle.expected_tokens`` |
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # annotations only
    import torch

# the greedy walk's keyword the oracle replaces (sgl-kernel's ``verify_tree_greedy`` and
# sglang's ``verify_tree_greedy_func`` both take it by this name)
TARGET_PREDICT_KWARG = "target_predict"


def verify_batch_idle(batch) -> bool:
    """The verify's batch is sglang's idle batch (no requests; the verify returns early)."""
    mode = getattr(batch, "forward_mode", None)
    return mode is None or bool(mode.is_idle())


def verify_sampling_info(batch):
    return getattr(batch, "sampling_info", None)


def verify_rows(spec_info) -> int:
    """Requests of the verify: ``retrieve_index`` ``[bs, draft_token_num]``'s rows, or (DFLASH's
    ``DFlashVerifyInput``, a chain of ``draft_token_num`` per request, no ``retrieve_index``)
    ``draft_token``'s length over ``draft_token_num``."""
    index = getattr(spec_info, "retrieve_index", None)
    if index is not None:
        return int(index.shape[0])
    return int(spec_info.draft_token.numel()) // int(spec_info.draft_token_num)


def verify_draft_token_num(spec_info) -> int:
    return int(spec_info.draft_token_num)


def verify_node_positions(spec_info) -> "torch.Tensor":
    """Each tree node's position, ``[bs * draft_token_num]`` (request-major)."""
    return spec_info.positions


@contextlib.contextmanager
def greedy_verify(sampling_info) -> Iterator[None]:
    """The verify takes sglang's greedy walk for every request meanwhile
    (``is_all_greedy``), whatever their sampling parameters; restored after."""
    before = sampling_info.is_all_greedy
    sampling_info.is_all_greedy = True
    try:
        yield
    finally:
        sampling_info.is_all_greedy = before


def ngram_greedy_walk_bound() -> bool:
    """sglang binds ``ngram_info.verify_tree_greedy`` (sgl-kernel's op) only on CUDA, MUSA
    or HIP; elsewhere there is nothing to hook (and sglang's NGRAM does not run)."""
    from sglang.srt.utils import is_cuda, is_hip, is_musa

    return bool(is_cuda() or is_musa() or is_hip())


def draft_extend_accept_lens(forward_batch) -> "torch.Tensor":
    """A ``DRAFT_EXTEND_V2`` forward's accepted tokens per request (bonus included), on the
    device: ``spec_info.num_accept_tokens``."""
    return forward_batch.spec_info.num_accept_tokens


def simulated_acceptance_length() -> float:
    """sglang's ``SGLANG_SIMULATE_ACC_LEN`` (> 0: each verify's acceptance simulated and its
    tokens set to a constant; off when <= 0)."""
    from sglang.srt.environ import envs

    return float(envs.SGLANG_SIMULATE_ACC_LEN.get() or 0)
