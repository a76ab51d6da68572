"""``benchmark/kv_canary/bench_interleaved.py`` (the paired latency measurement): its statistics
and server plumbing at the unit level, each ``--speculative`` mode's launch flags, draft
configs (read by sglang's own config loader and parsers) and canary-installation check, and one
smoke run on sglang's CPU server (two real ``launch_server`` processes, requests alternated
between them). The numbers of a CPU run mean
nothing; what is checked is that every round reaches every server, the records say what
they measured and the servers are gone afterwards."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import types

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=150, suite="stage-a-test-cpu")

BENCH_DIR = pathlib.Path(__file__).resolve().parents[3] / "benchmark" / "kv_canary"
sys.path.insert(0, str(BENCH_DIR))

import bench_interleaved as bi  # noqa: E402
import bench_pd_overhead as pdo  # noqa: E402
import common  # noqa: E402
import interleaved_rounds  # noqa: E402
import interleaved_servers  # noqa: E402
from sglang.srt.kv_canary.demo.server_process import (  # noqa: E402
    engine_kwargs_to_argv,
    launch_server_flags,
)


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


def test_rounds_rotate_each_server_through_each_place_and_memory_shares_accumulate():
    two = ["off", "raise"]
    assert [bi.round_order(two, k) for k in range(4)] == [two, two[::-1], two[::-1], two]  # ABBA
    names = ["off", "raise", "raise+token", "off~aa"]
    orders = [bi.round_order(names, k) for k in range(2 * len(names))]
    for name in names:  # every server in every place, twice over two cycles
        assert sorted(o.index(name) for o in orders) == [0, 0, 1, 1, 2, 2, 3, 3]
    follows = {(o[i], o[i + 1]) for o in orders for i in range(len(o) - 1)}
    # a server that follows another also precedes it
    assert all((b, a) in follows for a, b in follows)
    assert bi.round_order(names, -1) in orders  # warm-up rounds use the same orders
    assert bi.rotated(names, 5) == bi.rotated(names, 1) == names[1:] + names[:1]
    assert bi.memory_fractions(3, 0.2) == [0.2, 0.4, 0.6]
    with pytest.raises(ValueError, match="--gpu-share 0.3 x 4 servers = 1.2 of the GPU"):
        bi.memory_fractions(4, 0.3)


class _StartLog:
    """``start_servers``'s launch and wait callables, writing what happened in order."""

    def __init__(self, fail_up: str | None = None):
        self.events: list[tuple[str, str]] = []
        self.fail_up = fail_up

    def launch(self, name):
        self.events.append(("launch", name))
        return types.SimpleNamespace(name=name)

    def up(self, srv, launched):
        assert isinstance(launched, float)
        self.events.append(("up", srv.name))
        if srv.name == self.fail_up:
            raise RuntimeError(f"{srv.name} died")


def test_servers_start_one_after_the_other_or_together_with_their_memory_held_by_the_cap():
    """``--start serial`` waits for each server before launching the next, its memory
    fraction the shares so far; ``--start together`` launches every server, then waits for
    each, every server given the run's whole fraction (the pool cap keeps each to its share),
    and a run whose servers' pools came out unequal is refused; a server that fails to come
    up leaves every launched one in ``started`` for the caller to stop."""
    order = ["raise", "off~aa", "off"]
    serial, together = _StartLog(), _StartLog()
    started_serial, started_together = {}, {}
    bi.start_servers(order, serial.launch, serial.up, "serial", started_serial)
    bi.start_servers(order, together.launch, together.up, "together", started_together)
    assert serial.events == [(what, n) for n in order for what in ("launch", "up")]
    assert together.events == [("launch", n) for n in order] + [("up", n) for n in order]
    assert list(started_serial) == list(started_together) == order
    failing, started = _StartLog(fail_up="off~aa"), {}
    with pytest.raises(RuntimeError, match="off~aa died"):
        bi.start_servers(order, failing.launch, failing.up, "together", started)
    assert list(started) == order  # all launched: the caller stops all three
    with pytest.raises(ValueError, match="--start 'parallel': allowed serial, together"):
        bi.start_servers(order, serial.launch, serial.up, "parallel", {})

    assert bi.memory_fractions(3, 0.2, "together") == [0.6, 0.6, 0.6]
    with pytest.raises(ValueError, match="= 1.2 of the GPU"):
        bi.memory_fractions(4, 0.3, "together")
    with pytest.raises(ValueError, match="--start 'parallel'"):
        bi.memory_fractions(3, 0.2, "parallel")
    same = {n: {"version": "0.5.12", "max_total_num_tokens": 10112} for n in order}
    assert bi.pool_note(same, "together") is None and bi.pool_note(same, "serial") is None
    differ = {**same, "raise": {"version": "0.5.12", "max_total_num_tokens": 9000}}
    with pytest.raises(SystemExit, match="raise 9000, off~aa 10112, off 10112 tokens") as refused:
        bi.pool_note(differ, "together")
    assert "--start serial" in str(refused.value)
    assert bi.pool_note(differ, "serial") == (
        "note: the servers' KV pools differ (raise 9000, off~aa 10112, off 10112 tokens)"
    )
    unreported = {**same, "off": {"version": None, "max_total_num_tokens": None}}
    with pytest.raises(SystemExit, match="off None"):
        bi.pool_note(unreported, "together")


def test_osl_sets_every_decode_scenario_s_output_length_and_leaves_prefills_alone():
    chosen = [
        bi.SCENARIOS["decode_bs1"],
        bi.SCENARIOS["prefill_bs1_512"],
        bi.SCENARIOS["decode_bs32"],
    ]
    assert bi.with_osl(chosen, None) == chosen
    cut = bi.with_osl(chosen, 256)
    assert [(sc.name, sc.bs, sc.isl, sc.osl) for sc in cut] == [
        ("decode_bs1", 1, 512, 256),
        ("prefill_bs1_512", 1, 512, 1),
        ("decode_bs32", 32, 512, 256),
    ]
    assert bi.SCENARIOS["decode_bs1"].osl == 1024  # the table itself unchanged
    # the pool the run sizes follows the shorter outputs
    assert interleaved_servers.tokens_needed(cut, 512) < interleaved_servers.tokens_needed(
        chosen, 512
    )
    with pytest.raises(SystemExit, match="--osl 1: a decode scenario's output length"):
        bi.with_osl(chosen, 1)
    with pytest.raises(SystemExit, match="--osl 64: no decode scenario in --scenarios"):
        bi.with_osl([bi.SCENARIOS["prefill_bs1_4k"]], 64)


def test_decode_time_is_sglangs_own_and_the_control_decides_what_is_resolved():
    def out(n, tput):
        return {
            "output_ids": [1] * n,
            "meta_info": {"completion_tokens": n, "decode_throughput": tput},
        }

    # (n - 1) / throughput per request, the batch's median, in ms
    assert bi.server_decode_ms(
        [out(101, 1000.0), out(101, 500.0), out(101, 1000.0)]
    ) == pytest.approx(100.0)
    assert bi.server_decode_ms([out(1, 0.0)]) is None  # one token: no decode
    assert bi.server_decode_ms([{"output_ids": [1, 2], "meta_info": {}}]) is None
    # a figure no decode can reach (STANDALONE's 1023 tokens in 0.004 ms): no decode time
    assert bi.server_decode_ms([out(1024, 1023 / 4e-6)]) is None
    assert bi.server_decode_ms([out(1024, 1023 / 0.5), out(1024, 1023 / 4e-6)]) is None
    assert bi.server_decode_ms([out(1024, 1023 / 0.011)]) == pytest.approx(11.0)

    rec = {"server_overhead": (0.012, 0.008, 0.015), "decode_overhead": (0.001, -0.002, 0.004)}
    quiet = {"server_overhead": (0.001, -0.002, 0.0025), "decode_overhead": (0.0, -0.001, 0.001)}
    noisy = dict(quiet, server_overhead=(0.001, -0.006, 0.004))
    assert bi.resolved(rec, quiet, "server") == "resolved"
    assert bi.resolved(rec, quiet, "decode") == "within noise"
    assert bi.resolved(rec, noisy, "server") == "control too wide"
    assert bi.resolved(rec, None, "server") == "no control"


def test_engine_kwargs_become_launch_server_flags():
    argv = engine_kwargs_to_argv(
        dict(
            model_path="/m",
            cuda_graph_bs=[1, 128],
            enable_metrics=True,
            disable_piecewise_cuda_graph=False,
            kv_canary="raise",
            chunked_prefill_size=8192,
            speculative_draft_model_path=None,
        )
    )
    assert argv == [
        "--model-path",
        "/m",
        "--cuda-graph-bs",
        "1",
        "128",
        "--enable-metrics",
        "--kv-canary",
        "raise",
        "--chunked-prefill-size",
        "8192",
    ]


def test_each_server_gets_its_own_nccl_port_unless_its_kwargs_name_one(monkeypatch):
    """Left to sglang, ``nccl_port`` is an ephemeral port bound late, which a server starting
    beside it (``--start together``) may take first: every server's is picked here."""
    argvs = []

    def record(self, name, argv, *, port, env, log_path):
        argvs.append(argv)

    monkeypatch.setattr(interleaved_servers.ServerProcess, "__init__", record)
    cfg = interleaved_servers.server_config("off")
    for _ in range(2):
        interleaved_servers.Server("off", cfg, {"model_path": "/m"}, {}, "/dev/null")
    interleaved_servers.Server(
        "off", cfg, {"model_path": "/m", "nccl_port": 23456}, {}, "/dev/null"
    )

    def flag(argv, name):
        return int(argv[argv.index(name) + 1])

    ports = [(flag(a, "--port"), flag(a, "--nccl-port")) for a in argvs]
    picked = [p for pair in ports[:2] for p in pair]
    assert len(set(picked)) == 4  # two servers, four distinct ports
    assert ports[2][1] == 23456


