"""The project's import graph, read from the source tree (test support for the layering test).

``import-linter`` / ``grimp`` refuse ``sglang.srt.kv_canary`` as a root (it is a sub-package
of the installed ``sglang``), so this reads the imports itself with ``ast``: every ``import`` /
``from ... import`` of every ``.py`` under a source root, with its line. Every import counts,
wherever it sits: inside a function (a lazy import runs the first time the function does) and
under ``if TYPE_CHECKING:`` (never executed, but an annotation naming a higher layer's type is
the same dependency, and a circle through one is still a circle); ``typing_edges`` lists the
latter apart.

Modules are named from their path under the root (``python/``): ``a/b/c.py`` is ``a.b.c``,
``a/b/__init__.py`` is ``a.b``. An import resolves to the longest module of the tree it names
(``from a.b import c`` is an import of ``a.b.c`` when that module exists, else of ``a.b``);
imports of modules outside the tree are kept as external edges.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import pathlib
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module (in the tree), or the dotted name (external)
    line: int
    names: Tuple[str, ...]  # for ``from X import a, b``: the names; else ()
    internal: bool


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterable[Tuple[ast.stmt, bool]]:
    """Every import statement with ``True`` when it sits under ``if TYPE_CHECKING:``."""
    stack: List[Tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, typing_only = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, typing_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((stmt, True) for stmt in node.body)
            stack.extend((stmt, typing_only) for stmt in node.orelse)
        else:
            stack.extend((child, typing_only) for child in ast.iter_child_nodes(node))


class ImportGraph:
    """``modules``: name → path of every module under ``root`` whose name starts with one of
    ``packages``; ``edges``: their executed imports; ``typing_edges``: those under
    ``if TYPE_CHECKING:``. The checks read both (:meth:`all_edges`)."""

    def __init__(self, root: pathlib.Path, packages: Sequence[str]):
        self.root = pathlib.Path(root)
        self.modules: Dict[str, pathlib.Path] = {}
        for path in sorted(self.root.rglob("*.py")):
            name = module_name(self.root, path)
            if any(name == p or name.startswith(p + ".") for p in packages):
                self.modules[name] = path
        self.edges: List[Edge] = []
        self.typing_edges: List[Edge] = []
        for name, path in self.modules.items():
            tree = ast.parse(path.read_text(), filename=str(path))
            for stmt, typing_only in _imports(tree):
                for edge in self._resolve(name, path, stmt):
                    (self.typing_edges if typing_only else self.edges).append(edge)

    def _in_tree(self, dotted: str) -> Optional[str]:
        """The longest prefix of ``dotted`` that is a module of the tree."""
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            candidate = ".".join(parts[:i])
            if candidate in self.modules:
                return candidate
        return None

    def _resolve(self, name: str, path: pathlib.Path, stmt: ast.stmt) -> List[Edge]:
        out = []
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                target = self._in_tree(alias.name)
                out.append(Edge(name, target or alias.name, stmt.lineno, (), target is not None))
            return out
        base = stmt.module or ""
        if stmt.level:
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            parts = package.split(".")
            parts = parts[: len(parts) - (stmt.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        for alias in stmt.names:
            full = f"{base}.{alias.name}"
            target = self._in_tree(full) if full in self.modules else self._in_tree(base)
            out.append(Edge(name, target or base, stmt.lineno, (alias.name,), target is not None))
        return out

    def all_edges(self) -> List[Edge]:
        """Every import: executed and ``TYPE_CHECKING`` ones."""
        return self.edges + self.typing_edges

    def internal_edges(self) -> List[Edge]:
        return [e for e in self.all_edges() if e.internal and e.target != e.source]

    def cycles(self) -> List[List[str]]:
        """The strongly connected components with more than one module (Tarjan), each sorted;
        an import cycle between files is one of these."""
        graph: Dict[str, Set[str]] = {m: set() for m in self.modules}
        for e in self.internal_edges():
            graph[e.source].add(e.target)
        index: Dict[str, int] = {}
        low: Dict[str, int] = {}
        on_stack: Set[str] = set()
        stack: List[str] = []
        out: List[List[str]] = []
        counter = [0]

        def strongconnect(v: str) -> None:
            # iterative Tarjan: (node, iterator over its successors)
            work = [(v, iter(sorted(graph[v])))]
            index[v] = low[v] = counter[0]
            counter[0] += 1
            stack.append(v)
            on_stack.add(v)
            while work:
                node, it = work[-1]
                advanced = False
                for w in it:
                    if w not in index:
                        index[w] = low[w] = counter[0]
                        counter[0] += 1
                        stack.append(w)
                        on_stack.add(w)
                        work.append((w, iter(sorted(graph[w]))))
                        advanced = True
                        break
                    if w in on_stack:
                        low[node] = min(low[node], index[w])
                if advanced:
                    continue
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))

        for v in sorted(graph):
            if v not in index:
                strongconnect(v)
        return out


@dataclasses.dataclass(frozen=True)
class Layer:
    """A named set of modules, given as ``fnmatch`` patterns over dotted names."""

    name: str
    patterns: Tuple[str, ...]

    def matches(self, module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, p) for p in self.patterns)


def assign_layers(graph: ImportGraph, layers: Sequence[Layer]) -> Tuple[Dict[str, int], List[str]]:
    """``(module → index of its layer, problems)``: every module must match exactly one layer
    (index 0 is the top)."""
    where: Dict[str, int] = {}
    problems = []
    for module in graph.modules:
        hits = [i for i, layer in enumerate(layers) if layer.matches(module)]
        if len(hits) != 1:
            names = ", ".join(layers[i].name for i in hits) or "none"
            problems.append(f"{module} matches {len(hits)} layers ({names}): give it exactly one")
        else:
            where[module] = hits[0]
    return where, problems


def layer_violations(graph: ImportGraph, layers: Sequence[Layer]) -> List[str]:
    """Imports that go up (from a lower layer to a higher one), plus unassigned modules."""
    where, problems = assign_layers(graph, layers)
    for e in graph.internal_edges():
        src, dst = where.get(e.source), where.get(e.target)
        if src is None or dst is None:
            continue
        if dst < src:
            problems.append(
                f"{graph.modules[e.source].relative_to(graph.root)}:{e.line}: {e.source} "
                f"(layer {layers[src].name!r}) imports {e.target} (layer {layers[dst].name!r}, "
                "above it)"
            )
    return problems
