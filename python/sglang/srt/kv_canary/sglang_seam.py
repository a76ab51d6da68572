"""The sglang seam: every sglang 0.5.12 internal the canary reads beyond a public field or sets,
every hook target and every sglang import of the runtime (only this module imports sglang
outside the two packages: ``test_layering.py``); a new sglang is ported here
(docs/architecture.md, "Hooks and the sglang seam"). The contract, who relies on each internal:

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| hook targets (``HOOK_*`` below) through ``HookRegistry`` | BEFORE / AFTER / AROUND hooks | ``plugin`` |
| ``ServerArgs`` instance | sets ``kv_canary``, ``kv_canary_sweep_interval``, ``kv_canary_real_data``, ``kv_canary_token_oracle_requested``; reads ``device``, ``enable_torch_compile``, ``chunked_prefill_size``, ``max_prefill_tokens``, ``cuda_graph_max_bs``, ``sampling_backend``, ``disaggregation_mode`` (the reports' PD server role) | ``server_args_ext``, ``config``, ``api`` |
| KV pool sizing (``ModelRunner._profile_available_bytes``, before the pool exists) | hook target; :class:`KvPoolSizing` calls ``create_memory_pool_configurator`` (``calculate_pool_sizes`` / ``_from_max_tokens``, ``MemoryPoolConfig``'s token counts) and ``ModelRunner._resolve_max_num_reqs``; reads ``server_args.page_size`` / ``max_total_tokens`` / ``speculative_num_draft_tokens`` / ``disaggregation_mode``, ``model_config`` (context length, layer ids, ``hf_config``), ``use_mla_backend``, ``is_hybrid_swa``, ``mambaish_config``, ``num_effective_layers``, ``start_layer`` / ``end_layer``, ``device``; sets ``kv_canary_memory_reservation`` on the target ``ModelRunner`` and its ``memory_pool_config`` (the draft runner's, shared) | ``memory_budget``, ``api``, ``plugin`` |
| HiCache host pool sizing (``HostKVCache.__init__``) | hook target: its ``host_to_device_ratio`` / ``host_size`` arguments; reads the device pool's ``size`` and per-token row bytes (``k_buffer`` / ``v_buffer`` / ``kv_buffer``); the builder sets ``kv_canary_manager`` on the guarded pool | ``api``, ``builder`` |
| ``ModelRunner`` | reads ``token_to_kv_pool``, ``req_to_token_pool.req_to_token``, ``device``, ``model_config.context_len`` / ``vocab_size``, ``sliding_window_size``, ``is_draft_worker``; sets ``kv_canary_manager``; replaces ``sampler`` (token oracle); wraps ``model.forward`` on the instance (a piecewise CUDA-graph replay calls it with a padded copy of the batch; its warm-up and capture, inside ``init_piecewise_cuda_graphs``, with dummy batches) | ``api``, ``plugin`` |
| ``CudaGraphRunner.model_runner``, ``.buffers`` (``DecodeInputBuffers``) | zeroes ``req_pool_indices`` (and ``input_ids`` / ``positions`` for the token oracle) before each replay | ``plugin`` |
| ``Scheduler.tp_worker.model_runner``, ``Scheduler.tree_cache``, ``.server_args`` | finds the runner's canary, hands the radix cache to the sweep and containment, the settings to ``get_init_info`` | ``plugin`` |
| PD decode: ``disaggregation.decode._is_fake_transfer`` (private; with ``server_args.disaggregation_mode``), ``disaggregation.utils.FAKE_BOOTSTRAP_HOST`` | which requests' transfers sglang faked (nothing sent: their reads are set aside, not reported) | ``runner.requests`` |
| ``Scheduler.running_batch`` / ``.cur_batch`` (``.reqs``), ``.chunked_req`` | the running requests a violation touches; the request PD prefill stashes (abort mode lifts its mark around it) | ``runner.requests``, ``plugin`` |
| ``Scheduler.enable_metrics``, ``.metrics_collector.labels`` | the canary's Prometheus series get the scheduler's labels | ``runner.metrics`` |
| ``Scheduler.token_to_kv_pool_allocator.available_size()``, ``.max_total_num_tokens`` | the protected-tokens gauge | ``runner.metrics`` |
| ``ScheduleBatch.reqs`` (``ModelWorkerBatch.reqs``, ``.forward_mode``, ``.req_pool_indices``) | the requests of a ``ForwardBatch.init_new`` (spec v1's draft extend: the unfinished ones) | ``plugin`` |
| EAGLE (``EAGLEWorker`` spec v1, ``EagleDraftWorker`` / ``EAGLEWorkerV2`` spec v2, ``EAGLEDraftCudaGraphRunner``, ``EAGLEDraftExtendCudaGraphRunner``) | hooks ``draft_forward``, ``init_cuda_graphs``, the graph runners' ``capture_one_batch_size`` / ``replay``; reads the workers' ``draft_runner`` / ``model_runner``, ``Scheduler.draft_worker`` (``.draft_worker`` in v2), the graph runners' ``model_runner``; zeroes the draft-extend graph's ``buffers.req_pool_indices``; reads ``ServerArgs.speculative_*`` and ``enable_multi_layer_eagle`` | ``plugin``, ``api`` |
| ``ForwardBatch`` | sets one attribute, ``kv_canary_batch_state`` (:func:`set_batch_state`); reads ``spec_info.draft_token_num``; ``ForwardMode`` | ``batch_state``, ``plan_input`` |
| ``SamplingBatchInfo`` | sets / reads ``kv_canary_oracle_batch`` | ``token_oracle`` |
| ``Req`` | caches ``kv_canary_oracle_key``; reads ``rid``, ``origin_input_ids``, ``output_ids``, ``req_pool_idx``, ``kv_allocated_len``, ``finished()``, ``to_finish``; histories are kept by identity (sglang replaces, never edits, a rewritten list); abort mode sets ``to_finish = FINISH_ABORT(...)`` (sglang's abort of a running request), ``skip_radix_cache_insert`` and ``kv_canary_no_radix_insert`` (lifts the former around ``Scheduler.stash_chunked_request``, whose ``maybe_cache_unfinished_req`` also honours it; abort mode refuses PD, so PD prefill's copy of the stash never sees the mark) | ``token_oracle``, ``token_history``, ``runner.requests``, ``runner.containment`` |
| radix tree nodes (``TreeNode``) | reads ``root_node``, ``children``, ``value``, ``lock_ref`` (``full_lock_ref`` in ``MambaRadixCache``), ``swa_tombstone``; ``RadixCache`` / ``SWARadixCache`` / ``MambaRadixCache`` / ``UnifiedRadixCache`` types; ``UnifiedTreeNode``: ``component_data[ComponentType.FULL]`` (``value``, ``lock_ref``, ``host_value``), ``component_data[ComponentType.SWA].value``, ``tree_components`` | ``radix_cache_walker`` |
| tree-cache release (``RadixCache`` / ``ChunkCache.cache_finished_req``; the ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` behind it) | hooks ``cache_finished_req``; sets ``kv_canary_release_guard`` on the tree cache; reads the allocator's ``page_size``, ``free_pages``, ``release_pages``, ``free_group``, ``is_not_in_free_group``; wraps its ``free`` on the instance for one release; frees through it; reads ``Req.kv_committed_len``, ``cache_protected_len``, ``sampling_params.max_new_tokens``; sets ``kv_canary_contained`` on a ``Req`` | ``runner.ownership``, ``runner.containment``, ``runner.manager``, ``plugin`` |
| ``RadixCache`` eviction step | ``token_to_kv_pool_allocator.free(value)``, ``_delete_leaf``, ``_record_remove_event`` per node of an evicted subtree (abort mode) | ``runner.containment`` |
| ``sglang.srt.layers.sampler`` | ``Sampler`` base class (its ``__init__`` is skipped: :func:`init_sampler_module_only`), ``register_sampler_backend``, the private ``_CUSTOM_SAMPLER_FACTORIES`` (idempotent registration) | ``token_oracle.sampler`` |
| HiCache (``HiRadixCache.cache_controller``: ``mem_pool_host``, ``load_stream``; host pool ``size``, ``page_size``, ``layout``, ``k_buffer`` / ``v_buffer`` / ``kv_buffer``, ``backup_from_device_all_layer``, ``load_to_device_per_layer``; nodes' ``host_value``, ``id``; ``ongoing_write_through``; the device pool's ``layer_transfer_counter``) | wraps the host pool's two copy methods on the instance to copy the canary rows with the KV; waits for loads before reading records; lists host-resident pages; flips a host byte (``host_kv`` self-test) | ``runner.hicache``, ``perturb`` |
| KV pool instances | wraps buf-info methods on the instance (:func:`wrap_method_once`); pool classes (:func:`import_sglang_class`); each adapter reads its pool's buffers (listed in the adapter's docstring); reads ``page_size`` (the kept ``req_to_token`` self-test's unit) | ``pool_patcher``, ``runner.manager`` |

On the CUDA-graph path only :func:`zero_graph_padding_inputs` runs (one memset per buffer on
the forward stream, no sync).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import importlib
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Tuple

from sglang.srt.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:  # annotations only
    import torch

    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.memory_pool import KVCache
    from sglang.srt.mem_cache.radix_cache import TreeNode
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.server_args import ServerArgs

__all__ = ["ForwardMode"]  # the rest is used by attribute: ``sglang_seam.<name>``

# ---- hook targets ------------------------------------------------------------------------------

_SA = "sglang.srt.server_args.ServerArgs"
_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
_CG = "sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner"
HOOK_SERVER_ARGS_INIT = f"{_SA}.__init__"
HOOK_SERVER_ARGS_ADD_CLI_ARGS = f"{_SA}.add_cli_args"
HOOK_SERVER_ARGS_FROM_CLI_ARGS = f"{_SA}.from_cli_args"
HOOK_SERVER_ARGS_REPR = f"{_SA}.__repr__"
HOOK_MODEL_RUNNER_INIT_MEMORY_POOL = f"{_MR}.init_memory_pool"
HOOK_MODEL_RUNNER_INIT = f"{_MR}.__init__"
HOOK_MODEL_RUNNER_FORWARD = f"{_MR}.forward"
HOOK_MODEL_RUNNER_INIT_PIECEWISE_CUDA_GRAPHS = f"{_MR}.init_piecewise_cuda_graphs"
HOOK_GRAPH_CAPTURE_ONE_BATCH_SIZE = f"{_CG}.capture_one_batch_size"
HOOK_GRAPH_REPLAY_PREPARE = f"{_CG}.replay_prepare"
HOOK_GRAPH_REPLAY = f"{_CG}.replay"
HOOK_SCHEDULER_INIT_CACHE = "sglang.srt.managers.scheduler.Scheduler.init_cache_with_memory_pool"
HOOK_FORWARD_BATCH_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
HOOK_SCHEDULER_PROCESS_BATCH_RESULT = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
HOOK_SCHEDULER_GET_INIT_INFO = "sglang.srt.managers.scheduler.Scheduler.get_init_info"
# the chunked-prefill stash (``maybe_cache_unfinished_req(..., chunked=True)``) of aggregated
# serving (abort mode, the only one that marks requests, refuses PD)
HOOK_SCHEDULER_STASH_CHUNKED_REQUEST = (
    "sglang.srt.managers.scheduler.Scheduler.stash_chunked_request"
)
# the release of a finished request's KV (``release_kv_cache``'s first step), for the two tree
# caches abort mode runs with
HOOK_RADIX_CACHE_FINISHED_REQ = "sglang.srt.mem_cache.radix_cache.RadixCache.cache_finished_req"
HOOK_CHUNK_CACHE_FINISHED_REQ = "sglang.srt.mem_cache.chunk_cache.ChunkCache.cache_finished_req"
# EAGLE / EAGLE3 / NEXTN speculative decoding: spec v1 (``EAGLEWorker``, overlap scheduler off)
# and spec v2 (``EagleDraftWorker``, overlap on); the draft graph runners serve both
_SPEC = "sglang.srt.speculative"
_EAGLE_V1 = f"{_SPEC}.eagle_worker.EAGLEWorker"
_EAGLE_V2 = f"{_SPEC}.eagle_worker_v2.EagleDraftWorker"
_DRAFT_CG = f"{_SPEC}.eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner"
_DRAFT_EXTEND_CG = f"{_SPEC}.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner"
HOOK_EAGLE_V1_DRAFT_FORWARD = f"{_EAGLE_V1}.draft_forward"
HOOK_EAGLE_V2_DRAFT_FORWARD = f"{_EAGLE_V2}.draft_forward"
HOOK_EAGLE_V1_INIT_CUDA_GRAPHS = f"{_EAGLE_V1}.init_cuda_graphs"
HOOK_EAGLE_V2_INIT_CUDA_GRAPHS = f"{_EAGLE_V2}.init_cuda_graphs"
HOOK_DRAFT_GRAPH_CAPTURE_ONE_BATCH_SIZE = f"{_DRAFT_CG}.capture_one_batch_size"
HOOK_DRAFT_GRAPH_REPLAY = f"{_DRAFT_CG}.replay"
HOOK_DRAFT_EXTEND_GRAPH_CAPTURE_ONE_BATCH_SIZE = f"{_DRAFT_EXTEND_CG}.capture_one_batch_size"
HOOK_DRAFT_EXTEND_GRAPH_REPLAY = f"{_DRAFT_EXTEND_CG}.replay"


def register_hook(target: str, hook: Callable, kind: str) -> None:
    """``HookRegistry.register(target, hook, HookType[kind])`` (kind: BEFORE / AFTER / AROUND
    / REPLACE)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, hook, HookType[kind])


