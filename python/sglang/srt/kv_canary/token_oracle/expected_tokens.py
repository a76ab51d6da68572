"""``TokenOracleManager``: the token oracle's per-batch bookkeeping on one model runner
(docs/subsystems.md, "Self-tests"; docs/user_guide.md, "Self-tests: fault injection, the
token oracle, the demo"; with speculative decoding: docs/speculative_coverage.md, "The token
oracle with speculative decoding").

- :meth:`attach_batch` (``ForwardBatch.init_new`` hook, host): each request's oracle key; an
  :class:`OracleBatch` on ``sampling_info`` (for the ``token_oracle`` sampler and the
  speculative verify; a draft runner's manager attaches none) and the host rows on the
  batch's :class:`~sglang.srt.kv_canary.batch_state.CanaryBatchState`.
- :meth:`fill_expected_inputs` (the single-forward manager's outside-graph pre-op, write-input
  check on): per KV entry written, in ``out_cache_loc`` order, its token (the prompt's inside
  the prompt, the oracle's past it; a draft pool's entry at p holds the token of p + 1) and
  position, which the write kernel checks. Entries whose token is not the oracle's by design
  (a verify's draft proposals, a draft round's) expect the forward's own input.

Neither runs inside a CUDA graph; the expected inputs land in static buffers that the captured
write launches read.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.batch_state import CanaryBatchState, OracleRows, batch_state
from sglang.srt.kv_canary.expected_inputs import ExpectedInputs
from sglang.srt.kv_canary.plan_input import host_prefix_extend
from sglang.srt.kv_canary.token_oracle.oracle import (
    OracleBatch,
    oracle_tokens,
    request_oracle_key,
)


def _compute_req_key(req) -> int:
    return request_oracle_key(req.rid)


def _req_key(req) -> int:
    return sglang_seam.req_cached_value(req, _compute_req_key)


class TokenOracleManager:
    """One per model runner with the token oracle on.

    ``vocab_size``: the model's vocabulary (tokens are drawn from ``[0, vocab_size)``).
    ``after_sample``: optional in-place hook on the sampled tokens (the next-token-swap
    self-test, :class:`~sglang.srt.kv_canary.perturb.CanaryPerturber`).
    ``draft``: the manager of a speculative draft runner: its pool's entry at position p holds
    the token of p + 1 (``token_offset``), its decode forwards (a draft round's) write the
    draft model's proposals, and it attaches nothing to ``sampling_info`` (the verify reads
    the target's oracle batch).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        device,
        after_sample: Optional[Callable[[torch.Tensor], None]] = None,
        draft: bool = False,
        token_offset: int = 0,
    ):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if token_offset not in (0, 1):
            raise ValueError(f"token_offset must be 0 or 1, got {token_offset}")
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self.after_sample = after_sample
        self.draft = bool(draft)
        self.token_offset = int(token_offset)

    def writes_proposals(self, forward_batch) -> bool:
        """A forward whose every written token is a draft proposal, not the oracle's: a
        draft runner's decode forward (one forward of a draft round). The write-input check
        skips it."""
        return self.draft and forward_batch.forward_mode == sglang_seam.ForwardMode.DECODE

    def attach_batch(
        self, forward_batch, state: CanaryBatchState, reqs: Optional[Sequence]
    ) -> None:
        """Attach the oracle data of ``reqs`` (row-aligned with ``forward_batch``): the host
        rows to ``state`` (the batch's canary state), the keys to its ``sampling_info``; no-op
        for a batch without requests (idle)."""
        if reqs is None:
            return
        keys = np.fromiter((_req_key(r) for r in reqs), dtype=np.int64, count=len(reqs))
        state.oracle_rows = OracleRows(keys=keys, prompts=tuple(r.origin_input_ids for r in reqs))
        if self.draft:
            return
        sglang_seam.set_sampling_oracle(
            forward_batch,
            OracleBatch(
                keys=torch.from_numpy(keys).to(self.device),
                vocab_size=self.vocab_size,
                after_sample=self.after_sample,
            ),
        )

    def expected_inputs(self, forward_batch) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(tokens, positions)``: int64 CPU ``[num_written]`` in ``out_cache_loc`` order, or
        None when the batch carries no oracle rows. An entry's token is the request's token at
        its position plus ``token_offset`` (the prompt's inside the prompt, the oracle's past
        it). -1 (token and position) marks an entry the oracle does not fix, which expects the
        forward's own input (:meth:`fill_expected_inputs`): a target verify's nodes past its
        root (draft proposals; their positions are checked against their tree parent's by the
        write's chain-position check). A ``DRAFT_EXTEND_V2`` forward's entries past each
        request's accepted tokens are narrowed on the device (:meth:`fill_expected_inputs`)."""
        state = batch_state(forward_batch)
        rows = state.oracle_rows if state is not None else None
        if rows is None:
            return None
        _, prefix, extend = host_prefix_extend(forward_batch)
        if len(prefix) != rows.keys.shape[0]:
            raise RuntimeError(
                f"kv_canary: the oracle rows cover {rows.keys.shape[0]} requests but the forward "
                f"batch has {len(prefix)}"
            )
        offset = self.token_offset
        positions: List[np.ndarray] = []
        prompt_tokens: List[np.ndarray] = []
        for p0, n, prompt in zip(prefix, extend, rows.prompts):
            pos = np.arange(p0, p0 + n, dtype=np.int64)
            tok = np.full(n, -1, dtype=np.int64)
            q0 = p0 + offset  # the sequence position whose token the entry at p0 holds
            in_prompt = max(0, min(len(prompt), q0 + n) - q0)
            if in_prompt:
                tok[:in_prompt] = prompt[q0 : q0 + in_prompt]
            positions.append(pos)
            prompt_tokens.append(tok)
        pos_t = torch.from_numpy(np.concatenate(positions) if positions else np.zeros(0, np.int64))
        tok_t = torch.from_numpy(
            np.concatenate(prompt_tokens) if prompt_tokens else np.zeros(0, np.int64)
        )
        keys_t = torch.from_numpy(np.repeat(rows.keys, extend))
        generated = oracle_tokens(keys_t, pos_t + offset, self.vocab_size)
        tokens = torch.where(tok_t >= 0, tok_t, generated)
        if forward_batch.forward_mode == sglang_seam.ForwardMode.TARGET_VERIFY:
            # only each tree's root (the last committed token, at the committed length) is
            # the oracle's; the other nodes are draft proposals
            root = torch.from_numpy(_entry_starts(extend, len(pos_t)))
            tokens = torch.where(root, tokens, -1)
            pos_t = torch.where(root, pos_t, -1)
        return tokens, pos_t

    def fill_expected_inputs(self, forward_batch, expected: ExpectedInputs) -> None:
        """Fill ``expected`` for this forward; raises when the batch has no oracle rows (the
        write kernel would compare against stale values) or their count disagrees with
        ``out_cache_loc``. A forward writing only draft proposals
        (:meth:`writes_proposals`) expects its own inputs."""
        n = forward_batch.out_cache_loc.shape[0]
        device = expected.tokens.device
        if self.writes_proposals(forward_batch):
            expected.set(forward_batch.input_ids[:n], forward_batch.positions[:n])
            return
        got = self.expected_inputs(forward_batch)
        if got is None:
            raise RuntimeError(
                "kv_canary: SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT=1 but this forward batch "
                "carries no oracle rows (ForwardBatch.init_new hook did not run)"
            )
        tokens, positions = got
        if tokens.shape[0] != n:
            raise RuntimeError(
                f"kv_canary: the oracle expects {tokens.shape[0]} written tokens but the forward "
                f"writes {n} (out_cache_loc)"
            )
        tokens, positions = tokens.to(device), positions.to(device)
        mode = forward_batch.forward_mode
        if mode == sglang_seam.ForwardMode.DRAFT_EXTEND_V2:
            tokens = self._accepted_only(forward_batch, tokens)
        if mode in (sglang_seam.ForwardMode.TARGET_VERIFY, sglang_seam.ForwardMode.DRAFT_EXTEND_V2):
            tokens = torch.where(tokens >= 0, tokens, forward_batch.input_ids[:n].to(torch.int64))
            positions = torch.where(
                positions >= 0, positions, forward_batch.positions[:n].to(torch.int64)
            )
        expected.set(tokens, positions)

    def _accepted_only(self, forward_batch, tokens: torch.Tensor) -> torch.Tensor:
        """Spec v2's draft extend writes ``draft_token_num`` entries per request, of which the
        first ``num_accept_tokens`` hold the accepted tokens (the rest: the verify's
        predictions at rejected nodes, overwritten next round): -1 past them (device ops)."""
        _, _, extend = host_prefix_extend(forward_batch)
        local = torch.from_numpy(_entry_local_index(extend, tokens.shape[0])).to(tokens.device)
        owner = torch.from_numpy(np.repeat(np.arange(len(extend)), extend)).to(tokens.device)
        accepted = sglang_seam.draft_extend_accept_lens(forward_batch).to(torch.int64)
        return torch.where(local < accepted[owner], tokens, -1)


def _entry_local_index(extend: Sequence[int], total: int) -> np.ndarray:
    """Each entry's index within its request's run of ``extend`` entries."""
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum([0, *extend[:-1]]), extend)
    return np.arange(total, dtype=np.int64) - starts


def _entry_starts(extend: Sequence[int], total: int) -> np.ndarray:
    """bool ``[total]``: the first entry of each request's run."""
    return _entry_local_index(extend, total) == 0
