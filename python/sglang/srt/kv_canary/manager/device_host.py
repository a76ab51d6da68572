"""Delayed device→host reads that never stall the forward stream (docs/architecture.md,
"Reading results").

:class:`DelayedDeviceHostHandler` watches one typed structure: a frozen dataclass whose fields
are tensors, dataclasses of the same kind or tuples of either; the consumer gets the same type
holding host copies. :meth:`~DelayedDeviceHostHandler.stage` (after forward T) copies it on a
side stream into one of two alternating pinned host buffers and records an event;
:meth:`~DelayedDeviceHostHandler.consume` (after T+1) hands it to a callback;
:meth:`~DelayedDeviceHostHandler.fence` (before each forward) orders the forward after the
staged copies (a stream wait, no host sync). A named window (the ring's write index) is emptied
right after its copy. On CUDA, :meth:`~DelayedDeviceHostHandler.capture` (start-up) makes a
stage one graph replay; on CPU the copies are synchronous, and consumed in the same forward
unless ``defer_on_cpu`` (``SGLANG_KV_CANARY_CPU_DEFERRED_READBACK``) consumes them after the
next one, as on CUDA.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch

from sglang.srt.kv_canary import cuda_streams

W = TypeVar("W")


def _leaves(obj: Any, path: str) -> List[torch.Tensor]:
    """The tensors of a watched structure, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, tuple):
        return [t for i, x in enumerate(obj) for t in _leaves(x, f"{path}[{i}]")]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [
            t
            for f in dataclasses.fields(obj)
            for t in _leaves(getattr(obj, f.name), f"{path}.{f.name}")
        ]
    raise TypeError(
        f"DelayedDeviceHostHandler watches tensors, dataclasses and tuples; "
        f"{path} is a {type(obj).__name__}"
    )


def _rebuild(obj: Any, host: Iterator[torch.Tensor]) -> Any:
    """``obj``'s structure with each tensor replaced by the next of ``host``."""
    if isinstance(obj, torch.Tensor):
        return next(host)
    if isinstance(obj, tuple):
        return tuple(_rebuild(x, host) for x in obj)
    return type(obj)(
        **{f.name: _rebuild(getattr(obj, f.name), host) for f in dataclasses.fields(obj)}
    )


class FutureTensors(Generic[W]):
    """Host copies of a watched structure, ready once ``event`` has completed."""

    def __init__(self, value: W, event: Optional["torch.cuda.Event"]):
        self._value = value
        self._event = event

    @property
    def event(self) -> Optional["torch.cuda.Event"]:
        return self._event

    def get(self) -> W:
        if self._event is not None:
            self._event.synchronize()
        return self._value


_WORD_TYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _word_layout(leaves: Sequence[torch.Tensor]) -> Tuple[torch.dtype, List[int], int]:
    """The packed buffer's word type (the smallest element size of the leaves: every leaf is
    a whole number of words), each leaf's offset in words and the buffer's length in words.
    Leaves are placed by decreasing element size (ties in order), so every leaf starts at a
    multiple of its own element size."""
    word_bytes = min(t.element_size() for t in leaves)
    order = sorted(range(len(leaves)), key=lambda i: -leaves[i].element_size())
    offsets = [0] * len(leaves)
    at = 0
    for i in order:
        offsets[i] = at
        at += leaves[i].numel() * leaves[i].element_size() // word_bytes
    return _WORD_TYPES[word_bytes], offsets, at