# ---- ServerArgs --------------------------------------------------------------------------------


def server_args_value(server_args: "ServerArgs", name: str, default: Any = None) -> Any:
    """``server_args.<name>``, or ``default`` when the object lacks it (a ServerArgs built
    before the plugin was loaded, or a test's namespace)."""
    return getattr(server_args, name, default)


def set_server_args_values(server_args: "ServerArgs", values: dict) -> None:
    """Set the canary's own attributes on a ``ServerArgs`` instance (the dataclass is sglang's;
    the canary's fields live on the instance, so they are pickled to the scheduler)."""
    for name, value in values.items():
        setattr(server_args, name, value)


# ---- ModelRunner -------------------------------------------------------------------------------

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

    def __init__(self, model_runner: "ModelRunner"):
        self.kv_pool: "KVCache" = model_runner.token_to_kv_pool
        self.req_to_token: "torch.Tensor" = model_runner.req_to_token_pool.req_to_token
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


# ---- KV pool sizing (before the pool exists) ----------------------------------------------------

HOOK_MODEL_RUNNER_PROFILE_AVAILABLE_BYTES = f"{_MR}._profile_available_bytes"


class PoolFamily(str, enum.Enum):
    """How the pool sglang is about to build lays out its slots (what the canary's groups
    follow): one slot space (MHA-like: K and V rows; MLA-like: one latent row), or a full and
    a sliding-window space (hybrid SWA; DeepSeek-V4)."""

    MHA = "mha"
    MLA = "mla"
    SWA = "swa"
    DSV4 = "dsv4"


