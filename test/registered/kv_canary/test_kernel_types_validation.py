"""Bad input for the KV-canary constructors: ``RealKvSource``, ``VerifyOrWriteContext``,
``VerifyPlan`` / ``WritePlan`` (``allocate`` and their fields) (docs/architecture.md, "Record
format", "Plans" and "Kernel rules"; the launchers: ``test_kernels_validation*.py``). Each case
changes one argument of an accepted baseline; the error is a ``TypeError`` or ``ValueError``
whose message names the argument."""

from __future__ import annotations

import sys

import pytest
import torch

from sglang.jit_kernel.kv_canary import (
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
    VerifyPlan,
    WritePlan,
)
from sglang.test.ci.ci_register import register_cpu_ci
from validation_cases import (
    META,
    I64,
    I32,
    noncontig,
    named,
    make_source,
    context_kwargs,
    make_context,
)

register_cpu_ci(est_time=1, suite="stage-a-test-cpu")


# =============================================================================================
# RealKvSource
# =============================================================================================


def _misaligned():
    base = torch.zeros(4 * 32 + 1, dtype=torch.uint8)
    return base[1:].view(4, 32)


def _source_kwargs(**over):
    kw = dict(
        tensor=torch.zeros(8, 32, dtype=torch.uint8),
        page_size=2,
        num_bytes_per_token=16,
        read_bytes=16,
    )
    kw.update(over)
    return kw


SOURCE_CASES = [
    ("tensor_not_tensor", dict(tensor=[[0] * 32] * 8), TypeError, "RealKvSource.tensor"),
    ("tensor_none", dict(tensor=None), TypeError, "RealKvSource.tensor"),
    ("page_size_zero", dict(page_size=0), ValueError, "RealKvSource.page_size"),
    ("page_size_float", dict(page_size=2.0), TypeError, "RealKvSource.page_size"),
    ("page_size_bool", dict(page_size=True), TypeError, "RealKvSource.page_size"),
    (
        "nbpt_not_multiple_of_8",
        dict(num_bytes_per_token=12, read_bytes=8),
        ValueError,
        "RealKvSource.num_bytes_per_token",
    ),
    (
        "nbpt_zero",
        dict(num_bytes_per_token=0, read_bytes=8),
        ValueError,
        "RealKvSource.num_bytes_per_token",
    ),
    ("nbpt_float", dict(num_bytes_per_token=16.0), TypeError, "RealKvSource.num_bytes_per_token"),
    ("read_bytes_not_multiple_of_8", dict(read_bytes=12), ValueError, "RealKvSource.read_bytes"),
    ("read_bytes_4", dict(read_bytes=4), ValueError, "RealKvSource.read_bytes"),
    ("read_bytes_zero", dict(read_bytes=0), ValueError, "RealKvSource.read_bytes"),
    ("read_bytes_over_nbpt", dict(read_bytes=24), ValueError, "read_bytes"),
    (
        "tensor_1d",
        dict(tensor=torch.zeros(256, dtype=torch.uint8)),
        ValueError,
        "RealKvSource.tensor",
    ),
    (
        "rows_noncontig_stride",
        dict(tensor=torch.zeros(8, 64, dtype=torch.uint8)[:, ::2]),
        ValueError,
        "RealKvSource.tensor",
    ),
    (
        "rows_noncontig_transposed",
        dict(tensor=torch.zeros(8, 16, 4, dtype=torch.bfloat16).transpose(1, 2)),
        ValueError,
        "RealKvSource.tensor",
    ),
    (
        "rows_too_short",
        dict(tensor=torch.zeros(8, 24, dtype=torch.uint8)),
        ValueError,
        "num_bytes_per_token",
    ),
    (
        "rows_too_short_24_byte_tokens",
        dict(
            tensor=torch.zeros(8, 2, 8, dtype=torch.bfloat16), num_bytes_per_token=24, read_bytes=24
        ),
        ValueError,
        "num_bytes_per_token",
    ),
    (
        "row_stride_not_multiple_of_8",
        dict(tensor=torch.zeros(8, 36, dtype=torch.uint8)),
        ValueError,
        "RealKvSource.tensor row stride",
    ),
    ("misaligned_data", dict(tensor=_misaligned()), ValueError, "RealKvSource.tensor"),
    (
        "no_rows",
        dict(tensor=torch.zeros(0, 32, dtype=torch.uint8)),
        ValueError,
        "RealKvSource.tensor",
    ),
]


