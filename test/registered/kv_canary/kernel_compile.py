"""Compile the write kernels for an sm_90 GPU on a machine without one (Triton's own compiler
and ptxas, no device): what the interpreter accepts but the compiler does not (a starred tuple,
a Python-only construct) fails here instead of on the first GPU run. Run as a script, with
``TRITON_INTERPRET`` unset (the kernels must be imported compiled); prints one line per variant
and exits 1 on the first failure. Called by ``test_kernels_compile.py``."""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("kernel_compile.py: run it with TRITON_INTERPRET unset (the kernels compiled)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sglang.jit_kernel.kv_canary import write  # noqa: E402
from sglang.jit_kernel.kv_canary._tree_triton import tree_write_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def signature(fn, constexprs: dict) -> dict:
    """Every argument's Triton type: constexprs as such, ``*_ptr`` int64 pointers, the rest
    int64 scalars (the write kernels take nothing else)."""
    return {
        name: "constexpr" if name in constexprs else "*i64" if name.endswith("_ptr") else "i64"
        for name in fn.arg_names
    }


def variants():
    """(kernel, constexprs, num_warps) of every shape the launchers pick: each chain block
    size's warp count, one to four buffers, with and without the input assert, with real-KV
    sources (the fingerprint programs), and the tree kernel."""
    for assert_inputs in (False, True):
        for sources, bufs, sblock in ((0, 2, write.CHAIN_MAX_BLOCK), (2, 1, 16), (0, 4, 32)):
            constexprs = dict(
                INPUT_ASSERT=assert_inputs,
                NUM_SOURCES=sources,
                NUM_BUFS=bufs,
                SBLOCK=sblock,
                RBLOCK=write.CHAIN_STEP_LANES,
                FBLOCK=write.WRITE_FINGERPRINT_BLOCK,
            )
            warps = 4 if sources else max(min(sblock // 32, write.CHAIN_MAX_WARPS), 1)
            yield write._canary_write_kernel, constexprs, warps
        yield (
            tree_write_kernel,
            dict(
                INPUT_ASSERT=assert_inputs,
                ZERO_FP=not assert_inputs,
                MAX_DEPTH=4,
                TBLOCK=write.TREE_ENTRY_BLOCK,
            ),
            1,
        )


def main() -> int:
    for fn, constexprs, warps in variants():
        src = ASTSource(fn=fn, signature=signature(fn, constexprs), constexprs=constexprs)
        compiled = triton.compile(src, target=TARGET, options={"num_warps": warps})
        if "cubin" not in compiled.asm:
            print(f"FAILED {fn.__name__} {constexprs}: no cubin", flush=True)
            return 1
        print(f"compiled {fn.__name__} {constexprs} num_warps={warps}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
