"""Every test file is registered the way sglang's ``test/registered/`` files are
(``sglang.test.ci.ci_register``), and the GPU suite's lanes (``test/gpu_lanes.py``), derived
from the ``register_cuda_ci`` declarations, hold every ``cuda``-marked test exactly once
(docs/testing.md, "The CPU suite"). The checks run on this tree and on small planted trees that
break each rule once."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=85, suite="stage-a-test-cpu")

REPO = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "test"))
import gpu_lanes  # noqa: E402

# spelled apart: this file's own tests are CPU tests (a grep for the marker must not find one)
CUDA_MARK = "pytest.mark." + "cuda"
HEADER = "from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci\nimport pytest\n"
MAIN = '\nif __name__ == "__main__":\n    pytest.main([__file__])\n'
GPU_FILE = (
    HEADER
    + textwrap.dedent(f"""
    register_cuda_ci(est_time=20, suite="gpu")
    pytestmark = [{CUDA_MARK}]

    @pytest.mark.parametrize("x", ["a", "b"])
    def test_gpu(x):
        pass
    """)
    + MAIN
)
CPU_FILE = HEADER + 'register_cpu_ci(est_time=5, suite="cpu")\n\ndef test_cpu():\n    pass\n' + MAIN


def _tree(tmp_path, **files) -> pathlib.Path:
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    return tmp_path


def _check(test_dir: pathlib.Path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "test" / "gpu_lanes.py"),
            "--check",
            "--test-dir",
            str(test_dir),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_this_tree_every_file_registered_every_cuda_test_in_one_lane():
    rc, out = _check(gpu_lanes.TEST_DIR)
    assert rc == 0, out[-4000:]
    assert '"problems": 0' in out


def test_the_lanes_are_the_ones_the_files_declare():
    lanes = {lane.name: lane for lane in gpu_lanes.all_lanes()}
    assert lanes["hicache_mla"].select == "mla"
    assert lanes["e2e_swa_gpu"].select is None  # a file without GPU_LANES: one lane
    files = {lane.file.name for lane in lanes.values()}
    assert {"test_e2e_swa_gpu.py", "test_e2e_paged_gpu.py", "test_e2e_abort_gpu.py"} <= files


def test_gpu_lanes_sh_lists_every_lane_and_a_stale_list_is_seen():
    lanes = gpu_lanes.all_lanes()
    text = gpu_lanes.LANES_SH.read_text()
    for lane in lanes:
        assert f"#   {lane.name:<20} {lane.pytest_args()[0]}" in text, lane.name
    assert not gpu_lanes.sh_listing_stale(lanes)
    dropped = text.replace(f"#   {lanes[0].name:<20}", "#   renamed_lane", 1)
    assert gpu_lanes._sh_with_listing(dropped, gpu_lanes.sh_listing(lanes)) == text


def test_planted_good_tree_passes(tmp_path):
    rc, out = _check(_tree(tmp_path, test_g=GPU_FILE, test_c=CPU_FILE))
    assert rc == 0, out[-3000:]


def test_planted_unregistered_file_is_refused(tmp_path):
    rc, out = _check(_tree(tmp_path, test_g=GPU_FILE, test_c="def test_cpu():\n    pass\n"))
    assert rc == 1 and "No CI registry found" in out and "test_c.py" in out, out[-3000:]


def test_planted_cuda_test_without_a_cuda_registration_is_refused(tmp_path):
    text = GPU_FILE.replace(
        'register_cuda_ci(est_time=20, suite="gpu")', 'register_cpu_ci(est_time=20, suite="cpu")'
    )
    rc, out = _check(_tree(tmp_path, test_g=text))
    assert rc == 1 and "cuda test in 0 lanes" in out, out[-3000:]


def test_planted_overlapping_and_empty_lanes_are_refused(tmp_path):
    text = GPU_FILE.replace(
        'register_cuda_ci(est_time=20, suite="gpu")',
        'register_cuda_ci(est_time=30, suite="gpu")\n'
        'GPU_LANES = {"one": ("gpu", 10), "two": ("b", 10), "three": ("nothing", 10)}',
    )
    rc, out = _check(_tree(tmp_path, test_g=text))
    assert rc == 1, out[-3000:]
    assert "test_gpu[b]: cuda test in 2 lanes (one, two)" in out, out[-3000:]
    assert "lane three: selects no cuda test" in out, out[-3000:]


def test_planted_declaration_errors_name_the_file(tmp_path):
    text = GPU_FILE.replace(
        'register_cuda_ci(est_time=20, suite="gpu")',
        'register_cuda_ci(est_time=99, suite="gpu")\n'
        'GPU_LANES = {"one": ("a", 10), "two": ("b", 10)}',
    )
    rc, out = _check(_tree(tmp_path, test_g=text))
    assert rc == 2 and "test_g.py" in out and "add up to 20" in out, out[-3000:]
    with pytest.raises(gpu_lanes.LaneDeclarationError, match="2 register_cuda_ci calls"):
        gpu_lanes.lanes_of_file(
            _tree(
                tmp_path,
                test_h=GPU_FILE.replace(
                    'register_cuda_ci(est_time=20, suite="gpu")',
                    'register_cuda_ci(est_time=20, suite="gpu")\n'
                    'register_cuda_ci(est_time=20, suite="gpu2")',
                ),
            )
            / "test_h.py"
        )


def _lane_file(body: str, prelude: str = "") -> str:
    """A file of two ``cuda``-marked tests running ``body``, for lanes built here and given to
    the runner as they are (their registration is not read): no sglang import, which would
    cost each lane's process seconds of CPU."""
    return (
        f"import pytest\n{prelude}\npytestmark = [{CUDA_MARK}]\n\n\n"
        f"@pytest.mark.parametrize('x', ['a', 'b'])\ndef test_gpu(x):\n    {body}\n"
    )


