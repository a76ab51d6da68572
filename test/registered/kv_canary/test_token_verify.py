"""Token-id verification (SPEC §11): snapshot, scatter, consistency errors, and the serving
loop with token checks on: clean, and a same-position slot swap caught as verify_token."""

from __future__ import annotations

import re
import types

import pytest
import torch

from serving_driver import ServingDriver
from sglang.srt.kv_canary.req_to_expected_token_ids_manager import (
    ExpectedTokenRows,
    attach_req_all_ids_info,
    compute_req_all_ids_info,
    populate_req_to_expected_token_ids,
)

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


def _req(inp, out, row=None):
    return types.SimpleNamespace(origin_input_ids=list(inp), output_ids=list(out),
                                 req_pool_idx=row)


def _batch(rows, reqs, tracker=None):
    fb = types.SimpleNamespace(req_pool_indices=torch.tensor(rows, dtype=torch.int64))
    attach_req_all_ids_info(fb, reqs, rows=tracker)
    return fb


def _upload(fb, pool):
    return populate_req_to_expected_token_ids(forward_batch=fb, req_to_verify_expected_tokens=pool)


def _history(req):
    return list(req.origin_input_ids) + list(req.output_ids)


def test_snapshot_contents_and_lengths():
    flat, lens = compute_req_all_ids_info([_req([5, 6, 7], [8]), _req([], []), _req([9], [1, 2])])
    assert flat.dtype == torch.int64 and lens.dtype == torch.int64 and flat.device.type == "cpu"
    assert flat.tolist() == [5, 6, 7, 8, 9, 1, 2]
    assert lens.tolist() == [4, 0, 3]
    flat, lens = compute_req_all_ids_info([])
    assert flat.numel() == 0 and lens.numel() == 0


def test_populate_scatters_truncates_and_returns_lengths():
    pool = torch.full((5, 4), -1, dtype=torch.int32)
    before = pool.clone()
    fb = _batch([3, 1], [_req([10, 11, 12], [13, 14]), _req([20], [])])
    lens = populate_req_to_expected_token_ids(forward_batch=fb, req_to_verify_expected_tokens=pool)
    assert lens.tolist() == [5, 1]
    assert pool[3].tolist() == [10, 11, 12, 13]  # truncated at max_context_len
    assert pool[1].tolist() == [20, -1, -1, -1]
    for row in (0, 2, 4):
        assert torch.equal(pool[row], before[row])  # rows not named are untouched


def test_populate_no_ops():
    pool = torch.zeros((2, 3), dtype=torch.int32)
    assert populate_req_to_expected_token_ids(
        forward_batch=_batch([], []), req_to_verify_expected_tokens=pool) is None
    assert populate_req_to_expected_token_ids(
        forward_batch=_batch([1], [_req([4], [])]), req_to_verify_expected_tokens=None) is None
    no_snapshot = types.SimpleNamespace(req_pool_indices=torch.tensor([1]))
    assert populate_req_to_expected_token_ids(
        forward_batch=no_snapshot, req_to_verify_expected_tokens=pool) is None
    assert not pool.any()


def test_populate_mismatch_errors():
    pool = torch.zeros((4, 8), dtype=torch.int32)
    fb = _batch([1, 2], [_req([1, 2], [])])
    with pytest.raises(RuntimeError, match="covers 1 requests but the forward batch has 2"):
        populate_req_to_expected_token_ids(forward_batch=fb, req_to_verify_expected_tokens=pool)
    fb = _batch([1], [_req([1, 2], [])])
    fb.req_all_ids_flat = fb.req_all_ids_flat[:1]
    with pytest.raises(RuntimeError, match="holds 1 ids but its lengths sum to 2"):
        populate_req_to_expected_token_ids(forward_batch=fb, req_to_verify_expected_tokens=pool)
    fb = _batch([1], [_req([1, 2], [])])
    fb.req_all_ids_starts = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="has 2 starts for 1 lengths"):
        populate_req_to_expected_token_ids(forward_batch=fb, req_to_verify_expected_tokens=pool)
    assert not pool.any()  # nothing half-written


