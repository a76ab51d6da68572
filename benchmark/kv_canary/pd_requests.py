"""The prompts of ``pd_one_gpu.py`` (docs/user_guide.md, "Deployments"): pairwise different
first tokens, and each one's control with every token but the last replaced. One ``/generate``
with its body and one request the way a PD router sends it are the package's
(:mod:`sglang.srt.kv_canary.demo.pd_pair`, re-exported here)."""

from __future__ import annotations

import random

from sglang.srt.kv_canary.demo.pd_pair import body_for, generate, pd_request

__all__ = ["body_for", "generate", "make_prompts", "pd_request", "perturbed"]


# ---- prompts ------------------------------------------------------------------------------------


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids in [3, vocab), pairwise different first tokens."""
    rng = random.Random(seed)
    firsts = rng.sample(range(3, vocab), n)
    return [[f] + [rng.randrange(3, vocab) for _ in range(length - 1)] for f in firsts]


def perturbed(prompt: list[int], vocab: int, rng: random.Random, taken: set) -> list[int]:
    """``prompt`` with every token but the last replaced (first token unused so far)."""
    first = rng.choice([t for t in range(3, vocab) if t not in taken])
    taken.add(first)
    return [first] + [rng.randrange(3, vocab) for _ in range(len(prompt) - 2)] + [prompt[-1]]
