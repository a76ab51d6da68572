"""Test support on top of :mod:`sglang.srt.kv_canary.demo.server_process` (which holds the
server processes, the flags and the HTTP exchange; tests and benchmarks import those from
there): the Prometheus series of ``/metrics``, a Python snippet in a fresh process, and the
Mooncake check of the PD GPU tests."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from typing import Dict, Optional, Tuple

from sglang.srt.kv_canary.demo.server_process import http_call

MetricSeries = Dict[Tuple[str, frozenset], float]


def metric_series(port: int, prefix: str = "sglang:kv_canary_") -> MetricSeries:
    """The server's ``/metrics`` (Prometheus text) as ``{(name, frozenset of (label,
    value)): value}`` for the series whose name starts with ``prefix``; raises when
    ``/metrics`` does not answer 200 (``--enable-metrics`` off)."""
    status, body = http_call(port, "GET", "/metrics", timeout=60)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}: {body[:300]!r}")
    out = {}
    for m in re.finditer(
        rf"^({re.escape(prefix)}[\w:]*)(?:\{{(.*)\}})? (\S+)$", body.decode(), re.M
    ):
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric_total(series: MetricSeries, name: str) -> float:
    """The sum of ``name`` over its label sets in ``series`` (0 when absent)."""
    return sum(v for (n, _), v in series.items() if n == name)


def run_python(
    code: str, *, env: Dict[str, str], timeout: float = 600, cwd: Optional[str] = None
) -> subprocess.CompletedProcess:
    """Run ``code`` (which must guard its Engine use with ``__main__``) in a fresh process."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def require_mooncake() -> None:
    """Fail the calling test unless Mooncake's TransferEngine imports (the PD pairs' transfer
    engine on the GPU machine), saying how to bring it."""
    import pytest  # tests only: the benchmarks import this module without pytest

    if importlib.util.find_spec("mooncake") is None:
        pytest.fail(
            "Mooncake's TransferEngine is not importable: on the device run "
            "`bash .device/pd_a/install.sh` (test/device_bundle_pd.sh builds the bundle) "
            "and put /tmp/site on PYTHONPATH"
        )
