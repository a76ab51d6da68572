"""The GPU suite as lanes on one GPU, derived from the test files' own CI declarations
(docs/architecture.md, "Tests").

Every test file under ``test/registered/kv_canary`` declares its CI suites the way sglang's
``test/registered/`` files do (``sglang.test.ci.ci_register``): ``register_cpu_ci(...)`` and,
when it holds ``cuda``-marked tests, one ``register_cuda_ci(est_time=..., ...)``. A CUDA file
is one lane (named after the file: ``test_e2e_swa_gpu.py`` -> ``e2e_swa_gpu``), or, when it
also assigns a module-level ``GPU_LANES = {name: (pytest -k expression, est. seconds)}``, one
lane per entry. Each lane is one ``pytest -m cuda`` process; lanes run side by side, longest
first, at most ``--jobs`` at once; a lane declared ``(expression, seconds, "alone")`` runs by
itself after all the others (it needs the GPU's memory to itself).

    python3 test/gpu_lanes.py                 # every lane; exit 0 only if every lane passed
    python3 test/gpu_lanes.py e2e_swa_gpu hicache_mla   # only these lanes
    python3 test/gpu_lanes.py --list          # lanes, files, selections, estimates
    python3 test/gpu_lanes.py --check         # collect only: every cuda test in one lane

Each lane prints one line when it ends (``lane NAME: N passed, M failed, S s``) and the lines
are printed together at the end. Logs: ``--out`` (default ``$OUT`` or ``gpu_lanes_out``).

Before the lanes, the import path (``$PYTHONPATH``'s directories and this project's ``python/``)
is byte-compiled once. The device's bundles install sglang and its dependencies without
bytecode and its Python runs with ``-B`` (no ``.pyc`` written), so otherwise each of the
suite's few hundred processes (pytest, each server's engine, scheduler and detokenizer)
compiles sglang's sources again: tens of CPU seconds each, on a machine the lanes keep
CPU-bound (``--no-precompile`` skips it).

While the lanes run, :class:`CpuAccount` adds up where the CPU time goes (by kind of process and
by lane; printed before the lane lines, written to ``OUT/cpu_account.json``; the suite is bound
by CPU, docs/architecture.md, "Registration and the GPU lanes"); ``--no-cpu-account`` skips it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

REPO = pathlib.Path(__file__).resolve().parents[1]
TEST_DIR = REPO / "test" / "registered" / "kv_canary"
LANES_VAR = "GPU_LANES"
# a GPU_LANES entry's third element: the lane runs alone, after every other lane (it measures
# the GPU's memory, or sizes a server from the GPU's free memory)
ALONE = "alone"
# test/gpu_lanes.sh lists the lanes between these lines, rendered from the declarations
# (``--sync-sh`` rewrites it; ``--check`` fails while it is stale)
LANES_SH = REPO / "test" / "gpu_lanes.sh"
SH_BEGIN = "# Lanes (python3 test/gpu_lanes.py --sync-sh writes this list; --check compares it):"
SH_END = "# (end of lanes)"


class LaneDeclarationError(ValueError):
    """A test file's CI declarations do not make a lane set (named file and what is wrong)."""


@dataclasses.dataclass(frozen=True)
class Lane:
    name: str
    file: pathlib.Path
    select: Optional[str]  # pytest -k expression; None: the whole file
    est_seconds: float
    alone: bool = False  # runs by itself, after the other lanes

    def pytest_args(self) -> List[str]:
        path = self.file.relative_to(REPO) if self.file.is_relative_to(REPO) else self.file
        args = [str(path), "-m", "cuda"]
        return args + (["-k", self.select] if self.select else [])


@dataclasses.dataclass(frozen=True)
class LaneResult:
    name: str
    passed: int
    failed: int
    seconds: float
    returncode: Optional[int]  # None: stopped at the lane's time limit

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.failed == 0 and self.passed > 0

    def line(self) -> str:
        tail = "" if self.returncode is not None else " (timed out)"
        if self.returncode not in (0, None) and self.failed == 0:
            tail = f" (pytest exit {self.returncode})"
        return (
            f"lane {self.name}: {self.passed} passed, {self.failed} failed, "
            f"{self.seconds:.0f} s{tail}"
        )


