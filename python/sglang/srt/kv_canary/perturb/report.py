"""The one-line log of each injected fault, so a test (or the demo) can match it to the
violation the canary reports.

Form: ``kv_canary perturb: fault=<kind> step=<forward step> key=value ...`` (values are
integers or bare words).
"""

from __future__ import annotations

import logging
import re
from typing import Dict, Optional

from sglang.srt.kv_canary.perturb.config import FaultKind

logger = logging.getLogger(__name__)

PERTURB_LINE_PREFIX = "kv_canary perturb:"
_LINE_RE = re.compile(re.escape(PERTURB_LINE_PREFIX) + r" (.*)$")


def format_perturb_line(kind: FaultKind, *, step: int, **fields) -> str:
    parts = [f"fault={kind.value}", f"step={step}"]
    parts += [f"{k}={v}" for k, v in fields.items()]
    return f"{PERTURB_LINE_PREFIX} " + " ".join(parts)


def log_perturbation(kind: FaultKind, *, step: int, **fields) -> str:
    """Log (WARNING) and return the line."""
    line = format_perturb_line(kind, step=step, **fields)
    logger.warning("%s", line)
    return line


def parse_perturb_line(line: str) -> Optional[Dict[str, str]]:
    """The ``key=value`` fields of a perturbation line (anywhere in ``line``), or None."""
    m = _LINE_RE.search(line.rstrip())
    if m is None:
        return None
    return dict(part.split("=", 1) for part in m.group(1).split() if "=" in part)
