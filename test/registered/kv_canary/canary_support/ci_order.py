"""The order the suite's test files are handed to pytest-xdist's workers in: the longest first,
by each file's ``register_cpu_ci(est_time=...)`` (sglang's CI registration, read from the file
by sglang's own parser), files without a CPU registration (GPU-only: skipped on the CPU) last.

``--dist loadfile`` gives a worker a whole file at a time, in the collection order once
xdist's own reordering (by number of tests) is off (``--no-loadscope-reorder``, in
``pyproject.toml``): with the longest files first, the two workers finish together instead
of one running a four-minute server file while the other is idle (longest-processing-time
first). Called by ``conftest.pytest_collection_modifyitems``; the order within a file is
kept. Keep each file's ``est_time`` near its measured time (docs/architecture.md, "Tests")."""

from __future__ import annotations

import functools
import pathlib
from typing import Callable, List, Sequence, TypeVar

Item = TypeVar("Item")


@functools.lru_cache(maxsize=None)
def cpu_est_time(path: pathlib.Path) -> float:
    """The ``est_time`` of ``path``'s enabled ``register_cpu_ci`` call; 0 when it has none
    (a GPU-only file: its tests are skipped on the CPU)."""
    from sglang.test.ci import ci_register

    registries, _ = ci_register.ut_parse_one_file(str(path))
    cpu = [r for r in registries if r.backend == ci_register.HWBackend.CPU and r.disabled is None]
    return max((r.est_time for r in cpu), default=0.0)


def longest_files_first(
    items: Sequence[Item],
    path_of: Callable[[Item], pathlib.Path],
    est_time: Callable[[pathlib.Path], float] = cpu_est_time,
) -> List[Item]:
    """``items`` grouped by file, the files by decreasing ``est_time`` (ties: the order they
    came in), each file's items in their order."""
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(path_of(item), i)
    rank = {p: (-est_time(p), i) for p, i in first_seen.items()}
    return sorted(items, key=lambda item: rank[path_of(item)])
