"""End to end on a real sglang 0.5.12 server on the CPU (docs/testing.md, "CPU server"), canary wired through the
plugin: CLI / YAML / Engine kwargs, a clean workload identical to canary-off, a same-position
swap caught by the token checks (stopping the server in raise mode) and a log-mode CLI server
locating every injected fault. (The sweep finding a byte flipped in a slot only the radix cache
holds: the demo's ``real_kv_unused_cache`` case, test_e2e_detection_matrix.py; a corrupted
record stopping the server: the GPU suite's ``core_fault`` lane, test_e2e_gpu.py, through
graph replay.)"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import pytest
from canary_support.script_run import run_support_script
from e2e_workload import assert_memory_reserved_as_allocated, run_mixed_workload, workload_info

from sglang.srt.kv_canary.violations.lines import VIOLATION_LINE_PREFIX, parse_violation_lines
from sglang.srt.kv_canary.demo.server_harness import (
    build_libcuda_stub,
    cpu_server_env,
    write_tiny_llama,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=200, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow

HERE = pathlib.Path(__file__).parent
SUPPORT = HERE / "e2e_support"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_server")
    model = write_tiny_llama(root / "model")
    env = cpu_server_env(build_libcuda_stub(root / "stub"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), env.get("PYTHONPATH", "")) if p)
    return dict(model=model, env=env, root=root)


def _workload(server, mode, extra=None, env_extra=None, timeout=600):
    return run_mixed_workload(
        server["model"], mode, extra, base_env=server["env"], env_extra=env_extra, timeout=timeout
    )


# small chunks (chunked prefill) and a small pool (radix evictions)
WORKLOAD_ARGS = dict(
    chunked_prefill_size=32, max_total_tokens=384, max_running_requests=8, log_level="info"
)


def _assert_workload_coverage(out: str) -> None:
    """From sglang's own prefill log lines: radix hits, chunked prefill, a full pool."""

    cached = [int(x) for x in re.findall(r"#cached-token: (\d+)", out)]
    assert cached and max(cached) > 0, "no radix-cache hit"
    assert re.search(r"#new-token: 32, .*#pending-token: [1-9]", out), "no chunked prefill"
    usage = [float(x) for x in re.findall(r"token usage: ([0-9.]+)", out)]
    assert max(usage) >= 0.85, f"pool never under pressure (max usage {max(usage)})"


@pytest.fixture(scope="module")
def baseline(server):
    """Greedy outputs of the workload with the canary off (installs nothing)."""
    rc, out, res = _workload(server, "none", WORKLOAD_ARGS)
    assert rc == 0, out[-3000:]
    # canary off: nothing of the canary's own, only the four fields in sglang's
    # `server_args=ServerArgs(...)` line (its repr shows every setting)
    assert (
        "kv_canary='none', kv_canary_sweep_interval=0, kv_canary_real_data='none', "
        "kv_canary_real_data_layers='first')"
    ) in out
    server_log = "\n".join(
        line for line in out.splitlines() if not line.startswith("INFO ")
    )  # the workload's own print
    quiet = re.sub(
        r"kv_canary(_sweep_interval|_real_data|_real_data_layers)?=\S+",
        "",
        server_log.replace("sglang.srt.kv_canary", ""),
    )
    assert "kv_canary" not in quiet
    assert res is not None and len(res) == 48
    return res


