"""``benchmark/kv_canary/detect_side_by_side.py`` (detection and deployments beside upstream's
canary): what it reads from a run's output, the runs it plans for each stack, its verdicts, its
refusals, and one run of this project's stack on sglang's CPU server (a clean run, a
``req_to_token`` fault, abort mode clean and with that fault). Upstream's stack needs its GPU
bundle: CPU CI cannot run it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from sglang.srt.kv_canary.perturb.config import FaultKind
from sglang.srt.kv_canary.perturb.report import format_perturb_line
from sglang.srt.kv_canary.violations.lines import format_violation_line
from sglang.srt.kv_canary.violations.records import ViolationRecord
from sglang.srt.kv_canary.demo.server_harness import cpu_engine_kwargs
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=150, suite="stage-a-test-cpu")

BENCH_DIR = pathlib.Path(__file__).resolve().parents[3] / "benchmark" / "kv_canary"
sys.path.insert(0, str(BENCH_DIR))

import detect_side_by_side as sbs  # noqa: E402
from common import UPSTREAM_SITE_DIR  # noqa: E402


def _row(kind: int, slot: int, bits: int) -> "ViolationRecord":
    """A ring row in the record format's field order, decoded."""
    from sglang.jit_kernel.kv_canary import consts as c

    row = [0] * c.VIOLATION_NUM_FIELDS
    row[c.VIOLATION_FIELD_KERNEL_KIND] = kind
    row[c.VIOLATION_FIELD_SLOT_IDX] = slot
    row[c.VIOLATION_FIELD_FAIL_REASON_BITS] = bits
    return ViolationRecord.from_row(row)


def test_reports_are_read_from_either_stacks_violation_line():
    from sglang.jit_kernel.kv_canary.consts import FailReason
    from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag

    bits = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH) | int(FailReason.VERIFY_TOKEN_MISMATCH)
    ours = format_violation_line(_row(int(CanaryLaunchTag.HEAD_K_FULL), 17, bits), step=40)
    # the leading fields every line of the record format starts with, as a shorter line
    theirs = (
        "[2026-11-26 TP0] kv_canary violation: launch_tag=SWEEP_K_FULL "
        "fail_reason=verify_real_kv_hash slot_idx=5 position=3"
    )
    text = "\n".join([ours, ours, "noise", theirs])  # raise mode logs a report twice
    reports = sbs.parse_reports(text)
    assert [str(r) for r in reports] == [
        "HEAD_K_FULL verify_chain_hash+verify_token slot 17",
        "SWEEP_K_FULL verify_real_kv_hash slot 5",
    ]
    run = sbs.evaluate("project", "req_to_token", text, 1)
    assert run.caught(sbs.FAULTS["req_to_token"])
    assert not run.caught(sbs.FAULTS["next_token_swap"])  # write_token not among the reasons


def test_a_run_that_kept_serving_lists_its_failed_waves():
    done = "SIDE_BY_SIDE_RESULT " + json.dumps(
        {"requests": 48, "generated_tokens": 700, "failed_waves": [{"wave": 2, "error": "E: x"}]}
    )
    run = sbs.evaluate("project", "abort+req_to_token", "SIDE_BY_SIDE_INFO {}\n" + done, 0)
    assert run.served and run.failed_waves == ("E: x",)
    assert run.ended == "kept serving; 1 wave(s) failed: E: x"
    whole = sbs.evaluate(
        "project",
        "clean",
        done.replace(', {"wave": 2, "error": "E: x"}', "").replace(
            '[{"wave": 2, "error": "E: x"}]', "[]"
        ),
        0,
    )
    assert whole.failed_waves == () and whole.ended == "served every request"
    # a clean run with a failed wave is not a deployment that serves
    assert sbs.deployment_verdict(run, None) == ("fails requests of a clean run (1 wave(s)): E: x")


