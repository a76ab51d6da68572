"""Pool adapters. Each module registers its attachers when loaded; a pool class that this
sglang build lacks is skipped (defensive imports), so a missing optional class never breaks
start-up."""

from __future__ import annotations

import importlib

_ADAPTER_MODULES = ("mha", "swa", "dsv4", "mla", "hybrid_linear")


def load_all() -> None:
    for name in _ADAPTER_MODULES:
        importlib.import_module(f"{__name__}.{name}").register()
