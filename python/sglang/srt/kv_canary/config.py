"""``CanaryConfig``: every canary setting, built once from server args + environment
(docs/architecture.md, "Runtime")."""

from __future__ import annotations

import dataclasses
import enum
import logging

from sglang.jit_kernel.kv_canary.consts import RealKvHashMode
from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.envs import (
    canary_environment,
    MAX_HEALS,
    MAX_LAYERS_PER_FORWARD,
    MAX_RING_CAPACITY,
    MAX_STEP_INTERVAL,
    canary_envs,
    normalize_choice,
    set_canary_variables,
    unknown_canary_variables,
)
from sglang.srt.kv_canary.perturb.config import PerturbConfig, parse_target_group
from sglang.srt.kv_canary.token_oracle.oracle import TOKEN_ORACLE_BACKEND

logger = logging.getLogger(__name__)

# ServerArgs attribute holding the server's CanaryConfig with what it was built from
# (:meth:`CanaryConfig.of_server`)
CONFIG_CACHE_ATTR = "kv_canary_config_cache"

# ServerArgs attribute recording a ``--sampling-backend token_oracle`` request (sglang's CPU
# engine rewrites ``sampling_backend`` to ``pytorch``; see plugin ``ServerArgs.__init__`` hook)
TOKEN_ORACLE_REQUESTED_ATTR = "kv_canary_token_oracle_requested"


def _parse_choice(cls, value, flag: str):
    """A member of the str enum ``cls`` or its value (any case, surrounding blanks ignored);
    anything else (``None``, ``''``, a misspelling) raises ``ValueError`` naming ``flag``."""
    if isinstance(value, cls):
        return value
    choice = normalize_choice(value)
    if choice not in {m.value for m in cls}:
        raise ValueError(
            f"invalid {flag} value {value!r}; allowed: {', '.join(m.value for m in cls)}"
        )
    return cls(choice)


class CanaryMode(str, enum.Enum):
    """``--kv-canary``: what happens on a violation."""

    NONE = "none"  # canary not installed
    LOG = "log"  # each violation logged once as a WARNING; serving goes on
    RAISE = "raise"  # the scheduler raises RuntimeError (the server stops)
    # the requests mapping the violating slot are aborted and its radix nodes evicted; each
    # violation is logged as in LOG; serving goes on
    ABORT = "abort"
    # as ABORT, but the requests are taken back and computed again from their tokens (aborted
    # only past SGLANG_KV_CANARY_MAX_HEALS heals of one request)
    HEAL = "heal"

    @property
    def contains(self) -> bool:
        """The mode acts on the requests a violation touches (abort, heal)."""
        return self in (CanaryMode.ABORT, CanaryMode.HEAL)

    @classmethod
    def parse(cls, value, *, flag: str = "--kv-canary") -> "CanaryMode":
        """A ``CanaryMode`` or its name (any case, surrounding blanks ignored), as the command
        line, ``--config`` YAML and ``Engine(kv_canary=...)`` all accept it; anything else
        (``None``, ``''``, a misspelling) raises ``ValueError`` naming ``flag``."""
        return _parse_choice(cls, value, flag)


class DraftViolations(str, enum.Enum):
    """``SGLANG_KV_CANARY_DRAFT_VIOLATIONS``: what a violation in a speculative draft model's
    KV pool does (docs/user_guide.md, "Speculative decoding": a draft's KV costs draft
    acceptance only, the target model verifies every token)."""

    REPORT = "report"  # logged and counted in every mode; raise and abort do not act on it
    ACT = "act"  # as a target-pool violation: raise stops the server, abort aborts requests

    @classmethod
    def parse(cls, value, *, flag: str = "SGLANG_KV_CANARY_DRAFT_VIOLATIONS") -> "DraftViolations":
        return _parse_choice(cls, value, flag)


REAL_DATA_CHOICES = {
    "none": RealKvHashMode.NONE,
    "partial": RealKvHashMode.PARTIAL,
    "all": RealKvHashMode.ALL,
}


