"""sglang plugin entry point (group ``sglang.srt.plugins``, name ``kv_canary``; design:
docs/architecture.md, "Start-up" and "Hooks and the sglang seam").

sglang calls :func:`register` through ``load_plugins()`` in the launching process, the Engine
and every scheduler process, and applies the hooks below right after; :func:`register` also
registers the ``token_oracle`` sampling backend (``--sampling-backend token_oracle``). With
``--kv-canary none`` (the default) the runtime hooks find no manager and pass straight through.

| hook | target | what |
| --- | --- | --- |
| AROUND | ``ServerArgs.__init__`` | accept ``kv_canary*`` kwargs (``Engine(kv_canary=...)``), |
|  |  | validate (not inside ``from_cli_args``: the parsed options are not copied yet) |
| AFTER | ``ServerArgs.add_cli_args`` | add the four ``--kv-canary*`` options |
| AROUND | ``ServerArgs.from_cli_args`` | carry the parsed options over, then validate |
| AROUND | ``ServerArgs.__repr__`` | append the canary's four fields (and its config) |
| AROUND | ``ModelRunner._profile_available_bytes`` | the KV pool's budget less the canary's |
|  |  | share (``reserve_kv_budget``), before sglang sizes the pool |
| AFTER | ``ModelRunner.init_memory_pool`` | ``install_canary`` (pool exists, graphs not yet) |
| AROUND | ``HostKVCache.__init__`` | HiCache's host pool: its KV and the canary's mirror |
|  |  | within ``--hicache-size`` / ``--hicache-ratio`` (``host_pool_budget``) |
| AFTER | ``ModelRunner.__init__`` | ``mark_init_finished`` (warm-up and capture done) |
| AROUND | ``ModelRunner.forward`` | outside-graph bracket with single-forward manager 0 |
| AROUND | ``ModelRunner.init_piecewise_cuda_graphs`` | piecewise graphs' warm-up and capture |
|  |  | run no canary work (their dummy batches are not requests) |
| AROUND | ``CudaGraphRunner.capture_one_batch_size`` | capture bracket |
| AROUND | ``CudaGraphRunner.replay_prepare`` | padding rows really point at row 0 (below) |
| AROUND | ``CudaGraphRunner.replay`` | before: the token-history upload the graph reads; |
|  |  | after: record that the graph ran the inside ops |
| AFTER | ``Scheduler.init_cache_with_memory_pool`` | ``attach_scheduler``: tree cache, running |
|  |  | requests, metric labels, KV slots in use, faked PD transfers |
| AROUND | ``Scheduler._maybe_register_hicache_draft`` | HiCache with a draft pool: its host |
|  |  | pool keeps sglang's size; the draft canary's rows mirrored in it |
| AFTER | ``Scheduler.run_batch`` | heal mode: the result object tagged with its forward |
| BEFORE | ``Scheduler.process_batch_result`` | ``before_batch_result`` (heal mode: the read-back |
|  |  | of the result's forward consumed if still pending; the requests its reports |
|  |  | marked taken back, before sglang appends their tokens) |
| AFTER | ``Scheduler.process_batch_result`` | ``after_batch_result`` (abort and heal mode's |
|  |  | eviction; heal mode queues taken-back requests again) |
| BEFORE | ``Scheduler.process_input_requests`` | abort mode on several TP ranks: the |
|  |  | containment notices taken out of the iteration's inputs and applied |
| AFTER | ``Scheduler.get_init_info`` | add ``kv_canary`` (flags, effective config and |
|  |  | memory) to what ``/server_info`` and ``Engine.get_server_info()`` return |
| AFTER | ``Scheduler.get_internal_state`` | add ``kv_canary`` (each guarded pool's |
|  |  | violations so far, and the mode they are handled in) to ``/server_info``'s |
|  |  | ``internal_states`` |
| AFTER | ``Scheduler._session_held_tokens`` | heal mode: its retired slots counted as |
|  |  | held by sglang's pool-leak checks |
| AROUND | ``Scheduler.stash_chunked_request`` | |
|  |  | abort mode: a request aborted mid chunked prefill is still stashed chunk by |
|  |  | chunk (its no-insert mark lifted), so it reaches its last chunk and finishes |
| AFTER | ``ForwardBatch.init_new`` | the batch's canary state: token-id snapshot of |
|  |  | ``batch.reqs`` (token checks on), token-oracle rows (token oracle on) |
| AROUND | ``EAGLEWorker.draft_forward``, ``EagleDraftWorker.draft_forward`` | one EAGLE |
|  |  | draft round (spec v1 / v2): its forwards use one single-forward manager each |
| AFTER | ``EAGLEWorker.init_cuda_graphs``, ``EagleDraftWorker.init_cuda_graphs``, | the draft |
|  | ``MultiLayerEagleDraftWorker.init_cuda_graphs`` | runner's ``mark_init_finished`` (its |
|  |  | graphs are captured by the worker, later; multi-layer EAGLE: MTP layer 0's runner) |
| AROUND | ``EAGLEDraftCudaGraphRunner.capture_one_batch_size`` | draft rounds captured |
| AROUND | ``EAGLEDraftCudaGraphRunner.replay`` | outside ops of a replayed draft round |
| AROUND | ``EAGLEDraftExtendCudaGraphRunner.capture_one_batch_size`` | capture bracket |
| AROUND | ``EAGLEDraftExtendCudaGraphRunner.replay`` | padding rows at row 0, outside-graph |
|  |  | bracket, replayed mark |
| AFTER | ``MHATokenToKVPool.move_kv_cache`` | the records of the groups bound to that pool |
|  |  | follow the KV (NGRAM's compaction of accepted nodes at page size > 1) |
| AROUND | ``DFlashWorker._append_target_hidden_to_draft_kv`` | the draft canary's write-only |
|  |  | launch for the draft KV DFLASH writes outside any forward |
| AROUND | ``DFlashWorker._append_target_hidden_sequential``, | the positions and slots the |
|  | ``DFlashWorker._append_target_hidden_fused`` | append really wrote |
| AROUND | ``DFlashWorker._prepare_for_speculative_decoding`` | its hand-built draft block |
|  |  | batch gets the batch's requests as canary state |
| AROUND | ``DFlashWorker.__init__`` | the DFLASH draft runner's canary maps positions |
|  |  | through the target's req_to_token; its ``mark_init_finished`` |
| AROUND | ``EagleVerifyInput.verify``, ``EagleVerifyInputV2Mixin.sample``, | token oracle on: |
|  | ``NgramVerifyInput.verify``, ``DFlashVerifyInput.verify`` | the oracle's predictions per |
|  |  | tree node, the greedy walk forced (``token_oracle.spec_verify``) |
| AROUND | ``eagle_info.verify_tree_greedy_func``, ``eagle_info_v2.verify_tree_greedy_func``, | |
|  | ``ngram_info.verify_tree_greedy`` (CUDA / MUSA / HIP only), | the walk's |
|  | ``dflash_info.compute_dflash_correct_drafts_and_bonus`` | ``target_predict`` replaced by those predictions |

One more way in, not a hook: ``install_canary`` (from the hook after
``ModelRunner.init_memory_pool``) wraps each guarded runner's ``model.forward`` on the instance
(``sglang_seam.wrap_model_forward``), so the launches before and after the model run inside
the model call that sglang's CUDA-graph capture records (the ``ModelRunner.forward`` hook runs
outside any graph) and that a piecewise graph's replay calls. It cannot be a ``HookRegistry``
hook: the model class differs per architecture (and per draft model) and is known only once the
runner has loaded it; the wrap must cover exactly the runners the canary guards.

The targets and every sglang internal the hooks touch: :mod:`~sglang.srt.kv_canary.sglang_seam`.
"""

