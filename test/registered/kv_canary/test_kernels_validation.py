"""Bad input for the KV-canary launchers (docs/architecture.md, "Plans", "Token-id scatter" and
"Kernel rules"; the constructors of sources, contexts and plans:
``test_kernel_types_validation.py``): the accepted baselines, the plan launcher, keyword-only
calls and unsupported devices (the write, verify and scatter launchers:
``test_kernels_validation_write_verify_scatter.py``; the accepted calls and the ``launchers``
fixture the two files share: ``launcher_cases.py``).

Each case starts from a baseline that is accepted (``test_baselines_are_accepted``) and changes
one argument; the error must be a ``TypeError`` (wrong type / dtype) or ``ValueError`` (shape,
contiguity, capacity, missing SWA table or expected lengths, device) whose message names the
argument. Launcher cases run against both the public launcher and its torch reference.
Validation reads metadata only, so every case runs on CPU tensors (plus ``meta`` tensors as the
"other device"), with or without a GPU.
"""

from __future__ import annotations

import sys

import pytest
import torch

from launcher_cases import (  # noqa: F401  (launchers_fixture: the ``launchers`` fixture)
    launchers_fixture,
    plan_kwargs,
    scatter_kwargs,
    verify_kwargs,
    write_kwargs,
)
from sglang.jit_kernel.kv_canary import (
    CanaryLaunchTag,
    RealKvHashMode,
    RealKvSource,
    VerifyPlan,
    WritePlan,
    launch_canary_verify_kernel,
    launch_scatter_req_token_ids_kernel,
)
from sglang.test.ci.ci_register import register_cpu_ci
from validation_cases import (
    CPU,
    META,
    I64,
    I32,
    noncontig,
    named,
    make_source,
    make_context,
)

register_cpu_ci(est_time=1, suite="stage-a-test-cpu")


def test_baselines_are_accepted(launchers):
    """Every negative case below differs from these accepted calls in one argument."""
    launchers["plan"](**plan_kwargs())
    launchers["plan"](
        **plan_kwargs(swa_window_size=2, full_to_swa_index_mapping=torch.arange(32, dtype=I64))
    )
    launchers["plan"](
        **plan_kwargs(
            req_to_verify_expected_tokens=torch.zeros(3, 8, dtype=I32),
            req_to_verify_expected_tokens_valid_lens=torch.tensor([1, 2], dtype=I64),
        )
    )
    kw = write_kwargs()
    launchers["write"](**kw)
    assert int(kw["context"].kernel_run_counter[0]) == 1
    launchers["write"](
        **write_kwargs(
            enable_write_input_assert=True,
            expected_input_tokens=torch.tensor([5, 6, 7], dtype=I32),
            expected_input_positions=torch.tensor([0, 1, 2], dtype=I32),
        )
    )
    kw = verify_kwargs()
    launchers["verify"](**kw)
    assert int(kw["context"].kernel_run_counter[0]) == 1
    kw = scatter_kwargs()
    launchers["scatter"](**kw)
    assert kw["pool_out"].tolist() == [[0, 0, 0, 0], [1, 2, 0, 0], [3, 0, 0, 0]]
    kw = scatter_kwargs(dst_starts=torch.tensor([2, 1], dtype=I64))
    launchers["scatter"](**kw)
    assert kw["pool_out"].tolist() == [[0, 0, 0, 0], [0, 0, 1, 2], [0, 3, 0, 0]]


def test_constructor_baselines_are_accepted():
    ctx = make_context(
        kernel_kind=3,
        real_kv_sources=[make_source(), make_source(nbpt=8, read_bytes=8)],
        real_kv_hash_mode=1,
        enable_chain_position_assert=None,
    )
    assert ctx.kernel_kind is CanaryLaunchTag.TAIL_V_FULL
    assert ctx.real_kv_hash_mode is RealKvHashMode.PARTIAL
    assert isinstance(ctx.real_kv_sources, tuple) and len(ctx.real_kv_sources) == 2
    assert ctx.enable_chain_position_assert.dtype == I32
    assert ctx.enable_chain_position_assert.tolist() == [0]
    # rows with padding between them (row stride > row bytes) are fine
    big = torch.zeros(4, 64, dtype=torch.uint8)
    RealKvSource(tensor=big[:, :48], page_size=2, num_bytes_per_token=24, read_bytes=16)
    RealKvSource(
        tensor=torch.zeros(4, 2, 12, dtype=torch.bfloat16),
        page_size=2,
        num_bytes_per_token=24,
        read_bytes=24,
    )
    make_context(real_kv_sources=[make_source()] * 4, real_kv_hash_mode=RealKvHashMode.ALL)
    assert VerifyPlan.allocate(verify_capacity=0, device="cpu").capacity == 0
    assert WritePlan.allocate(write_req_capacity=0, device="cpu").req_capacity == 0


