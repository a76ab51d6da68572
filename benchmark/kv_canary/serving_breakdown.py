"""The canary's own cost per forward, in process on real pools (``bench_serving_overhead.py
--breakdown`` / ``--host-breakdown``): the GPU time of each launch of a decode step and an
eager prefill (here), the host time of each phase and method of a bs 1 prefill
(``host_breakdown.py``); the in-process prefill canary (``build_prefill_canary``,
``prefill_canary.py``) that ``bench_prefill_device_time.py`` shares. Every name other code
reads is importable from here."""

from __future__ import annotations

import contextlib
import dataclasses
import gc

from common import (
    CONFIGS,
    QWEN3_0_6B_CONFIG,
    BenchConfig,
    append_jsonl,
    bench_device,
    canary_on_configs,
    now_utc,
    parse_ints,
)
from host_breakdown import run_host_breakdown
from prefill_canary import PREFILL_SHAPES, _Req, build_prefill_canary, prefill_chunk_batch
from serving_report import breakdown_table

# what other code reads from this module (bench_serving_overhead.py,
# bench_prefill_device_time.py), the sibling modules' names included
__all__ = [
    "PREFILL_SHAPES",
    "_Req",
    "build_prefill_canary",
    "prefill_chunk_batch",
    "run_breakdown",
    "run_host_breakdown",
]


# ---- breakdown ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BreakdownShape:
    head_num: int
    head_dim: int
    layer_num: int
    num_slots: int
    max_reqs: int
    max_context_len: int
    ctx: int
    batch_sizes: tuple
    prefill_chunk: int
    steps: int
    warmup_steps: int
    vocab: int


LABEL = "kvc: "


