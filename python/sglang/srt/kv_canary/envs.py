"""The ``SGLANG_KV_CANARY_*`` environment variables, in one place, declared like sglang's
``Envs`` (a class attribute per variable, named by the attribute).

Unlike sglang's own fields (which warn and fall back to the default on a bad value), these
raise a ``ValueError`` naming the variable: a canary that silently runs with settings other
than the operator asked for is worse than none. They are read once, by
:meth:`~sglang.srt.kv_canary.config.CanaryConfig.from_server_args`; nothing deeper reads the
environment. (Own descriptors, not subclasses of sglang's ``EnvField``: that class refuses to
name fields declared after sglang's ``Envs`` is built.)
"""

from __future__ import annotations

import abc
import difflib
import os
from typing import Any, List, Optional, Tuple

PREFIX = "SGLANG_KV_CANARY_"
# upper bounds of the numeric settings (checked at start-up; a larger value is a typo, and an
# absurd ring capacity would fail at allocation without naming the variable)
MAX_STEP_INTERVAL = 10**9  # forward steps
MAX_RING_CAPACITY = 1 << 20  # violation rows of 88 bytes: 88 MiB of device memory
MAX_LAYERS_PER_FORWARD = 4096  # more than any model's layer count
MAX_HEALS = 1000  # heals of one request before heal mode aborts it


def normalize_choice(value) -> Optional[str]:
    """A user-given string choice (a flag's, a variable's, a config field's) as it is matched
    against the allowed values: surrounding blanks stripped, lower-cased. ``None`` for anything
    but a ``str``, which then matches no choice (the caller's error names what it parses)."""
    return value.strip().lower() if isinstance(value, str) else None


class _Strict(abc.ABC):
    """A variable: ``get()`` parses it (or returns the default when unset); parse errors raise,
    naming the variable and what is allowed."""

    allowed: str = ""

    def __init__(self, default: Any):
        self.default = default
        self.name = ""

    def __set_name__(self, owner, name):
        self.name = name

    @abc.abstractmethod
    def parse(self, value: str) -> Any:
        """The value of ``value`` (the raw string), or ``ValueError``."""

    def is_set(self) -> bool:
        return self.name in os.environ

    def get(self):
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            value = self.parse(raw)
        except ValueError as e:
            raise ValueError(
                f"invalid value {raw!r} for environment variable {self.name}: {e} "
                f"(allowed: {self.allowed})"
            ) from None
        self.check(value, raw)
        return value

    def check(self, value, raw) -> None:
        pass


class _Bool(_Strict):
    allowed = "0/1, true/false, yes/no, on/off"

    def parse(self, value: str) -> bool:
        v = normalize_choice(value)
        if v in ("1", "true", "yes", "on", "y", "t"):
            return True
        if v in ("0", "false", "no", "off", "n", "f", ""):
            return False
        raise ValueError("not a boolean")


class _BoundedInt(_Strict):
    """An integer in ``[minimum, maximum]``."""

    def __init__(self, default: int, *, minimum: int, maximum: int = MAX_STEP_INTERVAL):
        super().__init__(default)
        self.minimum, self.maximum = minimum, maximum
        self.allowed = f"an integer from {minimum} to {maximum}"

    def parse(self, value: str) -> int:
        return int(value.strip())

    def check(self, value, raw) -> None:
        if not self.minimum <= value <= self.maximum:
            raise ValueError(
                f"invalid value {raw!r} for environment variable {self.name}: "
                f"must be {self.allowed}"
            )


def _non_neg_int(default: int, **kw) -> _BoundedInt:
    return _BoundedInt(default, minimum=0, **kw)


def _pos_int(default: int, **kw) -> _BoundedInt:
    return _BoundedInt(default, minimum=1, **kw)


class _Prob(_Strict):
    allowed = "a probability in [0, 1]"
    noun = "a probability"

    def parse(self, value: str) -> float:
        return float(value.strip())

    def check(self, value, raw) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(
                f"invalid value {raw!r} for environment variable {self.name}: "
                f"must be {self.noun} in [0, 1]"
            )


class _Fraction(_Prob):
    allowed = "a fraction in [0, 1]"
    noun = "a fraction"


class _Choice(_Strict):
    def __init__(self, default, choices):
        super().__init__(default)
        self.choices = tuple(choices)
        self.allowed = ", ".join(repr(c) for c in self.choices)

    def parse(self, value: str) -> str:
        v = normalize_choice(value)
        if v not in self.choices:
            raise ValueError("not one of the allowed values")
        return v


class _Layer(_Strict):
    """A KV layer: a non-negative sglang layer id, or ``last``. Whether the pool has that layer
    is checked against the pool at start-up (the perturber)."""

    allowed = "a layer id (0, 1, ...) or 'last'"

    def parse(self, value: str) -> str:
        v = normalize_choice(value)
        if v != "last" and not v.isdigit():
            raise ValueError("not a layer")
        return v if v == "last" else str(int(v))