from __future__ import annotations

import contextvars
import logging

from sglang.srt.kv_canary import sglang_seam as seam

logger = logging.getLogger(__name__)

# True while sglang's ``ServerArgs.from_cli_args`` builds the instance: its ``__init__`` then
# runs before the parsed ``--kv-canary*`` options are copied over, so validating there would
# judge the defaults (and refuse, e.g., fault injection "without the canary")
_IN_FROM_CLI_ARGS = contextvars.ContextVar("kv_canary_in_from_cli_args", default=False)


def _server_args_init(original, self, *args, **kwargs):
    from sglang.srt.kv_canary.startup_checks import check_server_args_for_canary
    from sglang.srt.kv_canary.server_args_ext import (
        note_requested_sampling_backend,
        pop_canary_kwargs,
        set_canary_attrs,
    )

    set_canary_attrs(self, pop_canary_kwargs(kwargs))
    note_requested_sampling_backend(self, kwargs.get("sampling_backend"))
    result = original(self, *args, **kwargs)
    if not _IN_FROM_CLI_ARGS.get():
        check_server_args_for_canary(self)
    return result


def _add_cli_args(result, parser):
    from sglang.srt.kv_canary.server_args_ext import add_canary_cli_args

    add_canary_cli_args(parser)


def _from_cli_args(original, cls, args):
    from sglang.srt.kv_canary.startup_checks import check_server_args_for_canary
    from sglang.srt.kv_canary.server_args_ext import canary_values_from_namespace, set_canary_attrs

    token = _IN_FROM_CLI_ARGS.set(True)
    try:
        result = original(cls, args)
    finally:
        _IN_FROM_CLI_ARGS.reset(token)
    set_canary_attrs(result, canary_values_from_namespace(args))
    check_server_args_for_canary(result)
    return result