def test_injections_count_what_was_injected_not_skips_or_the_warm_up():
    text = "\n".join(
        [
            "INFO " + format_perturb_line(FaultKind.REQ_TO_TOKEN, step=31, slot=3, new_slot=9),
            "INFO kv_canary perturb: enabled after warmup window at step=30",
            "INFO kv_canary perturb req_to_token: skipped because no active nonzero slots",
            "INFO kv_canary perturb req_to_token: req_pool_idx=1 position=2 original_slot=4 "
            "new_slot=7",
        ]
    )
    found = sbs.parse_injections(text)
    assert len(found) == 2, found
    assert found[0].startswith("kv_canary perturb: fault=req_to_token step=31")


def test_upstream_runs_get_the_isolated_pythonpath_and_no_inherited_canary_variables(tmp_path):
    base = {
        "PYTHONPATH": "/tmp/site",
        "SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB": "1",
        "HOME": "/root",
    }
    up = sbs.stack_env(base, "upstream", str(tmp_path))
    assert up["PYTHONPATH"].split(os.pathsep) == [
        str(UPSTREAM_SITE_DIR),
        str(tmp_path),
        "/tmp/site",
    ]
    assert "SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB" not in up and up["HOME"] == "/root"
    ours = sbs.stack_env(base, "project", None)
    assert ours["PYTHONPATH"] == "/tmp/site"
    assert not [k for k in ours if k.startswith("SGLANG_KV_CANARY_")]
    with pytest.raises(ValueError, match="--upstream-site"):
        sbs.stack_env(base, "upstream", None)


def test_the_plan_runs_each_fault_and_each_deployment_clean_and_probed(tmp_path):
    models = {"llama": "/m/llama", "deepseek_v2": "/m/dsv2"}
    runs = sbs.plan(
        stacks=["project", "upstream"],
        faults=["clean", "real_kv_used"],
        deployments=["mla", "eagle", "abort"],
        models=models,
        draft_dir="/m/draft",
        make_kwargs=cpu_engine_kwargs,
        base_env={},
        upstream_site=str(tmp_path),
    )
    cases = [(r.stack, r.case) for r in runs]
    assert cases == [
        (s, c)
        for s in ("project", "upstream")
        for c in (
            "clean",
            "real_kv_used",
            "mla:off",
            "mla",
            "mla+req_to_token",
            "eagle:off",
            "eagle",
            "eagle+req_to_token",
            "abort:off",
            "abort",
            "abort+req_to_token",
        )
    ]
    by = {(r.stack, r.case): r for r in runs}
    for stack in ("project", "upstream"):
        clean, used = by[(stack, "clean")], by[(stack, "real_kv_used")]
        assert clean.env["SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE"] == "1"
        assert not [k for k in clean.env if "_PERTURB_" in k and k.endswith("_PROB")]
        assert used.env["SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB"] == "1"
        assert used.env["SGLANG_KV_CANARY_PERTURB_TARGET_GROUP"] == "full"
        assert clean.engine_kwargs["kv_canary"] == "raise"
        assert clean.engine_kwargs["kv_canary_real_data"] == "partial"
        assert by[(stack, "mla")].engine_kwargs["model_path"] == "/m/dsv2"
        eagle = by[(stack, "eagle+req_to_token")]
        assert eagle.engine_kwargs["speculative_draft_model_path"] == "/m/draft"
        assert eagle.env["SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB"] == "1"
        assert by[(stack, "abort")].engine_kwargs["kv_canary"] == "abort"
        # the control: the same deployment, no canary flag or variable
        for name in ("mla", "eagle", "abort"):
            off = by[(stack, name + ":off")]
            assert off.engine_kwargs["kv_canary"] == "none"
            assert not [k for k in off.engine_kwargs if k.startswith("kv_canary_")]
            assert not [k for k in off.env if k.startswith("SGLANG_KV_CANARY_")]
            # besides the canary's own: upstream's token oracle is a sampling backend
            canary_only = ("nccl_port",) + (("sampling_backend",) if stack == "upstream" else ())
            same = {
                k: v
                for k, v in by[(stack, name)].engine_kwargs.items()
                if not k.startswith("kv_canary") and k not in canary_only
            }
            assert {
                k: v
                for k, v in off.engine_kwargs.items()
                if not k.startswith("kv_canary") and k not in canary_only
            } == same
    assert by[("upstream", "clean")].env["PYTHONPATH"].startswith(str(UPSTREAM_SITE_DIR))
    # each server its own port for torch's store
    assert len({r.engine_kwargs["nccl_port"] for r in runs}) == len(runs)


