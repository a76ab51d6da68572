"""Which worker a model runner is: its rank in each parallel dimension, whether it is a
speculative draft model's runner (and what that makes of its canary: the draft pool's position offset, one
single-forward manager per forward of a draft round) and which server of a PD pair it serves.
Built once per runner by the api from sglang's ``ModelRunner``; read by the builder, the runner
(reports name the rank on a server of several) and the self-test's rank targets (docs/user_guide.md, "Self-tests: fault injection, the token oracle,
the demo"). Plain values."""

from __future__ import annotations

import dataclasses

PD_ROLES = ("null", "prefill", "decode")  # sglang 0.5.12's --disaggregation-mode choices
# draft workers whose pool's position p holds the KV of token p itself (token offset 0)
SAME_POSITION_DRAFT_WORKERS = ("DFLASH",)


@dataclasses.dataclass(frozen=True)
class RankFacts:
    """Which rank of each parallel dimension a model runner is (0 when the dimension is not
    used), and the sizes; what the rank targets are matched and checked against."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    draft: bool = False  # a speculative draft model's runner (shares the target's ranks)
    # a draft runner: sglang's --speculative-num-steps (a draft round runs steps - 1 forwards)
    draft_steps: int = 0
    # a draft runner's name in reports: EAGLE (EAGLE, EAGLE3, NEXTN), STANDALONE or DFLASH
    draft_worker: str = "EAGLE"
    # sglang's --disaggregation-mode: "null" (no PD), or which server of a PD pair
    disaggregation_mode: str = "null"
    # --speculative-eagle-topk K > 1 (draft trees; docs/speculative_trees.md): a draft runner's
    # forwards of a round carry K lanes per request; a target runner's verify writes a tree
    # whose paths hold at most verify_tree_depth entries (--speculative-num-steps + 1; NGRAM:
    # --speculative-num-draft-tokens, its verify is always a tree); 1 / 0 without trees
    draft_topk: int = 1
    verify_tree_depth: int = 0
    # a draft runner with draft_topk > 1: sglang's --page-size, which lays out its lanes'
    # req_to_token columns (whole pages per lane from the prefix's last page boundary); 1
    # otherwise
    draft_page_size: int = 1

    def __post_init__(self):
        if isinstance(self.draft_steps, bool) or not isinstance(self.draft_steps, int):
            raise TypeError(f"RankFacts.draft_steps must be an int, got {self.draft_steps!r}")
        if self.draft_steps < 0 or (self.draft_steps and not self.draft):
            raise ValueError(
                "RankFacts.draft_steps is an EAGLE draft runner's --speculative-num-steps "
                f"(>= 0, and 0 unless draft=True), got {self.draft_steps} with draft={self.draft}"
            )
        for name, low in (("draft_topk", 1), ("verify_tree_depth", 0), ("draft_page_size", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"RankFacts.{name} must be an int >= {low}, got {v!r}")
        if self.draft_topk > 1 and not self.draft:
            raise ValueError(
                f"RankFacts.draft_topk is a draft runner's lanes per request, got "
                f"{self.draft_topk} with draft=False"
            )
        if self.draft_page_size > 1 and self.draft_topk == 1:
            raise ValueError(
                "RankFacts.draft_page_size lays out a draft runner's lanes (draft_topk > 1), "
                f"got {self.draft_page_size} with draft_topk=1"
            )
        if self.verify_tree_depth and self.draft:
            raise ValueError(
                "RankFacts.verify_tree_depth is a target runner's (draft=False), got "
                f"{self.verify_tree_depth} with draft=True"
            )
        if self.disaggregation_mode not in PD_ROLES:
            raise ValueError(
                f"RankFacts.disaggregation_mode must be one of {', '.join(PD_ROLES)}, "
                f"got {self.disaggregation_mode!r}"
            )

    @property
    def draft_forwards_per_round(self) -> int:
        """Forwards of one EAGLE draft round (``draft_steps - 1``); 0 off a draft runner."""
        return max(0, self.draft_steps - 1) if self.draft else 0

    @property
    def single_forward_managers(self) -> int:
        """The canary's single-forward managers: one per forward of a draft round, else one."""
        return max(1, self.draft_forwards_per_round)

    @staticmethod
    def tree_fields(*, topk: int, verify_tree_depth: int, draft: bool, page_size: int = 1) -> dict:
        """``draft_topk`` / ``verify_tree_depth`` / ``draft_page_size`` of a runner of a
        server with ``--speculative-eagle-topk`` ``topk`` and ``--page-size`` ``page_size``
        whose target verifies trees of paths of at most ``verify_tree_depth`` tokens (0:
        chains; ``SpeculativeFacts.verify_tree_depth``): what :func:`install_canary` and the
        memory reservation both build."""
        lanes = topk > 1 and draft
        return dict(
            draft_topk=topk if lanes else 1,
            verify_tree_depth=0 if draft else verify_tree_depth,
            draft_page_size=page_size if lanes else 1,
        )

    @property
    def plan_rows_per_request(self) -> int:
        """Plan rows one request takes in a forward: a draft runner's lanes (topk), else 1."""
        return self.draft_topk

    @property
    def kv_token_id_vs_position_offset(self) -> int:
        """1 for an EAGLE or STANDALONE draft pool (its position p holds the KV computed from
        token p + 1); 0 for DFLASH's draft pool (position p holds the KV projected from the
        target's hidden state of token p: docs/speculative_multilayer_adaptive_dflash_mtp.md,
        "3.3 Record semantics") and for a target pool."""
        return 1 if self.draft and self.draft_worker not in SAME_POSITION_DRAFT_WORKERS else 0

    @property
    def forwards_write_records(self) -> bool:
        """Whether this runner's model forwards write records of the slots they write: not on
        DFLASH's draft runner, whose only forwards are draft blocks on borrowed slots no later
        forward reads (its records come from the appends: docs/speculative_multilayer_adaptive_dflash_mtp.md,
        "3.3 Record semantics"); its block forwards verify the prefix they read."""
        return not (self.draft and self.draft_worker in SAME_POSITION_DRAFT_WORKERS)

    @property
    def block_prefix_from_positions(self) -> bool:
        """Whether this runner's ``TARGET_VERIFY`` forwards are DFLASH draft blocks, whose
        ``seq_lens`` is the draft's resident length (the compact window ``W'`` with
        ``--speculative-draft-window-size``), not the committed length ``L``: their verified
        prefix is each row's first position, ``L`` (docs/speculative_multilayer_adaptive_dflash_mtp.md,
        "3.4 Changes to the canary")."""
        return self.draft and self.draft_worker in SAME_POSITION_DRAFT_WORKERS

    @property
    def server_role(self) -> str:
        """``PD prefill server`` / ``PD decode server``; ``""`` without PD."""
        return "" if self.disaggregation_mode == "null" else f"PD {self.disaggregation_mode} server"

    def rank(self, dim: str) -> int:
        return getattr(self, f"{dim}_rank")

    def size(self, dim: str) -> int:
        return getattr(self, f"{dim}_size")

    def describe(self) -> str:
        return self.describe_rank() + (f", {self.draft_worker} draft worker" if self.draft else "")

    @property
    def several(self) -> bool:
        """More than one scheduler rank (TP, PP or DP): reports must say which one."""
        return self.tp_size * self.pp_size * self.dp_size > 1

    def describe_rank(self) -> str:
        """``tp_rank T, pp_rank P, dp_rank D`` (the rank alone, draft or not)."""
        return f"tp_rank {self.tp_rank}, pp_rank {self.pp_rank}, dp_rank {self.dp_rank}"
