"""The GPU suite as lanes over the machine's GPUs, derived from the test files' own CI
declarations (docs/testing.md, "The GPU suite").

Every test file under ``test/registered/kv_canary`` declares its CI suites the way sglang's
``test/registered/`` files do (``sglang.test.ci.ci_register``): ``register_cpu_ci(...)`` and,
when it holds ``cuda``-marked tests, one ``register_cuda_ci(est_time=..., runner_config=...)``
(``"2-gpu..."``: its tests need two GPUs). A CUDA file is one lane (named after the file:
``test_e2e_swa_gpu.py`` -> ``e2e_swa_gpu``), or, when it also assigns a module-level
``GPU_LANES = {name: (pytest -k expression, est. seconds[, options])}``, one lane per entry;
``options`` is ``"alone"`` or a dict ``{"alone": bool, "gpus": int}`` (default: not alone, the
file's runner_config GPUs). Each lane is one ``pytest -m cuda`` process on the GPUs it is given
(``CUDA_VISIBLE_DEVICES``); placement, "alone" lanes and lanes needing more GPUs than there are:
``gpu_lanes_run.py``.

    python3 test/gpu_lanes.py                 # every lane; exit 0 only if none failed
    python3 test/gpu_lanes.py e2e_swa_gpu hicache_mla   # only these lanes
    python3 test/gpu_lanes.py --gpus 0,1      # these GPUs (default: $CUDA_VISIBLE_DEVICES,
                                              # else every GPU nvidia-smi lists)
    python3 test/gpu_lanes.py --list          # lanes, files, selections, estimates, GPUs
    python3 test/gpu_lanes.py --check         # collect only: every cuda test in one lane

Each lane prints one line when it ends (``lane NAME: N passed, M failed, S s, GPU g``) and the
lines are printed together at the end. Logs: ``--out`` (default ``$OUT`` or ``gpu_lanes_out``).

Before the lanes, the import path (``$PYTHONPATH``'s directories and this project's ``python/``)
is byte-compiled once. The device's bundles install sglang and its dependencies without
bytecode and its Python runs with ``-B`` (no ``.pyc`` written), so otherwise each of the
suite's few hundred processes (pytest, each server's engine, scheduler and detokenizer)
compiles sglang's sources again: tens of CPU seconds each, on a machine the lanes keep
CPU-bound (``--no-precompile`` skips it).

While the lanes run, :class:`CpuAccount` (``gpu_lanes_cpu_account.py``) adds up where the CPU
time goes (by kind of process and by lane; printed before the lane lines, written to
``OUT/cpu_account.json``); ``--no-cpu-account`` skips it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import re
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from gpu_lanes_cpu_account import CPU_KINDS, CpuAccount, cpu_kind, format_cpu_report  # noqa: F401
from gpu_lanes_run import (  # noqa: F401
    GpuDiscoveryError,
    GpuPlacer,
    Lane,
    LaneResult,
    parse_gpus,
    parse_pytest_counts,
    parse_pytest_progress,
    run_lanes,
    visible_gpus,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
TEST_DIR = REPO / "test" / "registered" / "kv_canary"
LANES_VAR = "GPU_LANES"
# a GPU_LANES entry's options: "alone" (no other lane on its GPUs: it measures the GPU's memory,
# or sizes a server from the GPU's free memory), or a dict of these keys
ALONE = "alone"
OPTION_KEYS = {"alone": bool, "gpus": int}
# test/gpu_lanes.sh lists the lanes between these lines, rendered from the declarations
# (``--sync-sh`` rewrites it; ``--check`` fails while it is stale)
LANES_SH = REPO / "test" / "gpu_lanes.sh"
SH_BEGIN = "# Lanes (python3 test/gpu_lanes.py --sync-sh writes this list; --check compares it):"
SH_END = "# (end of lanes)"


class LaneDeclarationError(ValueError):
    """A test file's CI declarations do not make a lane set (named file and what is wrong)."""