def test_upstream_runs_take_upstreams_engine_argument_names(tmp_path):
    """sglang 0.5.17's ``Engine`` no longer takes two of 0.5.12's arguments the GPU runs set
    (it keeps them as command-line aliases only): its runs get the new names and values, this
    project's runs keep theirs; and every fault is one both stacks inject on one server (the
    PD transfer fault needs a PD pair: it is not among them), the EAGLE deployment runs
    without the token oracle on both stacks, with no prompt split into prefill chunks (sglang
    0.5.12's own chunk-end draft bug would stop it first); upstream's runs that ask for the
    token oracle also get the sampling backend its server builds the oracle for."""
    from sglang.srt.kv_canary.demo.server_harness import gpu_engine_kwargs

    assert "pd_transfer" not in sbs.FAULTS and "req_to_token" in sbs.FAULTS
    runs = sbs.plan(
        stacks=["project", "upstream"],
        faults=["clean"],
        deployments=["eagle"],
        models={"llama": "/m/llama", "deepseek_v2": "/m/dsv2"},
        draft_dir="/m/draft",
        make_kwargs=gpu_engine_kwargs,
        base_env={},
        upstream_site=str(tmp_path),
    )
    by = {(r.stack, r.case): r for r in runs}
    ours, theirs = by[("project", "clean")].engine_kwargs, by[("upstream", "clean")].engine_kwargs
    assert ours["disable_piecewise_cuda_graph"] is True and ours["cuda_graph_max_bs"] == 8
    assert not set(sbs.UPSTREAM_RENAMED_KWARGS) & set(theirs)
    assert theirs["cuda_graph_backend_prefill"] == "disabled"
    assert theirs["cuda_graph_max_bs_decode"] == 8
    drop = lambda kw: {k: v for k, v in kw.items() if k != "nccl_port"}  # noqa: E731
    assert drop(sbs.stack_kwargs("project", ours)) == drop(ours)
    # 0.5.12's default (piecewise graphs on) has no counterpart to pass: left out
    assert sbs.stack_kwargs("upstream", {"disable_piecewise_cuda_graph": False}) == {}
    for stack in ("project", "upstream"):
        assert by[(stack, "clean")].env["SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE"] == "1"
        for case in ("eagle", "eagle+req_to_token"):
            env = by[(stack, case)].env
            assert "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE" not in env
            assert "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT" not in env
            assert env["SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT"] == "1"
        assert (
            by[(stack, "eagle+req_to_token")].env["SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB"]
            == "1"
        )
        longest = max(len(ids) for ids, _ in sbs.demo_requests())
        for case in ("eagle:off", "eagle", "eagle+req_to_token"):
            assert by[(stack, case)].engine_kwargs["chunked_prefill_size"] >= longest
    for r in runs:
        oracle = r.env.get("SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE") == "1"
        backend = r.engine_kwargs["sampling_backend"]
        if r.stack == "upstream":
            assert (backend == "token_oracle") == oracle, (r.case, backend)
        else:
            assert backend == "pytorch", (r.case, backend)
    assert by[("upstream", "clean")].engine_kwargs["sampling_backend"] == "token_oracle"


def _result(**kw) -> "sbs.RunResult":
    base = dict(
        stack="upstream",
        case="mla",
        returncode=0,
        version="0.5.17",
        installed=1,
        injections=0,
        reports=(),
        served=True,
        error=None,
    )
    return sbs.RunResult(**{**base, **kw})


