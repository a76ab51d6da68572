"""The detection matrix on a real sglang 0.5.12 CPU server (docs/subsystems.md,
"Self-tests"): the demo runs the clean workload and then one fault per detecting launch (HEAD,
the sweep, the write check), one server each, with ``--kv-canary raise``, real-data
``partial``, the sweep, the token oracle and both token checks on. Each fault must be reported
with the reason it must cause; the clean run must report nothing; the demo's exit status must
say so. The TAIL launch's cases in raise mode: the GPU lane ``demo_raise``. Also:
``--sampling-backend token_oracle`` on the CPU engine (which rewrites the flag to ``pytorch``)
really samples the oracle's tokens."""

from __future__ import annotations

import os
import sys
import pytest
import torch

from canary_support.script_run import run_support_script
from e2e_checks import assert_demo_fault_caught, demo_failure, run_demo
from sglang.srt.kv_canary.violations.lines import VIOLATION_LINE_PREFIX
from sglang.srt.kv_canary.demo.server_harness import (
    build_libcuda_stub,
    cpu_server_env,
    write_tiny_llama,
)
from sglang.srt.kv_canary.token_oracle import oracle_tokens, request_oracle_key
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=210, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow


# the demo's cases on the CPU: the clean run and one fault per detecting launch: HEAD
# (req_to_token, whose report names the changed entry), the sweep (real_kv_unused_cache: a
# flipped byte of a cached slot no forward reads) and the write check (next_token_swap). The
# TAIL launch's raise-mode cases (real_kv_used, real_kv_post_forward) run on the GPU lane
# ``demo_raise`` (test_e2e_gpu.py); on the CPU the same faults are found in log mode by the
# MLA and unified-tree every-fault runs.
CPU_FAULTS = ("req_to_token", "real_kv_unused_cache", "next_token_swap")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_KV_CANARY_")}
    return run_demo("cpu", ("clean", *CPU_FAULTS), tmp_path_factory.mktemp("demo"), env=env)


def test_demo_exit_status_and_table(demo):
    proc, rows, _ = demo
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(rows) == {"clean", *CPU_FAULTS}
    assert "every fault detected, clean run quiet" in proc.stdout
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # header + one row per run


def test_without_cases_the_demo_says_which_it_leaves_out_on_the_cpu():
    """The case list of a run without ``--cases`` on the CPU: every case but the GPU-only
    ones, each said, not hidden."""
    from sglang.srt.kv_canary.demo.cases import CASES
    from sglang.srt.kv_canary.demo.cli import choose_cases

    names, notes = choose_cases(None, "cpu")
    assert names == [c.name for c in CASES if c.name not in ("host_kv", "pd_transfer")]
    for gpu_only in ("host_kv", "pd_transfer"):
        assert f"leaving out {gpu_only}, which needs --device cuda" in "\n".join(notes)


def test_clean_run_reports_nothing(demo):
    _, rows, logs = demo
    clean = rows["clean"]
    assert clean["returncode"] == 0 and clean["finished"]
    assert clean["violations"] == 0 and clean["injections"] == 0
    assert clean["protected_tokens"] > 10_000 and clean["sweep_passes"] > 20
    text = (logs / "clean.log").read_text()
    # every check was on, and the workload hit the radix cache and chunked its prefills
    assert "token_oracle=on" in text and "replacing sglang's Sampler" in text
    assert "#cached-token: 0" in text and any(f"#cached-token: {n}" in text for n in range(1, 200))
    assert "#new-token: 32, " in text


@pytest.mark.parametrize("fault", CPU_FAULTS)
def test_fault_detected_with_its_reason(demo, fault):
    _, rows, logs = demo
    assert_demo_fault_caught(rows[fault], fault, logs)


def test_token_oracle_backend_flag_on_the_cpu_engine(tmp_path):
    model = write_tiny_llama(tmp_path / "model")
    env = cpu_server_env(build_libcuda_stub(tmp_path / "stub"))
    env["SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT"] = "1"
    rc, out, res = run_support_script("oracle_workload.py", model, env=env, timeout=600)
    assert rc == 0 and res is not None, out[-3000:]
    assert VIOLATION_LINE_PREFIX not in out
    assert "replacing sglang's Sampler with the token_oracle sampler" in out
    for r in res:
        n = len(r["output_ids"])
        assert n == 12
        want = oracle_tokens(
            torch.full((n,), request_oracle_key(r["rid"])),
            torch.arange(r["prompt_len"], r["prompt_len"] + n),
            512,
        )
        assert r["output_ids"] == want.tolist()


def test_a_failed_demo_run_shows_the_tail_of_its_server_log(tmp_path):
    """What the GPU tests' assertion prints when a demo run fails: the tail of the demo's
    output and of the case's server log, or that the log is missing."""
    (tmp_path / "host_kv.log").write_text("early lines " * 50 + "Traceback: the server died")
    message = demo_failure("host_kv | never | NO", tmp_path, "host_kv", chars=60)
    assert message.startswith("host_kv | never | NO\n---- host_kv.log")
    assert message.endswith("Traceback: the server died") and "early lines " * 10 not in message
    assert f"(no {tmp_path / 'pd_transfer.log'})" in demo_failure("out", tmp_path, "pd_transfer")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