def test_incremental_snapshots_send_only_what_a_row_lacks():
    tracker, pool = ExpectedTokenRows(6), torch.full((6, 16), -1, dtype=torch.int32)
    a, b = _req([1, 2, 3], [], row=4), _req([7, 8], [9], row=1)
    fb = _batch([4, 1], [a, b], tracker)
    assert fb.req_all_ids_starts.tolist() == [0, 0]  # rows hold nothing yet: whole histories
    assert _upload(fb, pool).tolist() == [3, 3]
    for step in range(3):  # decode: one new output id each
        a.output_ids.append(100 + step)
        b.output_ids.append(200 + step)
        fb = _batch([4, 1], [a, b], tracker)
        assert fb.req_all_ids_flat.tolist() == [a.output_ids[-1], b.output_ids[-1]]
        assert fb.req_all_ids_starts.tolist() == [len(_history(a)) - 1, len(_history(b)) - 1]
        assert _upload(fb, pool).tolist() == [len(_history(a)), len(_history(b))]
    assert pool[4, :6].tolist() == _history(a) and pool[1, :6].tolist() == _history(b)
    # the flat ids, lengths and starts are views of one host buffer: one upload per forward
    storage = fb.req_all_ids_lens.untyped_storage().data_ptr()
    assert fb.req_all_ids_flat.untyped_storage().data_ptr() == storage
    assert fb.req_all_ids_starts.untyped_storage().data_ptr() == storage
    assert tracker.full_resnapshots == 0


def test_a_row_given_to_another_request_is_sent_whole():
    tracker, pool = ExpectedTokenRows(4), torch.full((4, 8), -1, dtype=torch.int32)
    old = _req([1, 2, 3, 4, 5], [6], row=2)
    _upload(_batch([2], [old], tracker), pool)
    new = _req([9], [], row=2)  # the row freed and reused: same row, another request
    fb = _batch([2], [new], tracker)
    assert fb.req_all_ids_starts.tolist() == [0] and fb.req_all_ids_flat.tolist() == [9]
    assert _upload(fb, pool).tolist() == [1]
    assert pool[2, 0].item() == 9  # positions past the valid length are never checked
    # a history that got shorter than what the row holds is sent whole as well
    new.output_ids[:] = []
    new.origin_input_ids[:] = []
    fb = _batch([2], [new], tracker)
    assert fb.req_all_ids_starts.tolist() == [0] and fb.req_all_ids_lens.tolist() == [0]
    # as is one whose lists were replaced (sglang restarts a retracted input_embeds request's
    # output with a new list): same request, same row, same length, other tokens
    new.output_ids.extend([4, 5])
    _upload(_batch([2], [new], tracker), pool)
    new.output_ids = [6, 7]
    fb = _batch([2], [new], tracker)
    assert fb.req_all_ids_starts.tolist() == [0] and fb.req_all_ids_flat.tolist() == [6, 7]
    _upload(fb, pool)
    assert pool[2, :2].tolist() == [6, 7]
    # a request without a row in this pool is sent whole every time and never recorded
    loose = _req([5, 6], [7], row=None)
    for _ in range(2):
        fb = _batch([3], [loose], tracker)
        assert fb.req_all_ids_starts.tolist() == [0] and fb.req_all_ids_flat.tolist() == [5, 6, 7]


