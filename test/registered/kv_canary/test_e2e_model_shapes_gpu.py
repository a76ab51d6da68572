"""On the GPU: every MLA / NSA / hybrid pool class guards a real sglang 0.5.12 server
with CUDA graphs on (docs/user_guide.md, "Supported pools").

- ``mla``: a tiny DeepSeek-V2 (``MLATokenToKVPool``), triton attention.
- ``nsa``: a tiny DeepSeek-V3.2 (``NSATokenToKVPool``, page 64, the DSA indexer): FlashMLA
  sparse prefill, FlashMLA decode. Dense short-prompt prefill is off
  (``SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0``): it runs FA3, which the device's slim
  sgl_kernel lacks. sglang 0.5.12's CPU engine cannot build an NSA server at all (its server
  arguments ask the CUDA driver for the device capability), hence GPU only.
- ``hybrid``: a tiny Qwen3-Next (``HybridLinearKVPool`` over an MHA pool, ``MambaRadixCache``),
  triton attention and the triton Mamba backend; sglang's CPU engine cannot run its gated
  delta-net kernels.

Each shape: raise + sweep + real data + token checks is clean and gives the greedy outputs of
the canary off; under every fault class (log mode) each injected fault is reported with its
reason at its slot. Needs the device bundles a, b, c and, for ``nsa``, FlashMLA and DeepGEMM
(docs/testing.md, "The CPU suite").

``MLATokenToKVPoolFP4`` (``--kv-cache-dtype fp4_e2m1``) has no shape here: no sglang 0.5.12
server can serve FP4 MLA on a Hopper GPU or the CPU, canary on or off (its pool imports a
quantizer name its module lacks, and with that name added, the Triton attention kernels refuse
the pool's FP4 value rows: ``KeyError: 'float4_e2m1fn_x2'``; H100, 2026-11-23). Its adapter is
tested on the real pool class (test_mla_pool.py); docs/user_guide.md, "Supported pools"."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
from e2e_checks import EVERY_FAULT_ENV, assert_every_fault_caught, run_workload

from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from canary_support.tiny_models import (
    write_tiny_deepseek_v2,
    write_tiny_deepseek_v32,
    write_tiny_qwen3_next,
)
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=1020, stage="base-b", runner_config="1-gpu-small")
# its lanes in the GPU suite (test/gpu_lanes.py): name -> (pytest -k, est. seconds)
GPU_LANES = {"shape_mla": ("mla", 250), "shape_nsa": ("nsa", 490), "shape_hybrid": ("hybrid", 280)}

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

SUPPORT = pathlib.Path(__file__).parent / "e2e_support"
# the shapes may share one GPU (the device lanes): the pools are capped by max_total_tokens,
# so a high static fraction only relaxes sglang's free-memory check
COMMON = dict(
    chunked_prefill_size=64,
    max_total_tokens=2048,
    max_running_requests=8,
    log_level="info",
    decode_log_interval=1,
    mem_fraction_static=0.85,
)

# shape -> (config writer, writer overrides, engine kwargs, extra env, pool class)
SHAPES = {
    "mla": (write_tiny_deepseek_v2, {}, {}, {}, "MLATokenToKVPool"),
    "nsa": (
        write_tiny_deepseek_v32,
        {},
        dict(
            kv_cache_dtype="bfloat16",
            attention_backend=None,
            nsa_prefill_backend="flashmla_sparse",
            nsa_decode_backend="flashmla_kv",
        ),
        {"SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0"},
        "NSATokenToKVPool",
    ),
    "hybrid": (write_tiny_qwen3_next, {}, dict(max_mamba_cache_size=32), {}, "HybridLinearKVPool"),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape(request, tmp_path_factory):
    name = request.param
    write, overrides, kwargs, env, pool_cls = SHAPES[name]
    env = dict(os.environ, **env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), env.get("PYTHONPATH", "")) if p)
    return dict(
        name=name,
        model=write(tmp_path_factory.mktemp(name), **overrides),
        kwargs=dict(COMMON, **kwargs),
        env=env,
        pool_cls=pool_cls,
    )


def run(shape, env_extra=None, **engine_kwargs):
    return run_workload(
        "small_workload.py",
        shape["model"],
        dict(shape["kwargs"], **engine_kwargs),
        dict(shape["env"], **(env_extra or {})),
        "cuda",
        timeout=600,
    )


def test_clean_matches_canary_off(shape):
    rc, out, off = run(shape)
    assert rc == 0 and off is not None, out[-4000:]
    rc, out, on = run(
        shape,
        {
            "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
            "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "5",
        },
        kv_canary="raise",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=3,
    )
    assert rc == 0, out[-4000:]
    assert "kv_canary installed: mode=raise real_data=partial" in out
    assert f"pool={shape['pool_cls']}" in out, out[-4000:]
    assert "cuda graph: True" in out
    assert parse_violation_lines(out) == []
    assert on == off and len(on) == 12
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert stats and "violations=0" in stats[-1]
    assert "TAIL_K_FULL" in stats[-1] and "SWEEP_K_FULL" in stats[-1]


def test_every_fault_class_is_caught(shape):
    rc, out, res = run(
        shape,
        EVERY_FAULT_ENV,
        kv_canary="log",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
    )
    assert rc == 0 and res is not None and len(res) == 12, out[-4000:]
    assert f"pool={shape['pool_cls']}" in out, out[-4000:]
    assert_every_fault_caught(out)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
