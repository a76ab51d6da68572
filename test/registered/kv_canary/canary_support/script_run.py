"""Run a support script of ``e2e_support/`` in a fresh Python process and read what it printed:
``(returncode, stdout + stderr, the RESULT json or None)``. The scripts print one
``RESULT <json>`` line (``e2e_support/engine_main.py``) and may print ``INFO <json>``. With
``KV_CANARY_E2E_LOG_DIR`` set, each run's whole output is also written there (one file per
run, named after the test), which the GPU lanes keep."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Any, Mapping, Optional, Tuple

from e2e_support.engine_main import INFO_TAG, RESULT_TAG  # what the scripts print

__all__ = [
    "INFO_TAG",
    "RESULT_TAG",
    "SUPPORT_DIR",
    "ScriptRun",
    "load_support_script",
    "run_support_script",
    "tagged_json",
]

SUPPORT_DIR = pathlib.Path(__file__).resolve().parents[1] / "e2e_support"

ScriptRun = Tuple[int, str, Any]  # returncode, stdout + stderr, the RESULT json or None


def tagged_json(text: str, tag: str) -> Optional[Any]:
    """The JSON of the first line of ``text`` that starts with ``tag``; None when there is none."""
    for line in text.splitlines():
        if line.startswith(tag):
            return json.loads(line[len(tag) :])
    return None


def load_support_script(script: str):
    """``e2e_support/<script>`` imported in this process for its helpers (a workload's
    prompts), its directory on ``sys.path`` while it imports, as when it runs (its sibling
    imports, ``engine_main``, resolve); its ``__main__`` part does not run."""
    name = pathlib.Path(script).stem
    spec = importlib.util.spec_from_file_location(f"e2e_support_{name}", SUPPORT_DIR / script)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SUPPORT_DIR))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SUPPORT_DIR))
    return module


def run_support_script(
    script: str,
    *args: str,
    env: Mapping[str, str],
    timeout: float = 900,
    sitecustomize: bool = False,
) -> ScriptRun:
    """``python e2e_support/<script> args...`` with ``env``; ``sitecustomize``: ``e2e_support``
    first on ``PYTHONPATH`` (its ``sitecustomize`` test hooks load in every process of the
    server). Raises ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
    env = dict(env)
    if sitecustomize:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(SUPPORT_DIR), env.get("PYTHONPATH", "")) if p
        )
    argv = [sys.executable, str(SUPPORT_DIR / script), *args]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    _keep_log(script, argv, proc.stdout + proc.stderr)
    return proc.returncode, proc.stdout + proc.stderr, tagged_json(proc.stdout, RESULT_TAG)


def _keep_log(script: str, argv, output: str) -> None:
    log_dir = os.environ.get("KV_CANARY_E2E_LOG_DIR")
    if not log_dir:
        return
    os.makedirs(log_dir, exist_ok=True)
    name = f"{os.environ.get('PYTEST_CURRENT_TEST', script).split(' ')[0]}.{time.time_ns()}"
    with open(os.path.join(log_dir, re.sub(r"[^\w.-]+", "_", name) + ".log"), "w") as f:
        f.write(" ".join(argv[1:]) + "\n" + output)