@dataclasses.dataclass(frozen=True)
class PoolTokens:
    """Token counts of one candidate pool: ``max_total`` (sglang's ``max_total_num_tokens``;
    for SWA pools the full space's) and ``swa_total`` (the SWA space's; None without one)."""

    max_total: int
    swa_total: Optional[int] = None


class KvPoolSizing:
    """sglang's sizing of one ``ModelRunner``'s KV pool, for the canary to size itself into
    it, inside ``_profile_available_bytes`` (the model is loaded, the pool not yet built).
    Reads ``server_args.page_size`` / ``max_total_tokens`` / ``speculative_num_draft_tokens``
    / ``disaggregation_mode``, ``model_config`` (context length, layer ids), ``use_mla_backend``,
    ``is_hybrid_swa``, ``mambaish_config``, ``num_effective_layers``, ``start_layer`` /
    ``end_layer``; calls ``create_memory_pool_configurator`` (``calculate_pool_sizes`` /
    ``_from_max_tokens``) and ``ModelRunner._resolve_max_num_reqs``, as sglang's own
    ``_resolve_memory_pool_config`` does next."""

    def __init__(self, model_runner: "ModelRunner"):
        from sglang.srt.configs.model_config import is_deepseek_v4
        from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

        mr = model_runner
        self._runner = mr
        self._args = mr.server_args
        self.device = mr.device
        self._configurator = create_memory_pool_configurator(mr)
        self.page_size = int(self._args.page_size or 1)
        self.context_len = int(mr.model_config.context_len)
        hf = mr.model_config.hf_config
        if is_deepseek_v4(hf) and mr.is_hybrid_swa:
            self.family = PoolFamily.DSV4
        elif mr.is_hybrid_swa:
            self.family = PoolFamily.SWA
        elif mr.use_mla_backend:
            self.family = PoolFamily.MLA
        else:
            self.family = PoolFamily.MHA
        mamba = mr.mambaish_config
        if self.family == PoolFamily.SWA:
            self.layers = len(mr.model_config.full_attention_layer_ids)
            self.swa_layers = len(mr.model_config.swa_attention_layer_ids)
        elif mamba is not None:
            self.layers = sum(
                1 for i in mamba.full_attention_layer_ids if mr.start_layer <= i < mr.end_layer
            )
            self.swa_layers = 0
        else:
            self.layers = int(mr.num_effective_layers)
            self.swa_layers = 0
        self._user_cap = self._args.max_total_tokens
        self._draft_tokens = int(self._args.speculative_num_draft_tokens or 0)
        self._decode = self._args.disaggregation_mode == "decode"

    def tokens_for(self, kv_bytes: int) -> Optional[PoolTokens]:
        """What sglang's configurator makes of ``kv_bytes`` (then ``--max-total-tokens``);
        None when that is no pool at all (sglang then stops with "Not enough memory")."""
        if kv_bytes <= 0:
            return None
        try:
            config = self._configurator.calculate_pool_sizes(int(kv_bytes), self.page_size)
            if self._user_cap is not None and self._user_cap < config.max_total_num_tokens:
                config = self._configurator.calculate_pool_sizes_from_max_tokens(
                    int(self._user_cap), self.page_size
                )
        except RuntimeError:  # MemoryPoolConfig: max_total_num_tokens <= 0
            return None
        swa = config.swa_max_total_num_tokens
        full = config.full_max_total_num_tokens
        if swa is not None and full is not None:
            return PoolTokens(max_total=int(full), swa_total=int(swa))
        return PoolTokens(max_total=int(config.max_total_num_tokens))

    def req_to_token_shape(self, tokens: PoolTokens) -> Tuple[int, int]:
        """``ReqToTokenPool.req_to_token``'s shape for a pool of ``tokens``: a row per request
        sglang admits (plus the padding row, plus PD decode's pre-allocated rows) and the
        context length plus sglang's extra columns (4, plus the draft tokens)."""
        reqs = int(self._runner._resolve_max_num_reqs(tokens.max_total))
        rows = reqs + 1
        if self._decode:
            from sglang.srt.environ import envs

            rows += (
                reqs * 2
                if reqs <= 32
                else int(envs.SGLANG_DISAGGREGATION_NUM_PRE_ALLOCATE_REQS.get())
            )
        return rows, self.context_len + 4 + self._draft_tokens


