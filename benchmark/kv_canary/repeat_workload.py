"""Run the HiCache GPU lane's workload (``e2e_support/hicache_workload.py`` with the lane's
engine arguments) many times at once on one GPU, with the kv_canary plugin not loaded and
loaded but off, and tabulate how each run ended: how the HiCache + MLA lane's stop was told
apart from the canary (docs/testing.md, "The CPU suite"; ``benchmark/results/gpu_suite.md``).

    python benchmark/kv_canary/repeat_workload.py --copies 2 --seconds 420

Each cell of (plugin mode x model dims) runs ``--copies`` workloads side by side, again and
again until ``--seconds`` have passed; prints a ``RUN`` line per run and a table at the end.
Modes: ``not_loaded`` (``SGLANG_PLUGINS`` names another plugin: sglang skips this one),
``off`` (loaded, ``--kv-canary none``), ``raise`` (``--kv-canary raise``). Dims: ``tiny``
(the tiny DeepSeek-V2's MLA dims of 32) and ``v3`` (DeepSeek-V3's own MLA dims).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import TEST_DIR, use_test_support  # noqa: E402  (a sibling module)

use_test_support()
from canary_support.script_run import run_support_script  # noqa: E402
from canary_support.tiny_models import DEEPSEEK_V3_MLA_DIMS, write_tiny_deepseek_v2  # noqa: E402

SUPPORT = TEST_DIR / "e2e_support"
DIMS = {"tiny": {}, "v3": DEEPSEEK_V3_MLA_DIMS}
MODES = {
    "not_loaded": ({"SGLANG_PLUGINS": "no_plugin_of_this_name"}, {}),
    "off": ({}, {}),
    "raise": ({}, dict(kv_canary="raise")),
}
ERROR_RE = re.compile(
    r"(illegal memory access|CUBLAS_STATUS_\w+|CUDA error: [^\n]*|"
    r"device-side assert|Traceback)"
)


def _hicache_lane_kwargs() -> dict:
    """The engine arguments of the HiCache GPU lane (its test module's ``COMMON``)."""
    sys.path.insert(0, str(TEST_DIR))
    from test_e2e_hicache_gpu import COMMON

    return dict(COMMON)


def _one(script: str, model: str, kwargs: dict, env: dict, timeout: float):
    t0 = time.time()
    try:
        rc, out, result = run_support_script(
            script, model, json.dumps(kwargs), "cuda", env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        rc, out, result = "timeout", "", None
    ok = rc == 0 and result is not None
    m = ERROR_RE.search(out)
    return ok, rc, time.time() - t0, (m.group(1) if m else ""), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="not_loaded,off")
    p.add_argument("--dims", default="tiny,v3")
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--seconds", type=float, default=420)
    p.add_argument("--log-dir", default=None, help="keep each failed run's whole output here")
    args = p.parse_args()
    lane_kwargs = _hicache_lane_kwargs()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="repeat_workload_"))
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_KV_CANARY_")}
    base_env["PYTHONPATH"] = os.pathsep.join(
        x for x in (str(SUPPORT), base_env.get("PYTHONPATH", "")) if x
    )
    deadline = time.time() + args.seconds
    tally = defaultdict(lambda: [0, 0, defaultdict(int)])
    lock = threading.Lock()

    def worker(mode: str, dims: str, copy: int) -> None:
        env_extra, kw_extra = MODES[mode]
        model = write_tiny_deepseek_v2(tmp / f"{dims}_{mode}_{copy}", **DIMS[dims])
        n = 0
        while time.time() < deadline - 60:
            n += 1
            ok, rc, secs, sig, out = _one(
                "hicache_workload.py",
                model,
                dict(lane_kwargs, **kw_extra),
                dict(base_env, **env_extra),
                max(60.0, deadline - time.time()),
            )
            with lock:
                t = tally[(mode, dims)]
                t[0] += 1
                if not ok:
                    t[1] += 1
                    t[2][sig or f"rc={rc}"] += 1
                print(
                    f"RUN mode={mode} dims={dims} copy={copy} n={n} ok={ok} rc={rc} "
                    f"seconds={secs:.0f} error={sig!r}",
                    flush=True,
                )
                if not ok and args.log_dir:
                    os.makedirs(args.log_dir, exist_ok=True)
                    name = f"{mode}_{dims}_{copy}_{n}.log"
                    pathlib.Path(args.log_dir, name).write_text(out[-200000:])

    threads = [
        threading.Thread(target=worker, args=(m, d, c), daemon=True)
        for m in args.modes.split(",")
        for d in args.dims.split(",")
        for c in range(args.copies)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("| mode | dims | runs | failed | errors |")
    print("| --- | --- | ---: | ---: | --- |")
    for (mode, dims), (runs, failed, errs) in sorted(tally.items()):
        print(
            f"| {mode} | {dims} | {runs} | {failed} | "
            f"{'; '.join(f'{k} x{v}' for k, v in errs.items()) or '-'} |"
        )


if __name__ == "__main__":
    main()