def _word_views(
    buffer: torch.Tensor, leaves: Sequence[torch.Tensor], offsets: Sequence[int]
) -> List[torch.Tensor]:
    """Each leaf's place in ``buffer`` (1-D, word type), as words."""
    w = buffer.element_size()
    return [
        buffer[off : off + t.numel() * t.element_size() // w] for off, t in zip(offsets, leaves)
    ]


class DelayedDeviceHostHandler(Generic[W]):
    """Stages copies of ``sources`` (a dataclass of device tensors, fixed for its lifetime;
    every tensor contiguous). They travel packed: :meth:`_gather` is one multi-tensor copy of
    word views into a device staging buffer, then one copy into a host buffer whose views, one
    per watched tensor, are what the consumer gets (on CPU the gather writes the host buffer
    directly)."""

    def __init__(
        self,
        sources: W,
        *,
        zero_after_copy: Sequence[torch.Tensor] = (),
        defer_on_cpu: bool = False,
    ):
        self._sources = sources
        self._device_leaves = _leaves(sources, type(sources).__name__)
        if not self._device_leaves:
            raise ValueError("DelayedDeviceHostHandler needs at least one tensor to watch")
        devices = {t.device for t in self._device_leaves}
        if len(devices) != 1:
            raise ValueError(f"watched tensors span several devices: {sorted(map(str, devices))}")
        strided = [i for i, t in enumerate(self._device_leaves) if not t.is_contiguous()]
        if strided:
            raise ValueError(
                f"DelayedDeviceHostHandler watches contiguous tensors; leaves "
                f"{strided} of {type(sources).__name__} are not"
            )
        watched = {id(t) for t in self._device_leaves}
        foreign = [i for i, t in enumerate(zero_after_copy) if id(t) not in watched]
        if foreign:
            raise ValueError(
                f"DelayedDeviceHostHandler zeroes only watched tensors after their "
                f"copy; zero_after_copy entries {foreign} are not leaves of "
                f"{type(sources).__name__}"
            )
        self._zero_after_copy = tuple(zero_after_copy)
        self.device = devices.pop()
        on_cpu = self.device.type != "cuda"
        self._on_cpu = on_cpu
        # consumed in the forward that staged it (CPU), or one forward later (CUDA; CPU with
        # ``defer_on_cpu``: a CPU server read back in the GPU's order)
        self.synchronous = on_cpu and not defer_on_cpu
        pin = not on_cpu
        word, offsets, num_words = _word_layout(self._device_leaves)
        # the gather's inputs: the watched tensors as words
        self._device_words = [t.reshape(-1).view(word) for t in self._device_leaves]
        self._staging = None if on_cpu else torch.empty(num_words, dtype=word, device=self.device)
        self._staging_words = (
            None if on_cpu else _word_views(self._staging, self._device_leaves, offsets)
        )
        self._host_buffers = [torch.empty(num_words, dtype=word, pin_memory=pin) for _ in range(2)]
        self.num_bytes = self._host_buffers[0].numel() * self._host_buffers[0].element_size()
        self._host_words = [
            _word_views(host, self._device_leaves, offsets) for host in self._host_buffers
        ]
        self._host = [
            _rebuild(
                sources,
                iter([w.view(t.dtype).view(t.shape) for w, t in zip(words, self._device_leaves)]),
            )
            for words in self._host_words
        ]
        self._flip = 0
        self._pending: Optional[FutureTensors[W]] = None
        self._stream = None if on_cpu else torch.cuda.Stream(device=self.device)
        # CUDA: where the copies start (recorded on the producer's stream) and, per host
        # buffer, when they are done (a buffer is staged again only after its copies were
        # consumed or replaced, so its event is free to be recorded again)
        self._device_index = cuda_streams.device_index(self.device)
        self._produced = None if on_cpu else torch.cuda.Event()
        self._copied = None if on_cpu else [torch.cuda.Event() for _ in range(2)]
        # CUDA, after capture(): per host buffer, its copies as one graph
        self._graphs: Optional[List["torch.cuda.CUDAGraph"]] = None

    def _gather(self, out_words: List[torch.Tensor]) -> None:
        """Every watched tensor into its place in a packed buffer (``out_words``: the
        buffer's word views, in leaf order); one multi-tensor copy."""
        torch._foreach_copy_(out_words, self._device_words)

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def _copies(self, flip: int) -> None:
        """Host buffer ``flip``'s copies, on the current stream: the gather, the device→host
        copy, the resets of ``zero_after_copy``. What :meth:`capture` records."""
        self._gather(self._staging_words)
        self._host_buffers[flip].copy_(self._staging, non_blocking=True)
        for t in self._zero_after_copy:
            t.zero_()

    @property
    def captured(self) -> bool:
        return self._graphs is not None

    def capture(self) -> None:
        """Record each host buffer's copies as a CUDA graph on the copy stream. Capturing
        runs none of them: a pending stage and the watched tensors are left as they are, so
        it may come between any two forwards (at the end of start-up: it synchronizes the
        device). CUDA only."""
        if self._on_cpu:
            raise RuntimeError("kv_canary: the read-back's copies are captured only on CUDA")
        if self.captured:
            raise RuntimeError("kv_canary: the read-back's copies are already captured")
        graphs = [torch.cuda.CUDAGraph() for _ in range(2)]
        for flip, graph in enumerate(graphs):
            # thread_local: another thread's CUDA call cannot break the capture
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                self._copies(flip)
        self._graphs = graphs

    def stage(self) -> None:
        """Enqueue the copies for the current state (replacing an unconsumed earlier stage),
        then zero the ``zero_after_copy`` tensors (a window the copy closed) on the copy
        stream, after the copies; :meth:`fence` orders the next forward after both, and
        nothing on the forward stream waits for either before it. Allocation-free and
        host-sync-free on CUDA."""
        flip = self._flip
        self._flip ^= 1
        if self._on_cpu:
            self._gather(self._host_words[flip])
            for t in self._zero_after_copy:
                t.zero_()
            self._pending = FutureTensors(self._host[flip], None)
            return
        produced = self._produced
        produced.record(cuda_streams.current_stream(self._device_index))
        event = self._copied[flip]
        with cuda_streams.on_stream(self._stream):
            self._stream.wait_event(produced)
            if self._graphs is not None:
                self._graphs[flip].replay()
            else:
                self._copies(flip)
            event.record(self._stream)
        self._pending = FutureTensors(self._host[flip], event)

    def fence(self) -> None:
        """Make the current stream wait for the pending copies (if any): work queued after
        this cannot race them. A device-side wait on a recorded event; no host sync."""
        pending = self._pending
        if pending is not None and pending.event is not None:
            cuda_streams.current_stream(self._device_index).wait_event(pending.event)

    def consume(self, callback: Callable[[W], None]) -> bool:
        """Hand the staged copies to ``callback``; False if nothing was staged. The pending
        stage is cleared before the callback runs, so a raising callback leaves none behind."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        callback(pending.get())
        return True