def _stamped_lanes(tmp_path, bodies, *, est=None, alone=None, gpus=None):
    """A lane per ``{file stem: test body}``: each test writes when it started and ended, and
    the GPUs it was given (``CUDA_VISIBLE_DEVICES``), to ``tmp_path/stamps``; ``_wait_for(name)``
    in a body waits (up to two minutes) for that lane to have started. ``est``, ``alone``,
    ``gpus``: per stem, the lanes' declarations (default 1 s, shared, one GPU)."""
    est, alone, gpus = est or {}, alone or {}, gpus or {}
    stamps = str(tmp_path / "stamps")
    stamp = (
        "import os, pathlib, time\n"
        "def _stamp(name, what):\n"
        f"    with open({stamps!r}, 'a') as f:\n"
        "        f.write(f'{name} {what} {time.time()} {os.environ[\"CUDA_VISIBLE_DEVICES\"]}\\n')\n"
        "def _wait_for(name):\n"
        "    for _ in range(1200):\n"
        f"        if f'{{name}} start' in pathlib.Path({stamps!r}).read_text():\n"
        "            return\n"
        "        time.sleep(0.1)\n"
        "    raise AssertionError(f'{name} never started beside this test')\n"
    )
    files = {
        name: _lane_file(
            f"_stamp('{name}', 'start')\n    {body}\n    _stamp('{name}', 'end')", stamp
        )
        for name, body in bodies.items()
    }
    (tmp_path / "run").mkdir()
    tests = _tree(tmp_path / "run", **files)
    return [
        gpu_lanes.Lane(
            p.stem,
            p,
            None,
            est.get(p.stem, 1),
            alone=alone.get(p.stem, False),
            gpus=gpus.get(p.stem, 1),
        )
        for p in sorted(tests.glob("test_*.py"))
    ]


def _stamps(tmp_path):
    rows = [line.split() for line in (tmp_path / "stamps").read_text().splitlines()]
    starts = {n: min(float(t) for m, w, t, _ in rows if m == n and w == "start") for n, *_ in rows}
    ends = {n: max(float(t) for m, w, t, _ in rows if m == n and w == "end") for n, *_ in rows}
    gpus = {n: g for n, _, _, g in rows}
    return starts, ends, gpus


