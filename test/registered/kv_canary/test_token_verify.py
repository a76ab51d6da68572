"""Token-id verification (docs/subsystems.md, "Token checks"): the token-history snapshot and its upload
(``TokenHistoryUploader``: whole and incremental snapshots, out-of-order re-snapshot, the
scatter into the expected-token pool, consistency errors), and the serving loop with token
checks on: clean, and a same-position slot swap caught as verify_token."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from serving_driver import ServingDriver
from sglang.srt.kv_canary.batch_state import CanaryBatchState, batch_state
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.kv_canary.single_forward_manager import CanaryPhaseError
from sglang.srt.kv_canary.snapshot_buffers import SnapshotHostBuffers
from sglang.srt.kv_canary.token_history import (
    ExpectedTokenRows,
    TokenHistoryUploader,
    TokenIdSnapshot,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


def _req(inp, out, row=None):
    return types.SimpleNamespace(origin_input_ids=list(inp), output_ids=list(out), req_pool_idx=row)


def _uploader(rows, cols, replay_rows=4, replay_tokens=8):
    return TokenHistoryUploader(
        torch.full((rows, cols), -1, dtype=torch.int32),
        replay_rows=replay_rows,
        replay_tokens=replay_tokens,
    )


def _snap(up, reqs) -> CanaryBatchState:
    """What the ``ForwardBatch.init_new`` hook does: a batch state holding the snapshot."""
    state = CanaryBatchState()
    up.snapshot(state, reqs)
    return state


def _upload(up, state, rows):
    """An eager upload; the valid lengths it wrote (None when it had nothing to upload, and
    then it wrote none)."""
    lens = torch.full((len(rows) + 2,), -7, dtype=torch.int64)
    if not up.upload(state, torch.tensor(rows, dtype=torch.int64), lens):
        assert lens.eq(-7).all()
        return None
    assert lens[len(rows) :].eq(-7).all()  # only the batch's rows
    return lens[: len(rows)]


def _history(req):
    return list(req.origin_input_ids) + list(req.output_ids)


def test_whole_snapshot_contents_and_lengths():
    """Requests whose rows hold nothing yet (or that have no row) are snapshotted whole."""
    up = _uploader(4, 8)
    state = _snap(up, [_req([5, 6, 7], [8], row=2), _req([], []), _req([9], [1, 2], row=0)])
    snap = state.token_snapshot
    assert isinstance(snap, TokenIdSnapshot)
    for t in (snap.flat, snap.lens, snap.starts, snap.packed):
        assert t.dtype == torch.int64 and t.device.type == "cpu"
    assert snap.flat.tolist() == [5, 6, 7, 8, 9, 1, 2]
    assert snap.lens.tolist() == [4, 0, 3]
    assert snap.starts.tolist() == [0, 0, 0]
    snap = _snap(up, []).token_snapshot
    assert snap.flat.numel() == 0 and snap.lens.numel() == 0 and snap.starts.numel() == 0
    # a batch without requests (idle) gets no snapshot
    state = CanaryBatchState()
    up.snapshot(state, None)
    assert state.token_snapshot is None


def test_upload_scatters_truncates_and_returns_lengths():
    up = _uploader(5, 4)
    before = up.pool.clone()
    state = _snap(up, [_req([10, 11, 12], [13, 14], row=3), _req([20], [], row=1)])
    lens = _upload(up, state, [3, 1])
    assert lens.dtype == torch.int64 and lens.tolist() == [5, 1]
    assert up.pool[3].tolist() == [10, 11, 12, 13]  # truncated at max_context_len
    assert up.pool[1].tolist() == [20, -1, -1, -1]
    for row in (0, 2, 4):
        assert torch.equal(up.pool[row], before[row])  # rows not named are untouched


def test_upload_no_ops():
    up = _uploader(2, 3)
    before = up.pool.clone()
    assert _upload(up, _snap(up, []), []) is None  # empty batch
    assert _upload(up, _snap(up, [_req([4], [], row=1)]), []) is None
    assert _upload(up, None, [1]) is None  # a batch the hook never saw
    assert _upload(up, CanaryBatchState(), [1]) is None  # a state without a snapshot
    assert torch.equal(up.pool, before)


def test_uploader_needs_an_int32_2d_pool():
    for bad in (None, torch.zeros((2, 3), dtype=torch.int64), torch.zeros(6, dtype=torch.int32)):
        with pytest.raises(TypeError, match="int32 \\[rows, max_context_len\\] pool"):
            TokenHistoryUploader(bad, replay_rows=1, replay_tokens=0)
    up = TokenHistoryUploader(
        torch.zeros((7, 3), dtype=torch.int32), replay_rows=5, replay_tokens=9
    )
    assert isinstance(up.rows, ExpectedTokenRows) and up.rows.num_rows == 7
    assert up.replay_buffer.shape == (1 + 3 * 5 + 9,) and up.replay_buffer.dtype == torch.int64
    with pytest.raises(ValueError, match="replay_rows >= 1 and replay_tokens >= 0, got 0"):
        TokenHistoryUploader(torch.zeros((7, 3), dtype=torch.int32), replay_rows=0, replay_tokens=0)


def test_upload_mismatch_errors():
    up = _uploader(4, 8)
    before = up.pool.clone()
    state = _snap(up, [_req([1, 2], [], row=1)])
    with pytest.raises(RuntimeError, match="covers 1 requests but the forward batch has 2"):
        _upload(up, state, [1, 2])
    state = _snap(up, [_req([1, 2], [], row=1), _req([3], [], row=2)])
    with pytest.raises(RuntimeError, match="covers 2 requests but the forward batch has 1"):
        _upload(up, state, [1])
    assert torch.equal(up.pool, before)  # nothing half-written


def test_incremental_snapshots_send_only_what_a_row_lacks():
    up = _uploader(6, 16)
    a, b = _req([1, 2, 3], [], row=4), _req([7, 8], [9], row=1)
    state = _snap(up, [a, b])
    assert state.token_snapshot.starts.tolist() == [0, 0]  # rows hold nothing yet: whole
    assert _upload(up, state, [4, 1]).tolist() == [3, 3]
    for step in range(3):  # decode: one new output id each
        a.output_ids.append(100 + step)
        b.output_ids.append(200 + step)
        state = _snap(up, [a, b])
        snap = state.token_snapshot
        assert snap.flat.tolist() == [a.output_ids[-1], b.output_ids[-1]]
        assert snap.starts.tolist() == [len(_history(a)) - 1, len(_history(b)) - 1]
        assert snap.lens.tolist() == [len(_history(a)), len(_history(b))]
        assert _upload(up, state, [4, 1]).tolist() == [len(_history(a)), len(_history(b))]
        assert state.token_snapshot is snap  # in order: uploaded as snapshotted
    assert up.pool[4, :6].tolist() == _history(a) and up.pool[1, :6].tolist() == _history(b)
    # the flat ids, lengths and starts are views of one host buffer: one upload per forward
    storage = snap.packed.untyped_storage().data_ptr()
    for view in (snap.flat, snap.lens, snap.starts):
        assert view.untyped_storage().data_ptr() == storage
    bs = 2
    assert snap.packed.numel() == 3 * bs + 1 + snap.flat.numel()
    assert up.rows.full_resnapshots == 0


def test_pack_refuses_segments_that_disagree_with_the_total():
    """The header's segments (length - start per request) must add up to the ids given."""
    snap = TokenIdSnapshot.pack([4, 3], [1, 0], [[6, 7, 8], [1, 2, 3]], 6)
    assert snap.num_reqs == 2 and snap.flat.tolist() == [6, 7, 8, 1, 2, 3]
    with pytest.raises(ValueError, match="the segments hold 6 ids, total says 5"):
        TokenIdSnapshot.pack([4, 3], [1, 0], [[6, 7, 8], [1, 2]], 5)


