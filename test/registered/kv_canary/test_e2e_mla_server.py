"""MLA end to end on the CPU: a tiny DeepSeek-V2-shaped MLA model (``MLATokenToKVPool``)
served by sglang 0.5.12's CPU engine with the triton attention backend under the Triton
interpreter (``TRITON_INTERPRET=1``; the canary's kernels then run interpreted too), with the
sweep, real data and token checks: under every fault class of the perturbation framework (log
mode, one server), each injected fault is reported with its reason at its slot, and nothing
before the first. (docs/user_guide.md, "Supported pools".)"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
from e2e_checks import EVERY_FAULT_ENV, assert_every_fault_caught, run_workload
from e2e_workload import assert_memory_reserved_as_allocated, workload_info

from sglang.srt.kv_canary.perturb.report import parse_perturb_line
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.kv_canary.demo.server_harness import build_libcuda_stub, cpu_server_env
from canary_support.tiny_models import write_tiny_deepseek_v2
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=105, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow

SUPPORT = pathlib.Path(__file__).parent / "e2e_support"
ARGS = dict(
    attention_backend="triton",
    chunked_prefill_size=32,
    max_total_tokens=256,
    max_running_requests=4,
    log_level="info",
)


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_server")
    env = cpu_server_env(build_libcuda_stub(root / "stub"))
    env["TRITON_INTERPRET"] = "1"  # sglang's triton attention (and the canary) interpreted
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), env.get("PYTHONPATH", "")) if p)
    return dict(model=write_tiny_deepseek_v2(root / "model"), env=env)


def run(mla, env_extra=None, **engine_kwargs):
    return run_workload(
        "small_workload.py",
        mla["model"],
        dict(ARGS, **engine_kwargs),
        dict(mla["env"], **(env_extra or {})),
        timeout=900,
    )


def test_mla_every_fault_class_is_caught_and_nothing_else(mla):
    """One server (log mode: it serves on through the faults): each injected fault is
    reported with its reason at its slot, and nothing is reported before the first fault (the
    warm-up's forwards: prefills with radix hits and decodes, checked by HEAD, TAIL and the
    sweep). (A whole clean MLA workload in raise mode, against the canary off: the GPU lane
    ``shape_mla``, test_e2e_model_shapes_gpu.py, where the server is fast; here sglang's
    attention runs in the interpreter, about two minutes a server.)"""
    rc, out, res = run(
        mla,
        dict(EVERY_FAULT_ENV, SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS="5"),
        kv_canary="log",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
    )
    assert rc == 0 and res is not None and len(res) == 12, out[-3000:]
    assert "kv_canary installed: mode=log real_data=partial" in out
    assert "pool=MLATokenToKVPool groups=1 " in out
    # the MLA pool's canary (token checks on) was reserved as it was then built
    assert_memory_reserved_as_allocated(workload_info(out))
    assert_every_fault_caught(out)
    first_fault = min(
        int(f["step"]) for f in map(parse_perturb_line, out.splitlines()) if f is not None
    )
    early = [v for v in parse_violation_lines(out) if v.forward_step < first_fault]
    assert first_fault >= int(EVERY_FAULT_ENV["SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS"])
    assert early == [], early[:5]
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert stats and "TAIL_K_FULL" in stats[-1] and "SWEEP_K_FULL" in stats[-1], stats[-1:]
    assert "TAIL_V_FULL" not in stats[-1]  # MLA: no V half


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