def test_measure_sends_each_round_to_every_server_in_rotating_order():
    calls = []

    class FakeServer:
        def __init__(self, name, token):
            self.name, self.token = name, token

        def generate(self, ids, osl):
            calls.append(self.name)
            meta = {
                "forward_entry_time": 1.0,
                "prefill_finished_time": 1.002,
                "completion_tokens": osl,
                "decode_throughput": 100.0,
            }
            return 5.0, [{"output_ids": [self.token] * osl, "meta_info": meta} for _ in ids]

    sc = bi.SMOKE_SCENARIOS["prefill_bs1_512"]
    servers = {"off": FakeServer("off", 7), "raise": FakeServer("raise", 7)}
    wall, server, decode, mismatched = bi.measure(servers, sc, rounds=3, warmup=1, vocab=512)
    # warm-up round -1, then rounds 0, 1, 2
    assert calls == ["off", "raise", "off", "raise", "raise", "off", "raise", "off"]
    assert wall == {"off": [5.0] * 3, "raise": [5.0] * 3} and mismatched == 0
    assert server["off"] == pytest.approx([2.0] * 3)
    assert decode["off"] == [None] * 3  # one output token: no decode time
    servers["raise"].token = 8  # the canary changed an output: counted
    assert bi.measure(servers, sc, rounds=2, warmup=0, vocab=512)[3] == 2
    # another sglang's outputs differ by design: compared within a stack only
    servers["up:off"] = FakeServer("up:off", 9)
    assert bi.measure(servers, sc, rounds=2, warmup=0, vocab=512)[3] == 2  # raise still 8
    servers["raise"].token = 7
    assert bi.measure(servers, sc, rounds=2, warmup=0, vocab=512)[3] == 0


def test_repeated_requests_give_each_round_their_medians_and_one_pause_each(monkeypatch):
    """``--repeat 3``: each server answers the round's request three times in a row (continued
    once for them with ``--isolate``), its round's figures the medians of the three; a server
    whose repeated answers differ counts the round as mismatched."""
    events = []

    class FakeServer:
        def __init__(self, name, walls):
            self.name, self.walls, self.sent, self.tokens = name, walls, 0, [7, 7, 7]

        def generate(self, ids, osl):
            events.append(("generate", self.name))
            i = self.sent % 3
            self.sent += 1
            meta = {"forward_entry_time": 1.0, "prefill_finished_time": 1.0 + self.walls[i] / 1e3}
            return self.walls[i], [{"output_ids": [self.tokens[i]], "meta_info": meta}]

        def pause(self):
            events.append(("pause", self.name))

        def resume(self):
            events.append(("resume", self.name))

    monkeypatch.setattr(interleaved_rounds, "ISOLATE_SETTLE_S", 0.0)
    sc = bi.SMOKE_SCENARIOS["prefill_bs1_512"]
    servers = {
        "off": FakeServer("off", [10.0, 30.0, 11.0]),
        "raise": FakeServer("raise", [50.0, 12.0, 13.0]),
    }
    wall, server, _, mismatched = bi.measure(
        servers, sc, rounds=2, warmup=0, vocab=512, isolate=True, repeat=3
    )
    assert wall == {"off": [11.0, 11.0], "raise": [13.0, 13.0]} and mismatched == 0
    assert server["off"] == pytest.approx([11.0, 11.0]) and server["raise"] == pytest.approx(
        [13.0] * 2
    )
    visit = lambda n: [("resume", n)] + [("generate", n)] * 3 + [("pause", n)]  # noqa: E731
    paused_first = [("pause", "off"), ("pause", "raise")]
    continued_last = [("resume", "off"), ("resume", "raise")]
    assert (
        events
        == paused_first
        + visit("off")
        + visit("raise")
        + visit("raise")
        + visit("off")
        + continued_last
    )
    servers["raise"].tokens = [7, 8, 7]  # one of raise's three answers differs
    assert bi.measure(servers, sc, rounds=2, warmup=0, vocab=512, repeat=3)[3] == 2
    with pytest.raises(ValueError, match="--repeat 0: allowed 1 or more"):
        bi.measure(servers, sc, rounds=1, warmup=0, vocab=512, repeat=0)