def test_files(test_dir: pathlib.Path = TEST_DIR) -> List[pathlib.Path]:
    return sorted(test_dir.glob("test_*.py"))


def _module_lanes(path: pathlib.Path, tree: ast.Module) -> Optional[Dict[str, tuple]]:
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
                    and (len(v) == 2 or v[2] == ALONE)
                    for k, v in value.items()
                )
            ):
                raise LaneDeclarationError(
                    f"{path.name}: {LANES_VAR} must map each lane name to a "
                    f"(-k expression, estimated seconds) pair, or a triple ending in "
                    f"{ALONE!r} for a lane that needs the GPU to itself; got {value!r}"
                )
            return value
    return None


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
    if declared is None:
        stem = path.stem[len("test_") :]
        return [Lane(stem, path, None, cuda[0].est_time)]
    total = sum(v[1] for v in declared.values())
    if abs(total - cuda[0].est_time) > 1e-6:
        raise LaneDeclarationError(
            f"{path.name}: register_cuda_ci(est_time={cuda[0].est_time:g}) but its lanes "
            f"add up to {total:g} s; est_time is the whole file's time"
        )
    return [Lane(name, path, v[0], v[1], alone=len(v) == 3) for name, v in declared.items()]


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
        + (" (alone, after the others)" if lane.alone else "")
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


_COUNT_RE = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected)")


def parse_pytest_counts(output: str) -> Dict[str, int]:
    """Counts from pytest's closing summary line (``== 3 passed, 1 failed in 12.3s ==``);
    errors count as failures. Empty dict when no summary line is found."""
    for line in reversed(output.splitlines()):
        if re.search(r"\b(passed|failed|errors?|no tests ran)\b", line) and " in " in line:
            counts: Dict[str, int] = {}
            for n, word in _COUNT_RE.findall(line):
                key = "failed" if word.startswith("error") else word
                counts[key] = counts.get(key, 0) + int(n)
            return counts
    return {}


_PROGRESS_RE = re.compile(r"^([.FEsxX]+)\s*(\[\s*\d+%\])?$")


def parse_pytest_progress(output: str) -> Dict[str, int]:
    """Counts from ``pytest -q``'s progress characters, for a run stopped before its closing
    line (``.`` passed, ``F`` / ``E`` failed)."""
    chars = "".join(m.group(1) for m in map(_PROGRESS_RE.match, output.splitlines()) if m)
    return {"passed": chars.count("."), "failed": chars.count("F") + chars.count("E")}


# process kinds of the CPU account, first match wins: (kind, where, pattern); ``comm`` is the
# kernel's name of the executable, ``cmd`` the command line (sglang retitles its subprocesses)
CPU_KINDS = (
    ("scheduler", "cmd", re.compile(r"sglang::scheduler")),
    ("detokenizer", "cmd", re.compile(r"sglang::detokenizer")),
    (
        "native compiler",
        "comm",
        re.compile(
            r"^(cicc|ptxas|nvcc|nvlink|fatbinary|nvdisasm|cc1|cc1plus|gcc|g\+\+|c\+\+|as|ld|"
            r"collect2|ninja)$"
        ),
    ),
    ("pytest", "cmd", re.compile(r"-m pytest")),
    ("engine (workload, demo)", "cmd", re.compile(r"e2e_support/|kv_canary\.demo")),
)


def cpu_kind(comm: str, cmd: str) -> str:
    for kind, where, pattern in CPU_KINDS:
        if pattern.search(comm if where == "comm" else cmd):
            return kind
    return "other"


@dataclasses.dataclass
class _Seen:
    ppid: int
    cpu_s: float  # user + system, at the last sample
    first_s: float  # monotonic time of the first and the last sample that saw it
    last_s: float
    kind: str
    lane: Optional[str]
    command: str  # the command line, digits blanked, at most 90 characters