def test_pack_refuses_pieces_that_disagree_with_the_segments():
    """More or fewer ids than the header's segments is refused before anything is written
    (a reused buffer would otherwise keep an earlier snapshot's ids)."""
    with pytest.raises(ValueError, match="the pieces hold 5 ids, the segments 4"):
        TokenIdSnapshot.pack([4], [0], [[6, 7, 8], [1, 2]], 4)
    with pytest.raises(ValueError, match="the pieces hold 3 ids, the segments 4"):
        TokenIdSnapshot.pack([4], [0], [[6, 7, 8], []], 4)


def test_snapshot_buffers_are_reused_only_once_their_snapshot_is_gone():
    """A snapshot keeps its buffer slot while it exists (a batch run again uploads it again):
    later snapshots never write into it; once it is dropped its slot is handed out again,
    the same storage; a snapshot that finds every slot taken, or that is larger than a slot,
    gets a buffer of its own."""
    buffers = SnapshotHostBuffers(slots=2, numel=64, device=torch.device("cpu"))
    rows = ExpectedTokenRows(8, buffers=buffers)
    a = rows.snapshot([_req([1, 2, 3], [4])])
    b = rows.snapshot([_req([5, 6], [])])
    assert sorted((a.buffer_slot, b.buffer_slot)) == [0, 1]
    c = rows.snapshot([_req([7, 8, 9, 10, 11], [12])])  # both slots held
    assert c.buffer_slot == -1 and buffers.own_buffers == 1
    assert (a.flat.tolist(), b.flat.tolist()) == ([1, 2, 3, 4], [5, 6])
    slot, storage = a.buffer_slot, a.packed.data_ptr()
    del a
    d = rows.snapshot([_req([13], [14, 15])])
    assert d.buffer_slot == slot and d.packed.data_ptr() == storage
    assert b.flat.tolist() == [5, 6] and c.flat.tolist() == [7, 8, 9, 10, 11, 12]
    assert d.flat.tolist() == [13, 14, 15] and d.lens.tolist() == [3]
    del b
    e = rows.snapshot([_req(range(60), [])])  # 1 + 3 + 60 words: fits a slot
    assert e.buffer_slot >= 0 and e.packed.numel() == 64 and e.flat.tolist() == list(range(60))
    del e
    f = rows.snapshot([_req(range(61), [])])  # one word too many
    assert f.buffer_slot == -1 and buffers.own_buffers == 2
    assert f.flat.tolist() == list(range(61))