class _Rank(_Strict):
    """A rank number (0, 1, ...) or unset / empty (every rank). Checked against the server's
    parallel sizes at start-up."""

    allowed = "a rank (0, 1, ...), or empty for every rank"

    def parse(self, value: str):
        v = value.strip()
        if not v:
            return None
        if not v.isdigit():
            raise ValueError("not a rank")
        return int(v)


class CanaryEnvs:
    """Every ``SGLANG_KV_CANARY_*`` variable with its default (docs/user_guide.md,
    "Environment variables")."""

    SGLANG_KV_CANARY_RING_CAPACITY = _pos_int(1024, maximum=MAX_RING_CAPACITY)
    SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS = _non_neg_int(100)
    SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT = _Bool(False)
    SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT = _Bool(False)
    SGLANG_KV_CANARY_ENABLE_MHA_V = _Bool(False)
    SGLANG_KV_CANARY_REAL_DATA_LAYERS_PER_FORWARD = _pos_int(1, maximum=MAX_LAYERS_PER_FORWARD)
    SGLANG_KV_CANARY_HOST_SWEEP_PAGES = _non_neg_int(64)
    SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL = _non_neg_int(0)
    SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE = _Bool(False)
    SGLANG_KV_CANARY_DRAFT_VIOLATIONS = _Choice("report", ("report", "act"))
    SGLANG_KV_CANARY_MAX_HEALS = _pos_int(3, maximum=MAX_HEALS)
    SGLANG_KV_CANARY_RETIRE_AFTER = _pos_int(1, maximum=MAX_HEALS)
    SGLANG_KV_CANARY_RETIRE_MAX_FRACTION = _Fraction(0.01)
    SGLANG_KV_CANARY_CPU_DEFERRED_READBACK = _Bool(False)
    SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS = _non_neg_int(50)
    SGLANG_KV_CANARY_PERTURB_MAX_FAULTS = _non_neg_int(0)
    SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB = _Prob(0.0)
    SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_KEPT_PROB = _Prob(0.0)
    SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB = _Prob(0.0)
    SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB = _Prob(0.0)
    SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB = _Prob(0.0)
    SGLANG_KV_CANARY_PERTURB_REAL_KV_STUCK_PROB = _Prob(0.0)
    SGLANG_KV_CANARY_PERTURB_TARGET_GROUP = _Choice("", ("", "full", "swa"))
    SGLANG_KV_CANARY_PERTURB_TARGET_LAYER = _Layer("0")
    SGLANG_KV_CANARY_PERTURB_TARGET_HALF = _Choice("k", ("k", "v"))
    SGLANG_KV_CANARY_PERTURB_FLIP = _Choice("mantissa", ("mantissa", "exponent"))
    SGLANG_KV_CANARY_PERTURB_TP_RANK = _Rank(None)
    SGLANG_KV_CANARY_PERTURB_PP_RANK = _Rank(None)
    SGLANG_KV_CANARY_PERTURB_DP_RANK = _Rank(None)
    SGLANG_KV_CANARY_PERTURB_TARGET_WORKER = _Choice("", ("", "target", "draft"))
    SGLANG_KV_CANARY_PERTURB_NEXT_TOKEN_SWAP_PROB = _Prob(0.0)
    SGLANG_KV_CANARY_PERTURB_HOST_KV_PROB = _Prob(0.0)
    SGLANG_KV_CANARY_PERTURB_PD_TRANSFER_PROB = _Prob(0.0)


canary_envs = CanaryEnvs()

KNOWN_VARIABLES = tuple(sorted(n for n in vars(CanaryEnvs) if n.startswith(PREFIX)))


def set_canary_variables() -> List[str]:
    """The known ``SGLANG_KV_CANARY_*`` variables set in the environment (sorted)."""
    return [n for n in KNOWN_VARIABLES if n in os.environ]


def canary_environment() -> Tuple[Tuple[str, str], ...]:
    """Every ``SGLANG_KV_CANARY_*`` variable set, known or not, with its value (sorted): what
    a config built from the environment depends on."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(PREFIX)))


def unknown_canary_variables() -> List[Tuple[str, Optional[str]]]:
    """``(name, closest known name or None)`` of every ``SGLANG_KV_CANARY_*`` variable set in
    the environment that the canary does not know (a typo would otherwise be ignored)."""
    out = []
    for name in sorted(os.environ):
        if name.startswith(PREFIX) and name not in KNOWN_VARIABLES:
            close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1, cutoff=0.6)
            out.append((name, close[0] if close else None))
    return out