def test_deployment_verdicts():
    report = sbs.Report("HEAD_K_FULL", ("verify_chain_hash",), 3)
    refused = _result(
        returncode=1, installed=0, served=False, error="ValueError: kv_canary does not support MLA"
    )
    assert sbs.deployment_verdict(refused, None) == (
        "refuses at start-up: ValueError: kv_canary does not support MLA"
    )
    crashed = _result(returncode=1, served=False, error="RuntimeError: illegal memory access")
    assert sbs.deployment_verdict(crashed, None).startswith("crashes (canary installed)")
    assert sbs.deployment_verdict(_result(installed=0), None) == "serves, canary not installed"
    assert sbs.deployment_verdict(_result(reports=(report,)), None).startswith("false positive")
    caught = _result(
        case="mla+req_to_token", injections=1, reports=(report,), served=False, returncode=-9
    )
    assert sbs.deployment_verdict(_result(installed=2), caught).startswith(
        "guards: canary on 2 worker(s), req_to_token caught"
    )
    missed = _result(case="mla+req_to_token", injections=3)
    assert "NOT caught (3 injections; served every request)" in sbs.deployment_verdict(
        _result(), missed
    )
    table = sbs.deployment_table([_result(), missed])
    assert "| mla | upstream | 0.5.17 | canary on 1 worker(s) but req_to_token NOT" in table
    # a deployment the stack's sglang fails with the canary off says nothing of the canary
    off = _result(
        case="mla:off",
        returncode=1,
        served=False,
        installed=0,
        error="RuntimeError: Expected size [4, 64]",
    )
    assert sbs.deployment_verdict(crashed, None, off) == (
        "sglang itself fails it (canary off): RuntimeError: Expected size [4, 64]"
    )
    assert sbs.deployment_table([crashed, off]).endswith(
        "| mla | upstream | 0.5.17 | sglang itself fails it (canary off): RuntimeError: "
        "Expected size [4, 64] |"
    )
    assert sbs.deployment_verdict(
        _result(installed=2), caught, _result(case="mla:off", installed=0)
    ).startswith("guards")


def _cli(*argv, timeout=60):
    return subprocess.run(
        [sys.executable, str(BENCH_DIR / "detect_side_by_side.py"), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--stacks", "upstream"], "--stacks upstream needs --upstream-site DIR"),
        (
            ["--stacks", "upstream", "--upstream-site", "/x", "--device", "cpu"],
            "--stacks upstream needs --device cuda",
        ),
        (
            ["--device", "cpu", "--deployments", "hicache"],
            "--deployments hicache needs --device cuda",
        ),
        (["--device", "cpu", "--deployments", "mla"], "--deployments mla needs --device cuda"),
        (["--faults", "clean,bitrot"], "--faults: unknown bitrot; allowed: clean, req_to_token"),
        (["--jobs", "0"], "--jobs must be >= 1, got 0"),
    ],
)
def test_refusals_name_the_flag(argv, message, capsys):
    # in this process (the script's main, as its command line calls it): a process per case
    # would spend its time importing sglang; the command line itself is the next test's
    with pytest.raises(SystemExit) as refused:
        sbs.main(argv)
    out = capsys.readouterr()
    assert refused.value.code not in (0, None)
    assert message in f"{refused.value.code}{out.err}{out.out}"