def test_upload_is_one_host_to_device_copy(monkeypatch):
    """The whole snapshot reaches the device as one copy of ``packed`` (no per-field copies)."""
    up = _uploader(4, 8)
    state = _snap(up, [_req([1, 2, 3], [4], row=0), _req([5], [], row=2)])
    copied = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        copied.append(self)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    _upload(up, state, [0, 2])
    monkeypatch.undo()
    snap = state.token_snapshot
    host_copies = [
        t
        for t in copied
        if t.untyped_storage().data_ptr() == snap.packed.untyped_storage().data_ptr()
    ]
    assert len(host_copies) == 1 and host_copies[0] is snap.packed
    assert up.pool[0, :4].tolist() == [1, 2, 3, 4] and up.pool[2, 0].item() == 5


def test_a_row_given_to_another_request_is_sent_whole():
    up = _uploader(4, 8)
    old = _req([1, 2, 3, 4, 5], [6], row=2)
    _upload(up, _snap(up, [old]), [2])
    new = _req([9], [], row=2)  # the row freed and reused: same row, another request
    state = _snap(up, [new])
    assert state.token_snapshot.starts.tolist() == [0]
    assert state.token_snapshot.flat.tolist() == [9]
    assert _upload(up, state, [2]).tolist() == [1]
    assert up.pool[2, 0].item() == 9  # positions past the valid length are never checked
    # a history that got shorter than what the row holds is sent whole as well
    new.output_ids[:] = []
    new.origin_input_ids[:] = []
    state = _snap(up, [new])
    assert state.token_snapshot.starts.tolist() == [0]
    assert state.token_snapshot.lens.tolist() == [0]
    _upload(up, state, [2])
    # as is one whose lists were replaced (sglang restarts a retracted input_embeds request's
    # output with a new list): same request, same row, same length, other tokens
    new.output_ids.extend([4, 5])
    _upload(up, _snap(up, [new]), [2])
    new.output_ids = [6, 7]
    state = _snap(up, [new])
    assert state.token_snapshot.starts.tolist() == [0]
    assert state.token_snapshot.flat.tolist() == [6, 7]
    _upload(up, state, [2])
    assert up.pool[2, :2].tolist() == [6, 7]
    # a request without a row in this pool is sent whole every time and never recorded
    loose = _req([5, 6], [7], row=None)
    for _ in range(2):
        state = _snap(up, [loose])
        assert state.token_snapshot.starts.tolist() == [0]
        assert state.token_snapshot.flat.tolist() == [5, 6, 7]
    assert up.rows.full_resnapshots == 0


