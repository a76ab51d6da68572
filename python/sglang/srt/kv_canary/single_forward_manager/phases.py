"""The four checked phases of one forward and their allowed transitions (SPEC §10)."""

from __future__ import annotations

import enum


class SfmPhase(enum.Enum):
    IDLE = "idle"
    PRE_OUTSIDE_GRAPH = "pre_ops_outside_graph"
    PRE_MAYBE_INSIDE_GRAPH = "pre_ops_maybe_inside_graph"
    POST_MAYBE_INSIDE_GRAPH = "post_ops_maybe_inside_graph"


# op name -> (phases it may follow, phase after it)
TRANSITIONS = {
    "pre_ops_outside_graph": ((SfmPhase.IDLE,), SfmPhase.PRE_OUTSIDE_GRAPH),
    "pre_ops_maybe_inside_graph": ((SfmPhase.PRE_OUTSIDE_GRAPH,), SfmPhase.PRE_MAYBE_INSIDE_GRAPH),
    "post_ops_maybe_inside_graph": ((SfmPhase.PRE_MAYBE_INSIDE_GRAPH,),
                                    SfmPhase.POST_MAYBE_INSIDE_GRAPH),
    # a CUDA-graph replay ran both inside ops without Python seeing them
    "mark_replayed_inside_graph": ((SfmPhase.PRE_OUTSIDE_GRAPH,), SfmPhase.POST_MAYBE_INSIDE_GRAPH),
    "post_ops_outside_graph": ((SfmPhase.POST_MAYBE_INSIDE_GRAPH,), SfmPhase.IDLE),
}

# During CUDA-graph capture (and its warm-up runs) only the inside ops run, from IDLE.
CAPTURE_TRANSITIONS = {
    "pre_ops_maybe_inside_graph": ((SfmPhase.IDLE,), SfmPhase.PRE_MAYBE_INSIDE_GRAPH),
    "post_ops_maybe_inside_graph": ((SfmPhase.PRE_MAYBE_INSIDE_GRAPH,), SfmPhase.IDLE),
}


class CanaryPhaseError(RuntimeError):
    """A canary op was called out of order (a hook is missing or runs twice)."""
