"""Which requests a violation touches (docs/architecture.md, "Violation pipeline";
docs/user_guide.md, "Reading a violation report").

:class:`RequestResolver` names, for an incident, the reader (the request of the forward that
held the incident's ``req_to_token`` row, from that forward's own snapshot, so a request
finished since is still named) and every running request whose row maps a live position
(``< kv_allocated_len``) to the slot. Host only; on a step with an incident (and only then) it
reads the candidate rows back from the device: the canary's one intended host sync, declared
with :func:`violation_path_sync` and counted in ``RequestResolver.device_reads``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.jit_kernel.kv_canary.types import PoolKind
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.batch_state import ForwardRequests
from sglang.srt.kv_canary.violations.records import ViolationIncident


def _never(req) -> bool:
    return False


@contextlib.contextmanager
def violation_path_sync(device: torch.device):
    """Around the read-back of a step that reports an incident: lifts torch's CUDA sync debug
    mode for that read and restores it after (nothing to do off CUDA)."""
    if device.type != "cuda":
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


@dataclasses.dataclass(frozen=True, eq=False)
class IncidentRequests:
    """The requests one incident touches: ``rids`` (reader first, then by first sight) and,
    of them, ``running``: the ``Req`` objects not finished yet (what abort mode aborts), and
    ``holding``: those still holding a ``req_to_token`` row, finished or not (whose release
    abort mode guards). ``faked_transfer``: every request it touches is one whose KV transfer
    sglang faked on a PD decode server (nothing was sent to that slot: not a fault)."""

    rids: Tuple[str, ...]
    running: Tuple[object, ...]
    holding: Tuple[object, ...] = ()
    faked_transfer: bool = False


class RequestResolver:
    """``req_to_token``: the runner's int32 ``[rows, max_context_len]`` table;
    ``swa_index_lut``: the SWA group's full-slot -> SWA-slot table (None without SWA), to
    compare an SWA incident's slot with the rows' full slots. ``running_reqs`` and
    ``faked_transfer`` (set when the scheduler is attached) return the scheduler's running
    requests and whether sglang faked a request's KV transfer."""

    def __init__(self, *, req_to_token: torch.Tensor, swa_index_lut: Optional[torch.Tensor] = None):
        self.req_to_token = req_to_token
        self.swa_index_lut = swa_index_lut
        self.running_reqs: Callable[[], Sequence] = tuple
        self.faked_transfer: Callable[[object], bool] = _never
        self.device_reads = 0  # row read-backs (steps that reported an incident)

    def resolve(
        self, incidents: Sequence[ViolationIncident], forward: ForwardRequests
    ) -> List[IncidentRequests]:
        """One :class:`IncidentRequests` per incident, in order."""
        if not incidents:
            return []
        candidates, seen = [], set()
        for req in list(forward.reqs) + list(self.running_reqs()):
            if id(req) in seen or seam.req_done(req):
                continue
            seen.add(id(req))
            row = seam.req_pool_row(req)
            if row is not None and seam.req_kv_len(req) > 0:
                candidates.append((req, row, seam.req_kv_len(req)))
        mapped = self._mapped(incidents, candidates)
        out = []
        for i, inc in enumerate(incidents):
            reqs: List[object] = []
            row = inc.record.req_to_token_row
            if row >= 0:
                reqs += [r for r, snap in zip(forward.reqs, forward.rows) if snap == row]
            reqs += [candidates[j][0] for j in mapped[i]]
            unique: Dict[int, object] = {}
            for r in reqs:
                unique.setdefault(id(r), r)
            ordered = list(unique.values())
            out.append(
                IncidentRequests(
                    rids=tuple(dict.fromkeys(seam.req_rid(r) for r in ordered)),
                    running=tuple(r for r in ordered if not seam.req_done(r)),
                    holding=tuple(r for r in ordered if seam.req_pool_row(r) is not None),
                    faked_transfer=bool(ordered) and all(map(self.faked_transfer, ordered)),
                )
            )
        return out

    def _live_rows(self, rows: Sequence[int], lens: Sequence[int]):
        """``req_to_token[rows, :max(lens)]`` as int64 and the mask of each row's live
        entries (``< lens[i]``), on the table's device."""
        device = self.req_to_token.device
        width = max(lens)
        table = self.req_to_token[torch.tensor(rows, dtype=torch.int64).to(device), :width]
        lens_d = torch.tensor(lens, dtype=torch.int64).to(device)
        live = torch.arange(width, device=device)[None, :] < lens_d[:, None]
        return table.to(torch.int64), live

    def running_mapping_mask(self, slots: torch.Tensor) -> Tuple[List[object], List[bool]]:
        """The running requests (not finishing) holding live row entries, and for each
        whether one of them maps any of ``slots`` (int64 full-pool slots). One read-back;
        containment path only."""
        reqs = [
            r
            for r in self.running_reqs()
            if not seam.req_done(r) and seam.req_pool_row(r) is not None and seam.req_kv_len(r) > 0
        ]
        if not reqs or slots.numel() == 0:
            return reqs, [False] * len(reqs)
        device = self.req_to_token.device
        table, live = self._live_rows(
            [seam.req_pool_row(r) for r in reqs], [seam.req_kv_len(r) for r in reqs]
        )
        hit_d = (torch.isin(table, slots.to(device, torch.int64)) & live).any(dim=1)
        self.device_reads += 1
        with violation_path_sync(device):
            return reqs, hit_d.tolist()

    def _mapped(self, incidents, candidates) -> List[List[int]]:
        """For each incident, the candidates whose live row entries map its slot."""
        if not candidates:
            return [[] for _ in incidents]
        device = self.req_to_token.device
        table, live = self._live_rows([r for _, r, _ in candidates], [n for _, _, n in candidates])
        by_kind = {PoolKind.FULL: table}
        if self.swa_index_lut is not None:
            by_kind[PoolKind.SWA] = self.swa_index_lut.to(torch.int64)[table]
        hits = []
        for inc in incidents:
            slots = by_kind.get(inc.record.pool_kind)
            if inc.record.on_host_tier:
                slots = None  # a host-pool index, not a device slot: no request maps it
            if slots is None:
                hits.append(torch.zeros(len(candidates), dtype=torch.bool, device=device))
                continue
            slot = inc.record.slot_idx
            hits.append(((slots == slot) & live).any(dim=1))
        self.device_reads += 1
        with violation_path_sync(device):
            matrix = torch.stack(hits).tolist()  # the one read-back
        return [[j for j, hit in enumerate(row) if hit] for row in matrix]
