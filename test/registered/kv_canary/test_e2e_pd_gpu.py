"""On one GPU: a PD pair of sglang 0.5.12 servers (prefill and decode, Mooncake's transfer
engine over TCP) with the canary on both, started as an operator starts them: the server
warm-up and ``/health_generate`` on, so the decode server gets the requests whose transfer
sglang fakes, next to a plain server with the same canary flags
(``benchmark/kv_canary/pd_one_gpu.py``, docs/user_guide.md, "Deployments"). Needs Mooncake's
TransferEngine importable: on the device, ``bash .device/pd_a/install.sh`` (built by
``test/device_bundle_pd.sh``) into ``/tmp/site``, on ``PYTHONPATH``. The CPU side of the decode
server (faked transfers set aside, a lost transfer reported) is ``test_e2e_pd_decode_server.py``.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from canary_support.script_run import tagged_json
from canary_support.server_process import require_mooncake

from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=360, stage="base-b", runner_config="1-gpu-small")

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

PD_SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "benchmark/kv_canary/pd_one_gpu.py"
CANARY_FLAGS = "--kv-canary raise --kv-canary-real-data all --kv-canary-sweep-interval 4"


def test_pd_pair_with_the_canary_serves_a_default_start_up(tmp_path):
    """Every direct request served, the decode server's answers equal to the plain server's,
    no violation on either server, the decode server's reads of faked transfers set aside
    (its warm-up and ``/health_generate`` requests: nothing is sent for them), and the
    prefixes that did travel verified on the decode server without a report."""
    require_mooncake()
    proc = subprocess.run(
        [
            sys.executable,
            str(PD_SCRIPT),
            "--backend",
            "mooncake",
            "--router",
            "none",
            f"--extra-args={CANARY_FLAGS}",
            "--env",
            "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=1",
            "--log-dir",
            str(tmp_path),
            "--timeout",
            "420",
        ],
        capture_output=True,
        text=True,
        timeout=480,
    )
    out = proc.stdout + proc.stderr
    result = tagged_json(proc.stdout, "PD_RESULT")
    assert result is not None, out[-4000:]
    assert proc.returncode == 0 and not result["errors"], out[-4000:]
    direct = result["direct"]
    assert direct["served"] == direct["sent"] and result["identical"] is True, result
    assert result["concurrent"]["served"] == result["concurrent"]["sent"], result
    hints = result["log_hints"]
    for role in ("prefill", "decode"):
        assert hints[role].get("canary_installed", 0) >= 1, hints
        assert hints[role].get("canary_violations", 0) == 0, hints
        assert hints[role].get("canary_raised", 0) == 0, hints
        assert hints[role].get("traceback", 0) == 0, hints
    assert hints["decode"].get("faked_transfers_set_aside", 0) == 1, hints
    decode_log = (tmp_path / "decode.log").read_text(errors="replace")
    assert "mode=raise real_data=all" in decode_log and "token_checks=on" in decode_log


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
