"""pytest plugin (``-p kernel_compile_plugin``, TRITON_INTERPRET=0, no GPU needed): every
Triton launch the selected tests make is compiled for an sm_90 GPU by Triton's own compiler
and ptxas instead of being run (CPU tensors are routed to the Triton launchers), so code the
interpreter accepts but the compiler rejects fails in CPU CI, not on the first GPU run. The
tests' own assertions then fail (nothing ran); what counts is the report written at the end
to ``$KV_CANARY_COMPILE_REPORT`` (JSON: every kernel of the package, the variants compiled,
the compile errors). Each test function runs for its first ``KV_CANARY_COMPILE_ITEMS``
parameter sets (default 3). Used by ``test_kernels_compile.py``."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
PACKAGE = "sglang.jit_kernel.kv_canary"
REPORT_ENV = "KV_CANARY_COMPILE_REPORT"
ITEMS_ENV = "KV_CANARY_COMPILE_ITEMS"
_DTYPES = {
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    **{getattr(torch, n): t for n, t in (("uint16", "u16"), ("uint32", "u32"), ("uint64", "u64"))},
}
_OPTIONS = ("num_warps", "num_stages")

compiled: dict = {}  # (kernel, signature, constexprs, options) -> True
failures: list = []


def kernel_name(fn: JITFunction) -> str:
    return f"{fn.fn.__module__}.{fn.fn.__name__}"


def _arg_type(value) -> str:
    """Triton's type of a runtime argument (what the launcher's specialization would give)."""
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"a kernel argument of type {type(value).__name__}")


def compile_instead_of_run(self: JITFunction, *args, grid, warmup, **kwargs):
    """``JITFunction.run`` replaced: compile this launch's variant (once) and launch nothing."""
    bound = dict(zip(self.arg_names, args))
    options = {}
    for name, value in kwargs.items():
        if name in self.arg_names:
            bound[name] = value
        elif name in _OPTIONS:
            options[name] = value
    signature, constexprs = {}, {}
    for p in self.params:
        value = bound.get(p.name, p.default)
        if p.is_constexpr or value is None:
            signature[p.name], constexprs[p.name] = "constexpr", value
        else:
            try:
                signature[p.name] = _arg_type(value)
            except (KeyError, TypeError) as e:  # this plugin's gap, named in the report
                failures.append(
                    {"kernel": kernel_name(self), "constexprs": p.name, "error": repr(e)}
                )
                return None
    key = (
        kernel_name(self),
        tuple(signature.items()),
        tuple((k, repr(v)) for k, v in constexprs.items()),
        tuple(sorted(options.items())),
    )
    if key not in compiled:
        compiled[key] = True
        try:
            src = ASTSource(fn=self, signature=signature, constexprs=constexprs)
            triton.compile(src, target=TARGET, options=options)
        except Exception as e:  # reported, not raised: the report names every failure
            failures.append({"kernel": key[0], "constexprs": key[2], "error": str(e)[-3000:]})
    return None


def all_kernels() -> list:
    """Every ``*_kernel`` Triton function defined in the package's modules."""
    found = set()
    pkg = importlib.import_module(PACKAGE)
    for info in pkgutil.walk_packages(pkg.__path__, PACKAGE + "."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (
                isinstance(obj, JITFunction)
                and obj.fn.__name__.endswith("_kernel")
                and obj.fn.__module__ == module.__name__
            ):
                found.add(kernel_name(obj))
    return sorted(found)


def pytest_configure(config):
    from sglang.jit_kernel.kv_canary import _launch

    JITFunction.run = compile_instead_of_run
    _launch.TRITON_INTERPRET = True  # CPU tensors to the Triton launchers (compiled, not run)


def pytest_collection_modifyitems(config, items):
    keep = int(os.environ.get(ITEMS_ENV, "3"))
    seen: dict = {}
    kept = []
    for item in items:
        key = (item.path, getattr(item, "originalname", item.name))
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= keep:
            kept.append(item)
    items[:] = kept


def pytest_unconfigure(config):
    path = os.environ.get(REPORT_ENV)
    if path:
        report = {
            "kernels": all_kernels(),
            "compiled": sorted({key[0] for key in compiled}),
            "variants": len(compiled),
            "failures": failures,
        }
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
