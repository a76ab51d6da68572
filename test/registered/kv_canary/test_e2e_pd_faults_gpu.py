"""On one GPU: faults of a PD transfer, each caught by the decode server's canary on the first
forward that reads what arrived (``benchmark/kv_canary/pd_one_gpu.py``: a prefill and a decode
server of sglang 0.5.12, Mooncake's transfer engine over TCP, the canary in ``log`` mode on
both so the pair keeps serving and the reports can be read; docs/user_guide.md,
"Deployments"): a byte flipped in a received page (``pd_transfer``), a ``req_to_token`` entry
rewritten on the decode server, and transfers that carry the KV pages without the canary's rows
(sglang's buffer lists with nothing spliced in, a test-only hook in
``e2e_support/sitecustomize.py``). Needs Mooncake importable (``bash .device/pd_a/install.sh``
into ``/tmp/site``, on ``PYTHONPATH``). The clean run is ``test_e2e_pd_gpu.py``; the demo's
``pd_transfer`` row runs here too.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from canary_support.script_run import tagged_json
from canary_support.server_process import require_mooncake
from e2e_checks import demo_failure

from sglang.srt.kv_canary.perturb.report import parse_perturb_line
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=700, stage="base-b", runner_config="1-gpu-small")
# its lanes in the GPU suite (test/gpu_lanes.py): name -> (pytest -k, est. seconds)
GPU_LANES = {
    "pd_faults_pages": ("byte_flipped or demo_shows", 380),
    "pd_faults_decode": ("req_to_token or without_the_canary_rows", 320),
}

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

HERE = pathlib.Path(__file__).resolve().parent
PD_SCRIPT = HERE.parents[2] / "benchmark/kv_canary/pd_one_gpu.py"
CANARY_FLAGS = "--kv-canary log --kv-canary-real-data partial"
# one fault, on the first forward past the start-up (no request of sglang's own: no faked
# transfer for the fault to land in)
ONE_FAULT = ("SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS=0", "SGLANG_KV_CANARY_PERTURB_MAX_FAULTS=1")


def _pd_run(tmp_path, *, env=(), decode_env=()):
    """One PD pair (no reference server, no router), four requests one at a time, then the
    servers' logs; returns ``(PD_RESULT, prefill log, decode log)``."""
    require_mooncake()
    argv = [
        sys.executable,
        str(PD_SCRIPT),
        "--backend",
        "mooncake",
        "--router",
        "none",
        "--reference",
        "none",
        "--no-concurrent",
        "--no-fake-requests",
        f"--extra-args={CANARY_FLAGS}",
        "--log-dir",
        str(tmp_path),
        "--timeout",
        "420",
    ]
    for kv in env:
        argv += ["--env", kv]
    for kv in decode_env:
        argv += ["--decode-env", kv]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=480)
    out = proc.stdout + proc.stderr
    result = tagged_json(proc.stdout, "PD_RESULT")
    assert result is not None, out[-4000:]
    assert proc.returncode == 0 and not result["errors"], out[-4000:]
    direct = result["direct"]
    assert direct["served"] == direct["sent"], result
    hints = result["log_hints"]
    assert hints["prefill"].get("canary_installed", 0) >= 1, hints
    assert hints["prefill"].get("canary_violations", 0) == 0, hints
    for role in ("prefill", "decode"):
        assert hints[role].get("traceback", 0) == 0, hints
    logs = [
        (tmp_path / f"{role}.log").read_text(errors="replace") for role in ("prefill", "decode")
    ]
    return result, logs[0], logs[1]


def _faults_and_reports(decode_log: str):
    faults = [f for f in map(parse_perturb_line, decode_log.splitlines()) if f is not None]
    return faults, parse_violation_lines(decode_log)


