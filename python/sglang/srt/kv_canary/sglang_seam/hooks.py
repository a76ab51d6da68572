"""The hook targets: every sglang function the plugin hooks, as the ``HookRegistry`` target string, and :func:`register_hook`.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| hook targets (``HOOK_*`` below) through ``HookRegistry`` | BEFORE / AFTER / AROUND hooks | ``plugin`` |
"""

from __future__ import annotations

from typing import Callable

_SA = "sglang.srt.server_args.ServerArgs"
_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
_CG = "sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"

HOOK_SERVER_ARGS_INIT = f"{_SA}.__init__"
HOOK_SERVER_ARGS_ADD_CLI_ARGS = f"{_SA}.add_cli_args"
HOOK_SERVER_ARGS_FROM_CLI_ARGS = f"{_SA}.from_cli_args"
HOOK_SERVER_ARGS_REPR = f"{_SA}.__repr__"

HOOK_MODEL_RUNNER_INIT_MEMORY_POOL = f"{_MR}.init_memory_pool"
HOOK_MODEL_RUNNER_INIT = f"{_MR}.__init__"
HOOK_MODEL_RUNNER_FORWARD = f"{_MR}.forward"
HOOK_MODEL_RUNNER_INIT_PIECEWISE_CUDA_GRAPHS = f"{_MR}.init_piecewise_cuda_graphs"
HOOK_MODEL_RUNNER_PROFILE_AVAILABLE_BYTES = f"{_MR}._profile_available_bytes"

HOOK_GRAPH_CAPTURE_ONE_BATCH_SIZE = f"{_CG}.capture_one_batch_size"
HOOK_GRAPH_REPLAY_PREPARE = f"{_CG}.replay_prepare"
HOOK_GRAPH_REPLAY = f"{_CG}.replay"

# sglang's compaction of accepted tree nodes at page size > 1 (NGRAM's and EAGLE's verify
# ``_free_cache``): MHATokenToKVPoolFP4 inherits it, the SWA and hybrid pools call it on their
# MHA sub-pools
HOOK_MHA_POOL_MOVE_KV_CACHE = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.move_kv_cache"

HOOK_FORWARD_BATCH_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"

HOOK_SCHEDULER_INIT_CACHE = f"{_SCHEDULER}.init_cache_with_memory_pool"
# speculative decoding with HiCache: sglang registers the draft pool's own host pool with the
# HiCache controller right after init_cache_with_memory_pool
HOOK_SCHEDULER_REGISTER_HICACHE_DRAFT = f"{_SCHEDULER}._maybe_register_hicache_draft"
HOOK_SCHEDULER_PROCESS_BATCH_RESULT = f"{_SCHEDULER}.process_batch_result"
# a batch launched (its result object returned): heal mode tags the result with its forward
HOOK_SCHEDULER_RUN_BATCH = f"{_SCHEDULER}.run_batch"
# each loop iteration's inputs, the same list on every TP rank (``recv_requests`` broadcast it)
HOOK_SCHEDULER_PROCESS_INPUT_REQUESTS = f"{_SCHEDULER}.process_input_requests"
HOOK_SCHEDULER_GET_INIT_INFO = f"{_SCHEDULER}.get_init_info"
# ``/server_info``'s ``internal_states`` (asked of every scheduler at each call): live counts
HOOK_SCHEDULER_GET_INTERNAL_STATE = f"{_SCHEDULER}.get_internal_state"
# the event loops' idle step (every scheduler loop calls it when it runs no batch): the last
# forward's read-back is reported there, not held back until the next request
HOOK_SCHEDULER_ON_IDLE = f"{_SCHEDULER}.on_idle"
# the chunked-prefill stash (``maybe_cache_unfinished_req(..., chunked=True)``) of aggregated
# serving (abort mode, the only one that marks requests, refuses PD)
HOOK_SCHEDULER_STASH_CHUNKED_REQUEST = f"{_SCHEDULER}.stash_chunked_request"
# the tokens sglang's pool-leak checks count as held outside the tree and the running requests
# (``SchedulerRuntimeCheckerMixin._session_held_tokens``): heal mode adds its retired slots
HOOK_SCHEDULER_SESSION_HELD_TOKENS = f"{_SCHEDULER}._session_held_tokens"

# the release of a finished request's KV (``release_kv_cache``'s first step), for the two tree
# caches abort mode runs with
HOOK_RADIX_CACHE_FINISHED_REQ = "sglang.srt.mem_cache.radix_cache.RadixCache.cache_finished_req"
HOOK_CHUNK_CACHE_FINISHED_REQ = "sglang.srt.mem_cache.chunk_cache.ChunkCache.cache_finished_req"

HOOK_HOST_KV_CACHE_INIT = "sglang.srt.mem_cache.memory_pool_host.HostKVCache.__init__"

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
# multi-layer EAGLE (spec v2): its draft worker (one runner per MTP layer) is not an
# EagleDraftWorker; its init_cuda_graphs ends its start-up, graphs or not
HOOK_MULTI_LAYER_EAGLE_V2_INIT_CUDA_GRAPHS = (
    f"{_SPEC}.multi_layer_eagle_worker_v2.MultiLayerEagleDraftWorker.init_cuda_graphs"
)
HOOK_DRAFT_GRAPH_CAPTURE_ONE_BATCH_SIZE = f"{_DRAFT_CG}.capture_one_batch_size"
HOOK_DRAFT_GRAPH_REPLAY = f"{_DRAFT_CG}.replay"
HOOK_DRAFT_EXTEND_GRAPH_CAPTURE_ONE_BATCH_SIZE = f"{_DRAFT_EXTEND_CG}.capture_one_batch_size"
HOOK_DRAFT_EXTEND_GRAPH_REPLAY = f"{_DRAFT_EXTEND_CG}.replay"

# the token oracle with speculative decoding: each verify (spec v1 EAGLE / EAGLE3 / NEXTN /
# STANDALONE / FROZEN_KV_MTP, spec v2, NGRAM) and the greedy tree walk as each module looks it
# up (a module attribute; NGRAM's is sgl-kernel's op, bound only on CUDA / MUSA / HIP)
HOOK_EAGLE_V1_VERIFY = f"{_SPEC}.eagle_info.EagleVerifyInput.verify"
HOOK_EAGLE_V2_VERIFY_SAMPLE = f"{_SPEC}.eagle_info_v2.EagleVerifyInputV2Mixin.sample"
HOOK_NGRAM_VERIFY = f"{_SPEC}.ngram_info.NgramVerifyInput.verify"
HOOK_EAGLE_V1_GREEDY_WALK = f"{_SPEC}.eagle_info.verify_tree_greedy_func"
HOOK_EAGLE_V2_GREEDY_WALK = f"{_SPEC}.eagle_info_v2.verify_tree_greedy_func"
HOOK_NGRAM_GREEDY_WALK = f"{_SPEC}.ngram_info.verify_tree_greedy"


def register_hook(target: str, hook: Callable, kind: str) -> None:
    """``HookRegistry.register(target, hook, HookType[kind])`` (kind: BEFORE / AFTER / AROUND
    / REPLACE)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, hook, HookType[kind])
