"""Docstrings and the prose beside them cite the docs by section (``docs/architecture.md,
"Plans"``): every section cited from the code, the tests, the benchmarks, their results, the
docs themselves (``docs/performance.md`` included) and the README must exist; no source file may
cite the SPEC (a file this repository does not have), none names a tracker item ("issue" or
"finding" and a number): the reason belongs in the text, the history in git; and the
architecture's module map names every module of the two packages and no module that does not
exist."""

from __future__ import annotations

import fnmatch
import pathlib
import re
import sys

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-test-cpu")

REPO = pathlib.Path(__file__).resolve().parents[3]
CITATION = re.compile(r'docs/(\w+\.md),\s+"([^"]+)"')
SPEC_MARK = "SPEC" + " §"  # spelled apart so this file does not cite it
# the word, an optional "#" and a number, any case, singular or plural (spelled apart here)
TRACKER_REF = re.compile(r"\b(?:" + "iss" + "ue|fin" + r"ding)s?\s+#?\d+", re.I)


def headings(doc: pathlib.Path) -> set:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", doc.read_text(), re.M)}


def files(root: pathlib.Path, suffixes) -> list:
    """``root`` itself when it is a file, else every file under it, of those suffixes."""
    found = [root] if root.is_file() else sorted(root.rglob("*"))
    return [p for p in found if p.is_file() and p.suffix in suffixes]


def citations(root: pathlib.Path):
    for path in files(root, (".py", ".md")):
        for m in CITATION.finditer(path.read_text()):
            # a docstring may wrap a section name over lines
            yield path.relative_to(REPO), m.group(1), " ".join(m.group(2).split())


def check(root: pathlib.Path, docs: pathlib.Path) -> list:
    known = {p.name: headings(p) for p in docs.glob("*.md")}
    bad = [
        f"{path}: {doc} has no section {section!r}"
        for path, doc, section in citations(root)
        if section not in known.get(doc, set())
    ]
    bad += [
        f"{p.relative_to(REPO)} cites the SPEC"
        for p in files(root, (".py",))
        if SPEC_MARK in p.read_text()
    ]
    # code, scripts and the prose beside them (benchmark/results/*.md) alike
    bad += [
        f"{p.relative_to(REPO)} names a tracker item: {m.group(0)!r}"
        for p in files(root, (".py", ".md", ".sh"))
        for m in TRACKER_REF.finditer(p.read_text())
    ]
    return bad


def test_every_cited_section_exists():
    found = list(citations(REPO / "python"))
    assert len(found) > 20  # the docstrings do cite the docs
    assert check(REPO / "python", REPO / "docs") == []
    assert check(REPO / "benchmark", REPO / "docs") == []
    assert check(REPO / "test", REPO / "docs") == []
    assert check(REPO / "docs", REPO / "docs") == []
    assert check(REPO / "README.md", REPO / "docs") == []


def test_a_wrong_citation_is_reported(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "architecture.md").write_text("# Title\n\n## Plans\n")
    src = REPO / "python"  # relative paths in messages need a path under REPO
    bad = check(src, docs)  # the real tree against a docs folder lacking its sections
    assert any('has no section' in b for b in bad)


def test_a_wrong_citation_in_prose_is_reported():
    root = REPO / "benchmark" / "results"
    probe = root / "_citation_probe_tmp.md"  # under REPO: messages carry relative paths
    cite = "docs/performance.md"  # the citations spelled apart, so this file makes none
    probe.write_text(f'Why: {cite}, "The forward\npath"; {cite}, "Nowhere".\n')
    try:
        bad = [b for b in check(root, REPO / "docs") if "_citation_probe_tmp" in b]
    finally:
        probe.unlink()
    assert bad == [
        "benchmark/results/_citation_probe_tmp.md: performance.md has no section 'Nowhere'"
    ]


def test_a_tracker_reference_is_reported(tmp_path):
    root = REPO / "test" / "registered" / "kv_canary"
    probe = root / "_tracker_probe_tmp.py"  # under REPO: messages carry relative paths
    probe.write_text('"""Fixes ' + 'Iss' + 'ue #21 (fin' + 'dings 4 and 5)."""\n')
    try:
        bad = [b for b in check(root, REPO / "docs") if "_tracker_probe_tmp" in b]
    finally:
        probe.unlink()
    assert [b.split(" names a tracker item: ")[1] for b in bad] == [
        "'Iss" + "ue #21'",
        "'fin" + "dings 4'",
    ]


PACKAGES = ("python/sglang/jit_kernel/kv_canary", "python/sglang/srt/kv_canary")


def module_map_problems(doc_text: str, repo: pathlib.Path) -> list:
    """What the "Module map" section of ``doc_text`` gets wrong about the two packages under
    ``repo``: a module (``__init__`` aside) it names neither by file name, path nor pattern
    (``*_ref.py``), and a ``*.py`` name it gives that no module has."""
    section = doc_text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    names = set(re.findall(r"`([^`\s]+)`", section))
    modules = [
        (pkg, p.relative_to(repo / pkg).as_posix())
        for pkg in PACKAGES
        for p in sorted((repo / pkg).rglob("*.py"))
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    ]
    problems = []
    for pkg, rel in modules:
        base = rel.rsplit("/", 1)[-1]
        if not (
            base in names
            or rel in names
            or any(fnmatch.fnmatch(rel, n) or fnmatch.fnmatch(base, n) for n in names if "*" in n)
        ):
            problems.append(f"{pkg}/{rel} is not in the module map")
    known = {rel for _, rel in modules} | {rel.rsplit("/", 1)[-1] for _, rel in modules}
    problems += [
        f"the module map names {n}, which no module is"
        for n in sorted(names)
        if n.endswith(".py") and "*" not in n and n not in known
    ]
    return problems


def test_the_module_map_matches_the_tree():
    assert module_map_problems((REPO / "docs" / "architecture.md").read_text(), REPO) == []


def test_a_module_map_out_of_date_is_reported():
    text = (REPO / "docs" / "architecture.md").read_text()
    stale = text.replace("`rows.py`", "`rowz.py`")
    assert module_map_problems(stale, REPO) == [
        "python/sglang/jit_kernel/kv_canary/rows.py is not in the module map",
        "the module map names rowz.py, which no module is",
    ]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
