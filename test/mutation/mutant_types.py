"""The mutation check's types and shared pieces (docs/testing.md, "Mutation check"):
:class:`Mutant`, the path prefixes, and the speculative forward modes' skipped verify and
write. The lists are ``mutants_checks.py`` and ``mutants_paths.py``, joined in
``mutants.py``."""

from __future__ import annotations

import dataclasses

_T = "test/registered/kv_canary"
_RT = "python/sglang/srt/kv_canary"
_KN = "python/sglang/jit_kernel/kv_canary"


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    path: str  # relative to the repository root
    old: str  # exact text, found exactly once in ``path``
    new: str
    selection: str  # pytest node ids that must fail with the mutant planted
    speed: str  # "quick" (in -m "not slow") or "slow"
    what: str  # the defect, in a few words


def _spec_mode_skips(label: str, mode: str, what: str) -> tuple:
    """A speculative forward mode's verify, and its write, skipped for the forwards of
    ``mode`` (a ``ForwardMode`` name), each killed by that mode's test of
    ``test_speculative.py``."""
    guard = (
        f"        if self._batch is not None and self._batch.forward_mode.name == "
        f"\"{mode}\":\n            return\n"
    )
    sfm = f"{_RT}/single_forward_manager/forward_manager.py"
    verify = "    def _verify(self, phase: CanaryPhase) -> None:\n"
    write = "        self._write_lanes.run(launches)\n"
    name = label.replace("_", "-")
    return (
        Mutant(
            id=f"spec-{name}-verify-skipped",
            path=sfm,
            old=verify,
            new=verify + guard,
            selection=f"{_T}/test_speculative.py::"
            f"test_each_speculative_forward_mode_verifies_what_it_reads[{label}]",
            speed="quick",
            what=f"{what} verifies nothing (a later forward catches its faults)",
        ),
        Mutant(
            id=f"spec-{name}-write-skipped",
            path=sfm,
            old=write,
            new=guard + write,
            selection=f"{_T}/test_speculative.py::"
            f"test_each_speculative_forward_mode_writes_the_records_of_its_slots"
            f"[{label}]",
            speed="quick",
            what=f"{what} writes no records",
        ),
    )


_SPEC_MODE_SKIPS = (
    *_spec_mode_skips("target_verify", "TARGET_VERIFY", "the target verify"),
    *_spec_mode_skips("draft_decode", "DECODE", "a draft round's decode"),
    *_spec_mode_skips("draft_extend", "DRAFT_EXTEND", "spec v1's draft extend"),
    *_spec_mode_skips("draft_extend_v2", "DRAFT_EXTEND_V2", "spec v2's draft extend"),
)
