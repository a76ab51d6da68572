"""The plugin's hooks as sglang applies them, for the tests of ``plugin.py``'s runtime hooks
(CPU and CUDA): the hook :func:`plugin.register` hands to sglang for a target, wrapped around a
stand-in original with sglang's own ``HookRegistry`` wrapper (``_wrap_fn``); a real
``ModelRunner`` instance carrying a canary; stand-ins for ``Scheduler`` and ``TpModelWorker``
with the attributes the seam reads (importing sglang's classes loads ``sgl_kernel``'s
``common_ops``, which needs ``libcuda.so.1``)."""

from __future__ import annotations

from sglang.srt.kv_canary import plugin
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn


def registered_hook(monkeypatch, target: str):
    """The ``(hook, kind)`` that :func:`plugin.register` registers for ``target`` (exactly
    one)."""
    got = []
    monkeypatch.setattr(seam, "register_hook", lambda t, hook, kind: got.append((t, hook, kind)))
    plugin.register()
    mine = [(hook, kind) for t, hook, kind in got if t == target]
    assert len(mine) == 1, f"{target}: {len(mine)} hooks registered"
    return mine[0]


def as_sglang_applies(monkeypatch, target: str, original):
    """``original`` wrapped the way sglang's ``HookRegistry`` applies the plugin's hook."""
    hook, kind = registered_hook(monkeypatch, target)
    return _wrap_fn(original, hook, HookType[kind])


def model_runner_with(manager) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # sglang's class; its __init__ loads a model
    if manager is not None:
        seam.set_runner_canary(runner, manager)
    return runner


class TpWorkerStandIn:  # stand-in: sglang's TpModelWorker exposes the runner as ``model_runner``
    def __init__(self, model_runner):
        self.model_runner = model_runner


class ServerArgsStandIn:  # stand-in: the one ServerArgs field the scheduler hook reads
    def __init__(self, disaggregation_mode: str):
        self.disaggregation_mode = disaggregation_mode
        self.disaggregation_transfer_backend = "mooncake"


class SchedulerStandIn:  # stand-in: the Scheduler attributes the seam reads
    def __init__(
        self, model_runner, tree_cache, disaggregation_mode: str = "null", draft_worker=None
    ):
        self.tp_worker = TpWorkerStandIn(model_runner)
        self.tree_cache = tree_cache
        self.server_args = ServerArgsStandIn(disaggregation_mode)
        self.draft_worker = draft_worker
