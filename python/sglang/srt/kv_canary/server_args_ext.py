"""The four canary server arguments (``DEFAULTS``), added to sglang's ``ServerArgs`` through
hooks.

``ServerArgs`` is a dataclass we must not edit: the fields live as instance attributes set
around ``__init__`` (so ``Engine(kv_canary=...)`` works and the values are pickled to the
scheduler processes), the CLI options are added after ``add_cli_args`` (so ``--help`` and
``--config`` YAML, with dashed keys, know them), and ``from_cli_args`` copies them over.
:meth:`~sglang.srt.kv_canary.config.CanaryConfig.from_server_args` reads them (through the
sglang seam).
"""

from __future__ import annotations

import argparse

from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.config import (
    REAL_DATA_CHOICES,
    RealDataLayers,
    TOKEN_ORACLE_REQUESTED_ATTR,
    CanaryMode,
    normalize_canary_values,
    parse_sweep_interval,
)
from sglang.srt.kv_canary.envs import normalize_choice
from sglang.srt.kv_canary.token_oracle.oracle import TOKEN_ORACLE_BACKEND

DEFAULTS = {
    "kv_canary": "none",
    "kv_canary_sweep_interval": 0,
    "kv_canary_real_data": "none",
    "kv_canary_real_data_layers": "first",
}


def _argparse_type(parse):
    """An argparse ``type`` from one of the config's parsers (the same parse as the Engine
    keyword arguments get; argparse names the flag itself)."""

    def convert(value: str):
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


def add_canary_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV-cache canary (sglang-kv-canary)")
    group.add_argument(
        "--kv-canary",
        type=normalize_choice,
        default=DEFAULTS["kv_canary"],
        choices=[m.value for m in CanaryMode],
        help="Verify every KV slot attention reads against a fingerprint record: 'log' logs "
        "each violation, 'raise' stops the server on the first one, 'abort' logs it, "
        "aborts the requests reading the corrupt slot and evicts it from the radix cache "
        "(serving goes on), 'heal' does what abort does but takes the requests back and "
        "computes them again from their tokens (their clients get the right output), 'none' "
        "(default) installs nothing.",
    )
    group.add_argument(
        "--kv-canary-sweep-interval",
        type=_argparse_type(parse_sweep_interval),
        default=DEFAULTS["kv_canary_sweep_interval"],
        help="Every N forward steps also verify the KV slots idle in the radix cache "
        "(0 = off, the default). Needs --kv-canary log, raise, abort or heal.",
    )
    group.add_argument(
        "--kv-canary-real-data",
        type=normalize_choice,
        default=DEFAULTS["kv_canary_real_data"],
        choices=list(REAL_DATA_CHOICES),
        help="Also fingerprint the real KV bytes: 'partial' (first 16 bytes of layer 0's "
        "row), 'all' (the whole row) or 'none' (default).",
    )
    group.add_argument(
        "--kv-canary-real-data-layers",
        type=normalize_choice,
        default=DEFAULTS["kv_canary_real_data_layers"],
        choices=[m.value for m in RealDataLayers],
        help="Which layers the real-data fingerprints cover: 'first' (default: layer 0's K "
        "row) or 'all' (every layer's K and V rows: all checked at write time and by the "
        "sweep, a rotating window of layers on every read). Needs --kv-canary-real-data "
        "partial or all.",
    )


def pop_canary_kwargs(kwargs: dict) -> dict:
    """The canary's ``Engine`` / ``ServerArgs`` keyword arguments (defaults for the missing
    ones), removed from ``kwargs``, checked and normalised (``ValueError`` naming the flag)."""
    return normalize_canary_values({k: kwargs.pop(k, v) for k, v in DEFAULTS.items()})


def canary_values_from_namespace(args: argparse.Namespace) -> dict:
    """The parsed ``--kv-canary*`` options (defaults for the missing ones), checked and
    normalised like the keyword arguments."""
    return normalize_canary_values({k: getattr(args, k, v) for k, v in DEFAULTS.items()})


def set_canary_attrs(server_args, values: dict) -> None:
    sglang_seam.set_server_args_values(server_args, values)


_MISSING = object()


def _canary_on(server_args) -> bool:
    """Whether ``--kv-canary`` is other than ``none`` (its value normalized at the edge, by
    :func:`~sglang.srt.kv_canary.config.normalize_canary_values`)."""
    from sglang.srt.kv_canary.config import CanaryMode

    value = sglang_seam.server_args_value(server_args, "kv_canary", CanaryMode.NONE.value)
    return value != CanaryMode.NONE.value


def _effective_config(server_args) -> str:
    """The effective settings (flags plus ``SGLANG_KV_CANARY_*``) as ``key=value`` words, as
    the start-up log line has them; ``invalid: ...`` when they do not parse (a repr must not
    raise)."""
    from sglang.srt.kv_canary.config import CanaryConfig

    try:
        return CanaryConfig.of_server(server_args).describe()
    except ValueError as e:
        return f"invalid: {e}"


def canary_repr_suffix(server_args) -> str:
    """``, kv_canary='raise', kv_canary_sweep_interval=0, kv_canary_real_data='none',
    kv_canary_real_data_layers='first', kv_canary_config='mode=raise ...'`` for
    ``repr(server_args)`` (the canary's fields live on the instance, outside the dataclass's
    own repr; the effective config only with the canary on); empty when the instance has none
    of them."""
    parts = []
    for name in DEFAULTS:
        value = sglang_seam.server_args_value(server_args, name, _MISSING)
        if value is not _MISSING:
            parts.append(f"{name}={value!r}")
    if parts and _canary_on(server_args):
        parts.append(f"kv_canary_config={_effective_config(server_args)!r}")
    return "".join(", " + p for p in parts)


def canary_settings(server_args) -> dict:
    """The canary's flags and (with the canary on) its effective config, for
    ``/server_info`` and ``Engine.get_server_info()``."""
    out = {
        name: sglang_seam.server_args_value(server_args, name, default)
        for name, default in DEFAULTS.items()
    }
    out["config"] = _effective_config(server_args) if _canary_on(server_args) else None
    return out


def note_requested_sampling_backend(server_args, requested) -> None:
    """Remember a ``--sampling-backend token_oracle`` request: sglang may rewrite
    ``sampling_backend`` during ``__init__`` (its CPU engine forces ``pytorch``), and the
    canary must still know the operator asked for the oracle."""
    sglang_seam.set_server_args_values(
        server_args, {TOKEN_ORACLE_REQUESTED_ATTR: requested == TOKEN_ORACLE_BACKEND}
    )
