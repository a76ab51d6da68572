"""On the CPU: HiCache (``--enable-hierarchical-cache``) on sglang 0.5.12's CPU engine,
with the test-only shims of e2e_support/sitecustomize.py (``KV_CANARY_TEST_SHIM_HICACHE_CPU``:
unpinned host memory, a torch stand-in for ``transfer_kv_direct``; ``hicache_io_backend=direct``,
``layer_first``). A workload whose prefixes overflow the 256-token device pool backs them up to
the host pool and loads them back (docs/subsystems.md, "HiCache"). One canary server (log
mode, real data + per-layer fingerprints + token checks + the sweep) runs it clean, then with
one ``host_kv`` fault. The clean phase: no violation, the greedy outputs of the canary off (a
server of its own), the canary's rows really went to the host and back, and the host pool
made room for them within --hicache-ratio. ``host_kv``: a byte of a page in host memory
flipped; caught as ``verify_real_kv_hash`` at the position it was flipped, in host memory by
the host-tier sweep and when the page is loaded back and read."""

from __future__ import annotations

import pathlib
import sys

import pytest
from e2e_checks import (
    HOST_KV_FAULT_ENV,
    assert_clean_phase_then_faults,
    assert_host_kv_found,
    assert_host_pool_made_room,
    host_tier_stats,
    run_workload,
)

from sglang.srt.kv_canary.demo.server_harness import (
    build_libcuda_stub,
    cpu_server_env,
    write_tiny_llama,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=90, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow

SUPPORT = pathlib.Path(__file__).parent / "e2e_support"
ARGS = dict(
    enable_hierarchical_cache=True,
    hicache_io_backend="direct",
    hicache_mem_layout="layer_first",
    hicache_ratio=6,
    max_total_tokens=256,
    chunked_prefill_size=64,
    max_running_requests=2,
    log_level="info",
)
# the fault only past the clean phase (hicache_workload.py's two rounds: 88 forwards)
WARMUP = 110


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hicache_server")
    env = cpu_server_env(build_libcuda_stub(root / "stub"))
    env = {k: v for k, v in env.items() if not k.startswith("SGLANG_KV_CANARY_")}
    env["PYTHONPATH"] = str(SUPPORT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["KV_CANARY_TEST_SHIM_HICACHE_CPU"] = "1"
    return dict(model=write_tiny_llama(root / "model"), env=env)


def run(server, env_extra=None, *extra, **engine_kwargs):
    return run_workload(
        "hicache_workload.py",
        server["model"],
        dict(ARGS, **engine_kwargs),
        dict(server["env"], **(env_extra or {})),
        "cpu",
        *extra,
        timeout=900,
    )


@pytest.fixture(scope="module")
def canary_off(server):
    rc, out, off = run(server)
    assert rc == 0 and off is not None, out[-3000:]
    assert sum(off["cached"][8:]) >= 8 * 80  # the second round hits its prefixes
    return off


@pytest.fixture(scope="module")
def canary_on(server):
    """One server, log mode: partial real data + per-layer fingerprints
    (records and table both travel) + token checks + the sweep (device and host tier, every
    host page each pass, every step): ``hicache_workload.py two-phase``, its rounds clean, then
    one ``host_kv`` fault past ``WARMUP`` while the second phase's rounds run."""
    env = dict(
        HOST_KV_FAULT_ENV,
        SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS=str(WARMUP),
        SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT="1",
        SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS="1",
    )
    rc, out, res = run(
        server,
        env,
        "two-phase",
        kv_canary="log",
        kv_canary_real_data="partial",
        kv_canary_real_data_layers="all",
        kv_canary_sweep_interval=1,
    )
    assert rc == 0 and res is not None, out[-3000:]
    return out, res


def test_hicache_clean_matches_canary_off(canary_off, canary_on):
    """The clean phase: no violation, the outputs of the canary off."""
    out, res = canary_on
    on = res["clean"]
    clean_stats = assert_clean_phase_then_faults(out, warmup=WARMUP)
    assert "HiCache host tier mirrored" in out and "host_sweep_pages=4096" in out
    assert on["outputs"] == canary_off["outputs"]
    # the host pool made room for the mirror (fewer prefixes stay on the host: the ratio
    # leaves room for the second round's hits)
    assert_host_pool_made_room(
        out, ratio=ARGS["hicache_ratio"], device_tokens=ARGS["max_total_tokens"]
    )
    assert sum(on["cached"][8:]) >= 8 * 80
    backed_up, loaded = host_tier_stats(clean_stats)
    assert backed_up >= 8 * 80 and loaded >= 80, (backed_up, loaded)  # to the host and back


def test_a_flipped_host_byte_is_found_in_host_memory_and_when_loaded_back(canary_on):
    """``host_kv`` flips a byte of a host-only page: the host-tier sweep right after the fault
    finds it in host memory (``SWEEP_K_FULL``, ``req_to_token_row=-2``, the host-pool index
    as the slot), and the forward that reads the page once it is loaded back reports it too
    (``verify_real_kv_hash`` at the flipped position)."""
    out, res = canary_on
    assert sum(res["second"]["cached"]) >= 16 * 80  # each round loads the prefixes back
    fault, host, loaded = assert_host_kv_found(out)
    assert host[0].forward_step == int(fault["step"])
    assert "The host-tier sweep (HiCache) read host-pool slot" in out
    assert loaded and all(v.forward_step > int(fault["step"]) for v in loaded), (fault, loaded)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
