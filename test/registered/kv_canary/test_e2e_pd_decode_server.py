"""On the CPU: the decode side of PD disaggregation (``--disaggregation-mode decode``)
on sglang 0.5.12's CPU engine, with sglang's ``fake`` transfer backend (its prefill side
refuses ``fake``, and no real transfer engine runs on the CPU). The fake transfer moves no
bytes: sglang fakes it on purpose (bootstrap host ``2.2.2.2``: a server's warm-up request and
``/health_generate`` on a real PD pair), so the canary sets aside what such a request reads and
the server serves in raise mode. With ``KV_CANARY_TEST_TRANSFER_LOST=1`` (a test-only hook in
``e2e_support/sitecustomize.py``) the canary takes those transfers for real ones, which stands
for a transfer that reported success and lost the KV pages and the canary rows spliced into
them: the decode server's first forward of each request reads a prefix no prefill ever wrote
there. The canary must say so at that step, for every position of the prefix, naming the
request; in raise mode the server stops with the structured line. What needs GPUs (a real
transfer engine between two servers, clean runs, the ``pd_transfer`` fault) is in
docs/user_guide.md, "Deployments"."""

from __future__ import annotations

import json
import sys

import pytest
from canary_support.script_run import run_support_script

from sglang.srt.kv_canary.violations.lines import VIOLATION_LINE_PREFIX, parse_violation_lines
from sglang.srt.kv_canary.demo.server_harness import (
    build_libcuda_stub,
    cpu_server_env,
    write_tiny_llama,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=115, suite="stage-a-test-cpu")

pytestmark = pytest.mark.slow

PROMPT_LEN = 30  # e2e_support/pd_decode_workload.py
ARGS = dict(log_level="info")  # a decode server reserves 512 tokens per request: keep the pool


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd_decode")
    env = cpu_server_env(build_libcuda_stub(root / "stub"))
    env = {k: v for k, v in env.items() if not k.startswith("SGLANG_KV_CANARY_")}
    return dict(model=write_tiny_llama(root / "model"), env=env)


def run(server, *, lost: bool, **engine_kwargs):
    """The workload on a decode server; ``lost``: the canary takes sglang's faked transfers for
    real ones that delivered nothing (the sitecustomize hook)."""
    env = dict(server["env"], KV_CANARY_TEST_TRANSFER_LOST="1" if lost else "0")
    return run_support_script(
        "pd_decode_workload.py",
        server["model"],
        json.dumps(dict(ARGS, **engine_kwargs)),
        env=env,
        timeout=600,
        sitecustomize=True,
    )


def test_faked_transfers_are_set_aside_and_raise_mode_serves(server):
    rc, out, res = run(server, lost=False, kv_canary="raise")
    assert rc == 0 and res is not None, out[-3000:]
    assert len(res["outputs"]) == 3 and all(len(o) == 6 for o in res["outputs"])
    assert not parse_violation_lines(out) and VIOLATION_LINE_PREFIX not in out
    assert out.count("are not reported: nothing was sent for them") == 1, out[-3000:]


def test_a_transfer_that_delivered_nothing_is_reported_at_the_first_decode_step(server):
    rc, out, res = run(server, lost=True, kv_canary="log", kv_canary_sweep_interval=2)
    assert rc == 0 and res is not None, out[-3000:]  # log mode: served to the end
    assert "kv_canary installed: mode=log" in out
    # a decode server has no radix cache by default: the sweep has nothing to walk, says so
    assert "--kv-canary-sweep-interval 2 has nothing to sweep" in out
    lines = parse_violation_lines(out)
    assert lines, out[-3000:]
    for rid in res["rids"]:
        mine = [v for v in lines if rid in v.rids]
        first = min(v.forward_step for v in mine)
        at_first = [v for v in mine if v.forward_step == first]
        # the whole prefix, at the request's first forward on this server, by the HEAD verify
        # (and, at times, the slot this forward writes: its predecessor's record is not one)
        read = {v.read_position for v in at_first}
        assert set(range(PROMPT_LEN)) <= read <= set(range(PROMPT_LEN + 1)), (rid, at_first)
        assert all("HEAD_K_FULL" in v.seen_by for v in at_first)
        assert len({v.req_to_token_row for v in at_first}) == 1
        for v in at_first:
            want = (
                {"verify_chain_hash", "verify_position"}
                if v.read_position < PROMPT_LEN
                else {"write_position"}
            )
            assert set(v.fail_reasons) & want, v
    # every report names the server of the PD pair it comes from
    logged = parse_violation_lines(out, unique=False)
    assert out.count("\n  Server: PD decode server.") == len(logged), out[-3000:]


def test_a_transfer_that_delivered_nothing_stops_a_raise_mode_decode_server(server):
    rc, out, res = run(server, lost=True, kv_canary="raise")
    assert rc != 0 and res is None
    assert VIOLATION_LINE_PREFIX in out and "read_position=0 " in out
    assert "kv_canary detected KV-cache corruption of the PD decode server:" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