def _server_args_repr(original, self):
    from sglang.srt.kv_canary.server_args_ext import canary_repr_suffix

    text = original(self)
    suffix = canary_repr_suffix(self)
    return text[:-1] + suffix + ")" if suffix and text.endswith(")") else text


def _profile_available_bytes(original, self, *args, **kwargs):
    from sglang.srt.kv_canary.memory_budget import reserve_kv_budget

    available = original(self, *args, **kwargs)
    return reserve_kv_budget(
        server_args=self.server_args, model_runner=self, available_bytes=available
    )


def _host_kv_cache_init(
    original, self, device_pool, host_to_device_ratio, host_size, *args, **kwargs
):
    from sglang.srt.kv_canary.memory_budget import host_pool_budget

    ratio, size = host_pool_budget(
        device_pool=device_pool,
        host_pool_cls=type(self),
        host_to_device_ratio=host_to_device_ratio,
        host_size=host_size,
        draft=_REGISTERING_DRAFT_HOST_POOL.get(),
    )
    return original(self, device_pool, ratio, size, *args, **kwargs)


# the target's req_to_token while DFlashWorker.__init__ builds its draft runner
_DFLASH_DRAFT_REQ_TO_TOKEN: contextvars.ContextVar = contextvars.ContextVar(
    "kv_canary_dflash_draft_req_to_token"
)


def _after_init_memory_pool(result, self, *args, **kwargs):
    from sglang.srt.kv_canary.install import install_canary

    # DFLASH's draft runner, built inside DFlashWorker.__init__: the target's req_to_token
    table = _DFLASH_DRAFT_REQ_TO_TOKEN.get(None) if seam.is_draft_worker(self) else None
    install_canary(server_args=self.server_args, model_runner=self, req_to_token=table)


def _after_model_runner_init(result, self, *args, **kwargs):
    manager = seam.runner_canary(self)
    # a draft runner's graphs are captured later, by its EAGLE worker (_after_init_cuda_graphs)
    if manager is not None and not seam.is_draft_worker(self):
        manager.mark_init_finished()


def _model_runner_forward(original, self, forward_batch, *args, **kwargs):
    manager = seam.runner_canary(self)
    if manager is None:
        return original(self, forward_batch, *args, **kwargs)
    if manager.in_draft_round:  # one forward of an EAGLE draft round
        with manager.with_draft_forward(forward_batch):
            return original(self, forward_batch, *args, **kwargs)
    with manager.with_active_single_forward_manager(0):
        with manager.with_ops_outside_graph(forward_batch):
            return original(self, forward_batch, *args, **kwargs)


def _init_piecewise_cuda_graphs(original, self, *args, **kwargs):
    """sglang's piecewise CUDA graphs capture the layers (``model.model``) in pieces; the
    warm-up and capture forwards call the wrapped ``model.forward`` with dummy batches outside
    any ``ModelRunner.forward``: no canary work for them. A replay later runs the canary's
    launches eagerly around the replayed pieces, from the ``ModelRunner.forward`` bracket."""
    manager = seam.runner_canary(self)
    if manager is None:
        return original(self, *args, **kwargs)
    with manager.piecewise_graph_setup():
        return original(self, *args, **kwargs)


def _capture_one_batch_size(original, self, *args, **kwargs):
    manager = seam.runner_canary(seam.graph_runner_model_runner(self))
    if manager is None:
        return original(self, *args, **kwargs)
    with manager.graph_capture_setup(), manager.with_active_single_forward_manager(0):
        with manager.capturing():
            return original(self, *args, **kwargs)


