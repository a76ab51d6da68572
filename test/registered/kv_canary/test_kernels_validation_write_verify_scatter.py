"""Bad input for the KV-canary write, verify and scatter launchers (docs/architecture.md,
"Plans", "Token-id scatter" and "Kernel rules"; the accepted baselines, the plan launcher,
keyword-only calls and unsupported devices: ``test_kernels_validation.py``; the accepted calls
both files change: ``launcher_cases.py``).

Each case changes one argument of an accepted call; the error must be a ``TypeError`` (wrong
type / dtype) or ``ValueError`` (shape, contiguity, missing expected tensors, device) whose
message names the argument, and nothing is written or counted. Cases run against both the
public launcher and its torch reference, on CPU tensors (plus ``meta`` tensors as the "other
device"), with or without a GPU.
"""

from __future__ import annotations

import sys

import pytest
import torch

from launcher_cases import (  # noqa: F401  (launchers_fixture: the ``launchers`` fixture)
    launchers_fixture,
    scatter_kwargs,
    verify_kwargs,
    write_kwargs,
)
from sglang.jit_kernel.kv_canary import VerifyOrWriteContext, VerifyPlan, WritePlan
from sglang.test.ci.ci_register import register_cpu_ci
from validation_cases import CPU, META, I64, I32, noncontig, named

register_cpu_ci(est_time=1, suite="stage-a-test-cpu")


# =============================================================================================
# Write launcher
# =============================================================================================

WRITE_CASES = [
    ("context_type", lambda: dict(context=object()), TypeError, "context"),
    (
        "plan_type",
        lambda: dict(plan=VerifyPlan.allocate(verify_capacity=2, device=CPU)),
        TypeError,
        "plan",
    ),
    (
        "input_assert_int",
        lambda: dict(enable_write_input_assert=1),
        TypeError,
        "enable_write_input_assert",
    ),
    (
        "input_assert_none",
        lambda: dict(enable_write_input_assert=None),
        TypeError,
        "enable_write_input_assert",
    ),
    (
        "input_assert_tensor",
        lambda: dict(enable_write_input_assert=torch.tensor(True)),
        TypeError,
        "enable_write_input_assert",
    ),
    ("input_ids_not_tensor", lambda: dict(input_ids=[5, 6, 7]), TypeError, "input_ids"),
    (
        "input_ids_dtype",
        lambda: dict(input_ids=torch.tensor([5.0, 6.0, 7.0])),
        TypeError,
        "input_ids",
    ),
    ("input_ids_ndim", lambda: dict(input_ids=torch.tensor([[5, 6, 7]])), ValueError, "input_ids"),
    (
        "input_ids_noncontig",
        lambda: dict(input_ids=noncontig(torch.tensor([5, 6, 7]))),
        ValueError,
        "input_ids",
    ),
    (
        "positions_dtype",
        lambda: dict(positions=torch.tensor([0, 1, 2], dtype=torch.int16)),
        TypeError,
        "positions",
    ),
    ("positions_shape", lambda: dict(positions=torch.tensor([0, 1])), ValueError, "positions"),
    (
        "positions_noncontig",
        lambda: dict(positions=noncontig(torch.tensor([0, 1, 2]))),
        ValueError,
        "positions",
    ),
    (
        "out_cache_loc_dtype",
        lambda: dict(out_cache_loc=torch.tensor([1.0, 2.0, 3.0])),
        TypeError,
        "out_cache_loc",
    ),
    (
        "out_cache_loc_shape",
        lambda: dict(out_cache_loc=torch.tensor([1, 2, 3, 4])),
        ValueError,
        "out_cache_loc",
    ),
    (
        "out_cache_loc_noncontig",
        lambda: dict(out_cache_loc=noncontig(torch.tensor([1, 2, 3]))),
        ValueError,
        "out_cache_loc",
    ),
    (
        "expected_tokens_missing",
        lambda: dict(
            enable_write_input_assert=True, expected_input_positions=torch.tensor([0, 1, 2])
        ),
        ValueError,
        "expected_input_tokens",
    ),
    (
        "expected_positions_missing",
        lambda: dict(enable_write_input_assert=True, expected_input_tokens=torch.tensor([5, 6, 7])),
        ValueError,
        "expected_input_positions",
    ),
    (
        "expected_tokens_shape",
        lambda: dict(
            enable_write_input_assert=True,
            expected_input_tokens=torch.tensor([5, 6]),
            expected_input_positions=torch.tensor([0, 1, 2]),
        ),
        ValueError,
        "expected_input_tokens",
    ),
    (
        "expected_tokens_dtype",
        lambda: dict(
            enable_write_input_assert=True,
            expected_input_tokens=torch.tensor([5.0, 6.0, 7.0]),
            expected_input_positions=torch.tensor([0, 1, 2]),
        ),
        TypeError,
        "expected_input_tokens",
    ),
    (
        "expected_positions_noncontig",
        lambda: dict(
            enable_write_input_assert=True,
            expected_input_tokens=torch.tensor([5, 6, 7]),
            expected_input_positions=noncontig(torch.tensor([0, 1, 2])),
        ),
        ValueError,
        "expected_input_positions",
    ),
    (
        "device_positions",
        lambda: dict(positions=torch.zeros(3, dtype=I64, device=META)),
        ValueError,
        "positions",
    ),
    (
        "device_out_cache_loc",
        lambda: dict(out_cache_loc=torch.zeros(3, dtype=I64, device=META)),
        ValueError,
        "out_cache_loc",
    ),
    (
        "device_plan",
        lambda: dict(plan=WritePlan.allocate(write_req_capacity=2, device=META)),
        ValueError,
        "plan",
    ),
    (
        "device_expected_tokens",
        lambda: dict(
            enable_write_input_assert=True,
            expected_input_tokens=torch.zeros(3, dtype=I64, device=META),
            expected_input_positions=torch.tensor([0, 1, 2]),
        ),
        ValueError,
        "expected_input_tokens",
    ),
]


