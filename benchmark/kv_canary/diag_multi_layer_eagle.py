"""What sglang 0.5.12 itself does with multi-layer EAGLE on one GPU, with the kv_canary plugin
not loaded: the diagnostic run that comes before the canary covers it
(docs/speculative_multilayer_adaptive_dflash_mtp.md, "1.5 Tests and open questions").

    python benchmark/kv_canary/diag_multi_layer_eagle.py --log-dir $OUT/multi_layer_eagle

The tiny Step-3.5 target (``canary_support/tiny_models.write_tiny_step3p5``: 45 hybrid-SWA
layers, three MTP layers, dummy weights) serves ``e2e_support/small_workload.py`` (12 greedy
requests of 8 tokens) with ``--speculative-algorithm EAGLE`` (sglang turns on
``--enable-multi-layer-eagle`` for this architecture; 3 steps, topk 1, 4 draft tokens; the
draft read from the target's directory), once per case: spec v2 (overlap on) and spec v1
(``--disable-overlap-schedule``), each with CUDA graphs and with ``--disable-cuda-graph``, and
spec v2's graphs with FlashInfer attention on a tiny Step-3.5 of heads of 128.
``SGLANG_PLUGINS`` names no plugin of this project, so sglang skips it: whatever happens is
sglang's. Prints a ``CASE`` line per case (exit status, requests served, outputs equal to the
first case on the same model that served, the error's last traceback line) and a table; ``--log-dir`` keeps each
case's whole output. Needs a CUDA GPU.
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import TEST_DIR, use_test_support  # noqa: E402  (a sibling module)

use_test_support()
from canary_support.script_run import run_support_script  # noqa: E402
from canary_support.tiny_models import write_tiny_step3p5  # noqa: E402

# no plugin of this name exists: sglang's load_plugins loads none of this project's
NOT_LOADED = {"SGLANG_PLUGINS": "no_plugin_of_this_name"}
# per case: the GPU tests' spec v2 / v1 settings (``test_e2e_speculative_gpu.SPEC``), with
# CUDA graphs on or off
CASES = {
    "spec_v2-graphs": ("spec_v2", {}),
    "spec_v2-eager": ("spec_v2", dict(disable_cuda_graph=True)),
    "spec_v1-eager": ("spec_v1", dict(disable_cuda_graph=True)),
    "spec_v1-graphs": ("spec_v1", {}),
    # sglang's graphs with FlashInfer attention, on heads of 128 (its kernels have no
    # configuration for the tiny model's heads of 16)
    "spec_v2-graphs-flashinfer": ("spec_v2", dict(attention_backend="flashinfer")),
}
# a case's tiny Step-3.5 config overrides (default: none)
WIDE_HEADS = dict(
    hidden_size=256,
    num_attention_heads=2,
    num_attention_groups=1,
    head_dim=128,
    attention_other_setting={"num_attention_heads": 2, "num_attention_groups": 1},
)
CASE_MODEL = {"spec_v2-graphs-flashinfer": WIDE_HEADS}


def case_kwargs(case: str, model: str) -> dict:
    """A case's engine kwargs: the speculative GPU tests' ``COMMON`` (3 steps, topk 1, 4 draft
    tokens, their pool and batch sizes), EAGLE with the draft read from ``model``, the case's
    spec version and graphs."""
    sys.path.insert(0, str(TEST_DIR))
    from test_e2e_speculative_gpu import COMMON, SPEC

    spec, extra = CASES[case]
    return dict(
        COMMON,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=model,
        **SPEC[spec],
        **extra,
    )


ERROR_LINE = re.compile(r"^(\w+(?:\.\w+)*(?:Error|Exception)\b.*)$", re.M)


def last_error(out: str) -> str:
    """The last ``SomethingError: ...`` line of a run's output ('' if none)."""
    found = ERROR_LINE.findall(out)
    return found[-1][:300] if found else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated, of {', '.join(CASES)} (default: all)",
    )
    p.add_argument("--timeout", type=float, default=420, help="seconds per case")
    p.add_argument("--log-dir", default=None, help="keep each case's whole output here")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        p.error(f"--cases {args.cases!r}: unknown {unknown}; allowed: {', '.join(CASES)}")
    import torch

    if not torch.cuda.is_available():
        print("diag_multi_layer_eagle: needs a CUDA GPU", file=sys.stderr)
        return 2
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="diag_multi_layer_eagle_"))
    models = {}

    def model_of(case: str) -> str:
        overrides = CASE_MODEL.get(case, {})
        key = json.dumps(overrides, sort_keys=True)
        if key not in models:
            models[key] = write_tiny_step3p5(tmp / f"step3p5_{len(models)}", **overrides)
        return models[key]

    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_KV_CANARY_")}
    env.update(NOT_LOADED)
    rows, first_outputs = [], None
    for case in cases:
        model = model_of(case)
        kwargs = case_kwargs(case, model)
        try:
            rc, out, result = run_support_script(
                "small_workload.py",
                model,
                json.dumps(kwargs),
                "cuda",
                env=env,
                timeout=args.timeout,
                sitecustomize=False,
            )
        except subprocess.TimeoutExpired as e:
            rc, out, result = "timeout", str(e.output or ""), None
        served = len(result) if isinstance(result, list) else 0
        if served and first_outputs is None and case not in CASE_MODEL:
            first_outputs = result
        same = "-" if not served or case in CASE_MODEL else str(result == first_outputs)
        loaded = "kv_canary" in out and "kv_canary installed" in out
        row = dict(
            case=case,
            rc=rc,
            served=served,
            same_as_first=same,
            # sglang's ServerArgs line: the flag it turned on by itself
            multi_layer="enable_multi_layer_eagle=True" in out,
            plugin_loaded=loaded,
            error=last_error(out) if rc != 0 else "",
        )
        rows.append(row)
        print("CASE " + json.dumps(row), flush=True)
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)
            pathlib.Path(args.log_dir, f"{case}.log").write_text(out[-400000:])
    print("| case | exit | served | outputs = first served | sglang's error |")
    print("| --- | --- | ---: | --- | --- |")
    for r in rows:
        print(
            f"| {r['case']} | {r['rc']} | {r['served']} | {r['same_as_first']} | "
            f"{r['error'] or '-'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
