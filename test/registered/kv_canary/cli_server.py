"""A real sglang 0.5.12 HTTP server on the CPU, started from the command line
(``python -m sglang.launch_server``), for the end-to-end tests that must take the CLI path.

The server's flags are :func:`~sglang.srt.kv_canary.demo.server_harness.cpu_engine_kwargs`
written as command-line flags; its output goes to a log file the test reads.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from sglang.srt.kv_canary.demo.server_process import (  # noqa: F401  (http_call: tests)
    ServerProcess,
    ServerStartError,
    http_call,
    launch_server_flags,
)
from sglang.srt.kv_canary.demo.server_harness import cpu_engine_kwargs, free_port

START_TIMEOUT_S = 240.0


def server_argv(model_dir: str, port: int, **engine_kwargs) -> list[str]:
    """``cpu_engine_kwargs(model_dir, **engine_kwargs)`` (the harness's CPU server settings)
    as launch_server flags."""
    return launch_server_flags(port, cpu_engine_kwargs(model_dir, **engine_kwargs))


def launcher_argv(launcher: str) -> list[str]:
    """``python -m sglang.launch_server`` or the ``sglang serve`` console script (the
    installed one next to this interpreter)."""
    if launcher == "launch_server":
        return [sys.executable, "-m", "sglang.launch_server"]
    if launcher == "serve":
        script = pathlib.Path(sys.executable).parent / "sglang"
        if not script.exists():
            raise FileNotFoundError(f"no sglang console script next to {sys.executable}")
        return [str(script), "serve"]
    raise ValueError(f"launcher must be launch_server or serve, got {launcher!r}")


class CliServer(ServerProcess):
    """One ``launch_server`` (or ``sglang serve``: ``launcher="serve"``) process (own
    session), its log in ``root / f"{name}.log"``; ``engine_kwargs`` go through
    :func:`server_argv`, ``extra_argv`` is appended verbatim."""

    def __init__(
        self,
        name: str,
        root: pathlib.Path,
        model_dir: str,
        env: dict[str, str],
        extra_argv: list[str],
        launcher: str = "launch_server",
        **engine_kwargs,
    ):
        port = free_port()
        super().__init__(
            name,
            [*launcher_argv(launcher), *server_argv(model_dir, port, **engine_kwargs), *extra_argv],
            port=port,
            env=env,
            log_path=root / f"{name}.log",
        )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        try:
            super().wait_ready(timeout)
        except ServerStartError as e:
            pytest.fail(str(e))