# =============================================================================================
# Plan launcher
# =============================================================================================

PLAN_CASES = [
    ("verify_plan_out_type", lambda: dict(verify_plan_out=object()), TypeError, "verify_plan_out"),
    (
        "verify_plan_out_is_write_plan",
        lambda: dict(verify_plan_out=WritePlan.allocate(write_req_capacity=16, device=CPU)),
        TypeError,
        "verify_plan_out",
    ),
    (
        "write_plan_out_type",
        lambda: dict(write_plan_out=VerifyPlan.allocate(verify_capacity=4, device=CPU)),
        TypeError,
        "write_plan_out",
    ),
    (
        "req_pool_indices_not_tensor",
        lambda: dict(req_pool_indices=[1, 2]),
        TypeError,
        "req_pool_indices",
    ),
    (
        "req_pool_indices_dtype",
        lambda: dict(req_pool_indices=torch.tensor([1.0, 2.0])),
        TypeError,
        "req_pool_indices",
    ),
    (
        "req_pool_indices_ndim",
        lambda: dict(req_pool_indices=torch.tensor([[1, 2]])),
        ValueError,
        "req_pool_indices",
    ),
    (
        "req_pool_indices_noncontig",
        lambda: dict(req_pool_indices=noncontig(torch.tensor([1, 2]))),
        ValueError,
        "req_pool_indices",
    ),
    (
        "prefix_lens_dtype",
        lambda: dict(prefix_lens=torch.tensor([1, 2], dtype=torch.int16)),
        TypeError,
        "prefix_lens",
    ),
    (
        "prefix_lens_shape",
        lambda: dict(prefix_lens=torch.tensor([1, 2, 3])),
        ValueError,
        "prefix_lens",
    ),
    (
        "prefix_lens_noncontig",
        lambda: dict(prefix_lens=noncontig(torch.tensor([1, 2]))),
        ValueError,
        "prefix_lens",
    ),
    (
        "extend_seq_lens_dtype",
        lambda: dict(extend_seq_lens=torch.tensor([1.0, 1.0])),
        TypeError,
        "extend_seq_lens",
    ),
    (
        "extend_seq_lens_shape",
        lambda: dict(extend_seq_lens=torch.tensor([1])),
        ValueError,
        "extend_seq_lens",
    ),
    (
        "extend_seq_lens_noncontig",
        lambda: dict(extend_seq_lens=noncontig(torch.tensor([1, 1]))),
        ValueError,
        "extend_seq_lens",
    ),
    ("req_to_token_dtype", lambda: dict(req_to_token=torch.zeros(3, 8)), TypeError, "req_to_token"),
    (
        "req_to_token_ndim",
        lambda: dict(req_to_token=torch.zeros(24, dtype=I32)),
        ValueError,
        "req_to_token",
    ),
    (
        "req_to_token_noncontig",
        lambda: dict(req_to_token=torch.zeros(8, 3, dtype=I32).t()),
        ValueError,
        "req_to_token",
    ),
    ("swa_window_size_negative", lambda: dict(swa_window_size=-1), ValueError, "swa_window_size"),
    ("swa_window_size_bool", lambda: dict(swa_window_size=True), TypeError, "swa_window_size"),
    ("swa_window_size_float", lambda: dict(swa_window_size=2.0), TypeError, "swa_window_size"),
    (
        "swa_window_size_tensor",
        lambda: dict(swa_window_size=torch.tensor(2)),
        TypeError,
        "swa_window_size",
    ),
    (
        "swa_window_without_table",
        lambda: dict(swa_window_size=4),
        ValueError,
        "full_to_swa_index_mapping",
    ),
    (
        "table_without_window",
        lambda: dict(full_to_swa_index_mapping=torch.arange(32)),
        ValueError,
        "full_to_swa_index_mapping",
    ),
    (
        "table_dtype",
        lambda: dict(swa_window_size=4, full_to_swa_index_mapping=torch.zeros(32)),
        TypeError,
        "full_to_swa_index_mapping",
    ),
    (
        "table_ndim",
        lambda: dict(swa_window_size=4, full_to_swa_index_mapping=torch.zeros(4, 8, dtype=I64)),
        ValueError,
        "full_to_swa_index_mapping",
    ),
    (
        "table_noncontig",
        lambda: dict(swa_window_size=4, full_to_swa_index_mapping=noncontig(torch.arange(32))),
        ValueError,
        "full_to_swa_index_mapping",
    ),
    ("verify_capacity_mismatch", lambda: dict(verify_capacity=8), ValueError, "verify_capacity"),
    ("verify_capacity_type", lambda: dict(verify_capacity=16.0), TypeError, "verify_capacity"),
    ("verify_capacity_negative", lambda: dict(verify_capacity=-1), ValueError, "verify_capacity"),
    (
        "bs_over_write_capacity",
        lambda: dict(
            req_pool_indices=torch.tensor([1, 2, 1, 2, 1]),
            prefix_lens=torch.ones(5, dtype=I64),
            extend_seq_lens=torch.ones(5, dtype=I64),
        ),
        ValueError,
        "req_pool_indices",
    ),
    (
        "expected_tokens_dtype",
        lambda: dict(
            req_to_verify_expected_tokens=torch.zeros(3, 8, dtype=I64),
            req_to_verify_expected_tokens_valid_lens=torch.tensor([1, 2]),
        ),
        TypeError,
        "req_to_verify_expected_tokens",
    ),
    (
        "expected_tokens_ndim",
        lambda: dict(
            req_to_verify_expected_tokens=torch.zeros(24, dtype=I32),
            req_to_verify_expected_tokens_valid_lens=torch.tensor([1, 2]),
        ),
        ValueError,
        "req_to_verify_expected_tokens",
    ),
    (
        "expected_tokens_noncontig",
        lambda: dict(
            req_to_verify_expected_tokens=torch.zeros(8, 3, dtype=I32).t(),
            req_to_verify_expected_tokens_valid_lens=torch.tensor([1, 2]),
        ),
        ValueError,
        "req_to_verify_expected_tokens",
    ),
    (
        "expected_tokens_without_valid_lens",
        lambda: dict(req_to_verify_expected_tokens=torch.zeros(3, 8, dtype=I32)),
        ValueError,
        "req_to_verify_expected_tokens_valid_lens",
    ),
    (
        "valid_lens_shape",
        lambda: dict(
            req_to_verify_expected_tokens=torch.zeros(3, 8, dtype=I32),
            req_to_verify_expected_tokens_valid_lens=torch.tensor([1, 2, 3]),
        ),
        ValueError,
        "req_to_verify_expected_tokens_valid_lens",
    ),
    (
        "valid_lens_dtype",
        lambda: dict(
            req_to_verify_expected_tokens=torch.zeros(3, 8, dtype=I32),
            req_to_verify_expected_tokens_valid_lens=torch.tensor([1.0, 2.0]),
        ),
        TypeError,
        "req_to_verify_expected_tokens_valid_lens",
    ),
    (
        "token_offset_float",
        lambda: dict(kv_token_id_vs_position_offset=1.0),
        TypeError,
        "kv_token_id_vs_position_offset",
    ),
    (
        "token_offset_none",
        lambda: dict(kv_token_id_vs_position_offset=None),
        TypeError,
        "kv_token_id_vs_position_offset",
    ),
    (
        "device_req_to_token",
        lambda: dict(req_to_token=torch.zeros(3, 8, dtype=I32, device=META)),
        ValueError,
        "req_to_token",
    ),
    (
        "device_prefix_lens",
        lambda: dict(prefix_lens=torch.zeros(2, dtype=I32, device=META)),
        ValueError,
        "prefix_lens",
    ),
    (
        "device_verify_plan",
        lambda: dict(verify_plan_out=VerifyPlan.allocate(verify_capacity=16, device=META)),
        ValueError,
        "verify_plan_out",
    ),
    (
        "device_write_plan",
        lambda: dict(write_plan_out=WritePlan.allocate(write_req_capacity=4, device=META)),
        ValueError,
        "write_plan_out",
    ),
    (
        "device_table",
        lambda: dict(swa_window_size=4, full_to_swa_index_mapping=torch.arange(32, device=META)),
        ValueError,
        "full_to_swa_index_mapping",
    ),
    (
        "device_expected_tokens",
        lambda: dict(
            req_to_verify_expected_tokens=torch.zeros(3, 8, dtype=I32, device=META),
            req_to_verify_expected_tokens_valid_lens=torch.tensor([1, 2]),
        ),
        ValueError,
        "req_to_verify_expected_tokens",
    ),
]