def test_an_alone_lane_is_declared_and_on_one_gpu_runs_by_itself_after_the_others(tmp_path):
    """A ``GPU_LANES`` entry ending in ``"alone"``: on one GPU its lane starts once every
    shared lane has ended, and no other runs beside it; any other option is refused."""
    text = GPU_FILE.replace(
        'register_cuda_ci(est_time=20, suite="gpu")',
        'register_cuda_ci(est_time=20, suite="gpu")\n'
        'GPU_LANES = {"one": ("a", 10), "two": ("b", 10, "alone")}',
    )
    one, two = gpu_lanes.lanes_of_file(_tree(tmp_path, test_g=text) / "test_g.py")
    assert (one.alone, two.alone) == (False, True)
    assert "(alone: no other lane on its GPU)" in gpu_lanes.sh_listing([one, two])
    bad = text.replace('"alone")', '"solo")')
    with pytest.raises(gpu_lanes.LaneDeclarationError, match="alone"):
        gpu_lanes.lanes_of_file(_tree(tmp_path, test_h=bad) / "test_h.py")
    # the two shared lanes each wait for the other to have started, so they pass only if they
    # ran side by side, whatever the machine's load
    lanes = _stamped_lanes(
        tmp_path,
        {
            "test_long": "_wait_for('test_short')",
            "test_short": "_wait_for('test_long')",
            "test_solo": "time.sleep(0.5)",
        },
        alone={"test_solo": True},
    )
    results = gpu_lanes.run_lanes(lanes, jobs=3, timeout=300, out_dir=tmp_path / "logs", gpus=["7"])
    assert all(r.ok for r in results), [r.line() for r in results]
    assert all(r.line().endswith(", GPU 7") for r in results), [r.line() for r in results]
    starts, ends, gpus = _stamps(tmp_path)
    assert starts["test_long"] < ends["test_short"]  # the shared lanes ran side by side
    assert starts["test_solo"] >= max(ends["test_long"], ends["test_short"])
    assert set(gpus.values()) == {"7"}


def test_lanes_spread_over_the_gpus_and_an_alone_lane_starts_first_on_its_own(tmp_path):
    """Two GPUs: the alone lane's process starts first, on a GPU no other lane uses while it
    runs (it waits for both shared lanes to have started, so it holds its GPU through them);
    the shared lanes go to the other GPU; a two-GPU lane gets both once the alone lane has ended; a lane
    needing more GPUs than there are is skipped, saying so, and fails nothing."""
    lanes = _stamped_lanes(
        tmp_path,
        {
            "test_a_solo": "_wait_for('test_b'); _wait_for('test_c')",
            "test_b": "_wait_for('test_c')",
            "test_c": "_wait_for('test_b')",
            "test_d_pair": "pass",
            "test_e_quad": "pass",
        },
        alone={"test_a_solo": True},
        gpus={"test_d_pair": 2, "test_e_quad": 4},
        est={"test_a_solo": 5, "test_b": 50, "test_c": 40, "test_d_pair": 1},
    )
    results = {
        r.name: r
        for r in gpu_lanes.run_lanes(
            lanes, jobs=4, timeout=300, out_dir=tmp_path / "logs", gpus=["0", "1"]
        )
    }
    assert results["test_e_quad"].line() == "lane test_e_quad: skipped (needs 4 GPUs, 2 here)"
    assert not results["test_e_quad"].ok and results["test_e_quad"].skipped
    ran = [r for r in results.values() if r.skipped is None]
    assert all(r.ok for r in ran), [r.line() for r in results.values()]
    starts, ends, gpus = _stamps(tmp_path)
    assert results["test_a_solo"].started < min(
        results["test_b"].started, results["test_c"].started
    )
    assert gpus["test_a_solo"] not in (gpus["test_b"], gpus["test_c"])
    assert gpus["test_b"] == gpus["test_c"]
    assert gpus["test_d_pair"] == "0,1" and starts["test_d_pair"] >= ends["test_a_solo"]
    assert results["test_d_pair"].line().endswith(", GPUs 0,1")
    line = gpu_lanes.summary_line(list(results.values()), 12.0, ["0", "1"])
    assert line == (
        "gpu_lanes: 4 of 4 lanes passed in 12 s on 2 GPUs (0,1); "
        "skipped: test_e_quad (needs 4 GPUs, 2 here)"
    )


def _lane(name, est, **kw):
    return gpu_lanes.Lane(name, REPO / f"test_{name}.py", None, est, **kw)


