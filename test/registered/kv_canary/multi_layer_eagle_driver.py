"""Multi-layer EAGLE (``--enable-multi-layer-eagle``, spec v2, ``--disable-cuda-graph``) over
real sglang 0.5.12 pools and ForwardBatch objects, its draft canaries installed and its
forwards run through the plugin's own code (test support;
docs/speculative_multilayer_adaptive_dflash_mtp.md, "1.4 Changes to the canary").

The :class:`~eagle_driver.EagleDriver` spec v2 workload (target ``EXTEND`` /
``TARGET_VERIFY``, pre-allocated slots), with the draft side as sglang 0.5.12's
``MultiLayerEagleDraftWorker`` runs it without CUDA graphs:

- ``steps`` draft runners, one per MTP layer, each with its own one-layer
  ``MHATokenToKVPool``, all sharing the ``ReqToTokenPool``; each gets what the plugin's hook
  after ``ModelRunner.init_memory_pool`` gives it (``install.install_canary`` on a stand-in
  runner with sglang's ``draft_model_idx``), and layer 0's worker the hook after
  ``MultiLayerEagleDraftWorker.init_cuda_graphs``;
- a draft round runs no forward (the MTP layers' tokens come from the last draft extend);
- each draft ``EXTEND`` (prefill chunk) and ``DRAFT_EXTEND_V2`` (after a verify) runs once
  per MTP layer k, on the batch built for layer 0's runner: runner k's ``ModelRunner.forward``
  (the plugin's AROUND hook) calls runner k's wrapped ``model.forward``, whose model writes
  the KV of the batch's pool (layer 0's, as sglang's attention does); between steps each
  request's ids move one place left, a predicted token last (sglang's
  ``rotate_input_ids_triton``).

``bug_own_pool`` routes steps k >= 1 to runner k's own pool (a batch built for runner k),
which sglang 0.5.12 does not do; ``unshared`` leaves runners k >= 1 without the canary
(their forwards then write layer 0's pool behind its canary's back).
"""

from __future__ import annotations

import types
from typing import List

import torch

from eagle_driver import EagleDriver, tiny_mha_pool
from plugin_hooks_support import registered_hook
from serving_driver import VOCAB, speculative_server_args, stand_in_model_runner
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn


def multi_layer_server_args(*, steps: int, chunk: int, max_reqs: int, **kw):
    """The server arguments ``install_canary`` reads, for multi-layer EAGLE spec v2 without
    CUDA graphs (what sglang sets for a Step-3.5 target with ``--speculative-algorithm
    EAGLE --disable-cuda-graph``)."""
    return speculative_server_args(
        disable_cuda_graph=True,
        chunked_prefill_size=chunk,
        max_prefill_tokens=chunk * max_reqs,
        speculative_num_steps=steps,
        speculative_num_draft_tokens=steps + 1,
        enable_multi_layer_eagle=True,
        **kw,
    )


class MultiLayerEagleDriver(EagleDriver):
    def __init__(
        self,
        *,
        monkeypatch,
        steps: int = 3,
        bug_own_pool: bool = False,
        unshared: bool = False,
        server_args: dict = None,
        **kw,
    ):
        """``monkeypatch``: pytest's, to read the plugin's registered hooks. The draft
        canaries come from ``install_canary`` with ``multi_layer_server_args`` (plus
        ``server_args``) and the ``SGLANG_KV_CANARY_*`` variables the test set; the target's
        from the driver's own config (``EagleDriver``)."""
        from sglang.srt.kv_canary import install

        # no draft canary of the driver's own: install_canary builds them below
        super().__init__(steps=steps, v2=True, draft_model=False, **kw)
        self.bug_own_pool = bug_own_pool
        self.args = multi_layer_server_args(
            steps=steps,
            chunk=self.chunk,
            max_reqs=self.req_to_token_pool.size,
            **(server_args or {}),
        )
        # sglang's ModelRunner.forward and the worker's init_cuda_graphs, as the plugin's
        # hooks wrap them
        hook, kind = registered_hook(monkeypatch, seam.HOOK_MODEL_RUNNER_FORWARD)
        self._runner_forward = _wrap_fn(
            lambda runner, fb: runner.model.forward(fb.input_ids, fb.positions, fb),
            hook,
            HookType[kind],
        )
        hook, kind = registered_hook(monkeypatch, seam.HOOK_MULTI_LAYER_EAGLE_V2_INIT_CUDA_GRAPHS)
        init_cuda_graphs = _wrap_fn(lambda worker: None, hook, HookType[kind])
        ctx = self.req_to_token_pool.req_to_token.shape[1]
        self.mtp_pools = [self.draft_pool] + [
            tiny_mha_pool(self.draft_pool.size) for _ in range(steps - 1)
        ]
        self.mtp_runners = []
        self.installed = []
        for k, pool in enumerate(self.mtp_pools):
            runner = stand_in_model_runner(
                pool,
                req_to_token=self.req_to_token_pool.req_to_token,
                context_len=ctx,
                vocab_size=VOCAB,
                draft=True,
            )
            runner.req_to_token_pool = self.req_to_token_pool  # shared, as sglang's are
            runner.draft_model_idx = k
            # the model writes the KV of the pool its batch carries, as sglang's attention
            runner.model.forward = lambda input_ids, positions, forward_batch: self.write_kv(
                seam.batch_kv_pool(forward_batch), forward_batch
            )
            if k == 0 or not unshared:
                self.installed.append(
                    install.install_canary(server_args=self.args, model_runner=runner)
                )
            self.mtp_runners.append(runner)
        self.draft = self.installed[0]
        init_cuda_graphs(types.SimpleNamespace(draft_runner=self.mtp_runners[0]))
        self.mtp_forwards = [0] * steps  # forwards run per MTP layer

    def draft_round(self, reqs, base, guesses, draft_slots) -> None:
        """``MultiLayerEagleDraftWorker.draft``: no forward (the MTP layers' top-1 tokens
        come from the last draft extend)."""

    def _eager(self, manager, pool, fb: ForwardBatch) -> None:
        if manager is not self.draft:
            return super()._eager(manager, pool, fb)
        for k, runner in enumerate(self.mtp_runners):
            if k:
                self._rotate(fb)
            if k and self.bug_own_pool:
                fb.token_to_kv_pool = self.mtp_pools[k]
            self._runner_forward(runner, fb)
            self.mtp_forwards[k] += 1
        fb.token_to_kv_pool = self.draft_pool

    def _rotate(self, fb: ForwardBatch) -> None:
        """sglang's ``rotate_input_ids_triton``: each request's ids one place left, the
        step's predicted token last."""
        ids: List[int] = []
        flat = fb.input_ids.tolist()
        at = 0
        for n in fb.extend_seq_lens.tolist():
            ids += flat[at + 1 : at + n] + [self.rng.randrange(VOCAB)]
            at += n
        fb.input_ids = torch.tensor(ids, dtype=torch.int64)