@contextlib.contextmanager
def labelled_launches(manager):
    """Wrap the runtime's launch functions (module globals the single-forward manager and the
    kernel launcher call) in ``record_function`` ranges that end with a device
    synchronisation, so every kernel can be charged to the canary launch that issued it (the
    syncs only add idle time between launches, kernel durations are unchanged). Restored on
    exit."""
    import torch
    from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag
    from sglang.srt.kv_canary import plan_input as pi_mod
    from sglang.srt.kv_canary import token_history as th_mod
    from sglang.srt.kv_canary.single_forward_manager import launches as kl_mod
    from sglang.srt.kv_canary.single_forward_manager import forward_manager as sfm_mod

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def wrap(fn, label_of):
        def wrapper(*a, **kw):
            with torch.profiler.record_function(LABEL + label_of(*a, **kw)):
                out = fn(*a, **kw)
                sync()  # the range's device work ends inside it (see attribute())
                return out

        return wrapper

    def tag_phase(**kw):
        return CanaryLaunchTag(int(kw["context"].kernel_kind)).phase.name

    patches = [
        (th_mod.TokenHistoryUploader, "upload", lambda *a, **k: "token-id scatter (outside graph)"),
        (sfm_mod, "launch_group_plan", lambda *a, **k: "plan kernels"),
        (kl_mod, "launch_canary_verify_kernel", lambda *a, **k: f"{tag_phase(**k)} verify"),
        (kl_mod, "launch_canary_write_kernel", lambda *a, **k: f"{tag_phase(**k)} write"),
        (kl_mod, "launch_canary_chain_writes", lambda *a, **k: "HEAD + TAIL chain write"),
        (pi_mod.PlanInput, "fill_from_forward_batch", lambda *a, **k: "plan input fill"),
        (sfm_mod.SingleForwardManager, "pre_ops_maybe_inside_graph", lambda *a, **k: "pre-ops"),
        (sfm_mod.SingleForwardManager, "post_ops_maybe_inside_graph", lambda *a, **k: "post-ops"),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    dh = manager.device_host
    orig_stage = dh.stage
    try:
        for obj, name, label_of in patches:
            setattr(obj, name, wrap(getattr(obj, name), label_of))
        dh.stage = wrap(orig_stage, lambda *a, **k: "D2H staging")
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        dh.stage = orig_stage


def attribute(events, *, use_cuda: bool):
    """Per label: inclusive and exclusive (minus nested labelled ranges) time per label, summed
    over all its ranges, in µs; also device time by kernel name inside canary ranges and the
    device time outside every labelled range.

    On CUDA by time: every labelled range ends with a device synchronisation (see
    :func:`labelled_launches`), so each device activity (kernel, memcpy, memset) runs inside
    the CPU time span of the range that launched it; it is charged to the innermost labelled
    range containing its start. (The profiler's correlation-based attribution misses Triton
    launches.) On the CPU: the ranges' CPU time."""
    from torch.autograd import DeviceType

    incl: dict[str, float] = {}
    excl: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    ranges = sorted(
        (
            (ev.time_range.start, ev.time_range.end, ev.name[len(LABEL) :])
            for ev in events
            if ev.device_type == DeviceType.CPU and ev.name.startswith(LABEL)
        ),
        key=lambda r: (r[0], -r[1]),
    )
    if not use_cuda:
        for ev in events:
            if ev.device_type != DeviceType.CPU or not ev.name.startswith(LABEL):
                continue
            name = ev.name[len(LABEL) :]
            below, todo = 0.0, list(ev.cpu_children)
            while todo:
                ch = todo.pop()
                if ch.name.startswith(LABEL):
                    below += ch.cpu_time_total
                else:
                    todo += ch.cpu_children
            incl[name] = incl.get(name, 0.0) + ev.cpu_time_total
            excl[name] = excl.get(name, 0.0) + ev.cpu_time_total - below
        return incl, excl, by_kernel, 0.0
    unattributed = 0.0
    for ev in events:
        if ev.device_type != DeviceType.CUDA or ev.name.startswith(LABEL):
            continue  # (the device-side copies of the labelled ranges carry the label's name)
        t, dur = ev.time_range.start, ev.time_range.end - ev.time_range.start
        enclosing = [r for r in ranges if r[0] <= t <= r[1]]
        if not enclosing:
            unattributed += dur
            continue
        innermost = max(enclosing, key=lambda r: r[0])
        excl[innermost[2]] = excl.get(innermost[2], 0.0) + dur
        for name in {r[2] for r in enclosing}:
            incl[name] = incl.get(name, 0.0) + dur
        if not any(r[2] == "model stand-in" for r in enclosing):
            by_kernel[ev.name] = by_kernel.get(ev.name, 0.0) + dur
    return incl, excl, by_kernel, unattributed


def run_breakdown(args) -> None:
    import torch
    from sglang.srt.kv_canary.builder import build_canary
    from sglang.srt.kv_canary.capacities import CanaryCapacityInputs
    from sglang.srt.kv_canary.config import CanaryConfig
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    smoke = args.smoke_cpu
    device = bench_device(smoke, "--breakdown")
    use_cuda = device.type == "cuda"
    configs = canary_on_configs(args.configs, "--breakdown")
    bss = tuple(int(b) for b in parse_ints(args.breakdown_bs, "--breakdown-bs"))
    if smoke:
        shape = BreakdownShape(
            head_num=2,
            head_dim=8,
            layer_num=2,
            num_slots=4096,
            max_reqs=8,
            max_context_len=256,
            ctx=64,
            batch_sizes=tuple(min(b, 4) for b in bss),
            prefill_chunk=128,
            steps=2,
            warmup_steps=1,
            vocab=512,
        )
    else:
        shape = BreakdownShape(
            head_num=8,
            head_dim=128,
            layer_num=28,
            num_slots=args.max_total_tokens,
            max_reqs=128,
            max_context_len=QWEN3_0_6B_CONFIG["max_position_embeddings"],
            ctx=args.breakdown_ctx,
            batch_sizes=bss,
            prefill_chunk=args.chunked_prefill_size,
            steps=args.breakdown_steps,
            warmup_steps=3,
            vocab=QWEN3_0_6B_CONFIG["vocab_size"],
        )
    if max(shape.batch_sizes) > shape.max_reqs:
        raise SystemExit(
            f"--breakdown-bs: at most {shape.max_reqs} (the Engine's max_running_requests)"
        )
    need = max(shape.batch_sizes) * (shape.ctx + shape.warmup_steps + shape.steps + 2)
    if need > shape.num_slots:
        raise SystemExit(
            f"--breakdown-ctx / --max-total-tokens: {need} slots needed, the pool "
            f"has {shape.num_slots}"
        )
    name = torch.cuda.get_device_name() if use_cuda else "cpu (smoke)"
    unit = "GPU µs" if use_cuda else "CPU µs (smoke, meaningless)"
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if use_cuda else None
    print(
        f"KV-canary per-launch breakdown — {name} — {now_utc()} — context {shape.ctx}, "
        f"{shape.steps} profiled decode steps",
        flush=True,
    )
    records = []
    for cname in configs:
        cfg = CONFIGS[cname]
        for bs in shape.batch_sizes:
            rec = breakdown_one(
                cfg,
                bs,
                shape,
                device,
                flush,
                name,
                unit,
                torch=torch,
                CanaryCapacityInputs=CanaryCapacityInputs,
                CanaryConfig=CanaryConfig,
                build_canary=build_canary,
                TokenToKVPoolAllocator=TokenToKVPoolAllocator,
                MHATokenToKVPool=MHATokenToKVPool,
                ReqToTokenPool=ReqToTokenPool,
                ForwardBatch=ForwardBatch,
                ForwardMode=ForwardMode,
            )
            append_jsonl(args.out, rec)
            records.append(rec)
            tot = rec["launches"]["forward-stream total (sum)"]
            graph = rec["launches"].get("CUDA-graph replay of the in-graph ops")
            print(
                f"[{cname} bs{bs}] forward-stream total {tot:.1f} {unit}/step"
                + (f", graph replay {graph:.1f} µs" if graph is not None else ""),
                flush=True,
            )
            gc.collect()  # the pools, the manager and the patched buf-info methods form cycles
            if use_cuda:
                torch.cuda.empty_cache()
    print()
    print(breakdown_table(records))


def breakdown_one(
    cfg: BenchConfig,
    bs: int,
    shape: BreakdownShape,
    device,
    flush,
    gpu: str,
    unit: str,
    *,
    torch,
    CanaryCapacityInputs,
    CanaryConfig,
    build_canary,
    TokenToKVPoolAllocator,
    MHATokenToKVPool,
    ReqToTokenPool,
    ForwardBatch,
    ForwardMode,
) -> dict:
    use_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)
    gen = torch.Generator().manual_seed(bs)
    r2t = ReqToTokenPool(
        size=shape.max_reqs,
        max_context_len=shape.max_context_len,
        device=str(device),
        enable_memory_saver=False,
    )
    kv = MHATokenToKVPool(
        size=shape.num_slots,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=shape.head_num,
        head_dim=shape.head_dim,
        layer_num=shape.layer_num,
        device=str(device),
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    for layer in range(shape.layer_num if cfg.real_data_layers == "all" else 1):
        kv.k_buffer[layer].normal_()  # never hash zeros: the layers the canary reads
        kv.v_buffer[layer].normal_()
    alloc = TokenToKVPoolAllocator(
        shape.num_slots, torch.bfloat16, str(device), kv, need_sort=False
    )
    config = CanaryConfig(
        mode=cfg.kv_canary,
        real_kv_hash_mode=cfg.real_data,
        real_data_layers=cfg.real_data_layers,
        enable_verify_token_assert=cfg.verify_tokens,
        stats_print_every_n_steps=0,
    )
    # the production assembly, with the Engine's limits (max_prefill_tokens: its default)
    mgr = build_canary(
        pool=kv,
        req_to_token=r2t.req_to_token,
        config=config,
        device=device,
        capacity_inputs=CanaryCapacityInputs(
            context_len=shape.max_context_len,
            chunked_prefill_size=shape.prefill_chunk,
            max_prefill_tokens=16384,
            cuda_graph_max_bs=shape.max_reqs,
        ),
    )
    mgr.mark_init_finished()

    # slots as after churn: the allocator's free list, shuffled
    free = alloc.alloc(bs * (shape.ctx + shape.warmup_steps + shape.steps + 2))
    free = free[torch.randperm(free.shape[0], generator=gen).to(free.device)].tolist()
    reqs = [
        _Req(
            r2t.free_slots.pop(0),
            torch.randint(100, shape.vocab - 100, (shape.ctx,), generator=gen).tolist(),
        )
        for _ in range(bs)
    ]

    def i64(v):
        return torch.tensor(v, dtype=torch.int64, device=device)

    def batch(mode, part, ids, pos, loc, pre=None, ext=None):
        seq = [p + e for p, e in zip(pre, ext)] if pre is not None else [p + 1 for p in pos]
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(part),
            input_ids=i64(ids),
            req_pool_indices=i64([r.row for r in part]),
            seq_lens=i64(seq),
            out_cache_loc=i64(loc),
            seq_lens_sum=sum(seq),
            positions=i64(pos),
            req_to_token_pool=r2t,
            token_to_kv_pool=kv,
        )
        if mode == ForwardMode.EXTEND:
            fb.extend_prefix_lens, fb.extend_seq_lens = i64(pre), i64(ext)
            fb.extend_num_tokens = len(ids)
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = list(pre), list(ext)
        mgr.on_forward_batch_init(fb, part)  # what the ForwardBatch.init_new hook does
        return fb

    def model_stand_in():
        if flush is not None:
            with torch.profiler.record_function(LABEL + "model stand-in"):
                flush.zero_()
                torch.cuda.synchronize()

    def forward(fb):
        with mgr.with_active_single_forward_manager(0), mgr.with_ops_outside_graph(fb):
            mgr.pre_ops_maybe_inside_graph(fb)
            model_stand_in()  # the KV of the new tokens is already random
            mgr.post_ops_maybe_inside_graph(fb)
        model_stand_in()

    # prefill through the canary, in chunks of at most prefill_chunk tokens per forward
    per_fwd = max(1, shape.prefill_chunk // shape.ctx)
    for start in range(0, bs, per_fwd):
        part = reqs[start : start + per_fwd]
        ids, pos, loc = [], [], []
        for r in part:
            r.slots = [free.pop() for _ in range(shape.ctx)]
            r2t.req_to_token[r.row, : shape.ctx] = torch.tensor(r.slots, dtype=torch.int32)
            ids += r.origin_input_ids
            pos += list(range(shape.ctx))
            loc += r.slots
        forward(
            batch(
                ForwardMode.EXTEND,
                part,
                ids,
                pos,
                loc,
                pre=[0] * len(part),
                ext=[shape.ctx] * len(part),
            )
        )

    def decode_batch():
        ids, pos, loc = [], [], []
        for r in reqs:
            tok = int(torch.randint(100, shape.vocab - 100, (1,), generator=gen))
            r.output_ids.append(tok)
            p = r.length - 1
            slot = free.pop()
            r2t.req_to_token[r.row, p] = slot
            r.slots.append(slot)
            ids.append(tok)
            pos.append(p)
            loc.append(slot)
        return batch(ForwardMode.DECODE, reqs, ids, pos, loc)

    for _ in range(shape.warmup_steps):  # compiles the Triton kernels
        forward(decode_batch())
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if use_cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    fbs = [decode_batch() for _ in range(shape.steps)]  # host-side batch building unprofiled
    with labelled_launches(mgr), torch.profiler.profile(activities=acts) as prof:
        for fb in fbs:
            forward(fb)
        sync()
    incl, excl, by_kernel, unattributed = attribute(prof.events(), use_cuda=use_cuda)
    n = shape.steps
    launches = {
        "plan input fill": incl.get("plan input fill", 0.0) / n,
        "plan kernels": incl.get("plan kernels", 0.0) / n,
        "HEAD verify": incl.get("HEAD verify", 0.0) / n,
        # a group's HEAD writes and TAIL chain part: one launch (launch_canary_chain_writes)
        "HEAD + TAIL chain write": incl.get("HEAD + TAIL chain write", 0.0) / n,
        "TAIL verify": incl.get("TAIL verify", 0.0) / n,
        "status copy + rest of post-ops": excl.get("post-ops", 0.0) / n,
        "rest of pre-ops": excl.get("pre-ops", 0.0) / n,
    }
    if cfg.real_data != "none":  # without real data the TAIL write has nothing left to launch
        launches["TAIL fingerprint write"] = incl.get("TAIL write", 0.0) / n
    if cfg.verify_tokens:
        launches = {
            "token-id scatter (outside graph)": incl.get("token-id scatter (outside graph)", 0.0)
            / n,
            **launches,
        }
    launches["forward-stream total (sum)"] = sum(launches.values())
    launches["D2H staging (side stream, copy engine)"] = incl.get("D2H staging", 0.0) / n
    if use_cuda:
        launches["unattributed device time"] = unattributed / n
        launches["CUDA-graph replay of the in-graph ops"] = graph_replay_us(
            mgr,
            decode_batch(),
            bs,
            device,
            torch=torch,
            ForwardBatch=ForwardBatch,
            ForwardMode=ForwardMode,
            reqs=reqs,
            r2t=r2t,
            kv=kv,
        )
    sync()
    violations = int(mgr.state.violation_log.violation_write_index[0])
    if violations:
        raise SystemExit(
            f"breakdown {cfg.name} bs{bs}: {violations} canary violations on a clean workload"
        )
    rec = dict(
        kind="breakdown",
        time=now_utc(),
        gpu=gpu,
        unit=unit,
        config=cfg.name,
        bs=bs,
        ctx=shape.ctx,
        steps=n,
        shape=dataclasses.asdict(shape),
        launches=launches,
        by_kernel={k: v / n for k, v in by_kernel.items()},
        capacities=dataclasses.asdict(mgr.capacities),
    )
    return rec


def graph_replay_us(
    mgr, fb, bs, device, *, torch, ForwardBatch, ForwardMode, reqs, r2t, kv
) -> float:
    """Capture one decode step's in-graph canary ops (plan, HEAD, TAIL, status copy) into a
    CUDA graph as sglang's decode graphs hold them, run it once as the runtime does (outside
    ops + replay), then time replays (idempotent: same records rewritten, same prefix
    verified) with ``do_bench`` (L2 flushed before each)."""
    import triton

    def z():
        return torch.zeros(bs, dtype=torch.int64, device=device)

    static = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=z(),
        req_pool_indices=z(),
        seq_lens=z(),
        out_cache_loc=z(),
        seq_lens_sum=fb.seq_lens_sum,
        positions=z(),
        req_to_token_pool=r2t,
        token_to_kv_pool=kv,
    )
    for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
        getattr(static, name).copy_(getattr(fb, name))
    mgr.on_forward_batch_init(static, reqs)

    def body():
        mgr.pre_ops_maybe_inside_graph(static)
        mgr.post_ops_maybe_inside_graph(static)

    with mgr.with_active_single_forward_manager(0), mgr.capturing():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
    torch.cuda.synchronize()
    with mgr.with_active_single_forward_manager(0), mgr.with_ops_outside_graph(static):
        mgr.before_graph_replay()
        graph.replay()
        mgr.mark_replayed_inside_graph()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return ms * 1e3