def test_the_placer_balances_estimated_work_and_keeps_alone_gpus_to_themselves():
    placer = gpu_lanes.GpuPlacer(["0", "1", "2"])
    solo = _lane("solo", 300, alone=True)
    assert placer.place(solo, 0.0, shared_left=True) == ("0",)
    placer.start(solo, ("0",), 0.0)
    # a second alone lane would leave the shared lanes one GPU: it may start, a third not
    solo2 = _lane("solo2", 300, alone=True)
    assert placer.place(solo2, 0.0, shared_left=True) == ("1",)
    long, short, mid = _lane("long", 400), _lane("short", 100), _lane("mid", 150)
    for lane, gpu in ((long, "1"), (short, "2")):  # each to the GPU with no work yet
        assert placer.place(lane, 0.0, shared_left=True) == (gpu,)
        placer.start(lane, (gpu,), 0.0)
    # then to the GPU with the least estimated work left: short's (100 s against 400 s),
    # and still there once short has overrun its estimate
    assert placer.place(mid, 0.0, shared_left=True) == ("2",)
    assert placer.place(mid, 380.0, shared_left=True) == ("2",)
    placer.start(mid, ("2",), 0.0)  # GPU 2: 250 s left, GPU 1: 400
    assert placer.place(_lane("next", 10), 0.0, shared_left=True) == ("2",)
    assert placer.place(_lane("next", 10), 300.0, shared_left=True) == ("2",)  # 0 vs 100
    # no shared lane on the alone lane's GPU, and an alone lane waits for an idle GPU
    assert placer.place(_lane("pair", 10, gpus=2), 0.0, shared_left=True) == ("1", "2")
    assert placer.place(_lane("trio", 10, gpus=3), 0.0, shared_left=True) is None
    assert placer.place(solo2, 0.0, shared_left=True) is None
    placer.end(solo, ("0",))
    assert placer.place(_lane("trio", 10, gpus=3), 0.0, shared_left=True) == ("0", "1", "2")
    # one GPU: an alone lane waits for the shared lanes, then runs when nothing else does
    one = gpu_lanes.GpuPlacer(["0"])
    assert one.place(solo, 0.0, shared_left=True) is None
    assert one.place(solo, 0.0, shared_left=False) == ("0",)
    one.start(short, ("0",), 0.0)
    assert one.place(solo, 0.0, shared_left=False) is None


def test_the_gpus_come_from_the_flag_the_environment_or_nvidia_smi(monkeypatch):
    assert gpu_lanes.parse_gpus("2") == ("0", "1")
    assert gpu_lanes.parse_gpus("2,3") == ("2", "3")
    assert gpu_lanes.parse_gpus("0,") == ("0",)
    for bad in ("0", "1,1", "1,,2", "", ",", "2,,"):
        with pytest.raises(ValueError, match="--gpus"):
            gpu_lanes.parse_gpus(bad)
    assert gpu_lanes.visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 1"}) == ("3", "1")
    with pytest.raises(gpu_lanes.GpuDiscoveryError, match="names no GPU"):
        gpu_lanes.visible_gpus({"CUDA_VISIBLE_DEVICES": ""})
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(gpu_lanes.GpuDiscoveryError, match="--gpus"):
        gpu_lanes.visible_gpus({})


def test_a_lane_asks_for_gpus_through_its_runner_config_or_its_options(tmp_path):
    pair_file = GPU_FILE.replace(
        'register_cuda_ci(est_time=20, suite="gpu")',
        'register_cuda_ci(est_time=20, stage="base-b", runner_config="2-gpu-h200")',
    )
    (lane,) = gpu_lanes.lanes_of_file(_tree(tmp_path, test_p=pair_file) / "test_p.py")
    assert lane.gpus == 2
    assert "(2 GPUs)" in gpu_lanes.sh_listing([lane])
    split = pair_file.replace(
        'runner_config="2-gpu-h200")',
        'runner_config="2-gpu-h200")\n'
        'GPU_LANES = {"one": ("a", 10, {"gpus": 1}), '
        '"two": ("b", 10, {"alone": True, "gpus": 4})}',
    )
    one, two = gpu_lanes.lanes_of_file(_tree(tmp_path, test_s=split) / "test_s.py")
    assert (one.gpus, one.alone, two.gpus, two.alone) == (1, False, 4, True)
    for bad, match in (
        ('{"gpus": 0}', "gpus must be >= 1"),
        ('{"gpus": "2"}', "options must be"),
        ('{"cores": 2}', "options must be"),
    ):
        text = split.replace('{"gpus": 1}', bad)
        with pytest.raises(gpu_lanes.LaneDeclarationError, match=match):
            gpu_lanes.lanes_of_file(_tree(tmp_path, test_bad=text) / "test_bad.py")
    text = pair_file.replace('"2-gpu-h200"', '"h200-pair"')
    with pytest.raises(gpu_lanes.LaneDeclarationError, match="GPU count"):
        gpu_lanes.lanes_of_file(_tree(tmp_path, test_rc=text) / "test_rc.py")