@pytest.mark.parametrize(
    "over,exc,name", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES]
)
def test_plan_rejects(launchers, over, exc, name):
    kw = plan_kwargs(**over())
    before = (
        kw["write_plan_out"].write_offsets.clone()
        if isinstance(kw["write_plan_out"], WritePlan)
        and kw["write_plan_out"].write_offsets.device == CPU
        else None
    )
    with pytest.raises(exc, match=named(name)):
        launchers["plan"](**kw)
    if before is not None:  # validation happens before anything is written
        assert torch.equal(kw["write_plan_out"].write_offsets, before)


def test_plan_errors_are_specific(launchers):
    """The messages say what is wrong, not only which argument."""
    with pytest.raises(ValueError, match=r"swa_window_size=4 needs full_to_swa_index_mapping"):
        launchers["plan"](**plan_kwargs(swa_window_size=4))
    with pytest.raises(ValueError, match=r"verify_capacity=8 does not match .*16"):
        launchers["plan"](**plan_kwargs(verify_capacity=8))
    with pytest.raises(ValueError, match=r"batch size 5 .*req_pool_indices.* capacity 4"):
        launchers["plan"](
            **plan_kwargs(
                req_pool_indices=torch.ones(5, dtype=I64),
                prefix_lens=torch.ones(5, dtype=I64),
                extend_seq_lens=torch.ones(5, dtype=I64),
            )
        )
    with pytest.raises(TypeError, match=r"req_to_verify_expected_tokens must have dtype int32"):
        launchers["plan"](
            **plan_kwargs(
                req_to_verify_expected_tokens=torch.zeros(3, 8, dtype=I64),
                req_to_verify_expected_tokens_valid_lens=torch.tensor([1, 2]),
            )
        )
    with pytest.raises(ValueError, match=r"prefix_lens must have shape \(2,\)"):
        launchers["plan"](**plan_kwargs(prefix_lens=torch.ones(3, dtype=I64)))


