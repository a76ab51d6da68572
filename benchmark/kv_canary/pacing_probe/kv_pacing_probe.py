"""An sglang plugin with no canary in it, for the decode speed-up of issue "latency"
(benchmark/results/latency_h200.md, "Why raise decodes faster: the runs that decide"): it
reproduces, one at a time, the side effects the canary has on sglang besides its own kernels,
so that a canary-off server with one of them can be compared with plain canary-off and with
``raise``. Put this folder on ``PYTHONPATH`` (sglang finds the plugin through its dist-info)
and set, in the server's environment:

- ``KV_PACING_PROBE_WAIT=forward``: after each ``ModelRunner.forward`` (outside graph capture),
  the host waits for the previous forward's end, where the canary consumes the previous
  forward's read-back; ``batch``: the same wait after ``TpModelWorker.forward_batch_generation``
  (after sampling); unset or empty: no wait.
- ``KV_PACING_PROBE_STREAMS=N``: N streams taken from torch's stream pool right after
  ``ModelRunner.init_memory_pool`` (the canary takes two there); ``KV_PACING_PROBE_MIB=N``: a
  device block of N MiB allocated there (the canary's buffers).
- ``KV_PACING_PROBE_FORK=empty``: the model's forward (wrapped on the instance there, as the
  canary wraps it, so eager forwards and CUDA-graph captures both get it) forks a side stream
  at its start and joins it at its end, as the canary's post-ops do around their side-stream
  launches, with nothing on the side stream; ``kernel``: one small kernel there (a 4 KiB add),
  beside the model's; unset or empty: no fork.

CUDA only; a bad value raises ``ValueError`` naming the variable. Not part of the canary."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Dict, Optional

logger = logging.getLogger(__name__)
# logged once a model runner's forward is forked (bench_interleaved.py checks a server's log
# for it, followed by " (kernel)" or " (empty)")
FORK_LINE = "kv_pacing_probe: forked the model's forward"

FORKS = ("empty", "kernel")
WAIT_POINTS = {
    "forward": "sglang.srt.model_executor.model_runner.ModelRunner.forward",
    "batch": "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
}
INIT_MEMORY_POOL = "sglang.srt.model_executor.model_runner.ModelRunner.init_memory_pool"
MAX_STREAMS = 64
MAX_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    wait: Optional[str] = None  # a key of WAIT_POINTS, or None
    streams: int = 0
    mib: int = 0
    fork: Optional[str] = None  # one of FORKS, or None


def _count(env: Dict[str, str], name: str, maximum: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) > maximum:
        raise ValueError(f"{name}={raw!r}: allowed an integer from 0 to {maximum}")
    return int(raw)


def parse_settings(env: Dict[str, str]) -> ProbeSettings:
    """The probe's settings from ``env`` (the process environment)."""
    wait = env.get("KV_PACING_PROBE_WAIT", "").strip().lower() or None
    if wait is not None and wait not in WAIT_POINTS:
        raise ValueError(
            f"KV_PACING_PROBE_WAIT={env['KV_PACING_PROBE_WAIT']!r}: allowed "
            f"{', '.join(WAIT_POINTS)} or empty"
        )
    fork = env.get("KV_PACING_PROBE_FORK", "").strip().lower() or None
    if fork is not None and fork not in FORKS:
        raise ValueError(
            f"KV_PACING_PROBE_FORK={env['KV_PACING_PROBE_FORK']!r}: allowed "
            f"{', '.join(FORKS)} or empty"
        )
    return ProbeSettings(
        wait=wait,
        streams=_count(env, "KV_PACING_PROBE_STREAMS", MAX_STREAMS),
        mib=_count(env, "KV_PACING_PROBE_MIB", MAX_MIB),
        fork=fork,
    )


_previous: Dict[int, object] = {}  # the waiting object's id -> its previous forward's event
_kept: list = []  # the streams and the block, for the process's life


def _wait_for_previous(original, self, *args, **kwargs):
    """AROUND hook: run ``original``, record an event behind it and wait for the previous
    call's event (not while a CUDA graph is being captured)."""
    import torch

    out = original(self, *args, **kwargs)
    if torch.cuda.is_current_stream_capturing():
        return out
    event = torch.cuda.Event()
    event.record()
    previous, _previous[id(self)] = _previous.get(id(self)), event
    if previous is not None:
        previous.synchronize()
    return out


def _take_streams_and_memory(settings: ProbeSettings):
    def hook(result, self, *args, **kwargs):
        import torch

        streams = [torch.cuda.Stream(device=self.device) for _ in range(settings.streams)]
        block = (
            torch.empty(settings.mib << 20, dtype=torch.uint8, device=self.device)
            if settings.mib
            else None
        )
        _kept.append((streams, block))
        if settings.fork is not None:
            _fork_around_model_forward(self, with_kernel=settings.fork == "kernel")
        return result

    return hook


def _fork_around_model_forward(model_runner, *, with_kernel: bool) -> None:
    """Wrap ``model_runner.model.forward``: an event recorded on the current stream before
    the model's launches; after them the side stream waits for it, runs the kernel (or
    nothing) and the current stream waits for the side stream. The event, stream and buffer
    are made here, once (capture-safe: no allocation in the forward)."""
    import functools

    import torch

    side = torch.cuda.Stream(device=model_runner.device)
    fork = torch.cuda.Event()
    scratch = torch.zeros(512, dtype=torch.int64, device=model_runner.device)
    model = model_runner.model
    original = model.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        fork.record()
        out = original(*args, **kwargs)
        side.wait_event(fork)
        if with_kernel:
            with torch.cuda.stream(side):
                scratch.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        return out

    model.forward = forward
    _kept.append((side, fork, scratch))
    # after sglang set up its logging (this runs in the memory pool's hook): in the server log
    logger.info(
        "%s (%s) on %s",
        FORK_LINE,
        "kernel" if with_kernel else "empty",
        model_runner.device,
    )


def register() -> None:
    """sglang's plugin entry point (every process): the hooks the environment asks for."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    settings = parse_settings(dict(os.environ))
    if settings.wait is not None:
        HookRegistry.register(WAIT_POINTS[settings.wait], _wait_for_previous, HookType.AROUND)
    if settings.streams or settings.mib or settings.fork:
        HookRegistry.register(INIT_MEMORY_POOL, _take_streams_and_memory(settings), HookType.AFTER)
    logger.info(
        "kv_pacing_probe: wait=%s streams=%d mib=%d fork=%s",
        settings.wait or "none",
        settings.streams,
        settings.mib,
        settings.fork or "none",
    )
