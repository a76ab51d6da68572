"""Run ``e2e_support/workload.py`` (the end-to-end workload on an Engine) in a child process,
for the end-to-end suites on the CPU and on the GPU."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Dict, Mapping, Optional, Tuple

SUPPORT = pathlib.Path(__file__).parent / "e2e_support"


def run_workload(model: str, mode: str, engine_args: Optional[Mapping] = None, *,
                 device: str = "cpu", base_env: Optional[Mapping[str, str]] = None,
                 env_extra: Optional[Dict[str, str]] = None,
                 timeout: float = 420) -> Tuple[int, str, Optional[list]]:
    """``(returncode, stdout + stderr, greedy outputs or None)`` of one workload run with
    ``--kv-canary mode`` and ``engine_args``; the child's environment is ``base_env`` (default:
    this process's) plus ``env_extra``, with ``e2e_support`` first on ``PYTHONPATH`` (its
    ``sitecustomize`` test hooks)."""
    env = dict(os.environ if base_env is None else base_env, **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), env.get("PYTHONPATH", ""))
                                        if p)
    proc = subprocess.run([sys.executable, str(SUPPORT / "workload.py"), model, mode,
                           json.dumps(dict(engine_args or {})), device],
                          env=env, capture_output=True, text=True, timeout=timeout)
    res = [json.loads(x[len("RESULT "):]) for x in proc.stdout.splitlines()
           if x.startswith("RESULT ")]
    return proc.returncode, proc.stdout + proc.stderr, res[0] if res else None


def workload_info(out: str) -> Optional[dict]:
    """The ``INFO <json>`` line ``workload.py`` prints: ``Engine.get_server_info()``'s
    ``kv_canary`` and ``max_total_num_tokens``."""
    info = [json.loads(x[len("INFO "):]) for x in out.splitlines() if x.startswith("INFO ")]
    return info[0] if info else None


def assert_memory_reserved_as_allocated(info: dict) -> None:
    """The canary's memory in ``/server_info``: the target's bytes, as built, are the bytes
    reserved out of the KV pool's budget before the pool was sized (docs/user_guide.md,
    "Memory")."""
    memory = info["kv_canary"]["memory"]
    target = memory["target"]
    assert target["allocated"]["device_bytes"] > 0, memory
    assert target["allocated"] == target["reserved"], memory
    assert memory["reservation"]["max_total_num_tokens"] == info["max_total_num_tokens"], memory
