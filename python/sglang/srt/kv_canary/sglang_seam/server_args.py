"""``ServerArgs``: the canary's own attributes on an instance, and sglang's resolved speculative-decoding settings.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| ``ServerArgs`` instance | sets ``kv_canary``, ``kv_canary_sweep_interval``, ``kv_canary_real_data``, ``kv_canary_token_oracle_requested``; reads ``device``, ``enable_torch_compile``, ``chunked_prefill_size``, ``max_prefill_tokens``, ``cuda_graph_max_bs``, ``sampling_backend``, ``disaggregation_mode`` (the reports' PD server role) | ``server_args_ext``, ``config``, ``api`` |
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

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


@dataclasses.dataclass(frozen=True)
class SpeculativeFacts:
    """sglang's resolved speculative-decoding settings (``ServerArgs`` after its own
    defaults): ``algorithm`` upper-case or None; ``num_steps`` / ``topk`` /
    ``num_draft_tokens`` 0 when unset."""

    algorithm: Optional[str]
    num_steps: int
    topk: int
    num_draft_tokens: int
    multi_layer_eagle: bool
    adaptive: bool


def speculative_facts(server_args: "ServerArgs") -> SpeculativeFacts:
    algo = getattr(server_args, "speculative_algorithm", None)
    return SpeculativeFacts(
        algorithm=str(algo).upper() if algo else None,
        num_steps=int(getattr(server_args, "speculative_num_steps", None) or 0),
        topk=int(getattr(server_args, "speculative_eagle_topk", None) or 0),
        num_draft_tokens=int(getattr(server_args, "speculative_num_draft_tokens", None) or 0),
        multi_layer_eagle=bool(getattr(server_args, "enable_multi_layer_eagle", False)),
        adaptive=bool(getattr(server_args, "speculative_adaptive", False)),
    )