class CpuAccount:
    """Where the suite's CPU time goes: samples ``/proc`` every ``interval`` seconds while the
    lanes run and adds up each process's user + system time by kind (:data:`CPU_KINDS`) and by
    lane (the lane whose pytest it descends from). A process's time after its last sample is
    lost (at most ``interval`` s each). Linux only; elsewhere it records nothing."""

    def __init__(self, interval: float = 2.0):
        self.interval = interval
        self.lane_roots: Dict[int, str] = {}
        self.seen: Dict[int, _Seen] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.t0 = time.monotonic()

    def add_lane(self, pid: int, name: str) -> None:
        self.lane_roots[pid] = name

    def start(self) -> "CpuAccount":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def _lane_of(self, pid: int, ppids: Dict[int, int]) -> Optional[str]:
        for _ in range(32):
            if pid in self.lane_roots:
                return self.lane_roots[pid]
            pid = ppids.get(pid, self.seen[pid].ppid if pid in self.seen else 0)
            if pid <= 1:
                return None
        return None

    def sample(self) -> None:
        now = time.monotonic()
        stats: Dict[int, Tuple[int, float, str, str]] = {}
        for entry in pathlib.Path("/proc").iterdir() if pathlib.Path("/proc").is_dir() else ():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone between the listing and the read
                continue
            comm = stat[stat.find("(") + 1 : stat.rfind(")")]
            fields = stat[stat.rfind(")") + 2 :].split()
            # fields[0] is the state (stat's 3rd field): ppid 4th, utime 14th, stime 15th
            cpu = (int(fields[11]) + int(fields[12])) / self._tick
            stats[int(entry.name)] = (int(fields[1]), cpu, comm, cmd)
        ppids = {pid: v[0] for pid, v in stats.items()}
        for pid, (ppid, cpu, comm, cmd) in stats.items():
            old = self.seen.get(pid)
            kind = cpu_kind(comm, cmd)
            command = re.sub(r"\d+", "N", (cmd or f"[{comm}]").strip())[:90]
            if old is None:
                self.seen[pid] = _Seen(
                    ppid, cpu, now, now, kind, self._lane_of(pid, ppids), command
                )
            else:
                old.cpu_s, old.last_s, old.kind, old.command = cpu, now, kind, command
                old.lane = old.lane or self._lane_of(pid, ppids)

    def report(self) -> dict:
        """``{"seconds", "cores", "cpu_s", "kinds": {kind: {processes, cpu_s, alive_s,
        top}}, "lanes": {lane: cpu_s}}`` of the processes seen while the lanes ran (the lanes'
        own); ``top``: the kind's three costliest command lines, ``[command, processes,
        cpu_s]``."""
        mine = [s for s in self.seen.values() if s.lane is not None]
        kinds: Dict[str, dict] = {}
        lanes: Dict[str, float] = {}
        commands: Dict[Tuple[str, str], List[float]] = {}
        for s in mine:
            k = kinds.setdefault(s.kind, dict(processes=0, cpu_s=0.0, alive_s=0.0))
            k["processes"] += 1
            k["cpu_s"] += s.cpu_s
            k["alive_s"] += s.last_s - s.first_s
            lanes[s.lane] = lanes.get(s.lane, 0.0) + s.cpu_s
            c = commands.setdefault((s.kind, s.command), [0, 0.0])
            c[0] += 1
            c[1] += s.cpu_s
        for kind, k in kinds.items():
            top = sorted(
                ((cmd, n, cpu) for (kd, cmd), (n, cpu) in commands.items() if kd == kind),
                key=lambda t: -t[2],
            )[:3]
            k["top"] = [[cmd, n, round(cpu, 1)] for cmd, n, cpu in top]
        return dict(
            seconds=time.monotonic() - self.t0,
            cores=os.cpu_count(),
            cpu_s=sum(s.cpu_s for s in mine),
            kinds=dict(sorted(kinds.items(), key=lambda kv: -kv[1]["cpu_s"])),
            lanes=dict(sorted(lanes.items(), key=lambda kv: -kv[1])),
        )