def test_upstream_configs_take_the_same_flags_and_their_own_baseline():
    """``up:`` configs: upstream's canary under this project's flags (none for a canary-off
    server, no per-layer fingerprints, no abort mode), each compared with its own stack's
    baseline; a stack without its baseline is refused, naming it."""
    up = bi.CONFIG_TABLE["up:raise+token+partial"]
    assert up.stack == "upstream"
    assert up.env() == {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"}
    assert up.engine_kwargs() == {"kv_canary": "raise", "kv_canary_real_data": "partial"}
    assert bi.CONFIG_TABLE["up:off"].engine_kwargs() == {}
    assert bi.CONFIG_TABLE["up:raise+all"].engine_kwargs()["kv_canary_real_data"] == "all"
    assert bi.CONFIG_TABLE["raise+all"].stack == "project"
    # the sweep: the same flag and interval on both stacks, none where it is off
    for name in ("raise+all+sweep", "up:raise+all+sweep"):
        assert bi.CONFIG_TABLE[name].engine_kwargs()["kv_canary_sweep_interval"] == 100
    assert "kv_canary_sweep_interval" not in bi.CONFIG_TABLE["up:raise+all"].engine_kwargs()
    assert not [
        n for n in bi.CONFIG_TABLE if n.startswith("up:") and ("abort" in n or "layers" in n)
    ]
    names = ["off", "raise", "up:off", "up:raise", "off~aa"]
    assert bi.stack_baselines(names, "off") == {
        "off": "off",
        "raise": "off",
        "up:off": "up:off",
        "up:raise": "up:off",
        "off~aa": "off",
    }
    with pytest.raises(
        SystemExit,
        match="up:raise is compared with its stack's baseline up:off, which is not among them",
    ):
        bi.stack_baselines(["off", "raise", "up:raise"], "off")


def test_each_stack_is_resolved_by_its_own_aa_control():
    """Upstream's stack gets its own A/A twin once one of its canary configs runs, and the
    table judges each stack's overheads by its own twin: a quiet project pair does not make
    upstream's rows claims when upstream's twin is noisy."""
    assert bi.control_names(["off", "raise"], "off") == ["off~aa"]
    assert bi.control_names(["off", "raise", "up:off"], "off") == ["off~aa"]
    assert bi.control_names(["off", "raise", "up:off", "up:raise"], "off") == [
        "off~aa",
        "up:off~aa",
    ]
    names = ["off", "raise", "up:off", "up:raise", "off~aa", "up:off~aa"]
    baselines = bi.stack_baselines(names, "off")
    assert baselines["up:off~aa"] == "up:off" and baselines["off~aa"] == "off"

    def rec(name, overhead):
        cfg = name.removesuffix("~aa")
        r = dict(
            invocation="i",
            scenario="s",
            bs=1,
            isl=1,
            osl=1,
            config=cfg,
            server_name=name,
            control=name.endswith("~aa"),
            baseline=baselines[name],
            stack=bi.CONFIG_TABLE[cfg].stack,
            rounds=3,
            mismatched_rounds=0,
            wall={"median": 1.0, "min": 1.0},
        )
        if overhead is not None:
            r["wall_overhead"] = overhead
        return r

    text = bi.table(
        [
            rec("off", None),
            rec("raise", (0.02, 0.01, 0.03)),
            rec("up:off", None),
            rec("up:raise", (0.02, 0.01, 0.03)),
            rec("off~aa", (0.0, -0.001, 0.001)),
            rec("up:off~aa", (0.01, -0.02, 0.03)),
        ]
    )
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| s ")}
    assert rows["raise"].endswith("(resolved) |")
    assert rows["up:raise"].endswith("(control too wide) |")
    assert "up:off (A/A control)" in rows


def test_a_canary_config_s_twin_is_compared_with_that_config():
    """``--twins raise`` starts a second ``raise`` server whose records compare it with the
    first (not with ``off``) and are marked as a twin, not as the A/A control: the table
    keeps judging ``raise`` by ``off~aa`` and shows the twin's difference without a verdict.
    A baseline or a config not in the run is refused."""
    names = ["off", "raise"]
    assert bi.twin_names(names, ["raise"], "off") == ["raise~aa"]
    for bad in (["off"], ["raise+all"]):
        with pytest.raises(SystemExit, match="--twins"):
            bi.twin_names(names, bad, "off")
    servers = names + bi.control_names(names, "off") + bi.twin_names(names, ["raise"], "off")
    baselines = bi.stack_baselines(servers, "off")
    assert baselines == {"off": "off", "raise": "off", "off~aa": "off", "raise~aa": "raise"}
    runs = {"off": [10.0] * 5, "raise": [11.0] * 5, "off~aa": [10.0] * 5, "raise~aa": [13.2] * 5}
    recs = bi.scenario_records(
        bi.SCENARIOS["prefill_bs1_512"],
        runs,
        {n: list(v) for n, v in runs.items()},
        {n: [None] * 5 for n in runs},
        0,
        baselines=baselines,
        ports={n: 1 for n in runs},
        common=dict(invocation="i"),
        facts={n: {} for n in runs},
    )
    by = {r["server_name"]: r for r in recs}
    assert by["off~aa"]["control"] and not by["off~aa"]["twin"]
    assert by["raise~aa"]["twin"] and not by["raise~aa"]["control"]
    assert not by["raise"]["control"] and not by["raise"]["twin"]
    assert by["raise~aa"]["baseline"] == "raise"
    assert by["raise~aa"]["server_overhead"][0] == pytest.approx(0.2)  # 13.2 against 11
    assert by["raise"]["server_overhead"][0] == pytest.approx(0.1)  # 11 against 10
    rows = {
        line.split(" | ")[1]: line
        for line in bi.table(recs).splitlines()
        if line.startswith("| prefill_bs1_512")
    }
    assert set(rows) == {"off", "raise", "off (A/A control)", "raise (twin)"}
    assert "(resolved)" in rows["raise"]
    assert "(against raise)" in rows["raise (twin)"] and "resolved" not in rows["raise (twin)"]
    assert "(baseline)" not in rows["raise (twin)"]  # its decode cell: no decode here
    args = bi.build_parser().parse_args(["--twins", "raise"])
    assert args.twins == "raise"


def test_servers_capture_the_decode_graphs_of_the_run_s_batch_sizes():
    """Every server captures a decode graph for bs 1 and each decode scenario's batch size
    (a bs 32 decode replays a bs 32 graph, and no server spends start-up time on graphs the
    run never replays); ``--cuda-graph-bs`` overrides, EAGLE keeps 1 and 32."""
    sc = [bi.SCENARIOS[n] for n in ("prefill_bs1_16k", "decode_bs64", "decode_bs32")]
    args = bi.build_parser().parse_args([])
    assert bi.graph_batch_sizes(args, sc) == (1, 32, 64)
    assert bi.graph_batch_sizes(args, sc[:1]) == (1,)  # prefill only: bs 1
    args = bi.build_parser().parse_args(["--cuda-graph-bs", "1,8"])
    assert bi.graph_batch_sizes(args, sc) == (1, 8)
    args = bi.build_parser().parse_args(["--speculative", "eagle"])
    assert bi.graph_batch_sizes(args, sc) == (1, 32)
    args = bi.build_parser().parse_args(["--cuda-graph-bs", "0"])
    with pytest.raises(SystemExit, match="--cuda-graph-bs: expected comma-separated positive"):
        bi.graph_batch_sizes(args, sc)


class _PausableServer:
    """A stand-in server of :func:`interleaved_rounds.measure`: records whether it is paused,
    and at each request that no other server was running."""

    def __init__(self, name, peers, fail_at=None, strict=True):
        self.name, self.peers, self.paused, self.requests = name, peers, False, 0
        self.fail_at, self.strict, self.signals = fail_at, strict, 0

    def pause(self):
        self.paused = True
        self.signals += 1

    def resume(self):
        self.paused = False
        self.signals += 1

    def generate(self, ids, osl):
        running = [n for n, s in self.peers.items() if not s.paused]
        if self.strict:
            assert running == [self.name], f"running during {self.name}'s request: {running}"
        self.requests += 1
        if self.requests == self.fail_at:
            raise RuntimeError(f"{self.name} failed")
        out = {"output_ids": [7] * osl, "meta_info": {}}
        return 1.0, [out for _ in ids]


def test_isolated_rounds_run_one_server_at_a_time_and_continue_all_at_the_end(monkeypatch):
    """``--isolate``: while one server has a request, every other is paused; when the rounds
    end, or one request fails, every server is continued."""
    monkeypatch.setattr(interleaved_rounds, "ISOLATE_SETTLE_S", 0.0)
    monkeypatch.setattr(interleaved_rounds, "server_config", lambda n: bi.CONFIG_TABLE["off"])
    sc = bi.SMOKE_SCENARIOS["decode_bs1"]
    servers = {}
    servers.update({n: _PausableServer(n, servers) for n in ("a", "b", "c")})
    wall, _, _, mismatched = interleaved_rounds.measure(
        servers, sc, rounds=3, warmup=1, vocab=100, isolate=True
    )
    assert {n: len(v) for n, v in wall.items()} == {"a": 3, "b": 3, "c": 3}
    assert mismatched == 0 and not any(s.paused for s in servers.values())
    assert all(s.requests == 4 for s in servers.values())
    servers.clear()
    servers.update({n: _PausableServer(n, servers, fail_at=2) for n in ("a", "b")})
    with pytest.raises(RuntimeError, match="failed"):
        interleaved_rounds.measure(servers, sc, rounds=3, warmup=0, vocab=100, isolate=True)
    assert not any(s.paused for s in servers.values())
    # without --isolate no server is signalled (and the strict stand-ins would refuse)
    servers.clear()
    servers.update({n: _PausableServer(n, servers, strict=False) for n in ("a", "b")})
    interleaved_rounds.measure(servers, sc, rounds=2, warmup=0, vocab=100, isolate=False)
    assert [(s.requests, s.signals) for s in servers.values()] == [(2, 0), (2, 0)]
    servers.clear()
    servers.update({n: _PausableServer(n, servers) for n in ("a", "b")})
    with pytest.raises(AssertionError, match="running during"):
        interleaved_rounds.measure(servers, sc, rounds=1, warmup=0, vocab=100, isolate=False)


def test_a_paused_process_group_stops_all_its_processes_until_continued():
    """``pause_group`` stops the server's whole session (a child too, as a scheduler), and
    ``resume_group`` continues it: the processes' state in ``/proc`` says so."""
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.01)'])\n"
        "print(child.pid, flush=True)\n"
        "while True: time.sleep(0.01)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        child = int(proc.stdout.readline())

        def states():
            out = []
            for pid in (proc.pid, child):
                stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
                out.append(stat.rsplit(")", 1)[1].split()[0])
            return out

        interleaved_servers.pause_group(proc)
        deadline = time.monotonic() + 10
        while states() != ["T", "T"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert states() == ["T", "T"]
        interleaved_servers.resume_group(proc)
        deadline = time.monotonic() + 10
        while "T" in states() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "T" not in states()
    finally:
        interleaved_servers.resume_group(proc)
        os.killpg(proc.pid, 9)
        proc.wait()


def test_upstream_servers_run_from_their_site_with_this_project_kept_out(tmp_path):
    """An upstream server's PYTHONPATH: the isolation folder, the upstream site, then the
    run's; this project's servers keep the run's environment."""
    base = {"PYTHONPATH": "/tmp/site", "HOME": "/root"}
    env = bi.server_env(base, bi.CONFIG_TABLE["up:raise"], str(tmp_path))
    assert env["PYTHONPATH"].split(os.pathsep) == [
        str(bi.UPSTREAM_SITE_DIR),
        str(tmp_path),
        "/tmp/site",
    ]
    assert (bi.UPSTREAM_SITE_DIR / "sitecustomize.py").is_file()
    assert bi.server_env(base, bi.CONFIG_TABLE["raise"], str(tmp_path)) == base
    assert "PYTHONPATH" not in bi.server_env({}, bi.CONFIG_TABLE["off"], None)
    log = bi.INSTALLED_LINE + "raise ..."
    assert "this project's canary was installed on an upstream server" in bi.canary_install_problem(
        log, canary_on=True, speculative="none", stack="upstream"
    )
    assert (
        bi.canary_install_problem("", canary_on=True, speculative="none", stack="upstream") is None
    )


def test_the_side_kernel_config_runs_the_pacing_probe_and_is_refused_without_its_fork(
    monkeypatch,
):
    """``off+sidekernel``: canary off, the pacing probe's folder first on the server's
    PYTHONPATH and its fork variable set; a server whose log lacks the probe's fork line is
    refused (its figures would be plain off's); no upstream twin of it."""
    cfg = bi.CONFIG_TABLE["off+sidekernel"]
    assert not cfg.canary_on and cfg.engine_kwargs() == {"kv_canary": "none"}
    base = {"PYTHONPATH": "/tmp/site", "HOME": "/root"}
    env = bi.server_env(base, cfg, None)
    probe_dir = BENCH_DIR / "pacing_probe"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(probe_dir), "/tmp/site"]
    assert env["KV_PACING_PROBE_FORK"] == "kernel" and env["HOME"] == "/root"
    assert bi.server_env({}, cfg, None)["PYTHONPATH"] == str(probe_dir)
    assert "KV_PACING_PROBE_FORK" not in bi.server_env(base, bi.CONFIG_TABLE["off"], None)
    assert not any(c.side_fork for c in interleaved_servers.UPSTREAM_CONFIGS.values())
    # the other scripts' configs (common.CONFIGS) are canary configs and off: no probe there
    assert "off+sidekernel" not in bi.CONFIGS
    spec = importlib.util.spec_from_file_location(
        "kv_pacing_probe", probe_dir / "kv_pacing_probe.py"
    )
    probe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kv_pacing_probe", probe)
    spec.loader.exec_module(probe)
    assert probe.FORK_LINE == bi.SIDE_FORK_LINE
    line = f"[2026-11-30 07:00:00] {probe.FORK_LINE} (kernel) on cuda:0"
    assert (
        bi.canary_install_problem(line, canary_on=False, speculative="none", side_fork="kernel")
        is None
    )
    for log in ("", line.replace("(kernel)", "(empty)")):
        problem = bi.canary_install_problem(
            log, canary_on=False, speculative="none", side_fork="kernel"
        )
        assert "the pacing probe did not fork" in problem
    assert "canary-off config" in bi.canary_install_problem(
        line + "\n" + TARGET_LINE, canary_on=False, speculative="none", side_fork="kernel"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--configs", "off,up:raise", "--piecewise", "off"],
            "upstream's servers need --upstream-site DIR",
        ),
        (
            ["--configs", "off,up:raise", "--upstream-site", "{tmp}"],
            "--piecewise on: upstream's canary refuses",
        ),
        (
            [
                "--configs",
                "off,up:off,up:raise",
                "--upstream-site",
                "{tmp}",
                "--piecewise",
                "off",
                "--speculative",
                "eagle",
            ],
            "measures prefill and decode without speculative",
        ),
        (["--configs", "off,raise", "--upstream-site", "{tmp}"], "no up:config in --configs"),
        (["--configs", "off,up:abort"], "unknown|not one of|allowed"),
    ],
)
def test_side_by_side_refuses_what_it_cannot_run(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        bi.main([a.replace("{tmp}", str(tmp_path)) for a in argv])


def test_idle_schedulers_sleep_or_spin_as_told(tmp_path):
    base = bi.EngineSettings(model="qwen3-0.6b", max_total_tokens=4096).engine_kwargs(
        str(tmp_path), smoke=False
    )
    assert base["sleep_on_idle"] is False  # the GPU benchmarks' Engines spin too
    for name in ("off", "raise"):
        kw = bi.server_kwargs(base, bi.CONFIGS[name], mem_fraction=0.2, idle="sleep")
        assert kw["sleep_on_idle"] is True and kw["mem_fraction_static"] == 0.2
        assert "--sleep-on-idle" in engine_kwargs_to_argv(kw)
        kw = bi.server_kwargs(base, bi.CONFIGS[name], mem_fraction=None, idle="spin")
        assert kw["sleep_on_idle"] is False
        assert kw["mem_fraction_static"] == base["mem_fraction_static"]  # None: the settings'
        assert "--sleep-on-idle" not in engine_kwargs_to_argv(kw)  # sglang's default: spin
    assert kw["kv_canary"] == "raise"
    # the command line's defaults: spinning schedulers (sglang's own), piecewise graphs on
    defaults = bi.build_parser().parse_args([])
    assert (defaults.idle, defaults.piecewise) == ("spin", None)  # None: on where sglang can
    assert common.piecewise_setting(common.DEFAULT_MODEL, defaults.piecewise) == "on"
    with pytest.raises(ValueError, match="--idle 'nap': allowed sleep, spin"):
        bi.server_kwargs(base, bi.CONFIGS["off"], mem_fraction=None, idle="nap")


TARGET_LINE = "[INFO] kv_canary installed: MHATokenToKVPool pool=... groups=1"
DRAFT_LINE = "[INFO] kv_canary installed on the EAGLE draft worker: MHATokenToKVPool ..."
# install.py's line for each draft worker (the GPU suite's speculative lanes assert them)
STANDALONE_LINE = "[INFO] kv_canary installed on the STANDALONE draft worker: mode=raise ..."
DFLASH_LINE = "[INFO] kv_canary installed on the DFLASH draft worker: mode=raise ..."
# the draft canary line a canary-on server of each mode must show (None: NGRAM has no draft
# KV pool, its worker's runner is the target's: test_e2e_speculative_gpu.py's
# assert_only_the_target_guarded)
MODE_DRAFT_LINES = {
    "eagle": DRAFT_LINE,
    "eagle-tree": DRAFT_LINE,
    "eagle3": DRAFT_LINE,
    "adaptive": DRAFT_LINE,
    "standalone": STANDALONE_LINE,
    "dflash": DFLASH_LINE,
    "ngram": None,
    "nextn": DRAFT_LINE,  # sglang's EAGLE worker runs NEXTN
    "frozen-kv-mtp": None,  # its assistant writes no KV
    "multi-layer": DRAFT_LINE,  # MTP layer 0's runner, sglang's multi-layer EAGLE worker
}


def _install_cases():
    """Per speculative mode: its right lines pass, a missing or another worker's draft line
    is refused on a canary-on server, any canary line on a canary-off server."""
    cases = []
    for mode, line in MODE_DRAFT_LINES.items():
        wrong = STANDALONE_LINE if line != STANDALONE_LINE else DRAFT_LINE
        if line is None:
            cases += [
                (TARGET_LINE, True, mode, None),
                (TARGET_LINE + "\n" + DRAFT_LINE, True, mode, "has no draft KV pool"),
                (TARGET_LINE + "\n" + DFLASH_LINE, True, mode, "has no draft KV pool"),
                (TARGET_LINE, False, mode, "canary-off config"),
                ("", False, mode, None),
            ]
            continue
        cases += [
            (TARGET_LINE + "\n" + line, True, mode, None),
            (TARGET_LINE, True, mode, "the draft pool ran unguarded"),
            (TARGET_LINE + "\n" + wrong, True, mode, "the draft pool ran unguarded"),
            (
                TARGET_LINE + "\n" + line + "\n" + wrong,
                True,
                mode,
                "the server ran another speculative algorithm",
            ),
            (line, True, mode, "the canary did not run"),
            ("", False, mode, None),
            (line, False, mode, "canary-off config"),
        ]
    return cases


@pytest.mark.parametrize(
    "log, canary_on, speculative, problem",
    [
        (TARGET_LINE, True, "none", None),
        (TARGET_LINE + "\n" + DRAFT_LINE, True, "eagle", None),
        ("", False, "eagle", None),
        ("", True, "none", "the canary did not run"),
        (TARGET_LINE, True, "eagle", "the draft pool ran unguarded"),
        (DRAFT_LINE, True, "eagle", "the canary did not run"),
        (TARGET_LINE, False, "none", "canary-off config"),
        (DRAFT_LINE, False, "eagle", "canary-off config"),
        (STANDALONE_LINE, False, "none", "canary-off config"),
        *_install_cases(),
    ],
)
def test_a_server_whose_canary_is_not_what_its_config_says_is_refused(
    log, canary_on, speculative, problem
):
    got = bi.canary_install_problem(log, canary_on=canary_on, speculative=speculative)
    assert (got is None) if problem is None else (got is not None and problem in got), got


def test_every_speculative_mode_has_its_install_check_cases():
    """Every mode of the benchmarks' table is in the install check's cases above, with the
    worker the plugin names: install.py logs ``draft_worker_name`` of the algorithm sglang
    runs, and none for an algorithm without a draft KV pool."""
    from sglang.srt.kv_canary.sglang_seam.server_args import NO_DRAFT_POOL_ALGORITHMS
    from sglang.srt.kv_canary.startup_checks import draft_worker_name

    assert set(MODE_DRAFT_LINES) == set(common.SPECULATIVE) - {"none"}
    for mode, line in MODE_DRAFT_LINES.items():
        algorithm = common.SPECULATIVE[mode]["speculative_algorithm"]
        worker = None if algorithm in NO_DRAFT_POOL_ALGORITHMS else draft_worker_name(algorithm)
        assert common.SPECULATIVE_DRAFT_WORKERS[mode] == worker, mode
        assert (line is None) == (worker is None), mode
        if line is not None:
            assert common.draft_installed_line(worker) in line, mode


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--speculative", "eagle", "--smoke-cpu"],
            "--speculative eagle cannot run with --smoke-cpu",
        ),
        (
            ["--speculative", "eagle", "--model", "qwen3-30b-a3b"],
            "--speculative eagle needs --model qwen3-0.6b",
        ),
    ],
)
def test_eagle_runs_refuse_what_they_cannot_measure(argv, message):
    with pytest.raises(SystemExit, match=message):
        bi.main(["--configs", "off,raise", *argv])


