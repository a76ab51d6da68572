"""What sglang 0.5.12 itself does with multi-layer EAGLE, with the canary not loaded: the facts
the docs give for it (docs/speculative_multilayer_adaptive_dflash_mtp.md, "1.5 Tests and open
questions"). A Step-3.5 target with ``--speculative-algorithm EAGLE`` turns the flag on; spec v1
(``--disable-overlap-schedule``) then fails in sglang's own worker module at import, on any
device, and the canary leaves it to that error; spec v2 gets ``MultiLayerEagleWorkerV2`` (what
it does on a GPU: ``benchmark/kv_canary/diag_multi_layer_eagle.py``). The tiny Step-3.5 that diagnostic serves is
built and served by sglang's CPU engine here, so a GPU run is not spent on a config sglang
cannot build."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from e2e_checks import run_workload
from e2e_workload import workload_info

from canary_support.tiny_models import write_tiny_step3p5
from sglang.srt.kv_canary.demo.server_harness import build_libcuda_stub, cpu_server_env
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=105, suite="stage-a-test-cpu")

# no plugin of this name exists: sglang's load_plugins loads none of this project's
NOT_LOADED = {"SGLANG_PLUGINS": "no_plugin_of_this_name"}


# sglang's worker choice for the tiny Step-3.5 with EAGLE, per spec version, in a CPU server's
# environment (the worker modules import sgl_kernel, which needs the libcuda stub): one JSON line
WORKER_CHOICE = r"""
import json, sys
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
rows = {}
for version, v1 in (("v1", True), ("v2", False)):
    args = ServerArgs(model_path=sys.argv[1], device="cpu", load_format="dummy",
                      skip_tokenizer_init=True, attention_backend="torch_native",
                      speculative_algorithm="EAGLE", speculative_num_steps=3,
                      speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                      disable_overlap_schedule=v1)
    try:
        worker = SpeculativeAlgorithm.EAGLE.create_worker(args).__name__
    except Exception as e:
        worker = f"{type(e).__name__}: {e}"
    rows[version] = {"multi_layer": args.enable_multi_layer_eagle, "worker": worker}
print("CHOICE " + json.dumps(rows))
"""


def _cpu_env(tmp_path) -> dict:
    env = dict(cpu_server_env(build_libcuda_stub(tmp_path / "stub")), **NOT_LOADED)
    return {k: v for k, v in env.items() if not k.startswith("SGLANG_KV_CANARY_")}


def test_sglang_0_5_12_fails_its_own_spec_v1_multi_layer_eagle_worker_at_import(tmp_path):
    """sglang's worker choice for a Step-3.5 target with EAGLE (``enable_multi_layer_eagle``
    turned on by sglang, the operator never passed it): spec v1's ``MultiLayerEagleWorker``
    module raises ``NameError: name 'ModelRunner' is not defined`` when sglang imports it (an
    annotation of a name it imports for type checking only), so no spec v1 multi-layer EAGLE
    server starts; spec v2's is ``MultiLayerEagleWorkerV2``. (When a later sglang fixes the
    import, this fails: the docs' statement must then change.)"""
    model_dir = write_tiny_step3p5(tmp_path / "step3p5")
    proc = subprocess.run(
        [sys.executable, "-c", WORKER_CHOICE, model_dir],
        env=_cpu_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("CHOICE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    choice = json.loads(lines[-1].split(" ", 1)[1])
    assert choice == {
        "v1": {"multi_layer": True, "worker": "NameError: name 'ModelRunner' is not defined"},
        "v2": {"multi_layer": True, "worker": "MultiLayerEagleWorkerV2"},
    }


@pytest.mark.slow
def test_the_tiny_step3p5_target_serves_on_sglangs_cpu_engine(tmp_path):
    """The multi-layer diagnostic's tiny Step-3.5 target (45 hybrid-SWA layers, MoE from
    layer 3), no speculative decoding, the canary not loaded: sglang 0.5.12 builds it and
    serves the small workload's 12 requests of 8 tokens. (Built with
    ``use_moe_router_bias`` off, sglang fails to build it: GPU suite run 40's diagnostic.)"""
    model_dir = write_tiny_step3p5(tmp_path / "step3p5")
    env = _cpu_env(tmp_path)
    kwargs = dict(chunked_prefill_size=64, max_running_requests=4, log_level="warning")
    rc, out, res = run_workload("small_workload.py", model_dir, kwargs, env, "cpu")
    assert rc == 0 and res is not None and len(res) == 12, out[-3000:]
    assert all(len(o) == 8 for o in res)
    assert workload_info(out)["kv_canary"] is None  # the plugin not loaded


@pytest.mark.slow
def test_with_the_canary_spec_v1_multi_layer_eagle_stops_on_sglangs_own_error(tmp_path):
    """The tiny Step-3.5 with EAGLE and ``--disable-overlap-schedule``, ``--kv-canary raise``
    (the plugin loaded): the canary does not refuse it, and the server stops on sglang 0.5.12's
    own error, the spec v1 worker module's ``NameError``, as without the canary."""
    model_dir = write_tiny_step3p5(tmp_path / "step3p5")
    env = {
        k: v
        for k, v in cpu_server_env(build_libcuda_stub(tmp_path / "stub")).items()
        if not k.startswith("SGLANG_KV_CANARY_") and k != "SGLANG_PLUGINS"
    }
    kwargs = dict(
        chunked_prefill_size=64,
        max_running_requests=4,
        log_level="info",
        kv_canary="raise",
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=model_dir,
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        disable_overlap_schedule=True,
    )
    rc, out, res = run_workload("small_workload.py", model_dir, kwargs, env, "cpu", timeout=600)
    assert rc != 0 and res is None, out[-3000:]
    assert "kv_canary installed: mode=raise" in out  # on the target, before sglang's error
    assert "NameError: name 'ModelRunner' is not defined" in out, out[-3000:]
    assert "does not cover --enable-multi-layer-eagle" not in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
