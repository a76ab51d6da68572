"""The write kernel over a speculative draft tree (``WriteTree``; docs/speculative_trees.md,
"3. Record semantics for tree tokens"): hand trees and seeded fuzz against an independent scalar
oracle (:func:`oracle_tree_write`, one entry at a time, walking each path in Python), on the
Triton launcher (the interpreter on CPU) and the torch reference (the ``impl`` fixture)."""

from __future__ import annotations

import dataclasses
import random
import sys

import pytest
import torch

from kernel_oracle import (
    BIT_WRITE_POS,
    BIT_WRITE_TOKEN,
    HEAD,
    Canary,
    hand_write_plan,
    r2t_table,
    run_plan,
    sglang_tree_lists,
    oracle_fingerprint,
    rec_hash,
    tensor_of,
)
from sglang.jit_kernel.kv_canary import (
    CanaryLaunchTag,
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
    WriteParts,
    WriteTree,
    launch_canary_chain_writes,
)
from sglang.jit_kernel.kv_canary.consts import (
    TREE_PARENT_ORPHAN,
    TREE_PARENT_SEED,
    canary_chain_step,
    to_int64,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

SEED, ORPHAN = TREE_PARENT_SEED, TREE_PARENT_ORPHAN


def oracle_tree_write(
    oracle, plan, ids, pos, loc, parent, max_depth, *, input_assert, exp_tok, exp_pos
):
    """The scalar oracle of a tree write (``kernel_oracle.Oracle``'s state, advanced as the
    kernel must): per entry, walk its parents to the seed; an orphan path is skipped; a bad
    link (a parent not below its child, a path longer than ``max_depth``) is reported with
    expected position -1 and not stored; else the record is chained from the seed's hash and
    the path's (token, position) root first, its position checked against its parent's."""
    oracle.kernel_counter += 1
    nreq = min(max(plan.nreq, 0), len(plan.seeds))
    n = len(ids)
    rows, stored, touched = [], [], []
    starts = []
    for r in range(nreq):
        seed = plan.seeds[r]
        if 0 <= seed < oracle.num_slots:
            starts.append((rec_hash(oracle.recs[seed]), oracle.recs[seed][1], seed > 0))
        else:
            starts.append((HEAD, 0, False))
    for r in range(nreq):
        seed_hash, seed_pos, has_seed = starts[r]
        lo, hi = plan.write_offsets[r], plan.write_offsets[r + 1]
        for j in range(max(hi - lo, 0)):
            i = lo + j
            if not 0 <= i < n:
                continue
            path, cur, state = [j], j, None
            while state is None:
                p = parent[lo + cur]
                if p == SEED:
                    state = "rooted"
                elif p == ORPHAN:
                    state = "orphan"
                elif p < ORPHAN or p >= cur:
                    state = "bad"
                else:
                    cur = p
                    path.append(cur)
                    if len(path) > max_depth:
                        state = "bad"
            if 0 <= loc[i] < oracle.num_slots:
                touched.append(loc[i])
            if state == "orphan":
                continue
            tok, p_i, slot = ids[i], pos[i], loc[i]
            bits, etok, epos = 0, tok, p_i
            if input_assert:
                etok, epos = exp_tok[i], exp_pos[i]
                bits |= BIT_WRITE_TOKEN if tok != etok else 0
                bits |= BIT_WRITE_POS if p_i != epos else 0
            running = seed_hash
            if state == "bad":
                bits |= BIT_WRITE_POS
                epos = -1
            else:
                for a in reversed(path[1:]):
                    running = canary_chain_step(running, ids[lo + a], pos[lo + a])
                prev = pos[lo + path[1]] if len(path) > 1 else seed_pos
                if has_seed and oracle.chain_assert == 1 and p_i != prev + 1:
                    bits |= BIT_WRITE_POS
                    epos = prev + 1
            if not 0 <= slot < oracle.num_slots:
                continue
            if state == "rooted":
                oracle.recs[slot] = [tok, p_i, to_int64(running), 0]
                stored.append(slot)
            if bits:
                rows.append(
                    oracle._row(slot, p_i, tok, etok, running, epos, bits, p_i, plan.write_rows[r])
                )
    if oracle.mode != RealKvHashMode.NONE:  # the fingerprint part: every written slot
        for slot in touched:
            oracle.recs[slot][3] = to_int64(oracle_fingerprint(oracle.sources, oracle.mode, slot))
    oracle.slot_counter += len(stored)
    oracle.launch_rows.append(rows)
    return rows


def tree_write(
    c: Canary,
    plans,
    ids,
    pos,
    loc,
    parent,
    max_depth,
    *,
    input_assert=False,
    exp_tok=None,
    exp_pos=None,
    parts=WriteParts.ALL,
):
    """Launch ``c``'s implementation with a ``WriteTree`` and advance its oracle; check both."""
    dev = c.impl.device
    tree = WriteTree(parent=tensor_of(parent, torch.int64, dev), max_depth=max_depth)
    c.impl.write(
        context=c.ctx,
        plan=plans.wp,
        input_ids=tensor_of(ids, torch.int64, dev),
        positions=tensor_of(pos, torch.int64, dev),
        out_cache_loc=tensor_of(loc, torch.int64, dev),
        enable_write_input_assert=input_assert,
        expected_input_tokens=None if exp_tok is None else tensor_of(exp_tok, torch.int64, dev),
        expected_input_positions=None if exp_pos is None else tensor_of(exp_pos, torch.int64, dev),
        parts=parts,
        tree=tree,
    )
    rows = oracle_tree_write(
        c.oracle,
        plans.exp,
        ids,
        pos,
        loc,
        parent,
        max_depth,
        input_assert=input_assert,
        exp_tok=exp_tok,
        exp_pos=exp_pos,
    )
    c.check(f"[{c.impl.name} tree write] ")
    return rows


def _seeded(c, slot=1, token=5, position=9):
    c.set_record(slot, [token, position, 0x77, 0])
    return rec_hash([token, position, 0x77, 0])


# a verify tree of one request (sglang's node order: a parent's index below its children's):
#      0 (root, position 10)
#     / \
#    1   2        (position 11)
#   / \   \
#  3   4   5      (position 12)
#  |
#  6              (position 13)
TREE = [SEED, 0, 0, 1, 1, 2, 3]
TOKENS = [40, 41, 42, 43, 44, 45, 46]
DEPTHS = [0, 1, 1, 2, 2, 2, 3]


def test_each_node_is_chained_from_its_path_root_first(impl):
    """A node's record is what a plain decode of its path's tokens would store: the seed's
    hash folded with each ancestor's (token, position), root first; no violation."""
    c = Canary(impl, 32)
    h = _seeded(c)
    pos = [10 + d for d in DEPTHS]
    loc = [20, 21, 22, 23, 24, 25, 26]
    assert tree_write(c, hand_write_plan(impl, [7], [1], rows=[3]), TOKENS, pos, loc, TREE, 4) == []
    path_of_6 = canary_chain_step(canary_chain_step(canary_chain_step(h, 40, 10), 41, 11), 43, 12)
    assert c.record(26) == [46, 13, to_int64(path_of_6), 0]
    # siblings share their parent's chain; the root's is the seed's hash itself
    assert (
        c.record(23)[2]
        == c.record(24)[2]
        == to_int64(canary_chain_step(canary_chain_step(h, 40, 10), 41, 11))
    )
    assert c.record(20)[2] == to_int64(h)
    assert int(c.ctx.slot_run_counter[0]) == 7


def test_a_chain_shaped_tree_writes_what_the_linear_walk_writes(impl):
    """``parent = j - 1`` (a chain): byte for byte the linear write's records, rows and
    counters, a wrong position included."""
    ids = [7, 8, 9, 10, 11]
    pos = [4, 5, 9, 7, 8]  # position 9 breaks the chain: reported by both
    loc = [3, 4, 5, 6, 7]
    linear, tree = Canary(impl, 16), Canary(impl, 16)
    for c in (linear, tree):
        _seeded(c, slot=2, position=3)
    rows_linear = linear.write(hand_write_plan(impl, [5], [2], rows=[1]), ids, pos, loc)
    rows_tree = tree_write(
        tree, hand_write_plan(impl, [5], [2], rows=[1]), ids, pos, loc, [SEED, 0, 1, 2, 3], 5
    )
    assert rows_tree == rows_linear and len(rows_tree) == 2
    assert linear.ctx.canary_words.tolist() == tree.ctx.canary_words.tolist()


def test_a_node_under_a_sibling_is_reported_at_its_position(impl):
    """A node whose parent index names a sibling (same position) fails the position check:
    ``write_position``, the expected position its parent's + 1."""
    c = Canary(impl, 32)
    _seeded(c)
    pos = [10 + d for d in DEPTHS]
    bad_tree = list(TREE)
    bad_tree[3] = 2  # node 3 (position 12) under node 2... fine: 12 == 11 + 1
    bad_tree[5] = 4  # node 5 (position 12) under node 4 (position 12)
    rows = tree_write(
        c, hand_write_plan(impl, [7], [1], rows=[3]), TOKENS, pos, list(range(20, 27)), bad_tree, 4
    )
    assert [(r[1], r[6], r[7]) for r in rows] == [(25, 13, BIT_WRITE_POS)]


def test_orphans_and_their_subtrees_are_neither_written_nor_checked(impl):
    """An orphan (sglang dropped it from the tree) and every node below it keep their old
    records and are not counted, even with a wrong position."""
    c = Canary(impl, 32)
    _seeded(c)
    for s in range(20, 27):
        c.set_record(s, [1, 2, 3, 4])
    orphaned = list(TREE)
    orphaned[1] = ORPHAN  # node 1 and its subtree (3, 4, 6)
    pos = [10 + d for d in DEPTHS]
    pos[6] = 99
    assert (
        tree_write(
            c, hand_write_plan(impl, [7], [1]), TOKENS, pos, list(range(20, 27)), orphaned, 4
        )
        == []
    )
    for s in (21, 23, 24, 26):
        assert c.record(s) == [1, 2, 3, 4]
    assert int(c.ctx.slot_run_counter[0]) == 3


@pytest.mark.parametrize(
    "case, parent, pos, max_depth, bad",
    [
        ("parent not below its child", [SEED, 0, 3, 1], [10, 11, 12, 12], 4, [2]),
        ("a parent past the sentinels", [SEED, -7, 0, 2], [10, 11, 11, 12], 4, [1]),
        ("deeper than max_depth", [SEED, 0, 1, 2], [10, 11, 12, 13], 3, [3]),
    ],
)
def test_a_bad_link_is_reported_and_not_stored(impl, case, parent, pos, max_depth, bad):
    """A parent index that cannot be sglang's (not below its child, below the sentinels) or a
    path of more entries than ``max_depth``: ``write_position`` with expected position -1 and
    the seed's hash, the record untouched (a later read of the slot fails its verify); the
    rest of the tree is written."""
    c = Canary(impl, 16)
    h = _seeded(c)
    for s in range(4, 8):
        c.set_record(s, [1, 2, 3, 4])
    ids, loc = [30, 31, 32, 33], [4, 5, 6, 7]
    rows = tree_write(
        c, hand_write_plan(impl, [4], [1], rows=[2]), ids, pos, loc, parent, max_depth
    )
    assert sorted((r[1], r[5], r[6]) for r in rows) == [(loc[j], to_int64(h), -1) for j in bad], (
        case
    )
    for j in bad:
        assert c.record(loc[j]) == [1, 2, 3, 4]


def test_input_assert_and_slots_out_of_range(impl):
    """The input assert checks each node's token and position; a slot < 0 or past the pool
    is neither stored nor reported, and its subtree is still chained through it."""
    c = Canary(impl, 32)
    _seeded(c)
    pos = [10 + d for d in DEPTHS]
    exp_tok = list(TOKENS)
    exp_tok[5] = 99
    loc = [20, -1, 22, 23, 24, 25, 32]
    rows = tree_write(
        c,
        hand_write_plan(impl, [7], [1]),
        TOKENS,
        pos,
        loc,
        TREE,
        4,
        input_assert=True,
        exp_tok=exp_tok,
        exp_pos=pos,
    )
    assert [(r[1], r[4], r[7]) for r in rows] == [(25, 99, BIT_WRITE_TOKEN)]
    assert c.record(23)[0] == 43  # below the skipped slot of node 1


def test_real_kv_fingerprints_every_written_slot(impl):
    """With real-data fingerprints, an ``ALL`` launch fingerprints every slot of the launch
    (as the linear write does), and ``CHAIN`` stores 0 in the nodes it writes."""
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, 256, (32, 32), dtype=torch.uint8, generator=g).to(impl.device)
    src = RealKvSource(tensor=t, page_size=1, num_bytes_per_token=32, read_bytes=32)
    c = Canary(impl, 32, sources=(src,), mode=RealKvHashMode.PARTIAL)
    _seeded(c)
    pos = [10 + d for d in DEPTHS]
    tree_write(c, hand_write_plan(impl, [7], [1]), TOKENS, pos, list(range(20, 27)), TREE, 4)
    assert all(c.record(s)[3] != 0 for s in range(20, 27))


