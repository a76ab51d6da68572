"""``PerturbConfig``: the fault-injection settings (docs/subsystems.md, "Self-tests"), read
once from the
``SGLANG_KV_CANARY_PERTURB_*`` variables by :class:`~sglang.srt.kv_canary.config.CanaryConfig`.

Faults are self-tests: they corrupt a live server on purpose. All are off by default and act
only after ``warmup_steps`` forward steps.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from sglang.jit_kernel.kv_canary.types import KvHalf, PoolKind
from sglang.srt.kv_canary.envs import normalize_choice
from sglang.srt.kv_canary.ranks import RankFacts


class FaultKind(str, enum.Enum):
    """The fault classes, with the variable that turns each on."""

    REQ_TO_TOKEN = "req_to_token"
    # the same entry rewrite, left in place as a server bug would leave it (abort mode only)
    REQ_TO_TOKEN_KEPT = "req_to_token_kept"
    REAL_KV_USED = "real_kv_used"
    REAL_KV_UNUSED_CACHE = "real_kv_unused_cache"
    REAL_KV_POST_FORWARD = "real_kv_post_forward"
    # a stuck bit: a slot a forward wrote is flipped, and flipped again after every later
    # forward that writes it (until it is never handed out again)
    REAL_KV_STUCK = "real_kv_stuck"
    NEXT_TOKEN_SWAP = "next_token_swap"
    HOST_KV = "host_kv"  # a byte of a page in HiCache's host memory
    # a byte of a page a PD decode server received, before the request's first decode step
    PD_TRANSFER = "pd_transfer"

    @property
    def env_var(self) -> str:
        return f"SGLANG_KV_CANARY_PERTURB_{self.name}_PROB"

    @property
    def is_real_kv(self) -> bool:
        return self in REAL_KV_FAULTS


REAL_KV_FAULTS = frozenset(
    {
        FaultKind.REAL_KV_USED,
        FaultKind.REAL_KV_UNUSED_CACHE,
        FaultKind.REAL_KV_POST_FORWARD,
        FaultKind.REAL_KV_STUCK,
        FaultKind.HOST_KV,
        FaultKind.PD_TRANSFER,
    }
)

TARGET_GROUP_VAR = "SGLANG_KV_CANARY_PERTURB_TARGET_GROUP"
TARGET_LAYER_VAR = "SGLANG_KV_CANARY_PERTURB_TARGET_LAYER"
TARGET_HALF_VAR = "SGLANG_KV_CANARY_PERTURB_TARGET_HALF"
FLIP_VAR = "SGLANG_KV_CANARY_PERTURB_FLIP"


class FlipBit(str, enum.Enum):
    """``SGLANG_KV_CANARY_PERTURB_FLIP``: which bit of a slot's first 16-bit KV element a
    real-KV fault flips."""

    # bit 0: a bf16/fp16 mantissa bit (the value changes a little, never to inf/NaN)
    MANTISSA = "mantissa"
    # bit 14: the exponent's top bit (a small value becomes huge): a read of it changes what
    # attention computes, so the output shows whether the corrupt read was kept
    EXPONENT = "exponent"

    @property
    def byte_and_mask(self):
        """(byte offset in the slot's bytes, XOR mask), little-endian."""
        return (0, 0x01) if self == FlipBit.MANTISSA else (1, 0x40)


TARGET_WORKER_VAR = "SGLANG_KV_CANARY_PERTURB_TARGET_WORKER"
# the model runners of a speculative server: the target model's, and EAGLE's draft model's
WORKER_TARGET, WORKER_DRAFT = "target", "draft"
LAST_LAYER = "last"
# rank targets: (PerturbConfig field, variable, server flag of the size, RankFacts field)
RANK_TARGETS = (
    ("target_tp_rank", "SGLANG_KV_CANARY_PERTURB_TP_RANK", "--tp-size", "tp"),
    ("target_pp_rank", "SGLANG_KV_CANARY_PERTURB_PP_RANK", "--pp-size", "pp"),
    ("target_dp_rank", "SGLANG_KV_CANARY_PERTURB_DP_RANK", "--dp-size", "dp"),
)


_TARGET_GROUPS = {"full": PoolKind.FULL, "swa": PoolKind.SWA}


@dataclasses.dataclass(frozen=True)
class PerturbConfig:
    """Per-step probabilities of each fault (``[0, 1]``), the warm-up and the real-KV target.

    ``target_group`` (``PoolKind`` or None) is required when a real-KV fault is on.
    ``target_layer`` (a layer id, or ``"last"``: the group's last layer) and ``target_half``
    (``KvHalf``) say whose row a real-KV fault flips a byte of (default: layer 0's K, the row
    ``--kv-canary-real-data-layers first`` fingerprints); whether the pool has that layer and
    half is checked against it at start-up (the perturber). Checks that need the rest of the
    canary config (real-data mode, sweep, token oracle) are done by :meth:`check_against`.
    """

    warmup_steps: int = 50
    max_faults: int = 0  # faults injected at most, over the server's life (0: no limit)
    req_to_token_prob: float = 0.0
    req_to_token_kept_prob: float = 0.0
    real_kv_used_prob: float = 0.0
    real_kv_unused_cache_prob: float = 0.0
    real_kv_post_forward_prob: float = 0.0
    real_kv_stuck_prob: float = 0.0
    next_token_swap_prob: float = 0.0
    host_kv_prob: float = 0.0
    pd_transfer_prob: float = 0.0
    target_group: Optional[PoolKind] = None
    target_layer: object = 0  # int >= 0 or LAST_LAYER
    target_half: KvHalf = KvHalf.K
    flip: FlipBit = FlipBit.MANTISSA
    # None: every rank; an int: only the model runners of that rank inject faults
    target_tp_rank: Optional[int] = None
    target_pp_rank: Optional[int] = None
    target_dp_rank: Optional[int] = None
    # None: target and draft runners alike; "target" / "draft": only that one (speculative)
    target_worker: Optional[str] = None
    seed: int = 0

    def __post_init__(self):
        if (
            isinstance(self.warmup_steps, bool)
            or not isinstance(self.warmup_steps, int)
            or self.warmup_steps < 0
        ):
            raise ValueError(
                f"SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS must be an int >= 0, got "
                f"{self.warmup_steps!r}"
            )
        if (
            isinstance(self.max_faults, bool)
            or not isinstance(self.max_faults, int)
            or self.max_faults < 0
        ):
            raise ValueError(
                f"SGLANG_KV_CANARY_PERTURB_MAX_FAULTS must be an int >= 0 (0: no "
                f"limit), got {self.max_faults!r}"
            )
        for kind in FaultKind:
            p = self.prob(kind)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                raise ValueError(f"{kind.env_var} must be a probability in [0, 1], got {p!r}")
        if isinstance(self.target_group, str):
            object.__setattr__(self, "target_group", parse_target_group(self.target_group))
        if self.target_group is not None and not isinstance(self.target_group, PoolKind):
            raise ValueError(f"{TARGET_GROUP_VAR} must be full or swa, got {self.target_group!r}")
        layer = self.target_layer
        if isinstance(layer, str) and layer.strip().isdigit():
            layer = int(layer.strip())
        elif normalize_choice(layer) == LAST_LAYER:
            layer = LAST_LAYER
        if layer != LAST_LAYER and (
            isinstance(layer, bool) or not isinstance(layer, int) or layer < 0
        ):
            raise ValueError(
                f"{TARGET_LAYER_VAR} must be a layer id (0, 1, ...) or "
                f"'{LAST_LAYER}', got {self.target_layer!r}"
            )
        object.__setattr__(self, "target_layer", layer)
        half = self.target_half
        if not isinstance(half, KvHalf):
            try:
                half = KvHalf(normalize_choice(str(half)))
            except ValueError:
                raise ValueError(f"{TARGET_HALF_VAR} must be k or v, got {half!r}") from None
        object.__setattr__(self, "target_half", half)
        flip = self.flip
        if not isinstance(flip, FlipBit):
            try:
                flip = FlipBit(normalize_choice(str(flip)))
            except ValueError:
                raise ValueError(
                    f"{FLIP_VAR} must be mantissa or exponent, got {self.flip!r}"
                ) from None
        object.__setattr__(self, "flip", flip)
        for field, var, _, _ in RANK_TARGETS:
            rank = getattr(self, field)
            if rank is not None and (
                isinstance(rank, bool) or not isinstance(rank, int) or rank < 0
            ):
                raise ValueError(f"{var} must be a rank (0, 1, ...) or unset, got {rank!r}")
        if self.target_worker not in (None, WORKER_TARGET, WORKER_DRAFT):
            raise ValueError(
                f"{TARGET_WORKER_VAR} must be {WORKER_TARGET} or {WORKER_DRAFT} "
                f"(or unset for both), got {self.target_worker!r}"
            )
        real_on = [k.env_var for k in REAL_KV_FAULTS if self.prob(k) > 0]
        if real_on and self.target_group is None:
            raise ValueError(
                f"{', '.join(sorted(real_on))} > 0 needs {TARGET_GROUP_VAR}=full "
                "or swa (the buffer group whose real KV bytes to corrupt)"
            )

    def prob(self, kind: FaultKind) -> float:
        return getattr(self, f"{kind.value}_prob")

    @property
    def active_faults(self) -> tuple:
        return tuple(k for k in FaultKind if self.prob(k) > 0)

    @property
    def enabled(self) -> bool:
        return bool(self.active_faults)

    def check_ranks(self, sizes: RankFacts) -> None:
        """Refuse a rank target the server does not have (at start-up, with its sizes)."""
        for field, var, flag, dim in RANK_TARGETS:
            rank = getattr(self, field)
            if rank is not None and rank >= sizes.size(dim):
                raise ValueError(
                    f"{var}={rank} but the server has {flag} {sizes.size(dim)}: "
                    f"allowed 0 to {sizes.size(dim) - 1}, or unset for every rank"
                )

    def injects_on(self, ranks: RankFacts) -> bool:
        """Whether the model runner of ``ranks`` injects faults (every rank target matches,
        and the worker target: the target or EAGLE's draft model)."""
        worker = WORKER_DRAFT if ranks.draft else WORKER_TARGET
        return (
            self.enabled
            and self.target_worker in (None, worker)
            and all(
                getattr(self, field) in (None, ranks.rank(dim)) for field, _, _, dim in RANK_TARGETS
            )
        )

    @property
    def targets_layer_0_k(self) -> bool:
        """Real-KV faults hit layer 0's K row (the default target)."""
        return self.target_layer == 0 and self.target_half == KvHalf.K

    def check_against(
        self,
        *,
        canary_enabled: bool,
        real_kv_hash_on: bool,
        sweep_interval: int,
        token_oracle: bool,
        aborts: bool = False,
    ) -> None:
        """Refuse fault settings the rest of the configuration cannot act on or detect
        (``aborts``: ``--kv-canary abort`` or ``heal``)."""
        active = self.active_faults
        if not active:
            return
        names = ", ".join(k.env_var for k in active)
        if not canary_enabled:
            raise ValueError(
                f"{names} > 0 needs the canary on: pass --kv-canary log, raise, abort or heal"
            )
        if FaultKind.REQ_TO_TOKEN_KEPT in active and not aborts:
            raise ValueError(
                f"{FaultKind.REQ_TO_TOKEN_KEPT.env_var} > 0 leaves a corrupt "
                "req_to_token entry in place, as a server bug would, and only "
                "--kv-canary abort or heal contains what sglang then frees: pass "
                "--kv-canary abort or heal (or use "
                f"{FaultKind.REQ_TO_TOKEN.env_var}, which undoes its entry)"
            )
        if any(k.is_real_kv for k in active) and not real_kv_hash_on:
            raise ValueError(
                f"{names} > 0 corrupts real KV bytes, which only real-data "
                "fingerprints see: pass --kv-canary-real-data partial or all"
            )
        if FaultKind.REAL_KV_UNUSED_CACHE in active and sweep_interval <= 0:
            raise ValueError(
                f"{FaultKind.REAL_KV_UNUSED_CACHE.env_var} > 0 corrupts slots only "
                "the radix sweep reads: pass --kv-canary-sweep-interval N (N >= 1)"
            )
        if FaultKind.NEXT_TOKEN_SWAP in active and not token_oracle:
            raise ValueError(
                f"{FaultKind.NEXT_TOKEN_SWAP.env_var} > 0 swaps the token "
                "oracle's samples: pass --sampling-backend token_oracle or set "
                "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE=1"
            )


def parse_target_group(value: str) -> Optional[PoolKind]:
    v = normalize_choice(value or "")
    if v == "":
        return None
    try:
        return _TARGET_GROUPS[v]
    except KeyError:
        raise ValueError(
            f"invalid {TARGET_GROUP_VAR} value {value!r}; allowed: full, swa"
        ) from None
