"""Per-forward orchestration: the manager, kernel launching, reporting and health checks."""

from sglang.srt.kv_canary.manager.device_host import DelayedDeviceHostHandler, FutureTensors
from sglang.srt.kv_canary.manager.health import KernelRunCounterHealthChecker
from sglang.srt.kv_canary.manager.canary_manager import CanaryManager
from sglang.srt.kv_canary.manager.stats import PeriodicCanaryStatsLogger

__all__ = [
    "CanaryManager",
    "DelayedDeviceHostHandler",
    "FutureTensors",
    "KernelRunCounterHealthChecker",
    "PeriodicCanaryStatsLogger",
]
