"""What the demo needs to run a real sglang 0.5.12 server with a tiny dummy-weight Llama on
the CPU or a GPU (the end-to-end tests use it too): the model's ``config.json``, a
``libcuda.so.1`` stub and the environment of a GPU-less server, ``sglang.Engine`` keyword
arguments, free ports. Design: docs/testing.md, "CPU server". Scripts that start an
Engine must guard it with ``if __name__ == "__main__":`` (sglang spawns processes). Server
processes: :mod:`~sglang.srt.kv_canary.demo.server_process`; the other model shapes are test
support (``test/registered/kv_canary/canary_support``)."""

from __future__ import annotations

import glob
import json
import os
import pathlib
import random
import re
import shutil
import socket
import subprocess
import threading
from typing import Dict, List, Optional, Tuple

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_CUDA_ERROR_NO_DEVICE = 100


def write_tiny_llama(model_dir, **overrides) -> str:
    """Write the tiny Llama ``config.json`` into ``model_dir``; returns the directory."""
    return write_model_config(model_dir, {**TINY_LLAMA_CONFIG, **overrides})


def write_model_config(model_dir, config: dict) -> str:
    """Write ``config`` as ``model_dir/config.json`` (a dummy-weight model's whole
    definition); returns the directory."""
    path = pathlib.Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return str(path)


def _common_ops_libraries() -> List[str]:
    import importlib.util

    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sgl_kernel is not installed (it comes with sglang 0.5.12)")
    root = spec.submodule_search_locations[0]
    libs = sorted(glob.glob(os.path.join(root, "**", "common_ops*.so"), recursive=True))
    if not libs:
        raise RuntimeError(f"no common_ops*.so found under {root}")
    return libs


def libcuda_symbols(libraries: Optional[List[str]] = None) -> List[str]:
    """CUDA driver-API symbols (``cu*``, unversioned) the given libraries import."""
    if shutil.which("nm") is None:
        raise RuntimeError("`nm` (binutils) is needed to build the libcuda stub")
    names = set()
    for lib in libraries or _common_ops_libraries():
        out = subprocess.run(
            ["nm", "-D", "--undefined-only", lib], check=True, capture_output=True, text=True
        ).stdout
        for line in out.splitlines():
            m = re.match(r"\s*U\s+(cu[A-Z]\w*)(@\S+)?$", line)
            if m and (m.group(2) is None or "libcuda" in m.group(2)):
                names.add(m.group(1))
    return sorted(names)


def build_libcuda_stub(out_dir) -> str:
    """Build ``out_dir/libcuda.so.1`` (once; reused when present); returns ``out_dir``."""
    out = pathlib.Path(out_dir)
    lib = out / "libcuda.so.1"
    if lib.exists():
        return str(out)
    if shutil.which("gcc") is None:
        raise RuntimeError("`gcc` is needed to build the libcuda stub")
    out.mkdir(parents=True, exist_ok=True)
    symbols = libcuda_symbols() + ["cuInit", "cuDriverGetVersion", "cuDeviceGetCount"]
    src = ["/* generated: a libcuda.so.1 whose every entry point reports no device */"]
    for name in sorted(set(symbols)):
        src.append(f"int {name}(void) {{ return {_CUDA_ERROR_NO_DEVICE}; }}")
    c_file = out / "libcuda_stub.c"
    c_file.write_text("\n".join(src) + "\n")
    tmp = out / f"libcuda.so.1.tmp{os.getpid()}"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(c_file)],
        check=True,
    )
    os.replace(tmp, lib)
    return str(out)


# one OpenMP thread per server process unless the caller's environment says otherwise: the
# tiny model gains nothing from a second thread, and where several servers share a few cores
# (the test suites, the demo's --jobs) an OpenMP team waits, spinning, on a thread another
# process holds off its core: a workload of 24 requests took 17-20 s instead of 3-5 s so
CPU_SERVER_OMP_THREADS = "1"


def cpu_server_env(stub_dir, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for a CPU sglang server process (stub on LD_LIBRARY_PATH, CPU engine, one
    OpenMP thread unless ``OMP_NUM_THREADS`` is set)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", CPU_SERVER_OMP_THREADS)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(stub_dir), env.get("LD_LIBRARY_PATH", "")) if p
    )
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.pop("TRITON_INTERPRET", None)  # the CPU server runs the torch references
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


_COMMON_ENGINE_KWARGS = dict(
    sampling_backend="pytorch",
    grammar_backend="none",
    load_format="dummy",
    skip_tokenizer_init=True,
    max_total_tokens=4096,
    log_level="warning",
    random_seed=0,
    # many of these servers share one machine (the test suites, the demo's --jobs): sglang's
    # scheduler otherwise polls its sockets in a busy loop, a whole core each, while it has
    # nothing to run; asleep it still wakes on the next request and runs its idle checks first
    sleep_on_idle=True,
)


