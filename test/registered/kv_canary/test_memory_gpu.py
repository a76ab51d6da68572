"""The canary's memory on a GPU (docs/user_guide.md, "Memory"): what the CUDA caching
allocator hands out for a canary built and captured on real sglang pools is the tensors the
formula counts (each in its own block, rounded up as the allocator rounds) and a few bytes of
the graph captures' own, and a real server reserves, before sglang sizes its pool, what its
canary then allocates.

Alone on a GPU (lane ``memory_gpu_alone``: no other lane on its GPU while it runs, since
sglang sizes a pool from the GPU's free memory, and the peak is the GPU's): canary off and on at the same
``--mem-fraction-static``, the peak GPU memory with the canary on within 1 % of off's, and a
server left under 1 GiB free with token checks on serving a full pool of long prompts (lane
``memory_gpu_tight``, alone on another GPU; ``benchmark/kv_canary/bench_memory.py``; figures
in ``benchmark/results/memory.md``)."""

from __future__ import annotations

import gc
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from e2e_workload import assert_memory_reserved_as_allocated, run_mixed_workload, workload_info
from memory_walk import canary_bytes_by_part, formula_bytes_by_part, walk_tensors
from sglang.srt.kv_canary.builder import build_canary
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.memory import MemoryPart
from sglang.srt.kv_canary.demo.server_harness import write_tiny_llama
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=650, stage="base-b", runner_config="1-gpu-small")
# its lanes in the GPU suite (test/gpu_lanes.py): name -> (pytest -k, est. seconds[, "alone"])
GPU_LANES = {
    "memory_gpu": ("not alone_on_the_gpu", 150),
    "memory_gpu_alone": ("alone_on_the_gpu and keeps", 300, "alone"),
    "memory_gpu_tight": ("alone_on_the_gpu and tight", 200, "alone"),
}

pytestmark = [pytest.mark.cuda]


def _pool(kind: str):
    if kind == "mla":
        return MLATokenToKVPool(
            size=20000,
            page_size=1,
            dtype=torch.bfloat16,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            layer_num=3,
            device="cuda",
            enable_memory_saver=False,
        )
    return MHATokenToKVPool(
        size=20000,
        page_size=16,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=64,
        layer_num=3,
        device="cuda",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )


CONFIGS = {
    "mha_raise": ("mha", dict()),
    "mha_everything": (
        "mha",
        dict(
            enable_mha_v=True,
            real_kv_hash_mode="partial",
            real_data_layers="all",
            enable_verify_token_assert=True,
            sweep_interval=4,
        ),
    ),
    "mla_layers_tokens": (
        "mla",
        dict(real_kv_hash_mode="partial", real_data_layers="all", enable_verify_token_assert=True),
    ),
}


