"""The planted defects of the mutation check (docs/testing.md, "Mutation check"), read by
``run_mutants.py`` and kept well-formed by ``test/registered/kv_canary/test_mutants_list.py``.

Each :class:`Mutant` is one realistic single defect: replace ``old`` (which must occur exactly
once in ``path``) with ``new``, and ``selection`` (pytest node ids, space separated, relative to
the repository root) must then fail. ``speed`` says whether the selection is in the quick
subset (``-m "not slow"``) or needs the slow end-to-end suites.

The list grows with each capability: a new check, hook or validation comes with the defect
that would switch it off silently, and the test that notices it.
"""

from __future__ import annotations

from mutant_types import Mutant
from mutants_checks import MUTANTS_CHECKS
from mutants_paths import MUTANTS_PATHS

__all__ = ["MUTANTS", "Mutant"]

MUTANTS = (*MUTANTS_CHECKS, *MUTANTS_PATHS)