def _graph_replay_prepare(original, self, *args, **kwargs):
    """sglang pads a decode batch of ``raw_bs`` requests to the captured ``bs`` by resetting
    ``seq_lens`` and ``out_cache_loc`` of the padding rows, but leaves their
    ``req_pool_indices`` from an earlier, larger replay. ``ReqToTokenPool`` reserves row 0 for
    padded rows; a stale index makes the canary verify a request that is gone (whose row may
    now hold another request). Zero the static buffer before sglang copies the real rows in
    (and, for the token oracle's write-input check, the token inputs: padding rows then write
    token 0 at position 0, which the expected inputs say past the real entries)."""
    manager = seam.runner_canary(seam.graph_runner_model_runner(self))
    if manager is not None:
        seam.zero_graph_padding_inputs(self, token_inputs=manager.config.enable_write_input_assert)
    return original(self, *args, **kwargs)


def _graph_replay(original, self, *args, **kwargs):
    manager = seam.runner_canary(seam.graph_runner_model_runner(self))
    if manager is not None:
        manager.before_graph_replay()  # the token-history upload the graph reads
    out = original(self, *args, **kwargs)
    if manager is not None:
        manager.mark_replayed_inside_graph()
    return out


def _after_init_cache(result, self, *args, **kwargs):
    # the target runner's canary, then the EAGLE draft runner's (same tree, same requests,
    # the same Prometheus series)
    target = seam.runner_canary(seam.scheduler_model_runner(self))
    draft = seam.runner_canary(seam.scheduler_draft_model_runner(self))
    for manager in (target, draft):
        if manager is None:
            continue
        manager.attach_scheduler(
            radix_cache=seam.scheduler_tree_cache(self),
            running_reqs=lambda: seam.scheduler_running_reqs(self),
            metrics_labels=seam.scheduler_metrics_labels(self),
            kv_slots_in_use=lambda: seam.scheduler_kv_slots_in_use(self),
            metrics_of=target if manager is draft and target is not None else None,
            faked_transfer=seam.faked_transfer_test(self),
            retraction=seam.SchedulerRetraction(self),
        )
    _attach_ranks(self, [m for m in (target, draft) if m is not None])


# set while sglang builds a speculative draft pool's HiCache host pool: it keeps sglang's size
_REGISTERING_DRAFT_HOST_POOL: contextvars.ContextVar = contextvars.ContextVar(
    "kv_canary_registering_draft_host_pool", default=False
)


def _register_hicache_draft(original, self, *args, **kwargs):
    """Speculative decoding with HiCache: the host pool sglang builds for the draft pool
    (one host slot per target host slot) keeps sglang's size (:func:`_host_kv_cache_init`),
    and the draft canary's rows then go to it. Where sglang keeps no host copy of the draft
    pool's KV, a warning: prefixes loaded back from host memory bring no draft KV, and the
    draft canary reports their slots (docs/user_guide.md, "HiCache")."""
    token = _REGISTERING_DRAFT_HOST_POOL.set(True)
    try:
        result = original(self, *args, **kwargs)
    finally:
        _REGISTERING_DRAFT_HOST_POOL.reset(token)
    draft = seam.runner_canary(seam.scheduler_draft_model_runner(self))
    tree = seam.scheduler_tree_cache(self)
    if draft is None or seam.hicache_host_pool(tree) is None:
        return result
    if not draft.attach_draft_host_tier(tree):
        device_pool, _ = seam.hicache_draft_pools(tree)
        target = seam.runner_canary(seam.scheduler_model_runner(self))
        why = (
            "it registered the target's pool as the draft's (sglang 0.5.12 does so for "
            "--speculative-algorithm DFLASH)"
            if device_pool is not None and seam.pool_canary(device_pool) is target
            else "it registered no host pool for the draft's pool"
        )
        logger.warning(
            "kv_canary: sglang's HiCache keeps no host copy of this server's speculative draft "
            "KV (%s): a prefix loaded back from host memory comes with the target's KV only, "
            "and the draft canary reports the draft slots it reads (pool=draft; they cost "
            "draft acceptance, not output correctness)",
            why,
        )
    return result


def _attach_ranks(scheduler, managers) -> None:
    """Several TP ranks: each canary's containment joins the others' (abort mode; every rank
    runs this at the same point of its start-up, in the same order of canaries)."""
    group = seam.scheduler_tp_rank_group(scheduler)
    if group is None:
        return
    for manager in managers:
        manager.attach_ranks(group)


def _before_process_input_requests(self, recv_reqs, *args, **kwargs):
    """Abort mode on several ranks: the containment notices among this iteration's inputs
    (every rank's list is the same) are taken out before sglang dispatches the list, and
    each of the scheduler's canaries applies those for its pool."""
    if not recv_reqs:
        return
    managers = _scheduler_canaries(self)
    if not managers:
        return
    from sglang.srt.kv_canary.violations.rank_relay import take_containment_notices

    notices = take_containment_notices(recv_reqs)
    for manager in managers if notices else ():
        manager.apply_containment_notices(notices)


