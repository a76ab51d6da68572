"""The pools of the serving driver and its stand-in model (``serving_driver.ServingDriver``
inherits them): sglang's MLA / NSA, SWA and DeepSeek-V4 pools as the driver builds them (its MHA
and hybrid pools it builds inline), the full → SWA table, and the model's deterministic KV bytes,
a function of (token, position, layer), written into every layer of each pool kind. They work on
the driver's pools, allocator and device (``self``)."""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class DriverPools:
    # MLA latent rows of the driver: kv_lora_rank 32 + qk_rope_head_dim 16 bf16 (96 bytes)
    MLA_RANK, MLA_ROPE = 32, 16

    def _build_mla_pool(self, num_slots: int, *, nsa: bool):
        """sglang's ``MLATokenToKVPool`` (page size 1) or ``NSATokenToKVPool`` (page size 64,
        the only one it takes off HIP, with its indexer keys of 128 fp8 bytes per slot)."""
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, NSATokenToKVPool

        if not nsa:
            return MLATokenToKVPool(
                size=num_slots,
                page_size=1,
                dtype=torch.bfloat16,
                kv_lora_rank=self.MLA_RANK,
                qk_rope_head_dim=self.MLA_ROPE,
                layer_num=2,
                device=str(self.device),
                enable_memory_saver=False,
            )
        return NSATokenToKVPool(
            size=num_slots,
            page_size=64,
            kv_lora_rank=self.MLA_RANK,
            dtype=torch.bfloat16,
            qk_rope_head_dim=self.MLA_ROPE,
            layer_num=2,
            device=str(self.device),
            index_head_dim=128,
            enable_memory_saver=False,
            kv_cache_dim=self.MLA_RANK + self.MLA_ROPE,
        )

    def nsa_index_key_bytes(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Flat byte offsets ``[len(slots), 128]`` of ``slots``' indexer keys in
        ``index_k_with_scale_buffer[layer]`` (page rows: the page's fp8 keys, then its
        scales)."""
        buf = self.kv_pool.index_k_with_scale_buffer[layer]
        page, off = slots // 64, slots % 64
        return (page * buf.shape[1] + off * 128).unsqueeze(1) + torch.arange(
            128, device=self.device
        )

    def _build_swa_pool(self, num_slots: int, num_swa_slots: int, *, swa_only: bool = False):
        """sglang's ``SWAKVPool``: layer 0 sliding-window, layer 1 full; ``swa_only``: the one
        sliding-window layer alone (an MTP draft model's pool: ``Step3p5MTP``, ``MiMoV2MTP``)."""
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        return SWAKVPool(
            size=num_slots,
            size_swa=num_swa_slots,
            page_size=1,
            dtype=torch.bfloat16,
            head_num=2,
            head_dim=8,
            swa_attention_layer_ids=[0],
            full_attention_layer_ids=[] if swa_only else [1],
            enable_kvcache_transpose=False,
            device=str(self.device),
            enable_memory_saver=False,
            enable_alt_stream=False,
        )

    def _build_dsv4_pool(self, num_slots: int, num_swa_slots: int):
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        # the pool reads the global server args (speculative or not) for its state rings
        set_global_server_args_for_scheduler(
            ServerArgs(model_path="dummy", device=str(self.device.type))
        )
        return DeepSeekV4TokenToKVPool(
            max_num_reqs=4,
            swa_size=num_swa_slots,
            c4_size=num_slots // 4,
            c128_size=max(num_slots // 128, 1),
            c4_state_pool_size=4,
            c128_state_pool_size=4,
            page_size=128,
            swa_page_size=16,
            dtype=torch.uint8,
            state_dtype=torch.float32,
            qk_nope_head_dim=448,
            qk_rope_head_dim=64,
            indexer_head_dim=128,
            layer_num=2,
            device=str(self.device),
            enable_memory_saver=False,
            compression_ratios=[0, 4],
        )

    @property
    def swa_table(self) -> Optional[torch.Tensor]:
        return getattr(self.allocator, "full_to_swa_index_mapping", None)

    def swa_slot(self, slot: int) -> int:
        return int(self.swa_table[slot])

    # ---- the model: deterministic KV bytes -------------------------------------------------

    def model_forward(self, fb: ForwardBatch) -> None:
        """Write deterministic KV bytes for every token of ``fb`` into every layer."""
        if self.pool_kind == "swa":
            return self._model_forward_swa(fb)
        if self.pool_kind == "dsv4":
            return self._model_forward_dsv4(fb)
        if self.pool_kind in ("mla", "nsa"):
            return self._model_forward_mla(fb)
        n = fb.out_cache_loc.shape[0]
        base = (fb.input_ids[:n] * 31 + fb.positions[:n] * 7).unsqueeze(1)
        pool = self.mha_pool
        for layer in range(pool.layer_num):
            vals = ((base + layer * 13 + torch.arange(16, device=self.device)) % 251).to(
                torch.bfloat16
            ) / 251
            pool.k_buffer[layer][fb.out_cache_loc] = vals.view(n, 2, 8)
            pool.v_buffer[layer][fb.out_cache_loc] = (vals * 0.5).view(n, 2, 8)

    @property
    def mha_pool(self):
        """The MHA pool the model writes (the hybrid pool's full-attention inner pool)."""
        return self.kv_pool.full_kv_pool if self.pool_kind == "hybrid" else self.kv_pool

    def _kv_values(self, fb: ForwardBatch, layer: int, width: int) -> torch.Tensor:
        n = fb.out_cache_loc.shape[0]
        base = (fb.input_ids[:n] * 31 + fb.positions[:n] * 7).unsqueeze(1)
        return (base + layer * 13 + torch.arange(width, device=self.device)) % 251

    def _model_forward_mla(self, fb: ForwardBatch) -> None:
        """Every layer's latent row (and, NSA, indexer key bytes) of the new slots."""
        n = fb.out_cache_loc.shape[0]
        width = self.MLA_RANK + self.MLA_ROPE
        for layer in range(self.kv_pool.layer_num):
            vals = self._kv_values(fb, layer, width).to(torch.bfloat16) / 251
            self.kv_pool.kv_buffer[layer][fb.out_cache_loc] = vals.view(n, 1, width)
            if self.pool_kind == "nsa":
                flat = self.kv_pool.index_k_with_scale_buffer[layer].view(-1)
                where = self.nsa_index_key_bytes(layer, fb.out_cache_loc)
                flat[where] = self._kv_values(fb, layer + 5, 128).to(torch.uint8)

    def _model_forward_swa(self, fb: ForwardBatch) -> None:
        """Layer 0 (sliding window) into the SWA sub-pool at the translated slots, layer 1
        (full attention) into the full sub-pool, as ``SWAKVPool.set_kv_buffer`` does."""
        n = fb.out_cache_loc.shape[0]
        loc = fb.out_cache_loc
        swa_loc = self.swa_table[loc]
        for layer, (sub, where) in enumerate(
            ((self.kv_pool.swa_kv_pool, swa_loc), (self.kv_pool.full_kv_pool, loc))
        ):
            if not sub.k_buffer:  # an SWA-only pool has no full layer
                continue
            vals = self._kv_values(fb, layer, 16).to(torch.bfloat16) / 251
            sub.k_buffer[0][where] = vals.view(n, 2, 8)
            sub.v_buffer[0][where] = (vals * 0.5).view(n, 2, 8)

    def _model_forward_dsv4(self, fb: ForwardBatch) -> None:
        """Every layer's SWA record (448 fp8 nope, 64 bf16 rope, 7 scale bytes) through
        sglang's ``SetKAndS`` torch path, at the translated slots."""
        from sglang.srt.layers.attention.dsv4.index_buf_accessor import (
            NopeFp8RopeBf16Pack,
            SetKAndS,
            fp8_dtype,
        )

        swa = self.kv_pool.swa_kv_pool
        swa_loc = self.swa_table[fb.out_cache_loc].contiguous()
        for layer in range(swa.layer_num):
            pack = NopeFp8RopeBf16Pack(
                k_nope_fp8=(self._kv_values(fb, layer, 448).float() / 64).to(fp8_dtype),
                k_rope_bf16=(self._kv_values(fb, layer + 1, 64).float() / 251).to(torch.bfloat16),
                scale_k_nope_ue8m0=(self._kv_values(fb, layer + 2, 7) + 1).to(torch.uint8),
            )
            SetKAndS.torch(swa, swa.kv_buffer[layer], swa_loc, pack)
