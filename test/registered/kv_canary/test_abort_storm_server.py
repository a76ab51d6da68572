"""Abort mode's storm on the CPU (``canary_support/storm.py``; docs/testing.md, "The CPU
suite"): faults injected on purpose into a small-pool CLI server with eight clients, which must
stay up, abort exactly the requests it reports (each with the canary's message), serve every
other one as the canary-off server does and pass sglang's own leak checks. At CI's size; the
10-minute runs: ``benchmark/kv_canary/abort_storm.py``."""

from __future__ import annotations

import sys
import time

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=150, suite="stage-a-test-cpu")

pytestmark = [pytest.mark.slow, pytest.mark.soak]

# the abort-mode storm (canary_support.storm): every fault class the storm
# injects, eight clients, a 1,024-token pool, 32-token prefill chunks; CI's size (at its
# rarest fault's 0.01 a step, over 10 injections expected); the 10-minute runs:
# benchmark/kv_canary/abort_storm.py
STORM_SECONDS = 60


def test_abort_mode_storm_on_a_cli_server(tmp_path):
    """Abort mode under a storm of self-test faults (docs/user_guide.md, "Containment:
    --kv-canary abort"): a canary-off CLI server answers a list of 48 requests (shared
    prefixes, most longer than a prefill chunk) for the reference; then an abort-mode CLI
    server with a small pool, sglang's strict pool checks after every batch and when idle, and
    the ``req_to_token`` fault (undone, and kept: a corrupt entry left in place) and three
    real-KV faults injected at random serves the list to eight concurrent clients for
    ``STORM_SECONDS``. It passes only if the server is alive after idling and ``/health``
    answers, its log has no Traceback, leak or out-of-memory report, every fault class was
    injected, every request that did not complete ended with the canary's abort message, every
    completed one equals the canary-off output,
    ``sglang:kv_canary_aborted_requests_total`` equals the aborts the clients saw and the
    release guard reclaimed slots wherever a kept entry took one from its request (one at a
    decoded position: a prompt's positions are the radix tree's; none unattributed). The
    10-minute runs and their figures: ``benchmark/results/containment.md``."""
    from canary_support.storm import StormSettings, assert_storm_passed, run_storm

    t0 = time.monotonic()
    figures = run_storm(
        StormSettings(mode="abort", seconds=STORM_SECONDS, idle_seconds=10, out=tmp_path)
    )
    assert_storm_passed(figures, f"storm in {time.monotonic() - t0:.0f} s")
    # the storm really stormed: requests aborted and requests served alongside
    assert figures["aborted"] > 0 and figures["completed"] > figures["aborted"], figures


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
