"""The serving-loop driver on the CPU with its decode steps replayed from a "graph": a
:class:`~serving_driver.CpuGraph` issues the launches the capture path records (the single-
forward manager in capture mode, static padded inputs, the token scatter from the uploader's
replay buffer) while the outside bracket runs as around a real replay. The CUDA twins of these
tests (``test_runtime_cuda.py``) replay real CUDA graphs; these keep the replay paths in CPU
CI."""

from __future__ import annotations

import sys

import pytest
import torch

from serving_driver import CpuGraph, ServingDriver
from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


def test_replayed_decodes_leave_the_records_of_eager_decodes():
    """The same seeded loop with decodes replayed from a graph of 8 rows and with every
    decode eager: identical records and expected-token pool, no violation; the replayed
    steps' tokens went through the replay buffer (staged, scattered by the graph's launch)."""
    kw = dict(seed=5, real_data="partial", enable_mha_v=True, verify_tokens=True, max_running=6)
    graphs = ServingDriver(graph_bs=8, **kw)
    eager = ServingDriver(graph_bs=0, **kw)
    assert isinstance(graphs.graph, CpuGraph) and eager.graph is None
    staged = []
    real_stage = graphs.manager.token_history.stage_for_replay

    def spy(*args):
        staged.append(args[1].shape[0])
        return real_stage(*args)

    graphs.manager.token_history.stage_for_replay = spy
    for d in (graphs, eager):
        d.run(150)
        d.settle()
    assert graphs.step_count == eager.step_count
    assert graphs.manager.count_violations() == eager.manager.count_violations() == 0
    assert len(staged) > 50 and max(staged) > 1
    a, b = graphs.canary_bytes(), eager.canary_bytes()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_replayed_decodes_catch_the_right_position_with_the_wrong_token():
    """A slot of the same position and a consistent chain, another request's token: only the
    token check sees it, in a replayed decode (found at step T, reported at T+1)."""
    d = ServingDriver(graph_bs=8, seed=12, verify_tokens=True, mode="raise", max_running=6)
    d.run(100)
    assert d.manager.count_violations() == 0
    d.settle()
    info = d.fault_swap_same_position()
    assert info["shared_prefix"]
    with pytest.raises(RuntimeError, match="kv_canary detected KV-cache corruption") as exc:
        for _ in range(2):
            d.step()
    mine = [v for v in parse_violation_lines(str(exc.value)) if v.slot_idx == info["new_slot"]]
    assert mine and all(v.fail_reasons == ("verify_token",) for v in mine)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
