"""GPU kernel time per forward from one torch-profiler trace of a server's scheduler
(``bench_serving_overhead.py --host-profile``): the canary's own kernels (this project's
Triton kernels, by name) apart from everything else the GPU ran, and the GPU's span per
forward. Read two configs' traces side by side: if the model's kernels take less time in a
canary-on server than in a canary-off one, the difference is on the GPU (clocks, memory
placement), not in how the host paces the steps (docs/performance.md, "Decode")."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import statistics


def canary_kernel_names() -> frozenset[str]:
    """The names of this project's Triton kernels (every Triton kernel object of
    ``sglang.jit_kernel.kv_canary`` and its subpackages, autotuned or not), as the profiler
    names their launches."""
    from triton.runtime.jit import KernelInterface

    import sglang.jit_kernel.kv_canary as root

    names = set()
    mods = [root] + [
        importlib.import_module(m.name)
        for m in pkgutil.walk_packages(root.__path__, root.__name__ + ".")
    ]
    for mod in mods:
        for obj in vars(mod).values():
            if isinstance(obj, KernelInterface):
                while not callable(obj) or isinstance(obj, KernelInterface):
                    obj = obj.fn  # an autotuner wraps the JIT function, which wraps the def
                names.add(obj.__name__)
    if not names:
        raise RuntimeError("no Triton kernel found in sglang.jit_kernel.kv_canary")
    return frozenset(names)


@dataclasses.dataclass(frozen=True)
class KernelTime:
    """Per forward (µs): the canary's kernels, all other kernels, the median duration of the
    model's most frequent kernel (a clock-sensitive probe: the same launch every step), and
    the GPU's span (first kernel start to last kernel end) over the forwards."""

    forwards: int
    canary_us: float
    other_us: float
    probe_name: str
    probe_median_us: float
    span_us: float


def kernel_time(events: list[dict], forwards: int, canary_names: frozenset[str]) -> KernelTime:
    """Sum the trace's ``kernel`` events (``ph == "X"``) per forward (``forwards`` > 0)."""
    if forwards <= 0:
        raise ValueError(f"forwards must be positive, got {forwards}")
    canary = other = 0.0
    starts, ends = [], []
    by_name: dict[str, list[float]] = {}
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") != "kernel":
            continue
        dur = float(ev["dur"])
        starts.append(float(ev["ts"]))
        ends.append(float(ev["ts"]) + dur)
        name = ev.get("name", "")
        if name in canary_names:
            canary += dur
        else:
            other += dur
            by_name.setdefault(name, []).append(dur)
    if not starts:
        raise ValueError("the trace holds no kernel events (GPU activity not profiled?)")
    probe = max(by_name, key=lambda n: len(by_name[n])) if by_name else ""
    return KernelTime(
        forwards=forwards,
        canary_us=canary / forwards,
        other_us=other / forwards,
        probe_name=probe[:60],
        probe_median_us=statistics.median(by_name[probe]) if probe else 0.0,
        span_us=(max(ends) - min(starts)) / forwards,
    )
