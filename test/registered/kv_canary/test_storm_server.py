"""Abort and heal mode's storms on the CPU (``canary_support/storm.py``; docs/testing.md, "The
CPU suite"): faults injected on purpose into a small-pool CLI server with eight clients, which
must stay up and pass sglang's own leak checks. Abort mode aborts exactly the requests it
reports (each with the canary's message) and serves every other one as the canary-off server
does; heal mode completes every request with the canary-off output, none aborted but those
healed the most times, and retires a stuck bit's slot. One canary-off reference serves the
three storms (the same server settings, clients and request list). Heal mode's servers read
each forward's checks back one forward later, in the order a GPU server reads them
(``SGLANG_KV_CANARY_CPU_DEFERRED_READBACK``): a report then comes after the next forward was
launched, and a request past its heals is hit while the token of the forward that read
corrupt KV waits to be appended. At CI's size; the 10-minute runs:
``benchmark/kv_canary/abort_storm.py``."""

from __future__ import annotations

import sys
import time

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=300, suite="stage-a-test-cpu")

pytestmark = [pytest.mark.slow, pytest.mark.soak]

# every fault class the storm injects (the req_to_token fault, undone and kept, and three
# real-KV faults), eight clients, a 1,024-token pool, 32-token prefill chunks
# (canary_support.storm), at CI's size (about 140 faults a minute; the rarest, at 0.01 a step,
# several times)
STORM_SECONDS = 45
# the stuck bit: long enough for its slot to be handed out again after its first heal
STUCK_SECONDS = 30


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The canary-off server's outputs for the storms' request list, served once for the
    storms of this file (the same server settings, clients and list)."""
    from canary_support.storm import StormSettings, storm_reference

    return storm_reference(StormSettings(mode="heal"), tmp_path_factory.mktemp("reference"))


def test_abort_mode_storm_on_a_cli_server(tmp_path, reference):
    """Abort mode under a storm of self-test faults (docs/user_guide.md, "Containment:
    --kv-canary abort"): an abort-mode CLI server with a small pool, sglang's strict pool checks
    after every batch and when idle, and the ``req_to_token`` fault (undone, and kept: a
    corrupt entry left in place) and three real-KV faults injected at random serves the
    reference's list of 48 requests (shared prefixes, most longer than a prefill chunk) to
    eight concurrent clients for ``STORM_SECONDS``. It passes only if the server is alive after
    idling and ``/health`` answers, its log has no Traceback, leak or out-of-memory report,
    every fault class was injected, every request that did not complete ended with the
    canary's abort message, every completed one equals the canary-off output,
    ``sglang:kv_canary_aborted_requests_total`` equals the aborts the clients saw and the
    release guard reclaimed slots wherever a kept entry took one from its request (one at a
    decoded position: a prompt's positions are the radix tree's; none unattributed). The
    10-minute runs and their figures: ``benchmark/results/containment.md``."""
    from canary_support.storm import StormSettings, assert_storm_passed, run_storm

    t0 = time.monotonic()
    figures = run_storm(
        StormSettings(mode="abort", seconds=STORM_SECONDS, idle_seconds=10, out=tmp_path),
        reference,
    )
    assert_storm_passed(figures, f"abort storm in {time.monotonic() - t0:.0f} s")
    # the storm really stormed: requests aborted and requests served alongside
    assert figures["aborted"] > 0 and figures["completed"] > figures["aborted"], figures


def test_heal_mode_storm_on_a_cli_server(tmp_path, reference):
    """Heal mode under a storm of self-test faults (docs/user_guide.md, "Self-healing:
    --kv-canary heal"): a heal-mode CLI server with a small pool, sglang's strict pool checks after every batch and
    when idle, and the ``req_to_token`` fault (undone, and kept) and three real-KV faults
    injected at random serves the reference's list to eight concurrent clients for
    ``STORM_SECONDS``, every other request streaming. It passes only if the server is alive after idling and
    ``/health`` answers, its log has no Traceback, leak or out-of-memory report, every fault
    class was injected, every completed request has the canary-off output, every streamed
    chunk is a prefix of it, the only aborts are of requests healed
    ``SGLANG_KV_CANARY_MAX_HEALS`` times (at the storm's fault rates a long request can be hit
    again after each heal), ``sglang:kv_canary_healed_requests_total`` equals the heal lines,
    ``sglang:kv_canary_aborted_requests_total`` the aborts seen, and every slot a kept entry
    took from its request was found by its record."""
    from canary_support.storm import StormSettings, assert_storm_passed, run_storm

    t0 = time.monotonic()
    figures = run_storm(
        StormSettings(
            mode="heal",
            seconds=STORM_SECONDS,
            idle_seconds=10,
            stream=True,
            deferred_readback=True,
            out=tmp_path,
        ),
        reference,
    )
    assert_storm_passed(figures, f"storm in {time.monotonic() - t0:.0f} s")
    # the storm really stormed: requests healed, and served
    assert figures["healed"] > 0 and figures["completed"] > figures["aborted"], figures


def test_heal_mode_retires_a_stuck_slot_on_a_cli_server(tmp_path, reference):
    """A stuck bit (``SGLANG_KV_CANARY_PERTURB_REAL_KV_STUCK_PROB=1``: the slot a forward wrote
    is flipped, and flipped again after every later forward that writes it) under heal mode's
    storm clients: the requests reading it are healed, and once the slot is found corrupt
    again after its corrupt content was freed it is retired (a WARNING naming it, the
    ``sglang:kv_canary_retired_slots`` gauge); nothing writes it after that, every request
    completes with the canary-off output, and sglang's pool-leak checks (busy and idle) stay
    clean with the retired slot out of the allocator."""
    from canary_support.storm import StormSettings, assert_storm_passed, run_storm

    figures = run_storm(
        StormSettings(
            mode="heal",
            seconds=STUCK_SECONDS,
            idle_seconds=10,
            stuck=True,
            deferred_readback=True,
            out=tmp_path,
        ),
        reference,
    )
    assert_storm_passed(figures, "stuck")
    assert figures["retired_metric"] == 1 and figures["stuck_flips"] >= 2, figures


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
