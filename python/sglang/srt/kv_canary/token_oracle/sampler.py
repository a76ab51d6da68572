"""``TokenOracleSampler``: the ``token_oracle`` sampling backend (docs/subsystems.md,
"Self-tests").

Registered with sglang's ``register_sampler_backend`` by the plugin, so
``--sampling-backend token_oracle`` selects it; on devices where sglang forces its own sampler
(the CPU engine forces ``pytorch``) ``install_canary`` swaps it in when the oracle is on (see
:class:`~sglang.srt.kv_canary.config.CanaryConfig` ``enable_token_oracle``).

Row i's next token is ``oracle_tokens(keys[i], positions[i] + 1)``: the position the token will
occupy as the next input. The logits are ignored. Called by ``ModelRunner.sample`` outside CUDA
graphs; element-wise torch, no host sync (unless the batch's ``after_sample`` self-test hook
syncs).
"""

from __future__ import annotations

from typing import List

import torch

from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.token_oracle.oracle import TOKEN_ORACLE_BACKEND, oracle_tokens


class TokenOracleSampler(sglang_seam.sglang_sampler_class()):
    """A ``Sampler`` whose tokens come from the oracle, not from the logits. Log-probs are not
    computed (``return_logprob`` requests raise: the oracle has no distribution)."""

    def __init__(self):
        sglang_seam.init_sampler_module_only(self)

    def forward(
        self,
        logits_output,
        sampling_info,
        return_logprob: bool,
        top_logprobs_nums: List[int],
        token_ids_logprobs,
        positions: torch.Tensor,
    ):
        batch = sglang_seam.sampling_oracle(sampling_info)
        if batch is None:
            raise RuntimeError(
                f"kv_canary: the {TOKEN_ORACLE_BACKEND!r} sampler got a batch without oracle "
                "keys; it needs --kv-canary log|raise (the canary attaches them in "
                "ForwardBatch.init_new)"
            )
        if return_logprob:
            raise RuntimeError(
                f"kv_canary: the {TOKEN_ORACLE_BACKEND!r} sampler does not "
                "compute log-probs; do not request return_logprob with it"
            )
        bs = batch.keys.shape[0]
        if positions.shape[0] != bs:
            raise RuntimeError(
                f"kv_canary: the oracle batch has {bs} keys but the sampler got "
                f"{positions.shape[0]} positions"
            )
        next_token_ids = oracle_tokens(batch.keys, positions.to(torch.int64) + 1, batch.vocab_size)
        if batch.after_sample is not None:
            batch.after_sample(next_token_ids)
        return next_token_ids  # int64, like sglang's own samplers


def register_token_oracle_backend() -> None:
    """Register the ``token_oracle`` backend with sglang (once per process)."""
    sglang_seam.register_sampler_backend(TOKEN_ORACLE_BACKEND, TokenOracleSampler)
