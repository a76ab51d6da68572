"""The launchers' accepted calls that the KV-canary launcher validation tests change one
argument of, and the ``launchers`` fixture that runs each case against both the public launcher
and its torch reference (``test_kernels_validation.py``: the baselines, the plan launcher,
keyword-only calls and devices; ``test_kernels_validation_write_verify_scatter.py``: the write,
verify and scatter launchers). Validation reads metadata only: every call is on CPU tensors."""

from __future__ import annotations

from typing import Callable, Dict

import pytest
import torch

from sglang.jit_kernel.kv_canary import (
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel,
    launch_canary_write_kernel_torch_reference,
    launch_scatter_req_token_ids_kernel,
    scatter_req_token_ids_torch_reference,
)
from validation_cases import CPU, I64, I32, make_context


LAUNCHERS: Dict[str, Dict[str, Callable]] = {
    "public": dict(
        plan=launch_canary_plan_kernels,
        write=launch_canary_write_kernel,
        verify=launch_canary_verify_kernel,
        scatter=launch_scatter_req_token_ids_kernel,
    ),
    "torch_ref": dict(
        plan=launch_canary_plan_kernels_torch_reference,
        write=launch_canary_write_kernel_torch_reference,
        verify=launch_canary_verify_kernel_torch_reference,
        scatter=scatter_req_token_ids_torch_reference,
    ),
}


# named apart from the fixture, so the test files that import it can take ``launchers``
@pytest.fixture(params=sorted(LAUNCHERS), name="launchers")
def launchers_fixture(request):
    return LAUNCHERS[request.param]


def plan_kwargs(**over):
    kw = dict(
        verify_plan_out=VerifyPlan.allocate(verify_capacity=16, device=CPU),
        write_plan_out=WritePlan.allocate(write_req_capacity=4, device=CPU),
        req_pool_indices=torch.tensor([1, 2], dtype=I64),
        prefix_lens=torch.tensor([1, 2], dtype=I32),
        extend_seq_lens=torch.tensor([1, 1], dtype=I64),
        req_to_token=torch.arange(1, 25, dtype=I32).reshape(3, 8),
        swa_window_size=0,
        full_to_swa_index_mapping=None,
        verify_capacity=16,
        req_to_verify_expected_tokens=None,
        req_to_verify_expected_tokens_valid_lens=None,
        kv_token_id_vs_position_offset=0,
    )
    kw.update(over)
    return kw


def write_kwargs(**over):
    kw = dict(
        context=make_context(),
        plan=WritePlan.allocate(write_req_capacity=2, device=CPU),
        input_ids=torch.tensor([5, 6, 7], dtype=I64),
        positions=torch.tensor([0, 1, 2], dtype=I64),
        out_cache_loc=torch.tensor([1, 2, 3], dtype=I64),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    kw.update(over)
    return kw


def verify_kwargs(**over):
    kw = dict(
        context=make_context(),
        plan=VerifyPlan.allocate(verify_capacity=4, device=CPU),
        check_verify_expected_token=False,
    )
    kw.update(over)
    return kw


def scatter_kwargs(**over):
    kw = dict(
        flat_in=torch.tensor([1, 2, 3], dtype=I64),
        offsets=torch.tensor([0, 2, 3], dtype=I64),
        req_pool_indices=torch.tensor([1, 2], dtype=I64),
        pool_out=torch.zeros(3, 4, dtype=I32),
    )
    kw.update(over)
    return kw
