"""Delayed device→host reads that never stall the forward stream (SPEC §10).

At step T, :meth:`DelayedDeviceHostHandler.stage` enqueues copies of the watched device
tensors into pinned host buffers on a side stream (after the forward stream's work so far)
and records an event; at step T+1, :meth:`consume` waits on that event (long since done) and
hands the host copies to a callback. On CPU tensors both happen at once (synchronous copies).
Two host buffer sets alternate, so staging step T+1 never overwrites what step T's consumer
still reads. :meth:`DelayedDeviceHostHandler.fence`, called before the next forward is queued,
orders that forward after the staged copies (a stream wait on their event, no host sync), so a
kernel of step T+1 can never change a watched tensor while step T's copy is still reading it
(e.g. bump the violation index before writing the row).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch


class FutureTensors:
    """Host copies of a set of device tensors, ready once ``event`` has completed."""

    def __init__(self, tensors: Dict[str, torch.Tensor], event: Optional["torch.cuda.Event"]):
        self._tensors = tensors
        self._event = event

    @property
    def event(self) -> Optional["torch.cuda.Event"]:
        return self._event

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def get(self) -> Dict[str, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._tensors


class DelayedDeviceHostHandler:
    """Stages copies of ``sources`` (name → device tensor, fixed for its lifetime)."""

    def __init__(self, sources: Dict[str, torch.Tensor]):
        if not sources:
            raise ValueError("DelayedDeviceHostHandler needs at least one tensor to watch")
        self._sources = dict(sources)
        devices = {t.device for t in self._sources.values()}
        if len(devices) != 1:
            raise ValueError(f"watched tensors span several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.synchronous = self.device.type != "cuda"
        pin = not self.synchronous
        self._host = [
            {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in
             self._sources.items()}
            for _ in range(2)
        ]
        self._flip = 0
        self._pending: Optional[FutureTensors] = None
        self._stream = None if self.synchronous else torch.cuda.Stream(device=self.device)

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def stage(self) -> None:
        """Enqueue the copies for the current state (replacing an unconsumed earlier stage)."""
        host = self._host[self._flip]
        self._flip ^= 1
        if self.synchronous:
            for k, v in self._sources.items():
                host[k].copy_(v)
            self._pending = FutureTensors(host, None)
            return
        producer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(producer)
            for k, v in self._sources.items():
                host[k].copy_(v, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending = FutureTensors(host, event)

    def fence(self) -> None:
        """Make the current stream wait for the pending copies (if any): work queued after
        this cannot race them. A device-side wait on a recorded event; no host sync."""
        pending = self._pending
        if pending is not None and pending.event is not None:
            torch.cuda.current_stream(self.device).wait_event(pending.event)

    def consume(self, callback: Callable[[Dict[str, torch.Tensor]], None]) -> bool:
        """Hand the staged copies to ``callback``; False if nothing was staged. The pending
        stage is cleared before the callback runs, so a raising callback leaves none behind."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        callback(pending.get())
        return True
