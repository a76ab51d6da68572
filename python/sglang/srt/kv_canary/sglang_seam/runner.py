"""``ModelRunner`` and its graph runners: the runner's facts, the canary and memory reservation it carries, its wrapped ``model.forward``, the graph runners' padding rows, the EAGLE draft runners.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| ``ModelRunner`` | reads ``token_to_kv_pool``, ``req_to_token_pool.req_to_token``, ``device``, ``model_config.context_len`` / ``vocab_size``, ``sliding_window_size``, ``is_draft_worker``, ``draft_model_idx`` (multi-layer EAGLE's MTP layer); sets ``kv_canary_manager``, and ``kv_canary_mtp_layer_0`` on the ``req_to_token_pool`` the multi-layer EAGLE runners share; replaces ``sampler`` (token oracle); wraps ``model.forward`` on the instance (a piecewise CUDA-graph replay calls it with a padded copy of the batch; its warm-up and capture, inside ``init_piecewise_cuda_graphs``, with dummy batches) | ``install``, ``plugin`` |
| ``CudaGraphRunner.model_runner``, ``.buffers`` (``DecodeInputBuffers``) | zeroes ``req_pool_indices`` (and ``input_ids`` / ``positions`` for the token oracle) before each replay | ``plugin`` |
| EAGLE (``EAGLEWorker`` spec v1, ``EagleDraftWorker`` / ``EAGLEWorkerV2`` spec v2, ``EAGLEDraftCudaGraphRunner``, ``EAGLEDraftExtendCudaGraphRunner``; multi-layer EAGLE's ``MultiLayerEagleDraftWorker``) | hooks ``draft_forward``, ``init_cuda_graphs`` (and ``MultiLayerEagleDraftWorker.init_cuda_graphs``), the graph runners' ``capture_one_batch_size`` / ``replay``; reads the workers' ``draft_runner`` / ``model_runner`` / ``speculative_num_steps``, ``Scheduler.draft_worker`` (``.draft_worker`` in v2), the graph runners' ``model_runner`` (and the draft one's ``speculative_num_steps``); zeroes the draft-extend graph's ``buffers.req_pool_indices``; reads ``ServerArgs.speculative_*``, ``enable_multi_layer_eagle`` and ``disable_overlap_schedule`` (spec v1) | ``plugin``, ``startup_checks``, ``install`` |
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:  # annotations only
    import torch

    from sglang.srt.mem_cache.memory_pool import KVCache
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang.srt.model_executor.model_runner import ModelRunner


_MANAGER_ATTR = "kv_canary_manager"


_MANAGER_ATTR = "kv_canary_manager"
_WRAPPED_FORWARD_MARK = "_kv_canary_wrapped_forward"


class RunnerFacts:
    """What the canary builder needs from a ``ModelRunner`` (read once, at install)."""

    __slots__ = (
        "kv_pool",
        "req_to_token",
        "device",
        "context_len",
        "vocab_size",
        "sliding_window_size",
        "tp_rank",
        "tp_size",
        "pp_rank",
        "pp_size",
        "dp_rank",
    )

    def __init__(self, model_runner: "ModelRunner", req_to_token: "Optional[torch.Tensor]" = None):
        """``req_to_token``: the table to map positions through, when not the runner's own
        (DFLASH's draft runner: the target's)."""
        self.kv_pool: "KVCache" = model_runner.token_to_kv_pool
        self.req_to_token: "torch.Tensor" = (
            model_runner.req_to_token_pool.req_to_token if req_to_token is None else req_to_token
        )
        self.device = model_runner.device
        self.context_len = int(model_runner.model_config.context_len)
        self.vocab_size = int(model_runner.model_config.vocab_size)
        window = getattr(model_runner, "sliding_window_size", None)
        self.sliding_window_size: Optional[int] = int(window) if window else None
        # this runner's ranks (the perturbation's rank targets); dp_rank is None without DP
        self.tp_rank = int(getattr(model_runner, "tp_rank", 0) or 0)
        self.tp_size = int(getattr(model_runner, "tp_size", 1) or 1)
        self.pp_rank = int(getattr(model_runner, "pp_rank", 0) or 0)
        self.pp_size = int(getattr(model_runner, "pp_size", 1) or 1)
        self.dp_rank = int(getattr(model_runner, "dp_rank", 0) or 0)


def runner_context_len(model_runner: "ModelRunner") -> int:
    return int(model_runner.model_config.context_len)


_RESERVATION_ATTR = "kv_canary_memory_reservation"


def set_runner_memory_reservation(model_runner: "ModelRunner", reservation) -> None:
    """Keep the KV-pool reservation on the target runner that sized its pool."""
    setattr(model_runner, _RESERVATION_ATTR, reservation)


def share_memory_reservation(model_runner: "ModelRunner") -> None:
    """Stamp the target runner's reservation on its ``memory_pool_config``, which sglang hands
    to the EAGLE draft runner (whose pool the target's profile sized too)."""
    config = getattr(model_runner, "memory_pool_config", None)
    if config is not None:
        setattr(config, _RESERVATION_ATTR, getattr(model_runner, _RESERVATION_ATTR, None))


def runner_memory_reservation(model_runner: "ModelRunner"):
    """The reservation that sized this runner's pool: the target's own, a draft runner's
    through the ``memory_pool_config`` it shares with its target (None: none made)."""
    own = getattr(model_runner, _RESERVATION_ATTR, None)
    if own is not None:
        return own
    return getattr(getattr(model_runner, "memory_pool_config", None), _RESERVATION_ATTR, None)


def is_draft_worker(model_runner: "ModelRunner") -> bool:
    return bool(getattr(model_runner, "is_draft_worker", False))


def mtp_layer_index(model_runner: "ModelRunner") -> Optional[int]:
    """Multi-layer EAGLE (``--enable-multi-layer-eagle``): which MTP layer's draft runner
    ``model_runner`` is (sglang's ``draft_model_idx``: 0 for the draft ``TpModelWorker``'s own
    runner, ``1 .. steps - 1`` for the runners it adds); None on any other runner."""
    if not is_draft_worker(model_runner):
        return None
    index = getattr(model_runner, "draft_model_idx", None)
    return None if index is None else int(index)


# MTP layer 0's canary and pool, kept on the ReqToTokenPool every multi-layer EAGLE runner
# shares (sglang builds runners 1 .. steps - 1 after runner 0, each given that same object)
_MTP_LAYER_0_ATTR = "kv_canary_mtp_layer_0"


def set_mtp_layer_0_canary(model_runner: "ModelRunner", manager) -> None:
    """Keep MTP layer 0's runner's canary and its pool where the later MTP runners find them."""
    setattr(
        model_runner.req_to_token_pool,
        _MTP_LAYER_0_ATTR,
        (manager, model_runner.token_to_kv_pool),
    )


def mtp_layer_0_canary(model_runner: "ModelRunner"):
    """``(canary, KV pool)`` of MTP layer 0's runner of the multi-layer EAGLE worker
    ``model_runner`` belongs to (None: none installed)."""
    return getattr(model_runner.req_to_token_pool, _MTP_LAYER_0_ATTR, None)


def batch_kv_pool(forward_batch) -> "KVCache":
    """The KV pool a ``ForwardBatch``'s attention writes and reads (``token_to_kv_pool``,
    which ``ForwardBatch.init_new`` takes from the runner it builds the batch for)."""
    return forward_batch.token_to_kv_pool


def runner_canary(model_runner: Optional["ModelRunner"]):
    """The canary manager installed on ``model_runner`` (None when off or not installed)."""
    return getattr(model_runner, _MANAGER_ATTR, None) if model_runner is not None else None


def set_runner_canary(model_runner: "ModelRunner", manager) -> None:
    setattr(model_runner, _MANAGER_ATTR, manager)


def runner_sampler(model_runner: "ModelRunner"):
    return getattr(model_runner, "sampler", None)


def set_runner_sampler(model_runner: "ModelRunner", sampler) -> None:
    model_runner.sampler = sampler


def wrap_model_forward(model_runner: "ModelRunner", *, before: Callable, after: Callable) -> bool:
    """Wrap ``model_runner.model.forward`` on the instance (once) so that ``before(fb)`` and
    ``after(fb)`` run around every call, eager or captured. False when already wrapped."""
    model = model_runner.model
    if getattr(model, _WRAPPED_FORWARD_MARK, False):
        return False
    original = model.forward

    @functools.wraps(original)
    def forward(input_ids, positions, forward_batch, *args, **kwargs):
        before(forward_batch)
        out = original(input_ids, positions, forward_batch, *args, **kwargs)
        after(forward_batch)
        return out

    model.forward = forward
    setattr(model, _WRAPPED_FORWARD_MARK, True)
    return True


def graph_runner_model_runner(graph_runner: "CudaGraphRunner") -> "ModelRunner":
    """The runner of a ``CudaGraphRunner`` or of an EAGLE draft / draft-extend graph runner
    (all three keep it as ``model_runner``)."""
    return graph_runner.model_runner


def draft_worker_runner(worker) -> "ModelRunner":
    """The draft ``ModelRunner`` of an EAGLE worker: spec v2's ``EagleDraftWorker.draft_runner``,
    spec v1's ``EAGLEWorker.model_runner`` (the v1 worker is the draft ``TpModelWorker``)."""
    runner = getattr(worker, "draft_runner", None)
    return runner if runner is not None else worker.model_runner


def draft_worker_steps(worker) -> int:
    """The speculative steps an EAGLE worker's next ``draft_forward`` runs: its
    ``speculative_num_steps`` (``EAGLEWorker`` / ``EagleDraftWorker``), which
    ``--speculative-adaptive`` switches between rounds."""
    return int(worker.speculative_num_steps)


def draft_graph_runner_steps(graph_runner) -> int:
    """The speculative steps an ``EAGLEDraftCudaGraphRunner``'s graphs were captured with (its
    ``speculative_num_steps``, fixed at construction: one runner per adaptive step count)."""
    return int(graph_runner.speculative_num_steps)


def zero_draft_extend_graph_padding(graph_runner) -> None:
    """Zero the draft-extend graph's static ``req_pool_indices`` before sglang copies the real
    rows in: sglang 0.5.12's ``EAGLEDraftExtendCudaGraphRunner.replay`` leaves the padding rows'
    indices of an earlier, larger replay (the decode-side runners zero them). One memset on
    the forward stream, no sync."""
    graph_runner.buffers.req_pool_indices.zero_()


def zero_graph_padding_inputs(graph_runner: "CudaGraphRunner", *, token_inputs: bool) -> None:
    """Zero the decode graph's static ``req_pool_indices`` (and, with ``token_inputs``,
    ``input_ids`` / ``positions``) before sglang copies the real rows in, so padding rows are
    row 0 (the row ``ReqToTokenPool`` reserves for them) writing token 0 at position 0.
    Device memsets on the forward stream, no sync."""
    buffers = graph_runner.buffers
    buffers.req_pool_indices.zero_()
    if token_inputs:
        buffers.input_ids.zero_()
        buffers.positions.zero_()
