"""The token oracle (docs/subsystems.md, "Self-tests"): a sampler whose next token is a pure
function of the request
and the position, so every token a forward writes can be checked against what it must be."""

from sglang.srt.kv_canary.token_oracle.oracle import (
    TOKEN_ORACLE_BACKEND,
    OracleBatch,
    oracle_tokens,
    request_oracle_key,
)

__all__ = ["TOKEN_ORACLE_BACKEND", "OracleBatch", "oracle_tokens", "request_oracle_key"]
