#!/usr/bin/env python
"""Mutation check (docs/testing.md, "Mutation check").

Plants each single defect listed in ``mutants.py`` into this checkout, one at a time, runs
the pytest selection that must catch it (``python -m pytest -q -x -p no:warnings
<selection>``) and puts the file back byte for byte (in a ``finally``, also on Ctrl-C or
SIGTERM). A mutant is *killed* when its selection fails with the defect planted; it
*survived* when the selection passes anyway.

Before planting anything it refuses to start (exit status 2) when:

- a target file shows up in ``git status --porcelain`` (uncommitted work there would be
  clobbered by the restore, and the old text may no longer be what the list says);
- ``sglang.srt.kv_canary`` / ``sglang.jit_kernel.kv_canary`` do not import from this
  checkout (the defects would be planted where the tests do not look);
- the selections do not pass unmutated (``--skip-baseline`` skips this one run: every
  selection, together, with nothing planted; otherwise a broken test would count as a kill).

Exit status: 0 when every mutant run was killed; 1 when one survived, its old text does not
occur exactly once in its file, or its run could not tell (pytest found no test, usage
error); 2 when it refused to start.

    python test/mutation/run_mutants.py              # every mutant
    python test/mutation/run_mutants.py --list       # the list, nothing run
    python test/mutation/run_mutants.py --only row3,row7
    python test/mutation/run_mutants.py --quick-only # skip the mutants whose selection is slow
    python test/mutation/run_mutants.py --log-dir /tmp/mutants  # keep each run's output
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from mutants import MUTANTS, Mutant  # noqa: E402

PYTEST_ARGS = ("-m", "pytest", "-q", "-x", "-p", "no:warnings")
# pytest exit codes that do not mean "a test failed": usage error, no tests collected
_PYTEST_UNDECIDED = {4: "pytest usage error", 5: "no tests collected"}


def old_text_count(m: Mutant, repo: Path = REPO) -> int:
    path = repo / m.path
    if not path.is_file():
        return 0
    return path.read_text(encoding="utf-8").count(m.old)


def modified_targets(mutants: Sequence[Mutant], repo: Path = REPO) -> List[str]:
    """Target files with uncommitted changes (or untracked), per ``git status``."""
    paths = sorted({m.path for m in mutants})
    out = subprocess.run(
        ["git", "status", "--porcelain", "--", *paths], cwd=repo, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"run_mutants: git status failed in {repo}: {out.stderr.strip()}")
    return [line[3:] for line in out.stdout.splitlines() if line.strip()]


def imports_from_this_checkout(python: str, repo: Path = REPO) -> Optional[str]:
    """None when both canary packages import from ``repo/python``; else what they import."""
    code = (
        "import sglang.srt.kv_canary as a, sglang.jit_kernel.kv_canary as b; "
        "print(a.__file__); print(b.__file__)"
    )
    out = subprocess.run([python, "-c", code], cwd=repo, capture_output=True, text=True)
    if out.returncode != 0:
        return f"import failed: {out.stderr.strip().splitlines()[-1:]}"
    root = (repo / "python").resolve()
    files = [Path(line).resolve() for line in out.stdout.split()]
    bad = [str(f) for f in files if root not in f.parents]
    return ", ".join(bad) if bad or len(files) != 2 else None


def run_pytest(python: str, selection: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, *PYTEST_ARGS, *shlex.split(selection)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:110] if lines else ""


def _first_failure(output: str) -> Tuple[str, str]:
    """(the failing test's name, its first ``E`` line) from pytest's output."""
    failed = [
        ln.split()[1]
        for ln in output.splitlines()
        if ln.startswith(("FAILED ", "ERROR ")) and len(ln.split()) > 1
    ]
    test = failed[0].rpartition("/")[2] if failed else ""
    errors = [ln[1:].strip() for ln in output.splitlines() if ln.startswith("E ")]
    return test, (errors[0] if errors else _last_line(output))[:100]


def run_mutant(
    m: Mutant, *, python: str, timeout: float, log_dir: Optional[Path] = None
) -> Dict[str, str]:
    path = REPO / m.path
    original = path.read_bytes()
    text = original.decode("utf-8")
    count = text.count(m.old)
    if count != 1:
        return dict(
            result="old-text",
            test="",
            line=f"old text found {count} times (must be 1)",
            seconds="0",
        )
    start = time.monotonic()
    try:
        path.write_bytes(text.replace(m.old, m.new).encode("utf-8"))
        try:
            proc = run_pytest(python, m.selection, timeout)
        except subprocess.TimeoutExpired:
            return dict(
                result="killed",
                test="",
                line=f"timed out after {timeout:.0f} s",
                seconds=f"{time.monotonic() - start:.0f}",
            )
    finally:
        path.write_bytes(original)
    seconds = f"{time.monotonic() - start:.0f}"
    if log_dir is not None:
        (log_dir / f"{m.id}.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode == 0:
        return dict(result="SURVIVED", test="", line=_last_line(proc.stdout), seconds=seconds)
    if proc.returncode in _PYTEST_UNDECIDED:
        return dict(
            result="error", test="", line=_PYTEST_UNDECIDED[proc.returncode], seconds=seconds
        )
    test, line = _first_failure(proc.stdout)
    return dict(result="killed", test=test, line=line, seconds=seconds)


def print_table(rows: List[List[str]], header: List[str]) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


def list_mutants(mutants: Sequence[Mutant]) -> None:
    print_table(
        [[m.id, m.speed, m.path, m.what, m.selection] for m in mutants],
        ["id", "speed", "file", "defect", "selection that must kill it"],
    )


def select(args) -> List[Mutant]:
    mutants = list(MUTANTS)
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        known = {m.id for m in mutants}
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise SystemExit(
                f"run_mutants: unknown mutant id(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        mutants = [m for m in mutants if m.id in wanted]
    if args.quick_only:
        mutants = [m for m in mutants if m.speed == "quick"]
    return mutants


def _raise_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--only", metavar="ID[,ID]", help="run only these mutants")
    parser.add_argument(
        "--quick-only", action="store_true", help="skip the mutants whose selection is marked slow"
    )
    parser.add_argument(
        "--skip-baseline", action="store_true", help="do not first run the selections unmutated"
    )
    parser.add_argument(
        "--timeout", type=float, default=1200, help="seconds per selection run (default 1200)"
    )
    parser.add_argument(
        "--log-dir", type=Path, help="write each mutant's pytest output to DIR/<id>.log"
    )
    args = parser.parse_args(argv)
    mutants = select(args)
    if args.list:
        list_mutants(mutants)
        return 0
    if not mutants:
        print("run_mutants: no mutant selected")
        return 2
    python = sys.executable
    dirty = modified_targets(mutants)
    if dirty:
        print(
            "run_mutants: refusing to start, these target files have uncommitted changes "
            "(commit or stash them first): " + ", ".join(dirty)
        )
        return 2
    elsewhere = imports_from_this_checkout(python)
    if elsewhere:
        print(
            f"run_mutants: refusing to start, the canary packages do not import from "
            f"{REPO / 'python'} ({elsewhere}); install this checkout (pip install -e .)"
        )
        return 2
    if not args.skip_baseline:
        selection = " ".join(
            dict.fromkeys(part for m in mutants for part in shlex.split(m.selection))
        )
        print(
            f"run_mutants: baseline (nothing planted) of {len(mutants)} selection(s) ...",
            flush=True,
        )
        base = run_pytest(python, selection, args.timeout)
        if base.returncode != 0:
            print(base.stdout[-3000:])
            print("run_mutants: refusing to start, the selections fail with nothing planted")
            return 2
        print(f"run_mutants: baseline passes ({_last_line(base.stdout)})", flush=True)
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    rows, bad = [], 0
    for m in mutants:
        print(f"run_mutants: {m.id} ({m.path}) ...", flush=True)
        r = run_mutant(m, python=python, timeout=args.timeout, log_dir=args.log_dir)
        bad += r["result"] != "killed"
        rows.append(
            [
                m.id,
                m.speed,
                m.path.rpartition("/")[2],
                r["result"],
                r["seconds"],
                r["test"],
                r["line"],
            ]
        )
    print()
    print_table(rows, ["id", "speed", "file", "result", "s", "failing test", "first failure line"])
    killed = sum(1 for r in rows if r[3] == "killed")
    print(f"\n{killed}/{len(rows)} killed" + (f", {bad} not killed" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
