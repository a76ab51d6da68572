"""``--kv-canary abort`` and ``heal``: contain a violation and keep serving (docs/subsystems.md,
"Containment"; docs/user_guide.md, "Containment: --kv-canary abort" and "Self-healing:
--kv-canary heal").

:meth:`ContainmentManager.contain` (per reported incident) aborts every running request the
incident touches (:class:`~sglang.srt.kv_canary.violations.resolver.RequestResolver`) through
sglang's abort of running requests, marks them not to be inserted into the radix cache, and
remembers the slot. :meth:`ContainmentManager.after_batch_result` (scheduler thread, between
batches) evicts the radix nodes holding a remembered slot, with their subtrees, once no
running request locks them (one that does maps the slot: it is aborted too). Releases and
evictions go through :class:`~sglang.srt.kv_canary.violations.release_guard.ReleaseGuard`.

Heal mode (``heal_max`` set) takes a touched request back instead of aborting it: marked in
:meth:`ContainmentManager.contain`, taken out of the scheduler's batches with its KV freed
under the release guard in :meth:`ContainmentManager.before_batch_result` (before sglang
appends a token of the batch whose result comes next), queued again by
:meth:`ContainmentManager.after_batch_result` once no launched batch holds it and no corrupt
prefix is left to evict; sglang then recomputes it from its tokens. Past ``heal_max`` heals a
request is taken back all the same and then finished with abort mode's abort (its client gets
no token of the forward that read corrupt KV). A slot reported again by a forward launched
after its corrupt content was freed (evicted, released: it was handed out, written and found
corrupt once more) is retired: its page is taken out of the allocator for the server's life
(a stuck bit, a bad page), up to ``retire_max_fraction`` of the pool's slots.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from sglang.jit_kernel.kv_canary.consts import FailReason
from sglang.jit_kernel.kv_canary.types import PoolKind
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.radix_cache_walker import radix_nodes_holding_slots
from sglang.srt.kv_canary.violations.rank_relay import (
    SINGLE_RANK,
    ContainmentNotice,
    NoticeIncident,
    RankAgreement,
    RankRelay,
)
from sglang.srt.kv_canary.violations.release_guard import ReleaseGuard
from sglang.srt.kv_canary.violations.resolver import IncidentRequests, RequestResolver
from sglang.srt.kv_canary.violations.lines import format_rids, parse_rids
from sglang.srt.kv_canary.violations.records import ViolationIncident

logger = logging.getLogger(__name__)

ABORT_MESSAGE_PREFIX = "kv_canary: KV cache corruption detected"
# the message of a request aborted because it locks a cached prefix holding a corrupt slot
# (it is in no violation line's ``rids=``: it was admitted, or locked the prefix, later)
PREFIX_ABORT_MESSAGE = f"{ABORT_MESSAGE_PREFIX} (a cached prefix it shares held a corrupt slot)"
# heal mode's abort of a request healed SGLANG_KV_CANARY_MAX_HEALS times: what the message ends with
HEALS_SUFFIX_RE = re.compile(r", after (\d+) heal\(s\)\)$")
PREFIX_ABORT_LINE_PREFIX = "kv_canary abort: aborted the running requests locking a corrupt prefix:"
HEAL_LINE_PREFIX = "kv_canary heal: took back"
RETIRE_LINE_PREFIX = "kv_canary heal: retired"
RETIRE_BUDGET_LINE_PREFIX = "kv_canary heal: not retired"
REQUEUE_LINE_PREFIX = "kv_canary heal: queued again"
HEAL_ABORT_LINE_PREFIX = "kv_canary heal: took back and aborted"
_HEAL_RE = re.compile(re.escape(HEAL_LINE_PREFIX) + r" rids=(\S+)")
# several ranks: each rank's line when it applies a notice (the same request ids on every rank)
NOTICE_LINE_PREFIX = "kv_canary abort: applied the containment reported by"
_NOTICE_RE = re.compile(re.escape(NOTICE_LINE_PREFIX) + r" (.+?): aborted rids=(\S+)")
_PREFIX_ABORT_RE = re.compile(re.escape(PREFIX_ABORT_LINE_PREFIX) + r" rids=(\S+)")


class TakeBacks(NamedTuple):
    """What one :meth:`ContainmentManager.before_batch_result` did: requests taken back to be
    computed again, and taken back and aborted (past their heals)."""

    healed: int
    aborted: int


def prefix_abort_message(heals: int = 0) -> str:
    """What a request aborted for locking a corrupt prefix receives; ``heals``: as for
    :func:`abort_message`."""
    if not heals:
        return PREFIX_ABORT_MESSAGE
    return f"{PREFIX_ABORT_MESSAGE[:-1]}, after {heals} heal(s))"


def abort_message(incident: ViolationIncident, *, heals: int = 0) -> str:
    """What an aborted request's client receives (its finish reason's message); ``heals``:
    heal mode's heals of the request before this abort (0: abort mode)."""
    after = f", after {heals} heal(s)" if heals else ""
    return (
        f"{ABORT_MESSAGE_PREFIX} (launch_tag={incident.record.tag_name}, "
        f"fail_reason={FailReason.describe(incident.fail_bits)}{after})"
    )


