"""The runtime hooks of ``plugin.py`` on real sglang objects, without a server: each test takes
the hook that :func:`plugin.register` hands to sglang for a target, wraps a stand-in original
with sglang's own ``HookRegistry`` wrapper (``_wrap_fn``, the call convention sglang applies),
and checks what the hook must do to the canary of a real ``ModelRunner`` instance: the chain-
position check turned on after start-up, the radix cache handed to the sweep, the read-back
consumed at the scheduler's idle step, the token-id snapshot attached to every
``ForwardBatch`` (helpers: ``plugin_hooks_support.py``).

``ModelRunner``, ``ForwardBatch``, ``ModelWorkerBatch``, ``Req`` and ``RadixCache`` are sglang's
classes (``ModelRunner`` / ``ModelWorkerBatch`` instances made without running their
``__init__``). ``Scheduler`` and ``TpModelWorker`` are stand-ins with the attributes the seam
reads (``tp_worker.model_runner``, ``tree_cache``, ``draft_worker``): importing them loads
``sgl_kernel``'s ``common_ops``, which needs ``libcuda.so.1`` (the end-to-end server tests
cover them)."""

from __future__ import annotations

import sys

import pytest
import torch

from plugin_hooks_support import (
    SchedulerStandIn,
    TpWorkerStandIn,
    as_sglang_applies,
    model_runner_with,
    registered_hook,
)
from serving_driver import ServingDriver
from sglang.srt.kv_canary import plugin
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.batch_state import batch_state
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, ModelWorkerBatch, Req
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


# ---- ModelRunner.__init__ (AFTER): the chain-position check on once start-up is done --------


def test_model_runner_init_hook_turns_the_chain_position_check_on(monkeypatch):
    d = ServingDriver(seed=3, mode="raise", init_finished=False)
    flag = d.manager.state.enable_chain_position_assert
    init = as_sglang_applies(
        monkeypatch, seam.HOOK_MODEL_RUNNER_INIT, lambda self, *args, **kwargs: None
    )
    init(model_runner_with(None))  # canary off: passes straight through
    assert int(flag[0]) == 0  # warm-up and graph capture: off
    init(model_runner_with(d.manager))
    assert int(flag[0]) == 1, "ModelRunner.__init__ hook did not turn the check on"
    # and a write at the wrong position is now reported as such
    fb, info = d.shifted_chunk_batch()
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d._forward(fb)
    lines = parse_violation_lines(str(exc.value))
    assert [(v.fail_reasons, v.slot_idx, v.position) for v in lines] == [
        (("write_position",), info["slot"], info["position"])
    ], lines


# ---- Scheduler.init_cache_with_memory_pool (AFTER): the sweep gets the radix cache ----------


def _radix_cache_of(d: ServingDriver) -> RadixCache:
    """A real RadixCache over the driver's pools holding its running requests' prefixes."""
    r2t = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    cache = RadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=r2t,
            token_to_kv_pool_allocator=d.allocator,
            page_size=1,
        )
    )
    for r in d.running:
        cache.insert(
            InsertParams(
                key=RadixKey(r.tokens[: r.kv_len]), value=torch.tensor(r.slots[: r.kv_len])
            )
        )
    return cache


def test_scheduler_hook_hands_the_radix_cache_to_the_sweep(monkeypatch):
    d = ServingDriver(seed=21, real_data="partial", mode="raise", sweep_interval=2)
    d.run(40)
    d.settle()
    cache = _radix_cache_of(d)
    cached = {int(s) for r in d.running for s in r.slots[: r.kv_len]}
    init_cache = as_sglang_applies(
        monkeypatch, seam.HOOK_SCHEDULER_INIT_CACHE, lambda self, *args, **kwargs: None
    )
    init_cache(SchedulerStandIn(model_runner_with(None), cache))  # canary off: nothing to do
    assert d.manager.radix_cache is None and d.manager.sweep_passes == 0
    init_cache(SchedulerStandIn(model_runner_with(d.manager), cache))
    assert d.manager.radix_cache is cache, "the Scheduler hook did not attach the radix cache"
    for _ in range(3):
        d.step()
    assert d.manager.sweep_passes >= 1  # clean sweeps report nothing
    # the sweep reads that cache: a slot only the cache holds, corrupted, is caught
    victim = d.running.pop(0)
    slot = next(s for s in victim.slots[1:] if s in cached and d.slot_refs[s] == 1)
    d.kv_pool.k_buffer[0][slot].view(torch.uint8).view(-1)[0] ^= 0x3C
    d.add_request(prompt_len=5, max_new=8)  # forwards keep running (the sweep follows them)
    report = d.report_within(3)
    found = [(v.launch_tag, v.fail_reasons, v.slot_idx) for v in parse_violation_lines(report)]
    assert ("SWEEP_K_FULL", ("verify_real_kv_hash",), slot) in found, found


