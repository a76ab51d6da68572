"""Run a real sglang 0.5.12 server with a tiny dummy-weight model, on the CPU
(docs/architecture.md, "CPU server") or on
a GPU, for the end-to-end tests and the demo.

On a machine without a GPU: A tiny dummy-weight Llama (hidden 64, 2 layers,
4 heads, 2 KV heads, vocab 512) is written to a directory as a bare ``config.json``; requests
pass ``input_ids`` (no tokenizer). ``sgl_kernel``'s ``common_ops`` links ``libcuda.so.1``,
which a GPU-less host lacks: :func:`build_libcuda_stub` reads the driver symbols it imports
(``nm -D --undefined-only``), generates a C file whose functions return
``CUDA_ERROR_NO_DEVICE`` and builds ``libcuda.so.1`` with ``gcc``; :func:`cpu_server_env`
puts it on ``LD_LIBRARY_PATH`` with ``SGLANG_USE_CPU_ENGINE=1`` for the server's processes.

Engine keyword arguments for the CPU server come from :func:`cpu_engine_kwargs`. sglang
spawns processes, so scripts using the Engine must be guarded by
``if __name__ == "__main__":``.
"""

from __future__ import annotations

import glob
import http.client
import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
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

# A tiny DeepSeek-V2-shaped MLA model (dense MLP on every layer: first_k_dense_replace = the
# layer count). sglang 0.5.12's CPU engine builds its MLATokenToKVPool; it serves it with the
# triton attention backend under TRITON_INTERPRET=1 when kv_lora_rank + qk_rope_head_dim is
# 288 or 576, and needs yarn rope scaling.
TINY_DEEPSEEK_V2_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 256,
    "q_lora_rank": None,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# DeepSeek-V3's own MLA head dimensions, for a tiny model whose attention should take the
# shapes sglang's MLA kernels are tuned for (the tiny DeepSeek-V2 above has dims of 32)
DEEPSEEK_V3_MLA_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                            v_head_dim=128)

# A tiny DeepSeek-V3.2-shaped model (DSA: NSATokenToKVPool, page 64). Its shapes are the ones
# sglang's NSA kernels take on a Hopper GPU (FlashMLA sparse: a 512 + 64 latent row, 64 query
# heads; the indexer: 64 heads of 128, top-2048); everything else is tiny and dense.
TINY_DEEPSEEK_V32_CONFIG = {
    **TINY_DEEPSEEK_V2_CONFIG,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "kv_lora_rank": 512,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}

# A tiny Qwen3-Next-shaped hybrid model (HybridLinearKVPool): four layers, every second one
# full attention (an inner MHATokenToKVPool), the others gated delta-net linear attention with
# per-request Mamba state; a small MoE on every layer.
TINY_QWEN3_NEXT_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_CUDA_ERROR_NO_DEVICE = 100


def write_tiny_llama(model_dir, **overrides) -> str:
    """Write the tiny Llama ``config.json`` into ``model_dir``; returns the directory."""
    return _write_config(model_dir, {**TINY_LLAMA_CONFIG, **overrides})


def write_tiny_deepseek_v2(model_dir, **overrides) -> str:
    """Write the tiny DeepSeek-V2 (MLA) ``config.json`` into ``model_dir``; returns it."""
    return _write_config(model_dir, {**TINY_DEEPSEEK_V2_CONFIG, **overrides})


def write_tiny_deepseek_v32(model_dir, **overrides) -> str:
    """Write the tiny DeepSeek-V3.2 (MLA + DSA indexer, ``NSATokenToKVPool``) ``config.json``
    into ``model_dir``; returns it."""
    return _write_config(model_dir, {**TINY_DEEPSEEK_V32_CONFIG, **overrides})


def write_tiny_qwen3_next(model_dir, **overrides) -> str:
    """Write the tiny Qwen3-Next (hybrid linear attention, ``HybridLinearKVPool``)
    ``config.json`` into ``model_dir``; returns it."""
    return _write_config(model_dir, {**TINY_QWEN3_NEXT_CONFIG, **overrides})


def _write_config(model_dir, config: dict) -> str:
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
        out = subprocess.run(["nm", "-D", "--undefined-only", lib], check=True,
                             capture_output=True, text=True).stdout
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
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp),
                    str(c_file)], check=True)
    os.replace(tmp, lib)
    return str(out)


