"""Piecewise CUDA graphs (sglang's default for prefill): the canary runs with them on.

sglang's ``PiecewiseCudaGraphRunner`` captures the layers (``model.model``) in pieces and
replays them from inside the outer ``model.forward``, which it calls with a copy of the batch
padded to its captured token count. The canary's launches stay eager around the replayed
pieces (``model.forward`` is wrapped on the instance, outside what torch.compile traces); its
inside ops read the batch ``ModelRunner.forward`` got, not the padded copy; and the
piecewise warm-up and capture forwards (dummy batches, outside any ``ModelRunner.forward``)
run no canary work. The real runner needs CUDA (torch.compile + CUDA graphs): its end-to-end
test is ``test_e2e_gpu.py::test_piecewise_cuda_graphs_on_run_clean``; here the same calls on
real pools and real ``ForwardBatch`` objects on the CPU."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from serving_driver import ServingDriver, stand_in_model_runner
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag
from sglang.srt.kv_canary import install, startup_checks, plugin, sglang_seam
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")

WINDOW = 12


def _driver(pool: str, **kw) -> ServingDriver:
    extra = dict(num_slots=640, num_swa_slots=400, swa_window=WINDOW) if pool == "swa" else {}
    return ServingDriver(seed=7, pool=pool, real_data="partial", **extra, **kw)


@pytest.mark.parametrize("pool", ["mha", "swa"])
def test_a_padded_piecewise_replay_is_checked_as_the_scheduler_sent_it(pool):
    """Every prefill calls the model with a copy padded past the canary's token capacity (a
    ``--piecewise-cuda-graph-max-tokens`` above the chunked prefill size captures such
    sizes): the canary serves clean and still catches a fault in a prefix, at the real
    slots."""
    probe = _driver(pool)
    pad = probe.capacities.write_entry_capacity + 40
    d = _driver(pool, piecewise_pad_to=pad)
    d.run(80)
    d.settle()
    assert d.manager.count_violations() == 0
    state = d.manager.state
    assert int(state.kernel_run_counters[CanaryLaunchTag.TAIL_K_FULL]) > 0
    # the padding rows (slot 0: sglang's padding slot) got no record: only real slots did
    k_tail = d.groups[0].k_tail
    assert not bool(k_tail[0].any()), "the padded copy's slot 0 was written as a request's"
    info = d.fault_swap_req_to_token()
    report = d.report_within(3)
    assert "kv_canary detected KV-cache corruption" in report
    assert f"slot_idx={info['new_slot']} " in report, report[:400]


def _runner_with_canary():
    pool = MHATokenToKVPool(
        size=63,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    runner = stand_in_model_runner(
        pool, req_to_token=torch.zeros((8, 32), dtype=torch.int32), context_len=32
    )
    server_args = types.SimpleNamespace(
        kv_canary="raise",
        kv_canary_sweep_interval=0,
        kv_canary_real_data="partial",
        device="cpu",
        disable_piecewise_cuda_graph=False,
        enable_torch_compile=False,
        chunked_prefill_size=16,
        max_prefill_tokens=32,
        cuda_graph_max_bs=4,
        sampling_backend="pytorch",
    )
    manager = install.install_canary(server_args=server_args, model_runner=runner)
    return runner, manager


def _dummy_capture_batch(runner, num_tokens: int) -> ForwardBatch:
    """What sglang's piecewise ``warmup_compile`` / ``capture_one_batch_size`` hand the model:
    one request of ``num_tokens`` from row 0, slots from a zeroed buffer."""
    z = torch.zeros(num_tokens, dtype=torch.int64)
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=z,
        req_pool_indices=torch.zeros(1, dtype=torch.int64),
        seq_lens=torch.tensor([num_tokens]),
        out_cache_loc=z.clone(),
        seq_lens_sum=num_tokens,
        positions=z.clone(),
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool=runner.token_to_kv_pool,
    )
    fb.extend_prefix_lens = torch.zeros(1, dtype=torch.int64)
    fb.extend_seq_lens = torch.tensor([num_tokens])
    return fb


def test_piecewise_set_up_forwards_run_no_canary_work():
    """The plugin's ``ModelRunner.init_piecewise_cuda_graphs`` hook: the set-up's forwards
    (dummy batches, no ``ModelRunner.forward`` around them) pass through the wrapped
    ``model.forward`` without a launch. Without the hook the same call is refused (no
    single-forward manager is active), which is what a piecewise-on server hit before."""
    runner, manager = _runner_with_canary()
    counters = manager.state.kernel_run_counters

    def init_piecewise(self):  # sglang's set-up: warm-up, then capture, per token count
        for n in (4, 8):
            for _ in range(2):
                self.model.forward(torch.zeros(n), torch.zeros(n), _dummy_capture_batch(self, n))
        return "captured"

    assert plugin._init_piecewise_cuda_graphs(init_piecewise, runner) == "captured"
    assert int(counters.sum()) == 0
    assert manager.count_violations() == 0
    with pytest.raises(RuntimeError, match="no single-forward manager is active"):
        init_piecewise(runner)


def test_piecewise_set_up_inside_a_forward_is_refused():
    runner, manager = _runner_with_canary()
    with manager.with_active_single_forward_manager(0):
        with pytest.raises(RuntimeError, match="piecewise CUDA-graph set-up inside a forward"):
            with manager.piecewise_graph_setup():
                pass


def test_the_piecewise_hook_is_registered_on_sglangs_model_runner():
    from sglang.srt.model_executor.model_runner import ModelRunner

    target = sglang_seam.HOOK_MODEL_RUNNER_INIT_PIECEWISE_CUDA_GRAPHS
    assert target.rsplit(".", 1)[1] in vars(ModelRunner)
    assert (target, plugin._init_piecewise_cuda_graphs, "AROUND") in plugin.HOOKS


def test_piecewise_on_is_accepted_at_start_up():
    args = types.SimpleNamespace(
        kv_canary="raise",
        kv_canary_sweep_interval=0,
        kv_canary_real_data="none",
        device="cuda",
        disable_piecewise_cuda_graph=False,
        enable_torch_compile=False,
    )
    config = startup_checks.check_server_args_for_canary(args)
    assert isinstance(config, CanaryConfig) and config.enabled


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
