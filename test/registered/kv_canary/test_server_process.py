"""``sglang.srt.kv_canary.demo.server_process.ServerProcess``, the one start / wait / stop of
an HTTP server process that the CLI test servers (``cli_server.CliServer``), the interleaved
benchmark and the demo's PD pair share, on stand-in servers (a few lines of ``http.server``)
instead of sglang: ready when ``/health_generate`` answers 200, a clear error with the log's
tail when the process dies or never gets ready, and ``stop()`` leaves nothing of its process
group behind."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import time

import pytest

from sglang.srt.kv_canary.demo.server_harness import free_port
from canary_support.script_run import load_support_script
from sglang.srt.kv_canary.demo.server_process import ServerProcess, ServerStartError
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")

# A stand-in server: answers ``status`` to every GET, after forking a child that would outlive
# it if only the parent were signalled.
_STAND_IN = textwrap.dedent("""
    import http.server, os, sys, time
    status = int(sys.argv[2])
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(f"child {child}", flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.end_headers()
        def log_message(self, *a):
            pass
    print("stand-in up", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _stand_in(tmp_path, status: int) -> ServerProcess:
    port = free_port()
    return ServerProcess(
        "stand-in",
        [sys.executable, "-c", _STAND_IN, str(port), str(status)],
        port=port,
        env=dict(os.environ),
        log_path=tmp_path / "s.log",
    )


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed orphan waits for its reaper)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone_soon(pid: int, timeout: float = 10.0) -> bool:
    """``pid`` stops running within ``timeout`` s (a signal is delivered, and a process torn
    down, asynchronously: right after ``stop()`` a killed child can still be exiting)."""
    deadline = time.monotonic() + timeout
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _forked_child(srv: ServerProcess) -> int:
    pids = [int(line.split()[1]) for line in srv.log().splitlines() if line.startswith("child ")]
    assert len(pids) == 1, srv.log()
    return pids[0]


def test_ready_server_is_waited_for_and_stop_ends_its_whole_group(tmp_path):
    srv = _stand_in(tmp_path, 200)
    try:
        srv.wait_ready(60)
        assert srv.alive() and "stand-in up" in srv.log()
        child = _forked_child(srv)
        assert _running(child)
    finally:
        srv.stop()
    assert not srv.alive()
    assert _gone_soon(child)  # the forked child went with it
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=5).close()


def test_a_server_that_exits_during_start_up_is_reported_with_its_log(tmp_path):
    srv = ServerProcess(
        "doomed",
        [sys.executable, "-c", "print('bad flag --kv-canary', flush=True); raise SystemExit(3)"],
        port=free_port(),
        env=dict(os.environ),
        log_path=tmp_path / "d.log",
    )
    try:
        with pytest.raises(
            ServerStartError,
            match=r"doomed server exited \(3\) during "
            r"start-up:\n.*bad flag --kv-canary",
        ):
            srv.wait_ready(60)
    finally:
        srv.stop()


def test_a_server_that_never_gets_healthy_times_out_with_its_log(tmp_path):
    srv = _stand_in(tmp_path, 503)
    try:
        with pytest.raises(
            ServerStartError,
            match=r"(?s)stand-in server not ready after 3 s:\n"
            r".*stand-in up",
        ):
            srv.wait_ready(3)
        assert srv.alive()
        child = _forked_child(srv)
    finally:
        srv.stop()
    assert not srv.alive() and _gone_soon(child)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_every_test_server_gets_its_own_ports_outside_the_ephemeral_range(tmp_path):
    """A test server's ports (HTTP, ``nccl_port``) come from below the kernel's ephemeral range,
    where no outgoing connection is given one between the pick and sglang's bind; each set of
    engine kwargs names its own ``nccl_port`` (sglang's default is an ephemeral one)."""
    from sglang.srt.kv_canary.demo.server_harness import cpu_engine_kwargs, gpu_engine_kwargs

    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[:2])

    def allowed(p: int) -> bool:
        return 20000 <= p < 55000 and not low <= p <= high

    ports = [free_port() for _ in range(50)]
    assert all(allowed(p) for p in ports), ports
    picked = [
        make(str(tmp_path))["nccl_port"]
        for make in (cpu_engine_kwargs, gpu_engine_kwargs)
        for _ in range(10)
    ]
    assert all(allowed(p) for p in picked), picked
    assert len(set(picked)) > 1, picked
    assert cpu_engine_kwargs(str(tmp_path), nccl_port=12345)["nccl_port"] == 12345


def test_free_port_keeps_out_of_any_ephemeral_range(tmp_path, monkeypatch):
    """Whatever range the kernel hands outgoing connections, the pick stays outside it (above
    it when it starts below 20000), and a range covering all of [20000, 55000) is an error
    naming it, not a silent pick inside it."""
    from sglang.srt.kv_canary.demo import server_harness

    ranges = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(server_harness, "_PORT_RANGE_FILE", ranges)
    ranges.write_text("10000\t40000\n")
    assert all(40001 <= free_port() < 55000 for _ in range(30))
    ranges.write_text("30000 50000\n")
    ports = [free_port() for _ in range(60)]
    assert all(20000 <= p < 30000 or 50001 <= p < 55000 for p in ports), ports
    ranges.write_text("1024 65535\n")
    with pytest.raises(RuntimeError, match="outside the ephemeral range 1024-65535"):
        free_port()