def test_a_snapshot_never_uploaded_forces_a_whole_resnapshot(caplog):
    tracker, pool = ExpectedTokenRows(4), torch.full((4, 8), -1, dtype=torch.int32)
    req = _req([1, 2], [], row=3)
    _upload(_batch([3], [req], tracker), pool)
    req.output_ids.append(3)
    skipped = _batch([3], [req], tracker)  # built, never run: the row lacks token 3
    req.output_ids.append(4)
    fb = _batch([3], [req], tracker)
    assert fb.req_all_ids_flat.tolist() == [4]  # assumes the skipped one was uploaded
    assert _upload(fb, pool).tolist() == [4]
    assert tracker.full_resnapshots == 1
    assert fb.req_all_ids_starts.tolist() == [0]  # re-snapshotted whole before the upload
    assert pool[3, :4].tolist() == [1, 2, 3, 4]
    # the stale one, run late, belongs to a past epoch: whole again, and still correct
    assert _upload(skipped, pool).tolist() == [4]
    assert tracker.full_resnapshots == 2 and pool[3, :4].tolist() == [1, 2, 3, 4]
    # in order again: incremental
    req.output_ids.append(5)
    fb = _batch([3], [req], tracker)
    assert fb.req_all_ids_flat.tolist() == [5]
    _upload(fb, pool)
    assert tracker.full_resnapshots == 2 and pool[3, :5].tolist() == [1, 2, 3, 4, 5]
    warned = [r.getMessage() for r in caplog.records if "out of order" in r.getMessage()]
    assert len(warned) == 1 and "snapshot 2, last uploaded 0" in warned[0], warned


def test_a_batch_uploaded_again_keeps_the_record():
    """Split prefill runs one ForwardBatch several times, other batches in between."""
    tracker, pool = ExpectedTokenRows(4), torch.full((4, 8), -1, dtype=torch.int32)
    split = _batch([0], [_req([1, 2, 3], [], row=0)], tracker)
    _upload(split, pool)
    other = _req([7], [], row=1)
    _upload(_batch([1], [other], tracker), pool)
    _upload(split, pool)
    other.output_ids.append(8)
    fb = _batch([1], [other], tracker)
    assert fb.req_all_ids_flat.tolist() == [8]
    _upload(fb, pool)
    assert tracker.full_resnapshots == 0
    assert pool[0, :3].tolist() == [1, 2, 3] and pool[1, :2].tolist() == [7, 8]


def test_expected_token_rows_checks():
    with pytest.raises(ValueError, match="num_rows >= 1, got 0"):
        ExpectedTokenRows(0)
    fb = _batch([0], [_req([1], [], row=0)], ExpectedTokenRows(2))
    with pytest.raises(RuntimeError, match="another expected-token pool"):
        ExpectedTokenRows(2).check_upload(fb._kv_canary_token_snapshot)


def test_serving_loop_with_token_checks_is_clean():
    d = ServingDriver(seed=8, verify_tokens=True, real_data="partial")
    d.run(250)
    state = d.manager.state
    assert int(state.violation_log.violation_write_index) == 0
    assert state.req_to_verify_expected_tokens is not None
    # the pool really holds the requests' histories
    for r in d.running:
        n = len(r.tokens)
        assert state.req_to_verify_expected_tokens[r.row, : n - 1].tolist() == r.tokens[: n - 1]
    assert d.shared_admitted >= 5 and d.reused_slots >= 50
    # every forward ran the batch it snapshotted: the incremental record never had to reset
    assert d.manager.expected_token_rows.full_resnapshots == 0


@pytest.mark.parametrize("verify_tokens", [True, False])
def test_same_position_swap_is_caught_as_verify_token(verify_tokens):
    d = ServingDriver(seed=12, verify_tokens=verify_tokens, mode="raise")
    d.run(60)
    d.settle()
    info = d.fault_swap_same_position()
    assert info["shared_prefix"], "the workload must offer a shared-prefix pair"
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.step()
    rows = re.findall(r"fail_reason=([\w+]+) slot_idx=(\d+) position=(\d+) stored_token=(\d+) "
                      r"expected_token=(-?\d+)", str(exc.value))
    mine = [r for r in rows if int(r[1]) == info["new_slot"]]
    if verify_tokens:
        # the swapped slot's chain is consistent (shared prefix): only the token gives it away
        assert mine and all(r[0] == "verify_token" for r in mine), rows
        assert int(mine[0][3]) == info["other_token"] and int(mine[0][4]) == info["victim_token"]
    else:
        # without token checks the swapped slot itself passes; only its successor's chain fails
        assert not mine, rows
        assert rows and all("verify_token" not in r[0] and int(r[4]) == -1 for r in rows)