def cpu_server_env(stub_dir, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for a CPU sglang server process (stub on LD_LIBRARY_PATH, CPU engine)."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(stub_dir), env.get("LD_LIBRARY_PATH", "")) if p)
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
    return {**_COMMON_ENGINE_KWARGS, "model_path": model_dir, "device": "cpu",
            "attention_backend": "torch_native", "disable_cuda_graph": True,
            "mem_fraction_static": CPU_MEM_FRACTION_STATIC, "nccl_port": free_port(),
            **overrides}


def gpu_engine_kwargs(model_dir: str, **overrides) -> dict:
    """``sglang.Engine`` keyword arguments for the tiny model on one GPU, CUDA graphs on
    (settings seen working with sglang 0.5.12 on an H100; the first capture JIT-compiles
    Triton kernels, so keep ``cuda_graph_max_bs`` small); one set per server, as above."""
    return {**_COMMON_ENGINE_KWARGS, "model_path": model_dir, "attention_backend": "triton",
            "disable_piecewise_cuda_graph": True, "cuda_graph_max_bs": 8,
            "mem_fraction_static": 0.3, "nccl_port": free_port(), **overrides}


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


_PORT_RANGE_FILE = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_range() -> Tuple[int, int]:
    """The kernel's ephemeral port range, inclusive (outgoing connections take their ports
    from it); Linux's default where ``/proc`` does not say."""
    try:
        low, high = (int(x) for x in _PORT_RANGE_FILE.read_text().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free port for a test server to listen on (its HTTP port, its ``nccl_port``) in
    [20000, 55000) and outside the kernel's ephemeral range (sglang 0.5.12 refuses a port
    whose ``port + 10000``, its gRPC port, is not a valid port). Left to sglang, ``nccl_port``
    is an ephemeral port that is free when picked and bound only later by torch's rendezvous
    store; in between any process's outgoing connection may be given it (``EADDRINUSE`` at
    start-up, seen in CI with the suites' servers side by side)."""
    low, high = _ephemeral_range()
    ranges = [(a, b) for a, b in ((20000, min(low, 55000)), (max(high + 1, 20000), 55000))
              if a < b]
    if not ranges:
        raise RuntimeError(f"no port in [20000, 55000) outside the ephemeral range {low}-{high} "
                           f"({_PORT_RANGE_FILE})")
    pick = random.Random()  # not a caller's seeded RNG: two runs must not collide
    for _ in range(200):
        a, b = pick.choice(ranges)
        port = pick.randrange(a, b)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ranges}")


def http_call(port: int, method: str, path: str, body=None,
              timeout: float = 30.0) -> Tuple[int, bytes]:
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


MetricSeries = Dict[Tuple[str, frozenset], float]


def metric_series(port: int, prefix: str = "sglang:kv_canary_") -> MetricSeries:
    """The server's ``/metrics`` (Prometheus text) as ``{(name, frozenset of (label,
    value)): value}`` for the series whose name starts with ``prefix``; raises when
    ``/metrics`` does not answer 200 (``--enable-metrics`` off)."""
    status, body = http_call(port, "GET", "/metrics", timeout=60)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}: {body[:300]!r}")
    out = {}
    for m in re.finditer(rf"^({re.escape(prefix)}[\w:]*)(?:\{{(.*)\}})? (\S+)$", body.decode(),
                         re.M):
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric_total(series: MetricSeries, name: str) -> float:
    """The sum of ``name`` over its label sets in ``series`` (0 when absent)."""
    return sum(v for (n, _), v in series.items() if n == name)


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

    def __init__(self, name: str, argv: List[str], *, port: int, env: Dict[str, str],
                 log_path: "str | os.PathLike[str]"):
        self.name = name
        self.port = port
        self.log_path = pathlib.Path(log_path)
        self._log = open(self.log_path, "w")  # noqa: SIM115  (closed by stop())
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def wait_ready(self, timeout: float) -> None:
        """Poll ``/health_generate`` (a real forward) once a second until it answers 200;
        :class:`ServerStartError`, with the log's tail, if the process exits first or
        ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerStartError(f"{self.name} server exited ({self.proc.returncode}) "
                                       f"during start-up:\n{self.tail()}")
            try:
                if http_call(self.port, "GET", "/health_generate", timeout=60)[0] == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(1.0)
        raise ServerStartError(f"{self.name} server not ready after {timeout:.0f} s:\n"
                               f"{self.tail()}")

    def stop(self) -> None:
        stop_process_group(self.proc)
        self._log.close()


def run_python(code: str, *, env: Dict[str, str], timeout: float = 600,
               cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run ``code`` (which must guard its Engine use with ``__main__``) in a fresh process."""
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)