# ---- CudaGraphRunner / Scheduler / ScheduleBatch ------------------------------------------------


def graph_runner_model_runner(graph_runner: "CudaGraphRunner") -> "ModelRunner":
    """The runner of a ``CudaGraphRunner`` or of an EAGLE draft / draft-extend graph runner
    (all three keep it as ``model_runner``)."""
    return graph_runner.model_runner


# ---- speculative decoding (EAGLE workers) --------------------------------------------------


def draft_worker_runner(worker) -> "ModelRunner":
    """The draft ``ModelRunner`` of an EAGLE worker: spec v2's ``EagleDraftWorker.draft_runner``,
    spec v1's ``EAGLEWorker.model_runner`` (the v1 worker is the draft ``TpModelWorker``)."""
    runner = getattr(worker, "draft_runner", None)
    return runner if runner is not None else worker.model_runner


def zero_draft_extend_graph_padding(graph_runner) -> None:
    """Zero the draft-extend graph's static ``req_pool_indices`` before sglang copies the real
    rows in: sglang 0.5.12's ``EAGLEDraftExtendCudaGraphRunner.replay`` leaves the padding rows'
    indices of an earlier, larger replay (the decode-side runners zero them). One memset on
    the forward stream, no sync."""
    graph_runner.buffers.req_pool_indices.zero_()


@dataclasses.dataclass(frozen=True)
class SpeculativeFacts:
    """sglang's resolved speculative-decoding settings (``ServerArgs`` after its own
    defaults): ``algorithm`` upper-case or None; ``num_steps`` / ``topk`` /
    ``num_draft_tokens`` 0 when unset."""

    algorithm: Optional[str]
    num_steps: int
    topk: int
    num_draft_tokens: int
    multi_layer_eagle: bool
    adaptive: bool


def speculative_facts(server_args: "ServerArgs") -> SpeculativeFacts:
    algo = getattr(server_args, "speculative_algorithm", None)
    return SpeculativeFacts(
        algorithm=str(algo).upper() if algo else None,
        num_steps=int(getattr(server_args, "speculative_num_steps", None) or 0),
        topk=int(getattr(server_args, "speculative_eagle_topk", None) or 0),
        num_draft_tokens=int(getattr(server_args, "speculative_num_draft_tokens", None) or 0),
        multi_layer_eagle=bool(getattr(server_args, "enable_multi_layer_eagle", False)),
        adaptive=bool(getattr(server_args, "speculative_adaptive", False)),
    )


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


def scheduler_model_runner(scheduler: "Scheduler") -> Optional["ModelRunner"]:
    worker = getattr(scheduler, "tp_worker", None)
    return getattr(worker, "model_runner", None) if worker is not None else None


