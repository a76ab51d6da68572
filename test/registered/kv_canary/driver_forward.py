"""The serving driver's forward with the canary's four phases around it, and its decode graphs
(``serving_driver.ServingDriver`` inherits them): eager (optionally padded as sglang's
piecewise CUDA-graph replay pads it) or replayed from a decode graph, a CUDA graph on a GPU and
:class:`CpuGraph` on the CPU. They work on the driver's manager, pools and static batch
(``self``)."""

from __future__ import annotations

import torch

from sglang.srt.kv_canary.single_forward_manager.phases import SfmPhase
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


class CpuGraph:
    """The CPU's stand-in for the decode ``torch.cuda.CUDAGraph`` (no graphs without CUDA):
    :meth:`replay` issues the launches the capture recorded, on the same static tensors, as a
    graph replays its kernels. It runs the captured body again with the active single-forward
    manager in capture mode (what it was in when sglang captured the graph, so it takes the
    captured paths: static inputs, the token scatter from the replay buffer), then gives the
    manager its phase back: a real replay runs no canary Python, so the outside bracket's
    phases must not move. Capture itself is the first replay's business: nothing runs at
    construction (a CUDA capture's launches do not run either)."""

    def __init__(self, manager, body):
        self.manager = manager
        self.body = body

    def replay(self) -> None:
        sfm = self.manager.active_sfm
        phase = sfm.phase
        sfm.phase = SfmPhase.IDLE
        try:
            with sfm.capturing():
                self.body()
        finally:
            sfm.phase = phase


class DriverForward:
    # ---- the forward, with the canary around it ----------------------------------------------

    def _forward(self, fb: ForwardBatch) -> None:
        if not self.forbid_host_sync:
            return self._forward_inner(fb)
        torch.cuda.set_sync_debug_mode("error")
        try:
            self._forward_inner(fb)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def _forward_inner(self, fb: ForwardBatch) -> None:
        mgr = self.manager
        use_graph = (
            self.graph is not None
            and fb.forward_mode == ForwardMode.DECODE
            and fb.batch_size <= self.graph_bs
        )
        with mgr.with_active_single_forward_manager(0):
            with mgr.with_ops_outside_graph(fb):
                if use_graph:
                    self._load_graph_inputs(fb)
                    mgr.before_graph_replay()
                    self.graph.replay()
                    mgr.mark_replayed_inside_graph()
                else:
                    inner = (
                        self.piecewise_padded(fb)
                        if self.piecewise_pad_to and fb.forward_mode == ForwardMode.EXTEND
                        else fb
                    )
                    mgr.pre_ops_maybe_inside_graph(inner)
                    self.model_forward(inner)
                    mgr.post_ops_maybe_inside_graph(inner)

    def piecewise_padded(self, fb: ForwardBatch) -> ForwardBatch:
        """The batch sglang's ``PiecewiseCudaGraphRunner.replay`` hands ``model.forward``:
        ``input_ids`` / ``positions`` / ``out_cache_loc`` padded with zeros to the captured
        token count, the rest of the real batch's fields (a new ``ForwardBatch``, without the
        canary's batch state)."""
        n, padded = fb.out_cache_loc.shape[0], self.piecewise_pad_to
        if n > padded:
            raise ValueError(f"piecewise_pad_to={padded} is below a forward of {n} tokens")

        def pad(t):
            out = torch.zeros(padded, dtype=t.dtype, device=t.device)
            out[:n] = t
            return out

        copy = ForwardBatch(
            forward_mode=fb.forward_mode,
            batch_size=fb.batch_size,
            input_ids=pad(fb.input_ids),
            req_pool_indices=fb.req_pool_indices,
            seq_lens=fb.seq_lens,
            out_cache_loc=pad(fb.out_cache_loc),
            seq_lens_sum=fb.seq_lens_sum,
            positions=pad(fb.positions),
            req_to_token_pool=fb.req_to_token_pool,
            token_to_kv_pool=fb.token_to_kv_pool,
        )
        copy.extend_prefix_lens, copy.extend_seq_lens = fb.extend_prefix_lens, fb.extend_seq_lens
        copy.extend_num_tokens = fb.extend_num_tokens
        copy.extend_prefix_lens_cpu = fb.extend_prefix_lens_cpu
        copy.extend_seq_lens_cpu = fb.extend_seq_lens_cpu
        return copy

    # ---- decode CUDA graph -------------------------------------------------------------------

    def _capture_decode_graph(self, bs: int) -> None:
        if self.device.type == "cpu":
            self.static = self._static_decode_batch(bs)
            self.graph = CpuGraph(self.manager, self._graph_body)
            return
        self._capture_cuda_decode_graph(bs)

    def _static_decode_batch(self, bs: int) -> ForwardBatch:
        z = lambda: torch.zeros(bs, dtype=torch.int64, device=self.device)  # noqa: E731
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=z(),
            req_pool_indices=z(),
            seq_lens=z(),
            out_cache_loc=z(),
            seq_lens_sum=0,
            positions=z(),
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
        )

    def _graph_body(self) -> None:
        """What the decode graph holds: the inside ops around the model, on the static batch."""
        self.manager.pre_ops_maybe_inside_graph(self.static)
        self.model_forward(self.static)
        self.manager.post_ops_maybe_inside_graph(self.static)

    def _capture_cuda_decode_graph(self, bs: int) -> None:
        self.static = self._static_decode_batch(bs)
        mgr = self.manager
        body = self._graph_body

        with mgr.with_active_single_forward_manager(0), mgr.capturing():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                body()  # warm-up (compiles the kernels), as sglang does before capturing
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                body()
        torch.cuda.synchronize()

    def _load_graph_inputs(self, fb: ForwardBatch) -> None:
        """Copy the real batch into the static buffers; rows past it are padding (row 0)."""
        s, bs = self.static, fb.batch_size
        for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
            dst = getattr(s, name)
            dst.zero_()
            dst[:bs].copy_(getattr(fb, name))