def test_files(test_dir: pathlib.Path = TEST_DIR) -> List[pathlib.Path]:
    return sorted(test_dir.glob("test_*.py"))


def _module_lanes(path: pathlib.Path, tree: ast.Module) -> Optional[Dict[str, tuple]]:
    """The file's ``GPU_LANES``: name -> (-k expression, seconds, options dict), or None."""
    for stmt in tree.body:
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == LANES_VAR
        ):
            try:
                value = ast.literal_eval(stmt.value)
            except ValueError as e:
                raise LaneDeclarationError(
                    f"{path.name}: {LANES_VAR} must be a literal dict "
                    f"of name -> (-k expression, seconds): {e}"
                ) from e
            if (
                not isinstance(value, dict)
                or not value
                or not all(
                    isinstance(k, str)
                    and isinstance(v, tuple)
                    and len(v) in (2, 3)
                    and isinstance(v[0], str)
                    and isinstance(v[1], (int, float))
                    for k, v in value.items()
                )
            ):
                raise LaneDeclarationError(
                    f"{path.name}: {LANES_VAR} must map each lane name to a "
                    f"(-k expression, estimated seconds[, options]) tuple; got {value!r}"
                )
            return {
                name: (v[0], v[1], _lane_options(path, name, v[2] if len(v) == 3 else {}))
                for name, v in value.items()
            }
    return None


def _lane_options(path: pathlib.Path, name: str, options) -> Dict[str, object]:
    """A ``GPU_LANES`` entry's options as a dict of :data:`OPTION_KEYS` (parsed here once)."""
    if options == ALONE:
        return {"alone": True}
    if isinstance(options, dict) and all(
        k in OPTION_KEYS and type(v) is OPTION_KEYS[k] for k, v in options.items()
    ):
        if options.get("gpus", 1) < 1:
            raise LaneDeclarationError(f"{path.name}: lane {name}: gpus must be >= 1")
        return dict(options)
    raise LaneDeclarationError(
        f"{path.name}: lane {name}: options must be {ALONE!r} (no other lane on its GPUs) or a "
        f"dict of {', '.join(f'{k!r}: {t.__name__}' for k, t in OPTION_KEYS.items())}; "
        f"got {options!r}"
    )


def runner_gpus(path: pathlib.Path, runner_config: Optional[str]) -> int:
    """The GPUs a ``register_cuda_ci(runner_config=...)`` asks for: sglang's runner names start
    with the count (``"1-gpu-small"``, ``"2-gpu"``, ``"4-gpu-h100"``); none given: one."""
    if runner_config is None:
        return 1
    m = re.match(r"^(\d+)-gpu", runner_config)
    if m is None or int(m.group(1)) < 1:
        raise LaneDeclarationError(
            f"{path.name}: runner_config {runner_config!r} does not start with a GPU count "
            "(like '1-gpu-small' or '2-gpu')"
        )
    return int(m.group(1))


def ci_register():
    """sglang's ``sglang.test.ci.ci_register`` (standard library only), loaded from its file:
    importing it as ``sglang.test.ci...`` would first run ``sglang/__init__.py``, which imports
    torch and transformers, some 15 CPU seconds before the first lane could start."""
    import importlib.util

    name = "_gpu_lanes_ci_register"
    if name not in sys.modules:
        spec = importlib.util.find_spec("sglang")  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise LaneDeclarationError(
                "sglang is not installed: its ci_register declares the lanes"
            )
        path = pathlib.Path(spec.submodule_search_locations[0]) / "test" / "ci" / "ci_register.py"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses look their module up while it executes
        module_spec.loader.exec_module(module)
    return sys.modules[name]