@pytest.mark.parametrize(
    "over,exc,name", [c[1:] for c in WRITE_CASES], ids=[c[0] for c in WRITE_CASES]
)
def test_write_rejects(launchers, over, exc, name):
    kw = write_kwargs(**over())
    ctx = kw["context"]
    with pytest.raises(exc, match=named(name)):
        launchers["write"](**kw)
    if isinstance(ctx, VerifyOrWriteContext):  # nothing ran
        assert int(ctx.kernel_run_counter[0]) == 0
        assert not ctx.canary_buf.any()


def test_write_errors_are_specific(launchers):
    with pytest.raises(
        ValueError, match=r"expected_input_tokens is required when enable_write_input_assert"
    ):
        launchers["write"](**write_kwargs(enable_write_input_assert=True))
    with pytest.raises(TypeError, match=r"plan must be a WritePlan"):
        launchers["write"](**write_kwargs(plan=VerifyPlan.allocate(verify_capacity=2, device=CPU)))
    with pytest.raises(TypeError, match=r"context must be a VerifyOrWriteContext"):
        launchers["write"](**write_kwargs(context=None))
    # expected tensors are ignored (not validated) while the input assert is off
    launchers["write"](
        **write_kwargs(expected_input_tokens=torch.zeros(1), expected_input_positions=None)
    )


# =============================================================================================
# Verify launcher
# =============================================================================================

VERIFY_CASES = [
    ("context_type", lambda: dict(context="ctx"), TypeError, "context"),
    (
        "plan_type",
        lambda: dict(plan=WritePlan.allocate(write_req_capacity=2, device=CPU)),
        TypeError,
        "plan",
    ),
    ("plan_none", lambda: dict(plan=None), TypeError, "plan"),
    (
        "check_token_int",
        lambda: dict(check_verify_expected_token=1),
        TypeError,
        "check_verify_expected_token",
    ),
    (
        "check_token_none",
        lambda: dict(check_verify_expected_token=None),
        TypeError,
        "check_verify_expected_token",
    ),
    (
        "check_token_tensor",
        lambda: dict(check_verify_expected_token=torch.tensor(False)),
        TypeError,
        "check_verify_expected_token",
    ),
    (
        "device_plan",
        lambda: dict(plan=VerifyPlan.allocate(verify_capacity=4, device=META)),
        ValueError,
        "plan",
    ),
]


@pytest.mark.parametrize(
    "over,exc,name", [c[1:] for c in VERIFY_CASES], ids=[c[0] for c in VERIFY_CASES]
)
def test_verify_rejects(launchers, over, exc, name):
    kw = verify_kwargs(**over())
    ctx = kw["context"]
    with pytest.raises(exc, match=named(name)):
        launchers["verify"](**kw)
    if isinstance(ctx, VerifyOrWriteContext):
        assert int(ctx.kernel_run_counter[0]) == 0