def test_a_refusal_on_the_command_line_exits_non_zero_naming_the_flag():
    proc = _cli("--jobs", "0")
    assert proc.returncode != 0
    assert "--jobs must be >= 1, got 0" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_project_stack_on_the_cpu_server(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_KV_CANARY_")}
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "detect_side_by_side.py"),
            "--device",
            "cpu",
            "--faults",
            "req_to_token",  # the clean run: the abort deployment's
            "--deployments",
            "abort",
            "--jobs",
            "2",
            "--json",
            str(tmp_path / "runs.json"),
            "--logs",
            str(tmp_path / "logs"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {r["case"]: r for r in json.loads((tmp_path / "runs.json").read_text())}
    assert set(runs) == {"req_to_token", "abort:off", "abort", "abort+req_to_token"}
    assert all(r["stack"] == "project" and r["version"] == "0.5.12" for r in runs.values())
    assert runs["abort"]["served"] and runs["abort"]["reports"] == []
    assert runs["abort"]["installed"] == 1
    assert runs["req_to_token"]["injections"] >= 1 and not runs["req_to_token"]["served"]
    assert "| req_to_token | project | 0.5.12 |" in proc.stdout
    assert "| caught | HEAD_" in proc.stdout
    # abort mode: the fault reported, the aborted requests' calls failed with the canary's
    # message (sglang's HTTP 500 for a non-streaming call), the server kept serving
    probed = runs["abort+req_to_token"]
    assert probed["served"] and probed["returncode"] == 0 and probed["reports"], probed
    assert probed["failed_waves"] and all(
        "kv_canary: KV cache corruption detected" in w for w in probed["failed_waves"]
    ), probed
    # (with the fault injected at every step, every wave has an aborted request: the server
    # answered each of the four calls, and shut down cleanly)
    assert runs["abort"]["failed_waves"] == []
    assert runs["abort:off"]["served"] and runs["abort:off"]["installed"] == 0
    assert (
        "| abort | project | 0.5.12 | guards: canary on 1 worker(s), req_to_token caught"
        in proc.stdout
    )
    assert (tmp_path / "logs" / "project_req_to_token.log").is_file()


def test_detection_rows_show_the_first_report_that_matches_the_fault():
    token = sbs.Report("TAIL_K_FULL", ("write_token",), 8)
    kv = sbs.Report("SWEEP_K_FULL", ("verify_real_kv_hash",), 4)
    rows = [
        _result(stack="project", case="clean", reports=(token,)),
        _result(
            stack="project",
            case="real_kv_used",
            injections=2,
            reports=(token, kv),
            served=False,
            returncode=-9,
            error="RuntimeError: kv_canary detected",
        ),
        _result(stack="upstream", case="real_kv_unused_cache", injections=0),
        _result(stack="upstream", case="next_token_swap", injections=4, reports=(kv,)),
    ]
    table = sbs.detection_table(rows).splitlines()
    assert table[2].startswith("| clean | project | 0.5.17 | 0 | FALSE POSITIVE | TAIL_K_FULL")
    assert table[3] == (
        "| real_kv_used | project | 0.5.17 | 2 | caught | SWEEP_K_FULL "
        "verify_real_kv_hash slot 4 | stopped (exit -9): RuntimeError: "
        "kv_canary detected |"
    )
    assert "| 0 | not injected | - | served every request |" in table[4]
    assert "| 4 | NOT caught | - |" in table[5]


# ---- upstream_side_by_side_detached.sh: the lease's plumbing, on stand-ins -------------------


def _lease_tree(tmp_path) -> pathlib.Path:
    """A repository-root stand-in: bundle a's setup (records that it ran), one extra bundle's
    install script, upstream's sglang as a one-line package, and a detection script that
    writes what it was given."""
    root = tmp_path / "repo"
    (root / ".device" / "a").mkdir(parents=True)
    (root / ".device" / "a" / "setup.sh").write_text("echo setup >> \"$MARKS\"\n")
    (root / ".device" / "up_z").mkdir()
    (root / ".device" / "up_z" / "install.sh").write_text("echo up_z >> \"$MARKS\"\n")
    (root / ".device" / "up_bad").mkdir()
    (root / ".device" / "up_bad" / "install.sh").write_text("exit 3\n")
    site = tmp_path / "site_up" / "sglang"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text('__version__ = "0.5.17"\n')
    bench = root / "benchmark" / "kv_canary"
    bench.mkdir(parents=True)
    (bench / "detect_side_by_side.py").write_text(
        "import sys, json\nprint('DETECT', json.dumps(sys.argv[1:]))\n"
    )
    (bench / "bench_interleaved.py").write_text(
        "import sys, json\nprint('OVERHEAD', json.dumps(sys.argv[1:]))\n"
    )
    return root


def _lease(root, tmp_path, *argv, **env):
    script = BENCH_DIR / "upstream_side_by_side_detached.sh"
    full = {
        **os.environ,
        "MARKS": str(tmp_path / "marks"),
        "OUT": str(tmp_path / "out"),
        "SIDE_BY_SIDE_DIR": str(tmp_path / "run"),
        "SITE_UP": str(tmp_path / "site_up"),
        **env,
    }
    return subprocess.run(
        ["bash", str(script), *argv],
        cwd=root,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_lease_script_installs_starts_and_collects(tmp_path):
    root = _lease_tree(tmp_path)
    proc = _lease(root, tmp_path, "install", "c", "up_z")
    assert proc.returncode == 0 and "installed c up_z" in proc.stdout, proc.stderr
    assert (tmp_path / "marks").read_text().split() == ["setup", "up_z"]
    bad = _lease(root, tmp_path, "install", "up_bad")
    assert bad.returncode == 1 and "install of .device/up_bad failed" in bad.stderr
    assert _lease(root, tmp_path, "start", PART="most").returncode == 2

    started = _lease(root, tmp_path, "start", PART="detect", JOBS="3")
    assert started.returncode == 0 and "upstream 0.5.17" in started.stdout, started.stderr
    done = _lease(root, tmp_path, "wait", "60")
    assert "side_by_side: finished" in done.stdout, done.stdout + done.stderr
    assert "detect rc=0" in done.stdout and "overhead rc" not in done.stdout
    out = tmp_path / "out"
    detect = (out / "detect.log").read_text()
    assert '"--upstream-site", "%s"' % (tmp_path / "site_up") in detect
    assert '"--jobs", "3"' in detect
    assert (out / "side_by_side_run.tgz").stat().st_size > 0


def test_the_lease_script_runs_the_parts_in_the_order_given(tmp_path):
    """``PART=detect,overhead``: the detection first (of the stacks ``STACKS`` names, each run
    with its ``DETECT_TIMEOUT``), then the overhead run with its memory settings and
    ``TWINS``; the wait brings back the two logs, not each server's (those are in the
    tarball)."""
    root = _lease_tree(tmp_path)
    run = tmp_path / "run"
    started = _lease(
        root,
        tmp_path,
        "start",
        PART="detect,overhead",
        STACKS="upstream",
        MAX_TOTAL_TOKENS="56000",
        CONFIGS="off,up:off,up:raise",
        DETECT_TIMEOUT="300",
        TWINS="up:raise",
    )
    assert started.returncode == 0, started.stderr
    done = _lease(root, tmp_path, "wait", "60")
    assert "side_by_side: finished" in done.stdout, done.stdout + done.stderr
    assert (run / "summary.txt").read_text().split("\n")[:2] == ["detect rc=0", "overhead rc=0"]
    out = tmp_path / "out"
    detect = (out / "detect.log").read_text()
    assert '"--stacks", "upstream"' in detect and '"--timeout", "300"' in detect
    overhead = (out / "overhead.log").read_text()
    assert '"--configs", "off,up:off,up:raise"' in overhead
    assert '"--max-total-tokens", "56000"' in overhead and "--gpu-share" not in overhead
    assert '"--twins", "up:raise"' in overhead
    # a part that does not exist is refused before anything starts
    refused = _lease(root, tmp_path, "start", PART="overhead,sweep")
    assert refused.returncode == 2 and "allowed overhead, detect" in refused.stderr


def test_the_lease_script_refuses_without_upstreams_sglang(tmp_path):
    root = _lease_tree(tmp_path)
    proc = _lease(root, tmp_path, "start", SITE_UP=str(tmp_path / "nowhere"))
    assert proc.returncode == 1
    assert "upstream's sglang is not in" in proc.stderr
    assert not (tmp_path / "run").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
