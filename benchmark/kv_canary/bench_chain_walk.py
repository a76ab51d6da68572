"""The chain walk of a prefill (the side half's write launch, docs/performance.md, "The
forward path"), this tree's kernel against another tree's, paired and interleaved on one GPU.

    python benchmark/kv_canary/bench_chain_walk.py --against OTHER/python/sglang/jit_kernel/kv_canary/write.py
        [--tokens 512,4096,16384] [--decode-bs 32,256] [--rounds 30] [--out F.jsonl]
        [--req-capacity R] [--token-capacity T] [--graph]

``--against`` loads another revision's ``write.py`` (e.g. from ``git show REV:FILE``) as its
own module beside this tree's, on this tree's other kernel modules (hashes, constants,
validation): for comparing two versions of the write kernel only. Each shape is one
``launch_canary_chain_writes`` of two buffers (HEAD K and TAIL K of one group, as a prefill's
side half launches them): a prefill of N new tokens at batch size 1 (no prefix), and a decode
step (one token per request, each seeded by its prefix's last slot). Before timing, both
kernels write the same inputs into separate buffers and the records, rings and counters must
be byte-identical. Each round times, in an order shuffled per round, this tree (A), this tree
again (A', the A/A control) and the other tree (B), each as the median of 5 launches between
CUDA events; printed per shape: the medians and the paired ratios B/A and A'/A with a 95 %
bootstrap interval. ``--req-capacity`` / ``--token-capacity`` lay the launch out as a server's
(its write plan sized for R requests, its input tensors padded to T tokens: what an eager
forward's graph launches; default: the shape's own requests and tokens). ``--graph`` captures
each launch in a CUDA graph and times its replay: the device time alone (a server replays these
launches in graphs), not the host's launch work. ``--smoke-cpu`` runs the equality check on
the CPU (Triton's interpreter) with tiny shapes and times nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import random
import statistics
import sys
from pathlib import Path

if "--smoke-cpu" in sys.argv:  # the kernels read it once, at import: before them
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    append_jsonl,
    cuda_event_ms,
    now_utc,
    parse_ints,
    use_test_support,
)

use_test_support()
from canary_testlib import make_context  # noqa: E402

from sglang.jit_kernel.kv_canary import write as this_write  # noqa: E402
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag, WritePlan  # noqa: E402


def load_write_module(path: str):
    """Another revision's ``write.py`` as a module of its own (its imports resolve to this
    tree's kernel modules)."""
    spec = importlib.util.spec_from_file_location("kv_canary_write_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass
class Shape:
    name: str
    bs: int
    new_per_req: int  # new tokens per request
    prefix: int  # tokens already written per request (decode: its seed)


class Case:
    """One shape's inputs and two buffers' contexts per kernel (separate records, ring and
    counters for each kernel, so their results can be compared)."""

    def __init__(
        self,
        shape: Shape,
        device: torch.device,
        seed: int = 0,
        *,
        req_capacity: int = 0,
        token_capacity: int = 0,
    ):
        g = torch.Generator().manual_seed(seed)
        bs, n = shape.bs, shape.new_per_req
        total_slots = bs * (shape.prefix + n) + 1
        self.shape = shape
        self.device = device
        num_tokens = bs * n
        pad = max(token_capacity - num_tokens, 0)  # padding entries: slot 0, in no request
        perm = torch.randperm(total_slots - 1, generator=g) + 1  # slot 0: the padding slot
        ids = torch.randint(0, 150_000, (num_tokens,), generator=g)
        self.input_ids = torch.nn.functional.pad(ids, (0, pad)).to(device)
        pos = torch.arange(shape.prefix, shape.prefix + n).repeat(bs)
        self.positions = torch.nn.functional.pad(pos, (0, pad)).to(device)
        new_slots = perm[:num_tokens]
        self.out_cache_loc = torch.nn.functional.pad(new_slots, (0, pad)).to(device)
        seeds = perm[num_tokens : num_tokens + bs] if shape.prefix else torch.full((bs,), -1)
        self.plan = WritePlan.allocate(write_req_capacity=max(bs, req_capacity), device=device)
        self.plan.write_offsets[: bs + 1].copy_(torch.arange(0, bs + 1) * n)
        self.plan.write_seed_slot_indices[:bs].copy_(seeds)
        self.plan.write_req_to_token_rows[:bs].copy_(torch.arange(bs))
        self.plan.write_num_valid_reqs.fill_(bs)
        self.num_slots = total_slots
        # a seed record at position prefix - 1 (decode): what the prefix's last write left
        self.seed_records = torch.zeros(total_slots, 4, dtype=torch.int64)
        if shape.prefix:
            self.seed_records[seeds, 1] = shape.prefix - 1
            self.seed_records[seeds, 0] = torch.randint(0, 150_000, (bs,), generator=g)

    def contexts(self):
        head = make_context(self.num_slots, device=self.device, kind=CanaryLaunchTag.HEAD_K_FULL)
        tail = make_context(self.num_slots, device=self.device, kind=CanaryLaunchTag.TAIL_K_FULL)
        tail = dataclasses.replace(
            tail,
            violation_ring=head.violation_ring,
            violation_write_index=head.violation_write_index,
            enable_chain_position_assert=head.enable_chain_position_assert,
        )
        for c in (head, tail):
            c.canary_words.copy_(self.seed_records.to(self.device))
        return [head, tail]

    def launch(self, module, contexts) -> None:
        module.launch_canary_chain_writes(
            contexts=contexts,
            plan=self.plan,
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
        )


def check_equal(case: Case, a_module, b_module) -> None:
    """Both kernels on the same inputs: records, ring, counters byte-identical."""
    a, b = case.contexts(), case.contexts()
    case.launch(a_module, a)
    case.launch(b_module, b)
    for x, y in zip(a, b):
        for name in ("canary_words", "violation_ring", "violation_write_index"):
            if not torch.equal(getattr(x, name), getattr(y, name)):
                raise SystemExit(f"{case.shape.name}: the two kernels' {name} differ")
        for name in ("slot_run_counter", "kernel_run_counter"):
            if not torch.equal(getattr(x, name), getattr(y, name)):
                raise SystemExit(f"{case.shape.name}: the two kernels' {name} differ")
    if int(a[0].violation_write_index[0]) != 0:
        raise SystemExit(f"{case.shape.name}: the clean walk reported violations")


def launcher(case: Case, module, contexts, *, graph: bool = False):
    """A callable that runs ``module``'s launch on ``contexts``: the launch itself, or (``graph``)
    the replay of a CUDA graph holding it (captured here, after a warm-up launch)."""
    if not graph:
        return lambda: case.launch(module, contexts)
    case.launch(module, contexts)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        case.launch(module, contexts)
    return g.replay


def time_us(case: Case, module, contexts, reps: int = 5, *, run=None) -> float:
    """Median device time of ``reps`` launches (or calls of ``run``, a :func:`launcher`), each
    between two CUDA events."""
    times = cuda_event_ms(run or (lambda: case.launch(module, contexts)), reps)
    return statistics.median([ms * 1000.0 for ms in times])


def bootstrap_ci(ratios, n: int = 2000, seed: int = 0):
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choice(ratios) for _ in ratios) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="another revision's write.py")
    ap.add_argument("--tokens", default="512,4096,16384")
    ap.add_argument("--decode-bs", default="32,256")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=None, help="JSON lines file (appended)")
    ap.add_argument("--req-capacity", type=int, default=0, help="the write plan's requests")
    ap.add_argument("--token-capacity", type=int, default=0, help="the inputs' padded tokens")
    ap.add_argument("--graph", action="store_true", help="time CUDA graph replays")
    ap.add_argument("--smoke-cpu", action="store_true")
    a = ap.parse_args()
    for flag, value in (("--req-capacity", a.req_capacity), ("--token-capacity", a.token_capacity)):
        if value < 0:
            ap.error(
                f"{flag}: a count of requests or tokens, >= 0 (0: the shape's own), got {value}"
            )
    other = load_write_module(a.against)
    layout = dict(req_capacity=a.req_capacity, token_capacity=a.token_capacity)
    tokens, decode_bs = parse_ints(a.tokens, "--tokens"), parse_ints(a.decode_bs, "--decode-bs")
    if a.smoke_cpu:
        device = torch.device("cpu")
        shapes = [Shape("prefill 1 x 9", 1, 9, 0), Shape("decode 3 x 1", 3, 1, 5)]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_chain_walk.py times CUDA launches: no GPU (try --smoke-cpu)")
        device = torch.device("cuda")
        shapes = [Shape(f"prefill 1 x {n}", 1, n, 0) for n in tokens]
        shapes += [Shape(f"decode {bs} x 1", bs, 1, 511) for bs in decode_bs]
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"chain walk: this tree (A) vs {a.against} (B); {gpu}; {now_utc()}; "
        f"capacities {layout}; {'graph replays' if a.graph else 'launches'}"
    )
    for shape in shapes:
        case = Case(shape, device, **layout)
        check_equal(case, this_write, other)
        if device.type != "cuda":
            print(f"{shape.name}: records, ring and counters identical (CPU: not timed)")
            continue
        ctx = {"A": case.contexts(), "A'": case.contexts(), "B": case.contexts()}
        mods = {"A": this_write, "A'": this_write, "B": other}
        for k in ctx:  # compile and warm up
            for _ in range(3):
                case.launch(mods[k], ctx[k])
        torch.cuda.synchronize()
        runs = {k: launcher(case, mods[k], ctx[k], graph=a.graph) for k in ctx}
        t = {k: [] for k in ctx}
        order = list(ctx)
        rng = random.Random(1)
        for _ in range(a.rounds):
            rng.shuffle(order)
            for k in order:
                t[k].append(time_us(case, mods[k], ctx[k], run=runs[k]))
        row = {"shape": shape.name, "gpu": gpu, "date": now_utc(), "graph": a.graph, **layout}
        for k in ctx:
            row[f"{k}_us"] = statistics.median(t[k])
        for k in ("B", "A'"):
            ratios = [x / y for x, y in zip(t[k], t["A"])]
            lo, hi = bootstrap_ci(ratios)
            row[f"{k}/A"] = [statistics.median(ratios), lo, hi]
        ctl, b, us_ctl = row["A'/A"], row["B/A"], row["A'_us"]
        print(
            f"{shape.name:>18}: A {row['A_us']:8.1f} us  A' {us_ctl:8.1f} us  "
            f"B {row['B_us']:8.1f} us  B/A {b[0]:.3f} [{b[1]:.3f}, {b[2]:.3f}]  "
            f"A'/A {ctl[0]:.3f} [{ctl[1]:.3f}, {ctl[2]:.3f}]"
        )
        if a.out:
            append_jsonl(a.out, row)


if __name__ == "__main__":
    main()