def test_a_byte_flipped_in_a_received_page_is_caught_at_its_first_read(tmp_path):
    """``pd_transfer`` on the decode server: the forward that first reads the received prefix
    reports the flipped slot as ``verify_real_kv_hash``, as the PD decode server's report."""
    _, _, decode_log = _pd_run(
        tmp_path,
        decode_env=(
            "SGLANG_KV_CANARY_PERTURB_PD_TRANSFER_PROB=1",
            "SGLANG_KV_CANARY_PERTURB_TARGET_GROUP=full",
            *ONE_FAULT,
        ),
    )
    faults, reports = _faults_and_reports(decode_log)
    assert [f["fault"] for f in faults] == ["pd_transfer"], faults
    step, slot = int(faults[0]["step"]), int(faults[0]["slot"])
    assert reports and min(r.forward_step for r in reports) == step, (faults, reports[:3])
    assert any(
        r.forward_step == step and r.slot_idx == slot and "verify_real_kv_hash" in r.fail_reasons
        for r in reports
    ), (faults, reports[:3])
    assert "PD decode server" in decode_log


def test_a_req_to_token_entry_rewritten_on_the_decode_server_is_caught(tmp_path):
    """``req_to_token`` on the decode server (a received request's prefix entry pointed at
    another slot): reported by that forward's HEAD verify at the slot it was pointed at."""
    _, _, decode_log = _pd_run(
        tmp_path, decode_env=("SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB=1", *ONE_FAULT)
    )
    faults, reports = _faults_and_reports(decode_log)
    assert [f["fault"] for f in faults] == ["req_to_token"], faults
    step = int(faults[0]["step"])
    assert reports and min(r.forward_step for r in reports) == step, (faults, reports[:3])
    assert any(
        r.forward_step == step
        and r.slot_idx == int(faults[0]["new_slot"])
        and r.launch_tag.startswith("HEAD_")
        for r in reports
    ), (faults, reports[:3])
    assert "PD decode server" in decode_log


def test_transfers_without_the_canary_rows_are_caught_on_the_decode_server(tmp_path):
    """The KV pages travel but the canary's rows do not (both servers' buffer lists without
    them): the decode server's first forward of a received request finds the prefix's
    records missing; the prefill server, which wrote them, reports nothing."""
    support = str(HERE / "e2e_support")
    path = os.pathsep.join([support] + [p for p in [os.environ.get("PYTHONPATH", "")] if p])
    _, _, decode_log = _pd_run(
        tmp_path, env=("KV_CANARY_TEST_SPLICE_DROPPED=1", f"PYTHONPATH={path}")
    )
    faults, reports = _faults_and_reports(decode_log)
    assert not faults
    assert reports, decode_log[-4000:]
    assert all(r.launch_tag.startswith(("HEAD_", "TAIL_")) for r in reports), reports[:3]
    assert all(r.fail_reasons for r in reports), reports[:3]
    assert "PD decode server" in decode_log


def test_the_demo_shows_a_pd_transfer_fault_caught(tmp_path):
    """``python -m sglang.srt.kv_canary.demo --cases pd_transfer`` on the GPU: its PD pair
    serves the warm-up, the decode server's first received page after it is flipped, and the
    row says detected within the report lag, at the flipped slot, in raise mode (the decode
    server stops)."""
    require_mooncake()
    rows_path = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_KV_CANARY_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.srt.kv_canary.demo",
            "--device",
            "cuda",
            "--cases",
            "pd_transfer",
            "--json",
            str(rows_path),
            "--logs",
            str(tmp_path / "logs"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, demo_failure(out, tmp_path / "logs", "pd_transfer")
    (row,) = json.loads(rows_path.read_text())
    assert row["name"] == "pd_transfer" and row["detected"], row
    assert row["injections"] >= 1 and row["first_injection_step"] > 30, row  # after warm-up
    assert 0 <= row["steps_to_report"] <= 1 and "verify_real_kv_hash" in row["reasons"], row
    assert not row["finished"], row  # raise: the decode server stopped at its report
    log = (tmp_path / "logs" / "pd_transfer.log").read_text(errors="replace")
    assert "---- prefill server log ----" in log and "PD decode server" in log
    assert "kv_canary perturb: fault=pd_transfer" in log


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
