"""Stream look-ups and switches for the per-forward path, at a fraction of the host time of
``torch.cuda.current_stream`` / ``torch.cuda.stream`` (docs/architecture.md, "One forward",
host time).

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
from typing import Dict, Iterator, Tuple

import torch

_StreamKey = Tuple[int, int, int]  # (stream_id, device_index, device_type)
_streams: Dict[_StreamKey, "torch.cuda.Stream"] = {}


def current_stream(device_index: int) -> "torch.cuda.Stream":
    """The current stream of CUDA device ``device_index`` (the object is reused: the same
    stream always gives the same ``Stream``)."""
    key = torch._C._cuda_getCurrentStream(device_index)
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1],
                                                   device_type=key[2])
    return stream


@contextlib.contextmanager
def on_stream(stream: "torch.cuda.Stream") -> Iterator[None]:
    """Make ``stream`` current on its device for the enclosed work, then restore the stream
    that was current there (also when the body raises): ``torch.cuda.stream(stream)`` for a
    stream of the current device."""
    prev = torch._C._cuda_getCurrentStream(stream.device_index)
    torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type)
    try:
        yield
    finally:
        torch._C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
