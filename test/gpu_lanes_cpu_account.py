"""Where the GPU suite's CPU time goes (``test/gpu_lanes.py``; docs/testing.md, "The GPU
suite"): :class:`CpuAccount` samples ``/proc`` while the lanes run and adds up each process's user + system time by kind of process and by lane. Standard library
only; Linux only (elsewhere it records nothing)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import threading
import time
from typing import Dict, List, Optional, Tuple


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
    lost (at most ``interval`` s each). A process is known by its pid and start time: a pid the
    kernel hands out again (a busy machine's churn) is another process, not the same one's
    later sample. Linux only; elsewhere it records nothing."""

    def __init__(self, interval: float = 2.0, *, proc: str = "/proc"):
        self.interval = interval
        self.proc = pathlib.Path(proc)  # the process table (a test's stand-in elsewhere)
        self.lane_roots: Dict[int, str] = {}
        self.seen: Dict[Tuple[int, int], _Seen] = {}  # (pid, start time in ticks) -> it
        self._latest: Dict[int, Tuple[int, int]] = {}  # pid -> its latest process's key
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
            gone = self.seen.get(self._latest.get(pid, (0, 0)))
            pid = ppids.get(pid, gone.ppid if gone is not None else 0)
            if pid <= 1:
                return None
        return None

    def sample(self) -> None:
        now = time.monotonic()
        stats: Dict[int, Tuple[int, int, float, str, str]] = {}
        for entry in self.proc.iterdir() if self.proc.is_dir() else ():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone between the listing and the read
                continue
            comm = stat[stat.find("(") + 1 : stat.rfind(")")]
            fields = stat[stat.rfind(")") + 2 :].split()
            # fields[0] is the state (stat's 3rd field): ppid 4th, utime 14th, stime 15th,
            # starttime 22nd
            cpu = (int(fields[11]) + int(fields[12])) / self._tick
            stats[int(entry.name)] = (int(fields[1]), int(fields[19]), cpu, comm, cmd)
        ppids = {pid: v[0] for pid, v in stats.items()}
        for pid, (ppid, start, cpu, comm, cmd) in stats.items():
            key = (pid, start)
            old = self.seen.get(key)
            kind = cpu_kind(comm, cmd)
            command = re.sub(r"\d+", "N", (cmd or f"[{comm}]").strip())[:90]
            if old is None:
                self._latest[pid] = key
                self.seen[key] = _Seen(
                    ppid, cpu, now, now, kind, self._lane_of(pid, ppids), command
                )
            else:
                old.cpu_s, old.last_s = cpu, now
                if cmd:  # a zombie (exited, not yet reaped) has no command line: keep its kind
                    old.kind, old.command = kind, command
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
