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

CUDA only; a bad value raises ``ValueError`` naming the variable. Not part of the canary."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Dict, Optional

logger = logging.getLogger(__name__)

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
    return ProbeSettings(
        wait=wait,
        streams=_count(env, "KV_PACING_PROBE_STREAMS", MAX_STREAMS),
        mib=_count(env, "KV_PACING_PROBE_MIB", MAX_MIB),
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
        return result

    return hook


def register() -> None:
    """sglang's plugin entry point (every process): the hooks the environment asks for."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    settings = parse_settings(dict(os.environ))
    if settings.wait is not None:
        HookRegistry.register(WAIT_POINTS[settings.wait], _wait_for_previous, HookType.AROUND)
    if settings.streams or settings.mib:
        HookRegistry.register(INIT_MEMORY_POOL, _take_streams_and_memory(settings), HookType.AFTER)
    logger.info(
        "kv_pacing_probe: wait=%s streams=%d mib=%d",
        settings.wait or "none",
        settings.streams,
        settings.mib,
    )