def test_a_replaced_input_list_is_sent_whole():
    """sglang assigns a new ``origin_input_ids`` list where it rewrites a request's input
    (same request, same row): the row is sent whole, even when the new history is as long as
    or longer than what the row holds (a length check alone would send only the tail)."""
    up = _uploader(4, 8)
    req = _req([1, 2, 3], [4], row=1)
    _upload(up, _snap(up, [req]), [1])
    req.origin_input_ids = [5, 6, 7]  # same length, other tokens
    state = _snap(up, [req])
    assert state.token_snapshot.starts.tolist() == [0]
    assert state.token_snapshot.flat.tolist() == [5, 6, 7, 4]
    _upload(up, state, [1])
    assert up.pool[1, :4].tolist() == [5, 6, 7, 4]
    req.origin_input_ids = [8, 9, 10, 11]  # longer
    state = _snap(up, [req])
    assert state.token_snapshot.starts.tolist() == [0]
    assert _upload(up, state, [1]).tolist() == [5]
    assert up.pool[1, :5].tolist() == [8, 9, 10, 11, 4]
    req.output_ids.append(12)  # and incremental again on the new list
    state = _snap(up, [req])
    assert state.token_snapshot.flat.tolist() == [12]
    _upload(up, state, [1])
    assert up.pool[1, :6].tolist() == [8, 9, 10, 11, 4, 12]
    assert up.rows.full_resnapshots == 0


def test_a_snapshot_never_uploaded_forces_a_whole_resnapshot(caplog):
    up = _uploader(4, 8)
    req = _req([1, 2], [], row=3)
    _upload(up, _snap(up, [req]), [3])
    req.output_ids.append(3)
    skipped = _snap(up, [req])  # built, never run: the row lacks token 3
    req.output_ids.append(4)
    state = _snap(up, [req])
    stale = state.token_snapshot
    assert stale.flat.tolist() == [4]  # assumes the skipped one was uploaded
    assert _upload(up, state, [3]).tolist() == [4]
    assert up.rows.full_resnapshots == 1
    # re-snapshotted whole before the upload; the batch's state now holds the whole one
    assert state.token_snapshot is not stale
    assert state.token_snapshot.starts.tolist() == [0]
    assert state.token_snapshot.flat.tolist() == [1, 2, 3, 4]
    assert up.pool[3, :4].tolist() == [1, 2, 3, 4]
    # the stale one, run late, belongs to a past epoch: whole again, and still correct
    assert _upload(up, skipped, [3]).tolist() == [4]
    assert up.rows.full_resnapshots == 2 and up.pool[3, :4].tolist() == [1, 2, 3, 4]
    assert skipped.token_snapshot.starts.tolist() == [0]
    # in order again: incremental
    req.output_ids.append(5)
    state = _snap(up, [req])
    assert state.token_snapshot.flat.tolist() == [5]
    _upload(up, state, [3])
    assert up.rows.full_resnapshots == 2 and up.pool[3, :5].tolist() == [1, 2, 3, 4, 5]
    warned = [r.getMessage() for r in caplog.records if "out of order" in r.getMessage()]
    assert len(warned) == 1 and "snapshot 2, last uploaded 0" in warned[0], warned


