"""sglang plugin entry point (group ``sglang.srt.plugins``, name ``kv_canary``).

sglang calls :func:`register` through ``load_plugins()`` in the launching process, the Engine
and every scheduler process; the hooks below are applied right after. With ``--kv-canary
none`` (the default) the runtime hooks find no manager and pass straight through.

| hook | target | what |
| --- | --- | --- |
| AROUND | ``ServerArgs.__init__`` | accept ``kv_canary*`` kwargs (``Engine(kv_canary=...)``) |
| AFTER | ``ServerArgs.add_cli_args`` | add the three ``--kv-canary*`` options |
| AFTER | ``ServerArgs.from_cli_args`` | carry the parsed options over, validate at start-up |
| AFTER | ``ModelRunner.init_memory_pool`` | ``install_canary`` (pool exists, graphs not yet) |
| AFTER | ``ModelRunner.__init__`` | ``mark_init_finished`` (warm-up and capture done) |
| AROUND | ``ModelRunner.forward`` | outside-graph bracket with single-forward manager 0 |
| AROUND | ``CudaGraphRunner.capture_one_batch_size`` | capture bracket |
| AROUND | ``CudaGraphRunner.replay_prepare`` | padding rows really point at row 0 (below) |
| AROUND | ``CudaGraphRunner.replay`` | record that the graph ran the inside ops |
| AFTER | ``Scheduler.init_cache_with_memory_pool`` | ``attach_radix_cache(tree_cache)`` |
| AFTER | ``ForwardBatch.init_new`` | token-id snapshot of ``batch.reqs`` (token checks on only); |
|  |  | token-oracle keys of the batch's requests (token oracle on only) |

:func:`register` also registers the ``token_oracle`` sampling backend with sglang's
``register_sampler_backend`` (so ``--sampling-backend token_oracle`` parses).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_SA = "sglang.srt.server_args.ServerArgs"
_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
_CG = "sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner"
_SCHED = "sglang.srt.managers.scheduler.Scheduler"


def _server_args_init(original, self, *args, **kwargs):
    from sglang.srt.kv_canary.api import check_server_args_for_canary
    from sglang.srt.kv_canary.server_args_ext import (
        note_requested_sampling_backend,
        pop_canary_kwargs,
        set_canary_attrs,
    )

    set_canary_attrs(self, pop_canary_kwargs(kwargs))
    note_requested_sampling_backend(self, kwargs.get("sampling_backend"))
    result = original(self, *args, **kwargs)
    check_server_args_for_canary(self)
    return result


def _add_cli_args(result, parser):
    from sglang.srt.kv_canary.server_args_ext import add_canary_cli_args

    add_canary_cli_args(parser)


def _from_cli_args(result, cls, args):
    from sglang.srt.kv_canary.api import check_server_args_for_canary
    from sglang.srt.kv_canary.server_args_ext import DEFAULTS, set_canary_attrs

    set_canary_attrs(result, {k: getattr(args, k, v) for k, v in DEFAULTS.items()})
    check_server_args_for_canary(result)
    return result


def _after_init_memory_pool(result, self, *args, **kwargs):
    from sglang.srt.kv_canary.api import install_canary

    install_canary(server_args=self.server_args, model_runner=self)


def _after_model_runner_init(result, self, *args, **kwargs):
    from sglang.srt.kv_canary.api import get_canary_manager

    manager = get_canary_manager(self)
    if manager is not None:
        manager.mark_init_finished()


def _model_runner_forward(original, self, forward_batch, *args, **kwargs):
    from sglang.srt.kv_canary.api import get_canary_manager

    manager = get_canary_manager(self)
    if manager is None:
        return original(self, forward_batch, *args, **kwargs)
    with manager.with_active_single_forward_manager(0):
        with manager.with_ops_outside_graph(forward_batch):
            return original(self, forward_batch, *args, **kwargs)


def _capture_one_batch_size(original, self, *args, **kwargs):
    from sglang.srt.kv_canary.api import get_canary_manager

    manager = get_canary_manager(self.model_runner)
    if manager is None:
        return original(self, *args, **kwargs)
    with manager.with_active_single_forward_manager(0), manager.capturing():
        return original(self, *args, **kwargs)


def _graph_replay_prepare(original, self, *args, **kwargs):
    """sglang pads a decode batch of ``raw_bs`` requests to the captured ``bs`` by resetting
    ``seq_lens`` and ``out_cache_loc`` of the padding rows, but leaves their
    ``req_pool_indices`` from an earlier, larger replay. ``ReqToTokenPool`` reserves row 0 for
    padded rows; a stale index makes the canary verify a request that is gone (whose row may
    now hold another request). Zero the static buffer before sglang copies the real rows in:
    one device memset on the forward stream, no sync."""
    from sglang.srt.kv_canary.api import get_canary_manager

    manager = get_canary_manager(self.model_runner)
    if manager is not None:
        self.buffers.req_pool_indices.zero_()
        if manager.config.enable_write_input_assert:
            # padding rows then write token 0 at position 0, which the oracle's expected
            # inputs say for every entry past the real ones (self-test mode only)
            self.buffers.input_ids.zero_()
            self.buffers.positions.zero_()
    return original(self, *args, **kwargs)


def _graph_replay(original, self, *args, **kwargs):
    from sglang.srt.kv_canary.api import get_canary_manager

    out = original(self, *args, **kwargs)
    manager = get_canary_manager(self.model_runner)
    if manager is not None:
        manager.mark_replayed_inside_graph()
    return out


def _after_init_cache(result, self, *args, **kwargs):
    from sglang.srt.kv_canary.api import get_canary_manager

    worker = getattr(self, "tp_worker", None)
    runner = getattr(worker, "model_runner", None) if worker is not None else None
    manager = get_canary_manager(runner) if runner is not None else None
    if manager is not None:
        manager.attach_radix_cache(self.tree_cache)


def _after_forward_batch_init(result, cls, batch, model_runner, *args, **kwargs):
    from sglang.srt.kv_canary.api import get_canary_manager

    manager = get_canary_manager(model_runner)
    if manager is None:
        return result
    reqs = getattr(batch, "reqs", None)
    manager.attach_token_snapshot(result, reqs)
    if manager.token_oracle is not None:
        manager.token_oracle.attach_batch(result, reqs)
    return result


HOOKS = (
    (f"{_SA}.__init__", _server_args_init, "AROUND"),
    (f"{_SA}.add_cli_args", _add_cli_args, "AFTER"),
    (f"{_SA}.from_cli_args", _from_cli_args, "AFTER"),
    (f"{_MR}.init_memory_pool", _after_init_memory_pool, "AFTER"),
    (f"{_MR}.__init__", _after_model_runner_init, "AFTER"),
    (f"{_MR}.forward", _model_runner_forward, "AROUND"),
    (f"{_CG}.capture_one_batch_size", _capture_one_batch_size, "AROUND"),
    (f"{_CG}.replay_prepare", _graph_replay_prepare, "AROUND"),
    (f"{_CG}.replay", _graph_replay, "AROUND"),
    (f"{_SCHED}.init_cache_with_memory_pool", _after_init_cache, "AFTER"),
    ("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
     _after_forward_batch_init, "AFTER"),
)


def register() -> None:
    """Register the KV-canary hooks with sglang's ``HookRegistry``."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in HOOKS:
        HookRegistry.register(target, hook, HookType[kind])
    from sglang.srt.kv_canary.token_oracle.sampler import register_token_oracle_backend

    register_token_oracle_backend()