@pytest.mark.parametrize("disaggregation_mode", ["null", "prefill", "decode"])
def test_scheduler_hook_hands_sglangs_faked_transfer_test_on_a_pd_decode_server(
    monkeypatch, disaggregation_mode
):
    """sglang fakes the transfer of requests with bootstrap host 2.2.2.2 (warm-up,
    /health_generate); on a PD decode server the canary gets sglang's own test for them,
    elsewhere none."""
    d = ServingDriver(seed=22, mode="raise")
    init_cache = as_sglang_applies(
        monkeypatch, seam.HOOK_SCHEDULER_INIT_CACHE, lambda self, *args, **kwargs: None
    )
    init_cache(SchedulerStandIn(model_runner_with(d.manager), None, disaggregation_mode))

    def req(host):
        return Req(
            rid=f"r-{host}",
            origin_input_text="",
            origin_input_ids=[1, 2, 3],
            sampling_params=SamplingParams(max_new_tokens=4),
            bootstrap_host=host,
        )

    faked = d.manager.requests.faked_transfer
    decode = disaggregation_mode == "decode"
    assert faked(req(seam.fake_bootstrap_host())) is decode
    assert faked(req("10.1.2.3")) is False
    assert faked(req(None)) is False  # a real backend (mooncake): no host is no fake


# ---- Scheduler.stash_chunked_request (AROUND): abort mode's mark lifted for the stash ---------


def test_stash_hook_lets_a_request_aborted_mid_chunked_prefill_advance(monkeypatch):
    """sglang's chunk stash (``maybe_cache_unfinished_req(req, tree_cache, chunked=True)``, on
    a real ``RadixCache`` and ``Req``) skips a request whose ``skip_radix_cache_insert`` is set,
    so its prefix never reaches the chunk it prefilled. Around the stash the hook lifts the
    mark abort mode set (the chunk is cached, ``prefix_indices`` advances) and puts it back; a
    flag sglang set itself, and an unmarked request, are left to sglang."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

    d = ServingDriver(seed=3)
    r2t = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(
        d.kv_pool.size, torch.bfloat16, "cpu", d.kv_pool, need_sort=False
    )
    cache = RadixCache(
        CacheInitParams(
            disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1
        )
    )

    def stash(self, req):  # sglang 0.5.12's Scheduler.stash_chunked_request
        maybe_cache_unfinished_req(req, self.tree_cache, chunked=True)

    hooked = as_sglang_applies(monkeypatch, seam.HOOK_SCHEDULER_STASH_CHUNKED_REQUEST, stash)
    scheduler = SchedulerStandIn(model_runner_with(None), cache)

    def chunked_req(row: int, first: int) -> Req:
        """A request of 48 tokens whose first chunk (16) was prefilled into row ``row``."""
        ids = list(range(first, first + 48))
        req = Req(
            rid=f"r{row}",
            origin_input_text="",
            origin_input_ids=ids,
            sampling_params=SamplingParams(max_new_tokens=4),
        )
        req.req_pool_idx, req.fill_ids = row, ids[:16]
        req.prefix_indices, req.last_node = torch.empty(0, dtype=torch.int64), cache.root_node
        r2t.write((row, slice(0, 16)), alloc.alloc(16))
        return req

    plain = chunked_req(0, 100)  # sglang alone: the marked request's stash is skipped
    seam.mark_no_radix_insert(plain)
    stash(scheduler, plain)
    assert len(plain.prefix_indices) == 0 and cache.total_size() == 0
    aborted = chunked_req(1, 200)  # the hook: cached, prefix advanced, mark back
    seam.mark_no_radix_insert(aborted)
    hooked(scheduler, aborted)
    assert len(aborted.prefix_indices) == 16 and cache.total_size() == 16, (
        "the stash hook did not let the aborted request's chunk be cached"
    )
    assert aborted.skip_radix_cache_insert  # it is still not inserted when it finishes
    own = chunked_req(2, 300)  # a flag sglang set itself stays sglang's
    own.skip_radix_cache_insert = True
    seam.mark_no_radix_insert(own)
    hooked(scheduler, own)
    assert len(own.prefix_indices) == 0 and cache.total_size() == 16
    unmarked = chunked_req(3, 400)  # canary off or request untouched: sglang's stash
    hooked(scheduler, unmarked)
    assert len(unmarked.prefix_indices) == 16 and not unmarked.skip_radix_cache_insert


# ---- Scheduler.on_idle (BEFORE): the last forward's read-back, reported while idle -----------


def test_idle_hook_consumes_the_pending_read_back_of_each_canary(monkeypatch):
    """Before sglang's idle step runs, each canary of the scheduler (the target's, an EAGLE
    draft's) consumes the read-back its last forward staged; a scheduler without a canary
    passes straight through. A read-back stays staged between forwards only on CUDA (here
    one is staged by hand); test_runtime_cuda's idle test shows the report it carries."""
    target, draft = (ServingDriver(seed=s, mode="log") for s in (4, 5))
    ran = []  # sglang's idle step: which scheduler, and which canaries had a read-back staged

    def idle_step(scheduler):
        ran.append((scheduler, [d.manager.device_host.has_pending for d in (target, draft)]))

    on_idle = as_sglang_applies(monkeypatch, seam.HOOK_SCHEDULER_ON_IDLE, idle_step)
    plain = SchedulerStandIn(model_runner_with(None), None)
    on_idle(plain)
    for d in (target, draft):
        d.run(5)
        assert not d.manager.device_host.has_pending  # the CPU consumes at each forward
        d.manager.device_host.stage()
    scheduler = SchedulerStandIn(
        model_runner_with(target.manager),
        None,
        draft_worker=TpWorkerStandIn(model_runner_with(draft.manager)),
    )
    on_idle(scheduler)
    # sglang's own idle step still runs, after both read-backs were consumed
    assert ran == [(plain, [False, False]), (scheduler, [False, False])]


