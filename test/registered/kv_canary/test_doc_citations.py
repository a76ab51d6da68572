"""Docstrings cite the docs by section (``docs/architecture.md, "Plans"``): every cited
section must exist, and no source file may cite the SPEC (a file this repository does not
have)."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

REPO = pathlib.Path(__file__).resolve().parents[3]
CITATION = re.compile(r'docs/(\w+\.md),\s+"([^"]+)"')
SPEC_MARK = "SPEC" + " §"  # spelled apart so this file does not cite it


def headings(doc: pathlib.Path) -> set:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", doc.read_text(), re.M)}


def citations(root: pathlib.Path):
    for path in sorted(root.rglob("*.py")):
        for m in CITATION.finditer(path.read_text()):
            # a docstring may wrap a section name over lines
            yield path.relative_to(REPO), m.group(1), " ".join(m.group(2).split())


def check(root: pathlib.Path, docs: pathlib.Path) -> list:
    known = {p.name: headings(p) for p in docs.glob("*.md")}
    bad = [f"{path}: {doc} has no section {section!r}" for path, doc, section in citations(root)
           if section not in known.get(doc, set())]
    bad += [f"{p.relative_to(REPO)} cites the SPEC" for p in sorted(root.rglob("*.py"))
            if SPEC_MARK in p.read_text()]
    return bad


def test_every_cited_section_exists():
    found = list(citations(REPO / "python"))
    assert len(found) > 20  # the docstrings do cite the docs
    assert check(REPO / "python", REPO / "docs") == []
    assert check(REPO / "benchmark", REPO / "docs") == []
    assert check(REPO / "test", REPO / "docs") == []


def test_a_wrong_citation_is_reported(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "architecture.md").write_text("# Title\n\n## Plans\n")
    src = REPO / "python"  # relative paths in messages need a path under REPO
    bad = check(src, docs)  # the real tree against a docs folder lacking its sections
    assert any('has no section' in b for b in bad)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