def lanes_of_file(path: pathlib.Path) -> List[Lane]:
    """The lanes one test file declares (none when it registers no CUDA suite)."""
    reg = ci_register()
    registries, _ = reg.ut_parse_one_file(str(path))
    cuda = [r for r in registries if r.backend == reg.HWBackend.CUDA and r.disabled is None]
    declared = _module_lanes(path, ast.parse(path.read_text(), str(path)))
    if not cuda:
        if declared is not None:
            raise LaneDeclarationError(
                f"{path.name}: assigns {LANES_VAR} but registers no CUDA suite (register_cuda_ci)"
            )
        return []
    if len(cuda) != 1:
        raise LaneDeclarationError(
            f"{path.name}: {len(cuda)} register_cuda_ci calls; one per file (its lanes split it)"
        )
    gpus = runner_gpus(path, cuda[0].runner_config)
    if declared is None:
        stem = path.stem[len("test_") :]
        return [Lane(stem, path, None, cuda[0].est_time, gpus=gpus)]
    total = sum(v[1] for v in declared.values())
    if abs(total - cuda[0].est_time) > 1e-6:
        raise LaneDeclarationError(
            f"{path.name}: register_cuda_ci(est_time={cuda[0].est_time:g}) but its lanes "
            f"add up to {total:g} s; est_time is the whole file's time"
        )
    return [
        Lane(
            name,
            path,
            select,
            seconds,
            alone=options.get("alone", False),
            gpus=options.get("gpus", gpus),
        )
        for name, (select, seconds, options) in declared.items()
    ]


def all_lanes(files: Optional[Sequence[pathlib.Path]] = None) -> List[Lane]:
    lanes = [lane for f in (files or test_files()) for lane in lanes_of_file(f)]
    seen: Dict[str, pathlib.Path] = {}
    for lane in lanes:
        if lane.name in seen:
            raise LaneDeclarationError(
                f"lane {lane.name!r} declared by {seen[lane.name].name} and {lane.file.name}"
            )
        seen[lane.name] = lane.file
    return lanes


def sh_listing(lanes: Sequence[Lane]) -> str:
    """The lane list of ``test/gpu_lanes.sh``: one comment line per lane, the pytest
    arguments it runs."""
    rows = [
        f"#   {lane.name:<20} {lane.pytest_args()[0]}"
        + (f" -k {lane.select}" if lane.select else "")
        + (f" ({lane.gpus} GPUs)" if lane.gpus > 1 else "")
        + (" (alone: no other lane on its GPU)" if lane.alone else "")
        for lane in lanes
    ]
    return "\n".join([SH_BEGIN, *rows, SH_END])


def _sh_with_listing(text: str, listing: str) -> str:
    begin, end = text.find(SH_BEGIN), text.find(SH_END)
    if begin < 0 or end < begin:
        raise LaneDeclarationError(
            f"{LANES_SH.name}: no lane list between {SH_BEGIN!r} and {SH_END!r}"
        )
    return text[:begin] + listing + text[end + len(SH_END) :]


def sh_listing_stale(lanes: Sequence[Lane]) -> bool:
    text = LANES_SH.read_text()
    return _sh_with_listing(text, sh_listing(lanes)) != text


def sync_sh(lanes: Sequence[Lane]) -> None:
    LANES_SH.write_text(_sh_with_listing(LANES_SH.read_text(), sh_listing(lanes)))


class _Collector:
    """pytest plugin: each collected item's node id, whether it is ``cuda``-marked, and which
    of its file's lane expressions select it."""

    def __init__(self, lanes: Sequence[Lane]):
        self.lanes = lanes
        self.items: List[dict] = []

    def pytest_collection_modifyitems(self, items):
        from _pytest.mark import KeywordMatcher
        from _pytest.mark.expression import Expression

        for item in items:
            path = pathlib.Path(str(item.path)).resolve()
            matcher = KeywordMatcher.from_item(item)
            selected = [
                lane.name
                for lane in self.lanes
                if lane.file.resolve() == path
                and (lane.select is None or Expression.compile(lane.select).evaluate(matcher))
            ]
            self.items.append(
                dict(
                    nodeid=item.nodeid,
                    file=path.name,
                    cuda=item.get_closest_marker("cuda") is not None,
                    lanes=selected,
                )
            )


