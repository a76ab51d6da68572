"""The one main of the workload scripts in this folder: ``python SCRIPT.py MODEL_DIR [engine
kwargs as JSON] [cpu|cuda] [the script's own arguments...]``.

:func:`main` parses that command line (:class:`ScriptArgs`), starts an ``sglang.Engine`` on
the tiny-server settings of ``server_harness`` (``cpu_engine_kwargs`` or ``gpu_engine_kwargs``)
with the script's fixed keyword arguments and the JSON ones (a key in both is an error), runs
the script's body on it, prints ``RESULT <json>`` with what the body returned and shuts the
Engine down. Tests run the scripts through ``canary_support.script_run``; a script that starts
an Engine must call :func:`main` under ``if __name__ == "__main__":`` (sglang spawns
processes)."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple

DEVICES = ("cpu", "cuda")
RESULT_TAG = "RESULT "
INFO_TAG = "INFO "
PHASE_END_TAG = "KV_CANARY_TEST_PHASE_END "
CLEAN_TAG = "CLEAN "  # on stderr, after a two-phase script's clean phase


@dataclasses.dataclass(frozen=True)
class ScriptArgs:
    """A workload script's command line, parsed once."""

    script: str
    model_dir: str
    engine_kwargs: Mapping[str, Any]
    device: str
    rest: Tuple[str, ...]  # the script's own arguments, after the device


def parse_argv(argv: Sequence[str]) -> ScriptArgs:
    """``argv`` as ``sys.argv``; exits with a message naming the bad value and what is allowed."""
    script = argv[0] if argv else "workload script"
    if len(argv) < 2:
        sys.exit(f"{script}: usage: MODEL_DIR [engine kwargs as JSON] [{'|'.join(DEVICES)}] ...")
    kwargs = json.loads(argv[2]) if len(argv) > 2 else {}
    if not isinstance(kwargs, dict):
        sys.exit(f"{script}: engine kwargs {argv[2]!r} must be a JSON object")
    device = argv[3] if len(argv) > 3 else "cpu"
    if device not in DEVICES:
        sys.exit(f"{script}: device {device!r}; allowed: {', '.join(DEVICES)}")
    return ScriptArgs(script, argv[1], kwargs, device, tuple(argv[4:]))


def emit(tag: str, obj: Any) -> None:
    print(tag + json.dumps(obj), flush=True)


def end_phase(name: str) -> None:
    """``KV_CANARY_TEST_PHASE_END <name>`` on stderr, where the server's log lines go: in the
    captured stderr it follows every line the phase's forwards logged before their requests
    returned (on the CPU each forward's ``kv_canary stats:`` line among them), and precedes
    every line of the next phase's forwards."""
    print(PHASE_END_TAG + name, file=sys.stderr, flush=True)


def emit_server_info(engine) -> None:
    """``INFO <json>``: the server info's ``kv_canary`` and ``max_total_num_tokens``, and as
    ``kv_canary_live`` each scheduler's ``internal_states[i].kv_canary`` (read now)."""
    info = engine.get_server_info()
    out = {k: info.get(k) for k in ("kv_canary", "max_total_num_tokens")}
    out["kv_canary_live"] = [s.get("kv_canary") for s in info.get("internal_states") or []]
    emit(INFO_TAG, out)


def main(
    body: Callable[[Any, ScriptArgs], Any],
    *,
    fixed_kwargs: Optional[Mapping[str, Any]] = None,
    default_kwargs: Optional[Mapping[str, Any]] = None,
    argv: Optional[Sequence[str]] = None,
) -> None:
    """Start the Engine, print ``RESULT <json>`` of ``body(engine, args)``, shut it down.
    ``fixed_kwargs``: engine kwargs the script sets (given ones refused); ``default_kwargs``:
    those it sets unless given."""
    args = parse_argv(sys.argv if argv is None else argv)
    fixed = dict(fixed_kwargs or {})
    both = sorted(set(fixed) & set(args.engine_kwargs))
    if both:
        sys.exit(f"{args.script}: engine kwargs {both} are set by the script itself")
    given = {**(default_kwargs or {}), **args.engine_kwargs}
    import sglang
    from sglang.srt.kv_canary.demo.server_harness import cpu_engine_kwargs, gpu_engine_kwargs

    make = gpu_engine_kwargs if args.device == "cuda" else cpu_engine_kwargs
    engine = sglang.Engine(**make(args.model_dir, **fixed, **given))
    emit(RESULT_TAG, body(engine, args))
    engine.shutdown()