@pytest.mark.parametrize("mode", [m for m in common.SPECULATIVE if m != "none"])
def test_every_speculative_mode_refuses_what_it_cannot_measure(monkeypatch, mode):
    """Each mode: no CPU dry run (sglang 0.5.12's CPU server has no speculative decoding), the
    target its draft is made for only (refused before any server starts); without ``--model``
    that target, the run past its checks."""

    def no_server(name, *args):
        raise AssertionError(f"server {name} started")

    monkeypatch.setattr(bi, "Server", no_server)
    model = common.SPECULATIVE_MODELS[mode]
    for argv, message in (
        (["--smoke-cpu"], f"--speculative {mode} cannot run with --smoke-cpu"),
        (["--model", "qwen3-30b-a3b"], f"--speculative {mode} needs --model {model}"),
    ):
        with pytest.raises(SystemExit, match=re.escape(message)):
            bi.main(["--configs", "off,raise", "--speculative", mode, "--model", model, *argv])
    # without --model: the mode's target, past the checks to the first server
    with pytest.raises(AssertionError, match="started"):
        bi.main(["--configs", "off,raise", "--speculative", mode])
    args = bi.build_parser().parse_args(["--speculative", mode])
    assert args.speculative == mode
    assert bi.DEFAULT_SCENARIOS[mode] == "decode_bs1,decode_bs32"


@pytest.mark.parametrize("mode", [m for m in common.SPECULATIVE if m != "none"])
def test_piecewise_graphs_where_sglang_captures_the_target(monkeypatch, mode):
    """``--piecewise``: sglang's default (on) for a mode's target unless sglang 0.5.12 cannot
    capture its prefill (``common.MODELS_WITHOUT_PIECEWISE``: the Gemma4 target of
    ``frozen-kv-mtp``, whose KV-sharing layers stop the capture, canary off too), off there,
    and ``--piecewise on`` for it refused before any server starts; the value reaches every
    server's command line."""
    seen = []

    def first_server(name, cfg, kwargs, *args):
        seen.append(kwargs["disable_piecewise_cuda_graph"])
        raise AssertionError(f"server {name} started")

    monkeypatch.setattr(bi, "Server", first_server)
    model = common.SPECULATIVE_MODELS[mode]
    cannot = model in common.MODELS_WITHOUT_PIECEWISE
    for piecewise in (None, "on", "off"):
        argv = ["--configs", "off,raise", "--speculative", mode]
        argv += ["--piecewise", piecewise] if piecewise else []
        if cannot and piecewise == "on":
            with pytest.raises(SystemExit, match=f"--piecewise on cannot serve --model {model}"):
                bi.main(argv)
            continue
        with pytest.raises(AssertionError, match="started"):
            bi.main(argv)
        assert seen.pop() is (cannot or piecewise == "off"), (mode, piecewise)
    assert common.piecewise_setting(model, None) == ("off" if cannot else "on")
    assert common.piecewise_setting(model, "off") == "off"
    with pytest.raises(SystemExit, match="--piecewise maybe: allowed on, off"):
        common.piecewise_setting(model, "maybe")


