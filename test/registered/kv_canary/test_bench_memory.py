"""``benchmark/kv_canary/bench_memory.py``'s logic on the CPU (its servers need a GPU: lanes
``memory_gpu_alone`` and ``memory_gpu_tight``): the tight servers' prompt sizing, their first
fraction from the GPU's size, the plan of servers it starts and what it refuses."""

from __future__ import annotations

import sys

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")


def _bench_memory():
    """``benchmark/kv_canary/bench_memory.py`` as a module (it imports its sibling ``common``)."""
    import importlib.util
    import pathlib

    bench = pathlib.Path(__file__).resolve().parents[3] / "benchmark" / "kv_canary"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("bench_memory", bench / "bench_memory.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(bench))
    return mod


def test_the_tight_memory_servers_decode_a_bounded_batch_whatever_the_pool():
    """``bench_memory.py``'s tight servers (lane ``memory_gpu_tight``) fill the pool with
    prompts so long that at most ``TIGHT_CONCURRENCY`` requests fit in it at once: sglang's
    own memory outside the pool (a decode step's float32 logits, per running request) then
    does not grow with the GPU. Short pools keep the 4000-token prompts; no prompt passes the
    context length."""
    import math

    mod = _bench_memory()
    ctx = 40960
    for pool in (353_672, 697_981, 1_260_052, 2_000_000):  # H100 0.5 / tight, H200 tight, more
        isl = mod.tight_isl(pool, ctx)
        assert mod.SHORT_ISL <= isl and isl + mod.OSL <= ctx - 1, (pool, isl)
        prompts = math.ceil(1.1 * pool / (isl + mod.OSL))
        at_once = pool // (isl + mod.OSL)
        assert at_once <= mod.TIGHT_CONCURRENCY or isl + mod.OSL == ctx - 1, (pool, at_once)
        assert prompts * (isl + mod.OSL) >= 1.1 * pool - (isl + mod.OSL)
    assert mod.tight_isl(50_000, ctx) == mod.SHORT_ISL
    assert mod.tight_isl(10_000, 2048) == 2048 - 1 - mod.OSL


# the GPUs' totals and what a server held outside its static share at a tight fraction
# (benchmark/results/memory.md: H100 2026-11-26, H200 2026-11-28)
GIB_ = 1 << 30
MEASURED_OUTSIDE_STATIC = {
    "H100": (79.1787 * GIB_, [0.863, 0.870, 0.931]),
    "H200": (139.8007 * GIB_, [0.882, 0.897]),
}


def test_the_first_tight_fraction_leaves_the_target_free_on_the_measured_gpus():
    """The tight server's first fraction comes from the GPU's size: on the GPUs measured it
    leaves between half the target and the limit free, so one server usually does (the lane's
    time), and a second try from what the first left lands near the target."""
    mod = _bench_memory()
    for gpu, (total, outside) in MEASURED_OUTSIDE_STATIC.items():
        fraction = mod.first_tight_fraction(int(total))
        for gib in outside:
            free = (1 - fraction) * total - gib * GIB_
            assert mod.TIGHT_FREE / 2 < free < mod.TIGHT_LIMIT, (gpu, fraction, gib, free / GIB_)
        # a first server that held 0.4 GiB less than the estimate: the next try lands on target
        free = (1 - fraction) * total - (mod.OUTSIDE_STATIC - 0.4 * GIB_)
        nxt = mod.next_tight_fraction(fraction, int(free), int(total))
        left = (1 - nxt) * total - (mod.OUTSIDE_STATIC - 0.4 * GIB_)
        assert abs(left - mod.TIGHT_FREE) < 0.01 * GIB_, (gpu, nxt, left / GIB_)


def _tight_plan(monkeypatch, tmp_path, argv, outcomes):
    """``bench_memory.main(argv)`` with each server replaced by the next of ``outcomes``
    (the free GiB it leaves, or None: it exits; served always): the servers started, as
    (config, fraction, role), and main's exit status."""
    mod = _bench_memory()
    started, total = [], 100 * GIB_
    outcomes = list(outcomes)

    def run_child(args, name, fraction, log_path, stub_dir, tight):
        role = "control" if tight and name == "off" else "tight" if tight else ""
        started.append((name, fraction, role))
        free = outcomes.pop(0)
        if free is None:
            return None
        return dict(
            config=name,
            fraction=mod.first_tight_fraction(total) if fraction is None else fraction,
            max_total_num_tokens=1000,
            kv_canary_memory=None,
            gpu_total=total,
            gpu_used_idle=total - int(free * GIB_),
            gpu_used_peak=total - int(free * GIB_),
            requests=4,
            served=4,
            prompt_tokens=5000,
            output_tokens=32,
        )

    monkeypatch.setattr(mod, "run_child", run_child)
    monkeypatch.setattr(mod, "gpu_name", lambda smoke: "test GPU")
    rc = mod.main([*argv, "--out", str(tmp_path / "m.jsonl")])
    assert not outcomes, outcomes
    return started, rc, mod


def test_the_tight_lane_starts_one_server_from_the_gpus_size_and_tries_once_more(
    monkeypatch, tmp_path
):
    started, rc, mod = _tight_plan(
        monkeypatch, tmp_path, ["--configs", "off", "--only-tight"], [0.55]
    )
    assert (started, rc) == ([("raise+token", None, "tight")], 0)
    # a first server that left the limit or more free: one more, from what it left
    started, rc, mod = _tight_plan(
        monkeypatch, tmp_path, ["--configs", "off", "--only-tight"], [1.2, 0.6]
    )
    first = mod.first_tight_fraction(100 * GIB_)
    second = mod.next_tight_fraction(first, int(1.2 * GIB_), 100 * GIB_)
    assert second > first and rc == 0
    assert started == [("raise+token", None, "tight"), ("raise+token", second, "tight")]
    # still too much free after the second: failed, no third server
    started, rc, _ = _tight_plan(
        monkeypatch, tmp_path, ["--configs", "off", "--only-tight"], [1.2, 1.1]
    )
    assert len(started) == 2 and rc == 1
    # a tight server that exits: the canary-off control at its fraction
    started, rc, _ = _tight_plan(
        monkeypatch, tmp_path, ["--configs", "off", "--only-tight"], [None, 0.6]
    )
    assert started == [("raise+token", None, "tight"), ("off", None, "control")] and rc == 1
    # the full run: the servers at --fraction, then the tight one from the GPU's size
    started, rc, _ = _tight_plan(monkeypatch, tmp_path, ["--configs", "off,raise"], [40, 40, 0.5])
    assert [s[2] for s in started] == ["", "", "tight"] and started[2][1] is None and rc == 0


def test_only_tight_refuses_what_it_cannot_run(monkeypatch, tmp_path):
    for argv in (["--only-tight"], ["--configs", "off", "--only-tight", "--no-tight"]):
        with pytest.raises(SystemExit) as e:
            _tight_plan(monkeypatch, tmp_path, argv, [])
        assert e.value.code == 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
