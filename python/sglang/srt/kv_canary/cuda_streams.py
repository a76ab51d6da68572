"""Stream look-ups and switches for the per-forward path, at a fraction of the host time of
``torch.cuda.current_stream`` / ``torch.cuda.stream`` (docs/performance.md, "The forward
path").

On an H100 host (``benchmark/kv_canary/bench_host_primitives.py``) ``current_stream(dev)``
costs about 3 µs and entering and leaving ``torch.cuda.stream(s)`` about 10 µs, most of it
Python: device-index parsing, availability checks and a new ``Stream`` object per call. A
forward's canary work looks the current stream up and switches streams several times, before
and after every forward, graph replays included. The functions here call torch's own
accessors (``torch._C._cuda_getCurrentStream`` / ``_cuda_setStream``, what those wrappers
call) and reuse one ``Stream`` object per stream. Same semantics; callers pass a CUDA device
index. Graph-safe (no allocation on the device, no sync), including inside a capture.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional, Tuple

import torch

_StreamKey = Tuple[int, int, int]  # (stream_id, device_index, device_type)
_streams: Dict[_StreamKey, "torch.cuda.Stream"] = {}


def current_stream(device_index: int) -> "torch.cuda.Stream":
    """The current stream of CUDA device ``device_index`` (the object is reused: the same
    stream always gives the same ``Stream``)."""
    key = torch._C._cuda_getCurrentStream(device_index)
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.Stream(
            stream_id=key[0], device_index=key[1], device_type=key[2]
        )
    return stream


def device_index(device) -> Optional[int]:
    """The CUDA device index whose current stream work on ``device`` is queued on: its own
    index, the current device for a bare ``"cuda"``, None off CUDA. At construction, not on
    the forward path."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


@contextlib.contextmanager
def on_stream(stream: "torch.cuda.Stream") -> Iterator[None]:
    """Make ``stream`` current on its device for the enclosed work, then restore the stream
    that was current there (also when the body raises): ``torch.cuda.stream(stream)`` for a
    stream of the current device."""
    prev = torch._C._cuda_getCurrentStream(stream.device_index)
    torch._C._cuda_setStream(
        stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type
    )
    try:
        yield
    finally:
        torch._C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])


class ParallelLanes:
    """Runs independent launch sequences side by side: the first on the current stream, each
    other on a stream of its own, forked from the current stream and joined back to it by
    events (inside a CUDA-graph capture: parallel branches of the graph). For launches whose
    time is the latency of one SM, such as the serial hash chains a group's write walks: N of
    them then take about the time of one (docs/performance.md, "The forward path").

    ``lanes``: the most sequences one :meth:`run` takes; ``device``: where they run (not CUDA:
    in order, on the caller's stream). Streams and events are made here; :meth:`run`
    allocates nothing and never syncs the host."""

    def __init__(self, lanes: int, device):
        if lanes < 1:
            raise ValueError(f"ParallelLanes needs lanes >= 1, got {lanes}")
        device = torch.device(device)
        self.lanes = lanes
        extra = lanes - 1 if device.type == "cuda" else 0
        self._streams = [torch.cuda.Stream(device=device) for _ in range(extra)]
        self._fork = torch.cuda.Event() if extra else None
        self._done = [torch.cuda.Event() for _ in range(extra)]
        self._device_index = self._streams[0].device_index if extra else None

    def run(self, sequences) -> None:
        """Run each of ``sequences`` (callables taking no argument, at most ``lanes``) on its
        lane; work queued on the current stream afterwards waits for all of them."""
        if len(sequences) > self.lanes:
            raise ValueError(
                f"ParallelLanes.run: {len(sequences)} sequences for {self.lanes} lanes"
            )
        if not self._streams or len(sequences) < 2:
            for seq in sequences:
                seq()
            return
        here = current_stream(self._device_index)
        self._fork.record(here)
        sequences[0]()
        others = list(zip(self._streams, self._done, sequences[1:]))
        for stream, done, seq in others:
            stream.wait_event(self._fork)
            with on_stream(stream):
                seq()
            done.record(stream)
        for _, done, _ in others:
            here.wait_event(done)
