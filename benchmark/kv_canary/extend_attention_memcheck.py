"""sglang 0.5.12's Triton extend attention (``extend_attention_fwd``) on the MLA shapes the
GPU tests' tiny DeepSeek models give it, without the canary or a server: run under
``compute-sanitizer --tool memcheck`` to see whether the kernel itself reads or writes out of
bounds (docs/testing.md, "The CPU suite": the HiCache + MLA lane).

    compute-sanitizer --tool memcheck python benchmark/kv_canary/extend_attention_memcheck.py

Shapes (heads 4; a prefill without a prefix takes DeepSeek's MHA path, one with a prefix the
absorbed MLA path over the latent cache):

- ``tiny``: the tests' DeepSeek-V2 (latent 256, rope 32, nope 32, v 32): MHA q/k 64, v 32;
  MLA q/k 288, v 256.
- ``v3``: DeepSeek-V3's own (latent 512, rope 64, nope 128, v 128): MHA 192 / 128; MLA
  576 / 512.

Prints one ``SHAPE <name> path=<mha|mla> Lq=.. Lv=.. calls=N ok`` line per shape (CUDA only).
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import use_test_support  # noqa: E402  (a sibling module)

use_test_support()
from canary_support.tiny_models import DEEPSEEK_V3_MLA_DIMS, TINY_DEEPSEEK_V2_CONFIG  # noqa: E402

SHAPES = {"tiny": TINY_DEEPSEEK_V2_CONFIG, "v3": DEEPSEEK_V3_MLA_DIMS}
HEADS = 4


def _batch(rng: random.Random, max_prefix: int, max_extend: int, bs: int):
    prefix = [rng.randrange(0, max_prefix + 1) for _ in range(bs)]
    extend = [rng.randrange(1, max_extend + 1) for _ in range(bs)]
    return prefix, extend


def run_shape(name: str, path: str, calls: int, seed: int) -> str:
    from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd

    dims = SHAPES[name]
    dev = torch.device("cuda")
    rng = random.Random(seed)
    latent, rope = dims["kv_lora_rank"], dims["qk_rope_head_dim"]
    if path == "mha":
        lq, lv, kv_heads = dims["qk_nope_head_dim"] + rope, dims["v_head_dim"], HEADS
    else:
        lq, lv, kv_heads = latent + rope, latent, 1
    slots = 4096
    k_buf = torch.randn(slots, kv_heads, lq, dtype=torch.bfloat16, device=dev)
    # the MLA pool's value buffer is a view of the latent part of its key rows
    v_buf = (
        k_buf[..., :lv]
        if path == "mla"
        else torch.randn(slots, kv_heads, lv, dtype=torch.bfloat16, device=dev)
    )
    for _ in range(calls):
        bs = rng.randrange(1, 5)
        prefix, extend = _batch(rng, 0 if path == "mha" else 200, 96, bs)
        n = sum(extend)
        q = torch.randn(n, HEADS, lq, dtype=torch.bfloat16, device=dev)
        k = torch.randn(n, kv_heads, lq, dtype=torch.bfloat16, device=dev)
        v = (
            k[..., :lv]
            if path == "mla"
            else torch.randn(n, kv_heads, lv, dtype=torch.bfloat16, device=dev)
        )
        o = torch.empty(n, HEADS, lv, dtype=torch.bfloat16, device=dev)
        qo = torch.tensor([0] + list(torch.tensor(extend).cumsum(0)), dtype=torch.int32, device=dev)
        kvp = torch.tensor(
            [0] + list(torch.tensor(prefix).cumsum(0)), dtype=torch.int32, device=dev
        )
        kv_idx = torch.tensor(
            rng.sample(range(1, slots), sum(prefix)), dtype=torch.int64, device=dev
        )
        extend_attention_fwd(
            q,
            k.contiguous(),
            v.contiguous(),
            o,
            k_buf,
            v_buf,
            qo,
            kvp,
            kv_idx,
            None,
            True,
            None,
            max(extend),
            1.0,
            1.0,
            sm_scale=lq**-0.5,
        )
    torch.cuda.synchronize()
    return f"SHAPE {name} path={path} Lq={lq} Lv={lv} calls={calls} ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,v3")
    parser.add_argument("--paths", default="mha,mla")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in args.shapes.split(","):
        for path in args.paths.split(","):
            print(run_shape(name, path, args.calls, args.seed), flush=True)


if __name__ == "__main__":
    main()
