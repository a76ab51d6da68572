"""Can a CUDA graph launched before the model's kernels wait, inside the graph, for the forward
stream to reach the end of the model?

The question behind one replay for an eager forward's side and tail halves
(benchmark/results/latency_h100.md, "Where the next µs are"): the replay would be launched
before the model's kernels, and its tail nodes must wait for the forward stream to reach the
end of the model. With ``torch.cuda.Event(external=True)`` a captured ``wait_event`` becomes an
event-wait node; this probe launches such a graph, then records the event on another stream
behind a ~0.1 s sleep and a write, and reads what the node's successor copied:

- ``waits_for_later_record``: the successor saw the write (the wait honoured a record made
  after the launch);
- ``copied``: the value the successor copied (the write stores 5; 0 means it ran before).

The same with a memory-value wait instead (the driver's ``cuStreamWaitValue32_v2`` captured into
the graph, through ``ctypes``; the "forward" then writes the flag with ``cuStreamWriteValue32_v2``
and the graph clears it after its wait): ``value_wait_captured`` (the capture accepted it),
``value_waits_for_later_write``, ``value_copied``.

It also times ``replay()`` of each graph and of one without a wait (µs per call, host).
Prints one JSON line. CUDA only; plain torch (no sglang). Usage:
``python benchmark/kv_canary/probe_graph_event_wait.py``.
"""

from __future__ import annotations

import ctypes
import json
import time

import torch

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ


def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    wait, write = lib.cuStreamWaitValue32_v2, lib.cuStreamWriteValue32_v2
    for fn in (wait, write):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return wait, write


def _value_graph(side, flag, src, dst):
    """``(graph, error)``: wait until ``flag >= 1``, clear it, copy ``src`` to ``dst``."""
    wait, _ = _libcuda()
    graph = torch.cuda.CUDAGraph()
    err = 0
    with torch.cuda.graph(graph, stream=side):
        stream = torch.cuda.current_stream()
        err = wait(ctypes.c_void_p(stream.cuda_stream), flag.data_ptr(), 1, _WAIT_GEQ)
        flag.zero_()
        dst.copy_(src)
    return graph, err


def _graph(side: torch.cuda.Stream, event, src, dst) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        dst.copy_(src)
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph, side: torch.cuda.Stream, n: int = 2000) -> float:
    with torch.cuda.stream(side):
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            graph.replay()
        elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("probe_graph_event_wait: needs a CUDA GPU")
    side, producer = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.zeros(1, dtype=torch.int64, device="cuda")
    dst = torch.zeros(1, dtype=torch.int64, device="cuda")
    event = torch.cuda.Event(external=True)
    event.record(producer)  # a first record, complete long before the launch
    torch.cuda.synchronize()
    waiting = _graph(side, event, src, dst)
    plain = _graph(side, None, src, dst)
    src.zero_()
    dst.fill_(-1)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        waiting.replay()  # launched first
    with torch.cuda.stream(producer):  # then the "forward": a sleep, a write, the record
        torch.cuda._sleep(200_000_000)
        src.fill_(5)
        event.record(producer)
    torch.cuda.synchronize()
    copied = int(dst.item())
    result = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        waits_for_later_record=copied == 5,
        copied=copied,
        replay_us_with_wait_node=round(_replay_us(waiting, side), 2),
        replay_us_without=round(_replay_us(plain, side), 2),
    )
    # the memory-value wait
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    src.zero_()
    dst.fill_(-1)
    torch.cuda.synchronize()
    try:
        valued, err = _value_graph(side, flag, src, dst)
    except Exception as exc:  # the capture refused the node: that is the answer
        result.update(value_wait_captured=False, value_error=repr(exc))
        print(json.dumps(result))
        return
    result.update(value_wait_captured=err == 0, value_error=err)
    if err == 0:
        _, write = _libcuda()
        flag.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            valued.replay()  # launched first
        with torch.cuda.stream(producer):
            torch.cuda._sleep(200_000_000)
            src.fill_(5)
            write(ctypes.c_void_p(producer.cuda_stream), flag.data_ptr(), 1, 0)
        torch.cuda.synchronize()
        value_copied = int(dst.item())
        result.update(value_waits_for_later_write=value_copied == 5, value_copied=value_copied)

        def replay_after_write():
            write(ctypes.c_void_p(side.cuda_stream), flag.data_ptr(), 1, 0)
            valued.replay()

        with torch.cuda.stream(side):
            for _ in range(50):
                replay_after_write()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(2000):
                replay_after_write()
            us = (time.perf_counter() - t0) / 2000 * 1e6
        torch.cuda.synchronize()
        result.update(replay_us_with_value_wait_and_its_write=round(us, 2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
