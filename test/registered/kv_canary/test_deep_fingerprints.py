"""Per-layer (deep) fingerprint kernels (docs/subsystems.md, "Per-layer
fingerprints"): the Triton kernels (compiled on CUDA, interpreted on CPU) against the torch
references byte for byte; a byte flipped in any layer's K or V row is reported by the window
that holds its column and by a full (sweep) check, with the column's tag, slot and layer; the
rotating window covers every column within ``forwards_per_rotation`` forwards."""

from __future__ import annotations

import sys

import pytest
import torch

from sglang.jit_kernel.kv_canary import deep, deep_ref
from sglang.jit_kernel.kv_canary.consts import (
    VIOLATION_FIELD_EXPECTED_AUX,
    VIOLATION_FIELD_FAIL_REASON_BITS,
    VIOLATION_FIELD_KERNEL_KIND,
    VIOLATION_FIELD_KV_LAYER,
    VIOLATION_FIELD_POSITION,
    VIOLATION_FIELD_READ_POSITION,
    VIOLATION_FIELD_SLOT_IDX,
    VIOLATION_FIELD_STORED_CHAIN_HASH,
    VIOLATION_NUM_FIELDS,
    FailReason,
    RealKvHashMode,
)
from sglang.jit_kernel.kv_canary.types import (
    CANARY_SLOT_BYTES,
    CanaryLaunchTag,
    DeepColumn,
    DeepFingerprintTable,
    KvHalf,
    RealKvSource,
    VerifyPlan,
    WritePlan,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=65, suite="stage-a-test-cpu")

NUM_SLOTS, LAYERS, HEADS, DIM = 40, 3, 2, 8  # bf16 rows of 32 bytes