def _active_blocks() -> dict:
    """The CUDA caching allocator's allocated blocks: address -> size."""
    return {
        b["address"]: b["size"]
        for seg in torch.cuda.memory_snapshot()
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    }


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cuda_allocates_exactly_what_the_formula_counts(name):
    kind, config = CONFIGS[name]
    pool = _pool(kind)
    r2t = ReqToTokenPool(size=64, max_context_len=4096, device="cuda", enable_memory_saver=False)
    # an earlier case's pool held in a reference cycle would otherwise be freed by the cyclic
    # collector in the middle of the build (seen: a 30 MB MHA pool, in a lane run alone)
    gc.collect()
    torch.cuda.synchronize()
    before, blocks_before = torch.cuda.memory_allocated(), _active_blocks()
    manager = build_canary(
        pool=pool,
        req_to_token=r2t.req_to_token,
        config=CanaryConfig(mode="raise", **config),
        device="cuda",
        capacity_inputs=CanaryCapacityInputs(
            context_len=4096, chunked_prefill_size=512, cuda_graph_max_bs=64
        ),
    )
    manager.mark_init_finished()  # captures the eager-forward graphs and the read-back copies
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - before
    new_blocks = {a: n for a, n in _active_blocks().items() if a not in blocks_before}
    assert sum(new_blocks.values()) == allocated
    # the formula is every tensor the canary holds, on the GPU and in pinned host memory ...
    held = canary_bytes_by_part(manager, foreign=[pool, r2t])
    assert formula_bytes_by_part(manager.memory) == held
    # ... and its GPU share is the tensors behind the allocator's new blocks (each block its
    # tensor rounded up as the allocator rounds, sglang's own tensors alike)
    theirs = {
        t.untyped_storage().data_ptr()
        for obj in (pool, r2t)
        for _, t in walk_tensors(obj, ours_only=False)
    }
    ours = {}
    for _, t in walk_tensors(manager, ours_only=True):
        ptr = t.untyped_storage().data_ptr()
        if t.is_cuda and ptr not in theirs:
            ours[ptr] = t.untyped_storage().nbytes()
    assert sum(ours.values()) == manager.memory.device_bytes
    assert set(ours) <= set(new_blocks)
    assert all(new_blocks[a] >= n for a, n in ours.items())
    # what else the allocator handed out: the graph captures' own few bytes (the read-back
    # copy's multi-tensor metadata), no tensor the formula misses
    others = {a: n for a, n in new_blocks.items() if a not in ours}
    assert sum(others.values()) <= 4096, others
    assert dict(manager.memory.device)[MemoryPart.FORWARD_INPUTS] > 0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(
        tmp_path_factory.mktemp("memory_model"),
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def test_a_gpu_server_reserves_what_its_canary_allocates(model):
    """No --max-total-tokens: the pool is what the budget holds, less the canary's share."""
    rc, out, res = run_mixed_workload(
        model,
        "raise",
        dict(
            max_total_tokens=None,
            mem_fraction_static=0.1,
            max_running_requests=16,
            kv_canary_real_data="partial",
            kv_canary_real_data_layers="all",
            log_level="info",
        ),
        device="cuda",
        env_extra={"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"},
    )
    assert rc == 0 and res is not None, out[-4000:]
    info = workload_info(out)
    assert_memory_reserved_as_allocated(info)
    # what the pool's budget gave up is the canary's bytes, to sglang's rounding of the pool
    # (the canary of one page more)
    reserved = info["kv_canary"]["memory"]["reservation"]["reserved_bytes"]
    held = info["kv_canary"]["memory"]["target"]["allocated"]["device_bytes"]
    assert 0 <= reserved - held < 64 << 10, (reserved, held)
    assert "more GPU memory than was reserved" not in out


BENCH = pathlib.Path(__file__).resolve().parents[3] / "benchmark" / "kv_canary" / "bench_memory.py"
# the benchmark's model: the Qwen3-0.6B shape (28 layers, 8 KV heads of 128, bf16)
KV_BYTES_PER_TOKEN = 28 * 8 * 128 * 2 * 2


def _bench(tmp_path, name: str, *args: str) -> list:
    """``bench_memory.py ARGS`` (it fails when a tight server left 1 GiB or more free or any
    server did not serve its whole workload): its records. With ``KV_CANARY_E2E_LOG_DIR`` set
    (the GPU suite's detached runs), its output and records are kept there as
    ``bench_memory_NAME.log`` / ``.jsonl``."""
    out = tmp_path / "memory.jsonl"
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1100,
    )
    keep = os.environ.get("KV_CANARY_E2E_LOG_DIR")
    if keep:
        os.makedirs(keep, exist_ok=True)
        pathlib.Path(keep, f"bench_memory_{name}.log").write_text(proc.stdout + proc.stderr)
        if out.exists():
            shutil.copy(out, pathlib.Path(keep, f"bench_memory_{name}.jsonl"))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_alone_on_the_gpu_the_canary_keeps_the_servers_memory(tmp_path):
    records = _bench(tmp_path, "same_fraction", "--configs", "off,raise,everything", "--no-tight")
    off = next(r for r in records if r["config"] == "off")
    assert {r["config"] for r in records} == {"off", "raise", "everything"}
    for r in records:
        assert r["served"] == r["requests"], r
        if r is off:
            continue
        canary = r["kv_canary_memory"]["target"]["allocated"]["device_bytes"]
        assert r["kv_canary_memory"]["target"]["reserved"]["device_bytes"] == canary, r
        # the same budget: the pool gave up the canary's bytes (to a few tokens: the two
        # servers' readings of the GPU's free memory), and the peak stayed within 1 %
        given_up = (off["max_total_num_tokens"] - r["max_total_num_tokens"]) * KV_BYTES_PER_TOKEN
        assert abs(given_up - canary) <= max(16 * KV_BYTES_PER_TOKEN, canary // 50), (
            r["config"],
            given_up,
            canary,
        )
        assert r["gpu_used_peak"] <= off["gpu_used_peak"] * 1.01, (r["config"], r, off)


def test_alone_on_the_gpu_a_tight_server_serves_a_full_pool(tmp_path):
    """A server left under 1 GiB free, ``raise`` + token checks (its fraction from the GPU's
    size, one more try from what it left), fills its pool with prompts so long that at most
    ``TIGHT_CONCURRENCY`` decode at once (sglang's own memory outside
    the pool grows with the running batch, not the canary's: benchmark/results/memory.md)."""
    records = _bench(tmp_path, "tight", "--configs", "off", "--only-tight")
    tight = [r for r in records if r["tight"]]
    assert tight and all(r["served"] == r["requests"] for r in records), records
    last = tight[-1]
    assert last["gpu_total"] - last["gpu_used_idle"] < 1 << 30, last
    assert last["kv_canary_memory"]["target"]["allocated"]["device"]["token_table"] > 0
    # the whole pool's worth: 110 % of its tokens, in long prompts
    assert last["requests"] * (last["prompt_tokens"] + last["output_tokens"]) >= (
        1.1 * last["max_total_num_tokens"] - last["prompt_tokens"] - last["output_tokens"]
    )
    assert last["prompt_tokens"] > 4000
    assert not any(r["control"] for r in records)  # the control runs only after a failure


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
