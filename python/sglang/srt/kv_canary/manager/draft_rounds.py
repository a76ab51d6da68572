"""The EAGLE draft worker's brackets of ``CanaryManager`` (docs/architecture.md, "Runtime").

A draft round is sglang's ``draft_forward``: speculative steps - 1 draft-model forwards in
one loop, each writing one draft token per request after the previous one's. The step count
is the worker's current one, at most ``draft_forwards_per_round`` + 1 (the largest count
``--speculative-adaptive`` may switch to, which sized the canary). Eager, each forward is
bracketed like any other (its own single-forward manager, outside ops and read-back); in the
draft CUDA graph the loop is captured whole, so forward i's inside ops are captured with
single-forward manager i, and a replay brackets all of them at once
(:meth:`DraftRoundBrackets.with_replayed_draft_round`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.kv_canary.sglang_seam import ForwardBatch


@dataclasses.dataclass(eq=False)
class DraftRound:
    """An EAGLE draft round in progress (:meth:`CanaryManager.with_draft_round`): whether it is
    being captured into the draft CUDA graph, how many forwards it runs, and the index of its
    next forward (= the single-forward manager that forward uses)."""

    capturing: bool
    forwards: int
    next_forward: int = 0


class DraftRoundBrackets:
    """``CanaryManager``'s draft-round brackets (a base class of it: they use its
    single-forward managers and forward brackets; ``draft_forwards_per_round``,
    ``_draft_round`` and ``_capturing_draft_graph`` are set in its ``__init__``)."""

    def _round_forwards(self, forwards: int) -> int:
        if forwards < 0 or forwards > self.draft_forwards_per_round:
            raise RuntimeError(
                f"kv_canary: an EAGLE draft round of {forwards} draft forwards "
                f"(--speculative-num-steps {forwards + 1}); the canary was sized for at most "
                f"{self.draft_forwards_per_round} (--speculative-num-steps, or the largest of "
                "--speculative-adaptive's step counts, minus 1)"
            )
        return forwards

    @contextlib.contextmanager
    def with_draft_round(self, forwards: int):
        """Around one ``draft_forward`` call (eager, or inside the draft graph's capture) of
        ``forwards`` draft forwards (the worker's current speculative steps - 1)."""
        if self._draft_round is not None:
            raise RuntimeError("kv_canary: an EAGLE draft round started inside another one")
        self._draft_round = DraftRound(
            capturing=self._capturing_draft_graph, forwards=self._round_forwards(forwards)
        )
        try:
            yield self._draft_round
        finally:
            self._draft_round = None

    @property
    def in_draft_round(self) -> bool:
        return self._draft_round is not None

    @contextlib.contextmanager
    def with_draft_forward(self, forward_batch: "ForwardBatch"):
        """Around one draft-model forward of the round in progress: the next single-forward
        manager, captured (inside the draft graph's capture) or bracketed as an eager
        forward."""
        draft_round = self._draft_round
        if draft_round is None:
            raise RuntimeError("kv_canary: a draft forward outside an EAGLE draft round")
        index = draft_round.next_forward
        if index >= draft_round.forwards:
            raise RuntimeError(
                f"kv_canary: EAGLE draft round ran more than its {draft_round.forwards} "
                "draft forwards (the worker's --speculative-num-steps - 1)"
            )
        draft_round.next_forward += 1
        with self.with_active_single_forward_manager(index):
            if draft_round.capturing:
                with self.capturing():
                    yield
            else:
                with self.with_ops_outside_graph(forward_batch):
                    yield

    @contextlib.contextmanager
    def capturing_draft_graph(self):
        """Around the draft CUDA-graph runner's capture of one batch size: the draft rounds
        run in it (sglang's warm-up runs and the capture) only record the inside ops; the
        chain-position check is off meanwhile (:meth:`CanaryManager.graph_capture_setup`)."""
        self._capturing_draft_graph = True
        try:
            with self.graph_capture_setup():
                yield
        finally:
            self._capturing_draft_graph = False

    @contextlib.contextmanager
    def with_replayed_draft_round(self, forward_batch: "ForwardBatch", forwards: int):
        """Around a replay of a draft CUDA graph (one whole draft round of ``forwards`` draft
        forwards: the graph runner's speculative steps - 1, fixed when it was captured): the
        outside ops of every draft forward it holds, then one read-back for the round. No-op
        with a single speculative step (the round runs no draft forward)."""
        sfms = self.sfms[: self._round_forwards(forwards)]
        if not sfms:
            yield
            return
        with self._outside_graph(sfms, forward_batch, replayed=True):
            yield