@pytest.mark.parametrize(
    "line,counts",
    [
        ("==== 3 passed, 1 failed, 2 warnings in 12.30s ====", {"passed": 3, "failed": 1}),
        ("1 failed, 2 errors in 4.0s", {"failed": 3}),
        ("13 passed, 31 warnings in 150.59s (0:02:30)", {"passed": 13}),
        ("===== no tests ran in 0.01s =====", {}),
    ],
)
def test_pytest_counts(line, counts):
    assert gpu_lanes.parse_pytest_counts(f"noise\n{line}\n\n") == counts


def test_pytest_progress_of_a_stopped_run():
    out = "cmd\n..F.E                [ 60%]\n..\n=== warnings summary ===\n"
    assert gpu_lanes.parse_pytest_counts(out) == {}
    assert gpu_lanes.parse_pytest_progress(out) == {"passed": 5, "failed": 2}


def test_lanes_run_report_one_line_each_and_stop_at_the_time_limit(tmp_path, capsys):
    tests = _tree(
        tmp_path,
        test_ok=_lane_file("pass"),
        test_bad=_lane_file("assert x == 'a'"),
        test_slow=_lane_file("import time; time.sleep(600)"),
    )
    lanes = {p.stem: gpu_lanes.Lane(p.stem, p, None, 1) for p in tests.glob("test_*.py")}
    results = {
        r.name: r
        for r in gpu_lanes.run_lanes(
            [lanes["test_ok"], lanes["test_bad"]], jobs=2, timeout=300, out_dir=tmp_path / "logs"
        )
    }
    results.update(
        {
            r.name: r
            for r in gpu_lanes.run_lanes(
                [lanes["test_slow"]], jobs=1, timeout=5, out_dir=tmp_path / "logs"
            )
        }
    )
    assert results["test_ok"].line().startswith("lane test_ok: 2 passed, 0 failed, ")
    assert results["test_ok"].ok
    assert results["test_bad"].line().startswith("lane test_bad: 1 passed, 1 failed, ")
    assert not results["test_bad"].ok
    assert results["test_slow"].returncode is None and not results["test_slow"].ok
    assert results["test_slow"].line().endswith("(timed out)")
    printed = capsys.readouterr().out
    assert all(f"lane {name}:" in printed for name in results)


def test_each_lane_s_servers_pick_ports_from_a_share_of_their_own(tmp_path):
    """Lanes run side by side as separate pytest processes: lane i of n gets
    ``KV_CANARY_PORT_SHARE=i/n``, which ``free_port`` reads, so two lanes' servers never pick
    the same port (GPU suite run 36: two lanes' servers drew the same ``nccl_port``)."""
    out = tmp_path / "shares"
    out.mkdir()
    body = (
        "import os, pathlib; pathlib.Path(%r, os.environ['KV_CANARY_PORT_SHARE'].replace('/', "
        "'_') + x).write_text('')" % str(out)
    )
    tests = _tree(
        tmp_path, test_a=_lane_file(body), test_b=_lane_file(body), test_c=_lane_file(body)
    )
    lanes = [gpu_lanes.Lane(p.stem, p, None, 1) for p in sorted(tests.glob("test_*.py"))]
    results = gpu_lanes.run_lanes(lanes, jobs=3, timeout=300, out_dir=tmp_path / "logs")
    assert all(r.ok for r in results), [r.line() for r in results]
    assert sorted(p.name for p in out.iterdir()) == [
        f"{i}_3{x}" for i in range(3) for x in ("a", "b")
    ]


