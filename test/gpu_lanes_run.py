"""Running the GPU suite's lanes over the machine's GPUs (``test/gpu_lanes.py`` declares them;
docs/testing.md, "The GPU suite").

Each lane is one ``pytest -m cuda`` process whose ``CUDA_VISIBLE_DEVICES`` names the GPUs it
was given. :class:`GpuPlacer` decides where a lane goes (pure: no processes, tested on the
CPU); :func:`run_lanes` starts the lanes, longest first, at most ``jobs`` at once, and polls
them:

- a shared lane goes to the GPU(s) with the least estimated work left (the estimated seconds
  of the lanes running there, less what they have run), several lanes to a GPU;
- an ``alone`` lane (it measures or sizes itself from the GPU's free memory) gets GPUs with
  nothing else on them for as long as it runs: with two GPUs or more it starts first, one GPU
  always kept for the shared lanes while they last; with one GPU it runs after every other lane;
- a lane that needs more GPUs than the machine has is skipped, and its line says so.

Standard library only.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import IO, Dict, List, Optional, Sequence, Tuple

REPO = pathlib.Path(__file__).resolve().parents[1]
POLL_SECONDS = 0.2


@dataclasses.dataclass(frozen=True)
class Lane:
    name: str
    file: pathlib.Path
    select: Optional[str]  # pytest -k expression; None: the whole file
    est_seconds: float
    alone: bool = False  # no other lane on its GPUs while it runs
    gpus: int = 1  # GPUs it needs (its processes see exactly these)

    def __post_init__(self):
        if self.gpus < 1:
            raise ValueError(f"lane {self.name}: gpus must be >= 1, got {self.gpus}")

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
    returncode: Optional[int]  # None: stopped at the lane's time limit, or skipped
    gpus: Tuple[str, ...] = ()  # the CUDA_VISIBLE_DEVICES it ran with
    skipped: Optional[str] = None  # why it did not run
    started: Optional[float] = None  # time.monotonic() when its process started

    @property
    def ok(self) -> bool:
        return (
            self.skipped is None and self.returncode == 0 and self.failed == 0 and self.passed > 0
        )

    def line(self) -> str:
        if self.skipped is not None:
            return f"lane {self.name}: skipped ({self.skipped})"
        tail = "" if self.returncode is not None else " (timed out)"
        if self.returncode not in (0, None) and self.failed == 0:
            tail = f" (pytest exit {self.returncode})"
        where = f", GPU{'s' if len(self.gpus) > 1 else ''} {','.join(self.gpus)}"
        return (
            f"lane {self.name}: {self.passed} passed, {self.failed} failed, "
            f"{self.seconds:.0f} s{where if self.gpus else ''}{tail}"
        )


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


class GpuDiscoveryError(RuntimeError):
    """No GPU list could be made (names what was tried)."""


def parse_gpus(value: str) -> Tuple[str, ...]:
    """``--gpus`` / ``$GPU_LANES_GPUS``: a count (``4``: GPUs 0-3) or a comma-separated list of
    ids as ``CUDA_VISIBLE_DEVICES`` takes them (``2,3``; one id alone with a comma: ``2,``)."""
    given = value = value.strip()
    if value.isdigit():
        if int(value) < 1:
            raise ValueError(
                f"--gpus {value!r}: give a count >= 1, or GPU ids with a comma (0,1; GPU 0 "
                "alone: 0,)"
            )
        return tuple(str(i) for i in range(int(value)))
    if value.endswith(",") and not value.endswith(",,"):
        value = value[:-1]
    ids = tuple(v.strip() for v in value.split(","))
    if not ids or any(not v for v in ids) or len(set(ids)) != len(ids):
        raise ValueError(
            f"--gpus {given!r}: give a count >= 1 or comma-separated distinct GPU ids (0,1)"
        )
    return ids


def visible_gpus(env: Optional[Dict[str, str]] = None) -> Tuple[str, ...]:
    """The GPUs the lanes may use: ``$CUDA_VISIBLE_DEVICES``'s entries when it is set, else
    each index ``nvidia-smi`` lists. Raises :class:`GpuDiscoveryError` when neither gives one."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = tuple(v.strip() for v in env["CUDA_VISIBLE_DEVICES"].split(",") if v.strip())
        if not ids:
            raise GpuDiscoveryError("CUDA_VISIBLE_DEVICES is set but names no GPU")
        return ids
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GpuDiscoveryError(f"nvidia-smi could not list the GPUs ({e}); pass --gpus") from e
    ids = tuple(line.strip() for line in out.stdout.splitlines() if line.strip())
    if out.returncode != 0 or not ids:
        raise GpuDiscoveryError(
            f"nvidia-smi listed no GPU (exit {out.returncode}: {out.stderr.strip()[:200]}); "
            "pass --gpus"
        )
    return ids


