"""Issue 19 end to end on the CPU: a tiny DeepSeek-V2-shaped MLA model (``MLATokenToKVPool``)
served by sglang 0.5.12's CPU engine with the triton attention backend under the Triton
interpreter (``TRITON_INTERPRET=1``; the canary's kernels then run interpreted too). Clean
with raise + sweep + real data + token checks: no violation and the greedy outputs of the
canary off; under every fault class of the perturbation framework (log mode, one server):
each injected fault is reported with its reason at its slot. (docs/user_guide.md, "Supported
pools".)"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from sglang.srt.kv_canary.perturb.report import parse_perturb_line
from sglang.srt.kv_canary.runner.violation import parse_violation_lines
from sglang.srt.kv_canary.testing.server_harness import (
    build_libcuda_stub,
    cpu_server_env,
    write_tiny_deepseek_v2,
)

pytestmark = pytest.mark.slow

SUPPORT = pathlib.Path(__file__).parent / "e2e_support"
ARGS = dict(attention_backend="triton", chunked_prefill_size=32, max_total_tokens=256,
            max_running_requests=4, log_level="info")


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_server")
    env = cpu_server_env(build_libcuda_stub(root / "stub"))
    env["TRITON_INTERPRET"] = "1"  # sglang's triton attention (and the canary) interpreted
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), env.get("PYTHONPATH", "")) if p)
    return dict(model=write_tiny_deepseek_v2(root / "model"), env=env)


def run(mla, env_extra=None, **engine_kwargs):
    env = dict(mla["env"], **(env_extra or {}))
    proc = subprocess.run([sys.executable, str(SUPPORT / "small_workload.py"), mla["model"],
                           json.dumps(dict(ARGS, **engine_kwargs))],
                          env=env, capture_output=True, text=True, timeout=900)
    res = [json.loads(x[len("RESULT "):]) for x in proc.stdout.splitlines()
           if x.startswith("RESULT ")]
    return proc.returncode, proc.stdout + proc.stderr, res[0] if res else None


def test_mla_clean_matches_canary_off(mla):
    rc, out, off = run(mla)
    assert rc == 0 and off is not None, out[-3000:]
    rc, out, on = run(mla, {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
                            "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "5"},
                      kv_canary="raise", kv_canary_real_data="partial",
                      kv_canary_sweep_interval=3)
    assert rc == 0, out[-3000:]
    assert "kv_canary installed: mode=raise real_data=partial" in out
    assert "MLATokenToKVPool" in out or "groups=1" in out
    assert parse_violation_lines(out) == []
    assert on == off and len(on) == 12
    stats = [line for line in out.splitlines() if "kv_canary stats:" in line]
    assert stats and "violations=0" in stats[-1]
    assert "TAIL_K_FULL" in stats[-1] and "SWEEP_K_FULL" in stats[-1]
    assert "TAIL_V_FULL" not in stats[-1]  # MLA: no V half


def test_mla_every_fault_class_is_caught(mla):
    env = {"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
           "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "8",
           "SGLANG_KV_CANARY_PERTURB_MAX_FAULTS": "12",
           "SGLANG_KV_CANARY_PERTURB_TARGET_GROUP": "full",
           "SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB": "0.3",
           "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.15",
           "SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB": "0.15",
           "SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB": "0.15"}
    rc, out, res = run(mla, env, kv_canary="log", kv_canary_real_data="partial",
                       kv_canary_sweep_interval=2)
    assert rc == 0 and res is not None and len(res) == 12, out[-3000:]
    injected = [f for f in map(parse_perturb_line, out.splitlines()) if f]
    lines = parse_violation_lines(out)
    kinds = {f["fault"] for f in injected}
    assert {"req_to_token", "real_kv_used", "real_kv_post_forward"} <= kinds, injected
    def caught(f) -> bool:
        step = int(f["step"])
        if f["fault"] == "req_to_token":  # the changed entry, reported at its forward
            return any(v.forward_step == step and (v.req_to_token_row, v.read_position,
                                                   v.slot_idx)
                       == (int(f["req_pool_idx"]), int(f["position"]), int(f["new_slot"]))
                       for v in lines)
        # a byte of the slot's latent row flipped: its fingerprint no longer matches
        return any(v.forward_step >= step and v.slot_idx == int(f["full_slot"])
                   and "verify_real_kv_hash" in v.fail_reasons for v in lines)

    # faults the forward itself reads are caught every time; a byte flipped after a forward
    # is caught when the slot is next read or swept (a slot freed and rewritten first erases
    # it): each of those kinds at least once
    for f in injected:
        if f["fault"] in ("req_to_token", "real_kv_used"):
            assert caught(f), (f, lines[-5:])
    for kind in kinds - {"req_to_token", "real_kv_used"}:
        assert any(caught(f) for f in injected if f["fault"] == kind), (kind, injected)