def test_the_lanes_byte_compile_their_import_path_first(tmp_path, monkeypatch):
    """The device's Python writes no bytecode (``-B``) and its bundles come without it: the
    runner compiles ``$PYTHONPATH``'s directories and ``python/`` once, so that a process
    importing from them, still under ``-B``, reads ``.pyc`` files instead of compiling."""
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{tmp_path / 'gone'}")
    dirs = gpu_lanes.import_path_dirs()
    assert dirs == [site.resolve(), (REPO / "python").resolve()]
    ok, _ = gpu_lanes.precompile([site])
    assert ok
    cached = list((site / "pkg" / "__pycache__").glob("__init__.*.pyc"))
    assert len(cached) == 1, "no bytecode written for the import path"


BURN = (
    "import subprocess, sys, time\n"
    "def burn(s):\n"
    "    t = time.process_time()\n"
    "    while time.process_time() - t < s:\n"
    "        pass\n"
)


def test_the_cpu_account_adds_up_each_lane_and_kind(tmp_path):
    """The suite's account of where its CPU time went: a lane's process and its child (its
    command line naming it as sglang's retitled scheduler does) each burn about a second; both
    count for the lane, the child as a scheduler; the lane's sleeping neighbour costs next to
    nothing. The child lives until a sample has seen its whole burn (a busy machine may take
    seconds per sample)."""
    burner = tmp_path / "burner.py"
    release = tmp_path / "release"
    burner.write_text(
        BURN
        + textwrap.dedent(f"""
        import os
        if sys.argv[1] == "child":
            burn(1.0)
            deadline = time.monotonic() + 120
            while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:
                time.sleep(0.05)
        elif sys.argv[1] == "lane":
            child = subprocess.Popen([sys.executable, "-c",
                                      "import runpy, sys; sys.argv = [sys.argv[1], 'child'];"
                                      "runpy.run_path(sys.argv[0])", sys.argv[0],
                                      "sglang::scheduler_TP0"])
            burn(1.0)
            child.wait()
            time.sleep(1.0)
        else:
            time.sleep(2.0)
        """)
    )
    account = gpu_lanes.CpuAccount(interval=0.2).start()
    busy = subprocess.Popen([sys.executable, str(burner), "lane"])
    idle = subprocess.Popen([sys.executable, str(burner), "idle"])
    account.add_lane(busy.pid, "busy")
    account.add_lane(idle.pid, "idle")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(
        s.lane == "busy" and s.kind == "scheduler" and s.cpu_s >= 0.9
        for s in list(account.seen.values())
    ):
        time.sleep(0.1)
    release.touch()
    busy.wait(), idle.wait()
    account.stop()
    rep = account.report()
    assert set(rep["lanes"]) == {"busy", "idle"}, rep
    assert 1.6 <= rep["lanes"]["busy"] <= 3.0, rep
    assert rep["lanes"]["idle"] < 0.5, rep
    assert 0.8 <= rep["kinds"]["scheduler"]["cpu_s"] <= 1.5, rep
    assert rep["kinds"]["scheduler"]["processes"] == 1, rep
    text = gpu_lanes.format_cpu_report(rep)
    assert "scheduler: 1 processes" in text and "by lane: busy " in text, text


def _proc_entry(
    root, pid: int, *, ppid: int, start: int, cpu_ticks: int, cmd: str, state: str = "S"
) -> None:
    """A ``/proc/<pid>`` stand-in: ``stat`` with the fields the account reads, ``cmdline``
    (empty for a zombie, as the kernel shows it)."""
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime
    # stime cutime cstime priority nice threads itrealvalue starttime ...
    fields = [state, ppid] + [0] * 9 + [cpu_ticks, 0] + [0] * 6 + [start, 0]
    (d / "stat").write_text(f"{pid} (python3) " + " ".join(map(str, fields)) + "\n")
    (d / "cmdline").write_bytes(cmd.replace(" ", "\0").encode() + b"\0" if cmd else b"")


