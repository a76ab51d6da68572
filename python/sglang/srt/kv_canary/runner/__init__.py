"""Per-forward orchestration: the manager, kernel launching, reporting and health checks."""

from sglang.srt.kv_canary.runner.device_host import DelayedDeviceHostHandler, FutureTensors
from sglang.srt.kv_canary.runner.health import KernelRunCounterHealthChecker
from sglang.srt.kv_canary.runner.manager import CanaryManager
from sglang.srt.kv_canary.runner.stats import PeriodicCanaryStatsLogger

__all__ = [
    "CanaryManager",
    "DelayedDeviceHostHandler",
    "FutureTensors",
    "KernelRunCounterHealthChecker",
    "PeriodicCanaryStatsLogger",
]
