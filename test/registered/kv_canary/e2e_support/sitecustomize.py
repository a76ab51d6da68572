"""Test hook loaded into every process of an end-to-end server (via PYTHONPATH).

With ``KV_CANARY_TEST_CORRUPT_AFTER=N`` it registers, before sglang loads its plugins, an
AFTER hook on ``ModelRunner.forward`` that, after the N-th forward with the canary on, bumps
the position field of every HEAD K record: the next forward's HEAD verify must report it.

With ``KV_CANARY_TEST_SHIM_HICACHE_CPU=1`` HiCache runs on sglang's CPU engine: the host pool
allocates plain (unpinned) memory instead of calling ``cudaHostRegister``, and
``transfer_kv_direct`` (``sgl_kernel``: CUDA only) is stood in for by a torch index copy per
layer (use ``hicache_io_backend="direct"`` with the ``layer_first`` layout, the only copy that
then runs). Test processes only, like the libcuda stub.

With ``KV_CANARY_TEST_PR25015=1`` an EAGLE draft round's forwards run one position ahead of
their own (upstream sglang PR 25015's bug, re-introduced for the regression test).

With ``KV_CANARY_TEST_PR28254=fixed|buggy`` the EAGLE draft extend after a non-final prefill
chunk ends with the next token of the request's fill sequence instead of the token the target
sampled (upstream PRs 26329 / 26800, which sglang 0.5.12 lacks). ``fixed`` takes that token
from the prompt followed by the output so far (as upstream PR 28254 does); ``buggy`` takes it
from the prompt only and keeps the sampled token where the chunk ends inside the output of a
retracted and resumed request (the bug PR 28254 fixed). Each non-final chunk's end prints a
``KV_CANARY_TEST_PR28254:`` line saying whether it lies inside the prompt or the output.

With ``KV_CANARY_TEST_PAGED_LANES_REWRITTEN=1`` every EAGLE draft round at page size > 1 with
topk > 1 gets its lane slots as sglang's ``assign_draft_cache_locs`` means to write them (lane
k's step j at the ``req_to_token`` column ``L + k * npp * page_size + j``), read from
``req_to_token`` once the kernel has ended. Two defects of sglang 0.5.12's kernel: in a round
where no request's prefix ends inside a page it skips that rewrite, and the round's forwards
write the allocation's first slots instead; where a lane spans two pages, its part 3 may read
a column before its part 1 has stored it (no barrier between them), and the step gets the
column's earlier slot (docs/speculative_trees.md, "1.1 Draft round (draft pool, `DECODE`
forwards)").

With ``KV_CANARY_TEST_ADAPTIVE_ACCEPT=a,b,...`` sglang's ``--speculative-adaptive``
controller is fed these accepted-draft counts, one per verify, in a cycle, in place of the
measured ones (dummy weights accept nothing, so it would only ever step down): with
``ema_alpha`` 1 and ``update_interval`` 1 in its config, the worker switches its step count up
and down as the cycle says.

With ``KV_CANARY_TEST_TRANSFER_LOST=1`` a PD decode server's canary takes every transfer sglang
fakes for a real one: a request "received" through the ``fake`` backend then stands for a
transfer that reported success and delivered neither the KV pages nor the canary rows.

With ``KV_CANARY_TEST_SPLICE_DROPPED=1`` the pools' transfer buffer lists come without the
canary's rows (sglang's own lists, nothing spliced in): a PD transfer then carries the KV pages
and leaves the decode server's canary rows as they were. Set it on both PD servers (their
lists must match).

With ``KV_CANARY_TEST_PR26859=1`` a FROZEN_KV_MTP decode round whose verify finished every
request leaves the batch an empty draft input, not its verify input (sglang 0.5.12's defect
that upstream PR 26859 fixed: the next prefill's merge otherwise stops the server;
``pr26859.py``).

multiprocessing's resource tracker (one per server, started from this environment too) runs
no sglang code: it loads no hook, where importing sglang for one would cost it seconds of CPU.
"""

import os
import sys

_RESOURCE_TRACKER = any("multiprocessing.resource_tracker" in a for a in sys.orig_argv)
_TEST_ENV = {} if _RESOURCE_TRACKER else os.environ


def _canary(model_runner):
    """The runner's canary manager, through the sglang seam (imported late: this module loads
    before sglang)."""
    from sglang.srt.kv_canary import sglang_seam

    return sglang_seam.runner_canary(model_runner)


_n = _TEST_ENV.get("KV_CANARY_TEST_CORRUPT_AFTER")
if _n:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _calls = {"n": 0}

    def _corrupt(result, self, *args, **kwargs):
        manager = _canary(self)
        if manager is None:
            return result
        _calls["n"] += 1
        if _calls["n"] == int(_n):
            import torch

            for group in manager.groups:
                group.k_head.view(torch.int64)[1:, 1] += 1000
            print(
                f"KV_CANARY_TEST: corrupted HEAD K records after forward {_calls['n']}", flush=True
            )
        return result

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward", _corrupt, HookType.AFTER
    )

