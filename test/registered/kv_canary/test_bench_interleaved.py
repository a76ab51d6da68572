"""``benchmark/kv_canary/bench_interleaved.py`` (issue 22's paired measurement): its statistics
and server plumbing at the unit level, and one smoke run on sglang's CPU server (two real
``launch_server`` processes, requests alternated between them). The numbers of a CPU run mean
nothing; what is checked is that every round reaches every server, the records say what
they measured and the servers are gone afterwards."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

BENCH_DIR = pathlib.Path(__file__).resolve().parents[3] / "benchmark" / "kv_canary"
sys.path.insert(0, str(BENCH_DIR))

import bench_interleaved as bi  # noqa: E402
from sglang.srt.kv_canary.testing.server_harness import engine_kwargs_to_argv  # noqa: E402


def test_paired_overhead_is_the_median_ratio_with_a_bootstrap_interval():
    off = [10.0, 20.0, 10.0, 40.0, 10.0]
    on = [11.0, 22.0, 10.5, 44.0, 30.0]  # +10 %, +10 %, +5 %, +10 %, +200 % (one outlier)
    med, lo, hi = bi.paired_overhead(on, off)
    assert med == pytest.approx(0.10)  # the outlier round does not move the median
    assert lo <= med <= hi and lo >= 0.05 - 1e-12 and hi <= 2.0 + 1e-12
    assert bi.paired_overhead(on, off) == (med, lo, hi)  # seeded: reproducible
    # a constant ratio has a zero-width interval
    assert bi.paired_overhead([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="two equal non-empty series, got 2 and 3"):
        bi.paired_overhead([1.0, 2.0], [1.0, 2.0, 3.0])


def test_rounds_alternate_abba_and_memory_shares_accumulate():
    names = ["off", "raise", "raise+token"]
    assert bi.round_order(names, 0) == names
    assert bi.round_order(names, 1) == names[::-1]
    assert bi.round_order(names, -1) == names[::-1]  # warm-up rounds alternate too
    assert bi.memory_fractions(3, 0.2) == [0.2, 0.4, 0.6]
    with pytest.raises(ValueError, match="--gpu-share 0.3 x 4 servers = 1.2 of the GPU"):
        bi.memory_fractions(4, 0.3)


def test_engine_kwargs_become_launch_server_flags():
    argv = engine_kwargs_to_argv(dict(model_path="/m", cuda_graph_bs=[1, 128], enable_metrics=True,
                                  disable_piecewise_cuda_graph=False, kv_canary="raise",
                                  chunked_prefill_size=8192, speculative_draft_model_path=None))
    assert argv == ["--model-path", "/m", "--cuda-graph-bs", "1", "128", "--enable-metrics",
                    "--kv-canary", "raise", "--chunked-prefill-size", "8192"]


def test_measure_sends_each_round_to_every_server_in_abba_order():
    calls = []

    class FakeServer:
        def __init__(self, name, token):
            self.name, self.token = name, token

        def generate(self, ids, osl):
            calls.append(self.name)
            meta = {"forward_entry_time": 1.0, "prefill_finished_time": 1.002}
            return 5.0, [{"output_ids": [self.token] * osl, "meta_info": meta} for _ in ids]

    sc = bi.SMOKE_SCENARIOS["prefill_bs1_512"]
    servers = {"off": FakeServer("off", 7), "raise": FakeServer("raise", 7)}
    wall, server, mismatched = bi.measure(servers, sc, rounds=3, warmup=1, vocab=512)
    assert calls == ["raise", "off", "off", "raise", "raise", "off", "off", "raise"]
    assert wall == {"off": [5.0] * 3, "raise": [5.0] * 3} and mismatched == 0
    assert server["off"] == pytest.approx([2.0] * 3)
    servers["raise"].token = 8  # the canary changed an output: counted
    assert bi.measure(servers, sc, rounds=2, warmup=0, vocab=512)[2] == 2


@pytest.mark.slow
def test_smoke_run_on_two_cpu_servers(tmp_path):
    out = tmp_path / "i.jsonl"
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_interleaved.py"), "--smoke-cpu", "--configs",
         "off,raise", "--scenarios", "prefill_bs1_512", "--rounds", "2", "--warmup", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["config"] for r in recs] == ["off", "raise"]
    assert {r["kind"] for r in recs} == {"interleaved"} and len({r["invocation"] for r in recs}) == 1
    for r in recs:
        assert r["rounds"] == 2 and len(r["wall_runs_ms"]) == 2 and r["mismatched_rounds"] == 0
        assert len(r["server_runs_ms"]) == 2 and all(t > 0 for t in r["server_runs_ms"])
    assert "wall_overhead" not in recs[0] and len(recs[1]["wall_overhead"]) == 3
    assert len(recs[1]["server_overhead"]) == 3
    assert "| prefill_bs1_512 (bs1 isl16 osl1) | raise | 2 |" in proc.stdout
    # each server was a canary-on / canary-off launch_server, and is gone (its port closed)
    assert "kv_canary installed" in (tmp_path / "i.jsonl.raise.log").read_text()
    assert "kv_canary installed" not in (tmp_path / "i.jsonl.off.log").read_text()
    for port in {r["port"] for r in recs}:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