def _scheduler_canaries(scheduler):
    """The canaries of a scheduler's runners: the target's, then an EAGLE draft's (each only
    where installed)."""
    runners = (seam.scheduler_model_runner(scheduler), seam.scheduler_draft_model_runner(scheduler))
    managers = (seam.runner_canary(runner) for runner in runners)
    return [m for m in managers if m is not None]


def _after_run_batch(result, self, *args, **kwargs):
    for manager in _scheduler_canaries(self):
        manager.tag_batch_result(result)
    return result


def _before_process_batch_result(self, *args, **kwargs):
    """``Scheduler.process_batch_result(batch, result)``: heal mode's work before it."""
    result = args[1] if len(args) > 1 else kwargs.get("result")
    for manager in _scheduler_canaries(self):
        manager.before_batch_result(result)


def _after_process_batch_result(result, self, *args, **kwargs):
    for manager in _scheduler_canaries(self):
        manager.after_batch_result()


def _after_session_held_tokens(result, self, *args, **kwargs):
    """Heal mode: sglang's pool-leak checks count the retired slots (out of the allocator for
    the server's life) as held, as they count a streaming session's."""
    retired = sum(m.retired_slots for m in _scheduler_canaries(self))
    return result + retired if retired else result


def _before_on_idle(self, *args, **kwargs):
    """The scheduler is idle: each of its canaries (the target's, an EAGLE draft's) reports
    the last forward's read-back now (``CanaryManager.on_scheduler_idle``)."""
    for manager in _scheduler_canaries(self):
        manager.on_scheduler_idle()


def _stash_chunked_request(original, self, req, *args, **kwargs):
    """abort mode: a request aborted mid chunked prefill keeps having its chunks stashed
    (its no-insert mark lifted around sglang's stash), so its prefill advances to the last
    chunk, where sglang finishes it with the abort. Nothing changes for an unmarked request
    or with the canary off."""
    with seam.chunk_stash_inserting(req):
        return original(self, req, *args, **kwargs)


def _cache_finished_req(original, self, req, *args, **kwargs):
    """abort mode: the release of a request an incident touched frees only the KV it owns
    (the release guard, attached to the tree cache). Nothing changes for any other request or
    with the canary off."""
    guard = seam.release_guard_of(self) if seam.req_contained(req) else None
    if guard is None:
        return original(self, req, *args, **kwargs)
    with guard.releasing(req, self):
        return original(self, req, *args, **kwargs)


def _after_get_init_info(result, self, *args, **kwargs):
    from sglang.srt.kv_canary.install import canary_memory_info
    from sglang.srt.kv_canary.server_args_ext import canary_settings

    if isinstance(result, dict):
        settings = canary_settings(seam.scheduler_server_args(self))
        runner = seam.scheduler_model_runner(self)
        target = seam.runner_canary(runner)
        draft = seam.runner_canary(seam.scheduler_draft_model_runner(self))
        if target is not None or draft is not None:
            settings["memory"] = canary_memory_info(
                seam.runner_memory_reservation(runner), target=target, draft=draft
            )
        result["kv_canary"] = settings
    return result


def _after_get_internal_state(result, self, *args, **kwargs):
    from sglang.srt.kv_canary.install import canary_violation_info

    state = seam.internal_state_of(result)
    target = seam.runner_canary(seam.scheduler_model_runner(self))
    draft = seam.runner_canary(seam.scheduler_draft_model_runner(self))
    if state is not None and (target is not None or draft is not None):
        state["kv_canary"] = canary_violation_info(target=target, draft=draft)
    return result


def _after_forward_batch_init(result, cls, batch, model_runner, *args, **kwargs):
    manager = seam.runner_canary(model_runner)
    if manager is not None:
        manager.on_forward_batch_init(result, seam.schedule_batch_reqs(batch))
    return result


def _draft_forward(original, self, *args, **kwargs):
    manager = seam.runner_canary(seam.draft_worker_runner(self))
    if manager is None:
        return original(self, *args, **kwargs)
    with manager.with_draft_round(seam.draft_worker_steps(self) - 1):
        return original(self, *args, **kwargs)