@pytest.mark.parametrize("bad", ["frozen_kv_mtp", "multi_layer", "EAGLE", "eagle-chain", ""])
def test_an_unknown_speculative_mode_is_refused_naming_the_flag_and_the_modes(capsys, bad):
    """An unknown mode (the algorithms' own spellings among them) is refused by both
    benchmarks, naming ``--speculative``, the value and every allowed mode."""
    import bench_serving_overhead as bso

    for main in (bi.main, bso.main):
        with pytest.raises(SystemExit):
            main(["--speculative", bad])
        err = capsys.readouterr().err
        assert f"argument --speculative: unknown value {bad!r}" in err, err
        assert "allowed: " + ", ".join(common.SPECULATIVE) in err, err
    with pytest.raises(KeyError):
        common.write_speculative_files(bad, "/nonexistent")


# each mode's launch_server flags beside the draft's path, as the GPU suite's servers of that
# mode run (test_e2e_speculative_gpu.py: COMMON's chain, TREE and spec v1, EAGLE3, STANDALONE
# with the radix cache off, NGRAM on spec v1, DFLASH on spec v1 at page size 1, adaptive)
_CHAIN = {
    "--speculative-num-steps": ["3"],
    "--speculative-eagle-topk": ["1"],
    "--speculative-num-draft-tokens": ["4"],
}
SPEC_FLAGS = {
    "none": {},
    "eagle": {"--speculative-algorithm": ["EAGLE"], **_CHAIN},
    "eagle-tree": {
        "--speculative-algorithm": ["EAGLE"],
        "--speculative-num-steps": ["3"],
        "--speculative-eagle-topk": ["2"],
        "--speculative-num-draft-tokens": ["6"],
        "--disable-overlap-schedule": [],
    },
    "eagle3": {"--speculative-algorithm": ["EAGLE3"], **_CHAIN},
    "standalone": {
        "--speculative-algorithm": ["STANDALONE"],
        "--disable-radix-cache": [],
        **_CHAIN,
    },
    "ngram": {
        "--speculative-algorithm": ["NGRAM"],
        "--speculative-num-steps": ["3"],
        "--speculative-num-draft-tokens": ["6"],
        "--speculative-ngram-max-bfs-breadth": ["3"],
        "--disable-overlap-schedule": [],
    },
    "dflash": {
        "--speculative-algorithm": ["DFLASH"],
        "--speculative-num-steps": ["1"],
        "--speculative-eagle-topk": ["1"],
        "--speculative-num-draft-tokens": ["4"],
        "--page-size": ["1"],
        "--disable-overlap-schedule": [],
    },
    "adaptive": {
        "--speculative-algorithm": ["EAGLE"],
        "--speculative-adaptive": [],
        "--speculative-adaptive-config": ["{draft}/adaptive.json"],
        **_CHAIN,
    },
    "nextn": {"--speculative-algorithm": ["NEXTN"], **_CHAIN},
    "frozen-kv-mtp": {
        "--speculative-algorithm": ["FROZEN_KV_MTP"],
        "--disable-overlap-schedule": [],
        **_CHAIN,
    },
    "multi-layer": {
        "--speculative-algorithm": ["EAGLE"],
        "--disable-cuda-graph": [],
        "--disable-radix-cache": [],
        **_CHAIN,
    },
}
# what sglang 0.5.12 resolves each mode to: (algorithm, spec version, steps, topk, draft tokens)
SPEC_RESOLVED = {
    "none": (None, "v2", None, None, None),
    "eagle": ("EAGLE", "v2", 3, 1, 4),
    "eagle-tree": ("EAGLE", "v1", 3, 2, 6),
    "eagle3": ("EAGLE3", "v2", 3, 1, 4),
    "standalone": ("STANDALONE", "v2", 3, 1, 4),
    "ngram": ("NGRAM", "v1", 3, 3, 6),  # sglang sets topk to the breadth
    "dflash": ("DFLASH", "v1", 1, 1, 4),
    "adaptive": ("EAGLE", "v2", 3, 1, 4),
    "nextn": ("EAGLE", "v2", 3, 1, 4),  # sglang runs NEXTN as EAGLE
    "frozen-kv-mtp": ("FROZEN_KV_MTP", "v1", 3, 1, 4),
    "multi-layer": ("EAGLE", "v2", 3, 1, 4),  # sglang's multi-layer EAGLE worker
}
# flags that belong to a speculative mode's settings (the rest are every server's)
_MODE_FLAGS = (
    "--speculative",
    "--disable-overlap-schedule",
    "--disable-radix-cache",
    "--disable-cuda-graph",
    "--page-size",
)


def _flag_values(argv):
    """``{flag: [values]}`` of a launch_server command line."""
    out, flag = {}, None
    for a in argv:
        if a.startswith("--"):
            flag = a
            out[flag] = []
        else:
            out[flag].append(a)
    return out


@pytest.fixture(scope="module")
def spec_dirs(tmp_path_factory):
    """Each target's dir (``{model: dir}``: Qwen3-0.6B's shapes, NEXTN's DeepSeek-V3 MTP model)
    and each mode's draft dir, or None, as the benchmarks write them."""
    root = tmp_path_factory.mktemp("spec")
    targets = {}
    for model in {common.DEFAULT_MODEL, *common.SPECULATIVE_MODELS.values()}:
        (root / model).mkdir()
        (root / model / "config.json").write_text(json.dumps(common.MODELS[model]))
        targets[model] = str(root / model)
    drafts = {m: common.write_speculative_files(m, str(root / m)) for m in common.SPECULATIVE}
    return targets, drafts


def _target(spec_dirs, mode):
    return spec_dirs[0][common.SPECULATIVE_MODELS.get(mode, common.DEFAULT_MODEL)]


def _draft_path(spec_dirs, mode):
    """Where mode's server reads its draft: the draft dir written for it, NEXTN the target's."""
    if mode in common.SPECULATIVE_DRAFT_IN_TARGET:
        return _target(spec_dirs, mode)
    return spec_dirs[1][mode]


def _mode_kwargs(spec_dirs, mode, config="raise"):
    """One interleaved server's engine kwargs for ``mode`` and canary ``config``."""
    settings = bi.EngineSettings(speculative=mode, max_total_tokens=50000, cuda_graph_bs=(1, 32))
    kw = settings.engine_kwargs(_target(spec_dirs, mode), smoke=False, draft_dir=spec_dirs[1][mode])
    return bi.server_kwargs(kw, bi.CONFIG_TABLE[config], mem_fraction=0.2, idle="spin")


@pytest.mark.parametrize("mode", list(SPEC_FLAGS))
def test_each_speculative_mode_becomes_its_launch_server_flags(spec_dirs, mode):
    """A mode's settings reach the server's command line as the GPU suite's servers of that
    mode run; the draft's path exactly where the mode has a draft model (NEXTN's: the
    target's own directory)."""
    assert set(SPEC_FLAGS) == set(common.SPECULATIVE)
    draft = _draft_path(spec_dirs, mode)
    flags = _flag_values(engine_kwargs_to_argv(_mode_kwargs(spec_dirs, mode)))
    want = {k: [v.replace("{draft}", str(draft)) for v in vs] for k, vs in SPEC_FLAGS[mode].items()}
    if draft is not None:
        want["--speculative-draft-model-path"] = [draft]
    got = {k: v for k, v in flags.items() if k.startswith(_MODE_FLAGS)}
    assert got == want
    assert flags["--kv-canary"] == ["raise"]
    assert (draft is None) == (
        common.SPECULATIVE_DRAFT_CONFIGS[mode] is None
        and mode not in common.SPECULATIVE_DRAFT_IN_TARGET
    )