# sglang sizes a CPU server's pool from two readings of the host's available memory, before
# and after loading the model: rest = after - before * (1 - mem_fraction_static), and "Not
# enough memory" when rest <= 0. Another process allocating more than ``mem_fraction_static`` of
# the available memory in between (a test server starting beside it) failed 0.05 (CI, and
# reproduced with 6 GB available and a 1.2 GB allocation churning beside the start-up); the
# pool itself stays capped by ``max_total_tokens``, so the larger fraction only adds slack.
CPU_MEM_FRACTION_STATIC = 0.3


def cpu_engine_kwargs(model_dir: str, **overrides) -> dict:
    """``sglang.Engine`` keyword arguments for the tiny CPU server; one set per server (its
    ``nccl_port`` is picked here, see :func:`free_port`)."""
    return {
        **_COMMON_ENGINE_KWARGS,
        "model_path": model_dir,
        "device": "cpu",
        "attention_backend": "torch_native",
        "disable_cuda_graph": True,
        "mem_fraction_static": CPU_MEM_FRACTION_STATIC,
        "nccl_port": free_port(),
        **overrides,
    }


def gpu_engine_kwargs(model_dir: str, **overrides) -> dict:
    """``sglang.Engine`` keyword arguments for the tiny model on one GPU, CUDA graphs on
    (settings seen working with sglang 0.5.12 on an H100; the first capture JIT-compiles
    Triton kernels, so keep ``cuda_graph_max_bs`` small); one set per server, as above."""
    return {
        **_COMMON_ENGINE_KWARGS,
        "model_path": model_dir,
        "attention_backend": "triton",
        "disable_piecewise_cuda_graph": True,
        "cuda_graph_max_bs": 8,
        "mem_fraction_static": 0.3,
        "nccl_port": free_port(),
        **overrides,
    }


_PORT_RANGE_FILE = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")
# every port :func:`free_port` has returned in this process: a port is free when picked but
# bound only when its server starts, so a later pick must not return it again
_HANDED_OUT: set = set()
_HANDED_OUT_LOCK = threading.Lock()


def _ephemeral_range() -> Tuple[int, int]:
    """The kernel's ephemeral port range, inclusive (outgoing connections take their ports
    from it); Linux's default where ``/proc`` does not say."""
    try:
        low, high = (int(x) for x in _PORT_RANGE_FILE.read_text().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


PORT_SHARE_VARIABLE = "KV_CANARY_PORT_SHARE"


def _xdist_worker_share() -> Tuple[int, int]:
    """``(worker index, worker count)`` of the pytest-xdist worker this process runs under
    (or was started by: the variables are inherited), ``(0, 1)`` outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 0:
        return int(worker[2:]) % int(count), int(count)
    return 0, 1


def _port_share() -> Tuple[int, int]:
    """``(residue, modulus)``: the ports this process may pick are those congruent to
    ``residue`` modulo ``modulus``. ``KV_CANARY_PORT_SHARE=i/n`` (set by the GPU suite's
    runner, ``test/gpu_lanes_run.py``, for lane i of n: its lanes are pytest processes side by
    side, not xdist workers) splits the range n ways, each xdist worker's share within it.
    A malformed value raises ``ValueError`` naming the variable."""
    lane, lanes = 0, 1
    raw = os.environ.get(PORT_SHARE_VARIABLE, "").strip()
    if raw:
        i, _, n = raw.partition("/")
        if not (i.isdigit() and n.isdigit() and 0 <= int(i) < int(n)):
            raise ValueError(
                f"{PORT_SHARE_VARIABLE}={raw!r}: allowed 'i/n' with integers 0 <= i < n"
            )
        lane, lanes = int(i), int(n)
    worker, workers = _xdist_worker_share()
    return lane * workers + worker, lanes * workers


def free_port() -> int:
    """A free port for a test server to listen on (its HTTP port, its ``nccl_port``) in
    [20000, 55000) and outside the kernel's ephemeral range (sglang 0.5.12 refuses a port
    whose ``port + 10000``, its gRPC port, is not a valid port). Left to sglang, ``nccl_port``
    is an ephemeral port that is free when picked and bound only later by torch's rendezvous
    store; in between any process's outgoing connection may be given it (``EADDRINUSE`` at
    start-up, seen in CI with the suites' servers side by side). No port is returned twice in
    one process (a plan of servers picked before any starts would otherwise share one), and
    under pytest-xdist each worker (and the processes it starts) picks from its own residue
    class modulo the number of workers, so two workers never pick the same port either; the
    GPU suite's lanes likewise (:func:`_port_share`)."""
    low, high = _ephemeral_range()
    ranges = [(a, b) for a, b in ((20000, min(low, 55000)), (max(high + 1, 20000), 55000)) if a < b]
    if not ranges:
        raise RuntimeError(
            f"no port in [20000, 55000) outside the ephemeral range {low}-{high} "
            f"({_PORT_RANGE_FILE})"
        )
    pick = random.Random()  # not a caller's seeded RNG: two runs must not collide
    residue, modulus = _port_share()
    for _ in range(200):
        a, b = pick.choice(ranges)
        port = pick.randrange(a, b)
        port -= (port - residue) % modulus  # this worker's share of the range
        if port < a:
            continue
        with _HANDED_OUT_LOCK:
            if port in _HANDED_OUT:
                continue
            _HANDED_OUT.add(port)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ranges}")