# =============================================================================================
# Keyword-only launchers, unsupported devices
# =============================================================================================


def test_launchers_are_keyword_only(launchers):
    kw = plan_kwargs()
    with pytest.raises(TypeError, match="positional"):
        launchers["plan"](*kw.values())
    with pytest.raises(TypeError, match="positional"):
        launchers["plan"](
            kw["verify_plan_out"], **{k: v for k, v in kw.items() if k != "verify_plan_out"}
        )
    kw = write_kwargs()
    with pytest.raises(TypeError, match="positional"):
        launchers["write"](*kw.values())
    assert int(kw["context"].kernel_run_counter[0]) == 0
    kw = verify_kwargs()
    with pytest.raises(TypeError, match="positional"):
        launchers["verify"](kw["context"], kw["plan"], False)
    with pytest.raises(TypeError, match="positional"):
        launchers["verify"](kw["context"], plan=kw["plan"], check_verify_expected_token=False)
    assert int(kw["context"].kernel_run_counter[0]) == 0
    kw = scatter_kwargs()
    with pytest.raises(TypeError, match="positional"):
        launchers["scatter"](*kw.values())
    assert not kw["pool_out"].any()


def test_allocate_is_keyword_only():
    with pytest.raises(TypeError, match="positional"):
        VerifyPlan.allocate(4, "cpu")
    with pytest.raises(TypeError, match="positional"):
        WritePlan.allocate(4, "cpu")


def test_public_launchers_reject_unsupported_device():
    """All tensors on one device that is neither CUDA nor CPU: a clear ValueError."""
    ctx = make_context(device=META)
    with pytest.raises(ValueError, match=r"'cuda' and 'cpu'.*meta"):
        launch_canary_verify_kernel(
            context=ctx,
            plan=VerifyPlan.allocate(verify_capacity=4, device=META),
            check_verify_expected_token=False,
        )
    with pytest.raises(ValueError, match=r"'cuda' and 'cpu'.*meta"):
        launch_scatter_req_token_ids_kernel(
            flat_in=torch.zeros(3, dtype=I64, device=META),
            offsets=torch.zeros(3, dtype=I64, device=META),
            req_pool_indices=torch.zeros(2, dtype=I64, device=META),
            pool_out=torch.zeros(3, 4, dtype=I32, device=META),
        )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
