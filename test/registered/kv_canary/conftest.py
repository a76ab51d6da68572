"""pytest set-up for the KV-canary suites.

Without a GPU, the Triton kernels run in Triton's interpreter on CPU tensors: TRITON_INTERPRET
must be set before any kernel module is imported (Triton reads it when a kernel is decorated),
so it is set here, at conftest import. With a GPU the kernels run compiled on CUDA tensors.
Without one, each worker's torch runs one thread.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # CI runs two workers on two cores, beside the servers they start (one OpenMP thread each:
    # demo/server_harness.py): a worker's own torch ops on small tensors gain nothing from a
    # second thread, whose team would wait, spinning, on a core another process holds
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

from kernel_oracle import IMPLS, make_impl  # noqa: E402  (imports the kernels: after the above)


def _registered_cpu_seconds(path: str) -> float:
    """A test file's ``register_cpu_ci(est_time=...)``, read by sglang's own parser (0 if it
    has none)."""
    from sglang.test.ci.ci_register import HWBackend, ut_parse_one_file

    registrations, _ = ut_parse_one_file(path)
    return max((r.est_time for r in registrations if r.backend == HWBackend.CPU), default=0.0)


def pytest_collection_modifyitems(config, items):
    # The longest files first (their registered est_time; each file's tests in pytest's order,
    # the files of equal time in collection order): xdist's file-at-a-time scheduling, told
    # not to reorder by test count (--no-loadscope-reorder in addopts), then hands the short
    # files out last, and no long file starts when the other worker is nearly done.
    seconds: dict = {}
    for item in items:
        path = str(item.path)
        if path not in seconds:
            seconds[path] = _registered_cpu_seconds(path)
    items.sort(key=lambda item: -seconds[str(item.path)])
    if HAS_CUDA:
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture
def device() -> torch.device:
    """Where the Triton kernels under test run: CUDA when present, else CPU (interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def reference_kernels_on_cpu(request, monkeypatch):
    """Serve CPU tensors with the torch references, as a CPU sglang server does (no
    TRITON_INTERPRET there); the interpreter is for the kernel suites, which byte-compare the
    Triton kernels with these references. A test marked ``triton_interpreter`` keeps the
    canary's Triton kernels (interpreted) at its call sites: one such test per suite that
    otherwise runs the references. sglang's own Triton kernels stay interpreted either way. No
    effect on CUDA."""
    if request.node.get_closest_marker("triton_interpreter") is not None:
        return
    from sglang.jit_kernel.kv_canary import _launch

    monkeypatch.setattr(_launch, "TRITON_INTERPRET", False)


@pytest.fixture(params=IMPLS)
def impl(request, device, monkeypatch):
    """The hand-checked kernel suites' implementation under test: the Triton kernels, then the
    torch references (``kernel_oracle.make_impl``)."""
    return make_impl(request.param, device, monkeypatch)
