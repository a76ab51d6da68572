"""The ``Scheduler``: its runners, tree cache, running requests, metric labels, KV slots in use, chunked request, sglang's abort of a running request, and which PD transfers it fakes.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| ``Scheduler.tp_worker.model_runner``, ``Scheduler.tree_cache``, ``.server_args`` | finds the runner's canary, hands the radix cache to the sweep and containment, the settings to ``get_init_info`` | ``plugin`` |
| ``Scheduler.draft_worker`` (spec v2: its ``.draft_worker``), its ``.draft_runner`` or ``.model_runner`` | the draft runner's canary; none when that runner is the target's (``NGRAMWorker``) | ``plugin`` |
| PD decode: ``disaggregation.decode._is_fake_transfer`` (private; with ``server_args.disaggregation_mode``), ``disaggregation.utils.FAKE_BOOTSTRAP_HOST`` | which requests' transfers sglang faked (nothing sent: their reads are set aside, not reported) | ``violations.resolver`` |
| ``Scheduler.running_batch`` / ``.cur_batch`` (``.reqs``), ``.chunked_req`` | the running requests a violation touches; the request PD prefill stashes (abort mode lifts its mark around it) | ``violations.resolver``, ``plugin`` |
| ``Scheduler.enable_metrics``, ``.metrics_collector.labels`` | the canary's Prometheus series get the scheduler's labels | ``violations.metrics`` |
| ``Scheduler.token_to_kv_pool_allocator.available_size()``, ``.max_total_num_tokens`` | the protected-tokens gauge | ``violations.metrics`` |
| ``GetInternalStateReqOutput.internal_state`` (what ``Scheduler.get_internal_state`` returns) | adds ``kv_canary``: the violations each guarded pool reported so far (``/server_info``'s ``internal_states``) | ``plugin`` |
| ``ScheduleBatch.reqs`` (``ModelWorkerBatch.reqs``, ``.forward_mode``, ``.req_pool_indices``) | the requests of a ``ForwardBatch.init_new`` (spec v1's draft extend: the unfinished ones) | ``plugin`` |
| ``Scheduler.tp_size``, ``.tp_rank``, ``.tp_cpu_group`` (``torch.distributed.all_gather_object`` over it), ``.recv_from_tokenizer`` (TP rank 0's input ``PULL`` socket: ``connect``) | abort mode on several TP ranks: the ranks' relays' endpoints exchanged, rank 0's input connected to them; the containment agreements | ``manager.scheduler_side`` (through ``plugin``) |
| ``Scheduler.process_input_requests``' list (``recv_requests``' broadcast) | the canary's containment notices taken out before sglang dispatches it | ``plugin`` |
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional

from sglang.srt.kv_canary.sglang_seam.batch import req_done
from sglang.srt.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:  # annotations only
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs


def internal_state_of(output) -> Optional[Dict[str, Any]]:
    """The ``internal_state`` dict of what ``Scheduler.get_internal_state`` returned (a
    ``GetInternalStateReqOutput``); None for anything else."""
    state = getattr(output, "internal_state", None)
    return state if isinstance(state, dict) else None


def scheduler_model_runner(scheduler: "Scheduler") -> Optional["ModelRunner"]:
    worker = getattr(scheduler, "tp_worker", None)
    return getattr(worker, "model_runner", None) if worker is not None else None


def scheduler_draft_model_runner(scheduler: "Scheduler") -> Optional["ModelRunner"]:
    """The EAGLE draft runner of a speculative scheduler (``Scheduler.draft_worker``: spec v1's
    ``EAGLEWorker``, or spec v2's ``EAGLEWorkerV2`` whose ``draft_worker`` is the
    ``EagleDraftWorker``); None without speculative decoding, and without a draft model (an
    ``NGRAMWorker``'s ``model_runner`` is the target's, ``Scheduler.tp_worker.model_runner``)."""
    worker = getattr(scheduler, "draft_worker", None)
    if worker is None:
        return None
    inner = getattr(worker, "draft_worker", None)  # spec v2
    if inner is not None:
        worker = inner
    runner = getattr(worker, "draft_runner", None)
    if runner is None:
        runner = getattr(worker, "model_runner", None)
    target = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    return None if runner is target else runner


@dataclasses.dataclass(frozen=True)
class SchedulerRankGroup:
    """The TP ranks of a scheduler (more than one): this one's ``rank`` of ``size``;
    ``gather(obj)``: every rank's ``obj`` in rank order (the same call on every rank:
    ``all_gather_object`` over the TP CPU group); ``input_socket``: rank 0's scheduler input
    ``PULL`` socket (None on the other ranks)."""

    rank: int
    size: int
    gather: Callable[[object], List[object]]
    input_socket: Optional[object]


def scheduler_tp_rank_group(scheduler: "Scheduler") -> Optional[SchedulerRankGroup]:
    """The scheduler's TP ranks, None with one. Call on every rank at the same point (a
    gather blocks until every rank made it)."""
    size = int(getattr(scheduler, "tp_size", 1) or 1)
    if size <= 1:
        return None
    import torch.distributed as dist

    group = scheduler.tp_cpu_group

    def gather(obj) -> List[object]:
        out: List[object] = [None] * size
        dist.all_gather_object(out, obj, group=group)
        return out

    rank = int(scheduler.tp_rank)
    return SchedulerRankGroup(
        rank=rank,
        size=size,
        gather=gather,
        input_socket=scheduler.recv_from_tokenizer if rank == 0 else None,
    )


def scheduler_server_args(scheduler: "Scheduler") -> "ServerArgs":
    return scheduler.server_args


def faked_transfer_test(scheduler: "Scheduler") -> Callable[["Req"], bool]:
    """Whether sglang faked a request's KV transfer (sglang's own test, private
    ``disaggregation.decode._is_fake_transfer``: bootstrap host ``FAKE_BOOTSTRAP_HOST``, the
    server's warm-up and ``/health_generate`` requests, or any request without a bootstrap
    host under ``--disaggregation-transfer-backend fake``): no KV and no canary row was sent
    for it. Never true off a PD decode server."""
    server_args = scheduler.server_args
    if getattr(server_args, "disaggregation_mode", "null") != "decode":
        return lambda req: False
    from sglang.srt.disaggregation.decode import _is_fake_transfer

    return lambda req: _is_fake_transfer(req, server_args)


def fake_bootstrap_host() -> str:
    """The bootstrap host of the requests whose PD transfer sglang fakes."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    return FAKE_BOOTSTRAP_HOST


