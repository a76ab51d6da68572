"""Per-forward canary work: plan, HEAD and TAIL launches, in four checked phases."""

from sglang.srt.kv_canary.single_forward_manager.forward_manager import (
    SfmStatus,
    SingleForwardManager,
)
from sglang.srt.kv_canary.single_forward_manager.phases import CanaryPhaseError, SfmOp, SfmPhase

__all__ = ["CanaryPhaseError", "SfmOp", "SfmPhase", "SfmStatus", "SingleForwardManager"]