class GpuPlacer:
    """Which GPUs a lane starts on, given what runs where (see the module docstring).
    ``start`` and ``end`` keep the books; ``place`` only answers."""

    def __init__(self, gpus: Sequence[str]):
        if not gpus:
            raise ValueError("GpuPlacer: no GPU to place lanes on")
        self.gpus = tuple(gpus)
        self._ends: Dict[str, Dict[str, float]] = {g: {} for g in self.gpus}  # est. end
        self._alone: Dict[str, str] = {}  # GPU -> the alone lane holding it

    def fits(self, lane: Lane) -> bool:
        return lane.gpus <= len(self.gpus)

    def _left(self, gpu: str, now: float) -> float:
        return sum(max(end - now, 0.0) for end in self._ends[gpu].values())

    def place(self, lane: Lane, now: float, *, shared_left: bool) -> Optional[Tuple[str, ...]]:
        """The GPUs ``lane`` starts on now, or None while it must wait. ``shared_left``: shared
        lanes are still waiting or running (an alone lane then leaves them a GPU, or, on one
        GPU, waits for them)."""
        free = [g for g in self.gpus if g not in self._alone]
        if lane.alone:
            idle = [g for g in free if not self._ends[g]]
            keep = 1 if shared_left else 0  # GPUs left for the shared lanes (one GPU: it waits)
            if len(free) - lane.gpus < keep or len(idle) < lane.gpus:
                return None
            return tuple(idle[: lane.gpus])
        if len(free) < lane.gpus:
            return None
        order = sorted(free, key=lambda g: (self._left(g, now), len(self._ends[g])))
        return tuple(sorted(order[: lane.gpus], key=self.gpus.index))

    def start(self, lane: Lane, gpus: Sequence[str], now: float) -> None:
        for g in gpus:
            self._ends[g][lane.name] = now + lane.est_seconds
            if lane.alone:
                self._alone[g] = lane.name

    def end(self, lane: Lane, gpus: Sequence[str]) -> None:
        for g in gpus:
            self._ends[g].pop(lane.name, None)
            if self._alone.get(g) == lane.name:
                del self._alone[g]


@dataclasses.dataclass
class _Running:
    lane: Lane
    gpus: Tuple[str, ...]
    proc: subprocess.Popen
    log: IO[str]
    path: pathlib.Path
    t0: float


def _pytest_cmd(lane: Lane) -> List[str]:
    return [
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


def _start(
    lane: Lane, gpus: Tuple[str, ...], out_dir: pathlib.Path, account, share: Tuple[int, int]
) -> _Running:
    """Start ``lane`` on ``gpus``; ``share``: ``(i, n)``, lane i of the run's n, whose test
    servers pick their ports from share i of n (``KV_CANARY_PORT_SHARE``, read by
    ``server_harness.free_port``): lanes side by side never pick the same port."""
    path = out_dir / f"{lane.name}.log"
    cmd = _pytest_cmd(lane)
    log = open(path, "w")
    log.write(f"CUDA_VISIBLE_DEVICES={','.join(gpus)} " + " ".join(cmd) + "\n")
    log.flush()
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES=",".join(gpus),
        KV_CANARY_PORT_SHARE=f"{share[0]}/{share[1]}",
    )
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    if account is not None:
        account.add_lane(proc.pid, lane.name)
    return _Running(lane, gpus, proc, log, path, time.monotonic())


def _finish(run: _Running, rc: Optional[int]) -> LaneResult:
    run.log.close()
    seconds = time.monotonic() - run.t0
    text = run.path.read_text(errors="replace")
    counts = parse_pytest_counts(text) or parse_pytest_progress(text)
    return LaneResult(
        run.lane.name,
        counts.get("passed", 0),
        counts.get("failed", 0),
        seconds,
        rc,
        run.gpus,
        started=run.t0,
    )


def lane_limit(lane: Lane, timeout: float) -> float:
    """Seconds a lane may run before it is stopped: ``timeout``, or twice its estimate when
    that is longer."""
    return max(timeout, 2 * lane.est_seconds)


def run_lanes(
    lanes: Sequence[Lane],
    *,
    jobs: int,
    timeout: float,
    out_dir: pathlib.Path,
    gpus: Sequence[str] = ("0",),
    account=None,
) -> List[LaneResult]:
    """Run ``lanes`` over ``gpus`` (each lane's processes see only the GPUs it was given),
    longest first, at most ``jobs`` at once, each stopped after :func:`lane_limit` seconds;
    print each lane's line as it ends. Results in ``lanes``' order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    order = {lane.name: i for i, lane in enumerate(lanes)}
    placer = GpuPlacer(gpus)
    results: List[LaneResult] = []
    for lane in lanes:
        if not placer.fits(lane):
            results.append(
                LaneResult(
                    lane.name, 0, 0, 0.0, None,
                    skipped=f"needs {lane.gpus} GPUs, {len(placer.gpus)} here",
                )
            )  # fmt: skip
            print(results[-1].line(), flush=True)
    longest_first = sorted(
        (lane for lane in lanes if placer.fits(lane)), key=lambda x: (-x.est_seconds, x.name)
    )
    pending = [x for x in longest_first if x.alone] + [x for x in longest_first if not x.alone]
    running: List[_Running] = []
    while pending or running:
        now = time.monotonic()
        shared_left = any(not x.alone for x in pending) or any(not r.lane.alone for r in running)
        for lane in list(pending):
            if len(running) >= jobs:
                break
            where = placer.place(lane, now, shared_left=shared_left)
            if where is None:
                continue
            pending.remove(lane)
            placer.start(lane, where, now)
            running.append(_start(lane, where, out_dir, account, (order[lane.name], len(lanes))))
        time.sleep(POLL_SECONDS)
        for run in list(running):
            rc = run.proc.poll()
            if rc is None and time.monotonic() - run.t0 > lane_limit(run.lane, timeout):
                os.killpg(run.proc.pid, 9)
                run.proc.wait()
            elif rc is None:
                continue
            running.remove(run)
            placer.end(run.lane, run.gpus)
            results.append(_finish(run, rc))
            print(results[-1].line(), flush=True)
    return sorted(results, key=lambda r: order[r.name])