def _after_move_kv_cache(result, self, tgt_loc, src_loc, *args, **kwargs):
    """sglang moved KV ``tgt_loc <- src_loc`` in pool ``self`` (its compaction of accepted
    tree nodes at page size > 1, eager, on the current stream): the records of the groups
    bound to that pool follow (docs/speculative_standalone_ngram.md, "2.6 Page size > 1")."""
    for group in seam.kv_move_groups(self):
        group.mirror_kv_move(tgt_loc, src_loc)
    return result


def _after_init_cuda_graphs(result, self, *args, **kwargs):
    manager = seam.runner_canary(seam.draft_worker_runner(self))
    if manager is not None:
        manager.mark_init_finished()


def _draft_graph_capture_one_batch_size(original, self, *args, **kwargs):
    manager = seam.runner_canary(seam.graph_runner_model_runner(self))
    if manager is None:
        return original(self, *args, **kwargs)
    with manager.capturing_draft_graph():
        return original(self, *args, **kwargs)


def _draft_graph_replay(original, self, forward_batch, *args, **kwargs):
    manager = seam.runner_canary(seam.graph_runner_model_runner(self))
    if manager is None:
        return original(self, forward_batch, *args, **kwargs)
    with manager.with_replayed_draft_round(forward_batch, seam.draft_graph_runner_steps(self) - 1):
        return original(self, forward_batch, *args, **kwargs)


def _draft_extend_graph_replay(original, self, forward_batch, *args, **kwargs):
    """A draft extend replayed from its graph: padding rows at row 0 (sglang leaves stale
    indices there), then the outside-graph bracket of single-forward manager 0."""
    manager = seam.runner_canary(seam.graph_runner_model_runner(self))
    if manager is None:
        return original(self, forward_batch, *args, **kwargs)
    seam.zero_draft_extend_graph_padding(self)
    with manager.with_active_single_forward_manager(0):
        with manager.with_ops_outside_graph(forward_batch):
            manager.before_graph_replay()
            out = original(self, forward_batch, *args, **kwargs)
            manager.mark_replayed_inside_graph()
            return out


# the (positions, slots) DFLASH's write path was given during the append in progress
_DFLASH_WRITES: contextvars.ContextVar = contextvars.ContextVar("kv_canary_dflash_writes")


def _dflash_append(original, self, batch, draft_input, *args, **kwargs):
    """DFLASH's draft KV append (``_append_target_hidden_to_draft_kv``, after every target
    prefill and verify, outside any forward): its rows and tokens are read before sglang's
    call (which zeroes ``ctx_lens``), the positions and slots its write path really wrote are
    taken from that path (:func:`_dflash_write`), and after the call the draft canary
    records them (a write-only launch on the current stream;
    docs/speculative_multilayer_adaptive_dflash_mtp.md, "3.4 Changes to the canary")."""
    manager = seam.runner_canary(seam.dflash_draft_runner(self))
    if manager is None:
        return original(self, batch, draft_input, *args, **kwargs)
    append = seam.dflash_append_inputs(batch, draft_input)
    writes: list = []
    token = _DFLASH_WRITES.set(writes)
    try:
        out = original(self, batch, draft_input, *args, **kwargs)
    finally:
        _DFLASH_WRITES.reset(token)
    if append is not None and writes:
        positions, slots = writes[-1]  # one path writes (the fused one, or its fallback)
        if slots.shape[0] != append.total:
            raise RuntimeError(
                f"kv_canary: DFLASH's draft KV append wrote {slots.shape[0]} slots for "
                f"{append.total} newly committed positions (target_hidden rows); the draft "
                "canary records one slot per committed position"
            )
        manager.write_outside_forward(seam.dflash_append_batch(append, positions, slots))
    return out


def _dflash_write(original, self, ctx_hidden, ctx_positions, ctx_cache_loc, *args, **kwargs):
    """DFLASH's sequential or fused KV write of an append: once it returned, the positions
    and slots it wrote are what the append's records follow."""
    out = original(self, ctx_hidden, ctx_positions, ctx_cache_loc, *args, **kwargs)
    writes = _DFLASH_WRITES.get(None)
    if writes is not None:
        writes.append((ctx_positions, ctx_cache_loc))
    return out


def _dflash_prepare(original, self, batch, *args, **kwargs):
    """DFLASH's draft block (``_prepare_for_speculative_decoding``): the ``ForwardBatch`` it
    builds by hand for the draft runner gets the batch's requests as its canary state."""
    manager = seam.runner_canary(seam.dflash_draft_runner(self))
    if manager is None:
        return original(self, batch, *args, **kwargs)
    with manager.with_hand_built_batch_requests(seam.schedule_batch_reqs(batch) or ()):
        return original(self, batch, *args, **kwargs)


