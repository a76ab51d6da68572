"""Server processes of the demo, the tests and the benchmarks: ``launch_server`` / ``sglang
serve`` flags from ``sglang.Engine`` keyword arguments, one HTTP exchange with a server on
127.0.0.1, and :class:`ServerProcess`, a server in its own process group with its log in a file
(docs/testing.md, "CPU server"). Not graph- or device-related: host processes only."""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import signal
import subprocess
import time
from typing import Dict, List, Tuple


def engine_kwargs_to_argv(kwargs: dict) -> List[str]:
    """``sglang.Engine`` keyword arguments as ``launch_server`` / ``sglang serve`` flags:
    ``True`` the bare flag, ``False`` / ``None`` left out, a list or tuple one value each
    (``--cuda-graph-bs 1 128``), anything else its ``str``."""
    argv: List[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv


def launch_server_flags(port: int, engine_kwargs: dict) -> List[str]:
    """The flags of a ``launch_server`` / ``sglang serve`` on ``127.0.0.1:port`` with
    ``engine_kwargs`` (:func:`engine_kwargs_to_argv`); the caller puts its launcher first."""
    return ["--host", "127.0.0.1", "--port", str(port), *engine_kwargs_to_argv(engine_kwargs)]


def http_call(
    port: int, method: str, path: str, body=None, timeout: float = 30.0
) -> Tuple[int, bytes]:
    """One HTTP exchange with a server on 127.0.0.1 (``body`` sent as JSON); raises on
    transport errors and timeouts (socket.timeout)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body)
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, path, body=payload, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def stop_process_group(proc: subprocess.Popen) -> None:
    """Stop a server started with ``start_new_session=True``: SIGTERM to its process group,
    SIGKILL after 15 s, then SIGKILL to the group whatever happened (its scheduler and
    detokenizer share it)."""
    if proc.poll() is None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class ServerStartError(RuntimeError):
    """A :class:`ServerProcess` exited during start-up or did not become ready in time."""


class ServerProcess:
    """One HTTP server process (``launch_server``, ``sglang serve``) on 127.0.0.1:``port``,
    started in its own session so :meth:`stop` signals its process group (the server, its
    scheduler and detokenizer) and nothing else; stdout and stderr go to ``log_path``, open
    for the server's whole life. ``argv`` is the whole command line, ``--port`` included."""

    def __init__(
        self,
        name: str,
        argv: List[str],
        *,
        port: int,
        env: Dict[str, str],
        log_path: "str | os.PathLike[str]",
    ):
        self.name = name
        self.port = port
        self.log_path = pathlib.Path(log_path)
        self._log = open(self.log_path, "w")  # noqa: SIM115  (closed by stop())
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def wait_ready(self, timeout: float, path: str = "/health_generate") -> None:
        """Poll ``path`` (by default ``/health_generate``: a real forward) once a second until
        it answers 200; :class:`ServerStartError`, with the log's tail, if the process exits
        first or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerStartError(
                    f"{self.name} server exited ({self.proc.returncode}) "
                    f"during start-up:\n{self.tail()}"
                )
            try:
                if http_call(self.port, "GET", path, timeout=60)[0] == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(1.0)
        raise ServerStartError(
            f"{self.name} server not ready after {timeout:.0f} s:\n{self.tail()}"
        )

    def stop(self) -> None:
        stop_process_group(self.proc)
        self._log.close()
