"""``TokenOracleManager``: the token oracle's per-batch bookkeeping on one model runner
(docs/subsystems.md, "Self-tests"; docs/user_guide.md, "Self-tests: fault injection, the
token oracle, the demo").

- :meth:`attach_batch` (``ForwardBatch.init_new`` hook, host): each request's oracle key; an
  :class:`OracleBatch` on ``sampling_info`` (for the ``token_oracle`` sampler) and the host
  rows on the batch's :class:`~sglang.srt.kv_canary.batch_state.CanaryBatchState`.
- :meth:`fill_expected_inputs` (the single-forward manager's outside-graph pre-op, write-input
  check on): per KV entry written, in ``out_cache_loc`` order, its token (the prompt's inside
  the prompt, the oracle's past it) and position, which the write kernel checks.

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
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        device,
        after_sample: Optional[Callable[[torch.Tensor], None]] = None,
    ):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self.after_sample = after_sample

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
        None when the batch carries no oracle rows."""
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
        positions: List[np.ndarray] = []
        prompt_tokens: List[np.ndarray] = []
        for p0, n, prompt in zip(prefix, extend, rows.prompts):
            pos = np.arange(p0, p0 + n, dtype=np.int64)
            tok = np.full(n, -1, dtype=np.int64)
            in_prompt = max(0, min(len(prompt), p0 + n) - p0)
            if in_prompt:
                tok[:in_prompt] = prompt[p0 : p0 + in_prompt]
            positions.append(pos)
            prompt_tokens.append(tok)
        pos_t = torch.from_numpy(np.concatenate(positions) if positions else np.zeros(0, np.int64))
        tok_t = torch.from_numpy(
            np.concatenate(prompt_tokens) if prompt_tokens else np.zeros(0, np.int64)
        )
        keys_t = torch.from_numpy(np.repeat(rows.keys, extend))
        generated = oracle_tokens(keys_t, pos_t, self.vocab_size)
        return torch.where(tok_t >= 0, tok_t, generated), pos_t

    def fill_expected_inputs(self, forward_batch, expected: ExpectedInputs) -> None:
        """Fill ``expected`` for this forward; raises when the batch has no oracle rows (the
        write kernel would compare against stale values) or their count disagrees with
        ``out_cache_loc``."""
        got = self.expected_inputs(forward_batch)
        if got is None:
            raise RuntimeError(
                "kv_canary: SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT=1 but this forward batch "
                "carries no oracle rows (ForwardBatch.init_new hook did not run)"
            )
        tokens, positions = got
        n = forward_batch.out_cache_loc.shape[0]
        if tokens.shape[0] != n:
            raise RuntimeError(
                f"kv_canary: the oracle expects {tokens.shape[0]} written tokens but the forward "
                f"writes {n} (out_cache_loc)"
            )
        expected.set(tokens.to(expected.tokens.device), positions.to(expected.tokens.device))
