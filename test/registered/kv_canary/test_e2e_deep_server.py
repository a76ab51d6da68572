"""Per-layer fingerprints end to end on the CPU: ``--kv-canary-real-data-layers all`` on a real
sglang 0.5.12 server (a tiny four-layer Llama; docs/subsystems.md, "Per-layer fingerprints").
One server (log mode, sweep + real data + token checks, two layers a forward) runs a clean
phase, then faults: the clean phase reports no violation; a byte flipped after it in the last
layer's V row of a slot only the radix cache holds is caught by the sweep (``SWEEP_V_FULL``,
``verify_real_kv_hash``, ``kv_layer=3``); one flipped in a slot the forwards go on reading is
caught by a TAIL check within the stated bound (layers / layers per forward forwards). With
``first`` (layer 0's K only; a server of its own) the same faults go unseen: the gap the user
guide's "What it does not catch" states."""

from __future__ import annotations

import sys

import pytest
from e2e_checks import assert_clean_phase_then_faults, run_workload
from e2e_workload import assert_memory_reserved_as_allocated, workload_info

from sglang.srt.kv_canary.perturb.report import parse_perturb_line
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.kv_canary.demo.server_harness import (
    build_libcuda_stub,
    cpu_server_env,
    write_tiny_llama,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=80, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow

LAYERS = 4
LAYERS_PER_FORWARD = 2
BOUND = LAYERS // LAYERS_PER_FORWARD  # forwards reading a slot that check all its layers
ARGS = dict(chunked_prefill_size=32, max_total_tokens=512, max_running_requests=4, log_level="info")
# the every-layer server's faults only past its clean phase (small_workload.py's waves: 32
# forwards)
WARMUP = 50
FAULTS = {
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "6",
    "SGLANG_KV_CANARY_PERTURB_MAX_FAULTS": "10",
    "SGLANG_KV_CANARY_PERTURB_TARGET_GROUP": "full",
    "SGLANG_KV_CANARY_PERTURB_TARGET_LAYER": "last",
    "SGLANG_KV_CANARY_PERTURB_TARGET_HALF": "v",
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB": "0.35",
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB": "0.35",
    "SGLANG_KV_CANARY_REAL_DATA_LAYERS_PER_FORWARD": str(LAYERS_PER_FORWARD),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("deep_server")
    env = cpu_server_env(build_libcuda_stub(root / "stub"))
    env = {k: v for k, v in env.items() if not k.startswith("SGLANG_KV_CANARY_")}
    return dict(model=write_tiny_llama(root / "model", num_hidden_layers=LAYERS), env=env)


def run(server, layers, env_extra, *extra):
    return run_workload(
        "small_workload.py",
        server["model"],
        dict(
            ARGS,
            kv_canary="log",
            kv_canary_real_data="partial",
            kv_canary_real_data_layers=layers,
            kv_canary_sweep_interval=2,
        ),
        dict(server["env"], **env_extra),
        "cpu",
        *extra,
        timeout=900,
    )


@pytest.fixture(scope="module")
def every_layer(server):
    """One server with every layer fingerprinted (and token checks): ``small_workload.py
    two-phase``, the waves clean, then :data:`FAULTS` from step ``WARMUP`` on, while the second
    phase's waves run."""
    rc, out, res = run(
        server,
        "all",
        dict(
            FAULTS,
            SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS=str(WARMUP),
            SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT="1",
            SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS="1",
        ),
        "two-phase",
    )
    assert rc == 0 and res is not None and len(res["second"]) == 24, out[-3000:]
    return out, res


def test_every_layer_clean_reports_nothing(every_layer):
    """The clean phase. (The outputs with every layer fingerprinted against the canary off: the
    HiCache clean test, test_e2e_hicache_server.py, which runs ``--kv-canary-real-data-layers
    all``.)"""
    out, res = every_layer
    assert f"real_data=partial real_data_layers=all layers_per_forward={LAYERS_PER_FORWARD}" in out
    assert_clean_phase_then_faults(out, warmup=WARMUP)
    assert len(res["clean"]) == 12
    # every layer's fingerprint columns (and the token table) reserved as then built
    info = workload_info(out)
    assert_memory_reserved_as_allocated(info)
    assert {"layer_fingerprints", "token_table", "sweep"} <= set(
        info["kv_canary"]["memory"]["target"]["allocated"]["device"]
    )


def _faults_and_lines(out):
    injected = [f for f in map(parse_perturb_line, out.splitlines()) if f]
    kinds = {f["fault"] for f in injected}
    assert kinds == {"real_kv_unused_cache", "real_kv_post_forward"}, injected
    assert all(f["layer"] == str(LAYERS - 1) and f["half"] == "v" for f in injected)
    return injected, parse_violation_lines(out)


def test_last_layer_v_flips_are_caught_with_every_layer(every_layer):
    injected, lines = _faults_and_lines(every_layer[0])
    assert lines and all(v.fail_reasons == ("verify_real_kv_hash",) for v in lines), lines
    assert all(v.kv_layer == LAYERS - 1 for v in lines), lines
    # a slot only the radix cache holds: the sweep, every layer
    unused = [f for f in injected if f["fault"] == "real_kv_unused_cache"]
    assert any(
        v.launch_tag == "SWEEP_V_FULL"
        and v.slot_idx == int(f["full_slot"])
        and v.forward_step >= int(f["step"])
        for f in unused
        for v in lines
    ), (unused, lines)
    # a slot the next forwards read: a TAIL check within the bound
    post = [f for f in injected if f["fault"] == "real_kv_post_forward"]
    assert any(
        v.launch_tag == "TAIL_V_FULL"
        and v.slot_idx == int(f["full_slot"])
        and 0 < v.forward_step - int(f["step"]) <= BOUND
        for f in post
        for v in lines
    ), (post, lines)


def test_first_layer_only_misses_them(server):
    """Its own server (layer 0's K only): the faults from step 6 on, the waves once."""
    rc, out, res = run(server, "first", FAULTS)
    assert rc == 0 and res is not None and len(res) == 12, out[-3000:]
    injected, lines = _faults_and_lines(out)
    assert injected and lines == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