def test_the_cpu_account_tells_a_reused_pid_from_the_process_it_saw(tmp_path):
    """A busy machine hands a dead process's pid to a new one: the account keeps the first
    process's time and kind (a lane's scheduler) and counts the newcomer as another process,
    of no lane when it descends from none (a process table of files: no timing involved)."""
    proc = tmp_path / "proc"
    account = gpu_lanes.CpuAccount(proc=str(proc))
    tick = account._tick
    _proc_entry(proc, 100, ppid=1, start=10, cpu_ticks=tick, cmd="python -m pytest lane_a")
    _proc_entry(
        proc, 101, ppid=100, start=20, cpu_ticks=3 * tick, cmd="python sglang::scheduler_TP0"
    )
    account.add_lane(100, "lane_a")
    account.sample()
    # the scheduler exits; pid 101 is handed to an unrelated process
    _proc_entry(proc, 101, ppid=1, start=90, cpu_ticks=tick // 2, cmd="python -m other")
    account.sample()
    rep = account.report()
    assert rep["kinds"]["scheduler"]["processes"] == 1, rep
    assert rep["kinds"]["scheduler"]["cpu_s"] == pytest.approx(3.0), rep
    assert rep["lanes"] == {"lane_a": pytest.approx(4.0)}, rep
    assert len(account.seen) == 3


def test_the_cpu_account_keeps_the_kind_of_a_process_that_exited_unreaped(tmp_path):
    """A lane's scheduler exits and is sampled before its parent reaps it: a zombie, whose
    command line the kernel shows empty. It stays a scheduler of its lane, with its time
    (under load the reaping waits, and the account test's child was last seen so: its kind
    was lost, ``KeyError: 'scheduler'``)."""
    proc = tmp_path / "proc"
    account = gpu_lanes.CpuAccount(proc=str(proc))
    tick = account._tick
    _proc_entry(proc, 100, ppid=1, start=10, cpu_ticks=0, cmd="python -m pytest lane_a")
    _proc_entry(proc, 101, ppid=100, start=20, cpu_ticks=tick, cmd="python sglang::scheduler_TP0")
    account.add_lane(100, "lane_a")
    account.sample()
    _proc_entry(proc, 101, ppid=100, start=20, cpu_ticks=2 * tick, cmd="", state="Z")
    account.sample()
    rep = account.report()
    assert rep["kinds"]["scheduler"]["processes"] == 1, rep
    assert rep["kinds"]["scheduler"]["cpu_s"] == pytest.approx(2.0), rep
    assert rep["kinds"]["scheduler"]["top"][0][0] == "python sglang::scheduler_TPN", rep


@pytest.mark.parametrize(
    "comm, cmd, kind",
    [
        ("python3", "sglang::scheduler_TP0", "scheduler"),
        ("python3", "sglang::detokenizer", "detokenizer"),
        ("ptxas", "ptxas -arch=sm_90a x.ptx", "native compiler"),
        ("python", "python -m pytest -q test_x.py", "pytest"),
        (
            "python",
            "python test/registered/kv_canary/e2e_support/workload.py m none {}",
            "engine (workload, demo)",
        ),
        ("bash", "bash -c sleep 1", "other"),
    ],
)
def test_cpu_kinds(comm, cmd, kind):
    assert gpu_lanes.cpu_kind(comm, cmd) == kind


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_the_files_registered_longest_are_handed_out_first():
    """CI's two workers take whole files in collection order (``--no-loadscope-reorder``:
    not xdist's order by test count), and the collection puts the longest registered files
    first, each file's tests together in their own order; a file without a CPU registration
    last."""
    import types

    import conftest

    addopts = (REPO / "pyproject.toml").read_text()
    assert "--dist loadfile --no-loadscope-reorder" in addopts
    here = pathlib.Path(__file__).parent
    files = ["test_packaging.py", "test_storm_server.py", "kernel_oracle.py", "test_radix_sweep.py"]
    seconds = [conftest._registered_cpu_seconds(str(here / f)) for f in files]
    assert seconds[1] > seconds[0] > seconds[3] > seconds[2] == 0
    items = [
        types.SimpleNamespace(path=here / f, nodeid=f"{f}::t{i}", keywords={}, add_marker=print)
        for f in files
        for i in range(2)
    ]
    conftest.pytest_collection_modifyitems(None, items)
    order = [f"{f}::t{i}" for f in (files[1], files[0], files[3], files[2]) for i in range(2)]
    assert [item.nodeid for item in items] == order
