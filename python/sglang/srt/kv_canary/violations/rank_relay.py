"""Abort mode on several TP ranks: containment as an input message, and the ranks' agreement
on the decisions containment makes from a rank's own view (docs/multi_rank_abort_design.md;
docs/user_guide.md, "Containment: --kv-canary abort").

A corruption is seen by one rank (its shard of the KV, its copy of ``req_to_token``), but
every TP rank runs the same scheduler and must abort the same requests and free the same pages
at the same loop iteration. The detecting rank's containment sends a
:class:`ContainmentNotice` (:class:`RankRelay`) to the scheduler input socket of TP rank 0,
whose ``recv_requests`` broadcasts it with the tokenizer's inputs to every rank; each rank
takes it out of that list before sglang dispatches it and applies it. Decisions read from a
rank's own rows, records or free pages go through :class:`RankAgreement` (one gather over
the TP CPU group, on the containment path only). Host only; nothing runs on a clean step.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from typing import Callable, List, MutableSequence, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class NoticeIncident:
    """One incident of a notice: its slot (``pool_kind``: a ``PoolKind``'s value) and what the
    detecting rank resolved: the message aborted requests get, the ids of the running requests
    to abort and of the requests holding a row whose release is guarded."""

    slot_idx: int
    pool_kind: str
    message: str
    running_rids: Tuple[str, ...]
    holding_rids: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ContainmentNotice:
    """What one rank's report asks every rank to contain: ``pool`` is ``"target"`` or
    ``"draft"`` (which canary of each scheduler applies it), ``origin`` the detecting rank as
    reports name it (``tp_rank 1, pp_rank 0, dp_rank 0``)."""

    pool: str
    origin: str
    incidents: Tuple[NoticeIncident, ...]


def take_containment_notices(recv_reqs: MutableSequence) -> List[ContainmentNotice]:
    """Remove the notices from a scheduler's input list (in place: sglang dispatches the rest
    by type and knows no notice) and return them, in order. Nothing to do for a list without
    one."""
    if not recv_reqs:
        return []
    notices = [r for r in recv_reqs if isinstance(r, ContainmentNotice)]
    if notices:
        recv_reqs[:] = [r for r in recv_reqs if not isinstance(r, ContainmentNotice)]
    return notices


class RankAgreement:
    """The ranks of one scheduler group deciding together. ``gather(obj)``: every rank's
    ``obj``, in rank order (the same call on every rank: ``torch.distributed``'s
    ``all_gather_object`` over the TP CPU group); ``ranks``: how many."""

    def __init__(self, gather: Callable[[object], List[object]], ranks: int):
        if ranks < 1:
            raise ValueError(f"RankAgreement needs at least one rank, got {ranks}")
        self._gather = gather
        self.ranks = ranks
        self.rounds = 0  # gathers made (each one on the containment path)

    @property
    def several(self) -> bool:
        return self.ranks > 1

    def gather(self, obj) -> List[object]:
        if not self.several:
            return [obj]
        self.rounds += 1
        out = list(self._gather(obj))
        if len(out) != self.ranks:
            raise RuntimeError(
                f"kv_canary: a containment agreement got {len(out)} answers from {self.ranks} ranks"
            )
        return out

    def any_of(self, mask: Sequence[bool]) -> List[bool]:
        """Element-wise OR of every rank's ``mask`` (each over the same list of requests)."""
        masks = self.gather([bool(m) for m in mask])
        if len({len(m) for m in masks}) != 1:
            raise RuntimeError(
                "kv_canary: the ranks disagree on the running requests a corrupt prefix may "
                f"touch ({[len(m) for m in masks]} requests): their schedulers are out of step"
            )
        return [any(col) for col in zip(*masks)]

    def common(self, pages: Sequence[int]) -> List[int]:
        """The pages every rank listed, sorted."""
        sets = [set(p) for p in self.gather(sorted(int(x) for x in pages))]
        return sorted(set.intersection(*sets))


SINGLE_RANK = RankAgreement(lambda obj: [obj], 1)


@dataclasses.dataclass(frozen=True)
class AgreedRelease:
    """One guarded release as the ranks agreed it (:func:`agree_release`): ``frees``, the
    pages every rank frees (sorted; the same on every rank); this rank's ``held_back`` (pages
    its frees name that are not freed) and ``reclaim`` (pages freed that its frees do not
    name); ``kept``: pages some rank's plan touched and none frees now, held back on every
    rank (the same on every rank; its pages that are free already are the caller's to
    drop)."""

    frees: Tuple[int, ...]
    held_back: Tuple[int, ...]
    reclaim: Tuple[int, ...]
    kept: Tuple[int, ...]


def agree_release(
    agreement: RankAgreement,
    *,
    entry_pages: Sequence[int],
    held_back: Sequence[int],
    reclaim: Sequence[int],
) -> AgreedRelease:
    """One guarded release (or eviction) agreed by the ranks. Each rank's own plan frees
    ``entry_pages`` (the pages its frees name) less ``held_back``, plus ``reclaim``; the ranks
    free the pages every rank would free, and nothing else: a page some rank still sees named
    by another holder (its view may be the uncorrupted one) is held back everywhere."""
    entries = set(int(p) for p in entry_pages)
    mine = (entries - set(int(p) for p in held_back)) | set(int(p) for p in reclaim)
    touched = entries | set(int(p) for p in held_back) | set(int(p) for p in reclaim)
    answers = agreement.gather((sorted(mine), sorted(touched)))
    agreed = set.intersection(*(set(a[0]) for a in answers))
    everyone = set().union(*(set(a[1]) for a in answers))
    return AgreedRelease(
        frees=tuple(sorted(agreed)),
        held_back=tuple(sorted(entries - agreed)),
        reclaim=tuple(sorted(agreed - entries)),
        kept=tuple(sorted(everyone - agreed)),
    )


class RankRelay:
    """A rank's way to TP rank 0's scheduler input: a ZeroMQ ``PUSH`` socket bound at an IPC
    endpoint of its own (:attr:`endpoint`). Rank 0's scheduler input socket (a ``PULL``)
    connects to every rank's (:func:`connect_input`); :meth:`send` queues one notice."""

    def __init__(self, *, origin: str, pool: str):
        import zmq

        self.origin = origin
        self.pool = pool
        self._context = zmq.Context(1)
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        path = os.path.join(tempfile.gettempdir(), f"kv_canary_containment_{uuid.uuid4().hex}")
        self.endpoint = f"ipc://{path}"
        self._socket.bind(self.endpoint)
        self.sent = 0

    def send(self, incidents: Sequence[NoticeIncident]) -> None:
        self._socket.send_pyobj(
            ContainmentNotice(pool=self.pool, origin=self.origin, incidents=tuple(incidents))
        )
        self.sent += 1

    def close(self) -> None:
        self._socket.close()
        self._context.term()


def connect_input(input_socket, endpoints: Sequence[str]) -> None:
    """TP rank 0: its scheduler's input ``PULL`` socket takes from every rank's relay too
    (ZeroMQ queues fairly among the endpoints a ``PULL`` socket connects to)."""
    for endpoint in endpoints:
        input_socket.connect(endpoint)