def test_clean_workload_with_token_checks_matches_canary_off(server, baseline):
    """Raise mode with the token checks, ``--kv-canary-real-data all`` (the whole layer-0 K
    row of every slot fingerprinted by the TAIL and SWEEP launches) and the sweep every 3
    forwards: the greedy outputs of the canary off, nothing reported, the canary's memory (its
    token table included) reserved as allocated. (Log mode serving under injected faults: the
    CLI log-server test below.)"""
    env_extra = {
        "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "20",
        "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
    }
    args = dict(WORKLOAD_ARGS, kv_canary_real_data="all", kv_canary_sweep_interval=3)
    rc, out, res = _workload(server, "raise", args, env_extra)
    assert rc == 0, out[-3000:]
    assert res == baseline, "greedy outputs differ with the canary on"
    installed = next(line for line in out.splitlines() if "kv_canary installed:" in line)
    assert "mode=raise real_data=all" in installed and "token_checks=on" in installed, installed
    assert VIOLATION_LINE_PREFIX not in out
    assert "health check failed" not in out
    # the canary's memory: reserved before sglang sized the pool, as then allocated; the pool
    # is --max-total-tokens either way (the budget is far larger)
    assert_memory_reserved_as_allocated(workload_info(out))
    assert workload_info(out)["max_total_num_tokens"] == WORKLOAD_ARGS["max_total_tokens"]
    assert (
        "token_table" in workload_info(out)["kv_canary"]["memory"]["target"]["allocated"]["device"]
    )
    # the live counts in Engine.get_server_info()'s internal_states (sglang's scheduler call)
    assert workload_info(out)["kv_canary_live"] == [
        {
            "target": {
                "violations": 0,
                "dropped_violations": 0,
                "aborted_requests": 0,
                "healed_requests": 0,
                "retired_slots": 0,
                "acting_mode": "raise",
            }
        }
    ]
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert stats, "no stats line"
    for tag in ("HEAD_K_FULL", "TAIL_K_FULL", "SWEEP_K_FULL"):
        assert "violations=0" in stats[-1] and tag in stats[-1], stats[-1]
    _assert_workload_coverage(out)  # chunked prefill, radix reuse and a full pool covered


def test_token_checks_catch_a_req_to_token_swap(server):
    rc, out, res = _workload(
        server,
        "raise",
        dict(WORKLOAD_ARGS, log_level="warning"),
        {
            "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
            "KV_CANARY_TEST_SWAP_SAME_POSITION_AFTER": "5",
        },
        timeout=300,
    )
    assert "KV_CANARY_TEST: req_to_token[" in out, out[-3000:]
    assert rc != 0 and res is None, out[-3000:]
    reasons = [v.fail_reasons for v in parse_violation_lines(out)]
    assert any("verify_token" in r for r in reasons), reasons
    # located: the report names the swapped entry and the slot it read there
    row, pos, slot = map(
        int,
        re.search(
            r"KV_CANARY_TEST: req_to_token\[(\d+), (\d+)\] -> slot "
            r"(\d+)",
            out,
        ).groups(),
    )
    assert any(
        (v.req_to_token_row, v.read_position, v.slot_idx) == (row, pos, slot)
        for v in parse_violation_lines(out)
    ), out[-3000:]


# the command-line cases that end before a server starts: one process runs them all
# (e2e_support/launch_server_cases.py: launch_server's main code, once per case)
BAD_VALUES = [
    (["--kv-canary", "maybe"], "argument --kv-canary: invalid choice: 'maybe'"),
    (["--kv-canary-real-data", "most"], "argument --kv-canary-real-data: invalid choice"),
    (
        ["--kv-canary-sweep-interval", "-2"],
        "invalid --kv-canary-sweep-interval value '-2'; allowed: an integer from 0 (off)",
    ),
    (["--kv-canary-sweep-interval", "5"], "--kv-canary-sweep-interval=5 needs the canary on"),
]
YAML_FLAGS = "kv-canary: log\nkv-canary-sweep-interval: 7\nkv-canary-real-data: partial\n"


@pytest.fixture(scope="module")
def launch_server_cases(server):
    """``{case name: {"exit": status, "output": text}}`` of every case, from one process."""
    model = ["--model-path", server["model"], "--device", "cpu"]
    config = server["root"] / "server.yaml"
    config.write_text(YAML_FLAGS)
    cases = {"help": {"argv": ["--help"]}}
    for i, (argv, _) in enumerate(BAD_VALUES):
        cases[f"bad_value_{i}"] = {"argv": [*model, *argv]}
    cases["bad_env"] = {
        "argv": [*model, "--kv-canary", "log"],
        "env": {"SGLANG_KV_CANARY_RING_CAPACITY": "lots"},
    }
    cases["yaml"] = {"argv": [*model, "--config", str(config)]}
    rc, out, res = run_support_script(
        "launch_server_cases.py", json.dumps(list(cases.values())), env=server["env"], timeout=600
    )
    assert rc == 0 and res is not None and len(res) == len(cases), out[-3000:]
    return dict(zip(cases, res))


def test_launch_server_help_lists_the_flags(launch_server_cases):
    case = launch_server_cases["help"]
    assert case["exit"] == 0, case["output"][-2000:]
    for flag in ("--kv-canary ", "--kv-canary-sweep-interval", "--kv-canary-real-data"):
        assert flag in case["output"]
    assert "{none,log,raise,abort,heal}" in case["output"]
    assert "{none,partial,all}" in case["output"]