# ---- ForwardBatch.init_new (AFTER): the batch's token-id snapshot ----------------------------


def _init_new_hook(monkeypatch, model_runner):
    """What sglang's wrapped ``ForwardBatch.init_new(model_worker_batch, model_runner)`` does
    after building a batch ``fb`` from ``reqs``: the plugin's hook on it."""
    hook, kind = registered_hook(monkeypatch, seam.HOOK_FORWARD_BATCH_INIT_NEW)

    def run(fb, reqs, **fields):
        worker_batch = ModelWorkerBatch.__new__(ModelWorkerBatch)
        worker_batch.reqs = reqs
        for name, value in fields.items():  # e.g. forward_mode, req_pool_indices
            setattr(worker_batch, name, value)
        init_new = _wrap_fn(lambda cls, batch, runner: fb, hook, HookType[kind])
        assert init_new(ForwardBatch, worker_batch, model_runner) is fb

    return run


def _snapshot(manager, fb):
    """The token-id snapshot the forward's upload takes of the requests the hook recorded."""
    state = batch_state(fb)
    manager.token_history.snapshot(state, state.token_reqs)
    return state.token_snapshot


def test_forward_batch_hook_snapshots_real_requests(monkeypatch):
    d = ServingDriver(seed=8, verify_tokens=True)
    hook = _init_new_hook(monkeypatch, model_runner_with(d.manager))
    reqs = []
    for row, (prompt, out) in zip((2, 5), (([11, 12, 13], [14]), ([21, 22], []))):
        req = Req(
            rid=f"r{row}",
            origin_input_text="",
            origin_input_ids=list(prompt),
            sampling_params=SamplingParams(max_new_tokens=4),
        )
        req.req_pool_idx = row
        req.output_ids.extend(out)
        reqs.append(req)
    fb = ForwardBatch.__new__(ForwardBatch)
    hook(fb, reqs)
    state = batch_state(fb)
    assert state is not None and state.token_reqs == tuple(reqs), (
        "the ForwardBatch.init_new hook attached no requests to snapshot"
    )
    snap = _snapshot(d.manager, fb)
    assert snap.lens.tolist() == [4, 2]
    assert snap.flat.tolist() == [11, 12, 13, 14, 21, 22]
    # no manager (canary off): nothing attached
    bare = ForwardBatch.__new__(ForwardBatch)
    _init_new_hook(monkeypatch, model_runner_with(None))(bare, reqs)
    assert batch_state(bare) is None


