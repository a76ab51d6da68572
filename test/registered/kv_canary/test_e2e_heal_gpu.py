"""Heal mode on the GPU (docs/user_guide.md, "Self-healing: --kv-canary heal"): heal mode's
storm (``canary_support/storm.py``, as ``test_storm_server.py`` runs it on the CPU) on a
GPU ``launch_server`` with CUDA graphs and sglang's overlap scheduler, at page sizes 1 and 16:
every fault class, eight clients, every other request streaming, sglang's strict pool checks.
On the GPU a forward's read-back is consumed after the next forward is launched, or, for the
last forward before a quiet period, right before sglang processes its result: every request
must complete with the canary-off output (or be aborted past its heals), every streamed chunk
must be a prefix of it; every check of the storm must pass."""

from __future__ import annotations

import sys

import pytest

from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=480, stage="base-b", runner_config="1-gpu-small")
GPU_LANES = {
    "heal_storm_gpu_page_1": ("one_slot_pages", 240),
    "heal_storm_gpu_page_16": ("sixteen_slot_pages", 240),
}
STORM_SECONDS = 120

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


@pytest.mark.parametrize("page_size", [1, 16], ids=["one_slot_pages", "sixteen_slot_pages"])
def test_heal_mode_storm_on_the_gpu(tmp_path, page_size):
    from canary_support.storm import StormSettings, assert_storm_passed, run_storm

    figures = run_storm(
        StormSettings(
            mode="heal",
            seconds=STORM_SECONDS,
            idle_seconds=10,
            device="cuda",
            page_size=page_size,
            stream=True,
            out=tmp_path,
        )
    )
    assert_storm_passed(figures, "GPU heal storm")
    assert figures["healed"] > 0 and figures["completed"] > figures["aborted"], figures


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
