"""A deterministic serving loop over real sglang 0.5.12 pools and ForwardBatch objects, with
the canary's four phases around every forward (test support for the runtime suites).

What it exercises: chunked prefill (EXTEND with prefixes), decode, several requests sharing a
prefix through ``req_to_token`` (as the radix cache does), requests finishing and their
``req_to_token`` rows and KV slots being reused, optional decode CUDA graphs (the two
"maybe inside graph" phases captured, replayed with the real batch copied in; on the CPU a
:class:`CpuGraph` stands in for the CUDA graph). The "model"
writes KV bytes that are a deterministic function of (token, position, layer) into every
layer of the real ``MHATokenToKVPool``.

``pool="swa"`` runs the same loop over a real ``SWAKVPool`` (layer 0 sliding-window, layer 1
full; ``swa_only``: layer 0 alone, an MTP draft model's pool) with a real ``SWATokenToKVPoolAllocator``, so the full → SWA table is filled by real
allocations; decode steps evict SWA slots behind the window as sglang's
``ScheduleBatch._evict_swa`` does (every ``swa_evict_interval`` steps, positions below
``prefix - window - page_size``, never slots another running request shares).
``pool="dsv4"`` uses a real ``DeepSeekV4TokenToKVPool`` with the same allocator and eviction,
writing the SWA sub-pool's 584-byte token records with sglang's own ``SetKAndS`` (torch path).

Fault injectors (``driver_faults.DriverFaults``; each done once, on request) return what they
changed, so a test can match the canary's report to the fault. The driver's pools and model
(``driver_pools.DriverPools``) and its forward and decode graphs (``driver_forward``) are mixed
in the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import types
from typing import Dict, List, Optional

import torch

from driver_faults import DriverFaults
from driver_forward import CpuGraph, DriverForward
from driver_pools import DriverPools
from sglang.srt.kv_canary.builder import build_canary
from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

# what the suites import from this module (CpuGraph: driver_forward's)
__all__ = [
    "VOCAB",
    "CpuGraph",
    "DriverReq",
    "ServingDriver",
    "next_token",
    "stand_in_model_runner",
]

VOCAB = 1000


def stand_in_model_runner(
    pool,
    *,
    req_to_token: torch.Tensor,
    context_len: int,
    vocab_size: int = 512,
    draft: bool = False,
):
    """A stand-in sglang ``ModelRunner`` for ``install_canary``: the attributes the seam reads
    at install (``RunnerFacts``) and a model whose ``forward`` the canary wraps."""
    model = types.SimpleNamespace(forward=lambda input_ids, positions, forward_batch: None)
    return types.SimpleNamespace(
        token_to_kv_pool=pool,
        req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
        device="cpu",
        model_config=types.SimpleNamespace(context_len=context_len, vocab_size=vocab_size),
        sliding_window_size=None,
        is_draft_worker=draft,
        model=model,
        sampler=None,
    )


def speculative_server_args(**kw):
    """Stand-in ``ServerArgs`` with what ``install_canary`` reads of a speculative server
    (EAGLE, 4 steps, topk 1, 5 draft tokens, the canary in raise mode on the CPU), ``kw``
    overriding or adding."""
    base = dict(
        kv_canary="raise",
        kv_canary_sweep_interval=0,
        kv_canary_real_data="partial",
        device="cpu",
        disable_piecewise_cuda_graph=True,
        enable_torch_compile=False,
        chunked_prefill_size=64,
        max_prefill_tokens=128,
        cuda_graph_max_bs=8,
        sampling_backend="pytorch",
        speculative_algorithm="EAGLE",
        speculative_num_steps=4,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=5,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


def next_token(rid: int, position: int) -> int:
    return (rid * 7919 + position * 104729 + 17) % VOCAB


@dataclasses.dataclass
class DriverReq:
    rid: int
    prompt: List[int]
    max_new: int
    shared_prefix: int = 0  # leading tokens whose KV slots are shared (a radix hit)
    row: Optional[int] = None
    swa_evicted: int = 0  # positions below this had their SWA slots freed
    kv_len: int = 0  # tokens whose KV is in the cache
    slots: List[int] = dataclasses.field(default_factory=list)
    output: List[int] = dataclasses.field(default_factory=list)
    to_finish: Optional[object] = None  # set by an abort (sglang's FINISH_ABORT)
    skip_radix_cache_insert: bool = False

    @property
    def origin_input_ids(self) -> List[int]:  # the names sglang's Req uses
        return self.prompt

    @property
    def output_ids(self) -> List[int]:
        return self.output

    @property
    def req_pool_idx(self) -> Optional[int]:
        return self.row

    @property
    def sampling_params(self):
        return types.SimpleNamespace(max_new_tokens=self.max_new)

    @property
    def kv_allocated_len(self) -> int:
        return len(self.slots)

    def finished(self) -> bool:
        return self.done

    @property
    def tokens(self) -> List[int]:
        return self.prompt + self.output

    @property
    def prefilled(self) -> bool:
        return self.kv_len >= len(self.prompt)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new


class ServingDriver(DriverFaults, DriverPools, DriverForward):
    def __init__(
        self,
        *,
        device="cpu",
        mode="raise",
        real_data="partial",
        num_slots=640,
        max_reqs=12,
        max_ctx=160,
        chunk=24,
        max_running=6,
        graph_bs=0,
        enable_mha_v=False,
        seed=0,
        stats_every=0,
        forbid_host_sync=False,
        verify_tokens=False,
        sweep_interval=0,
        ring_capacity=1024,
        pool="mha",
        swa_window=0,
        num_swa_slots=0,
        swa_only=False,
        swa_evict_interval=4,
        swa_divergence_interval=0,
        perturb=None,
        init_finished=True,
        batch_init_hook=None,
        real_data_layers="first",
        layers_per_forward=1,
        ranks=None,
        piecewise_pad_to=0,
    ):
        if pool not in ("mha", "swa", "dsv4", "mla", "nsa", "hybrid"):
            raise ValueError(
                f"driver pool must be mha, swa, dsv4, mla, nsa or hybrid, got {pool!r}"
            )
        self.pool_kind = pool
        # > 0: every eager extend forward calls the model as sglang's piecewise CUDA-graph
        # replay does, with a copy padded to this many tokens (padding: slot 0, token 0,
        # position 0), inside the ModelRunner.forward bracket of the unpadded batch
        self.piecewise_pad_to = piecewise_pad_to
        self.swa_window = swa_window
        self.swa_evict_interval = swa_evict_interval
        self.device = torch.device(device)
        self.rng = random.Random(seed)
        self.chunk = chunk
        # CUDA only: every canary op of a forward runs under torch's sync debug mode "error",
        # so any device->host synchronisation on the forward stream raises
        self.forbid_host_sync = forbid_host_sync
        self.max_running = max_running
        self.req_to_token_pool = ReqToTokenPool(
            size=max_reqs,
            max_context_len=max_ctx,
            device=str(self.device),
            enable_memory_saver=False,
        )
        if pool in ("mla", "nsa"):
            self.kv_pool = self._build_mla_pool(num_slots, nsa=pool == "nsa")
            self.allocator = TokenToKVPoolAllocator(
                num_slots, torch.bfloat16, str(self.device), self.kv_pool, need_sort=False
            )
        elif pool == "hybrid":
            from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

            # full attention on layers 1 and 3 (linear attention elsewhere); the Mamba state
            # pool is not the canary's business (per request, not per token)
            self.kv_pool = HybridLinearKVPool(
                size=num_slots,
                dtype=torch.bfloat16,
                page_size=1,
                head_num=2,
                head_dim=8,
                full_attention_layer_ids=[1, 3],
                enable_kvcache_transpose=False,
                device=str(self.device),
                mamba_pool=None,
            )
            self.allocator = TokenToKVPoolAllocator(
                num_slots, torch.bfloat16, str(self.device), self.kv_pool, need_sort=False
            )
        elif pool == "mha":
            self.kv_pool = MHATokenToKVPool(
                size=num_slots,
                page_size=1,
                dtype=torch.bfloat16,
                head_num=2,
                head_dim=8,
                layer_num=2,
                device=str(self.device),
                enable_memory_saver=False,
                enable_alt_stream=False,
            )
            self.allocator = TokenToKVPoolAllocator(
                num_slots, torch.bfloat16, str(self.device), self.kv_pool, need_sort=False
            )
        else:
            if swa_window <= 0 or num_swa_slots <= 0:
                raise ValueError("pool='swa'/'dsv4' needs swa_window and num_swa_slots")
            self.kv_pool = (
                self._build_swa_pool(num_slots, num_swa_slots, swa_only=swa_only)
                if pool == "swa"
                else self._build_dsv4_pool(num_slots, num_swa_slots)
            )
            from sglang.srt.mem_cache.swa_memory_pool import SWATokenToKVPoolAllocator

            self.allocator = SWATokenToKVPoolAllocator(
                size=num_slots,
                size_swa=num_swa_slots,
                page_size=1,
                dtype=torch.bfloat16,
                device=str(self.device),
                kvcache=self.kv_pool,
                need_sort=False,
            )
        self.config = CanaryConfig(
            mode=mode,
            real_kv_hash_mode=real_data,
            real_data_layers=real_data_layers,
            real_data_layers_per_forward=layers_per_forward,
            enable_mha_v=enable_mha_v,
            stats_print_every_n_steps=stats_every,
            enable_verify_token_assert=verify_tokens,
            sweep_interval=sweep_interval,
            ring_capacity=ring_capacity,
            swa_divergence_stats_interval=swa_divergence_interval,
            **({"perturb": perturb} if perturb is not None else {}),
        )
        # the production assembly (what install_canary does with a ModelRunner's pool): a
        # prefill forward of this loop carries at most max_reqs chunks
        self.manager = build_canary(
            pool=self.kv_pool,
            req_to_token=self.req_to_token_pool.req_to_token,
            config=self.config,
            device=self.device,
            swa_window_size=swa_window or None,
            capacity_inputs=CanaryCapacityInputs(
                context_len=max_ctx,
                chunked_prefill_size=chunk,
                max_prefill_tokens=chunk * max_reqs,
                cuda_graph_max_bs=graph_bs or None,
            ),
            ranks=ranks,
        )
        self.groups = self.manager.groups
        self.capacities = self.manager.capacities
        self.waiting: List[DriverReq] = []
        self.running: List[DriverReq] = []
        self.finished: List[DriverReq] = []
        self.prefix_cache: Dict[int, DriverReq] = {}  # prefix id -> owner of the shared slots
        self.step_count = 0
        self.slot_refs = collections.Counter()  # running requests referencing each slot
        self.alloc_counts = collections.Counter()  # times each slot was handed out
        self.shared_admitted = 0
        self._next_rid = 1
        self.graph_bs = graph_bs
        self.graph = None
        # None: each batch is handed to the manager directly; else ``batch_init_hook(fb,
        # reqs)`` does it (a test routing batches through the plugin's init_new hook)
        self.batch_init_hook = batch_init_hook
        if graph_bs:
            self._capture_decode_graph(graph_bs)
        if init_finished:  # what the plugin's ModelRunner.__init__ hook does after start-up
            self.manager.mark_init_finished()

    # ---- workload ------------------------------------------------------------------------

    def add_request(
        self,
        prompt_len: int,
        max_new: int,
        share_with: Optional[DriverReq] = None,
        shared_len: int = 0,
    ) -> DriverReq:
        rid = self._next_rid
        self._next_rid += 1
        prompt = [self.rng.randrange(VOCAB) for _ in range(prompt_len)]
        req = DriverReq(rid=rid, prompt=prompt, max_new=max_new)
        if share_with is not None and shared_len:
            req.prompt[:shared_len] = share_with.prompt[:shared_len]
            req.shared_prefix = shared_len
            req.slots = list(share_with.slots[:shared_len])
            req.kv_len = shared_len
        self.waiting.append(req)
        return req

    def add_random_requests(self, n: int) -> None:
        for _ in range(n):
            donors = [
                r for r in self.running if r.prefilled and min(len(r.slots), len(r.prompt)) >= 8
            ]
            if donors and self.rng.random() < 0.5:
                donor = self.rng.choice(donors)
                self.add_request(
                    self.rng.randint(10, 60),
                    self.rng.randint(2, 12),
                    donor,
                    self.rng.randint(4, min(len(donor.slots), len(donor.prompt)) - 1),
                )
            else:
                self.add_request(self.rng.randint(4, 70), self.rng.randint(2, 12))

    # ---- one scheduler step ------------------------------------------------------------------

    def step(self) -> str:
        """Run one forward (extend if any request is waiting or mid-prefill, else decode)."""
        self._admit()
        extend = [r for r in self.running if not r.prefilled]
        if extend:
            fb = self._extend_batch(extend)
        elif self.running:
            fb = self._decode_batch(self.running)
        else:
            return "idle"
        self._forward(fb)
        self._finish()
        self.step_count += 1
        return fb.forward_mode.name.lower()

    def report_within(self, steps: int) -> str:
        """Step until the canary raises its report (raise mode; within two forwards on CUDA,
        the same forward on CPU) and return it; fails if ``steps`` forwards pass without
        one. Any other error propagates."""
        for _ in range(steps):
            try:
                self.step()
            except RuntimeError as exc:
                if "kv_canary detected" not in str(exc):
                    raise
                return str(exc)
        raise AssertionError(f"driver: no kv_canary report within {steps} forwards")

    def canary_bytes(self, *, kernel_counters: bool = True) -> Dict[str, torch.Tensor]:
        """Everything the canary wrote, by name, cloned: each group's records and per-layer
        table, the per-tag counters, the expected-token pool. Two runs of one seeded loop
        that differ only in how the launches are issued must match byte for byte.
        ``kernel_counters``: include the per-tag launch counts (False where one run launches
        more, e.g. a CUDA graph's warm-up)."""
        out = {}
        for i, g in enumerate(self.groups):
            for name in ("k_head", "k_tail", "v_head", "v_tail"):
                t = getattr(g, name)
                if t is not None:
                    out[f"group{i}.{name}"] = t.clone()
            if g.deep is not None:
                out[f"group{i}.deep"] = g.deep.table.clone()
        state = self.manager.state
        if kernel_counters:
            out["kernel_run_counters"] = state.kernel_run_counters.clone()
        out["slot_run_counters"] = state.slot_run_counters.clone()
        if self.manager.token_history is not None:
            out["expected_tokens"] = self.manager.token_history.pool.clone()
        return out

    def settle(self, max_steps: int = 200) -> None:
        """Step without arrivals until every admitted request is prefilled and none waits,
        so the next forward is a decode of all running requests."""
        for _ in range(max_steps):
            if not self.waiting and all(r.prefilled for r in self.running) and self.running:
                return
            if not self.running and not self.waiting:
                self.add_random_requests(2)
            self.step()
        raise RuntimeError("driver: did not settle")

    def run(self, steps: int, *, arrivals: float = 0.3) -> None:
        for _ in range(steps):
            if self.rng.random() < arrivals or not (self.running or self.waiting):
                self.add_random_requests(1)
            self.step()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if req.shared_prefix and any(s not in self._live_slots() for s in req.slots):
                # donor finished and its slots may be reused: drop the sharing
                req.slots, req.kv_len, req.shared_prefix = [], 0, 0
            need = len(req.prompt) + req.max_new - req.kv_len
            if self.allocator.available_size() < need + 8:
                break
            self.waiting.pop(0)
            req.row = self.req_to_token_pool.free_slots.pop(0)
            if req.slots:
                self.req_to_token_pool.req_to_token[req.row, : len(req.slots)] = torch.tensor(
                    req.slots, dtype=torch.int32
                )
                self.shared_admitted += 1
            self.slot_refs.update(req.slots)
            self.running.append(req)

    def _live_slots(self) -> set:
        return set(self.slot_refs)

    @property
    def reused_slots(self) -> int:
        """Slots handed out more than once (freed by a finished request, then reused)."""
        return sum(1 for c in self.alloc_counts.values() if c > 1)

    def _alloc(self, n: int) -> List[int]:
        got = self.allocator.alloc(n)
        if got is None:
            raise RuntimeError("driver: KV pool exhausted")
        got = got.tolist()
        self.slot_refs.update(got)
        self.alloc_counts.update(got)
        return got

    def _extend_batch(self, reqs: List[DriverReq]) -> ForwardBatch:
        ids, pos, loc, rows, pre, ext = [], [], [], [], [], []
        for r in reqs:
            n = min(self.chunk, len(r.prompt) - r.kv_len)
            new = self._alloc(n)
            start = r.kv_len
            self.req_to_token_pool.req_to_token[r.row, start : start + n] = torch.tensor(
                new, dtype=torch.int32
            )
            ids += r.prompt[start : start + n]
            pos += list(range(start, start + n))
            loc += new
            rows.append(r.row)
            pre.append(start)
            ext.append(n)
            r.slots += new
            r.kv_len += n
        return self._make_batch(
            ForwardMode.EXTEND,
            ids,
            pos,
            loc,
            rows,
            seq=[p + e for p, e in zip(pre, ext)],
            pre=pre,
            ext=ext,
            reqs=reqs,
        )

    def _evict_swa(self, reqs: List[DriverReq]) -> None:
        """sglang's decode-time SWA eviction: free the SWA slots of positions below
        ``prefix - window - page_size`` (page_size 1), except slots other running requests
        share (sglang protects shared, cached prefixes the same way)."""
        if self.pool_kind not in ("swa", "dsv4") or self.step_count % self.swa_evict_interval:
            return
        for r in reqs:
            hi = r.kv_len - self.swa_window - 1
            if hi <= r.swa_evicted:
                continue
            own = [s for s in r.slots[r.swa_evicted : hi] if self.slot_refs[s] == 1]
            if own:
                self.allocator.free_swa(torch.tensor(own, dtype=torch.int64, device=self.device))
            r.swa_evicted = hi

    def _decode_batch(self, reqs: List[DriverReq]) -> ForwardBatch:
        ids, pos, loc, rows = [], [], [], []
        self._evict_swa(reqs)
        for r in reqs:
            tok = next_token(r.rid, len(r.tokens))
            r.output.append(tok)
            p = len(r.tokens) - 1
            (slot,) = self._alloc(1)
            self.req_to_token_pool.req_to_token[r.row, p] = slot
            ids.append(r.tokens[p])
            pos.append(p)
            loc.append(slot)
            rows.append(r.row)
            r.slots.append(slot)
            r.kv_len += 1
        return self._make_batch(
            ForwardMode.DECODE, ids, pos, loc, rows, seq=[p + 1 for p in pos], reqs=reqs
        )

    def _make_batch(
        self, mode, ids, pos, loc, rows, *, seq, pre=None, ext=None, reqs=None
    ) -> ForwardBatch:
        dev = self.device
        i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=i64(ids),
            req_pool_indices=i64(rows),
            seq_lens=i64(seq),
            out_cache_loc=i64(loc),
            seq_lens_sum=sum(seq),
            positions=i64(pos),
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
        )
        if mode == ForwardMode.EXTEND:
            fb.extend_prefix_lens = i64(pre)
            fb.extend_seq_lens = i64(ext)
            fb.extend_num_tokens = len(ids)
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = list(pre), list(ext)
        if self.batch_init_hook is not None:
            self.batch_init_hook(fb, reqs)
        else:
            self.manager.on_forward_batch_init(fb, reqs)  # what the ForwardBatch.init_new hook does
        return fb

    def target_verify_batch(self, reqs: List[DriverReq], num_draft: int) -> ForwardBatch:
        """An EAGLE target-verify forward (a chain draft, topk 1) of ``reqs``: each request's
        next ``num_draft`` tokens written at positions ``seq_len .. seq_len + num_draft - 1``
        (``seq_lens`` = the committed prefix, as sglang's ``prepare_for_verify`` lays it out),
        with a real ``EagleVerifyInput`` as ``spec_info``. Every draft is accepted: the tokens
        join the requests' outputs."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        ids, pos, loc, rows, seq = [], [], [], [], []
        for r in reqs:
            seq.append(r.kv_len)
            new = self._alloc(num_draft)
            for j, slot in enumerate(new):
                p = r.kv_len + j
                r.output.append(next_token(r.rid, p))
                self.req_to_token_pool.req_to_token[r.row, p] = slot
                ids.append(r.tokens[p])
                pos.append(p)
            loc += new
            rows.append(r.row)
            r.slots += new
            r.kv_len += num_draft
        fb = self._make_batch(ForwardMode.TARGET_VERIFY, ids, pos, loc, rows, seq=seq, reqs=reqs)
        i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        fb.spec_info = EagleVerifyInput(
            draft_token=i64(ids),
            custom_mask=torch.ones(len(ids), dtype=torch.bool),
            positions=i64(pos),
            retrieve_index=i64(list(range(len(ids)))),
            retrieve_next_token=i64([-1] * len(ids)),
            retrieve_next_sibling=i64([-1] * len(ids)),
            retrieve_cum_len=i64([0]),
            spec_steps=num_draft - 1,
            topk=1,
            draft_token_num=num_draft,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            seq_lens_sum=sum(seq),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int64),
        )
        return fb

    def _finish(self) -> None:
        for r in list(self.running):
            # done, or aborted (sglang finishes a request whose ``to_finish`` is set)
            if (r.prefilled and r.done) or r.to_finish is not None:
                self.running.remove(r)
                self.slot_refs.subtract(r.slots)
                dead = sorted({s for s in r.slots if self.slot_refs[s] <= 0})
                for s in dead:
                    del self.slot_refs[s]
                self.allocator.free(torch.tensor(dead, dtype=torch.int64, device=self.device))
                self.req_to_token_pool.free_slots.append(r.row)
                r.row = None  # as sglang's ReqToTokenPool.free does
                self.finished.append(r)