def test_spec_v1_draft_extend_snapshots_only_the_unfinished_requests(monkeypatch):
    """Spec v1's draft extend after a verify runs the requests the verify left unfinished
    (``req_pool_indices`` narrowed) while ``ModelWorkerBatch.reqs`` still lists the whole
    round (found on the GPU: a request finishing before the others of its round stopped the
    server with a snapshot of one request too many). The snapshot covers the rows run."""
    d = ServingDriver(seed=8, verify_tokens=True)
    hook = _init_new_hook(monkeypatch, model_runner_with(d.manager))
    reqs = []
    for row, prompt in ((2, [11, 12, 13]), (4, [31, 32]), (5, [21, 22])):
        req = Req(
            rid=f"r{row}",
            origin_input_text="",
            origin_input_ids=list(prompt),
            sampling_params=SamplingParams(max_new_tokens=4),
        )
        req.req_pool_idx = row
        req.output_ids.append(prompt[-1] + 1)
        reqs.append(req)
    reqs[1].finished_reason = FINISH_LENGTH(length=4)
    fb = ForwardBatch.__new__(ForwardBatch)
    hook(
        fb,
        reqs,
        forward_mode=ForwardMode.DRAFT_EXTEND,
        req_pool_indices=torch.tensor([2, 5], dtype=torch.int64),
    )
    snap = _snapshot(d.manager, fb)
    assert snap.lens.tolist() == [4, 3]
    assert snap.flat.tolist() == [11, 12, 13, 14, 21, 22, 23]
    assert [r.rid for r in batch_state(fb).requests.reqs] == ["r2", "r5"]
    # any other batch keeps its requests as they are (a mismatch there is sglang's, reported
    # by the upload)
    other = ForwardBatch.__new__(ForwardBatch)
    hook(
        other,
        reqs,
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=torch.tensor([2, 5], dtype=torch.int64),
    )
    assert _snapshot(d.manager, other).lens.tolist() == [4, 3, 3]


def test_forward_batch_hook_feeds_the_token_checks_of_a_serving_loop(monkeypatch):
    """Every batch of the loop gets its snapshot through the plugin's hook only: a
    same-position slot swap is then caught by the token check (verify_token)."""
    runner = model_runner_with(None)
    d = ServingDriver(
        seed=12,
        verify_tokens=True,
        mode="raise",
        batch_init_hook=_init_new_hook(monkeypatch, runner),
    )
    seam.set_runner_canary(runner, d.manager)
    d.run(60)
    d.settle()
    info = d.fault_swap_same_position()
    assert info["shared_prefix"]
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.step()
    mine = [v for v in parse_violation_lines(str(exc.value)) if v.slot_idx == info["new_slot"]]
    assert mine and all(v.fail_reasons == ("verify_token",) for v in mine), str(exc.value)
    assert mine[0].expected_token == info["victim_token"]


def test_graph_replay_hook_uploads_the_tokens_before_the_replay():
    """``CudaGraphRunner.replay`` (AROUND): the graph's scatter reads the uploader's replay
    buffer, so the hook stages the batch's token history there before calling sglang's
    replay, then marks the inside ops as replayed (sglang's ``CudaGraphRunner`` instance, its
    ``model_runner`` carrying the canary)."""
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

    d = ServingDriver(seed=8, verify_tokens=True)
    d.add_request(prompt_len=7, max_new=2)
    d._admit()
    req = d.running[0]
    fb = d._extend_batch([req])
    graph_runner = CudaGraphRunner.__new__(CudaGraphRunner)
    graph_runner.model_runner = model_runner_with(d.manager)
    pool = d.manager.state.req_to_verify_expected_tokens
    seen = []

    def replay(self, *args, **kwargs):  # the graph's captured scatter, then its plan reads
        lens = torch.zeros(1, dtype=torch.int64)
        d.manager.token_history.launch_replay_scatter(
            torch.tensor([req.row], dtype=torch.int64), lens
        )
        seen.append(pool[req.row, :7].tolist())
        return "logits"

    mgr = d.manager
    with mgr.with_active_single_forward_manager(0), mgr.with_ops_outside_graph(fb):
        assert plugin._graph_replay(replay, graph_runner) == "logits"
        assert mgr.active_sfm.phase.value == "post_ops_maybe_inside_graph"
    assert seen == [req.prompt]