class ContainmentManager:
    """Abort mode's containment. ``resolver``: the manager's request resolver (its
    ``req_to_token`` and running requests); ``swa_index_lut``: the SWA group's full -> SWA
    table (an SWA incident's slot is found back as the full slots mapping to it);
    ``records``: the full pool's TAIL canary buffer (the release guard's records);
    ``heal_max``: heal mode's heals of one request before it is aborted (None: abort mode);
    ``retire_after``: heal mode's reports of a slot after its corrupt content was freed before
    the slot is retired; ``retire_max_fraction``: heal mode retires at most this fraction of
    the pool's slots (whole pages, rounded down; 0: none)."""

    def __init__(
        self,
        *,
        resolver: RequestResolver,
        swa_index_lut: Optional[torch.Tensor],
        records: torch.Tensor,
        heal_max: Optional[int] = None,
        retire_after: int = 1,
        retire_max_fraction: float = 0.01,
    ):
        self.resolver = resolver
        self.swa_index_lut = swa_index_lut
        self.records = records
        self.radix_cache = None
        self.guard: Optional[ReleaseGuard] = None  # the tree cache's (attach_radix_cache)
        self.aborted_requests = 0  # requests this manager aborted, over the server's life
        self.evicted_nodes = 0
        self.evicted_tokens = 0
        self._slots: List[int] = []  # full-pool slots whose radix nodes must go
        self._aborted: List[object] = []  # requests aborted for them, until they release
        # several TP ranks (attach_ranks): reports go to every rank as notices, and the
        # decisions read from this rank's own view are agreed
        self.relay: Optional[RankRelay] = None
        self.agreement: RankAgreement = SINGLE_RANK
        self.applied_notices = 0
        # heal mode: the scheduler's retraction (attach_retraction), the requests marked to be
        # taken back, those taken back and not queued again yet
        self.heal_max = heal_max
        self.retraction = None
        # (request, None) to heal; (request, message): past heal_max, finished with that abort
        self._to_heal: List[Tuple[object, Optional[str]]] = []
        self._healed: List[object] = []
        self.healed_requests = 0  # heals, over the server's life (a request may count twice)
        # taken-back requests until their next token: (request, take-back time, outputs then)
        self._healing: List[Tuple[object, float, int]] = []
        self._heal_seconds: List[float] = []  # not yet taken (take_heal_seconds)
        # slot -> the newest forward step launched when its corrupt content was freed (a
        # report from a forward launched after that is new); pages retired (never handed out
        # again), and those of them out of the allocator by now
        self._cleared: Dict[int, int] = {}
        self.retire_after = retire_after
        self.retire_max_fraction = retire_max_fraction
        self._retire_max_pages = 0  # attach_retraction: the fraction of the pool, in pages
        self.retire_refused = 0  # slots found corrupt again with the retirement budget spent
        self._refused_pages: set = set()  # pages whose refusal was logged
        self._again: dict = {}  # slot -> reports after its content was freed
        self.retired_pages: set = set()
        self._retired_out: set = set()
        self._page_size = 1

    @property
    def heals(self) -> bool:
        return self.heal_max is not None

    @property
    def heal_pending(self) -> bool:
        """Heal mode: requests marked to be taken back, or taken back and not queued again."""
        return bool(self._to_heal or self._healed)

    def attach_retraction(self, retraction) -> None:
        """Heal mode: the scheduler's :class:`~sglang.srt.kv_canary.sglang_seam.SchedulerRetraction`
        (start-up, after :meth:`attach_radix_cache`): the tree cache's allocator drops frees
        of retired pages from now on."""
        self.retraction = retraction
        if self.radix_cache is not None:
            allocator = seam.tree_cache_allocator(self.radix_cache)
            self._page_size = seam.allocator_page_size(allocator)
            self._retire_max_pages = (
                int(self.retire_max_fraction * seam.allocator_size(allocator)) // self._page_size
            )
            seam.allocator_retiring(allocator, self.retired_pages, self._retired_out.update)

    @property
    def retired_slots(self) -> int:
        """Slots of retired pages out of the allocator (sglang's pool accounting counts them
        as held: ``Scheduler._session_held_tokens``)."""
        return len(self._retired_out) * self._page_size

    def _retire(self, slot: int) -> None:
        page = slot // self._page_size
        if page in self.retired_pages or self.radix_cache is None:
            return
        unit = "slot" if self._page_size == 1 else f"page of {self._page_size} slots"
        if len(self.retired_pages) >= self._retire_max_pages:
            self.retire_refused += 1
            if page in self._refused_pages:  # said once per page; the counter counts each
                return
            self._refused_pages.add(page)
            logger.warning(
                "%s %s %d (found corrupt again after its corrupt content was freed): %d "
                "slot(s) retired already, the most SGLANG_KV_CANARY_RETIRE_MAX_FRACTION=%g "
                "of the pool allows; it stays in service (said once per page)",
                RETIRE_BUDGET_LINE_PREFIX,
                unit,
                page,
                len(self.retired_pages) * self._page_size,
                self.retire_max_fraction,
            )
            return
        self.retired_pages.add(page)
        allocator = seam.tree_cache_allocator(self.radix_cache)
        if seam.allocator_take_out(allocator, torch.tensor([page], dtype=torch.int64)):
            self._retired_out.add(page)
        logger.warning(
            "%s %s %d (found corrupt again after its corrupt content was freed): never "
            "handed out again (retired slots: %d)",
            RETIRE_LINE_PREFIX,
            unit,
            page,
            len(self.retired_pages) * self._page_size,
        )

    def attach_ranks(self, relay: RankRelay, agreement: RankAgreement) -> None:
        """Several TP ranks (start-up, after :meth:`attach_radix_cache`): :meth:`contain`
        sends its incidents to every rank through ``relay`` instead of acting, each rank acts
        in :meth:`apply`, and the locked-prefix aborts and the release guard decide through
        ``agreement``."""
        self.relay = relay
        self.agreement = agreement
        if self.guard is not None:
            self.guard.agreement = agreement

    def attach_radix_cache(self, radix_cache) -> None:
        """The scheduler's tree cache (start-up). Refuses a radix cache whose nodes the canary
        cannot evict, naming it (a cache that is no tree, ``ChunkCache``, has nothing to
        evict)."""
        if isinstance(
            radix_cache, seam.radix_cache_types()
        ) and not seam.radix_subtree_eviction_supported(radix_cache):
            raise RuntimeError(
                f"--kv-canary abort cannot evict corrupt prefixes from {type(radix_cache).__name__}"
                " (it evicts from sglang's RadixCache only); use --kv-canary raise or log, or "
                "--disable-radix-cache"
            )
        self.radix_cache = radix_cache
        # one guard per tree cache: an EAGLE draft pool's canary shares the target's requests
        # and slots, and the target's records name their tokens
        if radix_cache is not None and seam.release_guard_of(radix_cache) is None:
            self.guard = ReleaseGuard(
                records=self.records,
                req_to_token=self.resolver.req_to_token,
                live_reqs=lambda: self.resolver.running_reqs(),
                radix_cache=radix_cache,
            )
            seam.set_release_guard(radix_cache, self.guard)

    @property
    def pending_slots(self) -> Sequence[int]:
        return tuple(self._slots)

    def contain(
        self,
        incidents: Sequence[ViolationIncident],
        touched: Sequence[IncidentRequests],
        *,
        step: int,
    ) -> int:
        """Abort the running requests each incident touches and remember its slots; returns
        how many requests were aborted now. ``step``: the canary step of the forward whose
        checks found the incidents. On several ranks nothing is aborted here: the incidents
        go to every rank (:meth:`apply`, at the iteration rank 0 receives them)."""
        if self.relay is not None:
            self.relay.send(
                [
                    NoticeIncident(
                        slot_idx=inc.record.slot_idx,
                        pool_kind=inc.record.pool_kind.value,
                        message=abort_message(inc),
                        running_rids=tuple(seam.req_rid(r) for r in reqs.running),
                        holding_rids=tuple(seam.req_rid(r) for r in reqs.holding),
                    )
                    for inc, reqs in zip(incidents, touched)
                ]
            )
            return 0
        aborted = 0
        for inc, reqs in zip(incidents, touched):
            for req in reqs.holding:
                seam.mark_contained(req)
            for req in reqs.running:
                seam.mark_no_radix_insert(req)
                heals = seam.req_heals(req) if self.heals else 0
                message = abort_message(inc, heals=heals)
                if self._heal_later(req, message):
                    continue
                if seam.abort_running_req(req, message):
                    aborted += 1
                    self._aborted.append(req)
            self._remember(inc, step)
        self.aborted_requests += aborted
        return aborted

    def _heal_later(self, req, message: str) -> bool:
        """Heal mode (True; False: abort mode): mark ``req`` to be taken back, to be queued
        again or, healed ``heal_max`` times already, finished with an abort carrying
        ``message``."""
        if not self.heals:
            return False
        seam.mark_contained(req)  # its release is guarded
        if not any(r is req for r, _ in self._to_heal):
            over = seam.req_heals(req) >= self.heal_max
            self._to_heal.append((req, message if over else None))
        return True

    def before_batch_result(self) -> "TakeBacks":
        """Heal mode, before the scheduler processes a batch result (and at the idle step):
        every marked request still running is taken out of the scheduler's batches, its KV
        freed under the release guard, and reset for recomputation; sglang then appends no
        token of it from any launched batch. One healed ``heal_max`` times is then finished
        with its abort instead (its output as sent before: no token of the forward that read
        corrupt KV). The request being prefilled chunk by chunk waits for its last chunk.
        Host work only while requests are marked."""
        if not self._to_heal or self.retraction is None:
            return TakeBacks(0, 0)
        taken, ended, waiting = [], [], []
        for req, message in self._to_heal:
            if seam.req_done(req) or seam.req_pool_row(req) is None:
                continue  # finished, aborted or released since its report: nothing to heal
            if self.retraction.is_chunked(req):
                waiting.append((req, message))
                continue
            self.retraction.take_back(req, self._release)
            if message is not None:
                self.retraction.finish_aborted(req, message)
                ended.append(req)
                continue
            seam.count_heal(req)
            taken.append(req)
            self._healed.append(req)
            if all(r is not req for r, _, _ in self._healing):  # timed from its first take-back
                self._healing.append((req, time.monotonic(), seam.req_output_count(req)))
        self._to_heal = waiting
        if taken:
            self.healed_requests += len(taken)
            logger.warning(
                "%s rids=%s (their KV freed; computed again from their tokens)",
                HEAL_LINE_PREFIX,
                format_rids([seam.req_rid(r) for r in taken]),
            )
        if ended:
            self.aborted_requests += len(ended)
            logger.warning(
                "%s rids=%s (their KV freed; healed %d time(s) already)",
                HEAL_ABORT_LINE_PREFIX,
                format_rids([seam.req_rid(r) for r in ended]),
                self.heal_max,
            )
        return TakeBacks(healed=len(taken), aborted=len(ended))

    def _time_heals(self) -> None:
        """Heal mode: a taken-back request with a token more than at its take-back has been
        computed again: its time since the take-back is recorded; one finished without it
        (aborted past its heals, or stopped) is forgotten."""
        now, left = time.monotonic(), []
        for req, t0, outputs in self._healing:
            if seam.req_output_count(req) > outputs:
                self._heal_seconds.append(now - t0)
            elif not seam.req_done(req):
                left.append((req, t0, outputs))
        self._healing = left

    def take_heal_seconds(self) -> List[float]:
        """Heal mode: the healed requests' times from take-back to their next token recorded
        since the last call (the metrics' histogram)."""
        out, self._heal_seconds = self._heal_seconds, []
        return out

    def _release(self, req, free) -> None:
        guard = self.guard
        if guard is None:
            free()
            return
        with guard.releasing(req, self.radix_cache):
            free()

    def _requeue_healed(self) -> None:
        """Heal mode: queue again the taken-back requests no launched batch holds any more,
        once no corrupt prefix is left in the radix cache (they would read it again)."""
        if not self._healed or self._slots:
            return
        ready = [r for r in self._healed if not self.retraction.in_flight(r)]
        if not ready:
            return
        self._healed = [r for r in self._healed if all(r is not x for x in ready)]
        for req in ready:
            seam.unmark_contained(req)
            seam.unmark_no_radix_insert(req)
            self.retraction.requeue(req)
        logger.info(
            "%s rids=%s", REQUEUE_LINE_PREFIX, format_rids([seam.req_rid(r) for r in ready])
        )

    def apply(self, notice: ContainmentNotice) -> int:
        """Several ranks: what :meth:`contain` does on one rank, for a notice every rank
        received in the same iteration's inputs: the running requests it names are aborted
        and the holders' releases guarded, by request id (the ranks hold the same requests),
        and its slots remembered. Requests that finished since the report are not here any
        more (named, not aborted). Returns how many requests were aborted; logs the ids."""
        live = {seam.req_rid(r): r for r in self.resolver.running_reqs()}
        aborted, rids = 0, []
        for inc in notice.incidents:
            for rid in inc.holding_rids:
                req = live.get(rid)
                if req is not None and seam.req_pool_row(req) is not None:
                    seam.mark_contained(req)
            for rid in inc.running_rids:
                req = live.get(rid)
                if req is None:
                    continue
                seam.mark_no_radix_insert(req)
                if seam.abort_running_req(req, inc.message):
                    aborted += 1
                    rids.append(rid)
                    self._aborted.append(req)
            self._remember_slot(inc.slot_idx, PoolKind(inc.pool_kind), None)
        self.aborted_requests += aborted
        self.applied_notices += 1
        logger.warning(
            "%s %s: aborted rids=%s", NOTICE_LINE_PREFIX, notice.origin, format_rids(rids)
        )
        return aborted

    def _remember(self, inc: ViolationIncident, step: Optional[int]) -> None:
        self._remember_slot(inc.record.slot_idx, inc.record.pool_kind, step)

    def _remember_slot(self, slot: int, kind: PoolKind, step: Optional[int]) -> None:
        """``step``: the forward's canary step whose checks found it (None: not a forward's,
        never a report of a slot again)."""
        if kind == PoolKind.FULL:
            full = [slot]
        elif self.swa_index_lut is not None:
            full = (self.swa_index_lut == slot).nonzero().flatten().tolist()
        else:
            full = []
        for s in full:
            if s <= 0:  # slot 0 is the pool's padding slot
                continue
            cleared_at = self._cleared.get(s)
            if cleared_at is not None and step is not None:  # heal mode: freed since a report
                if step <= cleared_at:
                    # a forward launched before the free read the old content: its readers
                    # are marked; the content is gone, nothing to evict, no news of the slot
                    continue
                # corrupt again in a forward launched after its content was freed
                del self._cleared[s]
                self._again[s] = self._again.get(s, 0) + 1
                if self._again[s] >= self.retire_after:
                    self._retire(s)
            if s not in self._slots:
                self._slots.append(s)

    def after_batch_result(self, *, launched_step: int) -> int:
        """Settle held-back pages (the release guard), evict what can be evicted now; returns
        the number of requests aborted because they lock a node holding a corrupt slot.
        ``launched_step``: the canary step of the newest forward launched (heal mode: a slot
        freed now is news again only in a later forward's report). Host work only while pages
        are held back or slots are pending."""
        if self.guard is not None:
            self.guard.settle(self.radix_cache)
        if self._healing:
            self._time_heals()
        if not self._slots:
            if self.heals:
                self._requeue_healed()
            return 0
        self._aborted = [r for r in self._aborted if seam.req_pool_row(r) is not None]
        slots = torch.tensor(self._slots, dtype=torch.int64)
        nodes = (
            radix_nodes_holding_slots(radix_cache=self.radix_cache, slots=slots)
            if self.radix_cache is not None
            else []
        )
        locked = False
        for node in nodes:
            if seam.radix_subtree_evictable(self.radix_cache, node):
                guard = (
                    self.guard.evicting(self.radix_cache, node)
                    if self.guard is not None
                    else contextlib.nullcontext()
                )
                with guard:
                    freed = seam.radix_evict_subtree(self.radix_cache, node)
                self.evicted_tokens += freed
                self.evicted_nodes += 1
                logger.warning(
                    "kv_canary abort: evicted a radix-cache prefix holding a corrupt "
                    "slot (%d token(s) with its descendants)",
                    freed,
                )
            else:
                locked = True
        aborted = 0
        if locked:  # a running request holds the corrupt prefix: it reads corrupt KV
            rids = []
            reqs, hit = self.resolver.running_mapping_mask(slots)
            hit = self.agreement.any_of(hit) if self.agreement.several else hit
            for req in (r for r, h in zip(reqs, hit) if h):
                seam.mark_no_radix_insert(req)
                heals = seam.req_heals(req) if self.heals else 0
                if self._heal_later(req, prefix_abort_message(heals)):
                    continue
                if seam.abort_running_req(req, prefix_abort_message(heals)):
                    aborted += 1
                    rids.append(seam.req_rid(req))
                    self._aborted.append(req)
            if rids:
                logger.warning("%s rids=%s", PREFIX_ABORT_LINE_PREFIX, format_rids(rids))
            self.aborted_requests += aborted
        elif not self._aborted:
            if self.heals:  # their corrupt content is freed: a later forward's report is new
                self._cleared.update((s, launched_step) for s in self._slots)
            self._slots = []
        if self.heals:
            self._requeue_healed()
        return aborted


def parse_notice_lines(log: str) -> List[Tuple[str, Tuple[str, ...]]]:
    """Every applied-notice line in ``log`` (:meth:`ContainmentManager.apply`): (the
    detecting rank as named, the request ids aborted), in log order."""
    return [(m.group(1), parse_rids(m.group(2))) for m in _NOTICE_RE.finditer(log)]


def parse_healed_rids(log: str) -> Tuple[str, ...]:
    """The request ids of every heal line in ``log`` (:meth:`ContainmentManager.before_batch_result`),
    in log order (a request healed twice appears twice)."""
    return tuple(rid for m in _HEAL_RE.finditer(log) for rid in parse_rids(m.group(1)))


def parse_prefix_abort_rids(log: str) -> Tuple[str, ...]:
    """The request ids of every prefix-abort line in ``log`` (the WARNING
    :meth:`ContainmentManager.after_batch_result` writes when it aborts the requests locking
    a corrupt prefix), in log order."""
    return tuple(rid for m in _PREFIX_ABORT_RE.finditer(log) for rid in parse_rids(m.group(1)))
