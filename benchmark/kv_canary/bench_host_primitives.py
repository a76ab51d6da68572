"""Host time of the CUDA primitives a forward's canary work is made of (docs/user_guide.md,
"Overhead"): what one stream switch, event, small copy, graph replay or Triton launch costs
the scheduler's thread on this machine, so a host-time budget per forward can be split
before it is spent.

    python benchmark/kv_canary/bench_host_primitives.py [--iters 2000] [--out F.jsonl]

Each primitive runs ``--iters`` times in batches of 100 while the GPU is kept busy by a
queued sleep kernel (so no call waits for the device); the median per call of the batches
is printed, in µs. CUDA only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import triton
import triton.language as tl

from sglang.srt.kv_canary import cuda_streams

BATCH = 100


@triton.jit
def _touch(x_ptr, n, a, b, c, d, e, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + a + b + c + d + e, mask=m)


def _measure(fn, iters: int) -> float:
    """Median µs per call over batches of ``BATCH`` calls, the GPU busy meanwhile."""
    per_call = []
    for _ in range(max(1, iters // BATCH)):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # keeps the device busy for the whole batch
        t0 = time.perf_counter()
        for _ in range(BATCH):
            fn()
        per_call.append((time.perf_counter() - t0) / BATCH * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_primitives.py needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    idx = dev.index
    side = torch.cuda.Stream(dev)
    cur = torch.cuda.current_stream(dev)
    ev = torch.cuda.Event()
    ev.record(cur)
    a = torch.zeros(512, dtype=torch.int64, device=dev)
    b = torch.ones(512, dtype=torch.int64, device=dev)
    six_dst = [torch.zeros(512, dtype=torch.int64, device=dev) for _ in range(6)]
    six_src = [torch.ones(512, dtype=torch.int64, device=dev) for _ in range(6)]
    pinned = torch.ones(512, dtype=torch.int64, pin_memory=True)
    host_small = torch.ones(16, dtype=torch.int64, pin_memory=True)
    x = torch.zeros(4096, dtype=torch.float32, device=dev)

    g1, g20 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(dev)
    s.wait_stream(cur)
    with torch.cuda.stream(s):
        _touch[(4,)](x, 4096, 1, 2, 3, 4, 5, BLOCK=1024)
    torch.cuda.synchronize()
    with torch.cuda.graph(g1):
        _touch[(4,)](x, 4096, 1, 2, 3, 4, 5, BLOCK=1024)
    with torch.cuda.graph(g20):
        for _ in range(20):
            _touch[(4,)](x, 4096, 1, 2, 3, 4, 5, BLOCK=1024)
    # 20 kernels on four parallel branches, forked and joined by events (the shape
    # ParallelLanes gives the canary's side half inside a capture)
    g20x4 = torch.cuda.CUDAGraph()
    lanes = [torch.cuda.Stream(dev) for _ in range(3)]
    fork, joins = torch.cuda.Event(), [torch.cuda.Event() for _ in lanes]
    with torch.cuda.graph(g20x4):
        fork.record()
        for lane, join in zip(lanes, joins):
            lane.wait_event(fork)
            with torch.cuda.stream(lane):
                for _ in range(5):
                    _touch[(4,)](x, 4096, 1, 2, 3, 4, 5, BLOCK=1024)
            join.record(lane)
        for _ in range(5):
            _touch[(4,)](x, 4096, 1, 2, 3, 4, 5, BLOCK=1024)
        for join in joins:
            torch.cuda.current_stream().wait_event(join)

    @contextlib.contextmanager
    def cm():
        yield

    def switch_private():
        prev = torch._C._cuda_getCurrentStream(idx)
        torch._C._cuda_setStream(
            stream_id=side.stream_id, device_index=side.device_index, device_type=side.device_type
        )
        torch._C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])

    def stream_ctx():
        with torch.cuda.stream(side):
            pass

    def set_stream_pair():
        prev = torch.cuda.current_stream(dev)
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(prev)

    def pinned_in_flight():
        # what a token snapshot does: a new pinned buffer, copied to the device behind the
        # queued work; the caching host allocator cannot hand back a block whose copy is
        # still pending, so each call may allocate afresh
        buf = torch.empty(4096, dtype=torch.int64, pin_memory=True)
        a_big.copy_(buf, non_blocking=True)

    a_big = torch.zeros(4096, dtype=torch.int64, device=dev)
    cases = {
        "torch.cuda.current_stream(dev)": lambda: torch.cuda.current_stream(dev),
        "torch._C._cuda_getCurrentStream(idx)": lambda: torch._C._cuda_getCurrentStream(idx),
        "with torch.cuda.stream(side): pass": stream_ctx,
        "current_stream + set_stream x2": set_stream_pair,
        "_cuda_getCurrentStream + _cuda_setStream x2": switch_private,
        "torch.cuda.Event()": torch.cuda.Event,
        "event.record(stream)": lambda: ev.record(cur),
        "event.record() (no stream: torch.cuda.current_stream())": ev.record,
        "event.record(cuda_streams.current_stream(idx))": lambda: ev.record(
            cuda_streams.current_stream(idx)
        ),
        "stream.wait_event(event)": lambda: cur.wait_event(ev),
        "stream.wait_stream(stream)": lambda: side.wait_stream(cur),
        "small D2D copy_ (512 x int64)": lambda: a.copy_(b),
        "sliced D2D copy_ (a[:300].copy_(b[:300]))": lambda: a[:300].copy_(b[:300]),
        "zero_ (512 x int64)": a.zero_,
        "6 x D2D copy_": lambda: [d.copy_(t) for d, t in zip(six_dst, six_src)],
        "_foreach_copy_ of 6 (int64)": lambda: torch._foreach_copy_(six_dst, six_src),
        "H2D copy_ from pinned, non_blocking (512 x int64)": lambda: a.copy_(
            pinned, non_blocking=True
        ),
        "D2H copy_ to pinned, non_blocking (16 x int64)": lambda: host_small.copy_(
            a[:16], non_blocking=True
        ),
        "torch.empty(512, int64, pin_memory=True)": lambda: torch.empty(
            512, dtype=torch.int64, pin_memory=True
        ),
        "torch.empty(4096, int64, pinned) + H2D copy, earlier copies in flight": pinned_in_flight,
        "CUDAGraph.replay() (1 kernel)": g1.replay,
        "CUDAGraph.replay() (20 kernels)": g20.replay,
        "CUDAGraph.replay() (20 kernels on 4 parallel branches)": g20x4.replay,
        "Triton JIT launch (7 args)": lambda: _touch[(4,)](x, 4096, 1, 2, 3, 4, 5, BLOCK=1024),
        "host tensor .tolist() (16)": host_small.tolist,
        "contextlib.contextmanager enter + exit": lambda: cm().__enter__(),
    }
    print(
        f"Host µs per call — {torch.cuda.get_device_name(dev)} — "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — torch {torch.__version__}, "
        f"triton {triton.__version__}"
    )
    print("| primitive | µs per call (median) |")
    print("| --- | ---: |")
    results = {}
    for name, fn in cases.items():
        fn()
        us = _measure(fn, args.iters)
        results[name] = us
        print(f"| {name} | {us:.2f} |", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(
                json.dumps(
                    dict(
                        kind="host_primitives",
                        gpu=torch.cuda.get_device_name(dev),
                        time=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        us_per_call=results,
                    )
                )
                + "\n"
            )


if __name__ == "__main__":
    main()
