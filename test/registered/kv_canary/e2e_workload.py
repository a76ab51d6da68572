"""Run ``e2e_support/workload.py`` (the mixed end-to-end workload on an Engine) in a child
process, for the end-to-end suites on the CPU and on the GPU."""

from __future__ import annotations

import json
import os
from typing import Dict, Mapping, Optional, Tuple

from canary_support.script_run import INFO_TAG, run_support_script, tagged_json


def run_mixed_workload(
    model: str,
    mode: str,
    engine_args: Optional[Mapping] = None,
    *,
    device: str = "cpu",
    base_env: Optional[Mapping[str, str]] = None,
    env_extra: Optional[Dict[str, str]] = None,
    timeout: float = 420,
) -> Tuple[int, str, Optional[list]]:
    """``(returncode, stdout + stderr, greedy outputs or None)`` of one workload run with
    ``--kv-canary mode`` and ``engine_args``; the child's environment is ``base_env`` (default:
    this process's) plus ``env_extra``, with ``e2e_support``'s ``sitecustomize`` test hooks."""
    if engine_args and "kv_canary" in engine_args:
        raise ValueError("run_mixed_workload: pass the canary's mode as `mode`, not in engine_args")
    env = dict(os.environ if base_env is None else base_env, **(env_extra or {}))
    kwargs = dict(engine_args or {}, kv_canary=mode)
    return run_support_script(
        "workload.py",
        model,
        json.dumps(kwargs),
        device,
        env=env,
        timeout=timeout,
        sitecustomize=True,
    )


def workload_info(out: str) -> Optional[dict]:
    """The ``INFO <json>`` line ``workload.py`` prints: ``Engine.get_server_info()``'s
    ``kv_canary`` and ``max_total_num_tokens``, and ``kv_canary_live`` (each scheduler's live
    counts from ``internal_states``)."""
    return tagged_json(out, INFO_TAG)


def assert_memory_reserved_as_allocated(info: dict) -> None:
    """The canary's memory in ``/server_info``: the target's bytes, as built, are the bytes
    reserved out of the KV pool's budget before the pool was sized (docs/user_guide.md,
    "Memory")."""
    memory = info["kv_canary"]["memory"]
    target = memory["target"]
    assert target["allocated"]["device_bytes"] > 0, memory
    assert target["allocated"] == target["reserved"], memory
    assert memory["reservation"]["max_total_num_tokens"] == info["max_total_num_tokens"], memory
