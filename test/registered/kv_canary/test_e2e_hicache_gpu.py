"""HiCache on the GPU as sglang 0.5.12 runs it in production (pinned host pools, its
own transfer kernels, CUDA graphs on), no test shims. The workload of e2e_support/
hicache_workload.py (prefixes that overflow a 256-token device pool: backed up to the host pool,
evicted, loaded back on the second round) for each variant:

- ``mha_kernel``: a tiny Llama (``MHATokenToKVPoolHost``), page 1, sglang's defaults
  (``kernel`` io backend, ``layer_first``, write-through);
- ``mha_page_first_write_back``: page 16, ``page_first`` layout, ``write_back``;
- ``mha_direct``: page 16, the ``direct`` io backend (``page_first_direct``);
- ``mla``: a tiny DeepSeek-V2 with DeepSeek-V3's MLA dims (``MLATokenToKVPoolHost``), page 1,
  sglang's defaults. Not the tiny model's own dims of 32: with those, sglang 0.5.12 itself
  stops now and then under load with the plugin not loaded (docs/testing.md, "The CPU suite").

Each: raise + partial real data + per-layer fingerprints + token checks + the device and
host-tier sweep are quiet and give the greedy outputs of the canary off, with the canary's
rows really backed up and loaded back; ``host_kv`` (a byte flipped in host memory) is found
by the host-tier sweep at the flipped host slot and position."""

from __future__ import annotations

import functools
import os
import pathlib
import sys

import pytest
from e2e_checks import (
    HOST_KV_FAULT_ENV,
    violations_by_pool,
    assert_host_kv_found,
    assert_host_pool_made_room,
    host_tier_stats,
    run_workload,
)

from sglang.srt.kv_canary.violations.lines import parse_violation_lines
from sglang.srt.kv_canary.demo.server_harness import write_tiny_llama
from canary_support.tiny_models import (
    DEEPSEEK_V3_MLA_DIMS,
    write_tiny_deepseek_v2,
    write_tiny_dflash_pair,
)
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=2180, stage="base-b", runner_config="1-gpu-small")
# its lanes in the GPU suite (test/gpu_lanes.py): name -> (pytest -k, est. seconds)
GPU_LANES = {
    "hicache_kernel": ("mha_kernel", 440),
    "hicache_page_first": ("page_first", 440),
    "hicache_direct": ("mha_direct", 440),
    "hicache_mla": ("mla", 440),
    "hicache_spec": ("with_a_draft_model", 420),
}

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

SUPPORT = pathlib.Path(__file__).parent / "e2e_support"
# several of these servers may share one GPU (the device lanes): the pools are capped by
# max_total_tokens, so a high static fraction only relaxes sglang's free-memory check
COMMON = dict(
    enable_hierarchical_cache=True,
    hicache_ratio=6,
    max_total_tokens=256,
    chunked_prefill_size=64,
    max_running_requests=2,
    log_level="info",
    mem_fraction_static=0.85,
)

# variant -> (config writer, engine kwargs, host pool class)
VARIANTS = {
    "mha_kernel": (write_tiny_llama, {}, "MHATokenToKVPoolHost"),
    "mha_page_first_write_back": (
        write_tiny_llama,
        dict(page_size=16, hicache_mem_layout="page_first", hicache_write_policy="write_back"),
        "MHATokenToKVPoolHost",
    ),
    "mha_direct": (
        write_tiny_llama,
        dict(page_size=16, hicache_io_backend="direct", hicache_mem_layout="page_first_direct"),
        "MHATokenToKVPoolHost",
    ),
    "mla": (
        functools.partial(write_tiny_deepseek_v2, **DEEPSEEK_V3_MLA_DIMS),
        {},
        "MLATokenToKVPoolHost",
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    write, kwargs, host_cls = VARIANTS[request.param]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_KV_CANARY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), env.get("PYTHONPATH", "")) if p)
    return dict(
        model=write(tmp_path_factory.mktemp(request.param)),
        kwargs=dict(COMMON, **kwargs),
        env=env,
        host_cls=host_cls,
    )


def run(variant, env_extra=None, **engine_kwargs):
    return run_workload(
        "hicache_workload.py",
        variant["model"],
        dict(variant["kwargs"], **engine_kwargs),
        dict(variant["env"], **(env_extra or {})),
        "cuda",
        timeout=600,
    )