def test_move_kv_cache_hook_moves_the_bound_groups_records_with_the_kv(monkeypatch):
    """The hook registered on ``MHATokenToKVPool.move_kv_cache`` (as sglang's HookRegistry
    wraps the method): after the KV moves, the records of the groups the builder bound to that
    pool move the same way; a pool without a canary is left to sglang alone."""
    from ngram_driver import NgramDriver
    from eagle_driver import tiny_mha_pool
    from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

    def original(self, tgt_loc, src_loc):
        move_kv_cache_native(self.k_buffer, self.v_buffer, tgt_loc, src_loc)

    hooked = as_sglang_applies(monkeypatch, seam.HOOK_MHA_POOL_MOVE_KV_CACHE, original)
    d = NgramDriver(num_draft=6, breadth=3, seed=1)
    pool, group = d.target_pool, d.target.groups[0]
    for i, buf in enumerate((group.k_head, group.k_tail, pool.k_buffer[0])):
        buf.view(-1).view(torch.uint8)[:] = (
            torch.arange(buf.view(torch.uint8).numel()).to(torch.uint8) + i
        )
    before = [b.clone() for b in (group.k_head, group.k_tail, pool.k_buffer[0])]
    tgt, src = torch.tensor([3, 4]), torch.tensor([4, 8])
    hooked(pool, tgt, src)
    for buf, old in zip((group.k_head, group.k_tail, pool.k_buffer[0]), before):
        assert torch.equal(buf[tgt], old[src])
    bare = tiny_mha_pool(31)
    assert seam.kv_move_groups(bare) == ()
    hooked(bare, tgt, src)  # no canary: sglang's move only


# run in a fresh process with the libcuda stub (importing sglang's speculative workers loads
# sgl_kernel's common_ops): each STANDALONE worker class's method the plugin hooks on its EAGLE
# base class, before and after sglang's HookRegistry applies the plugin's hooks
_INHERITED_HOOKS_SCRIPT = """
import json
from sglang.srt.kv_canary import plugin
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.speculative import eagle_worker, eagle_worker_v2
from sglang.srt.speculative import standalone_worker, standalone_worker_v2

pairs = [
    (standalone_worker.StandaloneWorker, eagle_worker.EAGLEWorker),
    (standalone_worker_v2.StandaloneDraftWorker, eagle_worker_v2.EagleDraftWorker),
]
methods = ("draft_forward", "init_cuda_graphs")
before = {(b.__name__, m): getattr(b, m) for _, b in pairs for m in methods}
plugin.register()
HookRegistry.apply_hooks()
print("RESULT " + json.dumps([
    dict(
        sub=sub.__name__,
        base=base.__name__,
        method=m,
        hooked=getattr(base, m) is not before[(base.__name__, m)],
        inherited=getattr(sub, m) is getattr(base, m),
        overridden=m in vars(sub),
    )
    for sub, base in pairs
    for m in methods
] + [dict(
    v2_worker_is_eagle_v2=issubclass(
        standalone_worker_v2.StandaloneWorkerV2, eagle_worker_v2.EAGLEWorkerV2
    ),
)]))
"""


def test_standalone_workers_inherit_the_hooked_eagle_methods(tmp_path):
    """STANDALONE runs EAGLE's forwards: the plugin hooks ``draft_forward`` and
    ``init_cuda_graphs`` on ``EAGLEWorker`` (spec v1) and ``EagleDraftWorker`` (spec v2), and
    ``StandaloneWorker`` / ``StandaloneDraftWorker`` must reach those hooked methods (inherit,
    not override them): an override would run the draft forwards as unbracketed single
    forwards. A failure here means sglang's STANDALONE workers changed: hook their own
    methods in the seam."""
    import json
    import subprocess

    from sglang.srt.kv_canary.demo.server_harness import build_libcuda_stub, cpu_server_env

    env = cpu_server_env(build_libcuda_stub(tmp_path / "stub"))
    proc = subprocess.run(
        [sys.executable, "-c", _INHERITED_HOOKS_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")] or [None]
    assert proc.returncode == 0 and line, out[-3000:]
    *rows, v2 = json.loads(line[len("RESULT ") :])
    assert v2 == {"v2_worker_is_eagle_v2": True}
    assert len(rows) == 4
    for row in rows:
        assert row["hooked"] and row["inherited"] and not row["overridden"], row


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