_swap = _TEST_ENV.get("KV_CANARY_TEST_SWAP_SAME_POSITION_AFTER")
if _swap:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _swap_calls = {"n": 0}

    def _swap_same_position(result, self, forward_batch, *args, **kwargs):
        """From forward N on, on each decode forward: point position p of one request at the
        slot holding position p of another request whose token there differs (until the
        canary stops the server)."""
        manager = _canary(self)
        if manager is None or not forward_batch.forward_mode.is_decode():
            return result
        _swap_calls["n"] += 1
        pool = manager.state.req_to_verify_expected_tokens
        if _swap_calls["n"] < int(_swap) or pool is None:
            return result
        r2t = self.req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices.tolist()
        seqs = forward_batch.seq_lens.tolist()
        for i, r0 in enumerate(rows):
            for j, r1 in enumerate(rows):
                if i == j:
                    continue
                for p in range(1, min(seqs[i], seqs[j]) - 2):
                    if int(pool[r0, p]) != int(pool[r1, p]) and int(r2t[r0, p]) != int(r2t[r1, p]):
                        r2t[r0, p] = r2t[r1, p]
                        print(
                            f"KV_CANARY_TEST: req_to_token[{r0}, {p}] -> slot "
                            f"{int(r2t[r1, p])} (token {int(pool[r1, p])} instead of "
                            f"{int(pool[r0, p])})",
                            flush=True,
                        )
                        return result
        return result

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward",
        _swap_same_position,
        HookType.AFTER,
    )

_flip_swa = _TEST_ENV.get("KV_CANARY_TEST_FLIP_SWA_AFTER")
if _flip_swa:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _swa_state = {"n": 0, "done": False}

    def _flip_swa_byte(result, self, forward_batch, *args, **kwargs):
        """From decode forward N on, once: flip the first K byte (layer 0 of the SWA sub-pool
        of an ``SWAKVPool``) of the slot holding position ``seq_len - 2`` of the batch's first
        request: inside the window its next decode reads (and the canary verifies)."""
        manager = _canary(self)
        pool = getattr(self, "token_to_kv_pool", None)
        if (
            manager is None
            or _swa_state["done"]
            or not hasattr(pool, "swa_kv_pool")
            or not forward_batch.forward_mode.is_decode()
        ):
            return result
        _swa_state["n"] += 1
        if _swa_state["n"] < int(_flip_swa):
            return result
        row = int(forward_batch.req_pool_indices[0])
        p = int(forward_batch.seq_lens[0]) - 2
        full_slot = int(self.req_to_token_pool.req_to_token[row, p])
        swa_slot = int(pool.full_to_swa_index_mapping[full_slot])
        if p < 1 or swa_slot <= 0:
            return result
        kv = pool.swa_kv_pool.k_buffer[0][swa_slot].view(-1).view(__import__("torch").uint8)
        kv[0] ^= 0x5A
        _swa_state["done"] = True
        print(
            f"KV_CANARY_TEST: flipped SWA K byte 0 of position {p} (full slot {full_slot}, "
            f"swa slot {swa_slot})",
            flush=True,
        )
        return result

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward", _flip_swa_byte, HookType.AFTER
    )


if _TEST_ENV.get("KV_CANARY_TEST_SHIM_HICACHE_CPU") == "1":
    import torch
    from sglang.srt.mem_cache import memory_pool_host as _mph

    def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        src_idx = src_indices.to("cpu", torch.int64)
        dst_idx = dst_indices.to("cpu", torch.int64)
        for src, dst in zip(src_layers, dst_layers):
            dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))

    def _alloc_unpinned(dims, dtype, device, pin_memory, allocator):
        return allocator.allocate(dims, dtype=dtype, device=device)

    _mph.transfer_kv_direct = _transfer_kv_direct
    _mph.ALLOC_MEMORY_FUNCS.default_factory = lambda: _alloc_unpinned
    _mph.ALLOC_MEMORY_FUNCS.clear()

if _TEST_ENV.get("KV_CANARY_TEST_PR25015"):
    # upstream PR 25015 re-introduced (test processes only): a draft round's forward runs at
    # the position after its own, as when the round advanced positions before each draft
    # forward instead of after; in eager forwards and in the captured draft graph alike
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def _positions_before_forward(original, self, forward_batch, *args, **kwargs):
        if not (getattr(self, "is_draft_worker", False) and forward_batch.forward_mode.is_decode()):
            return original(self, forward_batch, *args, **kwargs)
        forward_batch.positions.add_(1)
        try:
            return original(self, forward_batch, *args, **kwargs)
        finally:
            forward_batch.positions.sub_(1)

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward",
        _positions_before_forward,
        HookType.AROUND,
    )