@pytest.mark.parametrize(
    "over,exc,name", [c[1:] for c in SOURCE_CASES], ids=[c[0] for c in SOURCE_CASES]
)
def test_real_kv_source_rejects(over, exc, name):
    with pytest.raises(exc, match=named(name)):
        RealKvSource(**_source_kwargs(**over))


def test_real_kv_source_errors_are_specific():
    with pytest.raises(
        ValueError,
        match=r"read_bytes \(32\) must not exceed "
        r"num_bytes_per_token \(16\)",
    ):
        RealKvSource(**_source_kwargs(read_bytes=32))
    with pytest.raises(ValueError, match=r"num_bytes_per_token must be a positive multiple of 8"):
        RealKvSource(**_source_kwargs(num_bytes_per_token=20, read_bytes=8))
    with pytest.raises(ValueError, match=r"contiguous rows"):
        RealKvSource(**_source_kwargs(tensor=torch.zeros(8, 64, dtype=torch.uint8)[:, ::2]))
    with pytest.raises(ValueError, match=r"exceeds the tensor's row"):
        RealKvSource(**_source_kwargs(tensor=torch.zeros(8, 24, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"8-byte aligned"):
        RealKvSource(**_source_kwargs(tensor=_misaligned()))


# =============================================================================================
# VerifyOrWriteContext
# =============================================================================================

CONTEXT_CASES = [
    ("canary_buf_not_tensor", lambda: dict(canary_buf=[[0] * 32] * 16), TypeError, "canary_buf"),
    (
        "canary_buf_dtype",
        lambda: dict(canary_buf=torch.zeros(16, 4, dtype=I64)),
        TypeError,
        "canary_buf",
    ),
    (
        "canary_buf_width",
        lambda: dict(canary_buf=torch.zeros(16, 16, dtype=torch.uint8)),
        ValueError,
        "canary_buf",
    ),
    (
        "canary_buf_ndim",
        lambda: dict(canary_buf=torch.zeros(16 * 32, dtype=torch.uint8)),
        ValueError,
        "canary_buf",
    ),
    (
        "canary_buf_no_rows",
        lambda: dict(canary_buf=torch.zeros(0, 32, dtype=torch.uint8)),
        ValueError,
        "canary_buf",
    ),
    (
        "canary_buf_noncontig",
        lambda: dict(canary_buf=torch.zeros(32, 32, dtype=torch.uint8)[::2]),
        ValueError,
        "canary_buf",
    ),
    ("kernel_kind_12", lambda: dict(kernel_kind=12), ValueError, "kernel_kind"),
    ("kernel_kind_negative", lambda: dict(kernel_kind=-1), ValueError, "kernel_kind"),
    (
        "violation_ring_dtype",
        lambda: dict(violation_ring=torch.zeros(8, 8, dtype=I32)),
        TypeError,
        "violation_ring",
    ),
    (
        "violation_ring_shape",
        lambda: dict(violation_ring=torch.zeros(8, 7, dtype=I64)),
        ValueError,
        "violation_ring",
    ),
    (
        "violation_ring_noncontig",
        lambda: dict(violation_ring=torch.zeros(16, 8, dtype=I64)[::2]),
        ValueError,
        "violation_ring",
    ),
    (
        "violation_write_index_dtype",
        lambda: dict(violation_write_index=torch.zeros(1, dtype=I64)),
        TypeError,
        "violation_write_index",
    ),
    (
        "violation_write_index_shape",
        lambda: dict(violation_write_index=torch.zeros(2, dtype=I32)),
        ValueError,
        "violation_write_index",
    ),
    (
        "slot_run_counter_dtype",
        lambda: dict(slot_run_counter=torch.zeros(1, dtype=I32)),
        TypeError,
        "slot_run_counter",
    ),
    (
        "slot_run_counter_shape",
        lambda: dict(slot_run_counter=torch.zeros(12, dtype=I64)),
        ValueError,
        "slot_run_counter",
    ),
    (
        "kernel_run_counter_dtype",
        lambda: dict(kernel_run_counter=torch.zeros(1)),
        TypeError,
        "kernel_run_counter",
    ),
    (
        "kernel_run_counter_shape",
        lambda: dict(kernel_run_counter=torch.zeros(1, 1, dtype=I64)),
        ValueError,
        "kernel_run_counter",
    ),
    (
        "chain_assert_dtype",
        lambda: dict(enable_chain_position_assert=torch.ones(1, dtype=torch.bool)),
        TypeError,
        "enable_chain_position_assert",
    ),
    (
        "chain_assert_shape",
        lambda: dict(enable_chain_position_assert=torch.ones(2, dtype=I32)),
        ValueError,
        "enable_chain_position_assert",
    ),
    (
        "five_sources",
        lambda: dict(
            real_kv_sources=[make_source() for _ in range(5)], real_kv_hash_mode=RealKvHashMode.ALL
        ),
        ValueError,
        "real_kv_sources",
    ),
    (
        "source_not_real_kv_source",
        lambda: dict(real_kv_sources=[torch.zeros(8, 32, dtype=torch.uint8)]),
        TypeError,
        "real_kv_sources[0]",
    ),
    (
        "source_too_small",
        lambda: dict(real_kv_sources=[make_source(), make_source(pages=4)]),
        ValueError,
        "real_kv_sources[1]",
    ),
    (
        "partial_without_sources",
        lambda: dict(real_kv_hash_mode=RealKvHashMode.PARTIAL),
        ValueError,
        "real_kv_hash_mode",
    ),
    (
        "all_without_sources",
        lambda: dict(real_kv_hash_mode=RealKvHashMode.ALL),
        ValueError,
        "real_kv_hash_mode",
    ),
    (
        "mode_out_of_range",
        lambda: dict(real_kv_hash_mode=3, real_kv_sources=[make_source()]),
        ValueError,
        "real_kv_hash_mode",
    ),
    (
        "device_violation_ring",
        lambda: dict(violation_ring=torch.zeros(8, 8, dtype=I64, device=META)),
        ValueError,
        "violation_ring",
    ),
    (
        "device_counter",
        lambda: dict(kernel_run_counter=torch.zeros(1, dtype=I64, device=META)),
        ValueError,
        "kernel_run_counter",
    ),
    (
        "device_chain_assert",
        lambda: dict(enable_chain_position_assert=torch.ones(1, dtype=I32, device=META)),
        ValueError,
        "enable_chain_position_assert",
    ),
]


@pytest.mark.parametrize(
    "over,exc,name", [c[1:] for c in CONTEXT_CASES], ids=[c[0] for c in CONTEXT_CASES]
)
def test_context_rejects(over, exc, name):
    with pytest.raises(exc, match=named(name)):
        VerifyOrWriteContext(**context_kwargs(**over()))


def test_context_errors_are_specific():
    with pytest.raises(ValueError, match=r"at most 4 sources, got 5"):
        make_context(real_kv_sources=[make_source() for _ in range(5)])
    with pytest.raises(
        ValueError,
        match=r"real_kv_sources\[1\] covers 8 slots but canary_buf "
        r"has 16",
    ):
        make_context(real_kv_sources=[make_source(), make_source(pages=4)])
    with pytest.raises(ValueError, match=r"real_kv_hash_mode=PARTIAL needs at least one"):
        make_context(real_kv_hash_mode=RealKvHashMode.PARTIAL)
    with pytest.raises(ValueError, match=r"kernel_kind must be a CanaryLaunchTag \(0\.\.11\)"):
        make_context(kernel_kind=12)
    with pytest.raises(TypeError, match=r"canary_buf must have dtype uint8"):
        make_context(canary_buf=torch.zeros(16, 32, dtype=torch.int8))


# =============================================================================================
# VerifyPlan / WritePlan
# =============================================================================================


@pytest.mark.parametrize(
    "value,exc",
    [(-1, ValueError), (2.5, TypeError), (True, TypeError), ("4", TypeError), (None, TypeError)],
)
def test_verify_plan_allocate_rejects(value, exc):
    with pytest.raises(exc, match="verify_capacity"):
        VerifyPlan.allocate(verify_capacity=value, device="cpu")


@pytest.mark.parametrize(
    "value,exc",
    [(-1, ValueError), (2.5, TypeError), (False, TypeError), ("4", TypeError), (None, TypeError)],
)
def test_write_plan_allocate_rejects(value, exc):
    with pytest.raises(exc, match="write_req_capacity"):
        WritePlan.allocate(write_req_capacity=value, device="cpu")


def _verify_plan_fields(cap=4, **over):
    kw = dict(
        verify_slot_indices=torch.zeros(cap, dtype=I64),
        verify_expected_tokens=torch.zeros(cap, dtype=I64),
        verify_expected_positions=torch.zeros(cap, dtype=I64),
        verify_prev_slot_indices=torch.zeros(cap, dtype=I64),
        verify_req_to_token_rows=torch.zeros(cap, dtype=I64),
        verify_num_valid=torch.zeros(1, dtype=I32),
        enable=torch.zeros(1, dtype=I32),
    )
    kw.update(over)
    return kw


def _write_plan_fields(cap=4, **over):
    kw = dict(
        write_offsets=torch.zeros(cap + 1, dtype=I64),
        write_seed_slot_indices=torch.zeros(cap, dtype=I64),
        write_req_to_token_rows=torch.zeros(cap, dtype=I64),
        write_num_valid_reqs=torch.zeros(1, dtype=I32),
        verify_req_offsets=torch.zeros(cap + 1, dtype=I64),
    )
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over,exc,name",
    [
        (
            dict(verify_expected_tokens=torch.zeros(5, dtype=I64)),
            ValueError,
            "verify_expected_tokens",
        ),
        (
            dict(verify_prev_slot_indices=torch.zeros(4, dtype=I32)),
            TypeError,
            "verify_prev_slot_indices",
        ),
        (dict(verify_slot_indices=torch.zeros(4, 1, dtype=I64)), ValueError, "verify_slot_indices"),
        (
            dict(verify_expected_positions=noncontig(torch.zeros(4, dtype=I64))),
            ValueError,
            "verify_expected_positions",
        ),
        (dict(verify_num_valid=torch.zeros(1, dtype=I64)), TypeError, "verify_num_valid"),
        (dict(enable=torch.zeros(2, dtype=I32)), ValueError, "enable"),
        (dict(enable=torch.zeros(1, dtype=I32, device=META)), ValueError, "enable"),
    ],
    ids=[
        "tokens_capacity",
        "prev_dtype",
        "slots_ndim",
        "positions_noncontig",
        "num_valid_dtype",
        "enable_shape",
        "enable_device",
    ],
)
def test_verify_plan_fields_rejected(over, exc, name):
    VerifyPlan(**_verify_plan_fields())  # baseline
    with pytest.raises(exc, match=named(name)):
        VerifyPlan(**_verify_plan_fields(**over))


@pytest.mark.parametrize(
    "over,exc,name",
    [
        (dict(write_offsets=torch.zeros(4, dtype=I64)), ValueError, "write_offsets"),
        (
            dict(write_seed_slot_indices=torch.zeros(4, dtype=I32)),
            TypeError,
            "write_seed_slot_indices",
        ),
        (dict(write_num_valid_reqs=torch.zeros(1, dtype=I64)), TypeError, "write_num_valid_reqs"),
        (dict(verify_req_offsets=torch.zeros(3, dtype=I64)), ValueError, "verify_req_offsets"),
        (dict(write_offsets=torch.zeros(5, dtype=I64, device=META)), ValueError, "write_offsets"),
    ],
    ids=[
        "offsets_shape",
        "seeds_dtype",
        "num_valid_dtype",
        "verify_offsets_shape",
        "offsets_device",
    ],
)
def test_write_plan_fields_rejected(over, exc, name):
    WritePlan(**_write_plan_fields())  # baseline
    with pytest.raises(exc, match=named(name)):
        WritePlan(**_write_plan_fields(**over))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