def parse_real_data(value, *, flag: str = "--kv-canary-real-data") -> RealKvHashMode:
    """``RealKvHashMode`` of a choice name (any case, blanks ignored); else ``ValueError``
    naming ``flag``."""
    if isinstance(value, RealKvHashMode):
        return value
    choice = normalize_choice(value)
    if choice not in REAL_DATA_CHOICES:
        raise ValueError(f"invalid {flag} value {value!r}; allowed: {', '.join(REAL_DATA_CHOICES)}")
    return REAL_DATA_CHOICES[choice]


class RealDataLayers(str, enum.Enum):
    """``--kv-canary-real-data-layers``: whose KV rows the real-data fingerprints cover."""

    FIRST = "first"  # layer 0's K row (and V with SGLANG_KV_CANARY_ENABLE_MHA_V), in the record
    ALL = "all"  # also every layer's K and V rows, in a per-layer table

    @classmethod
    def parse(cls, value, *, flag: str = "--kv-canary-real-data-layers") -> "RealDataLayers":
        return _parse_choice(cls, value, flag)


def parse_sweep_interval(value, *, flag: str = "--kv-canary-sweep-interval") -> int:
    """An int, or a string of decimal digits, from 0 (off) to ``MAX_STEP_INTERVAL``; anything
    else (a bool, a float, ``None``, ``'abc'``) raises ``ValueError`` naming ``flag``."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and value.strip().isdigit():
        n = int(value.strip())
    else:
        n = None
    if n is None or not 0 <= n <= MAX_STEP_INTERVAL:
        raise ValueError(
            f"invalid {flag} value {value!r}; allowed: an integer from 0 (off) "
            f"to {MAX_STEP_INTERVAL}"
        )
    return n


def normalize_canary_values(values: dict) -> dict:
    """The four canary server arguments (``kv_canary``, ``kv_canary_sweep_interval``,
    ``kv_canary_real_data``, ``kv_canary_real_data_layers``) checked and in their canonical
    form (lower-case names, an int).
    The one parse of every start-up route: Engine / ServerArgs keyword arguments, the command
    line and ``--config`` YAML. Raises ``ValueError`` naming the flag."""
    return {
        "kv_canary": CanaryMode.parse(values["kv_canary"]).value,
        "kv_canary_sweep_interval": parse_sweep_interval(values["kv_canary_sweep_interval"]),
        "kv_canary_real_data": parse_real_data(values["kv_canary_real_data"]).name.lower(),
        "kv_canary_real_data_layers": RealDataLayers.parse(
            values["kv_canary_real_data_layers"]
        ).value,
    }


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


@dataclasses.dataclass(frozen=True)
class CanaryConfig:
    """Immutable canary settings. Nothing below the config reads the environment."""

    mode: CanaryMode = CanaryMode.NONE
    ring_capacity: int = 1024
    sweep_interval: int = 0
    real_kv_hash_mode: RealKvHashMode = RealKvHashMode.NONE
    real_data_layers: RealDataLayers = RealDataLayers.FIRST
    real_data_layers_per_forward: int = 1
    host_sweep_pages: int = 64
    enable_write_input_assert: bool = False
    enable_verify_token_assert: bool = False
    stats_print_every_n_steps: int = 100
    enable_mha_v: bool = False
    swa_divergence_stats_interval: int = 0
    enable_token_oracle: bool = False
    draft_violations: DraftViolations = DraftViolations.REPORT
    max_heals: int = 3
    retire_after: int = 1
    # heal mode: at most this fraction of the pool's slots retired (whole pages, rounded down)
    retire_max_fraction: float = 0.01
    # CPU servers: each forward's results read back one forward later, as on CUDA (tests of
    # the GPU's ordering on a CPU server); CUDA always reads back one forward later
    cpu_deferred_readback: bool = False
    perturb: PerturbConfig = PerturbConfig()

    def __post_init__(self):
        object.__setattr__(self, "mode", CanaryMode.parse(self.mode))
        object.__setattr__(
            self,
            "real_kv_hash_mode",
            parse_real_data(self.real_kv_hash_mode)
            if not isinstance(self.real_kv_hash_mode, int)
            else RealKvHashMode(self.real_kv_hash_mode),
        )
        object.__setattr__(self, "real_data_layers", RealDataLayers.parse(self.real_data_layers))
        object.__setattr__(self, "draft_violations", DraftViolations.parse(self.draft_violations))
        for name, minimum, maximum in (
            ("ring_capacity", 1, MAX_RING_CAPACITY),
            ("sweep_interval", 0, MAX_STEP_INTERVAL),
            ("real_data_layers_per_forward", 1, MAX_LAYERS_PER_FORWARD),
            ("host_sweep_pages", 0, MAX_STEP_INTERVAL),
            ("stats_print_every_n_steps", 0, MAX_STEP_INTERVAL),
            ("swa_divergence_stats_interval", 0, MAX_STEP_INTERVAL),
            ("max_heals", 1, MAX_HEALS),
            ("retire_after", 1, MAX_HEALS),
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not minimum <= value <= maximum
            ):
                raise ValueError(
                    f"CanaryConfig.{name} must be an int from {minimum} to {maximum}, got {value!r}"
                )
        fraction = self.retire_max_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ValueError(
                f"CanaryConfig.retire_max_fraction must be a number in [0, 1], got {fraction!r}"
            )
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(
                f"CanaryConfig.retire_max_fraction must be a number in [0, 1], got {fraction!r}"
            )
        if self.sweep_interval > 0 and self.mode == CanaryMode.NONE:
            raise ValueError(
                f"--kv-canary-sweep-interval={self.sweep_interval} needs the canary on: "
                "pass --kv-canary log, raise, abort or heal (or set the interval to 0)"
            )
        if self.real_kv_hash_mode != RealKvHashMode.NONE and self.mode == CanaryMode.NONE:
            raise ValueError(
                f"--kv-canary-real-data={self.real_kv_hash_mode.name.lower()} needs the canary "
                "on: pass --kv-canary log, raise, abort or heal (or drop it)"
            )
        if (
            self.real_data_layers == RealDataLayers.ALL
            and self.real_kv_hash_mode == RealKvHashMode.NONE
        ):
            raise ValueError(
                "--kv-canary-real-data-layers=all fingerprints every layer's KV rows: it needs "
                "--kv-canary-real-data partial or all (or drop it)"
            )
        if self.enable_token_oracle and not self.enabled:
            raise ValueError(
                f"the token oracle (--sampling-backend {TOKEN_ORACLE_BACKEND} or "
                "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE=1) needs --kv-canary log, raise, abort or heal"
            )
        if self.enable_write_input_assert and not self.enable_token_oracle:
            raise ValueError(
                "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT=1 checks written tokens against the "
                f"token oracle: pass --sampling-backend {TOKEN_ORACLE_BACKEND} or set "
                "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE=1"
            )
        if not isinstance(self.perturb, PerturbConfig):
            raise TypeError(
                f"CanaryConfig.perturb must be a PerturbConfig, got {type(self.perturb).__name__}"
            )
        self.perturb.check_against(
            canary_enabled=self.enabled,
            real_kv_hash_on=self.real_kv_hash_mode != RealKvHashMode.NONE,
            sweep_interval=self.sweep_interval,
            token_oracle=self.enable_token_oracle,
            aborts=self.mode.contains,
        )

    @property
    def enabled(self) -> bool:
        return self.mode != CanaryMode.NONE

    def for_draft(self, *, token_checks: bool, write_input_check: bool) -> "CanaryConfig":
        """The config a speculative draft runner's canary is built with (by ``install_canary``
        and predicted with by the memory budget): this one, without token checks on reads and
        writes (the token oracle's write-input check) when the draft pool's records cannot be
        checked against the request's tokens (``SpeculativeFacts.draft_token_checks``:
        multi-layer EAGLE's MTP steps write the token of p + k + 1 at p), and without the
        write-input check alone when the draft's forwards write no records
        (``SpeculativeFacts.draft_write_input_check``: DFLASH)."""
        verify = self.enable_verify_token_assert and token_checks
        write = self.enable_write_input_assert and token_checks and write_input_check
        if (verify, write) == (self.enable_verify_token_assert, self.enable_write_input_assert):
            return self
        return dataclasses.replace(
            self, enable_verify_token_assert=verify, enable_write_input_assert=write
        )

    def acting_mode(self, *, draft: bool) -> CanaryMode:
        """The mode a pool's violations are handled in: ``mode``, except a speculative draft
        pool's with ``draft_violations`` ``report``, which are logged (and counted) only."""
        if draft and self.draft_violations == DraftViolations.REPORT and self.enabled:
            return CanaryMode.LOG
        return self.mode

    def describe(self) -> str:
        """Every effective setting, as ``key=value`` words (the start-up log line)."""
        on = {True: "on", False: "off"}
        faults = ",".join(k.value for k in self.perturb.active_faults) or "off"
        return (
            f"mode={self.mode.value} real_data={self.real_kv_hash_mode.name.lower()} "
            f"real_data_layers={self.real_data_layers.value} "
            f"layers_per_forward={self.real_data_layers_per_forward} "
            f"sweep_interval={self.sweep_interval} host_sweep_pages={self.host_sweep_pages} "
            f"ring_capacity={self.ring_capacity} "
            f"token_checks={on[self.enable_verify_token_assert]} "
            f"token_oracle={on[self.enable_token_oracle]} "
            f"write_input_check={on[self.enable_write_input_assert]} "
            f"v_half={on[self.enable_mha_v]} "
            f"stats_every={self.stats_print_every_n_steps} "
            f"swa_divergence_every={self.swa_divergence_stats_interval} "
            f"draft_violations={self.draft_violations.value} "
            + (
                f"max_heals={self.max_heals} retire_after={self.retire_after} "
                f"retire_max_fraction={self.retire_max_fraction:g} "
                if self.mode == CanaryMode.HEAL
                else ""
            )
            + ("cpu_readback=deferred " if self.cpu_deferred_readback else "")
            + f"fault_injection={faults}"
        )

    @classmethod
    def of_server(cls, server_args) -> "CanaryConfig":
        """The server's config, built once (:meth:`from_server_args`) and kept on the
        ``ServerArgs`` instance with what it was built from (the canary's server arguments,
        the sampling backend and the ``SGLANG_KV_CANARY_*`` environment): every start-up
        check, ``repr(server_args)``, ``/server_info`` and each runner's install read the same
        object, and a changed flag or variable builds it anew. The instance carries it to the
        scheduler processes."""
        value = sglang_seam.server_args_value
        key = (
            tuple(
                value(server_args, name, None)
                for name in (
                    "kv_canary",
                    "kv_canary_sweep_interval",
                    "kv_canary_real_data",
                    "kv_canary_real_data_layers",
                    "sampling_backend",
                    TOKEN_ORACLE_REQUESTED_ATTR,
                )
            ),
            canary_environment(),
        )
        cached = value(server_args, CONFIG_CACHE_ATTR, None)
        if cached is not None and cached[0] == key:
            return cached[1]
        config = cls.from_server_args(server_args)
        sglang_seam.set_server_args_values(server_args, {CONFIG_CACHE_ATTR: (key, config)})
        return config

    @classmethod
    def from_server_args(cls, server_args) -> "CanaryConfig":
        """Server args (``kv_canary``, ``kv_canary_sweep_interval``, ``kv_canary_real_data``)
        plus, with the canary on, the ``SGLANG_KV_CANARY_*`` environment, parsed once. With the
        canary off no variable is read: set ones are named in one warning. Unknown
        ``SGLANG_KV_CANARY_*`` names get a warning with the closest known name."""
        value = sglang_seam.server_args_value
        mode = CanaryMode.parse(value(server_args, "kv_canary", "none"))
        sweep_interval = parse_sweep_interval(value(server_args, "kv_canary_sweep_interval", 0))
        real_data = parse_real_data(value(server_args, "kv_canary_real_data", "none"))
        layers = RealDataLayers.parse(value(server_args, "kv_canary_real_data_layers", "first"))
        oracle_flag = value(server_args, "sampling_backend", None) == TOKEN_ORACLE_BACKEND or bool(
            value(server_args, TOKEN_ORACLE_REQUESTED_ATTR, False)
        )
        for name, suggestion in unknown_canary_variables():
            _warn_once(
                f"kv_canary: unknown environment variable {name} is ignored"
                + (f"; did you mean {suggestion}?" if suggestion else "")
            )
        if mode == CanaryMode.NONE:
            ignored = set_canary_variables()
            if ignored:
                _warn_once(
                    "kv_canary: the canary is off (--kv-canary none); these variables "
                    f"are ignored: {', '.join(ignored)}"
                )
            return cls(
                mode=mode,
                sweep_interval=sweep_interval,
                real_kv_hash_mode=real_data,
                real_data_layers=layers,
                enable_token_oracle=oracle_flag,
            )
        return cls(
            mode=mode,
            sweep_interval=sweep_interval,
            real_kv_hash_mode=real_data,
            real_data_layers=layers,
            real_data_layers_per_forward=(
                canary_envs.SGLANG_KV_CANARY_REAL_DATA_LAYERS_PER_FORWARD.get()
            ),
            host_sweep_pages=canary_envs.SGLANG_KV_CANARY_HOST_SWEEP_PAGES.get(),
            ring_capacity=canary_envs.SGLANG_KV_CANARY_RING_CAPACITY.get(),
            enable_write_input_assert=canary_envs.SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT.get(),
            enable_verify_token_assert=canary_envs.SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT.get(),
            stats_print_every_n_steps=canary_envs.SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS.get(),
            enable_mha_v=canary_envs.SGLANG_KV_CANARY_ENABLE_MHA_V.get(),
            swa_divergence_stats_interval=(
                canary_envs.SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL.get()
            ),
            enable_token_oracle=(
                canary_envs.SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE.get() or oracle_flag
            ),
            draft_violations=canary_envs.SGLANG_KV_CANARY_DRAFT_VIOLATIONS.get(),
            max_heals=canary_envs.SGLANG_KV_CANARY_MAX_HEALS.get(),
            retire_after=canary_envs.SGLANG_KV_CANARY_RETIRE_AFTER.get(),
            retire_max_fraction=canary_envs.SGLANG_KV_CANARY_RETIRE_MAX_FRACTION.get(),
            cpu_deferred_readback=canary_envs.SGLANG_KV_CANARY_CPU_DEFERRED_READBACK.get(),
            perturb=perturb_config_from_env(),
        )


def perturb_config_from_env() -> PerturbConfig:
    """The ``SGLANG_KV_CANARY_PERTURB_*`` variables as a :class:`PerturbConfig`."""
    e = canary_envs
    return PerturbConfig(
        warmup_steps=e.SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS.get(),
        max_faults=e.SGLANG_KV_CANARY_PERTURB_MAX_FAULTS.get(),
        req_to_token_prob=e.SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB.get(),
        req_to_token_kept_prob=e.SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_KEPT_PROB.get(),
        real_kv_used_prob=e.SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB.get(),
        real_kv_unused_cache_prob=e.SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB.get(),
        real_kv_post_forward_prob=e.SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB.get(),
        real_kv_stuck_prob=e.SGLANG_KV_CANARY_PERTURB_REAL_KV_STUCK_PROB.get(),
        next_token_swap_prob=e.SGLANG_KV_CANARY_PERTURB_NEXT_TOKEN_SWAP_PROB.get(),
        host_kv_prob=e.SGLANG_KV_CANARY_PERTURB_HOST_KV_PROB.get(),
        pd_transfer_prob=e.SGLANG_KV_CANARY_PERTURB_PD_TRANSFER_PROB.get(),
        target_group=parse_target_group(e.SGLANG_KV_CANARY_PERTURB_TARGET_GROUP.get()),
        target_layer=e.SGLANG_KV_CANARY_PERTURB_TARGET_LAYER.get(),
        target_half=e.SGLANG_KV_CANARY_PERTURB_TARGET_HALF.get(),
        flip=e.SGLANG_KV_CANARY_PERTURB_FLIP.get(),
        target_tp_rank=e.SGLANG_KV_CANARY_PERTURB_TP_RANK.get(),
        target_pp_rank=e.SGLANG_KV_CANARY_PERTURB_PP_RANK.get(),
        target_dp_rank=e.SGLANG_KV_CANARY_PERTURB_DP_RANK.get(),
        target_worker=e.SGLANG_KV_CANARY_PERTURB_TARGET_WORKER.get() or None,
    )