@pytest.fixture
def sglang_parsers(monkeypatch):
    """sglang's own parsers with this project's plugin loaded (as launch_server and Engine
    load it), each server argument resolved as on a GPU machine."""
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    for name in [n for n in os.environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    return prepare_server_args, ServerArgs


@pytest.mark.parametrize("mode", list(SPEC_RESOLVED))
@pytest.mark.parametrize("config", ["off", "raise"])
def test_sglang_and_the_canary_accept_each_speculative_mode_as_launched(
    spec_dirs, sglang_parsers, mode, config
):
    """Each mode's server, as bench_interleaved.py launches it (launch_server's command line)
    and as bench_serving_overhead.py starts it (``Engine`` kwargs), parsed by sglang 0.5.12
    with the plugin's start-up checks (``--device cuda``, as on the GPU): the algorithm, spec
    version, steps, topk and draft tokens sglang resolves it to; adaptive kept on with its
    candidate step counts (sglang turns it off where unsupported); page size 1; the radix cache
    off for STANDALONE and multi-layer EAGLE only; multi-layer EAGLE turned on by sglang for
    the Step-3.5 target alone, without CUDA graphs; the canary accepted in raise mode."""
    from sglang.srt.kv_canary.sglang_seam.server_args import speculative_facts

    prepare_server_args, ServerArgs = sglang_parsers
    assert set(SPEC_RESOLVED) == set(common.SPECULATIVE)
    kw = _mode_kwargs(spec_dirs, mode, config)
    for sa in (
        prepare_server_args(launch_server_flags(12345, kw) + ["--device", "cuda"]),
        ServerArgs(**{**kw, "device": "cuda"}),
    ):
        got = (
            sa.speculative_algorithm,
            "v1" if sa.disable_overlap_schedule else "v2",
            sa.speculative_num_steps,
            sa.speculative_eagle_topk,
            sa.speculative_num_draft_tokens,
        )
        assert got == SPEC_RESOLVED[mode]
        assert sa.speculative_draft_model_path == _draft_path(spec_dirs, mode)
        assert sa.speculative_adaptive == (mode == "adaptive")
        steps = speculative_facts(sa).step_counts
        assert steps == ((1, 2, 3, 4) if mode == "adaptive" else (sa.speculative_num_steps or 0,))
        assert sa.page_size == 1
        assert sa.disable_radix_cache == (mode in ("standalone", "multi-layer"))
        assert sa.enable_multi_layer_eagle == sa.disable_cuda_graph == (mode == "multi-layer")
        assert sa.kv_canary == ("none" if config == "off" else "raise")


# each draft model as sglang 0.5.12 reads it: (architecture, its class's module, layers)
DRAFT_MODELS = {
    "eagle": ("LlamaForCausalLMEagle", "sglang.srt.models.llama_eagle", 1),
    "eagle-tree": ("LlamaForCausalLMEagle", "sglang.srt.models.llama_eagle", 1),
    "adaptive": ("LlamaForCausalLMEagle", "sglang.srt.models.llama_eagle", 1),
    "eagle3": ("LlamaForCausalLMEagle3", "sglang.srt.models.llama_eagle3", 1),
    "standalone": ("Qwen3ForCausalLM", "sglang.srt.models.qwen3", 2),
    "dflash": ("DFlashDraftModel", "sglang.srt.models.dflash", 1),
}


@pytest.fixture(scope="module")
def sglang_models(spec_dirs):
    """sglang's model config of the target and of each draft (``is_draft_model``, as the draft
    worker builds it) and the class sglang's registry picks for each."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.registry import ModelRegistry

    def load(path, draft):
        config = ModelConfig(path, dtype="bfloat16", is_draft_model=draft)
        return config, ModelRegistry.resolve_model_cls(config.hf_config.architectures)[0]

    targets, drafts = spec_dirs
    return load(targets[common.DEFAULT_MODEL], False), {
        m: load(d, True) for m, d in drafts.items() if d is not None
    }


@pytest.mark.parametrize("mode", list(DRAFT_MODELS))
def test_each_draft_config_is_read_by_sglang_as_its_mode_needs(spec_dirs, sglang_models, mode):
    """Each mode's draft ``config.json`` through sglang's own config loader and model
    registry: the architecture and class sglang picks, the target's hidden size, heads and
    vocabulary; EAGLE3's aux layers as the target runner reads them (``eagle_config``) and
    DFLASH's ``dflash_config`` as sglang parses it, each captured target layer below the last
    (Qwen3 captures "before layer id + 1"), which the Qwen3 target can capture; DFLASH's block
    size the mode's draft tokens and its mask token inside the vocabulary; adaptive's step
    counts as sglang's controller reads its config file."""
    (target, target_cls), drafts = sglang_models
    assert set(DRAFT_MODELS) == {
        m
        for m, c in common.SPECULATIVE_DRAFT_CONFIGS.items()
        if c and common.SPECULATIVE_MODELS[m] == common.DEFAULT_MODEL
    }
    assert target_cls.__name__ == "Qwen3ForCausalLM"
    config, cls = drafts[mode]
    hf, layers = config.hf_config, target.hf_config.num_hidden_layers
    arch, module, n = DRAFT_MODELS[mode]
    assert (hf.architectures, cls.__name__, cls.__module__) == ([arch], arch, module)
    assert hf.num_hidden_layers == n
    assert (hf.hidden_size, hf.vocab_size) == (1024, target.hf_config.vocab_size)
    assert (config.num_attention_heads, config.get_total_num_kv_heads(), config.head_dim) == (
        16,
        8,
        128,
    )
    if mode == "eagle3":
        # what ModelRunner reads from the draft's config for the target's capture
        assert hf.eagle_config["use_aux_hidden_state"] is True
        ids = hf.eagle_config["eagle_aux_hidden_state_layer_ids"]
        assert len(ids) == 3 and all(0 <= i and i + 1 < layers for i in ids), ids
        assert hf.draft_vocab_size == hf.vocab_size
        assert callable(getattr(target_cls, "set_eagle3_layers_to_capture", None))
    if mode == "dflash":
        from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

        parsed = parse_dflash_draft_config(draft_hf_config=hf)
        ids = parsed.resolve_target_layer_ids(target_num_layers=layers, draft_num_layers=n)
        assert len(ids) >= 1 and all(0 <= i and i + 1 < layers for i in ids), ids
        assert parsed.block_size == common.SPECULATIVE[mode]["speculative_num_draft_tokens"]
        assert 0 <= parsed.mask_token_id < target.hf_config.vocab_size
        assert parsed.num_target_layers == layers
        assert callable(getattr(target_cls, "set_dflash_layers_to_capture", None))
    if mode == "adaptive":
        from sglang.srt.speculative.adaptive_spec_params import (
            AdaptiveSpeculativeParams,
            load_adaptive_config,
        )

        path = os.path.join(spec_dirs[1][mode], common.ADAPTIVE_CONFIG_FILE)
        params = AdaptiveSpeculativeParams(3, load_adaptive_config(path))
        assert params.candidate_steps == [1, 2, 3, 4]
    else:
        assert os.listdir(spec_dirs[1][mode]) == ["config.json"]


@pytest.mark.slow
def test_smoke_run_on_cpu_servers_with_the_aa_control(tmp_path):
    """The baseline with its A/A control and an ``up:`` server whose upstream site is a
    stand-in (an empty directory: the machine's sglang 0.5.12 runs there, with this project
    kept out by the isolation folder); ``--isolate``: the servers paused between their
    requests; ``--start together``: the three launched at once, their KV pools equal;
    ``--osl``: the decode scenario's outputs that long; ``--repeat 2``: two requests per server
    and round. (A canary-on server's install check: the refusal table above; a canary-on config
    is served like the baseline, with its flags: ``test_engine_kwargs_become_launch_server_flags``.)"""
    out = tmp_path / "i.jsonl"
    stand_in = tmp_path / "upstream_site"
    stand_in.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "bench_interleaved.py"),
            "--smoke-cpu",
            "--configs",
            "off,up:off",
            "--upstream-site",
            str(stand_in),
            "--scenarios",
            "prefill_bs1_512,decode_bs1",
            "--osl",
            "5",
            "--start",
            "together",
            "--repeat",
            "2",
            "--rounds",
            "2",
            "--warmup",
            "1",
            "--start-rotation",
            "1",
            "--idle",
            "sleep",
            "--isolate",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [
        (r["scenario"], r["osl"], r["server_name"], r["config"], r["control"], r["baseline"])
        for r in recs
    ] == [
        (scenario, osl, *server)
        for scenario, osl in (("prefill_bs1_512", 1), ("decode_bs1", 5))
        for server in (
            ("off", "off", False, "off"),
            ("up:off", "up:off", False, "up:off"),
            ("off~aa", "off", True, "off"),
        )
    ]
    assert [r["stack"] for r in recs[:3]] == ["project", "upstream", "project"]
    # launched together, each pool held to the same size (the run refuses unequal ones)
    assert all(r["start"] == "together" for r in recs) and "started together" in proc.stdout
    assert all(r["repeat"] == 2 for r in recs)
    assert len({r["max_total_num_tokens"] for r in recs}) == 1
    assert recs[0]["max_total_num_tokens"] > 0
    # each server's sglang; this project's plugin answered on its servers only
    assert all(r["version"] for r in recs)
    assert [r["kv_canary_info"] for r in recs] == [True, False, True] * 2
    assert {r["kind"] for r in recs} == {"interleaved"} and len(
        {r["invocation"] for r in recs}
    ) == 1
    # started in the order rotated by one: the upstream stand-in first
    assert all(r["start_order"] == ["up:off", "off~aa", "off"] for r in recs)
    # every server slept on idle as told (three spinning servers would hold CI's two cores)
    assert all(r["idle"] == "sleep" for r in recs) and "idle schedulers: sleep" in proc.stdout
    # each request went to the one server not paused (SIGSTOP), and every server, paused
    # between its requests, answered the next round and stopped cleanly
    assert all(r["isolate"] for r in recs)
    assert "every other server paused during a request" in proc.stdout
    for r in recs:
        assert r["rounds"] == 2 and len(r["wall_runs_ms"]) == 2 and r["mismatched_rounds"] == 0
        assert len(r["server_runs_ms"]) == 2 and all(t > 0 for t in r["server_runs_ms"])
    for k in (0, 3):  # each scenario's baselines, then its A/A control
        assert "wall_overhead" not in recs[k] and "wall_overhead" not in recs[k + 1]
        assert len(recs[k + 2]["wall_overhead"]) == 3 and len(recs[k + 2]["server_overhead"]) == 3
    assert "| prefill_bs1_512 (bs1 isl16 osl1) | up:off | 2 |" in proc.stdout
    assert "| prefill_bs1_512 (bs1 isl16 osl1) | off (A/A control) | 2 |" in proc.stdout
    assert "| decode_bs1 (bs1 isl16 osl5) | off (A/A control) | 2 |" in proc.stdout
    # each server was a canary-off launch_server, and is gone (its port closed)
    for name in ("off", "off_aa", "up_off"):
        assert "kv_canary installed" not in (tmp_path / f"i.jsonl.{name}.log").read_text()
    for port in {r["port"] for r in recs}:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_pd_overhead_is_paired_per_round_and_resolved_only_by_a_quiet_twin():
    """``bench_pd_overhead.py``'s verdict: each pair's overhead is the median of its per-round
    ratios to the baseline (a drift shared by every pair in a round cancels), a round without
    a decode figure leaves that metric unmeasured, and the table says whether the A/A twin
    lies within the limit."""
    drift = [1.0, 1.5, 0.8, 1.2, 1.1, 0.9, 1.3]  # the machine's state, round by round

    def series(ttft, decode):
        return {"ttft": ttft, "ttft_server": [t / 2 for t in ttft], "decode": decode}

    times = {
        "off": series([10 * d for d in drift], [100 * d for d in drift]),
        "raise": series([10.5 * d for d in drift], [101 * d for d in drift]),
        "off~aa": series([10 * d for d in drift], [100 * d for d in drift]),
        "gap": series([10 * d for d in drift], [None] + [100.0] * 6),
    }
    result = pdo.overheads(times, "off")
    assert set(result) == {"raise", "off~aa", "gap"}
    assert result["raise"]["ttft"]["median"] == pytest.approx(0.05)
    assert result["raise"]["ttft_server"]["median"] == pytest.approx(0.05)
    assert result["raise"]["decode"]["median"] == pytest.approx(0.01)
    assert result["raise"]["ttft"]["lo"] == pytest.approx(0.05)  # no spread: a point interval
    assert result["off~aa"]["decode"]["median"] == pytest.approx(0.0)
    assert result["gap"]["decode"] is None
    text = pdo.table(result, "off", "off~aa")
    assert "A/A twin within" in text
    assert "| raise | +5.00 % [+5.00, +5.00] | +5.00 % [+5.00, +5.00] | +1.00 % [" in text
    times["off~aa"]["ttft"] = [10.5 * d for d in drift]
    assert "A/A twin NOT within" in pdo.table(pdo.overheads(times, "off"), "off", "off~aa")