def _dflash_init(original, self, *args, **kwargs):
    """``DFlashWorker.__init__``: the draft runner it builds gets a canary that maps positions
    through the target's ``req_to_token`` (:func:`_after_init_memory_pool`; with
    ``--speculative-draft-window-size`` the draft's own table is a compact view of the last
    ``W'`` columns: docs/speculative_multilayer_adaptive_dflash_mtp.md, "3.4 Changes to the
    canary"); then the draft runner's ``mark_init_finished``: its graphs were captured in its
    ``ModelRunner.__init__``, which skips draft runners (``_after_model_runner_init``)."""
    table = seam.dflash_init_target_req_to_token(original, self, args, kwargs)
    token = _DFLASH_DRAFT_REQ_TO_TOKEN.set(table)
    try:
        out = original(self, *args, **kwargs)
    finally:
        _DFLASH_DRAFT_REQ_TO_TOKEN.reset(token)
    manager = seam.runner_canary(seam.dflash_draft_runner(self))
    if manager is not None:
        manager.mark_init_finished()
    return out


def _verify(original, self, batch, *args, **kwargs):
    from sglang.srt.kv_canary.token_oracle.spec_verify import verify_with_oracle

    return verify_with_oracle(original, self, batch, *args, **kwargs)


def _dflash_verify(original, self, *args, batch, **kwargs):
    """``DFlashVerifyInput.verify`` (its arguments keyword-only): the token oracle's
    predictions, as for the other verifies (:func:`_verify`)."""
    from sglang.srt.kv_canary.token_oracle.spec_verify import verify_with_oracle

    def call(spec_info, verify_batch, *rest, **kw):
        return original(spec_info, *rest, batch=verify_batch, **kw)

    return verify_with_oracle(call, self, batch, *args, **kwargs)


def _greedy_walk(original, *args, **kwargs):
    from sglang.srt.kv_canary.token_oracle.spec_verify import greedy_walk_with_oracle

    return greedy_walk_with_oracle(original, *args, **kwargs)


