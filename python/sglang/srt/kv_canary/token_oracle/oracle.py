"""The oracle function and the per-batch data the oracle sampler reads.

``oracle_tokens(keys, positions, vocab) = splitmix64(key ^ position) mod vocab`` (as u64),
where ``key`` identifies the request (:func:`request_oracle_key` of its ``rid``) and
``position`` is the sequence position the token will occupy once it is fed back as input.
The sampler (``token_oracle`` backend) produces exactly these tokens; the
:class:`~sglang.srt.kv_canary.token_oracle.expected_tokens.TokenOracleManager` predicts them for the
write-input check.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Optional

import torch

from sglang.jit_kernel.kv_canary._hash_torch import splitmix64_t

TOKEN_ORACLE_BACKEND = "token_oracle"


def request_oracle_key(rid) -> int:
    """A stable signed 64-bit key of a request id (any ``str()``-able value)."""
    digest = hashlib.blake2b(str(rid).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def oracle_tokens(keys: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 ``[n]``: the oracle's token for request ``keys[i]`` at ``positions[i]`` (both int64
    ``[n]``, same device), in ``[0, vocab_size)``. Element-wise, no host sync."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    h = splitmix64_t(keys.to(torch.int64) ^ positions.to(torch.int64))
    # unsigned modulo of the u64 bit pattern held in int64: split off the sign bit
    high = (h < 0).to(torch.int64)
    low = h & 0x7FFFFFFFFFFFFFFF
    return (low % vocab_size + high * ((1 << 63) % vocab_size)) % vocab_size


@dataclasses.dataclass(frozen=True, eq=False)
class OracleBatch:
    """What the oracle sampler needs for one batch, attached to its ``SamplingBatchInfo``.

    ``keys``: int64 ``[bs]`` on the model's device, row i = request i of the batch.
    ``vocab_size``: tokens are drawn from ``[0, vocab_size)``.
    ``after_sample``: optional hook ``(next_token_ids) -> None`` that may edit the sampled
    tokens in place (the next-token-swap self-test); None in normal runs.
    """

    keys: torch.Tensor
    vocab_size: int
    after_sample: Optional[Callable[[torch.Tensor], None]] = None
