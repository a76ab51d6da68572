"""``CanaryConfig``: every canary setting, built once from server args + environment
(docs/architecture.md, "Runtime")."""

from __future__ import annotations

import dataclasses
import enum

from sglang.jit_kernel.kv_canary.consts import RealKvHashMode
from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.envs import canary_envs
from sglang.srt.kv_canary.perturb.config import PerturbConfig, parse_target_group
from sglang.srt.kv_canary.token_oracle.oracle import TOKEN_ORACLE_BACKEND

# ServerArgs attribute recording a ``--sampling-backend token_oracle`` request (sglang's CPU
# engine rewrites ``sampling_backend`` to ``pytorch``; see plugin ``ServerArgs.__init__`` hook)
TOKEN_ORACLE_REQUESTED_ATTR = "kv_canary_token_oracle_requested"


class CanaryMode(str, enum.Enum):
    """``--kv-canary``: what happens on a violation."""

    NONE = "none"  # canary not installed
    LOG = "log"  # each violation logged once as a WARNING; serving goes on
    RAISE = "raise"  # the scheduler raises RuntimeError (the server stops)

    @classmethod
    def parse(cls, value, *, flag: str = "--kv-canary") -> "CanaryMode":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"invalid {flag} value {value!r}; allowed: {', '.join(m.value for m in cls)}"
            ) from None


REAL_DATA_CHOICES = {"none": RealKvHashMode.NONE, "partial": RealKvHashMode.PARTIAL,
                     "all": RealKvHashMode.ALL}


def parse_real_data(value, *, flag: str = "--kv-canary-real-data") -> RealKvHashMode:
    if isinstance(value, RealKvHashMode):
        return value
    try:
        return REAL_DATA_CHOICES[str(value).lower()]
    except KeyError:
        raise ValueError(
            f"invalid {flag} value {value!r}; allowed: {', '.join(REAL_DATA_CHOICES)}"
        ) from None


@dataclasses.dataclass(frozen=True)
class CanaryConfig:
    """Immutable canary settings. Nothing below the config reads the environment."""

    mode: CanaryMode = CanaryMode.NONE
    ring_capacity: int = 1024
    sweep_interval: int = 0
    real_kv_hash_mode: RealKvHashMode = RealKvHashMode.NONE
    enable_write_input_assert: bool = False
    enable_verify_token_assert: bool = False
    stats_print_every_n_steps: int = 100
    enable_mha_v: bool = False
    swa_divergence_stats_interval: int = 0
    enable_token_oracle: bool = False
    perturb: PerturbConfig = PerturbConfig()

    def __post_init__(self):
        object.__setattr__(self, "mode", CanaryMode.parse(self.mode))
        object.__setattr__(self, "real_kv_hash_mode", parse_real_data(self.real_kv_hash_mode)
                           if not isinstance(self.real_kv_hash_mode, int)
                           else RealKvHashMode(self.real_kv_hash_mode))
        for name, minimum in (("ring_capacity", 1), ("sweep_interval", 0),
                              ("stats_print_every_n_steps", 0),
                              ("swa_divergence_stats_interval", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"CanaryConfig.{name} must be an int >= {minimum}, got {value!r}")
        if self.sweep_interval > 0 and self.mode == CanaryMode.NONE:
            raise ValueError(
                f"--kv-canary-sweep-interval={self.sweep_interval} needs the canary on: "
                "pass --kv-canary log or --kv-canary raise (or set the interval to 0)"
            )
        if self.enable_token_oracle and not self.enabled:
            raise ValueError(
                f"the token oracle (--sampling-backend {TOKEN_ORACLE_BACKEND} or "
                "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE=1) needs --kv-canary log or raise")
        if self.enable_write_input_assert and not self.enable_token_oracle:
            raise ValueError(
                "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT=1 checks written tokens against the "
                f"token oracle: pass --sampling-backend {TOKEN_ORACLE_BACKEND} or set "
                "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE=1")
        if not isinstance(self.perturb, PerturbConfig):
            raise TypeError(f"CanaryConfig.perturb must be a PerturbConfig, got "
                            f"{type(self.perturb).__name__}")
        self.perturb.check_against(
            canary_enabled=self.enabled,
            real_kv_hash_on=self.real_kv_hash_mode != RealKvHashMode.NONE,
            sweep_interval=self.sweep_interval, token_oracle=self.enable_token_oracle)

    @property
    def enabled(self) -> bool:
        return self.mode != CanaryMode.NONE

    @classmethod
    def from_server_args(cls, server_args) -> "CanaryConfig":
        """Server args (``kv_canary``, ``kv_canary_sweep_interval``, ``kv_canary_real_data``)
        plus the ``SGLANG_KV_CANARY_*`` environment, parsed once."""
        value = sglang_seam.server_args_value
        return cls(
            mode=CanaryMode.parse(value(server_args, "kv_canary", "none") or "none"),
            sweep_interval=int(value(server_args, "kv_canary_sweep_interval", 0) or 0),
            real_kv_hash_mode=parse_real_data(value(server_args, "kv_canary_real_data", "none")
                                              or "none"),
            ring_capacity=canary_envs.SGLANG_KV_CANARY_RING_CAPACITY.get(),
            enable_write_input_assert=canary_envs.SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT.get(),
            enable_verify_token_assert=canary_envs.SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT.get(),
            stats_print_every_n_steps=canary_envs.SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS.get(),
            enable_mha_v=canary_envs.SGLANG_KV_CANARY_ENABLE_MHA_V.get(),
            swa_divergence_stats_interval=(
                canary_envs.SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL.get()),
            enable_token_oracle=(
                canary_envs.SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE.get()
                or value(server_args, "sampling_backend", None) == TOKEN_ORACLE_BACKEND
                or bool(value(server_args, TOKEN_ORACLE_REQUESTED_ATTR, False))),
            perturb=perturb_config_from_env(),
        )


def perturb_config_from_env() -> PerturbConfig:
    """The ``SGLANG_KV_CANARY_PERTURB_*`` variables as a :class:`PerturbConfig`."""
    e = canary_envs
    return PerturbConfig(
        warmup_steps=e.SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS.get(),
        req_to_token_prob=e.SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB.get(),
        real_kv_used_prob=e.SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB.get(),
        real_kv_unused_cache_prob=e.SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB.get(),
        real_kv_post_forward_prob=e.SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB.get(),
        next_token_swap_prob=e.SGLANG_KV_CANARY_PERTURB_NEXT_TOKEN_SWAP_PROB.get(),
        target_group=parse_target_group(e.SGLANG_KV_CANARY_PERTURB_TARGET_GROUP.get()),
    )
