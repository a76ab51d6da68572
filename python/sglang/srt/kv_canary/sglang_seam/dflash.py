"""DFLASH speculative decoding (``speculative/dflash_worker.py``): the draft KV its worker writes outside any forward, its hand-built draft block batch, its draft runner.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| ``DFlashWorker.__init__`` (hooked, AROUND; its ``target_worker`` argument's ``model_runner.req_to_token_pool.req_to_token``), ``.draft_model_runner`` | the target's ``req_to_token`` handed to the draft canary's install inside the call (with ``--speculative-draft-window-size`` the draft runner keeps a private compact table); the draft runner's ``mark_init_finished`` once its graphs are captured (never ``DFlashWorker.model_runner``: the target's) | ``plugin`` |
| ``DFlashWorker._append_target_hidden_to_draft_kv(batch, draft_input)`` (hooked, AROUND) | reads, before the call (which zeroes ``ctx_lens``), ``draft_input.target_hidden.shape[0]`` / ``.ctx_lens``, ``batch.req_pool_indices`` / ``.seq_lens`` / ``.input_ids`` / ``.forward_mode`` (and, after a verify, ``batch.spec_info.draft_token_num``); after it, the written positions' records: :func:`dflash_append_batch` | ``plugin`` |
| ``DFlashWorker._prepare_for_speculative_decoding(batch, draft_input)`` (hooked, AROUND) | ``batch.reqs`` (``schedule_batch_reqs``): the requests of the ``ForwardBatch`` it builds by hand (no ``ForwardBatch.init_new``) for its draft block | ``plugin`` |
| ``DFlashWorker._append_target_hidden_sequential`` / ``._append_target_hidden_fused(ctx_hidden, ctx_positions, ctx_cache_loc)`` (hooked, AROUND) | the positions and slots sglang really wrote (the records follow them, not the canary's own reckoning) | ``plugin`` |
| ``DFlashVerifyInput.verify(*, batch, logits_output, page_size)`` (hooked, AROUND, keyword-only), ``dflash_info.compute_dflash_correct_drafts_and_bonus`` (hooked, AROUND: the module attribute the verify calls, with the keyword ``target_predict``) | the token oracle's predictions in place of the target's argmax (``token_oracle.spec_verify``) | ``plugin`` |
| ``ForwardBatch(...)`` (the constructor, as ``DFlashWorker`` itself builds one) | an ``EXTEND`` batch describing an append, for the draft canary's write-only launch | ``plugin`` |

Design: docs/speculative_multilayer_adaptive_dflash_mtp.md, "3.4 Changes to the canary".
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Optional

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

if TYPE_CHECKING:  # annotations only
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

_DFLASH = "sglang.srt.speculative.dflash_worker.DFlashWorker"
HOOK_DFLASH_INIT = f"{_DFLASH}.__init__"
HOOK_DFLASH_APPEND = f"{_DFLASH}._append_target_hidden_to_draft_kv"
HOOK_DFLASH_PREPARE = f"{_DFLASH}._prepare_for_speculative_decoding"
# the token oracle: DFLASH's verify and the acceptance walk it looks up in its module
HOOK_DFLASH_VERIFY = "sglang.srt.speculative.dflash_info.DFlashVerifyInput.verify"
HOOK_DFLASH_GREEDY_WALK = (
    "sglang.srt.speculative.dflash_info.compute_dflash_correct_drafts_and_bonus"
)
# the two paths that write the projected KV: (ctx_hidden, ctx_positions, ctx_cache_loc)
HOOK_DFLASH_WRITE_SEQUENTIAL = f"{_DFLASH}._append_target_hidden_sequential"
HOOK_DFLASH_WRITE_FUSED = f"{_DFLASH}._append_target_hidden_fused"


def dflash_init_target_req_to_token(init, worker, args, kwargs) -> torch.Tensor:
    """The target's ``req_to_token`` of a ``DFlashWorker.__init__(worker, *args, **kwargs)``
    call (``init``: the function called; its ``target_worker`` argument, which sglang's
    ``Scheduler`` passes by keyword). The draft canary maps positions through it: the
    appends write every committed position's draft KV into the slots it names, and with
    ``--speculative-draft-window-size`` the draft runner's own table is a compact view of its
    last ``W'`` columns (docs/speculative_multilayer_adaptive_dflash_mtp.md, "3.4 Changes to
    the canary"). Raises ``TypeError`` when the call has no ``target_worker``."""
    try:
        target = inspect.signature(init).bind(worker, *args, **kwargs).arguments["target_worker"]
    except (TypeError, KeyError) as exc:
        raise TypeError(
            "kv_canary: DFlashWorker.__init__ was called without the target_worker argument "
            f"sglang 0.5.12 gives it ({exc}); the DFLASH draft canary needs the target's "
            "req_to_token"
        ) from exc
    return target.model_runner.req_to_token_pool.req_to_token