def scheduler_draft_model_runner(scheduler: "Scheduler") -> Optional["ModelRunner"]:
    """The EAGLE draft runner of a speculative scheduler (``Scheduler.draft_worker``: spec v1's
    ``EAGLEWorker``, or spec v2's ``EAGLEWorkerV2`` whose ``draft_worker`` is the
    ``EagleDraftWorker``); None without speculative decoding."""
    worker = getattr(scheduler, "draft_worker", None)
    if worker is None:
        return None
    inner = getattr(worker, "draft_worker", None)  # spec v2
    if inner is not None:
        worker = inner
    runner = getattr(worker, "draft_runner", None)
    return runner if runner is not None else getattr(worker, "model_runner", None)


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


# ---- ForwardBatch / SamplingBatchInfo / Req ------------------------------------------------------

_BATCH_STATE_ATTR = "kv_canary_batch_state"
_SAMPLING_ORACLE_ATTR = "kv_canary_oracle_batch"
_REQ_ORACLE_KEY_ATTR = "kv_canary_oracle_key"


def batch_state(forward_batch: "ForwardBatch"):
    """The canary's per-batch state object set by :func:`set_batch_state`, or None."""
    return getattr(forward_batch, _BATCH_STATE_ATTR, None)


def set_batch_state(forward_batch: "ForwardBatch", state) -> None:
    setattr(forward_batch, _BATCH_STATE_ATTR, state)


def draft_token_num(forward_batch: "ForwardBatch") -> int:
    """Draft tokens per request of a TARGET_VERIFY batch (EAGLE)."""
    return int(forward_batch.spec_info.draft_token_num)


def sampling_oracle(sampling_info: "SamplingBatchInfo"):
    return getattr(sampling_info, _SAMPLING_ORACLE_ATTR, None)


def set_sampling_oracle(forward_batch: "ForwardBatch", oracle_batch) -> None:
    """Attach ``oracle_batch`` to the batch's ``sampling_info`` (no-op without one)."""
    sampling_info = getattr(forward_batch, "sampling_info", None)
    if sampling_info is not None:
        setattr(sampling_info, _SAMPLING_ORACLE_ATTR, oracle_batch)


def req_cached_value(req: "Req", compute: Callable[["Req"], int]) -> int:
    """``compute(req)``, cached on the request (the oracle key of its ``rid``)."""
    value = getattr(req, _REQ_ORACLE_KEY_ATTR, None)
    if value is None:
        value = compute(req)
        setattr(req, _REQ_ORACLE_KEY_ATTR, value)
    return value


def req_rid(req: "Req") -> str:
    return str(req.rid)


def req_pool_row(req: "Req") -> Optional[int]:
    """The request's ``req_to_token`` row (None once freed)."""
    idx = req.req_pool_idx
    return int(idx) if idx is not None else None


def req_kv_len(req: "Req") -> int:
    """Entries of the request's ``req_to_token`` row that hold its KV slots now
    (``kv_allocated_len``: later entries are a previous occupant's leftovers)."""
    return int(req.kv_allocated_len)


def req_tokens_left(req: "Req") -> int:
    """New tokens the request may still generate (``sampling_params.max_new_tokens`` less its
    outputs so far; it may stop earlier, at a stop token)."""
    return int(req.sampling_params.max_new_tokens or 0) - len(req.output_ids)


def req_done(req: "Req") -> bool:
    """Finished, or already told to finish (``to_finish``) at its next result."""
    return bool(req.finished() or req.to_finish is not None)


_CANARY_NO_INSERT = "kv_canary_no_radix_insert"


def mark_no_radix_insert(req: "Req") -> None:
    """Tell sglang not to insert the request's KV into the radix cache when it finishes
    (``Req.skip_radix_cache_insert``, which ``release_kv_cache`` honours). sglang's chunked
    prefill honours the same flag when it stashes a chunk, and a request whose chunks are not
    stashed re-prefills the same chunk for ever (allocating each time): the canary's own mark
    is lifted around the stash (:func:`chunk_stash_inserting`). A flag sglang set itself is
    left as it is."""
    if not getattr(req, "skip_radix_cache_insert", False):
        setattr(req, _CANARY_NO_INSERT, True)
    req.skip_radix_cache_insert = True


@contextlib.contextmanager
def chunk_stash_inserting(req: Optional["Req"]):
    """Around sglang's stash of a chunked request's prefilled chunk: the canary's no-insert
    mark (:func:`mark_no_radix_insert`) is lifted so the chunk is cached and the request's
    prefix advances to its next chunk, as for a client's abort (sglang finishes the request
    after its last chunk). What the chunk put in the tree is evicted with the corrupt slot's
    subtree (docs/user_guide.md, "Containment: --kv-canary abort"). No-op for a request the
    canary has not marked (``req`` may be None)."""
    lifted = req is not None and getattr(req, _CANARY_NO_INSERT, False)
    if lifted:
        req.skip_radix_cache_insert = False
    try:
        yield
    finally:
        if lifted:
            req.skip_radix_cache_insert = True


_CANARY_CONTAINED = "kv_canary_contained"
_CANARY_RELEASE_GUARD = "kv_canary_release_guard"


def mark_contained(req: "Req") -> None:
    """Mark a request abort mode aborted: its release is guarded (:func:`release_guard_of`)."""
    setattr(req, _CANARY_CONTAINED, True)


def req_contained(req: "Req") -> bool:
    return bool(getattr(req, _CANARY_CONTAINED, False))


