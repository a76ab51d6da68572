"""The in-process canary of a bs 1 prefill (docs/user_guide.md, "Overhead"): ``_Req`` (what
the canary reads of an sglang ``Req``), the stand-ins' pool shapes, config ``cname``'s canary
from the runtime's builder on real sglang pools, and the ``ForwardBatch`` of one prefill chunk.
Shared by ``serving_breakdown.py``, ``host_breakdown.py`` and
``bench_prefill_device_time.py``."""

from __future__ import annotations

from common import CONFIGS


class _Req:
    """What the token-id snapshot reads from an sglang ``Req``."""

    def __init__(self, row: int, prompt: list[int]):
        self.row = self.req_pool_idx = row
        self.origin_input_ids = prompt
        self.output_ids: list[int] = []
        self.slots: list[int] = []

    @property
    def length(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)


# the in-process prefill stand-ins' pool shapes (Qwen3-0.6B; tiny for --smoke-cpu):
# layers, KV heads, head dim, vocabulary
PREFILL_SHAPES = {False: (28, 8, 128, 151936), True: (2, 2, 8, 512)}


def build_prefill_canary(
    cname: str, *, device, smoke: bool, max_ctx: int, num_slots: int, chunk: int
):
    """``(manager, req_to_token_pool, kv_pool)``: config ``cname``'s canary from the runtime's
    builder on real sglang pools of :data:`PREFILL_SHAPES` (eight request rows, page size 1,
    layer 0's K and V random), start-up finished (on CUDA: its graphs captured). For the
    in-process bs 1 prefills of ``--host-breakdown`` and ``bench_prefill_device_time.py``."""
    import torch
    from sglang.srt.kv_canary.builder import build_canary
    from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
    from sglang.srt.kv_canary.config import CanaryConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    cfg = CONFIGS[cname]
    layers, heads, dim, _ = PREFILL_SHAPES[smoke]
    r2t = ReqToTokenPool(
        size=8, max_context_len=max_ctx, device=str(device), enable_memory_saver=False
    )
    kv = MHATokenToKVPool(
        size=num_slots,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=dim,
        layer_num=layers,
        device=str(device),
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    kv.k_buffer[0].normal_()
    kv.v_buffer[0].normal_()
    mgr = build_canary(
        pool=kv,
        req_to_token=r2t.req_to_token,
        device=device,
        config=CanaryConfig(
            mode=cfg.kv_canary,
            real_kv_hash_mode=cfg.real_data,
            real_data_layers=cfg.real_data_layers,
            enable_verify_token_assert=cfg.verify_tokens,
            stats_print_every_n_steps=0,
        ),
        capacity_inputs=CanaryCapacityInputs(
            context_len=max_ctx,
            chunked_prefill_size=chunk,
            max_prefill_tokens=16384,
            cuda_graph_max_bs=8,
        ),
    )
    mgr.mark_init_finished()
    return mgr, r2t, kv


def prefill_chunk_batch(req: "_Req", slots, start: int, n: int, *, device, r2t=None, kv=None):
    """The ``ForwardBatch`` sglang would build for tokens ``[start, start + n)`` of ``req``'s
    prompt (bs 1 EXTEND, prefix ``start``), written to ``slots[start:start + n]``."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    def i64(v):
        return torch.tensor(v, dtype=torch.int64, device=device)

    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=i64(req.origin_input_ids[start : start + n]),
        req_pool_indices=i64([req.row]),
        seq_lens=i64([start + n]),
        out_cache_loc=i64(slots[start : start + n].tolist()),
        seq_lens_sum=start + n,
        positions=i64(list(range(start, start + n))),
        req_to_token_pool=r2t,
        token_to_kv_pool=kv,
    )
    fb.extend_prefix_lens, fb.extend_seq_lens = i64([start]), i64([n])
    fb.extend_num_tokens = n
    fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = [start], [n]
    return fb