@pytest.mark.parametrize("index", range(len(BAD_VALUES)), ids=[m for _, m in BAD_VALUES])
def test_launch_server_rejects_bad_values(launch_server_cases, index):
    case = launch_server_cases[f"bad_value_{index}"]
    assert case["exit"] != 0
    assert BAD_VALUES[index][1] in case["output"], case["output"][-2000:]
    assert "PARSED" not in case["output"]


def test_bad_environment_variable_is_named(launch_server_cases):
    case = launch_server_cases["bad_env"]
    assert case["exit"] != 0 and "PARSED" not in case["output"]
    assert "SGLANG_KV_CANARY_RING_CAPACITY" in case["output"], case["output"][-2000:]


def test_config_yaml_carries_the_flags(launch_server_cases):
    case = launch_server_cases["yaml"]
    assert case["exit"] == 0, case["output"][-2000:]
    assert "PARSED log 7 partial" in case["output"], case["output"][-2000:]


def test_cli_log_server_under_injection_locates_every_fault_and_keeps_serving(server):
    """On the command-line path: a ``launch_server`` in log mode with req_to_token faults
    injected and a ring of 2 rows per forward step. Every injected entry is reported at its
    forward step with its req_to_token row, read position and slot (every step in detail,
    though each one overflows the ring), nothing is
    reported at a step without a fault (the fault was undone after its forward),
    and the server serves every request to the end and stays healthy."""
    from cli_server import CliServer, http_call
    from sglang.srt.kv_canary.perturb.report import parse_perturb_line

    env = dict(
        server["env"],
        SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB="0.25",
        SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS="20",
        SGLANG_KV_CANARY_RING_CAPACITY="2",
        SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT="1",
    )
    srv = CliServer(
        "cli_log_faults",
        server["root"],
        server["model"],
        env,
        ["--kv-canary", "log", "--kv-canary-real-data", "partial"],
        **WORKLOAD_ARGS,
    )
    try:
        srv.wait_ready()
        prefix = list(range(10, 90))
        for wave in range(3):
            prompts = [prefix[: 40 + 10 * i] + [200 + wave, 300 + i] for i in range(6)]
            status, body = http_call(
                srv.port,
                "POST",
                "/generate",
                {
                    "input_ids": prompts,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
                },
                timeout=300,
            )
            assert status == 200, body[:500]
            outs = json.loads(body)
            assert [len(o["output_ids"]) for o in outs] == [24] * 6  # served to the end
        assert http_call(srv.port, "GET", "/health_generate", timeout=120)[0] == 200
        # the canary's memory through the HTTP /server_info: reserved out of the KV budget (the
        # launch_server path's profile hook) as then allocated, token table included
        status, body = http_call(srv.port, "GET", "/server_info", timeout=60)
        assert status == 200, body[:500]
        info = json.loads(body)
        assert_memory_reserved_as_allocated(info)
        assert "token_table" in info["kv_canary"]["memory"]["target"]["allocated"]["device"]
        # and what it reported so far, live: each fault step's lines and the rows past the
        # 2-row ring (the last forward's read-back may come after this call)
        live = [s["kv_canary"] for s in info["internal_states"]]
        assert len(live) == 1 and set(live[0]) == {"target"}, live
        assert live[0]["target"]["violations"] >= 1 and live[0]["target"]["acting_mode"] == "log"
        assert live[0]["target"]["dropped_violations"] >= 1, live
        assert srv.alive()
    finally:
        srv.stop()
    log = srv.log()
    assert "memory leak" not in log and "Traceback" not in log, log[-3000:]
    injected = [
        f
        for f in map(parse_perturb_line, log.splitlines())
        if f is not None and f.get("fault") == "req_to_token"
    ]
    assert len(injected) >= 3, log[-3000:]
    lines = parse_violation_lines(log)
    assert live[0]["target"]["violations"] <= len(lines)
    steps = {int(i["step"]) for i in injected}
    assert {v.forward_step for v in lines} <= steps  # undone: later forwards are clean
    for i in injected:
        step = int(i["step"])
        assert any(
            v.forward_step == step
            and v.slot_idx == int(i["new_slot"])
            and (v.req_to_token_row, v.read_position)
            == (int(i["req_pool_idx"]), int(i["position"]))
            for v in lines
        ), (i, lines)
    # each step overflowed the 2-row ring and the next one was detailed again
    assert any(f"not recorded at forward step {s}" in log for s in steps)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