def test_each_xdist_worker_picks_ports_of_its_own(monkeypatch):
    """Two pytest-xdist workers (and the servers they start, which inherit the variables)
    pick from disjoint shares of the range: worker i of n only ports congruent to i modulo
    n; outside xdist any port."""
    for worker, count in (("gw0", "2"), ("gw1", "2"), ("gw2", "3")):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
        ports = [free_port() for _ in range(40)]
        assert {p % int(count) for p in ports} == {int(worker[2:])}, (worker, ports)
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert len({p % 2 for p in (free_port() for _ in range(60))}) == 2


def test_each_gpu_lane_picks_ports_of_its_own(monkeypatch):
    """``KV_CANARY_PORT_SHARE=i/n`` (the GPU suite's lane i of n): only ports congruent to i
    modulo n, each xdist worker's share within it; a malformed value names the variable."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.setenv("KV_CANARY_PORT_SHARE", "2/5")
    assert {free_port() % 5 for _ in range(40)} == {2}
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert {free_port() % 10 for _ in range(40)} == {2 * 2 + 1}
    for bad in ("5/5", "x", "1/", "-1/3", "1/0"):
        monkeypatch.setenv("KV_CANARY_PORT_SHARE", bad)
        with pytest.raises(ValueError, match="KV_CANARY_PORT_SHARE=.*allowed 'i/n'"):
            free_port()


def test_free_port_never_returns_a_port_twice_in_one_process(monkeypatch):
    """A port is free when picked but bound only when its server starts: a plan that picks
    every server's ports first (the side-by-side runs) must not get one port twice, even when
    the random pick lands on it again."""
    from sglang.srt.kv_canary.demo import server_harness

    first = free_port()
    other = free_port()
    server_harness._HANDED_OUT.discard(other)  # handed out, then given back for the draw below
    draws = iter([first, first, other])

    class Repeating:
        def choice(self, ranges):
            return ranges[0]

        def randrange(self, a, b):
            return next(draws)

    monkeypatch.setattr(server_harness.random, "Random", Repeating)
    assert free_port() == other


def test_a_workload_scripts_command_line_is_checked_before_any_engine_starts(tmp_path):
    """The support scripts' one main: a device, engine kwargs that are not a JSON object, or a
    keyword the script sets itself is refused with the value and what is allowed, before an
    Engine starts; a good command line parses into its parts (run for real by the e2e
    suites)."""
    import json

    from canary_support.script_run import SUPPORT_DIR, run_support_script, tagged_json

    def refusal(script, *args):
        rc, out, res = run_support_script(script, *args, env=dict(os.environ), timeout=120)
        assert rc != 0 and res is None, out
        return out

    model = str(tmp_path)
    assert "device 'gpu'; allowed: cpu, cuda" in refusal("small_workload.py", model, "{}", "gpu")
    assert "must be a JSON object" in refusal("small_workload.py", model, "[1]")
    assert "['kv_canary'] are set by the script itself" in refusal(
        "abort_workload.py", model, json.dumps({"kv_canary": "raise"})
    )
    sys.path.insert(0, str(SUPPORT_DIR))
    try:
        from engine_main import parse_argv
    finally:
        sys.path.remove(str(SUPPORT_DIR))
    args = parse_argv(["w.py", model, '{"page_size": 16}', "cuda", "long"])
    assert (args.model_dir, dict(args.engine_kwargs), args.device, args.rest) == (
        model,
        {"page_size": 16},
        "cuda",
        ("long",),
    )
    assert parse_argv(["w.py", model]).device == "cpu"
    assert tagged_json("x\nINFO {\"a\": 1}\nRESULT [2]\nRESULT [3]\n", "RESULT ") == [2]


def test_a_support_script_imports_in_process_with_its_siblings():
    """A test reading a workload's prompts imports its script here, as the speculative GPU
    test does: the script's own sibling import (engine_main) resolves, sys.path is left as it
    was, and the script's main does not run."""
    path_before = list(sys.path)
    workload = load_support_script("small_workload.py")
    assert sys.path == path_before
    waves = workload.waves()
    assert [len(w) for w in waves] == [4, 4, 4]
    assert waves[0][0][:40] == waves[2][0][:40]  # the third wave repeats the first's prefix
    assert callable(workload.run) and callable(workload.main)


def test_the_mixed_workload_takes_the_canary_mode_in_one_place():
    from e2e_workload import run_mixed_workload

    with pytest.raises(ValueError, match="pass the canary's mode as `mode`"):
        run_mixed_workload("/nonexistent", "raise", {"kv_canary": "log"})
