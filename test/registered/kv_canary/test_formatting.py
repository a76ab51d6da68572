"""Every Python file of the repository is as ``ruff format`` writes it (the settings in
``pyproject.toml``'s ``[tool.ruff]``; the version pinned in the ``test`` extra). Fix a failure
with ``ruff format .`` from the repository root."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _ruff() -> list[str]:
    """ruff from this interpreter's environment (the ``test`` extra), else from ``PATH``."""
    beside = pathlib.Path(sys.executable).with_name("ruff")
    found = str(beside) if beside.is_file() else shutil.which("ruff")
    if found is None:
        raise RuntimeError("ruff is not installed: pip install -e '.[test]' (it pins ruff)")
    return [found]


def test_every_python_file_is_formatted():
    proc = subprocess.run(
        _ruff() + ["format", "--check", "--diff", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        "not as `ruff format .` writes them:\n" + proc.stdout[-6000:] + proc.stderr[-2000:]
    )


def test_a_file_out_of_format_is_reported(tmp_path):
    """The check reads the repository's settings and fails on a file that breaks them."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    bad = tmp_path / "bad.py"
    bad.write_text("def f(a,b):\n  return {'k':a+b}\n")
    proc = subprocess.run(
        _ruff() + ["format", "--check", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "bad.py" in proc.stdout + proc.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
