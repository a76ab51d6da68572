"""The mutation check's list (``test/mutation/mutants.py``, docs/testing.md, "Mutation
check") stays runnable: every old text occurs exactly once in its file, every selection names
an existing test function in an existing file, ids are unique, quick selections are not in a
slow suite. Reads files only; plants nothing."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-test-cpu")

REPO = Path(__file__).resolve().parents[3]
MUTATION_DIR = REPO / "test" / "mutation"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(
        f"kv_canary_mutation_{name}", MUTATION_DIR / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mutants():
    sys.path.insert(0, str(MUTATION_DIR))  # run_mutants imports ``mutants`` by name
    try:
        return _load("mutants").MUTANTS
    finally:
        sys.path.remove(str(MUTATION_DIR))


def test_ids_are_unique_and_the_audit_rows_are_kept(mutants):
    ids = [m.id for m in mutants]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for row in range(1, 11):
        assert any(re.match(rf"row{row}[a-z]?-", i) for i in ids), f"audit row {row} missing"
    assert len(mutants) >= 16


def test_every_old_text_occurs_exactly_once_and_changes_something(mutants):
    for m in mutants:
        path = REPO / m.path
        assert path.is_file(), f"{m.id}: {m.path} does not exist"
        count = path.read_text(encoding="utf-8").count(m.old)
        assert count == 1, f"{m.id}: old text found {count} times in {m.path}"
        assert m.new != m.old and m.speed in ("quick", "slow") and m.what, m.id


def _is_slow_file(text: str) -> bool:
    return re.search(r"^pytestmark\s*=.*\bslow\b", text, re.MULTILINE) is not None


def test_every_selection_names_an_existing_test(mutants):
    for m in mutants:
        nodes = m.selection.split()
        assert nodes, f"{m.id}: empty selection"
        for node in nodes:
            file, _, name = node.partition("::")
            path = REPO / file
            assert path.is_file(), f"{m.id}: {file} does not exist"
            text = path.read_text(encoding="utf-8")
            func = re.sub(r"\[.*\]$", "", name)
            assert func and re.search(rf"^def {re.escape(func)}\(", text, re.MULTILINE), (
                f"{m.id}: no test function {func!r} in {file}"
            )
            if m.speed == "quick":
                assert not _is_slow_file(text), f"{m.id}: quick, but {file} is marked slow"
                assert not re.search(rf"@pytest\.mark\.slow\s*\ndef {re.escape(func)}\(", text)


def test_the_runner_lists_without_planting(mutants, capsys):
    sys.path.insert(0, str(MUTATION_DIR))
    try:
        runner = _load("run_mutants")
    finally:
        sys.path.remove(str(MUTATION_DIR))
    before = {m.path: (REPO / m.path).read_bytes() for m in mutants}
    assert runner.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(m.id in out for m in mutants)
    assert runner.main(["--list", "--only", f"{mutants[0].id},{mutants[-1].id}"]) == 0
    listed = capsys.readouterr().out
    assert mutants[0].id in listed and mutants[1].id not in listed
    with pytest.raises(SystemExit, match="unknown mutant id"):
        runner.main(["--list", "--only", "no-such-mutant"])
    assert {m.path: (REPO / m.path).read_bytes() for m in mutants} == before


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