def test_pd_rounds_read_the_decode_servers_timing_from_its_answer():
    """A round's figures come from what ``pd_request`` returns: the decode server's
    ``meta_info`` (``--enable-metrics``: ``e2e_latency`` and ``decode_throughput``) travels
    with its answer; without those figures a round has no decode or server TTFT value."""
    from sglang.srt.kv_canary.demo.pd_pair import pd_request

    meta = {"completion_tokens": 65, "decode_throughput": 640.0, "e2e_latency": 0.130}

    def http_call(port, method, path, body, timeout):
        answer = {"output_ids": [5] * 65, "meta_info": meta if port == 2 else {}}
        return 200, json.dumps(answer).encode()

    full = pd_request(http_call, 1, 2, 3, [7, 8, 9], 65, 5.0)
    assert full["meta_info"] == meta
    figures = pdo.round_figures(12.5, full)
    assert figures["ttft"] == 12.5
    assert figures["decode"] == pytest.approx(100.0)  # 64 tokens at 640 per second
    assert figures["ttft_server"] == pytest.approx(30.0)  # 130 ms less the decode
    assert pdo.round_figures(12.5, {"output_ids": [5]}) == {
        "ttft": 12.5,
        "ttft_server": None,
        "decode": None,
    }


def test_the_nextn_target_and_its_mtp_draft_are_read_by_sglang_as_the_mode_needs(spec_dirs):
    """``--speculative nextn``'s target (``--model deepseek-v3-mtp``) through sglang's own
    config loader and registry: ``DeepseekV3ForCausalLM``, MLA with DeepSeek-V3's head
    dimensions, 28 layers of hidden 1024, one MTP layer; the same directory read as the draft
    (``is_draft_model``, as the NEXTN draft worker reads it) is ``DeepseekV3ForCausalLMNextN``,
    MLA; the vocabulary Qwen3's (the benchmarks' token ids)."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.models.registry import ModelRegistry

    path = _target(spec_dirs, "nextn")
    assert common.SPECULATIVE_MODELS["nextn"] == "deepseek-v3-mtp"
    for draft, arch in ((False, "DeepseekV3ForCausalLM"), (True, "DeepseekV3ForCausalLMNextN")):
        config = ModelConfig(path, dtype="bfloat16", is_draft_model=draft)
        cls = ModelRegistry.resolve_model_cls(config.hf_config.architectures)[0]
        assert (config.hf_config.architectures, cls.__name__) == ([arch], arch)
        assert config.attention_arch == AttentionArch.MLA
        assert (config.kv_lora_rank, config.qk_rope_head_dim) == (512, 64)
        # the draft keeps the target's count (its one layer is built at layer_id 28)
        assert config.num_hidden_layers == 28 and config.hidden_size == 1024
        assert config.hf_config.num_nextn_predict_layers == 1
        assert config.vocab_size == common.QWEN3_0_6B_CONFIG["vocab_size"]
    assert common.write_speculative_files("nextn", "/nonexistent") is None


def test_the_frozen_kv_mtp_pair_is_read_by_sglang_as_the_mode_needs(spec_dirs):
    """``--speculative frozen-kv-mtp``'s pair through sglang's own config loader and registry:
    the assistant's architecture promotes EAGLE to FROZEN_KV_MTP; the target (``--model
    gemma4-mtp``) is ``Gemma4ForCausalLM``, hybrid SWA (sliding even layers, full odd ones,
    the window 1024), 16 heads and 8 KV heads of 128, hidden 1024, its last two layers
    KV-shared; the assistant (``is_draft_model``) is ``Gemma4AssistantForCausalLM`` with one
    sliding and one full layer of the target's heads, its ``backbone_hidden_size`` the
    target's hidden size; the vocabulary Qwen3's (the benchmarks' token ids)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import _resolve_speculative_algorithm_alias

    target_dir, draft_dir = _target(spec_dirs, "frozen-kv-mtp"), spec_dirs[1]["frozen-kv-mtp"]
    assert _resolve_speculative_algorithm_alias("EAGLE", draft_dir) == "FROZEN_KV_MTP"
    target = ModelConfig(target_dir, dtype="bfloat16")
    text = target.hf_text_config
    cls = ModelRegistry.resolve_model_cls(target.hf_config.architectures)[0]
    assert (target.hf_config.architectures, cls.__name__) == (
        ["Gemma4ForCausalLM"],
        "Gemma4ForCausalLM",
    )
    assert target.is_hybrid_swa
    assert target.swa_attention_layer_ids == list(range(0, 28, 2))
    assert target.full_attention_layer_ids == list(range(1, 28, 2))
    assert (text.num_kv_shared_layers, text.sliding_window) == (2, 1024)
    assert (text.swa_num_key_value_heads, text.swa_head_dim, text.swa_v_head_dim) == (8, 128, 128)
    assert (target.head_dim, target.get_total_num_kv_heads(), text.hidden_size) == (128, 8, 1024)
    assert target.vocab_size == common.QWEN3_0_6B_CONFIG["vocab_size"]
    draft = ModelConfig(draft_dir, dtype="bfloat16", is_draft_model=True)
    cls = ModelRegistry.resolve_model_cls(draft.hf_config.architectures)[0]
    assert cls.__name__ == "Gemma4AssistantForCausalLM"
    assert draft.hf_config.backbone_hidden_size == text.hidden_size
    assert draft.hf_text_config.layer_types == ["sliding_attention", "full_attention"]
    assert (draft.head_dim, draft.swa_head_dim, draft.get_total_num_kv_heads()) == (128, 128, 8)


def test_the_multi_layer_target_and_its_mtp_drafts_are_read_by_sglang_as_the_mode_needs(spec_dirs):
    """``--speculative multi-layer``'s target (``--model step3p5-mtp``) through sglang's own
    config loader and registry: ``Step3p5ForCausalLM``, hybrid SWA (every fourth of its 45
    layers full attention, the window 512), 16 heads in 8 groups of 128, hidden 1024, three
    MTP layers; the same directory read as a draft (``is_draft_model``, as each MTP runner
    reads it) is ``Step3p5MTP``, whose one-layer pool sglang makes a sliding-window layer with
    no full one (the pool the canary's SWA adapter takes with its window group alone); the
    vocabulary Qwen3's (the benchmarks' token ids)."""
    from sglang.srt.configs.model_config import ModelConfig, get_hybrid_layer_ids
    from sglang.srt.models.registry import ModelRegistry

    path = _target(spec_dirs, "multi-layer")
    assert common.SPECULATIVE_MODELS["multi-layer"] == "step3p5-mtp"
    target = ModelConfig(path, dtype="bfloat16")
    cls = ModelRegistry.resolve_model_cls(target.hf_config.architectures)[0]
    assert cls.__name__ == "Step3p5ForCausalLM" and target.is_hybrid_swa
    assert target.full_attention_layer_ids == list(range(3, 45, 4))
    assert target.hf_config.sliding_window == 512
    assert (target.num_hidden_layers, target.hidden_size, target.head_dim) == (45, 1024, 128)
    assert (target.num_attention_heads, target.get_total_num_kv_heads()) == (16, 8)
    assert target.hf_config.num_nextn_predict_layers == 3
    assert target.vocab_size == common.QWEN3_0_6B_CONFIG["vocab_size"]
    draft = ModelConfig(path, dtype="bfloat16", is_draft_model=True)
    cls = ModelRegistry.resolve_model_cls(draft.hf_config.architectures)[0]
    assert cls.__name__ == "Step3p5MTP"
    assert get_hybrid_layer_ids(draft.hf_config.architectures, draft.hf_config) == ([0], [])
    assert common.write_speculative_files("multi-layer", "/nonexistent") is None


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def _fake_tools(tmp_path, gpus):
    """A PATH dir with an ``nvidia-smi`` listing ``gpus`` and a ``python3`` that logs each call
    (``CUDA_VISIBLE_DEVICES`` and argv, one JSON line) and writes its ``--out`` file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.jsonl"
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + "".join(f"echo {g}\n" for g in gpus))
    (bin_dir / "python3").write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(calls)!r}, 'a') as f:\n"
        "    f.write(json.dumps([os.environ.get('CUDA_VISIBLE_DEVICES'), sys.argv[1:]]) + '\\n')\n"
        "if '--out' in sys.argv:\n"
        "    open(sys.argv[sys.argv.index('--out') + 1], 'w').close()\n"
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir, calls


@pytest.mark.parametrize(
    "scenarios, osl",
    [(None, None), ("decode_bs32", None), ("decode_bs1,decode_bs32", None), ("decode_bs32", "512")],
)
def test_speculative_overhead_all_deals_modes_over_gpus(tmp_path, scenarios, osl):
    """``speculative_overhead_all.sh``: one mode at a time per GPU, the modes dealt in turn;
    each mode's run gets ROUNDS, START, SCENARIOS (default bs 1 and bs 32), ``--isolate`` and
    ``--osl OSL`` (unset: none, but ``--osl 256`` for multi-layer); then one report of every
    record."""
    bin_dir, calls = _fake_tools(tmp_path, ["0", "1"])
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ROUNDS": "3"}
    env.pop("SCENARIOS", None)
    env.pop("OSL", None)
    if scenarios:
        env["SCENARIOS"] = scenarios
    if osl:
        env["OSL"] = osl
    out = tmp_path / "out"
    modes = ["eagle", "nextn", "multi-layer"]
    script = BENCH_DIR / "speculative_overhead_all.sh"
    res = subprocess.run(
        ["bash", str(script), str(out), *modes], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    runs = [json.loads(line) for line in calls.read_text().splitlines()]
    report = [argv for _, argv in runs if "--report" in argv]
    bench = {
        argv[argv.index("--speculative") + 1]: (gpu, argv)
        for gpu, argv in runs
        if "--speculative" in argv
    }
    assert sorted(bench) == sorted(modes) and len(report) == 1
    assert {m: gpu for m, (gpu, _) in bench.items()} == {
        "eagle": "0",
        "nextn": "1",
        "multi-layer": "0",
    }
    for mode, (_, argv) in bench.items():
        opts = dict(zip(argv, argv[1:]))
        assert opts["--scenarios"] == (scenarios or "decode_bs1,decode_bs32")
        assert (opts["--rounds"], opts["--start"]) == ("3", "together")
        assert "--isolate" in argv
        assert opts.get("--osl") == (osl or ("256" if mode == "multi-layer" else None))
        assert opts["--out"] == str(out / f"spec_{mode}.jsonl")
    assert sorted(report[0][2:]) == sorted(str(out / f"spec_{m}.jsonl") for m in modes)
    assert [f"speculative_overhead: {m} on GPU" in res.stdout for m in modes] == [True] * 3


@pytest.mark.parametrize(
    "var, value, message",
    [
        ("SCENARIOS", "decode_bs64", "decode_bs64 is not one of decode_bs1, decode_bs32"),
        ("SCENARIOS", "decode_bs1,,decode_bs32", "a comma-separated list"),
        ("ROUNDS", "0", "ROUNDS=0: a whole number above 0"),
        ("START", "staggered", "START=staggered: allowed serial, together"),
        ("OSL", "0", "OSL=0: a whole number above 0"),
        ("OSL", "512t", "OSL=512t: a whole number above 0"),
    ],
)
def test_speculative_overhead_all_refuses_bad_settings(tmp_path, var, value, message):
    bin_dir, calls = _fake_tools(tmp_path, ["0"])
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", var: value}
    script = BENCH_DIR / "speculative_overhead_all.sh"
    res = subprocess.run(
        ["bash", str(script), str(tmp_path / "out"), "eagle"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and message in res.stderr
    assert not calls.exists()  # refused before any run


# latency_table.sh: each part's scenarios and configs (the latency targets, latency_h200.md)
LATENCY_PARTS = {
    "prefill": ("prefill_bs1_512,prefill_bs1_4k,prefill_bs1_16k", "off,raise,raise+token+partial"),
    "prefill-bs32": ("prefill_bs32", "off,raise,raise+token+partial"),
    "decode": (
        "decode_bs1,decode_bs32,decode_bs128",
        "off,raise,raise+token+partial,off+sidekernel",
    ),
    "eagle": ("decode_bs1,decode_bs32", "off,raise,raise+token+partial"),
}


def _checked_latency_run(argv):
    """One run's arguments as ``bench_interleaved.py`` reads them, its names checked as
    ``run`` checks them before any server starts (a typo fails here, not on the device)."""
    args = bi.build_parser().parse_args(argv)
    configs = common.parse_names(args.configs, bi.CONFIG_TABLE, "--configs")
    scenarios = common.parse_names(args.scenarios, bi.SCENARIOS, "--scenarios")
    model = common.speculative_model(args.speculative, args.model)
    assert common.speculative_model_problem(args.speculative, model) is None
    assert args.baseline == "off" and args.baseline in configs and args.control
    assert args.isolate and args.start == "together"
    return args, configs, scenarios


@pytest.mark.parametrize("num_gpus", [1, 2])
def test_latency_table_runs_every_target_scenario_paired_with_its_control(tmp_path, num_gpus):
    """``latency_table.sh``: the four parts (prefill bs 1 with --repeat, prefill bs 32, decode
    with the side-kernel baseline too, EAGLE decode) dealt over the GPUs in turn, every run
    isolated, started together, against off with its A/A twin; ROUNDS / REPEAT / OSL / WARMUP
    passed on; then one report of every record."""
    gpus = [str(g) for g in range(num_gpus)]
    bin_dir, calls = _fake_tools(tmp_path, gpus)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.update(ROUNDS="7", REPEAT="3", OSL="128", WARMUP="0")
    out = tmp_path / "out"
    script = BENCH_DIR / "latency_table.sh"
    res = subprocess.run(["bash", str(script), str(out)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    runs = [json.loads(line) for line in calls.read_text().splitlines()]
    report = [argv for _, argv in runs if "--report" in argv]
    bench = {}
    for gpu, argv in runs:
        if "--report" in argv:
            continue
        assert argv[0] == str(BENCH_DIR / "bench_interleaved.py")
        args, configs, scenarios = _checked_latency_run(argv[1:])
        part = pathlib.Path(args.out).name.removeprefix("latency_").removesuffix(".jsonl")
        bench[part] = (gpu, args, configs, scenarios)
    assert sorted(bench) == sorted(LATENCY_PARTS)
    order = list(LATENCY_PARTS)
    for part, (gpu, args, configs, scenarios) in bench.items():
        want_scenarios, want_configs = LATENCY_PARTS[part]
        assert (",".join(scenarios), ",".join(configs)) == (want_scenarios, want_configs), part
        assert gpu == gpus[order.index(part) % num_gpus], part
        assert (args.rounds, args.warmup) == (7, 0)
        assert args.repeat == (3 if part == "prefill" else 1), part
        assert args.osl == (128 if part in ("decode", "eagle") else None), part
        assert args.speculative == ("eagle" if part == "eagle" else "none"), part
        assert args.out == str(out / f"latency_{part}.jsonl")
    assert len(report) == 1
    assert sorted(report[0][2:]) == sorted(str(out / f"latency_{p}.jsonl") for p in LATENCY_PARTS)
    assert [f"latency_table: {p} on GPU" in res.stdout for p in LATENCY_PARTS] == [True] * 4


def test_latency_table_runs_only_the_parts_named(tmp_path):
    bin_dir, calls = _fake_tools(tmp_path, ["0"])
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for var in ("ROUNDS", "REPEAT", "OSL", "WARMUP"):
        env.pop(var, None)
    script = BENCH_DIR / "latency_table.sh"
    res = subprocess.run(
        ["bash", str(script), str(tmp_path / "out"), "decode"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    runs = [argv for _, argv in map(json.loads, calls.read_text().splitlines())]
    assert len(runs) == 2 and "--report" in runs[1]
    args, _, _ = _checked_latency_run(runs[0][1:])
    # the defaults: 30 rounds after 2 warm-up rounds, 256-token decodes
    assert (args.rounds, args.warmup, args.osl, args.repeat) == (30, 2, 256, 1)


@pytest.mark.parametrize(
    "var, value, message",
    [
        ("ROUNDS", "0", "ROUNDS=0: a whole number above 0"),
        ("REPEAT", "five", "REPEAT=five: a whole number above 0"),
        ("OSL", "256t", "OSL=256t: a whole number above 0"),
        ("WARMUP", "-1", "WARMUP=-1: a whole number (0: none)"),
        ("PART", "prefill_bs1_512", "part prefill_bs1_512: allowed prefill, prefill-bs32, decode"),
    ],
)
def test_latency_table_refuses_bad_settings(tmp_path, var, value, message):
    bin_dir, calls = _fake_tools(tmp_path, ["0"])
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    parts = [value] if var == "PART" else []
    if var != "PART":
        env[var] = value
    script = BENCH_DIR / "latency_table.sh"
    res = subprocess.run(
        ["bash", str(script), str(tmp_path / "out"), *parts],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not calls.exists()  # refused before any run


@pytest.mark.parametrize("script", ["latency_table.sh", "speculative_overhead_all.sh"])
def test_gpu_drivers_stop_when_no_gpu_is_listed(tmp_path, script):
    """``gpu_deal.sh``'s ``deal_over_gpus``: no GPU listed by nvidia-smi -> exit 1, nothing run."""
    bin_dir, calls = _fake_tools(tmp_path, [])
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for var in ("ROUNDS", "REPEAT", "OSL", "WARMUP", "SCENARIOS", "START"):
        env.pop(var, None)
    res = subprocess.run(
        ["bash", str(BENCH_DIR / script), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1 and "no GPU (nvidia-smi lists none)" in res.stderr, res.stderr
    assert not calls.exists()
