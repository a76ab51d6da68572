"""The processes of ``pd_one_gpu.py`` (docs/user_guide.md, "Deployments"): the tiny Llama's
seeded random weights, the libcuda stub of ``--cpu``, and :class:`PdProcesses`, which starts
the servers and the router (each in its own process group, recorded in ``LOG_DIR/pgids.json``)
and stops them all; ``pd_one_gpu.Run`` adds the run's steps."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

# the variables a dry run shows per server (the canary's and the test hooks')
CANARY_ENV_PREFIXES = ("SGLANG_KV_CANARY_", "KV_CANARY_TEST_")

# ---- model ------------------------------------------------------------------------------------


def write_random_llama_weights(model_dir: str, config: dict, seed: int) -> None:
    """``model_dir/model.safetensors`` for the Llama ``config`` (HF names): seeded normal
    weights with std 1/sqrt(fan_in), embeddings with std 1, norms at 1, bfloat16."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim", h // nh)

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f**0.5

    t = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=g),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": lin(v, h),
    }
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        t.update(
            {
                pre + "self_attn.q_proj.weight": lin(nh * hd, h),
                pre + "self_attn.k_proj.weight": lin(nkv * hd, h),
                pre + "self_attn.v_proj.weight": lin(nkv * hd, h),
                pre + "self_attn.o_proj.weight": lin(h, nh * hd),
                pre + "mlp.gate_proj.weight": lin(inter, h),
                pre + "mlp.up_proj.weight": lin(inter, h),
                pre + "mlp.down_proj.weight": lin(h, inter),
                pre + "input_layernorm.weight": torch.ones(h),
                pre + "post_attention_layernorm.weight": torch.ones(h),
            }
        )
    save_file(
        {k: x.to(torch.bfloat16).contiguous() for k, x in t.items()},
        str(pathlib.Path(model_dir) / "model.safetensors"),
    )


# ---- --cpu: the libcuda stub -------------------------------------------------------------------


def transfer_engine_libraries(backend: str) -> list[str]:
    """The shared libraries of the installed transfer engine that import CUDA driver symbols."""
    import importlib.util

    pkg = "mooncake" if backend == "mooncake" else "nixl_cu13"
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{pkg} is not installed (test/device_bundle_pd.sh)")
    root = pathlib.Path(spec.submodule_search_locations[0])
    dirs = (
        [root]
        if backend == "mooncake"
        else [root.parent / "nixl_cu13.libs", root.parent / ".nixl_cu13.mesonpy.libs"]
    )
    return sorted(
        str(p) for d in dirs for p in d.rglob("*.so*") if p.is_file() and not p.is_symlink()
    )


def cpu_stub(out_dir: pathlib.Path, backend: str) -> str:
    """``out_dir/libcuda.so.1`` answering "no device" for the driver symbols of sgl_kernel
    (``server_harness.libcuda_symbols``) and of the transfer engine (its libraries are
    loaded with RTLD_NOW, so every symbol they import must exist)."""
    from sglang.srt.kv_canary.demo.server_harness import libcuda_symbols

    out_dir.mkdir(parents=True, exist_ok=True)
    names = sorted(
        set(libcuda_symbols())
        | set(libcuda_symbols(transfer_engine_libraries(backend)))
        | {"cuInit", "cuDriverGetVersion", "cuDeviceGetCount"}
    )
    (out_dir / "stub.c").write_text("".join(f"int {n}(void) {{ return 100; }}\n" for n in names))
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(out_dir / "libcuda.so.1"),
            str(out_dir / "stub.c"),
        ],
        check=True,
    )
    return str(out_dir)


# ---- the processes ------------------------------------------------------------------------------


def log_dir_for(given: str | None, name: str) -> pathlib.Path:
    """A run's log folder, made: ``given``, else ``$OUT/<name>_logs`` when ``$OUT`` is set
    (the device tool brings it back), else a new temporary folder."""
    if given:
        path = pathlib.Path(given)
    elif os.environ.get("OUT"):
        path = pathlib.Path(os.environ["OUT"]) / f"{name}_logs"
    else:
        path = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}_"))
    path.mkdir(parents=True, exist_ok=True)
    return path