def test_hicache_clean_matches_canary_off(variant):
    rc, out, off = run(variant)
    assert rc == 0 and off is not None, out[-4000:]
    assert sum(off["cached"][8:]) >= 8 * 80, off  # the second round hits its prefixes
    rc, out, on = run(
        variant,
        {
            "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
            "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "1",
        },
        kv_canary="raise",
        kv_canary_real_data="partial",
        kv_canary_real_data_layers="all",
        kv_canary_sweep_interval=2,
    )
    assert rc == 0, out[-4000:]
    assert "cuda graph: True" in out
    assert f"HiCache host tier mirrored ({variant['host_cls'][:3].lower()} host pool" in out, out[
        -4000:
    ]
    assert parse_violation_lines(out) == []
    assert on["outputs"] == off["outputs"]
    # the host pool made room for the mirror (fewer prefixes stay on the host: the ratio
    # leaves room for the second round's hits)
    kwargs = variant["kwargs"]
    assert_host_pool_made_room(
        out,
        ratio=kwargs["hicache_ratio"],
        device_tokens=kwargs["max_total_tokens"],
        page_size=kwargs.get("page_size", 1),
    )
    assert sum(on["cached"][8:]) >= 8 * 80, on
    backed_up, loaded = host_tier_stats(out)
    assert backed_up >= 8 * 80 and loaded >= 80, (backed_up, loaded)


def test_host_kv_is_found_in_host_memory(variant):
    rc, out, res = run(
        variant,
        HOST_KV_FAULT_ENV,
        kv_canary="log",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=1,
    )
    assert rc == 0 and res is not None, out[-4000:]
    assert_host_kv_found(out)


# speculative decoding with HiCache: each drafter's (target, draft) writer and its flags
DRAFTERS = {
    # EAGLE, spec v2, a chain of 3
    "EAGLE": (
        lambda target_dir, draft_dir: (
            write_tiny_llama(target_dir),
            write_tiny_llama(
                draft_dir, architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1
            ),
        ),
        dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4),
    ),
    # DFLASH (spec v1), Triton attention
    "DFLASH": (
        write_tiny_dflash_pair,
        dict(
            attention_backend="triton",
            speculative_num_steps=1,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
        ),
    ),
}


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_hicache_with_a_draft_model(tmp_path_factory, drafter):
    """Speculative decoding with HiCache, ``--kv-canary raise`` (partial real data, token
    checks, the sweep): the workload's prefixes go to host memory and come back, outputs equal
    to the canary off's, nothing reported in the target's pool. EAGLE: sglang keeps the draft
    pool's KV in a host pool of its own, copied with the target's, and the draft canary's rows
    follow it: nothing reported in either pool. DFLASH: sglang 0.5.12 registers the target's
    pool as the draft's, so no draft KV comes back with a prefix; the start-up log says so,
    the draft canary reports those draft slots (pool=draft) and the server serves on."""
    write_pair, flags = DRAFTERS[drafter]
    target, draft = write_pair(
        tmp_path_factory.mktemp(f"hicache_{drafter}_target"),
        tmp_path_factory.mktemp(f"hicache_{drafter}_draft"),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_KV_CANARY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), env.get("PYTHONPATH", "")) if p)
    variant = dict(
        model=target,
        kwargs=dict(
            COMMON,
            # prompts in one prefill chunk: a non-final chunk's last draft position holds the
            # KV of the sampled token in sglang 0.5.12, a true draft report of its own
            # (test_e2e_speculative_gpu.py, test_pr26329_chunk_end_draft_token_is_reported)
            chunked_prefill_size=512,
            speculative_algorithm=drafter,
            speculative_draft_model_path=draft,
            **flags,
        ),
        env=env,
    )
    rc, out, off = run(variant)
    assert rc == 0 and off is not None, out[-4000:]
    assert "HiCache draft KV registered" in out, out[-4000:]
    assert sum(off["cached"][8:]) >= 8 * 80, off
    rc, out, on = run(
        variant,
        {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"},
        kv_canary="raise",
        kv_canary_real_data="partial",
        kv_canary_sweep_interval=2,
    )
    assert rc == 0, out[-4000:]
    assert f"kv_canary installed on the {drafter} draft worker" in out, out[-4000:]
    assert on["outputs"] == off["outputs"]
    assert sum(on["cached"][8:]) >= 8 * 80, on
    pools = {pool for pool, _ in violations_by_pool(out)}
    mirrored = out.count("HiCache host tier mirrored (mha host pool")
    if drafter == "EAGLE":
        assert mirrored == 2 and "keeps no host copy" not in out, out[-4000:]
        assert pools == set(), out[-4000:]
    else:
        assert mirrored == 1, out[-4000:]
        assert "it registered the target's pool as the draft's" in out, out[-4000:]
        assert pools == {"draft"}, out[-4000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
