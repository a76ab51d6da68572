"""The serving-loop driver on CUDA with the two "maybe inside graph" phases captured in a
decode CUDA graph and replayed across steps: no false positives, faults detected within two
steps (results are read one step late, on a side stream), and no device→host sync on the
forward stream (every canary op runs under torch's sync debug mode "error")."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types

import pytest
import torch

from plugin_hooks_support import SchedulerStandIn, as_sglang_applies, model_runner_with
from serving_driver import ServingDriver
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag
from sglang.srt.kv_canary.batch_state import CanaryBatchState
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.kv_canary.snapshot_buffers import SnapshotHostBuffers
from sglang.srt.kv_canary.token_history import TokenHistoryUploader
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=60, stage="base-b", runner_config="1-gpu-small")

pytestmark = pytest.mark.cuda


def _driver(**kw) -> ServingDriver:
    return ServingDriver(device="cuda", graph_bs=8, max_running=6, forbid_host_sync=True, **kw)


def test_graph_replay_clean_run_and_no_host_sync():
    d = _driver(seed=3, real_data="partial", enable_mha_v=True)
    assert not d.manager.device_host.synchronous
    d.run(300)
    torch.cuda.synchronize()
    d.manager.device_host.consume(d.manager._on_host_copies)
    state = d.manager.state
    assert d.manager.count_violations() == 0
    assert d.shared_admitted >= 5 and d.reused_slots >= 50
    # every forward (graph replays included) ran verify + write per tag, plus the eager
    # warm-up forward before the decode graph's capture and the eager-forward graphs'
    # warm-up at mark_init_finished (all padding: counted, nothing written)
    assert int(state.kernel_run_counters[CanaryLaunchTag.TAIL_K_FULL]) == 2 * 300 + 2 + 2
    assert int(state.kernel_run_counters[CanaryLaunchTag.HEAD_V_FULL]) == 2 * 300 + 2 + 2
    assert d.manager.sfms[0].eager_graphs.captured


def test_eager_forward_graphs_leave_the_records_of_the_direct_launches():
    """Prefills (and the decode batches no decode graph holds) replayed from the graphs
    captured at mark_init_finished, against the same loop with the launches issued one by
    one: identical records, token pool and verified-slot counts; no host sync on the graph
    path either."""
    kw = dict(seed=5, real_data="partial", enable_mha_v=True, verify_tokens=True)
    graphs = _driver(**kw)
    direct = ServingDriver(device="cuda", graph_bs=8, max_running=6, init_finished=False, **kw)
    direct.manager.state.mark_init_finished()  # the chain check on, no eager graphs
    assert graphs.manager.sfms[0].eager_graphs.captured
    assert direct.manager.sfms[0].eager_graphs is None
    for d in (graphs, direct):
        d.run(200)
        d.settle()
    torch.cuda.synchronize()
    assert graphs.step_count == direct.step_count
    assert graphs.manager.count_violations() == direct.manager.count_violations() == 0
    a, b = graphs.canary_bytes(kernel_counters=False), direct.canary_bytes(kernel_counters=False)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert int(a["slot_run_counters"].sum()) > 0


FAULTS = {
    "req_to_token_swap": ("fault_swap_req_to_token", {"verify_chain_hash", "verify_position"}, 2),
    "kv_byte_flip": ("fault_flip_kv_byte", {"verify_real_kv_hash"}, 2),
    "record_field_flip": ("fault_flip_record_field", {"verify_position"}, 2),
    "slot_reused_while_referenced": ("fault_reuse_referenced_slot", {"verify_position"}, 3),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_graph_replay_detects_fault(fault):
    injector, reasons, max_steps = FAULTS[fault]
    d = _driver(seed=11, mode="raise", real_data="partial")
    d.run(60)
    d.settle()
    info = getattr(d, injector)()
    with pytest.raises(RuntimeError, match="kv_canary detected KV-cache corruption") as exc:
        for _ in range(max_steps):
            d.step()
    found = parse_violation_lines(str(exc.value))
    assert {r for v in found for r in v.fail_reasons} & reasons
    assert info.get("slot", info.get("new_slot")) in {v.slot_idx for v in found}


def test_the_last_forward_before_the_scheduler_idles_is_reported_at_its_idle_step(
    monkeypatch, caplog
):
    """A fault read by the last forward before a quiet period is reported when sglang's
    scheduler runs its idle step (the plugin's hook before ``Scheduler.on_idle``), not held
    back until a next forward that may never come: on CUDA the forward's read-back is still
    staged after it, and the idle hook consumes it."""
    d = _driver(seed=11, mode="log", real_data="partial")
    d.run(60)
    d.settle()
    info = d.fault_swap_req_to_token()
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        d.step()  # a decode of every running request: it reads the rewritten entry
        assert d.manager.device_host.has_pending and d.manager.violations.total == 0
        on_idle = as_sglang_applies(monkeypatch, seam.HOOK_SCHEDULER_ON_IDLE, lambda self: None)
        on_idle(SchedulerStandIn(model_runner_with(d.manager), None))
    assert not d.manager.device_host.has_pending and d.manager.violations.total > 0
    found = [v for r in caplog.records for v in parse_violation_lines(r.getMessage())]
    assert (info["row"], info["position"], info["new_slot"]) in {
        (v.req_to_token_row, v.read_position, v.slot_idx) for v in found
    }, found


def test_graph_replay_with_token_checks():
    """Token scatter outside the graph, gather + check inside it on static buffers."""
    d = _driver(seed=12, verify_tokens=True, mode="raise")
    d.run(150)
    torch.cuda.synchronize()
    assert d.manager.count_violations() == 0
    d.settle()
    info = d.fault_swap_same_position()
    assert info["shared_prefix"]
    with pytest.raises(RuntimeError, match="kv_canary detected KV-cache corruption") as exc:
        for _ in range(2):  # found in the graph at step T, reported at T+1
            d.step()
    mine = [v for v in parse_violation_lines(str(exc.value)) if v.slot_idx == info["new_slot"]]
    assert mine and all(v.fail_reasons == ("verify_token",) for v in mine)


@dataclasses.dataclass(frozen=True)
class _Watched:
    x: torch.Tensor


@pytest.mark.parametrize("fenced", [True, False])
def test_fence_orders_the_next_forward_after_the_read_back(fenced):
    """A read-back held up on its side stream: with ``fence()`` the next forward's write to a
    watched tensor waits for it (the host sees the staged value); without, it races ahead."""
    from sglang.srt.kv_canary.manager import DelayedDeviceHostHandler

    src = torch.zeros(1 << 20, dtype=torch.int64, device="cuda")
    h = DelayedDeviceHostHandler(_Watched(x=src))
    with torch.cuda.stream(h._stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the copy can start
    h.stage()
    if fenced:
        h.fence()
    src.add_(7)  # the "next forward" on the current stream
    torch.cuda.synchronize()
    got = {}
    h.consume(lambda host: got.update(x=int(host.x[-1])))
    assert got["x"] == (0 if fenced else 7)


@pytest.mark.parametrize("pending_before_capture", [False, True])
def test_captured_read_back_copies_match_the_eager_ones(pending_before_capture):
    """After ``capture()`` a stage replays one graph per host buffer: the consumer gets every
    watched tensor's value at the stage (the two host buffers alternate), the window named by
    ``zero_after_copy`` is emptied after its copy, and capturing runs nothing (a stage pending
    before it is consumed unchanged; the watched tensors keep their values)."""
    from sglang.srt.kv_canary.manager import DelayedDeviceHostHandler

    index = torch.tensor([5], dtype=torch.int32, device="cuda")
    ring = torch.arange(12, dtype=torch.int64, device="cuda").reshape(4, 3)
    h = DelayedDeviceHostHandler(_Pair(index=index, ring=ring), zero_after_copy=(index,))
    got = []
    if pending_before_capture:
        h.stage()
        h.fence()  # as before the next forward: its writes queue after the staged copy's reset
        index.fill_(2)  # the next window: 2 entries
    h.capture()
    assert h.captured and int(index[0]) == (2 if pending_before_capture else 5)
    if pending_before_capture:
        torch.cuda.synchronize()
        h.consume(lambda host: got.append((host.index.tolist(), host.ring.tolist())))
        assert got.pop() == ([5], torch.arange(12).reshape(4, 3).tolist())
        index.fill_(5)
    for step in range(4):
        h.fence()
        ring.add_(100)
        index.add_(step)
        want = ([5 * (step == 0) + step], ring.tolist())
        h.stage()
        torch.cuda.synchronize()
        assert int(index[0]) == 0  # emptied after its copy
        h.consume(lambda host: got.append((host.index.tolist(), host.ring.tolist())))
        assert got.pop() == want


@dataclasses.dataclass(frozen=True)
class _Pair:
    index: torch.Tensor
    ring: torch.Tensor


@pytest.mark.parametrize("captured", [False, True])
def test_parallel_lanes_fork_from_and_join_the_current_stream(captured):
    """Each sequence after the first runs on a stream of its own, after the work queued on
    the current stream before the run (the fork), and work queued after the run waits for all
    of them (the join); the same replayed from a CUDA graph that captured the run."""
    from sglang.srt.kv_canary.cuda_streams import ParallelLanes

    lanes = ParallelLanes(3, "cuda")
    src = torch.zeros(3, dtype=torch.int64, device="cuda")
    out = torch.zeros(3, dtype=torch.int64, device="cuda")
    res = torch.zeros(3, dtype=torch.int64, device="cuda")
    streams = []

    def lane(i):
        def run():
            streams.append(torch.cuda.current_stream())
            if i:  # held up (the first lane is the current stream): a missing join reads 0
                torch.cuda._sleep(50_000_000)
            out[i : i + 1].copy_(src[i : i + 1])

        return run

    def work():
        torch.cuda._sleep(100_000_000)  # held up longer: a missing fork would copy 0
        src.fill_(7)
        lanes.run([lane(0), lane(1), lane(2)])
        res.copy_(out)

    here = torch.cuda.current_stream()
    if captured:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            here = torch.cuda.current_stream()
            work()
        graph.replay()
    else:
        work()
    torch.cuda.synchronize()
    assert res.tolist() == [7, 7, 7]
    # the first on the caller's stream, each other on its lane's own stream (torch hands
    # streams out of a pool round-robin, so their ids may repeat one made elsewhere)
    assert streams[0] == here
    assert [s.stream_id for s in streams[1:]] == [s.stream_id for s in lanes._streams]
    with pytest.raises(ValueError, match="4 sequences for 3 lanes"):
        lanes.run([lane(0)] * 4)


def test_cuda_streams_match_torch_and_restore_the_stream():
    """The per-forward path's stream helpers agree with torch's own: the device index of a
    device (a bare ``"cuda"``: the current one), the current stream (the
    same object each time for the same stream), a switch that makes the side stream current
    for its body and restores the caller's stream afterwards, also when the body raises, and
    work queued inside the switch runs on the side stream."""
    from sglang.srt.kv_canary import cuda_streams

    idx = torch.cuda.current_device()
    assert cuda_streams.device_index("cuda") == idx
    assert cuda_streams.device_index(f"cuda:{idx}") == idx
    assert cuda_streams.device_index("cpu") is None
    outer = torch.cuda.Stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(outer):
        s = cuda_streams.current_stream(idx)
        assert s == torch.cuda.current_stream() == outer
        assert cuda_streams.current_stream(idx) is s
        with cuda_streams.on_stream(side):
            assert torch.cuda.current_stream() == side
            assert cuda_streams.current_stream(idx) == side
            x = torch.zeros(1 << 20, device="cuda")
            torch.cuda._sleep(20_000_000)
            x.fill_(1)
            done = torch.cuda.Event()
            done.record()
        assert torch.cuda.current_stream() == outer
        with pytest.raises(KeyError):
            with cuda_streams.on_stream(side):
                raise KeyError("body")
        assert torch.cuda.current_stream() == outer
    assert not side.query()  # the sleep was queued on the side stream, not the outer one
    assert outer.query()
    done.synchronize()
    assert int(x.sum()) == 1 << 20


def _allocator_block_state(address: int) -> str:
    """The state torch's CUDA caching allocator gives the block holding ``address``
    (``torch.cuda.memory_snapshot()``: "active_allocated", "active_pending_free": freed and
    waiting for the streams that used it, "inactive": free)."""
    for segment in torch.cuda.memory_snapshot():
        offset = segment["address"]
        for block in segment["blocks"]:
            if offset <= address < offset + block["size"]:
                return block["state"]
            offset += block["size"]
    raise AssertionError(f"no block of the caching allocator holds address {address:#x}")


def test_the_sweeps_walk_holds_an_evicted_nodes_value_until_its_stream_read_it():
    """sglang makes a radix node's value (its slots) on the scheduling stream; the sweep's walk
    reads the values on the forward stream, behind that forward's kernels. An eviction in
    between frees a value on the scheduling stream, whose next tensor of that size takes the
    same memory and is written at once: unless the walk holds the values for its own stream,
    it reads the new tensor's contents as the cached slots (a clean server's sweep then reports
    slots of running requests at the cached depths). Here the forward stream sleeps while the
    node is evicted and its memory offered again: the evicted value's block must wait for the
    forward stream (not be free), the walk must read the right slots, and the walk itself must
    not wait for the forward."""
    from sglang.srt.kv_canary.radix_cache_walker import walk_radix_cache_for_canary
    from canary_support.radix_pools import radix_cache_params
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    params = radix_cache_params(256, device="cuda")
    alloc = params.token_to_kv_pool_allocator
    cache = RadixCache(params)
    tokens = list(range(3, 43))
    slots = alloc.alloc(len(tokens)).to(torch.int64, copy=True)  # its own memory, as in sglang
    expected = slots.tolist()
    cache.insert(InsertParams(key=RadixKey(tokens), value=slots))
    del slots  # the tree holds the only reference, as in a server
    (node,) = cache.root_node.children.values()
    value_address = node.value.data_ptr()
    del node
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):  # a server's earlier sweeps: kernels loaded, pinned blocks
        walk_radix_cache_for_canary(radix_cache=cache)
    torch.cuda.synchronize()
    with torch.cuda.stream(forward):
        torch.cuda._sleep(2_000_000_000)  # the forward's model kernels, still running
        walk = walk_radix_cache_for_canary(radix_cache=cache)
    assert not forward.query(), "the walk waited for the forward stream"
    # the scheduling stream: the node evicted, then tensors of its value's size made and written
    cache.evict(EvictParams(num_tokens=len(tokens)))
    assert cache.evictable_size() == 0
    # freed by the eviction, but kept from reuse until the forward stream's queued reads ran
    # (the caching allocator's snapshot: "inactive" would be free for the next tensor)
    assert _allocator_block_state(value_address) == "active_pending_free"
    junk = [torch.full((len(tokens),), -7, dtype=torch.int64, device="cuda") for _ in range(256)]
    torch.cuda.synchronize()
    assert walk.slot_indices.tolist() == expected, (walk.slot_indices.tolist(), len(junk))
    assert walk.positions.tolist() == list(range(len(tokens)))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_a_snapshot_buffer_waits_for_its_copy_to_the_device():
    """A token-id snapshot's pinned host buffer is not handed to a later snapshot before its
    host→device copy ran, even once the snapshot itself is dropped (the copy is queued behind
    the GPU's work): the later snapshot gets a buffer of its own, and the device receives the
    first snapshot's ids. Once the copy completed, the slot is reused."""

    def req(ids, row):
        return types.SimpleNamespace(origin_input_ids=ids, output_ids=[], req_pool_idx=row)

    up = TokenHistoryUploader(
        torch.full((4, 64), -1, dtype=torch.int32, device="cuda"), replay_rows=4, replay_tokens=8
    )
    buffers = up.rows.buffers = SnapshotHostBuffers(slots=1, numel=64, device=up.pool.device)
    lens = torch.zeros(4, dtype=torch.int64, device="cuda")
    warm = CanaryBatchState()  # compile the scatter first: the timed part must not wait for it
    up.snapshot(warm, [req([1, 2], 0)])
    assert up.upload(warm, torch.tensor([0], dtype=torch.int64, device="cuda"), lens)
    del warm
    torch.cuda.synchronize()
    state = CanaryBatchState()
    up.snapshot(state, [req(list(range(10, 50)), 1)])
    slot = state.token_snapshot.buffer_slot
    assert slot == 0
    rows = torch.tensor([1], dtype=torch.int64, device="cuda")  # (a blocking copy: before)
    torch.cuda._sleep(1_000_000_000)  # the copy below waits behind ~0.5 s of GPU work
    assert up.upload(state, rows, lens)
    del state
    later = CanaryBatchState()
    up.snapshot(later, [req(list(range(90, 99)), 2)])
    assert later.token_snapshot.buffer_slot == -1 and buffers.own_buffers == 1
    torch.cuda.synchronize()
    assert up.pool[1, :40].tolist() == list(range(10, 50))
    del later
    again = CanaryBatchState()
    up.snapshot(again, [req([7, 8], 3)])
    assert again.token_snapshot.buffer_slot == slot and buffers.own_buffers == 1