def check(files: Optional[Sequence[pathlib.Path]] = None) -> List[str]:
    """Problems with the lane set, collecting (not running) every test file: each
    ``cuda``-marked test in exactly one lane, no lane empty, no non-cuda test in a lane's file
    selected as GPU work. Empty list: all good."""
    import pytest

    collect_tests = ci_register().collect_tests

    files = list(files or test_files())
    try:  # sglang's own check: each file registered, each with a __main__ entry
        collect_tests([str(f) for f in files], sanity_check=True)
    except ValueError as e:
        return [str(e)]
    lanes = all_lanes(files)
    collector = _Collector(lanes)
    rc = pytest.main(
        ["--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *map(str, files)],
        plugins=[collector],
    )
    if rc != 0:
        return [f"pytest could not collect the test files (exit {int(rc)})"]
    problems = []
    per_lane = {lane.name: 0 for lane in lanes}
    for item in collector.items:
        if item["cuda"]:
            if len(item["lanes"]) != 1:
                problems.append(
                    f"{item['nodeid']}: cuda test in {len(item['lanes'])} lanes "
                    f"({', '.join(item['lanes']) or 'none'}); needs exactly one"
                )
            for name in item["lanes"]:
                per_lane[name] += 1
    problems += [f"lane {name}: selects no cuda test" for name, n in per_lane.items() if n == 0]
    if {f.resolve() for f in files} == {f.resolve() for f in test_files()} and sh_listing_stale(
        lanes
    ):
        problems.append(
            f"{LANES_SH.name}: its lane list is stale; run python3 test/gpu_lanes.py --sync-sh"
        )
    return problems


def import_path_dirs() -> List[pathlib.Path]:
    """The directories whose modules the lanes import from source: ``$PYTHONPATH``'s
    directories and this project's ``python/`` (the interpreter's own site-packages are
    installed with bytecode)."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    dirs: List[pathlib.Path] = []
    for d in [*map(pathlib.Path, entries), REPO / "python"]:
        d = d.resolve()
        if d.is_dir() and d not in dirs:
            dirs.append(d)
    return dirs


def precompile(dirs: Sequence[pathlib.Path]) -> Tuple[bool, float]:
    """Byte-compile every module under ``dirs`` (``compileall``, one worker per core; an
    up-to-date ``.pyc`` is kept). Returns (every file compiled, seconds). A file that does not
    compile is left to fail where it is imported."""
    import compileall

    t0 = time.monotonic()
    ok = True
    for d in dirs:
        ok = bool(compileall.compile_dir(str(d), quiet=2, workers=0)) and ok
    return ok, time.monotonic() - t0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lanes", nargs="*", help="lane names (default: all)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=int(os.environ.get("GPU_LANES_JOBS", max(1, (os.cpu_count() or 4) - 2))),
        help="lanes at once (default: CPU cores - 2, or $GPU_LANES_JOBS); "
        "the lanes' servers are CPU-bound while they start",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=float(os.environ.get("GPU_LANES_TIMEOUT", 600)),
        help="seconds per lane before it is stopped, or twice its estimate when longer "
        "(default 600)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_lanes_out"))
    parser.add_argument(
        "--gpus",
        default=os.environ.get("GPU_LANES_GPUS"),
        help="GPUs to spread the lanes over: a count or ids (0,1); default: $GPU_LANES_GPUS, "
        "else $CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists",
    )
    parser.add_argument(
        "--test-dir",
        type=pathlib.Path,
        default=TEST_DIR,
        help="where the test files are (default: test/registered/kv_canary)",
    )
    parser.add_argument("--list", action="store_true", help="print the lanes and exit")
    parser.add_argument(
        "--check", action="store_true", help="collect only: every cuda test in exactly one lane"
    )
    parser.add_argument(
        "--no-precompile",
        action="store_true",
        help="do not byte-compile the import path before the lanes",
    )
    parser.add_argument(
        "--no-cpu-account",
        action="store_true",
        help="do not sample where the lanes' CPU time goes (printed at the end "
        "and written to OUT/cpu_account.json)",
    )
    parser.add_argument(
        "--sync-sh", action="store_true", help="rewrite the lane list in test/gpu_lanes.sh and exit"
    )
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0:
        parser.error("--jobs must be >= 1 and --timeout > 0")
    gpus: Tuple[str, ...] = ()
    if args.gpus is not None:
        try:
            gpus = parse_gpus(args.gpus)
        except ValueError as e:
            parser.error(str(e))
    t0 = time.monotonic()
    if not (args.list or args.check or args.sync_sh or args.no_precompile):
        dirs = import_path_dirs()
        ok, seconds = precompile(dirs)
        print(
            f"gpu_lanes: byte-compiled {', '.join(map(str, dirs))} in {seconds:.0f} s"
            + ("" if ok else " (some files did not compile)"),
            flush=True,
        )
    files = test_files(args.test_dir)
    try:
        lanes = all_lanes(files)
    except LaneDeclarationError as e:
        print(f"gpu_lanes: {e}", file=sys.stderr)
        return 2
    if args.sync_sh:
        sync_sh(lanes)
        return 0
    if args.check:
        problems = check(files)
        for p in problems:
            print(f"gpu_lanes: {p}", file=sys.stderr)
        print(json.dumps({"lanes": len(lanes), "problems": len(problems)}))
        return 1 if problems else 0
    if args.lanes:
        unknown = sorted(set(args.lanes) - {lane.name for lane in lanes})
        if unknown:
            parser.error(
                f"unknown lane(s) {', '.join(unknown)}; lanes: "
                f"{', '.join(lane.name for lane in lanes)}"
            )
        lanes = [lane for lane in lanes if lane.name in set(args.lanes)]
    if args.list:
        for lane in lanes:
            flags = ("alone, " if lane.alone else "") + f"{lane.gpus} GPU"
            print(f"{lane.name}\t{lane.est_seconds:g}s\t{flags}\t{' '.join(lane.pytest_args())}")
        return 0
    if not gpus:
        try:
            gpus = visible_gpus()
        except GpuDiscoveryError as e:
            print(f"gpu_lanes: {e}", file=sys.stderr)
            return 2
    print(f"gpu_lanes: {len(lanes)} lanes over GPU(s) {','.join(gpus)}, {args.jobs} at once")
    out_dir = pathlib.Path(args.out)
    # a server compiling with torch's inductor would otherwise start a pool of compile workers,
    # a process per core, each importing torch: on a machine the lanes keep CPU-bound, compiling
    # the few kernels in the server's own process costs less
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    account = None if args.no_cpu_account else CpuAccount().start()
    results = run_lanes(
        lanes, jobs=args.jobs, timeout=args.timeout, out_dir=out_dir, gpus=gpus, account=account
    )
    if account is not None:
        account.stop()
        rep = account.report()
        (out_dir / "cpu_account.json").write_text(json.dumps(rep, indent=1))
        print(format_cpu_report(rep))
    print("\n".join(["", "== GPU lanes =="] + [r.line() for r in results]))
    print(summary_line(results, time.monotonic() - t0, gpus))
    return 1 if any(not r.ok and r.skipped is None for r in results) else 0


def summary_line(results: Sequence[LaneResult], seconds: float, gpus: Sequence[str]) -> str:
    """``gpu_lanes: P of N lanes passed in S s on G GPUs (ids)[; failed: ...][; skipped: ...]``:
    the suite's last line. A skipped lane (more GPUs than here) is neither passed nor failed."""
    ran = [r for r in results if r.skipped is None]
    bad = [r.name for r in ran if not r.ok]
    skipped = [f"{r.name} ({r.skipped})" for r in results if r.skipped is not None]
    return (
        f"gpu_lanes: {len(ran) - len(bad)} of {len(ran)} lanes passed in {seconds:.0f} s on "
        f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} ({','.join(gpus)})"
        + (f"; failed: {', '.join(bad)}" if bad else "")
        + (f"; skipped: {', '.join(skipped)}" if skipped else "")
    )


if __name__ == "__main__":
    sys.exit(main())