HOOKS = (
    (seam.HOOK_SERVER_ARGS_INIT, _server_args_init, "AROUND"),
    (seam.HOOK_SERVER_ARGS_ADD_CLI_ARGS, _add_cli_args, "AFTER"),
    (seam.HOOK_SERVER_ARGS_FROM_CLI_ARGS, _from_cli_args, "AROUND"),
    (seam.HOOK_SERVER_ARGS_REPR, _server_args_repr, "AROUND"),
    (seam.HOOK_MODEL_RUNNER_PROFILE_AVAILABLE_BYTES, _profile_available_bytes, "AROUND"),
    (seam.HOOK_MODEL_RUNNER_INIT_MEMORY_POOL, _after_init_memory_pool, "AFTER"),
    (seam.HOOK_HOST_KV_CACHE_INIT, _host_kv_cache_init, "AROUND"),
    (seam.HOOK_MODEL_RUNNER_INIT, _after_model_runner_init, "AFTER"),
    (seam.HOOK_MODEL_RUNNER_FORWARD, _model_runner_forward, "AROUND"),
    (seam.HOOK_MODEL_RUNNER_INIT_PIECEWISE_CUDA_GRAPHS, _init_piecewise_cuda_graphs, "AROUND"),
    (seam.HOOK_GRAPH_CAPTURE_ONE_BATCH_SIZE, _capture_one_batch_size, "AROUND"),
    (seam.HOOK_GRAPH_REPLAY_PREPARE, _graph_replay_prepare, "AROUND"),
    (seam.HOOK_GRAPH_REPLAY, _graph_replay, "AROUND"),
    (seam.HOOK_SCHEDULER_INIT_CACHE, _after_init_cache, "AFTER"),
    (seam.HOOK_SCHEDULER_REGISTER_HICACHE_DRAFT, _register_hicache_draft, "AROUND"),
    (seam.HOOK_SCHEDULER_RUN_BATCH, _after_run_batch, "AFTER"),
    (seam.HOOK_SCHEDULER_PROCESS_BATCH_RESULT, _before_process_batch_result, "BEFORE"),
    (seam.HOOK_SCHEDULER_PROCESS_BATCH_RESULT, _after_process_batch_result, "AFTER"),
    (seam.HOOK_SCHEDULER_PROCESS_INPUT_REQUESTS, _before_process_input_requests, "BEFORE"),
    (seam.HOOK_SCHEDULER_GET_INIT_INFO, _after_get_init_info, "AFTER"),
    (seam.HOOK_SCHEDULER_GET_INTERNAL_STATE, _after_get_internal_state, "AFTER"),
    (seam.HOOK_SCHEDULER_ON_IDLE, _before_on_idle, "BEFORE"),
    (seam.HOOK_SCHEDULER_STASH_CHUNKED_REQUEST, _stash_chunked_request, "AROUND"),
    (seam.HOOK_SCHEDULER_SESSION_HELD_TOKENS, _after_session_held_tokens, "AFTER"),
    (seam.HOOK_RADIX_CACHE_FINISHED_REQ, _cache_finished_req, "AROUND"),
    (seam.HOOK_CHUNK_CACHE_FINISHED_REQ, _cache_finished_req, "AROUND"),
    (seam.HOOK_FORWARD_BATCH_INIT_NEW, _after_forward_batch_init, "AFTER"),
    (seam.HOOK_EAGLE_V1_DRAFT_FORWARD, _draft_forward, "AROUND"),
    (seam.HOOK_EAGLE_V2_DRAFT_FORWARD, _draft_forward, "AROUND"),
    (seam.HOOK_EAGLE_V1_INIT_CUDA_GRAPHS, _after_init_cuda_graphs, "AFTER"),
    (seam.HOOK_EAGLE_V2_INIT_CUDA_GRAPHS, _after_init_cuda_graphs, "AFTER"),
    (seam.HOOK_MULTI_LAYER_EAGLE_V2_INIT_CUDA_GRAPHS, _after_init_cuda_graphs, "AFTER"),
    (seam.HOOK_DRAFT_GRAPH_CAPTURE_ONE_BATCH_SIZE, _draft_graph_capture_one_batch_size, "AROUND"),
    (seam.HOOK_DRAFT_GRAPH_REPLAY, _draft_graph_replay, "AROUND"),
    # the draft-extend graph is captured like a decode graph: single-forward manager 0
    (seam.HOOK_DRAFT_EXTEND_GRAPH_CAPTURE_ONE_BATCH_SIZE, _capture_one_batch_size, "AROUND"),
    (seam.HOOK_DRAFT_EXTEND_GRAPH_REPLAY, _draft_extend_graph_replay, "AROUND"),
    (seam.HOOK_MHA_POOL_MOVE_KV_CACHE, _after_move_kv_cache, "AFTER"),
    (seam.HOOK_DFLASH_APPEND, _dflash_append, "AROUND"),
    (seam.HOOK_DFLASH_WRITE_SEQUENTIAL, _dflash_write, "AROUND"),
    (seam.HOOK_DFLASH_WRITE_FUSED, _dflash_write, "AROUND"),
    (seam.HOOK_DFLASH_PREPARE, _dflash_prepare, "AROUND"),
    (seam.HOOK_DFLASH_INIT, _dflash_init, "AROUND"),
    (seam.HOOK_EAGLE_V1_VERIFY, _verify, "AROUND"),
    (seam.HOOK_EAGLE_V2_VERIFY_SAMPLE, _verify, "AROUND"),
    (seam.HOOK_NGRAM_VERIFY, _verify, "AROUND"),
    (seam.HOOK_DFLASH_VERIFY, _dflash_verify, "AROUND"),
    (seam.HOOK_DFLASH_GREEDY_WALK, _greedy_walk, "AROUND"),
    (seam.HOOK_EAGLE_V1_GREEDY_WALK, _greedy_walk, "AROUND"),
    (seam.HOOK_EAGLE_V2_GREEDY_WALK, _greedy_walk, "AROUND"),
)
# where sglang binds NGRAM's greedy walk at all (sgl-kernel's op: CUDA, MUSA, HIP)
DEVICE_BOUND_HOOKS = ((seam.HOOK_NGRAM_GREEDY_WALK, _greedy_walk, "AROUND"),)


def register() -> None:
    """Register the KV-canary hooks with sglang's ``HookRegistry``."""
    for target, hook, kind in HOOKS:
        seam.register_hook(target, hook, kind)
    if seam.ngram_greedy_walk_bound():
        for target, hook, kind in DEVICE_BOUND_HOOKS:
            seam.register_hook(target, hook, kind)
    from sglang.srt.kv_canary.token_oracle.sampler import register_token_oracle_backend

    register_token_oracle_backend()