def dflash_draft_runner(worker) -> "ModelRunner":
    """A ``DFlashWorker``'s draft ``ModelRunner`` (its ``model_runner`` is the target's)."""
    return worker.draft_model_runner


@dataclasses.dataclass(frozen=True, eq=False)
class DFlashAppend:
    """One ``_append_target_hidden_to_draft_kv`` call, read before sglang's call: ``bs``
    rows ``req_pool_indices``, the committed lengths ``seq_lens`` after the forward, the
    newly committed counts ``ctx_lens`` (positions ``[seq_lens - ctx_lens, seq_lens)`` of
    each row are written), ``total`` = their sum (``target_hidden``'s rows, known on the
    host), and each written position's token: ``tokens`` ``[total]`` after a prefill (the
    extend's ``input_ids``), or ``block_tokens`` ``[bs, B]`` after a verify (its draft
    tokens, of which the first ``ctx_lens`` per row were committed)."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    ctx_lens: torch.Tensor
    total: int
    tokens: Optional[torch.Tensor] = None
    block_tokens: Optional[torch.Tensor] = None


def dflash_append_inputs(batch: "ScheduleBatch", draft_input) -> Optional[DFlashAppend]:
    """What the append about to run writes, or None when it writes nothing (sglang's
    ``total_ctx <= 0`` early return: the call in ``_prepare_for_speculative_decoding`` after a
    verify's own append). Raises ``NotImplementedError`` naming the batch's mode when an append
    with work comes from a batch that is neither a prefill nor a verify (sglang 0.5.12 makes
    none: the tokens it writes would be unknown here)."""
    hidden = draft_input.target_hidden
    total = int(hidden.shape[0]) if hidden is not None else 0
    if total <= 0:
        return None
    mode = batch.forward_mode
    common = {
        "req_pool_indices": batch.req_pool_indices,
        "seq_lens": batch.seq_lens,
        "ctx_lens": draft_input.ctx_lens,
        "total": total,
    }
    # TARGET_VERIFY first: sglang's ForwardMode.is_extend() counts it as an extend
    if mode == ForwardMode.TARGET_VERIFY:
        bs = batch.req_pool_indices.shape[0]
        block = int(batch.spec_info.draft_token_num)
        return DFlashAppend(block_tokens=batch.input_ids.view(bs, block), **common)
    if mode.is_extend():
        return DFlashAppend(tokens=batch.input_ids, **common)
    prefills = ", ".join(
        m.name for m in ForwardMode if m.is_extend() and m != ForwardMode.TARGET_VERIFY
    )
    raise NotImplementedError(
        f"kv_canary: a DFLASH draft KV append of {total} positions after a {mode.name} batch; "
        f"the canary records appends after a prefill (an extend batch: {prefills}) or a "
        "verify (TARGET_VERIFY) only"
    )


def dflash_append_batch(
    append: DFlashAppend, positions: torch.Tensor, slots: torch.Tensor
) -> ForwardBatch:
    """An ``EXTEND`` ``ForwardBatch`` of what an append wrote: per row, prefix ``seq_lens -
    ctx_lens`` and extend ``ctx_lens`` (the canary's plan: chain seeds, write layout), and,
    flattened row by row as sglang's append orders them, the ``positions`` and ``slots``
    sglang's write path was given (``ctx_positions``, ``ctx_cache_loc``) with each entry's
    token. Device ops only, no host sync (``total`` is the host's)."""
    rpi = append.req_pool_indices.to(torch.int64)
    device = rpi.device
    bs = rpi.shape[0]
    total = append.total
    ctx = append.ctx_lens.to(device=device, dtype=torch.int64)
    prefix = append.seq_lens.to(torch.int64) - ctx
    if append.tokens is not None:
        tokens = append.tokens[:total].to(torch.int64)
    else:
        owner = torch.repeat_interleave(
            torch.arange(bs, device=device, dtype=torch.int64), ctx, output_size=total
        )
        offset = (
            torch.arange(total, device=device, dtype=torch.int64)
            - (torch.cumsum(ctx, 0) - ctx)[owner]
        )
        tokens = append.block_tokens[owner, offset].to(torch.int64)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=bs,
        input_ids=tokens,
        req_pool_indices=rpi,
        seq_lens=append.seq_lens.to(torch.int64),
        out_cache_loc=slots.to(torch.int64),
        seq_lens_sum=0,  # not read by the canary (its sum would cost a host sync)
        positions=positions.to(torch.int64),
        extend_num_tokens=total,
        extend_seq_lens=ctx,
        extend_prefix_lens=prefix,
    )
