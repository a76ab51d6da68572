"""Token-id verification (SPEC §11): snapshot, scatter, consistency errors, and the serving
loop with token checks on: clean, and a same-position slot swap caught as verify_token."""

from __future__ import annotations

import re
import types

import pytest
import torch

from serving_driver import ServingDriver
from sglang.srt.kv_canary.req_to_expected_token_ids_manager import (
    attach_req_all_ids_info,
    compute_req_all_ids_info,
    populate_req_to_expected_token_ids,
)

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


def _req(inp, out):
    return types.SimpleNamespace(origin_input_ids=list(inp), output_ids=list(out))


def _batch(rows, reqs):
    fb = types.SimpleNamespace(req_pool_indices=torch.tensor(rows, dtype=torch.int64))
    attach_req_all_ids_info(fb, reqs)
    return fb


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
