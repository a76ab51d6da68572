"""Fault injection (docs/subsystems.md, "Self-tests"): the self-tests that prove the canary
catches what it claims."""

from sglang.srt.kv_canary.perturb.config import FaultKind, PerturbConfig, parse_target_group
from sglang.srt.kv_canary.perturb.perturber import CanaryPerturber
from sglang.srt.kv_canary.perturb.report import (
    PERTURB_LINE_PREFIX,
    format_perturb_line,
    parse_perturb_line,
)

__all__ = [
    "CanaryPerturber",
    "FaultKind",
    "PERTURB_LINE_PREFIX",
    "PerturbConfig",
    "format_perturb_line",
    "parse_perturb_line",
    "parse_target_group",
]
