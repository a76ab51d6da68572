"""The four checked phases of one forward and their allowed transitions (docs/architecture.md,
"One forward")."""

from __future__ import annotations

import enum


class SfmPhase(enum.Enum):
    IDLE = "idle"
    PRE_OUTSIDE_GRAPH = "pre_ops_outside_graph"
    PRE_MAYBE_INSIDE_GRAPH = "pre_ops_maybe_inside_graph"
    POST_MAYBE_INSIDE_GRAPH = "post_ops_maybe_inside_graph"


class SfmOp(enum.Enum):
    """The single-forward manager's ops (the value is the method name, for messages)."""

    PRE_OUTSIDE_GRAPH = "pre_ops_outside_graph"
    PRE_MAYBE_INSIDE_GRAPH = "pre_ops_maybe_inside_graph"
    POST_MAYBE_INSIDE_GRAPH = "post_ops_maybe_inside_graph"
    # a CUDA-graph replay ran both inside ops without Python seeing them
    MARK_REPLAYED_INSIDE_GRAPH = "mark_replayed_inside_graph"
    POST_OUTSIDE_GRAPH = "post_ops_outside_graph"


# op -> (phases it may follow, phase after it)
TRANSITIONS = {
    SfmOp.PRE_OUTSIDE_GRAPH: ((SfmPhase.IDLE,), SfmPhase.PRE_OUTSIDE_GRAPH),
    SfmOp.PRE_MAYBE_INSIDE_GRAPH: ((SfmPhase.PRE_OUTSIDE_GRAPH,), SfmPhase.PRE_MAYBE_INSIDE_GRAPH),
    SfmOp.POST_MAYBE_INSIDE_GRAPH: (
        (SfmPhase.PRE_MAYBE_INSIDE_GRAPH,),
        SfmPhase.POST_MAYBE_INSIDE_GRAPH,
    ),
    SfmOp.MARK_REPLAYED_INSIDE_GRAPH: (
        (SfmPhase.PRE_OUTSIDE_GRAPH,),
        SfmPhase.POST_MAYBE_INSIDE_GRAPH,
    ),
    SfmOp.POST_OUTSIDE_GRAPH: ((SfmPhase.POST_MAYBE_INSIDE_GRAPH,), SfmPhase.IDLE),
}

# During CUDA-graph capture (and its warm-up runs) only the inside ops run, from IDLE.
CAPTURE_TRANSITIONS = {
    SfmOp.PRE_MAYBE_INSIDE_GRAPH: ((SfmPhase.IDLE,), SfmPhase.PRE_MAYBE_INSIDE_GRAPH),
    SfmOp.POST_MAYBE_INSIDE_GRAPH: ((SfmPhase.PRE_MAYBE_INSIDE_GRAPH,), SfmPhase.IDLE),
}


class CanaryPhaseError(RuntimeError):
    """A canary op was called out of order (a hook is missing or runs twice)."""