def test_chain_writes_of_several_buffers_equal_one_launch_each(device):
    """``launch_canary_chain_writes`` with a tree: each buffer chained from its own seed
    record, byte for byte what one tree launch per buffer writes."""
    from canary_testlib import make_context
    from sglang.jit_kernel.kv_canary import launch_canary_write_kernel

    def contexts():
        first = make_context(32, device=device, ring_capacity=16)
        ctxs = [first] + [
            VerifyOrWriteContext(
                canary_buf=torch.zeros_like(first.canary_buf),
                kernel_kind=tag,
                violation_ring=first.violation_ring,
                violation_write_index=first.violation_write_index,
                slot_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
                kernel_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
                enable_chain_position_assert=first.enable_chain_position_assert,
            )
            for tag in list(CanaryLaunchTag)[1:3]
        ]
        for k, ctx in enumerate(ctxs):  # each buffer's own seed record
            ctx.canary_words[1] = torch.tensor([5 + k, 9, 0x70 + k, 0])
        return ctxs

    plan = hand_write_plan(type("I", (), {"device": device})(), [7, 2], [1, -1]).wp
    args = dict(
        input_ids=tensor_of(TOKENS + [1, 2], torch.int64, device),
        positions=tensor_of([10 + d for d in DEPTHS] + [0, 1], torch.int64, device),
        out_cache_loc=tensor_of(list(range(20, 29)), torch.int64, device),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    tree = WriteTree(parent=tensor_of(TREE + [SEED, 0], torch.int64, device), max_depth=4)
    one = contexts()
    for ctx in one:
        launch_canary_write_kernel(
            context=ctx, plan=plan, parts=WriteParts.CHAIN, tree=tree, **args
        )
    together = contexts()
    launch_canary_chain_writes(contexts=together, plan=plan, tree=tree, **args)
    for a, b in zip(one, together):
        assert a.canary_words.tolist() == b.canary_words.tolist()
        assert int(a.slot_run_counter[0]) == int(b.slot_run_counter[0]) == 9
    assert len({tuple(c.canary_words[26].tolist()) for c in together}) == 3  # own seeds


def _random_tree(rng, n, max_depth):
    """sglang-shaped: node 0 the root, each later node under an earlier one within the depth
    bound; a few orphans."""
    parent, depth = [SEED], [1]
    for j in range(1, n):
        p = rng.choice([q for q in range(j) if depth[q] < max_depth])
        parent.append(ORPHAN if rng.random() < 0.08 else p)
        depth.append(depth[p] + 1)
    return parent, depth


@pytest.mark.parametrize("seed", range(6))
def test_fuzz_against_the_oracle(impl, seed):
    """Seeded random batches: several requests (chain heads, padding rows, a seed at slot 0),
    random trees with orphans, now and then a bad link, a wrong position or a slot out of
    range, with and without the input assert and the chain-position check."""
    rng = random.Random(seed)
    num_slots = 96
    c = Canary(impl, num_slots, chain_assert=rng.choice([0, 1]), ring_capacity=rng.choice([4, 64]))
    free = list(range(1, num_slots))
    rng.shuffle(free)
    lengths, seeds, ids, pos, loc, parent = [], [], [], [], [], []
    max_depth = rng.randint(2, 5)
    for r in range(rng.randint(1, 5)):
        n = rng.randint(0, 9)
        seed_slot = rng.choice([-1, 0, free.pop()])
        if seed_slot > 0:
            c.set_record(
                seed_slot, [rng.randrange(1000), rng.randrange(50), rng.getrandbits(63), 0]
            )
        base = c.oracle.recs[seed_slot][1] + 1 if seed_slot > 0 else 0
        tree, depth = _random_tree(rng, n, max_depth)
        for j in range(n):
            if rng.random() < 0.05:
                tree[j] = rng.choice([j, j + 1, -5])
            ids.append(rng.randrange(1000))
            pos.append(base + depth[j] - 1 + (1 if rng.random() < 0.05 else 0))
            loc.append(free.pop() if rng.random() > 0.05 else rng.choice([-1, num_slots]))
        lengths.append(n)
        seeds.append(seed_slot)
        parent.extend(tree)
    input_assert = rng.random() < 0.5
    exp_tok = [t if rng.random() > 0.1 else t + 1 for t in ids]
    tree_write(
        c,
        hand_write_plan(impl, lengths, seeds, rows=list(range(len(seeds)))),
        ids,
        pos,
        loc,
        parent,
        max_depth,
        input_assert=input_assert,
        exp_tok=exp_tok if input_assert else None,
        exp_pos=pos if input_assert else None,
    )


def test_a_tree_that_does_not_fit_or_is_not_a_tree_is_refused(device):
    """Bad arguments name the argument: a ``tree`` that is not a ``WriteTree``, a parent table
    shorter than the launch, a depth bound below 1, a parent table that is not int64."""
    from canary_testlib import make_context
    from sglang.jit_kernel.kv_canary import launch_canary_write_kernel

    ctx = make_context(16, device=device)
    plan = hand_write_plan(type("I", (), {"device": device})(), [3], [-1]).wp
    args = dict(
        context=ctx,
        plan=plan,
        input_ids=tensor_of([1, 2, 3], torch.int64, device),
        positions=tensor_of([0, 1, 1], torch.int64, device),
        out_cache_loc=tensor_of([4, 5, 6], torch.int64, device),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    with pytest.raises(TypeError, match="tree must be a WriteTree"):
        launch_canary_write_kernel(tree=tensor_of([SEED, 0, 0], torch.int64, device), **args)
    short = WriteTree(parent=tensor_of([SEED, 0], torch.int64, device), max_depth=2)
    with pytest.raises(ValueError, match="tree.parent holds 2 entries, fewer than the launch's 3"):
        launch_canary_write_kernel(tree=short, **args)
    with pytest.raises(ValueError, match="WriteTree.max_depth must be >= 1"):
        WriteTree(parent=tensor_of([SEED], torch.int64, device), max_depth=0)
    with pytest.raises(TypeError, match="WriteTree.parent must have dtype int64"):
        WriteTree(parent=tensor_of([SEED], torch.int32, device), max_depth=1)


@pytest.mark.parametrize("name", ["triton", "torch_ref"])
def test_the_parent_table_comes_from_sglangs_lists(device, name):
    """``retrieve_next_token`` / ``retrieve_next_sibling`` (``[bs, n]``, local indices) → each
    node's parent in the write's entry order (``b * n + i``): the root the seed's, an orphan
    (in no list) ``TREE_PARENT_ORPHAN``; the entries past ``bs * n`` untouched."""
    from sglang.jit_kernel.kv_canary.tree_parents import (
        launch_tree_parents_kernel,
        tree_parents_torch_reference,
    )

    launch = launch_tree_parents_kernel if name == "triton" else tree_parents_torch_reference
    dev = device if name == "triton" else torch.device("cpu")
    rng = random.Random(5)
    bs, n = 3, 9
    want, rows = [], []
    for b in range(bs):
        parents, _depth = _random_tree(rng, n, 4)
        if b == 0:
            parents[1] = ORPHAN
        want += parents
        rows.append(parents)
    tree = WriteTree.allocate(capacity=bs * n + 4, max_depth=4, device=dev)
    tree.parent.fill_(123)
    # an orphan's subtree stays linked below it, as sglang links it
    first, sibling = sglang_tree_lists(rows)
    launch(next_token=first.to(dev), next_sibling=sibling.to(dev), tree=tree)
    assert tree.parent.tolist() == want + [123] * 4
    assert ORPHAN in want
    assert _parents_back(TREE) == TREE


def _parents_back(parents):
    """``parents`` through the lists and back (the reference), for a hand check."""
    from sglang.jit_kernel.kv_canary.tree_parents import tree_parents_torch_reference

    n = len(parents)
    first, sibling = sglang_tree_lists([parents])
    tree = WriteTree.allocate(capacity=n, max_depth=n, device="cpu")
    tree_parents_torch_reference(next_token=first, next_sibling=sibling, tree=tree)
    return tree.parent.tolist()


def test_the_parent_table_refuses_lists_that_do_not_fit(device):
    """The lists must be int64 ``[bs, n]`` of one shape, the table hold ``bs * n``."""
    from sglang.jit_kernel.kv_canary.tree_parents import launch_tree_parents_kernel

    lists = torch.full((2, 4), -1, dtype=torch.int64, device=device)
    small = WriteTree.allocate(capacity=7, max_depth=2, device=device)
    with pytest.raises(ValueError, match="tree.parent holds 7 entries, fewer than the 2 x 4"):
        launch_tree_parents_kernel(next_token=lists, next_sibling=lists, tree=small)
    tree = WriteTree.allocate(capacity=8, max_depth=2, device=device)
    with pytest.raises(ValueError, match="retrieve_next_sibling"):
        launch_tree_parents_kernel(next_token=lists, next_sibling=lists[:1], tree=tree)
    with pytest.raises(TypeError, match="retrieve_next_token must have dtype int64"):
        launch_tree_parents_kernel(next_token=lists.int(), next_sibling=lists, tree=tree)


# =============================================================================================
# Plan lanes: a draft round's rows of a tree (PlanLanes)
# =============================================================================================


def _lane_batch(k_lanes, steps, step, prefixes, rows):
    """A draft round's forward ``step`` over requests of committed lengths ``prefixes`` in
    ``req_to_token`` rows ``rows``, ``k_lanes`` lanes each (sglang's page-1 layout: lane k's
    step j at column L + k * steps + j): the batch rows, prefix lengths and lanes."""
    rpi, prefix, vfrom, split, shift = [], [], [], [], []
    for length, row in zip(prefixes, rows):
        for k in range(k_lanes):
            rpi.append(row)
            prefix.append(length + step)
            vfrom.append(0 if k == 0 else length)
            split.append(length)
            shift.append(k * steps)
    return rpi, prefix, (vfrom, split, shift)


@pytest.mark.parametrize("step", [0, 1, 2])
def test_lane_rows_verify_their_own_steps_and_the_prefix_once(impl, step):
    """Draft forward ``step`` of topk 2, 3 steps: lane 0 verifies the prefix and its own
    steps, lane 1 only its own steps (from its columns), each chained from its previous step's
    slot and seeded from its last step's (or the prefix's last) slot."""
    r2t = r2t_table(4, 24)
    r2t[1][:5] = [11, 12, 13, 14, 15]
    r2t[1][5:11] = [20, 21, 22, 30, 31, 32]  # lane 0 steps 0..2, lane 1 steps 0..2
    rpi, prefix, lanes = _lane_batch(2, 3, step, [5], [1])
    p = run_plan(impl, rpi=rpi, prefix=prefix, ext=[1, 1], r2t=r2t, lanes=lanes)
    lane0 = [11, 12, 13, 14, 15] + [20, 21, 22][:step]
    lane1 = [30, 31, 32][:step]
    assert [e[0] for e in p.exp.entries] == lane0 + lane1
    assert p.exp.seeds[:2] == [lane0[-1], (lane1 or [15])[-1]]
    if step:
        assert p.exp.entries[len(lane0)][3] == 15  # lane 1's first step follows the prefix


def test_zero_lanes_plan_as_without_lanes(impl):
    """``verify_from`` 0 and ``branch_shift`` 0 on every row: the plan of no lanes."""
    rng = random.Random(2)
    r2t = r2t_table(6, 40)
    for r in range(1, 6):
        r2t[r] = [rng.randrange(1, 500) for _ in range(40)]
    rpi, prefix, ext = [1, 3, 0, 5], [7, 40, 3, 0], [1, 2, 1, 4]
    without = run_plan(impl, rpi=rpi, prefix=prefix, ext=ext, r2t=r2t)
    zero = run_plan(
        impl, rpi=rpi, prefix=prefix, ext=ext, r2t=r2t, lanes=([0] * 4, [9] * 4, [0] * 4)
    )
    assert zero.exp.entries == without.exp.entries and zero.exp.seeds == without.exp.seeds
    for a, b in ((zero.vp, without.vp), (zero.wp, without.wp)):
        for f in dataclasses.fields(a):
            assert torch.equal(getattr(a, f.name), getattr(b, f.name)), f.name


@pytest.mark.parametrize("seed", range(4))
def test_lanes_fuzz_against_the_oracle(impl, seed):
    """Random draft rounds (topk 2-4, 1-4 steps, a few requests and a padding row), expected
    tokens on, against the oracle's plan."""
    rng = random.Random(seed)
    k_lanes, steps = rng.randint(2, 4), rng.randint(1, 4)
    cols = 48
    r2t = [[rng.randrange(1, 900) for _ in range(cols)] for _ in range(6)]
    lengths = [rng.randint(0, 20) for _ in range(rng.randint(1, 3))]
    rows = rng.sample(range(1, 6), len(lengths))
    rpi, prefix, lanes = _lane_batch(k_lanes, steps, rng.randrange(steps), lengths, rows)
    rpi.append(0)  # a padding row
    prefix.append(3)
    lanes = tuple(v + [0] for v in lanes)
    exp_pool = [[rng.randrange(50_000) for _ in range(cols)] for _ in range(6)]
    run_plan(
        impl,
        rpi=rpi,
        prefix=prefix,
        ext=[1] * len(rpi),
        r2t=r2t,
        lanes=lanes,
        verify_capacity=256,
        write_req_capacity=16,
        exp_pool=exp_pool,
        valid_lens=[rng.randint(0, cols) for _ in rpi],
        offset=1,
    )


def test_lanes_that_do_not_cover_the_batch_are_refused(device):
    """A ``PlanLanes`` of fewer rows than the batch names both."""
    from sglang.jit_kernel.kv_canary import PlanLanes, VerifyPlan, WritePlan
    from sglang.jit_kernel.kv_canary import launch_canary_plan_kernels

    rows = tensor_of([1, 2], torch.int64, device)
    with pytest.raises(ValueError, match="lanes hold 1 rows, fewer than the batch's 2"):
        launch_canary_plan_kernels(
            verify_plan_out=VerifyPlan.allocate(verify_capacity=8, device=device),
            write_plan_out=WritePlan.allocate(write_req_capacity=2, device=device),
            req_pool_indices=rows,
            prefix_lens=rows,
            extend_seq_lens=rows,
            req_to_token=torch.zeros(3, 8, dtype=torch.int32, device=device),
            swa_window_size=0,
            full_to_swa_index_mapping=None,
            verify_capacity=8,
            req_to_verify_expected_tokens=None,
            req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0,
            lanes=PlanLanes.allocate(capacity=1, device=device),
        )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
