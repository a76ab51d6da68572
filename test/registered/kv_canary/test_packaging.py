"""The install contract of docs/architecture.md, "Module map": in-tree packages merged into the installed sglang."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import subprocess
import sys
import tomllib

import pytest

import sglang
import sglang.jit_kernel.kv_canary as kernels
import sglang.srt.kv_canary as runtime
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_every_package_is_listed_and_no_namespace_init_is_shipped():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(p.parent.relative_to(ROOT / "python").parts)
        for p in (ROOT / "python").rglob("__init__.py")
    }
    assert found == listed
    for ns in ("sglang", "sglang/srt", "sglang/jit_kernel"):
        assert not (ROOT / "python" / ns / "__init__.py").exists(), ns


def test_imports_resolve_to_this_repo_and_to_installed_sglang():
    assert pathlib.Path(kernels.__file__).resolve().is_relative_to(ROOT / "python")
    assert pathlib.Path(runtime.__file__).resolve().is_relative_to(ROOT / "python")
    assert not pathlib.Path(sglang.__file__).resolve().is_relative_to(ROOT)
    assert sglang.__version__ == "0.5.12"


def test_the_demo_runs_as_a_module_of_the_runtime_package():
    """README's ``python -m sglang.srt.kv_canary.demo`` (the ``demo`` subpackage's
    ``__main__``) starts the demo's command line from this repository."""
    spec = importlib.util.find_spec("sglang.srt.kv_canary.demo.__main__")
    assert spec is not None and spec.origin is not None
    assert pathlib.Path(spec.origin).resolve().is_relative_to(ROOT / "python")
    out = subprocess.run(
        [sys.executable, "-m", "sglang.srt.kv_canary.demo", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m sglang.srt.kv_canary.demo"), out.stdout
    assert "--cases" in out.stdout and "--page-size" in out.stdout


def test_a_cpu_server_runs_one_openmp_thread_unless_told_otherwise(tmp_path):
    """``cpu_server_env``: the stub first on ``LD_LIBRARY_PATH``, sglang's CPU engine, the
    torch references (no ``TRITON_INTERPRET``), and one OpenMP thread unless the caller's
    environment sets ``OMP_NUM_THREADS``."""
    from sglang.srt.kv_canary.demo.server_harness import cpu_server_env

    env = cpu_server_env(tmp_path, {"LD_LIBRARY_PATH": "/x", "TRITON_INTERPRET": "1"})
    assert env["LD_LIBRARY_PATH"] == f"{tmp_path}:/x" and env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert "TRITON_INTERPRET" not in env and env["OMP_NUM_THREADS"] == "1"
    assert cpu_server_env(tmp_path, {"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"


def test_plugin_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    (ep,) = [e for e in eps if e.name == "kv_canary"]
    assert ep.value == "sglang.srt.kv_canary.plugin:register"
    assert callable(ep.load())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