class PdProcesses:
    """The run's processes: ``args`` (``pd_one_gpu.parse_args``'s), ``log_dir`` (set by its
    ``main``), the servers and the router started, the errors and the result so far."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.servers: list = []  # ServerProcess
        self.router_proc: subprocess.Popen | None = None
        self.router_log = None
        self.errors: list[str] = []
        self.result: dict = {"backend": args.backend}

    # -- processes --
    def start_server(
        self,
        name: str,
        model_dir: str,
        port: int,
        extra: list[str],
        env: dict[str, str],
        log_level: str,
        mem_fraction: float | None = None,
        **overrides,
    ):
        """Start (or, with ``--dry-run``, print) one server; ``mem_fraction``: its
        ``--mem-fraction-static`` (None: ``--mem-fraction-static``'s); ``overrides``: engine
        kwargs that replace the harness's."""
        from sglang.srt.kv_canary.demo.server_process import ServerProcess, launch_server_flags
        from sglang.srt.kv_canary.demo.server_harness import (
            cpu_engine_kwargs,
            gpu_engine_kwargs,
        )

        make = cpu_engine_kwargs if self.args.cpu else gpu_engine_kwargs
        kwargs = make(
            model_dir,
            mem_fraction_static=(
                mem_fraction if mem_fraction is not None else self.args.mem_fraction_static
            ),
            max_total_tokens=self.args.max_total_tokens,
            log_level=log_level,
            **({} if self.args.cpu else {"base_gpu_id": 0}),
            **({"load_format": "auto"} if self.args.weights == "random" else {}),
        )
        kwargs.update(overrides)
        argv = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            *launch_server_flags(port, kwargs),
            *extra,
        ]
        (self.log_dir / f"{name}.argv").write_text(shlex.join(argv) + "\n")
        if self.args.dry_run:
            print(f"pd_one_gpu: {name}: {shlex.join(argv)}", flush=True)
            canary_env = {k: v for k, v in env.items() if k.startswith(CANARY_ENV_PREFIXES)}
            print(f"pd_one_gpu: {name} env: {json.dumps(canary_env, sort_keys=True)}", flush=True)
            return None
        server = ServerProcess(
            name, argv, port=port, env=env, log_path=self.log_dir / f"{name}.log"
        )
        self.servers.append(server)
        self.record_pgid(name, server.proc.pid)
        return server

    def record_pgid(self, name: str, pgid: int) -> None:
        path = self.log_dir / "pgids.json"
        try:
            known = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            known = {}
        known[name] = pgid
        path.write_text(json.dumps(known))

    @staticmethod
    def router_argv(
        prefill_port: int, bootstrap_port: int, decode_port: int, port: int, mini: bool
    ) -> list[str]:
        from sglang.srt.kv_canary.demo.server_harness import free_port

        argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill",
            f"http://127.0.0.1:{prefill_port}",
            str(bootstrap_port),
            "--decode",
            f"http://127.0.0.1:{decode_port}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--worker-startup-timeout-secs",
            "120",
            "--log-level",
            "info",
        ]
        return argv + (["--mini-lb"] if mini else [])

    def start_router(
        self,
        prefill_port: int,
        bootstrap_port: int,
        decode_port: int,
        port: int,
        mini: bool,
        env: dict[str, str],
    ) -> None:
        argv = self.router_argv(prefill_port, bootstrap_port, decode_port, port, mini)
        (self.log_dir / "router.argv").write_text(shlex.join(argv) + "\n")
        self.router_log = open(self.log_dir / "router.log", "w")  # noqa: SIM115
        self.router_proc = subprocess.Popen(
            argv, env=env, stdout=self.router_log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.record_pgid("router", self.router_proc.pid)

    def stop_all(self) -> list[str]:
        """Stop every process group started here; the ones still alive after that."""
        from sglang.srt.kv_canary.demo.server_process import stop_process_group

        procs = []
        if self.router_proc is not None:
            procs.append(("router", self.router_proc))
        procs += [(s.name, s.proc) for s in self.servers]
        for name, proc in procs:
            try:
                stop_process_group(proc)
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"stopping {name}: {e}")
        for s in self.servers:
            try:
                s._log.close()
            except Exception:  # noqa: BLE001, S110  (not up yet / best effort)
                pass
        if self.router_log is not None:
            self.router_log.close()

        def alive(pgid: int) -> bool:
            try:
                os.killpg(pgid, 0)
                return True
            except (ProcessLookupError, PermissionError):
                return False

        # SIGKILLed members of a group go away a moment later (reaped by init): wait for them
        deadline = time.monotonic() + 15
        while any(alive(p.pid) for _, p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [name for name, proc in procs if alive(proc.pid)]
        self.servers, self.router_proc = [], None
        return left