if _TEST_ENV.get("KV_CANARY_TEST_PAGED_LANES_REWRITTEN"):
    # sglang 0.5.12's assign_draft_cache_locs rewrites the round's slots to [bs, topk, steps]
    # only when duplicate_cache_len > 0, and may read a lane's column before storing it: every
    # round's slots are read here from req_to_token, which the kernel's stores leave right
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def _rewrite_lane_slots(result, self, batch, *args, **kwargs):
        import torch

        page, topk, steps = self.page_size, self.topk, self.speculative_num_steps
        if page == 1 or topk == 1:
            return result
        seq = batch.seq_lens.to(torch.int64).view(-1, 1, 1)
        npp = (seq % page + steps + page - 1) // page  # pages per lane, per request
        device = seq.device
        cols = (
            seq
            + torch.arange(topk, device=device).view(1, topk, 1) * (npp * page)
            + torch.arange(steps, device=device).view(1, 1, steps)
        )
        rows = batch.req_pool_indices.to(torch.int64).view(-1, 1, 1)
        slots = batch.req_to_token_pool.req_to_token[rows, cols].reshape(-1)
        batch.out_cache_loc = slots.to(batch.out_cache_loc.dtype)
        return result

    HookRegistry.register(
        "sglang.srt.speculative.eagle_worker.EAGLEWorker._draft_preprocess_decode",
        _rewrite_lane_slots,
        HookType.AFTER,
    )


_adaptive_accept = _TEST_ENV.get("KV_CANARY_TEST_ADAPTIVE_ACCEPT")
if _adaptive_accept:
    import itertools

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _accepts = itertools.cycle(int(a) for a in _adaptive_accept.split(","))

    def _scripted_accepts(original, self, num_correct_drafts_per_req, *args, **kwargs):
        if not num_correct_drafts_per_req:
            return original(self, num_correct_drafts_per_req, *args, **kwargs)
        n = next(_accepts)
        return original(self, [n] * len(num_correct_drafts_per_req), *args, **kwargs)

    HookRegistry.register(
        "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams.update",
        _scripted_accepts,
        HookType.AROUND,
    )


_pr28254 = _TEST_ENV.get("KV_CANARY_TEST_PR28254")
if _pr28254:
    # upstream PRs 26329 / 26800 applied to sglang 0.5.12 (test processes only), with PR
    # 28254's fix ("fixed") or with the bug it fixed ("buggy"); spec v1 and v2
    if _pr28254 not in ("fixed", "buggy"):
        raise ValueError(f"KV_CANARY_TEST_PR28254={_pr28254!r}: allowed fixed, buggy")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def _chunk_tails(reqs):
        """Per request of a prefill batch: the token the draft input must end with at a
        non-final chunk's end (None: keep the sampled token)."""
        tails = []
        for req in reqs:
            fill = list(req.origin_input_ids) + list(req.output_ids)
            n = len(req.fill_ids)
            if n >= len(fill):  # the final chunk: the sampled token is right
                tails.append(None)
                continue
            in_output = n >= len(req.origin_input_ids)
            print(
                f"KV_CANARY_TEST_PR28254: chunk end at position {n - 1} inside the "
                f"{'output' if in_output else 'prompt'} of request {req.rid} (prompt "
                f"{len(req.origin_input_ids)} tokens, output {len(req.output_ids)}, "
                f"retracted {req.retraction_count} time(s))",
                flush=True,
            )
            if _pr28254 == "buggy" and in_output:
                tails.append(None)  # PR 28254's bug: bounded by the prompt, falls back
            else:
                tails.append(fill[n])
        return tails

    def _v1_prepare_for_extend(original, self, batch, *args, **kwargs):
        result = original(self, batch, *args, **kwargs)
        if batch.forward_mode.is_idle():
            return result
        end = 0
        for tail, extend_len in zip(_chunk_tails(batch.reqs), batch.extend_lens):
            end += extend_len
            if tail is not None:
                batch.input_ids[end - 1] = tail
        return result

    def _v2_draft_extend_for_prefill(
        original, self, batch, target_hidden_states, next_token_ids, *args, **kwargs
    ):
        if not batch.forward_mode.is_idle() and batch.reqs:
            tails = _chunk_tails(batch.reqs)
            if any(t is not None for t in tails):
                next_token_ids = next_token_ids.clone()
                for i, tail in enumerate(tails):
                    if tail is not None:
                        next_token_ids[i] = tail
        return original(self, batch, target_hidden_states, next_token_ids, *args, **kwargs)

    HookRegistry.register(
        "sglang.srt.speculative.eagle_info.EagleDraftInput.prepare_for_extend",
        _v1_prepare_for_extend,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_prefill",
        _v2_draft_extend_for_prefill,
        HookType.AROUND,
    )


if _TEST_ENV.get("KV_CANARY_TEST_TRANSFER_LOST") == "1":
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def _no_faked_transfer(original, scheduler):
        return lambda req: False

    HookRegistry.register(
        "sglang.srt.kv_canary.sglang_seam.faked_transfer_test",
        _no_faked_transfer,
        HookType.AROUND,
    )


if _TEST_ENV.get("KV_CANARY_TEST_SPLICE_DROPPED") == "1":
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def _unspliced(original, infos, **kwargs):
        return tuple(list(x) for x in infos)

    HookRegistry.register(
        "sglang.srt.kv_canary.pool_patcher.buf_info_splice.splice_buf_infos",
        _unspliced,
        HookType.AROUND,
    )


if _TEST_ENV.get("KV_CANARY_TEST_PR26859") == "1":
    from pr26859 import TARGET, idle_draft_input_after_all_finished
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, idle_draft_input_after_all_finished, HookType.AFTER)