def format_cpu_report(rep: dict) -> str:
    share = rep["cpu_s"] / max(1e-9, rep["seconds"] * (rep["cores"] or 1))
    lines = [
        f"gpu_lanes CPU: {rep['cpu_s']:.0f} CPU-s in {rep['seconds']:.0f} s on "
        f"{rep['cores']} cores ({share:.0%} of the machine)"
    ]
    for kind, k in rep["kinds"].items():
        busy = k["cpu_s"] / k["alive_s"] if k["alive_s"] else 0.0
        lines.append(
            f"  {kind}: {k['processes']} processes, {k['cpu_s']:.0f} CPU-s "
            f"({busy:.0%} of their {k['alive_s']:.0f} s alive)"
        )
        lines += [f"    {cpu:.0f} CPU-s, {n} x {cmd}" for cmd, n, cpu in k.get("top", ())]
    lines.append("  by lane: " + ", ".join(f"{n} {s:.0f}" for n, s in rep["lanes"].items()))
    return "\n".join(lines)


def run_lane(
    lane: Lane, out_dir: pathlib.Path, timeout: float, account: Optional[CpuAccount] = None
) -> LaneResult:
    log = out_dir / f"{lane.name}.log"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-ra",
        "-p",
        "no:cacheprovider",
        "--tb=short",
        "-o",
        "addopts=",
        "--durations=0",
        *lane.pytest_args(),
    ]
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        if account is not None:
            account.add_lane(proc.pid, lane.name)
        try:
            rc: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    counts = parse_pytest_counts(text) or parse_pytest_progress(text)
    return LaneResult(lane.name, counts.get("passed", 0), counts.get("failed", 0), seconds, rc)


def run_lanes(
    lanes: Sequence[Lane],
    *,
    jobs: int,
    timeout: float,
    out_dir: pathlib.Path,
    account: Optional[CpuAccount] = None,
) -> List[LaneResult]:
    """Run ``lanes`` longest first, ``jobs`` at a time, then the ``alone`` lanes one by one;
    print each lane's line as it ends."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shared = [lane for lane in lanes if not lane.alone]
    results = _run_queue(shared, jobs=jobs, timeout=timeout, out_dir=out_dir, account=account)
    results += _run_queue(
        [lane for lane in lanes if lane.alone],
        jobs=1,
        timeout=timeout,
        out_dir=out_dir,
        account=account,
    )
    order = {lane.name: i for i, lane in enumerate(lanes)}
    return sorted(results, key=lambda r: order[r.name])


def _run_queue(
    lanes: Sequence[Lane],
    *,
    jobs: int,
    timeout: float,
    out_dir: pathlib.Path,
    account: Optional[CpuAccount],
) -> List[LaneResult]:
    queue = sorted(lanes, key=lambda lane: (-lane.est_seconds, lane.name))
    results: List[LaneResult] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                lane = queue.pop(0)
            result = run_lane(lane, out_dir, timeout, account)
            with lock:
                results.append(result)
                print(result.line(), flush=True)

    threads = [threading.Thread(target=worker) for _ in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


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
        help="seconds per lane before it is stopped (default 600)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_lanes_out"))
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
            print(f"{lane.name}\t{lane.est_seconds:g}s\t{' '.join(lane.pytest_args())}")
        return 0
    out_dir = pathlib.Path(args.out)
    # a server compiling with torch's inductor would otherwise start a pool of compile workers,
    # a process per core, each importing torch: on a machine the lanes keep CPU-bound, compiling
    # the few kernels in the server's own process costs less
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    account = None if args.no_cpu_account else CpuAccount().start()
    results = run_lanes(
        lanes, jobs=args.jobs, timeout=args.timeout, out_dir=out_dir, account=account
    )
    if account is not None:
        account.stop()
        rep = account.report()
        (out_dir / "cpu_account.json").write_text(json.dumps(rep, indent=1))
        print(format_cpu_report(rep))
    print("\n".join(["", "== GPU lanes =="] + [r.line() for r in results]))
    bad = [r.name for r in results if not r.ok]
    print(
        f"gpu_lanes: {len(results) - len(bad)} of {len(results)} lanes passed in "
        f"{time.monotonic() - t0:.0f} s" + (f"; failed: {', '.join(bad)}" if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
