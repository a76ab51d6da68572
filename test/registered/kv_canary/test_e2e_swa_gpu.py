"""A full sglang Engine serving a tiny hybrid sliding-window model (``GptOssForCausalLM``,
dummy weights: layer 0 sliding-window, layer 1 full attention → ``SWAKVPool`` with a
``SWATokenToKVPoolAllocator`` and ``SWARadixCache``) with ``--kv-canary raise``: a clean
workload (prompts far longer than the window, so SWA eviction runs) reports nothing, and a
byte flipped in the SWA sub-pool inside a running request's window is reported with an
``_SWA`` tag.

GPU only: sglang 0.5.12's CPU path (``torch_native`` attention) has no sliding-window
support, so no hybrid-SWA model runs on the CPU server.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from canary_support.tiny_models import write_tiny_gpt_oss
from e2e_workload import run_mixed_workload

from sglang.srt.kv_canary.perturb.report import parse_perturb_line
from sglang.srt.kv_canary.manager.swa_divergence import SWA_DIVERGENCE_LINE_PREFIX
from sglang.srt.kv_canary.violations.lines import VIOLATION_LINE_PREFIX, parse_violation_lines
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=450, stage="base-b", runner_config="1-gpu-small")

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

WINDOW = 32
ARGS = dict(
    chunked_prefill_size=64,
    max_total_tokens=2048,
    max_running_requests=8,
    log_level="info",
    kv_canary_real_data="partial",
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_swa")
    return write_tiny_gpt_oss(path, sliding_window=WINDOW)


def _workload(model, env_extra=None):
    return run_mixed_workload(model, "raise", ARGS, device="cuda", env_extra=env_extra, timeout=480)


def test_swa_engine_clean_run_has_no_violations(model):
    rc, out, res = _workload(
        model,
        {
            "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "10",
            "SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL": "10",
        },
    )
    assert rc == 0, out[-4000:]
    assert res is not None and len(res) == 48
    assert VIOLATION_LINE_PREFIX not in out and "health check failed" not in out
    assert "SWAKVPool covered by a FULL group" in out
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert stats and "violations=0" in stats[-1]
    assert "TAIL_K_FULL" in stats[-1] and "TAIL_K_SWA" in stats[-1]
    div = [
        json.loads(line.split(SWA_DIVERGENCE_LINE_PREFIX, 1)[1])
        for line in out.splitlines()
        if SWA_DIVERGENCE_LINE_PREFIX in line
    ]
    # prompts of 60-160 tokens against a 31-token window: the SWA group verifies far less
    assert div and 0 < div[-1]["swa_verify_entries"] < div[-1]["full_verify_entries"]


def test_swa_window_byte_flip_detected(model):
    rc, out, res = _workload(
        model, {"KV_CANARY_TEST_FLIP_SWA_AFTER": "30", "SGLANG_KV_CANARY_RING_CAPACITY": "8"}
    )
    m = re.search(
        r"KV_CANARY_TEST: flipped SWA K byte 0 of position (\d+) \(full slot \d+, "
        r"swa slot (\d+)\)",
        out,
    )
    assert m, out[-4000:]
    assert rc != 0 and res is None, out[-4000:]
    pos, swa_slot = m.groups()
    assert ("TAIL_K_SWA", ("verify_real_kv_hash",), int(swa_slot), int(pos)) in {
        (v.launch_tag, v.fail_reasons, v.slot_idx, v.position) for v in parse_violation_lines(out)
    }, out[-3000:]


def test_swa_targeted_fault_injection_detected(model):
    """The runtime's own fault injection aimed at the SWA group: a byte of a slot inside a
    running request's window flipped before a forward, reported on that SWA slot."""
    rc, out, res = _workload(
        model,
        {
            "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "1",
            "SGLANG_KV_CANARY_PERTURB_TARGET_GROUP": "swa",
            "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "30",
            "SGLANG_KV_CANARY_RING_CAPACITY": "8",
        },
    )
    lines = [parse_perturb_line(line) for line in out.splitlines()]
    flips = {f["slot"] for f in lines if f and f["fault"] == "real_kv_used" and f["group"] == "swa"}
    assert flips, out[-4000:]
    assert rc != 0 and res is None, out[-4000:]
    reported = parse_violation_lines(out)
    assert reported and {v.launch_tag for v in reported} == {"TAIL_K_SWA"}, reported
    assert any(
        v.fail_reasons == ("verify_real_kv_hash",) and str(v.slot_idx) in flips for v in reported
    ), reported


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
