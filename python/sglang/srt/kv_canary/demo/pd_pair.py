"""A prefill/decode (PD) pair of sglang 0.5.12 servers on one GPU with a real transfer engine,
as the demo's ``pd_transfer`` case and ``benchmark/kv_canary/pd_one_gpu.py`` start it
(docs/user_guide.md, "Deployments"): each role's ``launch_server`` flags, the environment that
keeps the transfer on the loopback, and one request the way a PD router sends it (the same body,
bootstrap fields included, to both servers at once). Host processes only."""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import pathlib
import random
import threading
from typing import Callable, Dict, List, Optional, Tuple

HttpCall = Callable[..., Tuple[int, bytes]]  # server_process.http_call's signature

TRANSFER_BACKENDS = ("mooncake", "nixl")


class PdRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


def transfer_engine_missing(backend: str) -> Optional[str]:
    """None when ``backend``'s transfer engine imports here; else why not, naming the bundle
    that brings it to a GPU machine (``test/device_bundle_pd.sh``)."""
    if backend not in TRANSFER_BACKENDS:
        return f"transfer backend {backend!r}: allowed {', '.join(TRANSFER_BACKENDS)}"
    pkg = "mooncake" if backend == "mooncake" else "nixl_cu13"
    if importlib.util.find_spec(pkg) is None:
        return (
            f"the {backend} transfer engine (Python package {pkg!r}) is not importable "
            "(on a GPU machine: `bash .device/pd_a/install.sh` from test/device_bundle_pd.sh)"
        )
    return None


def role_flags(
    role: PdRole, backend: str, bootstrap_port: int, *, skip_warmup: bool = False
) -> List[str]:
    """``launch_server`` flags of one side of the pair; the prefill server's bootstrap server
    listens on ``bootstrap_port``. ``skip_warmup``: no warm-up request (its transfer is one
    sglang fakes: nothing moves)."""
    flags = ["--disaggregation-transfer-backend", backend, "--disaggregation-mode", role.value]
    if role is PdRole.PREFILL:
        flags += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return flags + (["--skip-server-warmup"] if skip_warmup else [])


def pair_env(base: Dict[str, str], *, no_fake_requests: bool = False) -> Dict[str, str]:
    """``base`` for both servers of a pair: ``SGLANG_HOST_IP=127.0.0.1`` (sglang's
    ``get_local_ip_auto`` reads it first, so the KV managers' sockets and Mooncake's
    TransferEngine stay on the loopback) and Mooncake's package folder on ``LD_LIBRARY_PATH``
    (its ``engine.so`` finds its companion libraries through an RPATH that a ``--target``
    install may not keep). ``no_fake_requests``: ``/health`` answers without a forward, so no
    request sglang fakes a transfer for reaches the decode server."""
    env = dict(base, SGLANG_HOST_IP="127.0.0.1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        folder = str(pathlib.Path(list(spec.submodule_search_locations)[0]))
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [folder] + [p for p in [env.get("LD_LIBRARY_PATH", "")] if p]
        )
    if no_fake_requests:
        env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "0"
    return env


def generate(http_call: HttpCall, port: int, body: dict, timeout: float) -> dict:
    """POST /generate; the JSON answer, or ``{"error": ...}``."""
    try:
        status, raw = http_call(port, "POST", "/generate", body, timeout=timeout)
    except Exception as e:  # noqa: BLE001  (reported, the run goes on)
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        out = json.loads(raw)
    except ValueError:
        return {"error": f"HTTP {status}: {raw[:300]!r}"}
    if status != 200:
        return {"error": f"HTTP {status}: {json.dumps(out)[:300]}"}
    return out if isinstance(out, dict) else {"error": f"unexpected answer {str(out)[:300]}"}


def body_for(prompt: List[int], max_new: int, boot: Optional[dict] = None) -> dict:
    """A greedy ``/generate`` body for ``prompt`` (``ignore_eos``), with ``boot``'s fields."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True},
    }
    if boot:
        body.update(boot)
    return body


def pd_request(
    http_call: HttpCall,
    prefill_port: int,
    decode_port: int,
    bootstrap_port: int,
    prompt: List[int],
    max_new: int,
    timeout: float,
) -> dict:
    """One request the way a PD router sends it: the same body, bootstrap fields included, to
    the prefill and the decode server at once; the decode server's answer (``output_ids``,
    ``meta_info``, ``error``) plus the prefill's error, if any, and the bootstrap room."""
    boot = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.SystemRandom().randrange(1, 2**63 - 1),
    }
    body = body_for(prompt, max_new, boot)
    answers: Dict[str, dict] = {}

    def send(name: str, port: int) -> None:
        answers[name] = generate(http_call, port, body, timeout)

    threads = [
        threading.Thread(target=send, args=(n, p), daemon=True)
        for n, p in (("prefill", prefill_port), ("decode", decode_port))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    dec = answers.get("decode", {"error": "no answer (thread still running)"})
    pre = answers.get("prefill", {"error": "no answer (thread still running)"})
    out = {
        "room": boot["bootstrap_room"],
        "output_ids": dec.get("output_ids"),
        "meta_info": dec.get("meta_info", {}),
    }
    if "error" in dec:
        out["error"] = "decode: " + dec["error"]
    if "error" in pre:
        out["prefill_error"] = pre["error"]
    return out
