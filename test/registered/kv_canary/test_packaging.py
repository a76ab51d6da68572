"""The install contract of docs/architecture.md, "Module map": in-tree packages merged into the installed sglang."""

from __future__ import annotations

import importlib.metadata
import pathlib
import sys
import tomllib

import pytest

import sglang
import sglang.jit_kernel.kv_canary as kernels
import sglang.srt.kv_canary as runtime
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-test-cpu")

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


def test_plugin_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    (ep,) = [e for e in eps if e.name == "kv_canary"]
    assert ep.value == "sglang.srt.kv_canary.plugin:register"
    assert callable(ep.load())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