def test_verify_errors_are_specific(launchers):
    with pytest.raises(TypeError, match=r"plan must be a VerifyPlan"):
        launchers["verify"](
            **verify_kwargs(plan=WritePlan.allocate(write_req_capacity=2, device=CPU))
        )
    with pytest.raises(ValueError, match=r"plan is on meta.*canary_buf is on cpu"):
        launchers["verify"](
            **verify_kwargs(plan=VerifyPlan.allocate(verify_capacity=4, device=META))
        )


# =============================================================================================
# Scatter launcher
# =============================================================================================

SCATTER_CASES = [
    ("flat_in_not_tensor", lambda: dict(flat_in=[1, 2, 3]), TypeError, "flat_in"),
    (
        "flat_in_dtype",
        lambda: dict(flat_in=torch.tensor([1, 2, 3], dtype=I32)),
        TypeError,
        "flat_in",
    ),
    ("flat_in_ndim", lambda: dict(flat_in=torch.tensor([[1, 2, 3]])), ValueError, "flat_in"),
    (
        "flat_in_noncontig",
        lambda: dict(flat_in=noncontig(torch.tensor([1, 2, 3]))),
        ValueError,
        "flat_in",
    ),
    (
        "offsets_dtype",
        lambda: dict(offsets=torch.tensor([0, 2, 3], dtype=I32)),
        TypeError,
        "offsets",
    ),
    ("offsets_shape", lambda: dict(offsets=torch.tensor([0, 3])), ValueError, "offsets"),
    (
        "offsets_noncontig",
        lambda: dict(offsets=noncontig(torch.tensor([0, 2, 3]))),
        ValueError,
        "offsets",
    ),
    (
        "req_pool_indices_dtype",
        lambda: dict(req_pool_indices=torch.tensor([1, 2], dtype=I32)),
        TypeError,
        "req_pool_indices",
    ),
    (
        "req_pool_indices_ndim",
        lambda: dict(req_pool_indices=torch.tensor([[1, 2]])),
        ValueError,
        "req_pool_indices",
    ),
    ("pool_out_dtype", lambda: dict(pool_out=torch.zeros(3, 4, dtype=I64)), TypeError, "pool_out"),
    ("pool_out_ndim", lambda: dict(pool_out=torch.zeros(12, dtype=I32)), ValueError, "pool_out"),
    (
        "pool_out_noncontig",
        lambda: dict(pool_out=torch.zeros(4, 3, dtype=I32).t()),
        ValueError,
        "pool_out",
    ),
    (
        "device_pool_out",
        lambda: dict(pool_out=torch.zeros(3, 4, dtype=I32, device=META)),
        ValueError,
        "pool_out",
    ),
    (
        "device_offsets",
        lambda: dict(offsets=torch.zeros(3, dtype=I64, device=META)),
        ValueError,
        "offsets",
    ),
    (
        "dst_starts_dtype",
        lambda: dict(dst_starts=torch.tensor([0, 1], dtype=I32)),
        TypeError,
        "dst_starts",
    ),
    (
        "dst_starts_shape",
        lambda: dict(dst_starts=torch.tensor([0, 1, 2], dtype=I64)),
        ValueError,
        "dst_starts",
    ),
    ("dst_starts_type", lambda: dict(dst_starts=[0, 1]), TypeError, "dst_starts"),
    (
        "device_dst_starts",
        lambda: dict(dst_starts=torch.zeros(2, dtype=I64, device=META)),
        ValueError,
        "dst_starts",
    ),
]


@pytest.mark.parametrize(
    "over,exc,name", [c[1:] for c in SCATTER_CASES], ids=[c[0] for c in SCATTER_CASES]
)
def test_scatter_rejects(launchers, over, exc, name):
    kw = scatter_kwargs(**over())
    pool = kw["pool_out"]
    snapshot = pool.clone() if pool.device == CPU else None
    with pytest.raises(exc, match=named(name)):
        launchers["scatter"](**kw)
    if snapshot is not None:
        assert torch.equal(pool, snapshot)


def test_scatter_errors_are_specific(launchers):
    with pytest.raises(TypeError, match=r"pool_out must have dtype int32"):
        launchers["scatter"](**scatter_kwargs(pool_out=torch.zeros(3, 4, dtype=I64)))
    with pytest.raises(TypeError, match=r"flat_in must have dtype int64"):
        launchers["scatter"](**scatter_kwargs(flat_in=torch.tensor([1, 2, 3], dtype=I32)))
    with pytest.raises(ValueError, match=r"offsets must have shape \(3,\)"):
        launchers["scatter"](**scatter_kwargs(offsets=torch.tensor([0, 3])))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