def test_a_batch_uploaded_again_keeps_the_record():
    """Split prefill runs one ForwardBatch several times, other batches in between."""
    up = _uploader(4, 8)
    split = _snap(up, [_req([1, 2, 3], [], row=0)])
    _upload(up, split, [0])
    other = _req([7], [], row=1)
    _upload(up, _snap(up, [other]), [1])
    _upload(up, split, [0])
    other.output_ids.append(8)
    state = _snap(up, [other])
    assert state.token_snapshot.flat.tolist() == [8]
    _upload(up, state, [1])
    assert up.rows.full_resnapshots == 0
    assert up.pool[0, :3].tolist() == [1, 2, 3] and up.pool[1, :2].tolist() == [7, 8]


def test_expected_token_rows_checks():
    with pytest.raises(ValueError, match="num_rows >= 1, got 0"):
        ExpectedTokenRows(0)
    snap = _snap(_uploader(2, 4), [_req([1], [], row=0)]).token_snapshot
    with pytest.raises(RuntimeError, match="another expected-token pool"):
        ExpectedTokenRows(2).check_upload(snap)
    # a snapshot of another uploader's pool is refused at upload too, pool untouched
    up = _uploader(2, 4)
    before = up.pool.clone()
    state = CanaryBatchState()
    state.token_snapshot = snap
    with pytest.raises(RuntimeError, match="another expected-token pool"):
        _upload(up, state, [0])
    assert torch.equal(up.pool, before)


def test_manager_hook_fills_the_batch_state():
    """``CanaryManager.on_forward_batch_init``: with token checks on the batch's canary state
    records the requests to snapshot, and the forward's upload takes the snapshot (off the
    batch build, which the forward's launch waits for); with neither token checks nor the
    oracle the state holds only the batch's requests."""
    on = ServingDriver(seed=8, verify_tokens=True)
    on.add_request(prompt_len=5, max_new=2)
    on._admit()
    fb = on._extend_batch(list(on.running))
    state = batch_state(fb)
    assert state is not None and state.oracle_rows is None
    # the hook only remembers the requests: the snapshot waits for the upload
    assert state.token_reqs == tuple(on.running) and state.token_snapshot is None
    assert state.requests.reqs == tuple(on.running) and state.requests.rows == (on.running[0].row,)
    on._forward(fb)
    assert state.token_snapshot.lens.tolist() == [5]
    assert state.token_snapshot.flat.tolist() == on.running[0].prompt
    off = ServingDriver(seed=8)
    off.add_request(prompt_len=5, max_new=2)
    off._admit()
    state = batch_state(off._extend_batch(list(off.running)))
    # neither feature on: only the requests (for rids=), no snapshot, no oracle rows
    assert state.token_snapshot is None and state.token_reqs is None and state.oracle_rows is None
    assert state.requests.rows == (off.running[0].row,)


def test_serving_loop_with_token_checks_is_clean():
    d = ServingDriver(seed=8, verify_tokens=True, real_data="partial")
    d.run(250)
    state = d.manager.state
    assert d.manager.count_violations() == 0
    assert state.req_to_verify_expected_tokens is not None
    # the pool really holds the requests' histories
    for r in d.running:
        n = len(r.tokens)
        assert state.req_to_verify_expected_tokens[r.row, : n - 1].tolist() == r.tokens[: n - 1]
    assert d.shared_admitted >= 5 and d.reused_slots >= 50
    # every forward ran the batch it snapshotted: the incremental record never had to reset
    assert d.manager.token_history.rows.full_resnapshots == 0


@pytest.mark.parametrize("verify_tokens", [True, False])
def test_same_position_swap_is_caught_as_verify_token(verify_tokens):
    d = ServingDriver(seed=12, verify_tokens=verify_tokens, mode="raise")
    d.run(60)
    d.settle()
    info = d.fault_swap_same_position()
    assert info["shared_prefix"], "the workload must offer a shared-prefix pair"
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.step()
    rows = parse_violation_lines(str(exc.value))
    mine = [v for v in rows if v.slot_idx == info["new_slot"]]
    if verify_tokens:
        # the swapped slot's chain is consistent (shared prefix): only the token gives it away
        assert mine and all(v.fail_reasons == ("verify_token",) for v in mine), rows
        assert mine[0].stored_token == info["other_token"]
        assert mine[0].expected_token == info["victim_token"]
    else:
        # without token checks the swapped slot itself passes; only its successor's chain fails
        assert not mine, rows
        assert rows and all(
            "verify_token" not in v.fail_reasons and v.expected_token == -1 for v in rows
        )


