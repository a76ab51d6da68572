"""A full sglang Engine on a GPU with CUDA graphs and ``--kv-canary raise``: the canary
launches are captured inside the decode graphs (their kernel counters keep growing through
graph replays), a clean workload reports nothing and matches canary-off token for token, and
a corrupted record is caught through a graph replay. The demo's TAIL-launch faults in raise
mode (``real_kv_used``, ``real_kv_post_forward``; its other cases: the CPU detection matrix)."""

from __future__ import annotations

import re
import sys

import pytest
from e2e_checks import assert_demo_fault_caught, demo_failure, run_demo
from e2e_workload import run_mixed_workload

from sglang.srt.kv_canary.violations.lines import VIOLATION_LINE_PREFIX, parse_violation_lines
from sglang.srt.kv_canary.demo.server_harness import write_tiny_llama
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=930, stage="base-b", runner_config="1-gpu-small")
# its lanes in the GPU suite (test/gpu_lanes.py): name -> (pytest -k, est. seconds)
GPU_LANES = {
    "core": ("not piecewise and not corrupted and not demo", 400),
    "core_fault": ("corrupted_record", 120),
    "piecewise": ("piecewise", 260),
    "demo_raise": ("demo", 150),
}

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

ARGS = dict(
    chunked_prefill_size=64, max_total_tokens=1024, max_running_requests=8, log_level="info"
)


def _workload(model, mode, env_extra=None, extra=None):
    return run_mixed_workload(
        model, mode, dict(ARGS, **(extra or {})), device="cuda", env_extra=env_extra
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(
        tmp_path_factory.mktemp("gpu_model"),
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.fixture(scope="module")
def res_off(model):
    rc_off, out_off, res = _workload(model, "none")
    assert rc_off == 0, out_off[-4000:]
    return res


def test_engine_with_cuda_graphs_clean_and_identical(model, res_off):
    rc, out, res = _workload(model, "raise", {"SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "10"})
    assert rc == 0, out[-4000:]
    assert res == res_off
    assert VIOLATION_LINE_PREFIX not in out and "health check failed" not in out
    assert re.search(r"Decode batch.*cuda graph: True", out), "decode never used a CUDA graph"
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    steps = [int(re.search(r"step=(\d+)", s).group(1)) for s in stats]
    assert stats and "violations=0" in stats[-1] and "TAIL_K_FULL" in stats[-1]
    # protected tokens keep growing during graph-replayed decode: the launches are in the graph
    protected = [int(re.search(r"protected_tokens=(\d+)", s).group(1)) for s in stats]
    assert protected == sorted(protected) and protected[-1] > protected[0] and steps[-1] >= 50


def test_engine_with_token_checks_clean_and_identical(model, res_off):
    """The incremental token-id snapshots under sglang's overlap scheduler and decode graphs:
    every forward runs the batch it snapshotted (no whole re-snapshot was needed) and the
    token check reports nothing."""
    rc, out, res = _workload(
        model,
        "raise",
        {
            "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
            "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "10",
        },
    )
    assert rc == 0, out[-4000:]
    assert res == res_off
    assert VIOLATION_LINE_PREFIX not in out and "health check failed" not in out
    assert re.search(r"Decode batch.*cuda graph: True", out), "decode never used a CUDA graph"
    assert "re-snapshotted in full" not in out


def test_corrupted_record_caught_through_graph_replay(model):
    rc, out, res = _workload(
        model,
        "raise",
        {"KV_CANARY_TEST_CORRUPT_AFTER": "40", "SGLANG_KV_CANARY_RING_CAPACITY": "8"},
        dict(log_level="warning"),
    )
    assert "KV_CANARY_TEST: corrupted HEAD K records" in out
    assert rc != 0 and res is None, out[-4000:]
    # every HEAD K record's position was bumped: position (and, past position 0, chain) fail
    assert any(
        v.launch_tag == "HEAD_K_FULL"
        and v.fail_reasons in {("verify_position",), ("verify_chain_hash", "verify_position")}
        for v in parse_violation_lines(out)
    ), out[-3000:]


# sglang's default: piecewise CUDA graphs for prefill (capture sizes up to the 64-token chunk,
# so every prefill chunk of the workload replays them)
PIECEWISE = dict(disable_piecewise_cuda_graph=False)


def test_piecewise_cuda_graphs_on_run_clean(model):
    """Piecewise CUDA graphs on, on both servers: every check on (raise, real data partial,
    sweep every 3 forwards, token checks), zero violations, outputs identical to the canary
    off, and the prefills really replayed the piecewise graphs."""
    rc_off, out_off, res_off_pw = _workload(model, "none", extra=PIECEWISE)
    assert rc_off == 0, out_off[-4000:]
    rc, out, res = _workload(
        model,
        "raise",
        {
            "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
            "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "10",
        },
        dict(PIECEWISE, kv_canary_real_data="partial", kv_canary_sweep_interval=3),
    )
    assert rc == 0, out[-4000:]
    assert res == res_off_pw
    assert VIOLATION_LINE_PREFIX not in out and "health check failed" not in out
    assert re.search(r"Prefill batch.*cuda graph: True", out), "no prefill replayed a graph"
    assert re.search(r"Decode batch.*cuda graph: True", out), "decode never used a CUDA graph"
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert stats and "violations=0" in stats[-1] and "TAIL_K_FULL" in stats[-1]


def test_piecewise_cuda_graphs_on_catch_every_fault(model):
    """The same server with the perturbation framework's faults (from step 8, full group):
    each fault the forward reads is caught, prefills through the piecewise graphs included."""
    from e2e_checks import EVERY_FAULT_ENV, assert_every_fault_caught

    rc, out, _ = _workload(
        model,
        "log",
        dict(EVERY_FAULT_ENV),
        dict(PIECEWISE, kv_canary_real_data="partial", kv_canary_sweep_interval=3),
    )
    assert rc == 0, out[-4000:]
    assert re.search(r"Prefill batch.*cuda graph: True", out), "no prefill replayed a graph"
    assert_every_fault_caught(out)


# the demo's faults that only the TAIL launch (and the sweep) can see, in raise mode
DEMO_TAIL_FAULTS = ("real_kv_used", "real_kv_post_forward")


def test_demo_raise_mode_tail_faults(tmp_path):
    """``python -m sglang.srt.kv_canary.demo --device cuda`` with the faults whose reports come
    from the TAIL launch: each injected after the warm-up, reported within three forwards with
    ``verify_real_kv_hash``, and the raise-mode server stopped."""
    proc, rows, logs = run_demo("cuda", DEMO_TAIL_FAULTS, tmp_path, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, demo_failure(out, logs, DEMO_TAIL_FAULTS[0])
    assert set(rows) == set(DEMO_TAIL_FAULTS), out[-3000:]
    for fault in DEMO_TAIL_FAULTS:
        assert_demo_fault_caught(rows[fault], fault, logs)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