def scheduler_tree_cache(scheduler: "Scheduler") -> "BasePrefixCache":
    return scheduler.tree_cache


def scheduler_running_reqs(scheduler: "Scheduler") -> List["Req"]:
    """The requests the scheduler is running now: its running (decode) batch, the batch it
    is forwarding (a prefill batch, with the chunked request) and the chunked request,
    each once. Read from the scheduler's own thread (the canary's hooks run there)."""
    out: List["Req"] = []
    seen = set()
    batches = (getattr(scheduler, "running_batch", None), getattr(scheduler, "cur_batch", None))
    chunked = getattr(scheduler, "chunked_req", None)
    for req in [r for b in batches if b is not None for r in (b.reqs or ())] + (
        [chunked] if chunked is not None else []
    ):
        if id(req) not in seen:  # identity of live objects within this call only
            seen.add(id(req))
            out.append(req)
    return out


def scheduler_metrics_labels(scheduler: "Scheduler") -> Optional[Dict[str, Any]]:
    """The labels of sglang's scheduler metrics (``--enable-metrics``), or None when metrics
    are off."""
    if not getattr(scheduler, "enable_metrics", False):
        return None
    collector = getattr(scheduler, "metrics_collector", None)
    return dict(collector.labels) if collector is not None else None


def scheduler_kv_slots_in_use(scheduler: "Scheduler") -> int:
    """Full-attention KV slots the allocator has handed out (running requests and the radix
    cache hold them): ``max_total_num_tokens - available_size()``."""
    allocator = scheduler.token_to_kv_pool_allocator
    return max(0, int(scheduler.max_total_num_tokens) - int(allocator.available_size()))


def schedule_batch_reqs(batch: "ScheduleBatch") -> Optional[list]:
    """The requests of the batch ``ForwardBatch.init_new`` builds from, one per row of its
    ``req_pool_indices`` (None for a batch without requests). Host only.

    Spec v1's draft extend after a verify (``DRAFT_EXTEND``) runs only the requests the verify
    left unfinished (``EagleVerifyInput.verify``'s ``unfinished_index``: it narrows
    ``req_pool_indices`` and ``seq_lens``), while the batch's ``reqs`` still lists every
    request of the round: the finished ones are dropped here, in order."""
    reqs = getattr(batch, "reqs", None)
    if (
        reqs is not None
        and getattr(batch, "forward_mode", None) == ForwardMode.DRAFT_EXTEND
        and len(reqs) != batch.req_pool_indices.shape[0]
    ):
        reqs = [r for r in reqs if not r.finished()]
    return reqs


def live_row_reqs(reqs: Iterable["Req"]) -> List["Req"]:
    """Of ``reqs``, those holding a ``req_to_token`` row now (finished ones included until
    sglang releases them)."""
    return [r for r in reqs if r.req_pool_idx is not None]


def scheduler_chunked_req(scheduler: "Scheduler") -> Optional["Req"]:
    """The request the scheduler is prefilling in chunks (``Scheduler.chunked_req``), or
    None."""
    return getattr(scheduler, "chunked_req", None)


def abort_running_req(req: "Req", message: str) -> bool:
    """Abort a running request the way sglang's ``Scheduler.abort_request`` does for running
    requests ("abort method 3": ``req.to_finish = FINISH_ABORT(...)``; the scheduler finishes
    it at its next batch result and frees its KV through the normal path), with ``message``
    and HTTP status 500, so a non-streaming client gets an error, not the text. False when
    it is already finishing."""
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if req_done(req):
        return False
    req.to_finish = FINISH_ABORT(
        message, HTTPStatus.INTERNAL_SERVER_ERROR, "KVCacheCorruptionError"
    )
    return True