def _one_prefill(verify_tokens=True):
    d = ServingDriver(seed=8, verify_tokens=verify_tokens)
    d.add_request(prompt_len=7, max_new=2)
    d._admit()
    req = d.running[0]
    return d, req, d._extend_batch([req])


def test_an_eager_forward_uploads_the_tokens_after_the_models_launches():
    """The upload is not on the forward's critical path: nothing reaches the expected-token
    pool in the outside pre-ops or at the fork point, it does in the inside post-ops (on
    CUDA on the side stream, after the model's kernels are queued), before the plan that
    reads it."""
    d, req, fb = _one_prefill()
    pool = d.manager.state.req_to_verify_expected_tokens
    mgr = d.manager
    with mgr.with_active_single_forward_manager(0), mgr.with_ops_outside_graph(fb):
        mgr.pre_ops_maybe_inside_graph(fb)
        assert pool[req.row, :7].tolist() == [-1] * 7  # not yet: the model's turn first
        d.model_forward(fb)
        mgr.post_ops_maybe_inside_graph(fb)
        assert pool[req.row, :7].tolist() == req.prompt
    assert mgr.count_violations() == 0


def test_a_graph_replay_needs_the_token_upload_first():
    """A CUDA-graph replay scatters the tokens inside the graph, from the uploader's replay
    buffer, so the replay hooks stage the snapshot there before replaying
    (``before_graph_replay``); a replay marked without it is refused, naming the call that is
    missing. Without token checks there is nothing to upload."""
    d, req, fb = _one_prefill()
    mgr = d.manager
    pool = mgr.state.req_to_verify_expected_tokens
    with mgr.with_active_single_forward_manager(0):
        with pytest.raises(CanaryPhaseError, match="upload_tokens_before_replay"):
            with mgr.with_ops_outside_graph(fb):
                mgr.mark_replayed_inside_graph()
        with mgr.with_ops_outside_graph(fb):
            mgr.before_graph_replay()
            assert pool[req.row, :7].tolist() != req.prompt  # staged, not scattered yet
            # what the graph's captured scatter then does (a padded batch of 3 rows)
            lens = torch.full((3,), -1, dtype=torch.int64)
            mgr.token_history.launch_replay_scatter(
                torch.tensor([req.row, 0, 0], dtype=torch.int64), lens
            )
            assert pool[req.row, :7].tolist() == req.prompt and lens.tolist() == [7, 0, 0]
            mgr.mark_replayed_inside_graph()
    d, req, fb = _one_prefill(verify_tokens=False)
    with d.manager.with_active_single_forward_manager(0), d.manager.with_ops_outside_graph(fb):
        d.manager.before_graph_replay()
        d.manager.mark_replayed_inside_graph()


# ---- replayed forwards: staged before the replay, scattered inside the graph ---------------


def _replay(up, state, rows, graph_rows):
    """Stage as the replay hook does, then run the graph's captured scatter over a padded
    batch of ``graph_rows`` (padding rows 0, as sglang pads); returns the valid lengths."""
    lens = torch.full((graph_rows,), -7, dtype=torch.int64)
    up.stage_for_replay(state, torch.tensor(rows, dtype=torch.int64), lens)
    padded = torch.tensor(list(rows) + [0] * (graph_rows - len(rows)), dtype=torch.int64)
    up.launch_replay_scatter(padded, lens)
    return lens