def set_release_guard(tree_cache, guard) -> None:
    """Attach abort mode's release guard to the scheduler's tree cache (start-up); the
    ``cache_finished_req`` hook finds it there."""
    setattr(tree_cache, _CANARY_RELEASE_GUARD, guard)


def release_guard_of(tree_cache):
    return getattr(tree_cache, _CANARY_RELEASE_GUARD, None)


def req_release_span(req: "Req", tree_cache) -> Tuple[int, int]:
    """The positions of the request's ``req_to_token`` row whose slots its
    ``cache_finished_req`` frees: from ``cache_protected_len`` (below it the radix cache's
    own; 0 for ``ChunkCache``) to ``kv_committed_len``. The speculative over-allocated tail
    (``kv_committed_len`` to ``kv_allocated_len``) is freed afterwards by
    ``release_kv_cache``."""
    lo = 0 if is_chunk_cache(tree_cache) else int(getattr(req, "cache_protected_len", 0) or 0)
    return lo, int(req.kv_committed_len)


def req_token_ids(req: "Req") -> List[int]:
    """The request's tokens by position (``origin_input_ids + output_ids``)."""
    return list(req.origin_input_ids) + list(req.output_ids)


def tree_cache_allocator(tree_cache):
    """The tree cache's ``token_to_kv_pool_allocator`` (what its releases free into)."""
    return tree_cache.token_to_kv_pool_allocator


def allocator_page_size(allocator) -> int:
    return int(allocator.page_size)


def allocator_free_pages(allocator) -> "torch.Tensor":
    """The pages free now, int64 on the allocator's device: ``free_pages``, ``release_pages``
    (freed, not merged yet) and the slots of an open free group (``free_group``, freed at
    ``free_group_end``) as pages. Page ids are slot ids at page size 1."""
    import torch

    parts = [allocator.free_pages.to(torch.int64), allocator.release_pages.to(torch.int64)]
    if not allocator.is_not_in_free_group and allocator.free_group:
        parts.append(
            torch.cat(allocator.free_group).to(torch.int64) // allocator_page_size(allocator)
        )
    return torch.cat(parts)


@contextlib.contextmanager
def allocator_frees_filtered(allocator, keep: Callable[["torch.Tensor"], "torch.Tensor"]):
    """Within the block, every ``allocator.free(indices)`` frees ``keep(indices)`` instead
    (a slot tensor of the same dtype; nothing when it is empty): the instance's ``free`` is
    wrapped for the block and restored after it."""
    own = vars(allocator).get("free")  # an instance-level ``free`` set before ours, if any
    original = allocator.free

    def free(free_index):
        kept = keep(free_index)
        if kept.numel():
            original(kept)

    allocator.free = free
    try:
        yield
    finally:
        if own is None:
            del allocator.free  # the class's method again
        else:
            allocator.free = own


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


# ---- radix caches --------------------------------------------------------------------------------


def radix_cache_types() -> Tuple[type, ...]:
    """The tree caches the sweep can walk: ``RadixCache``, ``SWARadixCache``,
    ``MambaRadixCache`` (hybrid linear-attention models: its nodes' ``value`` holds the
    full-attention slots, ``mamba_value`` the per-request state the canary does not cover) and
    ``UnifiedRadixCache`` (``SGLANG_ENABLE_UNIFIED_RADIX_TREE=1``: one node type whose
    per-component data holds the full-attention slots, the SWA slots or the Mamba state)."""
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return (RadixCache, SWARadixCache, MambaRadixCache, UnifiedRadixCache)


def is_chunk_cache(tree_cache) -> bool:
    """``ChunkCache`` / ``SWAChunkCache``: the tree cache of a server without a radix cache
    (``--disable-radix-cache``; a PD decode server's default). No tree: a finished request's
    slots are freed, not cached."""
    from sglang.srt.mem_cache.chunk_cache import ChunkCache

    return isinstance(tree_cache, ChunkCache)


@functools.lru_cache(maxsize=None)
def _unified_component_indices() -> Tuple[int, int]:
    """``(FULL, SWA)``: where a ``UnifiedTreeNode``'s ``component_data`` keeps the
    full-attention and the SWA component."""
    from sglang.srt.mem_cache.unified_cache_components import ComponentType

    return int(ComponentType.FULL), int(ComponentType.SWA)


def _unified_full(node):
    """A ``UnifiedTreeNode``'s full-attention component data, None for the other node types."""
    data = getattr(node, "component_data", None)
    return None if data is None else data[_unified_component_indices()[0]]


def radix_root_children(radix_cache) -> Iterable["TreeNode"]:
    return radix_cache.root_node.children.values()


def radix_node_children(node: "TreeNode") -> Iterable["TreeNode"]:
    return node.children.values()


def radix_node_key_tokens(node: "TreeNode") -> List[int]:
    """The tokens of the node's key, one per slot of its value (a bigram key, EAGLE's, holds
    one more: each slot's token is the first of its pair)."""
    return list(node.key.token_ids)


def radix_node_depth(node: "TreeNode") -> int:
    """The sequence position of the node's first slot: its ancestors' key lengths."""
    depth, parent = 0, node.parent
    while parent is not None:  # the root's key is empty
        depth += len(parent.key) if parent.key is not None else 0
        parent = parent.parent
    return depth


def radix_node_has_children(node: "TreeNode") -> bool:
    return bool(node.children)


def radix_node_value(node: "TreeNode") -> Optional["torch.Tensor"]:
    """The node's full-attention KV slots (None once evicted from the device)."""
    full = _unified_full(node)
    return node.value if full is None else full.value


