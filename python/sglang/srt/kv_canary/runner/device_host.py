"""Delayed device→host reads that never stall the forward stream (docs/architecture.md,
"Reading results").

At step T, :meth:`DelayedDeviceHostHandler.stage` enqueues copies of the watched device
tensors into pinned host buffers on a side stream (after the forward stream's work so far)
and records an event; at step T+1, :meth:`consume` waits on that event (long since done) and
hands the host copies to a callback. On CPU tensors both happen at once (synchronous copies).
Two host buffer sets alternate, so staging step T+1 never overwrites what step T's consumer
still reads. :meth:`DelayedDeviceHostHandler.fence`, called before the next forward is queued,
orders that forward after the staged copies (a stream wait on their event, no host sync), so a
kernel of step T+1 can never change a watched tensor while step T's copy is still reading it
(e.g. bump the violation index before writing the row).

What is watched is typed: a (frozen) dataclass whose fields are tensors, dataclasses of the
same kind or tuples of either; the consumer gets an object of the same type holding the host
copies. A watched window (the violation ring's write index) is emptied on the copy stream
right after its copy (``stage(zero_after_copy=...)``), behind the same event.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, Iterator, List, Optional, Sequence, TypeVar

import torch

W = TypeVar("W")


def _leaves(obj: Any, path: str) -> List[torch.Tensor]:
    """The tensors of a watched structure, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, tuple):
        return [t for i, x in enumerate(obj) for t in _leaves(x, f"{path}[{i}]")]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _leaves(getattr(obj, f.name),
                                                                      f"{path}.{f.name}")]
    raise TypeError(f"DelayedDeviceHostHandler watches tensors, dataclasses and tuples; "
                    f"{path} is a {type(obj).__name__}")


def _rebuild(obj: Any, host: Iterator[torch.Tensor]) -> Any:
    """``obj``'s structure with each tensor replaced by the next of ``host``."""
    if isinstance(obj, torch.Tensor):
        return next(host)
    if isinstance(obj, tuple):
        return tuple(_rebuild(x, host) for x in obj)
    return type(obj)(**{f.name: _rebuild(getattr(obj, f.name), host)
                        for f in dataclasses.fields(obj)})


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


class DelayedDeviceHostHandler(Generic[W]):
    """Stages copies of ``sources`` (a dataclass of device tensors, fixed for its lifetime)."""

    def __init__(self, sources: W):
        self._sources = sources
        self._device_leaves = _leaves(sources, type(sources).__name__)
        if not self._device_leaves:
            raise ValueError("DelayedDeviceHostHandler needs at least one tensor to watch")
        devices = {t.device for t in self._device_leaves}
        if len(devices) != 1:
            raise ValueError(f"watched tensors span several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.synchronous = self.device.type != "cuda"
        pin = not self.synchronous
        self._host_leaves = [
            [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in self._device_leaves]
            for _ in range(2)
        ]
        self._host = [_rebuild(sources, iter(leaves)) for leaves in self._host_leaves]
        self._flip = 0
        self._pending: Optional[FutureTensors[W]] = None
        self._stream = None if self.synchronous else torch.cuda.Stream(device=self.device)

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def stage(self, *, zero_after_copy: Sequence[torch.Tensor] = ()) -> None:
        """Enqueue the copies for the current state (replacing an unconsumed earlier stage),
        then zero ``zero_after_copy`` (watched device tensors: a window the copy closed) on
        the copy stream, after the copies; :meth:`fence` orders the next forward after
        both, and nothing on the forward stream waits for either before it."""
        flip = self._flip
        self._flip ^= 1
        pairs = zip(self._host_leaves[flip], self._device_leaves)
        if self.synchronous:
            for dst, src in pairs:
                dst.copy_(src)
            for t in zero_after_copy:
                t.zero_()
            self._pending = FutureTensors(self._host[flip], None)
            return
        producer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(producer)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            for t in zero_after_copy:
                t.zero_()
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending = FutureTensors(self._host[flip], event)

    def fence(self) -> None:
        """Make the current stream wait for the pending copies (if any): work queued after
        this cannot race them. A device-side wait on a recorded event; no host sync."""
        pending = self._pending
        if pending is not None and pending.event is not None:
            torch.cuda.current_stream(self.device).wait_event(pending.event)

    def consume(self, callback: Callable[[W], None]) -> bool:
        """Hand the staged copies to ``callback``; False if nothing was staged. The pending
        stage is cleared before the callback runs, so a raising callback leaves none behind."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        callback(pending.get())
        return True