def test_a_replayed_decode_gets_its_tokens_from_the_replay_buffer():
    """Decode steps replayed from a graph of 4 rows: each step's new tokens reach the pool
    through the staged buffer and the graph's scatter; padding rows get valid length 0 and
    their row (0, a live request's row here) is not written."""
    up = _uploader(6, 16, replay_rows=4, replay_tokens=8)
    a, b, c = _req([1, 2, 3], [], row=4), _req([7, 8], [9], row=1), _req([5], [6], row=0)
    _upload(up, _snap(up, [a, b, c]), [4, 1, 0])  # the prefill (eager)
    row0 = up.pool[0].clone()
    for step in range(3):
        a.output_ids.append(100 + step)
        b.output_ids.append(200 + step)
        lens = _replay(up, _snap(up, [a, b]), [4, 1], graph_rows=4)
        assert lens.tolist() == [len(_history(a)), len(_history(b)), 0, 0]
    assert up.pool[4, :6].tolist() == _history(a) and up.pool[1, :6].tolist() == _history(b)
    assert torch.equal(up.pool[0], row0)
    assert up.rows.full_resnapshots == 0


def test_replay_staging_copies_once_per_snapshot():
    """The forwards of one EAGLE draft round share a snapshot: only the first one copies it
    into the replay buffer; a new snapshot is copied again."""
    up = _uploader(4, 8)
    req = _req([1, 2], [3], row=2)
    state = _snap(up, [req])
    lens = torch.zeros(4, dtype=torch.int64)
    up.stage_for_replay(state, torch.tensor([2]), lens)
    up.replay_buffer[-1] = 4242  # a word past the snapshot: a second copy would not touch it
    up.replay_buffer[1 + 3] = 99  # its first token: a second copy would restore it
    up.stage_for_replay(state, torch.tensor([2]), lens)
    assert up.replay_buffer[1 + 3].item() == 99
    req.output_ids.append(4)
    up.stage_for_replay(_snap(up, [req]), torch.tensor([2]), lens)
    assert up.replay_buffer[:5].tolist() == [1, 4, 3, 0, 4]


def test_a_replay_without_a_snapshot_checks_no_token():
    """No snapshot (an idle batch, token checks attached to no request): the buffer's request
    count is 0, so the graph's scatter sets every valid length to 0 and writes nothing."""
    up = _uploader(4, 8)
    _replay(up, _snap(up, [_req([1, 2], [], row=1)]), [1], graph_rows=2)
    before = up.pool.clone()
    lens = _replay(up, CanaryBatchState(), [1], graph_rows=2)
    assert lens.tolist() == [0, 0] and torch.equal(up.pool, before)


def test_a_snapshot_larger_than_the_replay_buffer_is_scattered_before_the_replay():
    """A replayed forward whose snapshot does not fit the replay buffer (a request sent
    whole): its tokens go by their own launch before the replay; the graph's scatter then
    gets the lengths only, and the next (small) snapshot uses the buffer again."""
    up = _uploader(4, 32, replay_rows=2, replay_tokens=3)
    big = _req(list(range(10, 30)), [5], row=3)
    small = _req([1], [], row=1)
    lens = _replay(up, _snap(up, [big, small]), [3, 1], graph_rows=2)
    assert lens.tolist() == [21, 1]
    assert up.pool[3, :21].tolist() == _history(big) and up.pool[1, 0].item() == 1
    head = up.replay_buffer[:7].view(-1)[1:].view(2, 3)
    assert head[:, 1].tolist() == head[:, 0].tolist() == [21, 1]  # empty segments
    big.output_ids.append(6)
    lens = _replay(up, _snap(up, [big, small]), [3, 1], graph_rows=2)
    assert lens.tolist() == [22, 1] and up.pool[3, :22].tolist() == _history(big)


def test_a_replayed_snapshot_out_of_order_is_resent_whole():
    """A snapshot built but never run leaves rows behind what the next one assumes: staged for
    a replay, the next one is re-snapshotted whole (as for an eager upload) and the pool
    ends up right."""
    up = _uploader(4, 16, replay_tokens=16)
    req = _req([1, 2, 3], [], row=2)
    _upload(up, _snap(up, [req]), [2])
    req.output_ids.append(4)
    _snap(up, [req])  # built, never run: the record claims row 2 holds 4 tokens
    req.output_ids.append(5)
    lens = _replay(up, _snap(up, [req]), [2], graph_rows=1)
    assert up.rows.full_resnapshots == 1
    assert lens.tolist() == [5] and up.pool[2, :5].tolist() == [1, 2, 3, 4, 5]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
