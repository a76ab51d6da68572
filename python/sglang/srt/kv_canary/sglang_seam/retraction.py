"""Heal mode's retraction: a running request taken back the way sglang's own retraction does it (``ScheduleBatch.retract_decode``: release without insert, ``Req.reset_for_retract``, ``Scheduler._add_request_to_queue(req, is_retracted=True)``), at a point of the scheduler's loop where no token of it is appended.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| ``Scheduler.running_batch``, ``cur_batch``, ``chunked_req``, ``result_queue`` (overlap loop) | removes a request from the running batch and from the launched extend batch (``ScheduleBatch.filter_batch(keep_indices=...)``, which the loop would merge into the running batch next) and clears their ``batch_is_full``; reads which launched batches' results are still to be processed | ``violations.containment``, ``plugin`` |
| ``release_kv_cache(req, tree_cache, is_insert=False)`` (``mem_cache.common``) | frees the request's KV (through the tree cache's ``cache_finished_req``, which the release guard wraps) | ``violations.containment`` |
| ``Req.reset_for_retract``, ``is_retracted``, ``kv_committed_len``, ``kv_allocated_len``, ``output_ids`` | resets the request for its recomputation; the slots past its known tokens (the launched forward's write) are freed with it | ``violations.containment`` |
| ``Scheduler._add_request_to_queue(req, is_retracted=True)`` | queues it again; sglang prefills it from ``origin_input_ids + output_ids`` | ``violations.containment`` |
| ``Req.to_finish``, ``Req.check_finished``, ``Scheduler.stream_output(reqs, return_logprob)`` | a taken-back request past its heals is finished with abort mode's ``FINISH_ABORT`` and its output sent as sglang sends a finished request's (no token of the forward that read corrupt KV in it) | ``violations.containment`` |
| the result ``Scheduler.run_batch`` returns (``GenerationBatchResult``) | sets ``kv_canary_forward_step`` on it: the canary's step of the forward that computed it | ``manager.scheduler_side``, ``plugin`` |
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List

from sglang.srt.kv_canary.sglang_seam.release import tree_cache_allocator

if TYPE_CHECKING:  # annotations only
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

_HEALS = "kv_canary_heals"
_FORWARD_STEP = "kv_canary_forward_step"


def tag_result_forward_step(result, step: int) -> None:
    """Remember on a launched batch's result object the canary's step of its forward."""
    if result is not None:
        setattr(result, _FORWARD_STEP, step)


def result_forward_step(result):
    """The step :func:`tag_result_forward_step` put on ``result`` (None: untagged)."""
    return getattr(result, _FORWARD_STEP, None)


def req_heals(req: "Req") -> int:
    """How many times heal mode took this request back so far."""
    return int(getattr(req, _HEALS, 0))


def count_heal(req: "Req") -> int:
    """One more heal of ``req``; returns the new count."""
    n = req_heals(req) + 1
    setattr(req, _HEALS, n)
    return n


def _drop_from(batch: "ScheduleBatch", reqs: List["Req"]) -> None:
    """``reqs`` out of ``batch`` (``filter_batch``); a batch that shrank is no longer full
    (as after sglang's own retraction: the scheduler admits new requests only into a batch
    that is not full)."""
    if batch is None or not batch.reqs:
        return
    gone = {id(r) for r in reqs}
    keep = [i for i, r in enumerate(batch.reqs) if id(r) not in gone]
    if len(keep) < len(batch.reqs):
        batch.filter_batch(keep_indices=keep)
        batch.batch_is_full = False


class SchedulerRetraction:
    """One scheduler's retraction of running requests, for heal mode. Scheduler thread, between
    batches only (a hook before ``Scheduler.process_batch_result``, after it, or the idle
    step): never while a batch is being built or launched."""

    def __init__(self, scheduler: "Scheduler"):
        self._scheduler = scheduler

    def is_chunked(self, req: "Req") -> bool:
        """The request is the one being prefilled chunk by chunk (its next chunk is scheduled
        by the loop itself, not from the queue)."""
        return getattr(self._scheduler, "chunked_req", None) is req

    def in_flight(self, req: "Req") -> bool:
        """A launched batch whose result is still to be processed holds the request."""
        queue = getattr(self._scheduler, "result_queue", None) or ()
        return any(req in batch.reqs for batch, _ in queue if batch is not None)

    def take_back(self, req: "Req", release: Callable[["Req", Callable[[], None]], None]) -> None:
        """Take ``req`` out of the scheduler's batches and free its KV: ``release(req, free)``
        calls ``free()`` inside whatever guards the release (the release guard). ``free``
        frees the slots past the request's known tokens (the launched forward wrote the next
        one there) and then runs sglang's ``release_kv_cache`` without insert; afterwards the
        request is reset as sglang's retraction resets it. Its output so far is kept: sglang
        recomputes its KV from ``origin_input_ids + output_ids`` when it is admitted again."""
        from sglang.srt.mem_cache.common import release_kv_cache

        scheduler = self._scheduler
        _drop_from(getattr(scheduler, "running_batch", None), [req])
        cur = getattr(scheduler, "cur_batch", None)
        if cur is not None and cur is not scheduler.running_batch and cur.forward_mode.is_extend():
            _drop_from(cur, [req])
        tree_cache = scheduler.tree_cache

        def free() -> None:
            known = len(req.origin_input_ids) + len(req.output_ids)
            end = int(req.kv_allocated_len)
            if req.req_pool_idx is not None and end > known:
                row = tree_cache.req_to_token_pool.req_to_token[req.req_pool_idx]
                tree_cache_allocator(tree_cache).free(row[known:end])
                req.kv_committed_len = min(int(req.kv_committed_len), known)
                req.kv_allocated_len = known
            release_kv_cache(req, tree_cache, is_insert=False)

        release(req, free)
        req.reset_for_retract()

    def finish_aborted(self, req: "Req", message: str) -> None:
        """Finish a taken-back request (:meth:`take_back` ran: its KV is freed, no batch will
        append to it) with abort mode's abort and ``message``, and send its output as sglang
        sends a finished request's: its client gets the error, and a streaming client no token
        past those it was sent before the take-back."""
        from sglang.srt.kv_canary.sglang_seam.scheduler import abort_running_req

        if not abort_running_req(req, message):
            return  # finished already: its output went out
        req.check_finished()
        self._scheduler.stream_output([req], req.return_logprob)

    def requeue(self, req: "Req") -> None:
        """Queue a taken-back request again (sglang prefills it from its tokens)."""
        self._scheduler._add_request_to_queue(req, is_retracted=True)