def radix_node_locked(node: "TreeNode") -> bool:
    """Held by a running request (``lock_ref``; ``MambaRadixCache`` nodes: ``full_lock_ref``;
    ``UnifiedTreeNode``: the full component's ``lock_ref``)."""
    full = _unified_full(node)
    if full is not None:
        return full.lock_ref > 0
    ref = getattr(node, "lock_ref", None)
    return (ref if ref is not None else node.full_lock_ref) > 0


def radix_node_swa_tombstone(node: "TreeNode") -> bool:
    """An SWA node whose SWA slots were freed: ``SWARadixCache``'s ``swa_tombstone``; a
    ``UnifiedTreeNode`` of a tree with an SWA component whose SWA value is gone. False for
    other caches."""
    data = getattr(node, "component_data", None)
    if data is None:
        return bool(getattr(node, "swa_tombstone", False))
    swa = _unified_component_indices()[1]
    return swa in node.tree_components and data[swa].value is None


def radix_cache_device(radix_cache):
    return getattr(radix_cache, "device", "cpu")


def radix_subtree_eviction_supported(radix_cache) -> bool:
    """Whether :func:`radix_evict_subtree` can evict from this cache: ``RadixCache`` itself
    (its subclasses and the SWA, HiCache, Mamba and unified caches keep more state per node
    than its ``evict`` step updates)."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return type(radix_cache) is RadixCache


def radix_subtree_evictable(radix_cache, node: "TreeNode") -> bool:
    """Whether :func:`radix_evict_subtree` can remove ``node`` and its descendants now: a
    supported cache and no node of the subtree locked by a running request."""
    if not radix_subtree_eviction_supported(radix_cache):
        return False
    stack = [node]
    while stack:
        n = stack.pop()
        if n.lock_ref > 0:
            return False
        stack.extend(n.children.values())
    return True


def radix_evict_subtree(radix_cache, node: "TreeNode") -> int:
    """Remove ``node`` and its descendants from a ``RadixCache`` and free their KV slots,
    leaves first, each step as sglang's own ``RadixCache.evict`` does it for one leaf
    (``token_to_kv_pool_allocator.free(value)``, ``_delete_leaf``, ``_record_remove_event``);
    returns the number of tokens freed. Call only when :func:`radix_subtree_evictable` says
    True (the scheduler's thread, between batches)."""
    order, stack = [], [node]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(n.children.values())
    freed = 0
    for n in reversed(order):  # every child comes after its parent in ``order``
        radix_cache.token_to_kv_pool_allocator.free(n.value)
        freed += len(n.value)
        radix_cache._delete_leaf(n)
        radix_cache._record_remove_event(n)
    return freed


# ---- sampler ------------------------------------------------------------------------------------


def sglang_sampler_class() -> type:
    from sglang.srt.layers.sampler import Sampler

    return Sampler


def init_sampler_module_only(sampler) -> None:
    """Initialise a ``Sampler`` subclass as a bare ``nn.Module``: sglang's
    ``Sampler.__init__`` reads the tensor-parallel group and sampling options that a sampler
    ignoring the logits does not use."""
    import torch.nn

    torch.nn.Module.__init__(sampler)


def register_sampler_backend(name: str, factory: Callable) -> None:
    """sglang's ``register_sampler_backend`` (adds ``name`` to ``--sampling-backend``), once
    per process: a second call with the same factory is a no-op (sglang would warn)."""
    from sglang.srt.layers import sampler as sampler_mod

    if sampler_mod._CUSTOM_SAMPLER_FACTORIES.get(name) is factory:
        return
    sampler_mod.register_sampler_backend(name, factory)


# ---- pools ----------------------------------------------------------------------------------------

_WRAPPED_METHODS_ATTR = "_kv_canary_wrapped_methods"


def kv_pool_page_size(kv_pool: "KVCache") -> int:
    """The pool's page size (``KVCache.page_size``; the hybrid pools' too)."""
    return int(kv_pool.page_size)


def import_sglang_class(module: str, name: str) -> type:
    """``module.name`` from sglang; ``ImportError`` when this build lacks it."""
    cls = getattr(importlib.import_module(module), name, None)
    if cls is None:
        raise ImportError(f"{module} has no {name}")
    return cls


def wrap_method_once(obj, method_name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``obj.method_name`` (on the instance) with ``make_wrapper(original)``.

    Raises ``RuntimeError`` if the canary already wrapped this method on this object (a second
    attach would splice the canary buffers twice and break PD transfers)."""
    wrapped = obj.__dict__.setdefault(_WRAPPED_METHODS_ATTR, set())
    if method_name in wrapped:
        raise RuntimeError(
            f"kv_canary already wrapped {type(obj).__name__}.{method_name} on this pool; "
            "canary buffers can be attached to a pool only once"
        )
    original = getattr(obj, method_name)
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    setattr(obj, method_name, wrapper)
    wrapped.add(method_name)


# ---- HiCache (hierarchical cache) ------------------------------------------------------------


def hicache_host_pool(radix_cache):
    """The host-tier KV pool of a ``HiRadixCache`` (``cache_controller.mem_pool_host``), or
    None for a tree without a host tier."""
    controller = getattr(radix_cache, "cache_controller", None)
    return getattr(controller, "mem_pool_host", None) if controller is not None else None


def hicache_wait_for_loads(radix_cache) -> None:
    """Make the current stream wait for every host -> device load queued so far (the sweep
    reads records of slots a queued load fills). CUDA only; a no-op on the CPU, where the
    loads are synchronous."""
    controller = getattr(radix_cache, "cache_controller", None)
    stream = getattr(controller, "load_stream", None) if controller is not None else None
    import torch

    if stream is not None and isinstance(stream, torch.cuda.Stream):
        torch.cuda.current_stream(stream.device).wait_stream(stream)


def hicache_wait_for_first_layer(kv_pool) -> None:
    """Make the current stream wait until this forward's host -> device load has finished its
    first layer (which carries the canary rows): sglang's ``layer_transfer_counter``, a no-op
    when the forward loads nothing (decode) or the pool has no host tier."""
    counter = getattr(kv_pool, "layer_transfer_counter", None)
    if counter is not None:
        counter.wait_until(0)


def host_pool_kind(host_pool) -> str:
    """``mha`` or ``mla`` for the host pools the canary mirrors; raises for others."""
    from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost

    if isinstance(host_pool, MHATokenToKVPoolHost):
        return "mha"
    if isinstance(host_pool, MLATokenToKVPoolHost):
        return "mla"
    raise NotImplementedError(
        f"kv_canary does not mirror HiCache host pool {type(host_pool).__name__} (supported: "
        "MHATokenToKVPoolHost, MLATokenToKVPoolHost); run without --enable-hierarchical-cache "
        "or without --kv-canary"
    )


HOOK_HOST_KV_CACHE_INIT = "sglang.srt.mem_cache.memory_pool_host.HostKVCache.__init__"
# set by the builder on a guarded device pool: its canary manager (HiCache sizes the host pool
# from it, and the host tier's mirror of its records goes beside the host KV)
_POOL_CANARY_ATTR = "kv_canary_manager"


def set_pool_canary(kv_pool: "KVCache", manager) -> None:
    setattr(kv_pool, _POOL_CANARY_ATTR, manager)


def pool_canary(kv_pool: "KVCache"):
    return getattr(kv_pool, _POOL_CANARY_ATTR, None)


def host_pool_class_kind(host_pool_cls: type) -> Optional[str]:
    """``mha`` / ``mla`` for the host pool classes the canary mirrors, else None."""
    from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost

    if issubclass(host_pool_cls, MHATokenToKVPoolHost):
        return "mha"
    if issubclass(host_pool_cls, MLATokenToKVPoolHost):
        return "mla"
    return None


def kv_pool_bytes_per_token(kv_pool: "KVCache") -> int:
    """KV bytes one token takes over all of an MHA or MLA pool's layers (one row of each
    layer's ``k_buffer`` and ``v_buffer``, or of its ``kv_buffer``): what HiCache's host pool
    of that device pool stores per token (``HostKVCache.get_size_per_token``)."""
    if hasattr(kv_pool, "k_buffer"):
        return sum(int(b[0].nbytes) for b in (*kv_pool.k_buffer, *kv_pool.v_buffer))
    return sum(int(b[0].nbytes) for b in kv_pool.kv_buffer)


def kv_pool_size(kv_pool: "KVCache") -> int:
    return int(kv_pool.size)


def host_pool_size(host_pool) -> int:
    return int(host_pool.size)


def host_pool_layer_rows(host_pool, layer: int, half: str):
    """``(tensor, page_size)``: the host rows of local ``layer``'s ``half`` ('k' / 'v'; MLA:
    'k', the latent row) addressed as the record format's ``RealKvSource`` addresses them
    (slot ``h`` = row ``h // page_size``, token ``h % page_size``). Raises for the
    ``page_head`` layout, whose rows are not contiguous per token."""
    layout = host_pool.layout
    kind = host_pool_kind(host_pool)
    if kind == "mha":
        buf = host_pool.k_buffer if half == "k" else host_pool.v_buffer
    else:
        if half != "k":
            raise ValueError("MLA host pools have K (latent) rows only")
        buf = host_pool.kv_buffer
    if layout == "layer_first":
        return buf[layer], 1
    if layout == "page_first":
        return buf[:, layer], 1
    if layout == "page_first_direct":
        return buf[:, layer], int(host_pool.page_size)
    raise ValueError(
        f"kv_canary cannot address HiCache host rows in layout {layout!r} "
        "(supported: layer_first, page_first, page_first_direct)"
    )


def wrap_host_pool_copies(host_pool, *, after_backup: Callable, before_load: Callable) -> None:
    """Wrap the host pool's two copy methods on the instance (once): ``after_backup(host_
    indices, device_indices)`` after each device -> host backup, ``before_load(host_indices,
    device_indices)`` before the first layer's host -> device load. Both run where sglang runs
    the copy (the scheduler thread, inside its write / load stream)."""

    def make_backup(original):
        def backup(device_pool, host_indices, device_indices, io_backend):
            result = original(device_pool, host_indices, device_indices, io_backend)
            after_backup(host_indices, device_indices)
            return result

        return backup

    def make_load(original):
        def load(device_pool, host_indices, device_indices, layer_id, io_backend):
            if layer_id == 0:
                before_load(host_indices, device_indices)
            return original(device_pool, host_indices, device_indices, layer_id, io_backend)

        return load

    wrap_method_once(host_pool, "backup_from_device_all_layer", make_backup)
    wrap_method_once(host_pool, "load_to_device_per_layer", make_load)


def radix_node_host_value(node: "TreeNode"):
    """A HiCache node's host indices (None when it has no host copy)."""
    full = _unified_full(node)
    return getattr(node, "host_value", None) if full is None else full.host_value


def radix_node_id(node: "TreeNode") -> int:
    return int(node.id)


def hicache_pending_write_node_ids(radix_cache) -> set:
    """Nodes whose device -> host backup may still be in flight (their host rows are not
    final yet)."""
    return set(getattr(radix_cache, "ongoing_write_through", {}) or {})
