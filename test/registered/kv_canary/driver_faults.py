"""The fault injectors of the serving driver (``serving_driver.ServingDriver`` inherits
them): each corrupts one thing once, on request, as a server bug or a bad transfer would, and
returns what it changed, so a test can match the canary's report to the fault. They work on
the driver's running requests, pools and tables (``self``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from serving_driver import DriverReq


class DriverFaults:
    def victim_request(self) -> DriverReq:
        reqs = [r for r in self.running if r.prefilled and r.kv_len >= 4]
        if not reqs:
            raise RuntimeError("driver: no running request with a prefix to corrupt")
        return self.rng.choice(reqs)

    def fault_swap_req_to_token(self) -> dict:
        """Point one position of a running request at another live request's slot."""
        victim = self.victim_request()
        others = [
            s for r in self.running if r is not victim for s in r.slots if s not in victim.slots
        ]
        if not others:
            raise RuntimeError("driver: no other live slot to swap in")
        p = self.rng.randrange(1, victim.kv_len - 1)
        new = self.rng.choice(others)
        old = int(self.req_to_token_pool.req_to_token[victim.row, p])
        self.req_to_token_pool.req_to_token[victim.row, p] = (
            new  # the scheduler's view is unchanged
        )
        return dict(rid=victim.rid, row=victim.row, position=p, old_slot=old, new_slot=new)

    def fault_swap_same_position(self) -> dict:
        """Point position p of a running request at the slot holding position p of another
        running request whose token there differs. Prefers a pair sharing the prefix
        [0, p) (through the same slots): then the swapped slot's chain hash is consistent and
        only its token is wrong (``shared_prefix`` in the result)."""
        pairs = [
            (v, o)
            for v in self.running
            for o in self.running
            if v is not o and v.prefilled and o.prefilled
        ]
        for want_shared in (True, False):
            for victim, other in pairs:
                for p in range(1, min(victim.kv_len, other.kv_len) - 1):
                    shared = victim.slots[:p] == other.slots[:p]
                    if shared != want_shared and want_shared:
                        continue
                    if victim.tokens[p] != other.tokens[p] and other.slots[p] not in victim.slots:
                        new = other.slots[p]
                        old = int(self.req_to_token_pool.req_to_token[victim.row, p])
                        self.req_to_token_pool.req_to_token[victim.row, p] = new
                        return dict(
                            rid=victim.rid,
                            position=p,
                            old_slot=old,
                            new_slot=new,
                            victim_token=victim.tokens[p],
                            other_token=other.tokens[p],
                            shared_prefix=shared,
                        )
        raise RuntimeError("driver: no same-position slot with a different token")

    def fault_flip_kv_byte(self, byte: int = 0) -> dict:
        """Flip byte ``byte`` (negative: from the end) of layer 0's K row of a slot a running
        request reads."""
        victim = self.victim_request()
        p = self.rng.randrange(0, victim.kv_len - 1)
        slot = victim.slots[p]
        rows = (
            self.kv_pool.kv_buffer if self.pool_kind in ("mla", "nsa") else self.mha_pool.k_buffer
        )
        row = rows[0][slot].view(torch.uint8).view(-1)
        old = int(row[byte])
        row[byte] ^= 0xFF
        return dict(
            rid=victim.rid, row=victim.row, position=p, slot=slot, old=old, new=int(row[byte])
        )

    def layer_rows(self, layer: int, half: str):
        """The pool's per-layer buffer of (local) ``layer`` and ``half`` ('k' or 'v'); MLA
        pools have K (latent) rows only."""
        if self.pool_kind in ("mla", "nsa"):
            if half != "k":
                raise RuntimeError("driver: MLA pools have no V rows")
            return self.kv_pool.kv_buffer[layer]
        pool = self.kv_pool.swa_kv_pool if self.pool_kind == "swa" else self.mha_pool
        return (pool.k_buffer if half == "k" else pool.v_buffer)[layer]

    def fault_flip_layer_byte(self, layer: int, half: str, *, slot=None) -> dict:
        """Flip the first byte of ``layer``'s ``half`` row of a slot a running request reads
        (or of ``slot``)."""
        info = {}
        if slot is None:
            victim = self.victim_request()
            p = self.rng.randrange(0, victim.kv_len - 1)
            slot = victim.slots[p]
            info = dict(rid=victim.rid, row=victim.row, position=p)
        row = self.layer_rows(layer, half)[slot].view(torch.uint8).view(-1)
        row[0] ^= 0x01
        return dict(info, slot=slot, layer=layer, half=half)

    def shifted_chunk_batch(self, shift: int = 1):
        """A new request's second prefill chunk with its positions off by ``shift`` (a
        scheduler that got them wrong): returns ``(batch, info)``; the batch writes slot
        ``info["slot"]`` at position ``info["position"]`` where the chain expects
        ``info["expected_position"]``. Its first chunk runs here, correctly."""
        req = self.add_request(prompt_len=2 * self.chunk, max_new=2)
        self.waiting.remove(req)
        self.waiting.insert(0, req)
        self._admit()
        self._forward(self._extend_batch([req]))
        fb = self._extend_batch([req])
        fb.positions += shift
        return fb, dict(
            rid=req.rid,
            row=req.row,
            slot=req.slots[self.chunk],
            position=self.chunk + shift,
            expected_position=self.chunk,
        )

    def window_positions(self, req: DriverReq) -> range:
        """Positions the next decode forward's SWA verify covers for ``req``."""
        return range(max(0, req.kv_len - self.swa_window), req.kv_len)

    def _flip_swa_byte(self, swa_slot: int, part: str) -> tuple:
        if self.pool_kind == "swa":
            row = self.kv_pool.swa_kv_pool.k_buffer[0][swa_slot].view(torch.uint8).view(-1)
            return row, 0
        swa = self.kv_pool.swa_kv_pool
        page, off = divmod(swa_slot, swa.page_size)
        row = swa.kv_buffer[0][page]
        if part == "data":
            return row, off * 576
        return row, swa.page_size * 576 + off * 8

    def fault_flip_swa_kv_byte(self, *, inside_window: bool = True, part: str = "data") -> dict:
        """Flip one byte of layer 0's SWA KV of a running request's position: inside the
        window the next decode reads (``inside_window``), or resident in the SWA pool but
        behind the window (never read again). ``part`` (dsv4): ``data`` (first nope byte) or
        ``scale`` (first scale byte) of the 584-byte token record."""
        if self.pool_kind == "mha":
            raise RuntimeError("driver: fault_flip_swa_kv_byte needs pool='swa' or 'dsv4'")
        for victim in self.rng.sample(self.running, len(self.running)):
            if not victim.prefilled:
                continue
            window = self.window_positions(victim)
            cands = list(window)[:-1] if inside_window else range(victim.swa_evicted, window.start)
            cands = [
                p
                for p in cands
                if self.swa_slot(victim.slots[p]) > 0 and self.slot_refs[victim.slots[p]] == 1
            ]
            if cands:
                p = self.rng.choice(cands)
                slot = victim.slots[p]
                swa_slot = self.swa_slot(slot)
                row, i = self._flip_swa_byte(swa_slot, part)
                old = int(row[i])
                row[i] ^= 0xFF
                return dict(
                    rid=victim.rid,
                    position=p,
                    slot=slot,
                    swa_slot=swa_slot,
                    old=old,
                    new=int(row[i]),
                    window=(window.start, window.stop),
                )
        raise RuntimeError(
            "driver: no SWA-resident position "
            f"{'inside' if inside_window else 'behind'} a window to corrupt"
        )

    def fault_flip_record_field(self, *, buffer: str = "k_head", field: int = 1) -> dict:
        """Flip a bit of one int64 field of a live slot's canary record."""
        victim = self.victim_request()
        p = self.rng.randrange(0, victim.kv_len - 1)
        slot = victim.slots[p]
        words = getattr(self.groups[0], buffer).view(torch.int64)
        old = int(words[slot, field])
        words[slot, field] ^= 1 << 3
        return dict(
            rid=victim.rid, position=p, slot=slot, field=field, old=old, new=int(words[slot, field])
        )

    def fault_reuse_referenced_slot(self) -> dict:
        """Free a slot still referenced by a running request and hand it to a new request,
        which then writes its own KV (and canary record) into it."""
        victim = self.victim_request()
        p = self.rng.randrange(1, victim.kv_len - 1)
        slot = victim.slots[p]
        self.allocator.free_pages = torch.cat(
            [
                torch.tensor([slot], dtype=torch.int64, device=self.device),
                self.allocator.free_pages[self.allocator.free_pages != slot],
            ]
        )
        thief = self.add_request(prompt_len=3, max_new=2)
        self.waiting.remove(thief)
        self.waiting.insert(0, thief)
        return dict(rid=victim.rid, position=p, slot=slot, thief=thief.rid)
