"""``SnapshotHostBuffers``: the reused host buffers token-id snapshots are packed into
(docs/subsystems.md, "Token checks"). Caller: ``token_history`` (``TokenIdSnapshot.pack``
takes, binds and, after each host→device copy, marks them sent). Host only, on sglang's
scheduler thread; never inside a CUDA-graph capture.
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Tuple

import numpy as np
import torch

from sglang.srt.kv_canary import cuda_streams


class SnapshotHostBuffers:
    """The host buffers token-id snapshots are packed into, reused instead of allocated per
    snapshot (docs/subsystems.md, "Token checks"): ``slots`` buffers of ``numel`` int64
    words each, allocated here, for copies to ``device`` (pinned when it is a CUDA device). A
    slot is handed out again only when the snapshot packed in it is gone (nothing can upload
    it again) and, on CUDA, its last host→device copy has completed (:meth:`sent` records
    that copy's event on ``device``'s current stream); a snapshot that finds no slot free,
    or that is larger than a slot (a long prompt's first chunk carries the whole prompt), gets
    a buffer of its own (counted in ``own_buffers``). Host only, on sglang's scheduler thread;
    never inside a CUDA-graph capture."""

    def __init__(self, *, slots: int, numel: int, device: torch.device):
        if slots < 1 or numel < 1:
            raise ValueError(
                f"SnapshotHostBuffers needs slots >= 1 and numel >= 1, got {slots} and {numel}"
            )
        device = torch.device(device)
        pin = self._pin = device.type == "cuda"
        # the device whose current stream the copies are queued on (CUDA only)
        self._device_index = cuda_streams.device_index(device)
        self.numel = numel
        # per slot: the buffer (owned here for the canary's lifetime) and its numpy view
        self._buffers = [
            torch.empty(numel, dtype=torch.int64, pin_memory=pin) for _ in range(slots)
        ]
        self._views = [b.numpy() for b in self._buffers]
        self._users: List[Optional[weakref.ref]] = [None] * slots
        self._copies: List[Optional["torch.cuda.Event"]] = [None] * slots
        self._next = 0
        self.own_buffers = 0  # snapshots packed outside the slots (none free, or too large)

    def _free(self, slot: int) -> bool:
        user, copy = self._users[slot], self._copies[slot]
        return (user is None or user() is None) and (copy is None or copy.query())

    def take(self, numel: int) -> Tuple[np.ndarray, int]:
        """A 1-D int64 host buffer of ``numel`` elements, as a numpy view (cheaper to slice
        than a tensor), and its slot (-1: its own buffer); bound to the snapshot by
        :meth:`bind`."""
        slots = len(self._buffers)
        if numel <= self.numel:
            for i in range(slots):
                slot = (self._next + i) % slots
                if self._free(slot):
                    self._next = (slot + 1) % slots
                    self._users[slot] = None
                    return self._views[slot][:numel], slot
        self.own_buffers += 1
        return torch.empty(numel, dtype=torch.int64, pin_memory=self._pin).numpy(), -1

    def bind(self, snap) -> None:
        """``snap`` (a ``token_history.TokenIdSnapshot``) is packed in its slot
        (``snap.buffer_slot``): the slot stays taken while it exists."""
        if snap.buffer_slot >= 0:
            self._users[snap.buffer_slot] = weakref.ref(snap)

    def sent(self, snap) -> None:
        """A host→device copy of ``snap.packed`` was just queued on the current stream: its
        slot is not reused before that copy completes. No host sync."""
        slot = snap.buffer_slot
        if slot >= 0 and self._pin:
            if self._copies[slot] is None:
                self._copies[slot] = torch.cuda.Event()
            self._copies[slot].record(cuda_streams.current_stream(self._device_index))