def _pool(device, page_size=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = NUM_SLOTS // page_size

    def buf():
        return torch.randn(rows, page_size * HEADS * DIM, generator=g).to(torch.bfloat16).to(device)

    return [buf() for _ in range(LAYERS)], [buf() for _ in range(LAYERS)]


def _table(k, v, mode, *, page_size=1, layers_per_forward=1, with_v=True):
    cols = []
    for layer in range(LAYERS):
        for half, bufs in ((KvHalf.K, k), (KvHalf.V, v)) if with_v else ((KvHalf.K, k),):
            row = HEADS * DIM * 2
            cols.append(
                DeepColumn(
                    layer,
                    half,
                    RealKvSource(
                        tensor=bufs[layer],
                        page_size=page_size,
                        num_bytes_per_token=row,
                        read_bytes=row,
                    ),
                )
            )
    return DeepFingerprintTable.allocate(
        num_slots=NUM_SLOTS,
        columns=cols,
        mode=mode,
        layers_per_forward=layers_per_forward,
        device=k[0].device,
    )


def _write_plan(slots, device):
    plan = WritePlan.allocate(write_req_capacity=2, device=device)
    plan.write_offsets[:3] = torch.tensor([0, len(slots) // 2, len(slots)])
    plan.write_num_valid_reqs[0] = 2
    return plan, torch.tensor(slots, dtype=torch.int64, device=device)


def _verify_plan(slots, device):
    plan = VerifyPlan.allocate(verify_capacity=len(slots) + 3, device=device)
    n = len(slots)
    plan.verify_slot_indices[:n] = torch.tensor(slots)
    plan.verify_expected_positions[:n] = torch.arange(n)
    plan.verify_req_to_token_rows[:n] = 1
    plan.verify_num_valid[0] = n
    plan.enable[0] = 1
    return plan


def _ring(device):
    return (
        torch.zeros(64, VIOLATION_NUM_FIELDS, dtype=torch.int64, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
    )


def _records(device):
    rec = torch.zeros(NUM_SLOTS, CANARY_SLOT_BYTES, dtype=torch.uint8, device=device)
    rec.view(torch.int64)[:, 1] = torch.arange(NUM_SLOTS) + 1000  # stored positions
    return rec


def _verify(table, plan, rec, *, rotate, reference):
    ring, idx = _ring(table.device)
    launch = (
        deep_ref.launch_deep_fingerprint_verify_torch_reference
        if reference
        else deep.launch_deep_fingerprint_verify
    )
    launch(
        table=table,
        plan=plan,
        canary_buf=rec,
        violation_ring=ring,
        violation_write_index=idx,
        tag_k=CanaryLaunchTag.TAIL_K_FULL,
        tag_v=CanaryLaunchTag.TAIL_V_FULL,
        rotate=rotate,
    )
    n = int(idx[0])
    return sorted(tuple(r) for r in ring[:n].tolist())


@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL])
@pytest.mark.parametrize("page_size", [1, 4])
def test_write_matches_reference(device, mode, page_size):
    k, v = _pool(device, page_size)
    slots = [3, 7, 8, 9, 31, -1, 39, 0]
    a, b = _table(k, v, mode, page_size=page_size), _table(k, v, mode, page_size=page_size)
    plan, loc = _write_plan(slots, device)
    deep.launch_deep_fingerprint_write(table=a, plan=plan, out_cache_loc=loc)
    deep_ref.launch_deep_fingerprint_write_torch_reference(table=b, plan=plan, out_cache_loc=loc)
    assert torch.equal(a.table.cpu(), b.table.cpu())
    written = [s for s in slots if s >= 0]
    assert bool((a.table[written] != 0).all())  # every column of every written slot
    others = [s for s in range(NUM_SLOTS) if s not in written]
    assert bool((a.table[others] == 0).all())
    if mode == RealKvHashMode.PARTIAL:  # only the first 16 bytes count
        row = k[2].view(torch.uint8).view(NUM_SLOTS // page_size, -1)
        row[7 // page_size, (7 % page_size) * HEADS * DIM * 2 + 20] ^= 1
        c = _table(k, v, mode, page_size=page_size)
        deep.launch_deep_fingerprint_write(table=c, plan=plan, out_cache_loc=loc)
        assert torch.equal(c.table.cpu(), a.table.cpu())


def _flip(bufs, layer, slot, page_size=1, byte=3):
    row = bufs[layer].view(torch.uint8).view(NUM_SLOTS // page_size, -1)
    row[slot // page_size, (slot % page_size) * HEADS * DIM * 2 + byte] ^= 0x10


@pytest.mark.parametrize("half", ["k", "v"])
@pytest.mark.parametrize("layer", [0, LAYERS - 1])
def test_flip_is_reported_by_its_column(device, half, layer):
    k, v = _pool(device)
    table = _table(k, v, RealKvHashMode.PARTIAL)
    slots = [5, 6, 7, 12]
    plan, loc = _write_plan(slots, device)
    deep.launch_deep_fingerprint_write(table=table, plan=plan, out_cache_loc=loc)
    rec = _records(device)
    vplan = _verify_plan([0, 5, 6, 7, 12], device)
    assert _verify(table, vplan, rec, rotate=False, reference=False) == []
    _flip(k if half == "k" else v, layer, 7)
    full = _verify(table, vplan, rec, rotate=False, reference=False)
    assert full == _verify(table, vplan, rec, rotate=False, reference=True)
    assert len(full) == 1, full
    row = full[0]
    tag = CanaryLaunchTag.TAIL_K_FULL if half == "k" else CanaryLaunchTag.TAIL_V_FULL
    assert row[VIOLATION_FIELD_KERNEL_KIND] == tag
    assert row[VIOLATION_FIELD_SLOT_IDX] == 7 and row[VIOLATION_FIELD_KV_LAYER] == layer
    assert row[VIOLATION_FIELD_POSITION] == 1007 and row[VIOLATION_FIELD_READ_POSITION] == 3
    assert row[VIOLATION_FIELD_FAIL_REASON_BITS] == FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    col = layer * 2 + (0 if half == "k" else 1)
    assert row[VIOLATION_FIELD_STORED_CHAIN_HASH] == int(table.table[7, col])
    assert row[VIOLATION_FIELD_EXPECTED_AUX] != row[VIOLATION_FIELD_STORED_CHAIN_HASH]


@pytest.mark.parametrize("layers_per_forward", [1, 2])
def test_rotation_covers_every_column_within_the_bound(device, layers_per_forward):
    k, v = _pool(device)
    table = _table(k, v, RealKvHashMode.ALL, layers_per_forward=layers_per_forward)
    ref = _table(k, v, RealKvHashMode.ALL, layers_per_forward=layers_per_forward)
    plan, loc = _write_plan([4, 9], device)
    for t in (table, ref):
        deep.launch_deep_fingerprint_write(table=t, plan=plan, out_cache_loc=loc)
    rec = _records(device)
    vplan = _verify_plan([4, 9], device)
    _flip(v, LAYERS - 1, 9)  # the last column
    bound = table.forwards_per_rotation
    assert bound == -(-LAYERS // layers_per_forward)
    seen_at = []
    steps = 3 * bound
    for step in range(steps):
        got = _verify(table, vplan, rec, rotate=True, reference=False)
        assert got == _verify(ref, vplan, rec, rotate=True, reference=True)
        if got:
            assert [(r[VIOLATION_FIELD_SLOT_IDX], r[VIOLATION_FIELD_KV_LAYER]) for r in got] == [
                (9, LAYERS - 1)
            ]
            seen_at.append(step)
    # any `bound` consecutive forwards check every column: the flip is seen in each such span
    for start in range(steps - bound + 1):
        assert any(start <= s < start + bound for s in seen_at), (start, seen_at)
    assert len(seen_at) < steps  # and only when its column is in the window
    assert int(table.cursor[0]) == steps * table.columns_per_forward


def test_disabled_plan_checks_nothing_but_advances(device):
    k, v = _pool(device)
    table = _table(k, v, RealKvHashMode.PARTIAL)
    vplan = _verify_plan([4], device)
    vplan.enable[0] = 0
    _flip(k, 0, 4)  # never written: column 0 of slot 4 is 0 and would mismatch
    assert _verify(table, vplan, _records(device), rotate=True, reference=False) == []
    assert int(table.cursor[0]) == table.columns_per_forward


def test_table_validation_names_the_problem(device):
    k, v = _pool(device)
    row = HEADS * DIM * 2
    src = RealKvSource(tensor=k[0], page_size=1, num_bytes_per_token=row, read_bytes=row)
    with pytest.raises(ValueError, match="PARTIAL or ALL"):
        DeepFingerprintTable.allocate(
            num_slots=NUM_SLOTS,
            columns=[DeepColumn(0, KvHalf.K, src)],
            mode=RealKvHashMode.NONE,
            layers_per_forward=1,
            device=device,
        )
    with pytest.raises(ValueError, match="layer-major"):
        DeepFingerprintTable.allocate(
            num_slots=NUM_SLOTS,
            columns=[
                DeepColumn(0, KvHalf.K, src),
                DeepColumn(1, KvHalf.K, src),
                DeepColumn(0, KvHalf.V, src),
            ],
            mode=RealKvHashMode.ALL,
            layers_per_forward=1,
            device=device,
        )
    with pytest.raises(ValueError, match="covers"):
        DeepFingerprintTable.allocate(
            num_slots=NUM_SLOTS + 1,
            columns=[DeepColumn(0, KvHalf.K, src)],
            mode=RealKvHashMode.ALL,
            layers_per_forward=1,
            device=device,
        )
    table = _table(k, v, RealKvHashMode.ALL, layers_per_forward=99)
    assert table.columns_per_forward == 2 * LAYERS and table.forwards_per_rotation == 1


# ---- the runtime: a serving loop on real sglang pools (torch references on CPU) ----------------

from serving_driver import ServingDriver  # noqa: E402

from sglang.srt.kv_canary.violations.lines import parse_violation_lines  # noqa: E402


def _driver(pool, layers, **kw):
    extra = dict(swa_window=12, num_swa_slots=200) if pool == "swa" else {}
    return ServingDriver(
        pool=pool, mode="raise", real_data="partial", seed=5, real_data_layers=layers, **extra, **kw
    )


@pytest.mark.parametrize("pool", ["mha", "swa", "mla", "hybrid"])
def test_serving_loop_with_every_layer_is_clean(pool, reference_kernels_on_cpu):
    d = _driver(pool, "all", sweep_interval=3)
    d.run(60)
    for group in d.groups:
        assert group.deep is not None
        assert bool((group.deep.table[1:] != 0).any())  # written
        assert int(group.deep.cursor[0]) > 0  # rotated
    # the model's layer ids: SWA sub-pools and the hybrid full-attention pool map theirs
    layers = {"mha": [[0, 1]], "swa": [[1], [0]], "mla": [[0, 1]], "hybrid": [[1, 3]]}[pool]
    assert [list(g.deep.layers) for g in d.groups] == layers


# (pool, local layer index, half, the model's layer id it is)
LAST_LAYER_CASES = [
    ("mha", 1, "v", 1),
    ("mha", 1, "k", 1),
    ("mla", 1, "k", 1),
    ("hybrid", 1, "v", 3),
]


@pytest.mark.parametrize("pool,layer,half,model_layer", LAST_LAYER_CASES)
def test_flip_in_the_last_layer_is_caught_within_the_bound(
    pool, layer, half, model_layer, reference_kernels_on_cpu
):
    d = _driver(pool, "all")
    d.run(40)
    d.settle()
    info = d.fault_flip_layer_byte(layer, half)
    bound = d.groups[0].deep.forwards_per_rotation
    with pytest.raises(RuntimeError, match="kv_canary detected KV-cache corruption") as exc:
        for _ in range(bound):
            d.step()
    found = parse_violation_lines(str(exc.value))
    hit = [v for v in found if v.slot_idx == info["slot"]]
    assert hit and hit[0].kv_layer == model_layer, found
    assert hit[0].launch_tag == f"TAIL_{half.upper()}_FULL"
    assert hit[0].fail_reasons == ("verify_real_kv_hash",)


@pytest.mark.parametrize("pool,layer,half,model_layer", LAST_LAYER_CASES[:2])
def test_first_layer_only_misses_the_same_flip(
    pool, layer, half, model_layer, reference_kernels_on_cpu
):
    """The documented gap of ``--kv-canary-real-data-layers first``: the same flip runs clean."""
    d = _driver(pool, "first")
    d.run(40)
    d.settle()
    d.fault_flip_layer_byte(layer, half)
    for _ in range(4):
        d.step()


# ---- perturbation targets: a layer and a half ---------------------------------------------------

from sglang.srt.kv_canary.perturb.config import PerturbConfig  # noqa: E402
from sglang.srt.kv_canary.perturb.report import parse_perturb_line  # noqa: E402

NUM_DRIVER_SLOTS = 641  # the driver's 640 slots + sglang's padding slot


@pytest.mark.parametrize(
    "layer,half,message",
    [
        (5, "k", "has layers 0..1 .*allowed: one of those layer ids or 'last'"),
        ("last", "v", "halves k; allowed"),
    ],
)
def test_perturbation_target_the_pool_lacks_is_refused(layer, half, message):
    pool = "mha" if layer == 5 else "mla"
    with pytest.raises(ValueError, match="SGLANG_KV_CANARY_PERTURB_TARGET_LAYER=.*" + message):
        _driver(
            pool,
            "all",
            perturb=PerturbConfig(
                real_kv_post_forward_prob=1.0,
                target_group="full",
                target_layer=layer,
                target_half=half,
            ),
        )


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(target_layer=-1), "TARGET_LAYER must be a layer id"),
        (dict(target_layer="top"), "TARGET_LAYER must be a layer id"),
        (dict(target_half="kv"), "TARGET_HALF must be k or v"),
    ],
)
def test_perturbation_target_values_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        PerturbConfig(**kw)


@pytest.mark.parametrize("layer,half", [("last", "v"), (0, "v"), (1, "k")])
def test_perturbation_flips_the_targeted_row(layer, half, reference_kernels_on_cpu):
    """Two identical loops, one with a single post-forward fault: right after it, the only
    byte that differs is byte 0 of the targeted layer's half row of the logged slot."""

    def make(prob):
        return _driver(
            "mha",
            "all",
            perturb=PerturbConfig(
                warmup_steps=5,
                max_faults=1,
                real_kv_post_forward_prob=prob,
                target_group="full",
                target_layer=layer,
                target_half=half,
                seed=3,
            ),
        )

    hit, quiet = make(1.0), make(0.0)
    for _ in range(40):
        for d in (hit, quiet):
            if d.rng.random() < 0.3 or not (d.running or d.waiting):
                d.add_random_requests(1)
            d.step()
        if hit.manager.perturber.injected:
            break
    fault = parse_perturb_line(hit.manager.perturber.injected[0])
    want_layer = 1 if layer == "last" else layer
    assert (fault["layer"], fault["half"]) == (str(want_layer), half)
    diffs = []
    for i in range(2):
        for h in "kv":
            a = hit.layer_rows(i, h).view(torch.uint8).reshape(NUM_DRIVER_SLOTS, -1)
            b = quiet.layer_rows(i, h).view(torch.uint8).reshape(NUM_DRIVER_SLOTS, -1)
            diffs += [(i, h, int(sl), int(by)) for sl, by in (a != b).nonzero().tolist()]
    assert diffs == [(want_layer, half, int(fault["slot"]), 0)]


# ---- PD: the table travels with the KV pages ----------------------------------------------------

from sglang.srt.kv_canary.config import CanaryConfig  # noqa: E402
from sglang.srt.kv_canary.pool_patcher import attach_canary_buffers  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_the_table_is_spliced_after_the_k_tail(kind, page_size):
    if kind == "mha":
        pool = MHATokenToKVPool(
            size=64,
            page_size=page_size,
            dtype=torch.bfloat16,
            head_num=2,
            head_dim=8,
            layer_num=3,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
    else:
        pool = MLATokenToKVPool(
            size=64,
            page_size=page_size,
            dtype=torch.bfloat16,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            layer_num=3,
            device="cpu",
            enable_memory_saver=False,
        )
    plain = pool.get_contiguous_buf_infos()
    cfg = CanaryConfig(mode="raise", real_kv_hash_mode="partial", real_data_layers="all")
    (group,) = attach_canary_buffers(pool=pool, config=cfg, device="cpu")
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    k_entries = 3  # layers of K (MHA: then 3 of V; MLA: the latent rows only)
    table = group.deep.table
    assert table.shape == (group.num_slots, 3 * (2 if kind == "mha" else 1))
    at = 1 + k_entries + 1  # K-head, K layers, K-tail, then the table
    assert ptrs[at - 1] == group.k_tail.data_ptr()
    assert (ptrs[at], lens[at], items[at]) == (
        table.data_ptr(),
        table.nbytes,
        table.shape[1] * 8 * page_size,
    )
    assert len(ptrs) == len(plain[0]) + 3
    assert ptrs[at + 1 :] == list(plain[0][k_entries:])  # the V layers (MHA) follow unchanged


# ---- HiCache: the row copy between a device buffer and its host mirror --------------------------

from sglang.jit_kernel.kv_canary.rows import launch_copy_rows  # noqa: E402


@pytest.mark.parametrize("width", [4, 6])
def test_copy_rows_matches_the_reference(device, width):
    g = torch.Generator().manual_seed(width)
    src = torch.randint(-(2**62), 2**62, (50, width), generator=g, dtype=torch.int64).to(device)
    dst = torch.zeros(70, width, dtype=torch.int64, device=device)
    s_idx = torch.tensor([3, 9, 49, 50, -1, 0, 7], device=device)  # 50 and -1 are out of range
    d_idx = torch.tensor([60, 1, 2, 3, 4, 69, 70], dtype=torch.int32)  # 70 is out of range
    launch_copy_rows(src=src, dst=dst, src_indices=s_idx, dst_indices=d_idx)
    want = torch.zeros(70, width, dtype=torch.int64)
    for s, d in zip(s_idx.tolist(), d_idx.tolist()):
        if 0 <= s < 50 and 0 <= d < 70:
            want[d] = src[s].cpu()
    assert torch.equal(dst.cpu(), want)
    if device.type == "cuda":  # HiCache: device -> pinned host rows and back, on a side stream
        host = torch.zeros(70, width, dtype=torch.int64, pin_memory=True)
        back = torch.zeros(50, width, dtype=torch.int64, device=device)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            launch_copy_rows(src=src, dst=host, src_indices=s_idx, dst_indices=d_idx)
            launch_copy_rows(src=host, dst=back, src_indices=d_idx, dst_indices=s_idx)
        stream.synchronize()
        assert torch.equal(host, want)
        kept = [s for s, d in zip(s_idx.tolist(), d_idx.tolist()) if 0 <= s < 50 and 0 <= d < 70]
        assert torch.equal(back[kept], src[kept]) and int(back.count_nonzero()) == int(
            src[kept].count_nonzero()
        )


def test_copy_rows_refuses_unpinned_host_memory_and_odd_widths(device):
    src = torch.zeros(4, 4, dtype=torch.int64, device=device)
    idx = torch.arange(2)
    with pytest.raises(ValueError, match="same row width"):
        launch_copy_rows(
            src=src,
            dst=torch.zeros(4, 3, dtype=torch.int64, device=device),
            src_indices=idx,
            dst_indices=idx,
        )
    with pytest.raises(ValueError, match="dst_indices must have shape"):
        launch_copy_rows(src=src, dst=src.clone(), src_indices=idx, dst_indices=torch.arange(3))
    if device.type == "cuda":
        with pytest.raises(ValueError, match="pinned"):
            launch_copy_rows(
                src=src, dst=torch.zeros(4, 4, dtype=torch.int64), src_indices=idx, dst_indices=idx
            )


def test_host_tier_mirror_on_real_pools(tmp_path):
    """HiCache: a real ``MHATokenToKVPoolHost`` (a process with the libcuda stub and the HiCache
    CPU shims): every canary buffer's rows (K / V head and tail records, the per-layer table) go
    to the host with a backup and come back, into other slots, with the load's first layer; the
    host pool makes room for them in its budget (docs/user_guide.md, "Memory")."""
    from canary_support.script_run import run_support_script
    from sglang.srt.kv_canary.demo.server_harness import build_libcuda_stub, cpu_server_env

    env = cpu_server_env(build_libcuda_stub(tmp_path / "stub"))
    env["KV_CANARY_TEST_SHIM_HICACHE_CPU"] = "1"
    rc, out, res = run_support_script(
        "host_tier_check.py", env=env, timeout=300, sitecustomize=True
    )
    assert rc == 0 and res, out[-5000:]
    assert res["on_host"] and res["back"] and res["kv_back"], res
    # 4 record buffers (K and V, head and tail) of 32 bytes + 2 layers x 2 halves x 8 bytes
    assert res["pairs"] == 5 and res["bytes_per_host_slot"] == 4 * 32 + 4 * 8
    assert (res["backed_up"], res["loaded"]) == (4, 4) and res["host_slots"] > 64
    # the host pool's KV plus the mirror take what --hicache-ratio / --hicache-size give the
    # KV alone (to a slot: sglang rounds the size up to a whole page)
    sizes = res["sizes"]
    kv, mirror = sizes["kv_per_token"], sizes["mirror_per_slot"]
    assert mirror == res["bytes_per_host_slot"]
    for mode in ("ratio", "size"):
        off, on = sizes[mode]["off"], sizes[mode]["on"]
        assert off * kv - (kv + mirror) < on * (kv + mirror) <= off * kv + (kv + mirror), mode
    assert "--hicache-ratio 1.2 leaves no room" in sizes["tight_ratio"]
    assert res["memory_host_mirror"] == res["mirror_bytes"] == res["host_slots"] * mirror


def test_a_draft_pool_s_rows_follow_its_own_host_pool(tmp_path):
    """HiCache with speculative decoding: sglang registers the draft pool's own host pool after
    the tree exists (``Scheduler._maybe_register_hicache_draft``), sized slot for slot to the
    target's host pool, and copies both in each backup and load. Both canaries attach to the
    tree without clashing (the draft's mirror is not built on the target's host pool), the
    draft's rows follow its own host pool once sglang registered it, both canaries' rows come
    back with their KV, and the draft host pool keeps the size sglang gives it without the
    canary (the canary's host budget applies to the target's host pool only)."""
    from canary_support.script_run import run_support_script
    from sglang.srt.kv_canary.demo.server_harness import build_libcuda_stub, cpu_server_env

    env = cpu_server_env(build_libcuda_stub(tmp_path / "stub"))
    env["KV_CANARY_TEST_SHIM_HICACHE_CPU"] = "1"
    rc, out, res = run_support_script(
        "draft_host_tier_check.py", env=env, timeout=300, sitecustomize=True
    )
    assert rc == 0 and res, out[-5000:]
    assert res["errors"] == {}, res
    # sglang's own sizing (at least the target host pool's slots), not the budget's
    assert res["draft_host_slots"] == res["draft_host_slots_canary_off"] >= res["host_slots"]
    assert not res["draft_mirrored_before_register"] and res["draft_mirror_host_pool_is_drafts"]
    assert res["moved"] == {"target": True, "draft": True}, res
    assert res["draft_memory_host_mirror"] > 0


def test_a_dflash_draft_pool_left_without_a_host_copy_is_said_at_start_up(tmp_path):
    """sglang 0.5.12's DFLASH with HiCache registers the target's pool as the draft's: the
    "draft" host pool keeps sglang's size (not the target budget's), copies the target's KV
    a second time without overflowing, the draft canary mirrors nothing (no host copy of its
    pool exists) and the start-up log says why its reports of loaded-back prefixes will come."""
    from canary_support.script_run import run_support_script
    from sglang.srt.kv_canary.demo.server_harness import build_libcuda_stub, cpu_server_env

    env = cpu_server_env(build_libcuda_stub(tmp_path / "stub"))
    env["KV_CANARY_TEST_SHIM_HICACHE_CPU"] = "1"
    rc, out, res = run_support_script(
        "draft_host_tier_check.py", "dflash", env=env, timeout=300, sitecustomize=True
    )
    assert rc == 0 and res, out[-5000:]
    assert res["errors"] == {}, res
    assert res["draft_host_slots"] == res["draft_host_slots_canary_off"] >= res["host_slots"]
    assert res["moved"] == {"target": True, "draft": False}, res
    assert (
        "keeps no host copy of this server's speculative draft KV (it registered the target's "
        "pool as the draft's (sglang 0.5.12 does so for --speculative-algorithm DFLASH)" in out
    ), out[-3000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
