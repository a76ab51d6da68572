"""NGRAM speculative decoding (``--speculative-algorithm NGRAM``, page size 1) over real sglang
0.5.12 pools and ForwardBatch objects (test support; docs/speculative_standalone_ngram.md,
"2. NGRAM (n-gram lookup, no draft model)").

:class:`NgramDriver` is :class:`~eagle_tree_driver.EagleTreeDriver` without a draft model:
one canary, the target's, built as ``install_canary`` builds it for NGRAM
(``RankFacts.verify_tree_depth`` = ``--speculative-num-draft-tokens`` n), a prefill of target
``EXTEND`` chunks, then rounds of one target ``TARGET_VERIFY`` each:

1. per request a tree of n nodes as sglang's n-gram corpus returns it (``result.cpp``'s
   ``fillResult``): node 0 the last sampled token at the committed length L, then the matched
   trie's nodes in BFS order (a node's parent has a smaller index, siblings are contiguous, at
   most ``breadth`` children per node: ``--speculative-ngram-max-bfs-breadth``), then padding
   nodes of token 0 under node 0 up to n; node i at position ``L + depth(i)`` and
   ``req_to_token`` column ``L + i``; the lists ``reconstruct_indices_from_tree_mask`` builds
   (first child, next sibling, in index order) in a real ``NgramVerifyInput``;
2. acceptance as sglang's ``verify_tree_greedy`` walks the lists, the path re-pointed into
   ``req_to_token[L .. L + acc]``, every other node freed at once (``_free_cache``, page 1);
   no draft extend follows.

``seq_lens`` is int32 in even rounds (sglang's graph runner's static buffer) and int64 in odd
ones. The ``plant_*`` faults of :class:`EagleTreeDriver` that concern the verify apply.
"""

from __future__ import annotations

from typing import List

import torch

from eagle_tree_driver import EagleTreeDriver
from kernel_oracle import sglang_tree_lists
from serving_driver import DriverReq


class NgramDriver(EagleTreeDriver):
    def __init__(self, *, num_draft: int = 6, breadth: int = 3, **kwargs):
        if num_draft < 2:
            raise ValueError("NgramDriver needs num_draft >= 2 (a root and one node)")
        if breadth < 1:
            raise ValueError("NgramDriver needs breadth >= 1")
        for name in ("topk", "steps", "v2", "draft_model", "verify_tree_depth"):
            if name in kwargs:
                raise ValueError(f"NgramDriver sets {name} itself (NGRAM has no draft model)")
        # steps: the deepest path's draft tokens (a chain of n - 1 matched nodes); topk 2
        # only satisfies EagleTreeDriver (no lanes: no draft runner)
        super().__init__(
            topk=2,
            steps=num_draft - 1,
            num_draft=num_draft,
            orphan_prob=0.0,
            draft_model=False,
            verify_tree_depth=num_draft,
            **kwargs,
        )
        self.num_draft = num_draft  # EagleTreeDriver caps it at an EAGLE tree's bound
        self.breadth = breadth
        self.branch_accepted = 0  # accepted paths through a node that is not a first child

    def decode_round(self, reqs: List[DriverReq]) -> None:
        base = [r.kv_len for r in reqs]
        trees = [self._ngram_tree(r, L) for r, L in zip(reqs, base)]
        self.verify_trees(reqs, base, trees)
        for tree in trees:
            path = tree["path"]
            firsts = {min(c for c, p in enumerate(tree["parent"]) if p == q) for q in path[:-1]}
            self.branch_accepted += any(i not in firsts for i in path[1:])
        self.rounds += 1

    def _ngram_tree(self, req: DriverReq, L: int) -> dict:
        """A tree of ``num_draft`` nodes in the corpus's layout (module docstring): a random
        match of 0 .. n - 1 nodes grown level by level, each node's children guessed (right
        with ``accept_prob``), then padding; ``matched``: the first padding node's index."""
        n = self.num_draft
        parent, depth, tokens = [-1], [0], [req.tokens[L]]
        matched = 1 + self.rng.randint(0, n - 1)
        frontier = [0]
        while frontier and len(parent) < matched:
            level = []
            for p in frontier:
                for _ in range(self.rng.randint(1, self.breadth)):
                    if len(parent) >= matched:
                        break
                    parent.append(p)
                    depth.append(depth[p] + 1)
                    tokens.append(self._guess(req, L + depth[-1]))
                    level.append(len(parent) - 1)
            frontier = level
        matched = len(parent)
        while len(parent) < n:  # padding: token 0 under the root
            parent.append(0)
            depth.append(1)
            tokens.append(0)
        return dict(parent=parent, depth=depth, tokens=tokens, matched=matched)

    def tree_verify_input(self, ids, pos, seq, trees):
        """The verify's ``spec_info``: a real ``NgramVerifyInput`` (its tree mask unused by
        the canary: ones of the FULL_MASK layout's size)."""
        from sglang.srt.speculative.ngram_info import NgramVerifyInput

        n = self.num_draft
        first, sibling = sglang_tree_lists([tree["parent"] for tree in trees])
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return NgramVerifyInput(
            draft_token=i64(ids),
            tree_mask=torch.ones(sum(n * (L + n) for L in seq), dtype=torch.bool),
            positions=i64(pos),
            retrieve_index=i64(list(range(len(ids)))).view(len(trees), n),
            retrieve_next_token=first,
            retrieve_next_sibling=sibling,
            draft_token_num=n,
        )
