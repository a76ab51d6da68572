"""``python launch_server_cases.py CASES_JSON``: ``python -m sglang.launch_server``'s main
code, run in this one process once per case, for the command-line cases that end before a
server starts (``--help``, refused flag values, a bad environment variable, flags read from a
``--config`` YAML file): one sglang import for all of them instead of one per case.

``CASES_JSON``: a JSON list of ``{"argv": [...], "env": {...}}``; each case runs the module
``sglang.launch_server`` as ``__main__`` (its plugin loading and ``prepare_server_args``, as
the command line does) with ``sys.argv`` set to its ``argv`` and its ``env`` added to the
environment while it runs. sglang's HTTP server is replaced by a stand-in that prints
``PARSED <kv_canary> <sweep interval> <real data>`` from the server arguments it was given and
exits 0, so a case that parses starts nothing. Prints ``RESULT <json>``: per case ``{"exit":
the exit status (1 for an exception, as Python's own exit), "output": what it printed, the
exception's traceback included}``.
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback


def _stand_in_server(server_args):
    print(
        "PARSED",
        server_args.kv_canary,
        server_args.kv_canary_sweep_interval,
        server_args.kv_canary_real_data,
    )
    raise SystemExit(0)


def _exit_status(code) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1  # sys.exit("message") exits 1


def run_case(argv, env) -> dict:
    saved_argv, saved_env = sys.argv, dict(os.environ)
    out = io.StringIO()
    os.environ.update(env)
    sys.argv = ["sglang.launch_server", *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
                status = 0
            except SystemExit as e:
                status = _exit_status(e.code)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except Exception:  # noqa: BLE001 - reported as Python reports an uncaught one
                traceback.print_exc()
                status = 1
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
    return {"exit": status, "output": out.getvalue()}


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("launch_server_cases.py: usage: CASES_JSON")
    cases = json.loads(sys.argv[1])
    if not isinstance(cases, list):
        sys.exit(f"launch_server_cases.py: CASES_JSON must be a JSON list, got {sys.argv[1]!r}")
    from sglang.srt.entrypoints import http_server

    http_server.launch_server = _stand_in_server
    results = [run_case(c["argv"], c.get("env", {})) for c in cases]
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
