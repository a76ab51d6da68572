"""The token oracle with speculative decoding (docs/speculative_coverage.md, "The token oracle
with speculative decoding"), on sglang 0.5.12's own verify code on the CPU: spec v1
``EagleVerifyInput.verify`` (EAGLE / EAGLE3 / NEXTN / STANDALONE; FROZEN_KV_MTP's verify calls
it), spec v2 ``EagleVerifyInputV2Mixin.sample``, NGRAM's ``NgramVerifyInput.verify`` and
DFLASH's ``DFlashVerifyInput.verify`` (its acceptance rule, torch, sglang's own), chains and
trees, each wrapped with the plugin's hooks the way sglang's ``HookRegistry`` applies them.

sglang's greedy tree walk is sgl-kernel's CUDA op (``verify_tree_greedy``): on the CPU
sglang's ``verify_tree_greedy_func`` does nothing and ngram_info binds no walk at all. The
tests put :func:`greedy_walk_stand_in` (the op's documented walk, in torch) at the module
attribute each verify looks the walk up by, under the plugin's hook, as the hook sits on the
real op on a GPU. Everything else is sglang's: ``Req``, ``ScheduleBatch``,
``SamplingBatchInfo``, ``ReqToTokenPool``, ``TokenToKVPoolAllocator``, the verify inputs, their
Triton kernels (interpreted; the canary's own kernels are the torch references but in the
test marked ``triton_interpreter``). The write-input check's expectations for the speculative
forwards, and the start-up routes, follow.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from plugin_hooks_support import registered_hook
from sglang.srt.kv_canary import plugin
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.batch_state import batch_state_for
from sglang.srt.kv_canary.expected_inputs import ExpectedInputs
from sglang.srt.kv_canary.token_oracle import OracleBatch, oracle_tokens, request_oracle_key
from sglang.srt.kv_canary.token_oracle.expected_tokens import TokenOracleManager
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
from sglang.srt.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative import dflash_info, dflash_utils, eagle_info, eagle_info_v2, ngram_info
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.eagle_info import EagleVerifyInput
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.test.ci.ci_register import register_cpu_ci

from eagle_driver import tiny_mha_pool
from kernel_oracle import sglang_tree_lists

register_cpu_ci(est_time=35, suite="stage-a-test-cpu")

# the canary's kernels as the torch references but in the tests marked triton_interpreter
pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")

VOCAB = 97


@pytest.fixture(autouse=True)
def global_server_args():
    """sglang's global server args (``Req`` and the verifies read them); restored after."""
    import sglang.srt.server_args as sa

    saved = sa._global_server_args
    sa.set_global_server_args_for_scheduler(sa.ServerArgs(model_path="dummy", device="cpu"))
    yield
    sa._global_server_args = saved


def oracle(rid: str, position: int) -> int:
    key = torch.tensor([request_oracle_key(rid)])
    return int(oracle_tokens(key, torch.tensor([position]), VOCAB))


# ---- the greedy walk as sgl-kernel's op runs it ---------------------------------------------


def greedy_walk_stand_in(
    *,
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    target_predict,
    retrieve_index=None,
    retrieve_next_token=None,
    retrieve_next_sibling=None,
    retrive_index=None,
    retrive_next_token=None,
    retrive_next_sibling=None,
    topk=-1,
):
    """sgl-kernel's ``verify_tree_greedy`` on the CPU (both keyword spellings: sglang's
    ``verify_tree_greedy_func`` and the op itself): per request, from the root, the first
    child (``retrieve_next_token``, then ``retrieve_next_sibling``) whose candidate equals the
    target's prediction at the last accepted node is accepted, up to ``accept_index``'s width;
    ``predicts`` at each accepted node gets the target's prediction there (the bonus at the
    last). Returns ``(predicts, accept_index, accept_token_num)`` like sglang's function."""
    index = retrieve_index if retrieve_index is not None else retrive_index
    first = retrieve_next_token if retrieve_next_token is not None else retrive_next_token
    sibling = retrieve_next_sibling if retrieve_next_sibling is not None else retrive_next_sibling
    flat_target = target_predict.reshape(-1)
    for b in range(candidates.shape[0]):
        last = int(index[b, 0])
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, accept_index.shape[1]):
            child = int(first[b, node])
            while child != -1 and int(candidates[b, child]) != int(flat_target[last]):
                child = int(sibling[b, child])
            if child == -1:
                break
            predicts[last] = flat_target[last]
            accepted += 1
            last = int(index[b, child])
            accept_index[b, accepted] = last
            node = child
        accept_token_num[b] = accepted
        predicts[last] = flat_target[last]
    return predicts, accept_index, accept_token_num


def with_plugin_hooks(monkeypatch, *, skip_walk_hook: bool = False):
    """Every verify and greedy walk the plugin hooks, wrapped as sglang applies the hooks, the
    walk's CPU stand-in underneath; ``skip_walk_hook``: the walks left unhooked (the planted
    defect: the verifies still force the greedy walk and must notice)."""
    monkeypatch.setattr(seam, "ngram_greedy_walk_bound", lambda: True)
    got = []
    monkeypatch.setattr(seam, "register_hook", lambda t, hook, kind: got.append((t, hook, kind)))
    plugin.register()
    hooks = {t: (hook, HookType[kind]) for t, hook, kind in got}
    for target, owner, name in (
        (seam.HOOK_EAGLE_V1_VERIFY, EagleVerifyInput, "verify"),
        (seam.HOOK_EAGLE_V2_VERIFY_SAMPLE, eagle_info_v2.EagleVerifyInputV2Mixin, "sample"),
        (seam.HOOK_NGRAM_VERIFY, NgramVerifyInput, "verify"),
        (seam.HOOK_DFLASH_VERIFY, DFlashVerifyInput, "verify"),
    ):
        if target in hooks:  # each registered hook as sglang applies it, on sglang's own
            # method (unwrapped: sglang's load_plugins may have hooked it in this process)
            hook, kind = hooks[target]
            sglang_own = inspect.unwrap(getattr(owner, name))
            monkeypatch.setattr(owner, name, _wrap_fn(sglang_own, hook, kind))
    for target, module, name in (
        (seam.HOOK_EAGLE_V1_GREEDY_WALK, eagle_info, "verify_tree_greedy_func"),
        (seam.HOOK_EAGLE_V2_GREEDY_WALK, eagle_info_v2, "verify_tree_greedy_func"),
        (seam.HOOK_NGRAM_GREEDY_WALK, ngram_info, "verify_tree_greedy"),
    ):
        walk = greedy_walk_stand_in
        if target in hooks and not skip_walk_hook:
            walk = _wrap_fn(greedy_walk_stand_in, *hooks[target])
        monkeypatch.setattr(module, name, walk, raising=False)
    # DFLASH's acceptance rule is torch: sglang's own function, under the hook (unwrapped: a
    # HookRegistry applied in this process propagates its patch to dflash_utils too)
    dflash_walk = inspect.unwrap(dflash_utils.compute_dflash_correct_drafts_and_bonus)
    if not skip_walk_hook:
        dflash_walk = _wrap_fn(dflash_walk, *hooks[seam.HOOK_DFLASH_GREEDY_WALK])
    monkeypatch.setattr(dflash_info, "compute_dflash_correct_drafts_and_bonus", dflash_walk)


# ---- a verify round on real sglang objects ---------------------------------------------------


class Round:
    """Requests at committed length ``L`` each (prompt + earlier outputs, all the oracle's),
    their trees (``parents``: per request each node's parent, -1 the root), a real
    ``ScheduleBatch`` over real pools with the verify's slots assigned, and logits whose
    argmax is never the oracle's token."""

    def __init__(self, parents, *, lengths=(7, 11), greedy=(True, False), seed=0):
        self.bs, self.n = len(parents), len(parents[0])
        gen = torch.Generator().manual_seed(seed)
        self.reqs = []
        for i, (L, g) in enumerate(zip(lengths, greedy)):
            rid = f"oracle-spec-{seed}-{i}"
            prompt = [int(t) for t in torch.randint(0, VOCAB, (L - 2,), generator=gen)]
            params = SamplingParams(
                max_new_tokens=64,
                temperature=0.0 if g else 0.8,
                top_k=1 if g else 20,
                ignore_eos=True,
            )
            params.normalize(None)
            req = Req(rid, "", prompt, params, vocab_size=VOCAB)
            req.output_ids = [oracle(rid, L - 2), oracle(rid, L - 1)]
            self.reqs.append(req)
        self.lengths = list(lengths)
        self.parents = parents
        self.depth = [[self._depth(p, i) for i in range(self.n)] for p in parents]
        self.r2t = ReqToTokenPool(
            size=4, max_context_len=64, device="cpu", enable_memory_saver=False
        )
        self.allocator = TokenToKVPoolAllocator(
            128, torch.bfloat16, "cpu", tiny_mha_pool(128), need_sort=False
        )
        self.batch = ScheduleBatch.init_new(
            self.reqs,
            self.r2t,
            self.allocator,
            None,
            types.SimpleNamespace(think_end_id=None, vocab_size=VOCAB),
            False,
            SpeculativeAlgorithm.EAGLE,
        )
        batch = self.batch
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.req_pool_indices = torch.tensor([1, 2], dtype=torch.int64)
        batch.seq_lens = torch.tensor(lengths, dtype=torch.int64)
        batch.seq_lens_cpu = batch.seq_lens.clone()
        for req, row in zip(self.reqs, (1, 2)):
            req.req_pool_idx = row
        batch.sampling_info = self._sampling_info()
        batch.out_cache_loc = self.allocator.alloc(self.bs * self.n)
        for b, (row, L) in enumerate(zip((1, 2), lengths)):
            self.r2t.req_to_token[row, L : L + self.n] = batch.out_cache_loc[
                b * self.n : (b + 1) * self.n
            ].to(torch.int32)
        # the target's logits: argmax one above the oracle's token at every node
        self.logits = torch.zeros(self.bs * self.n, VOCAB)
        for b in range(self.bs):
            for i in range(self.n):
                tok = (self.oracle_at(b, self.position(b, i) + 1) + 1) % VOCAB
                self.logits[b * self.n + i, tok] = 5.0

    @staticmethod
    def _depth(parents, i):
        d = 0
        while parents[i] != -1:
            i, d = parents[i], d + 1
        return d

    def rid(self, b):
        return self.reqs[b].rid

    def oracle_at(self, b, position):
        return oracle(self.rid(b), position)

    def position(self, b, i):
        return self.lengths[b] + self.depth[b][i]

    def _sampling_info(self):
        reqs = self.reqs
        info = SamplingBatchInfo(
            temperatures=torch.tensor([[r.sampling_params.temperature] for r in reqs]),
            top_ps=torch.tensor([r.sampling_params.top_p for r in reqs]),
            top_ks=torch.tensor([r.sampling_params.top_k for r in reqs], dtype=torch.int32),
            min_ps=torch.tensor([r.sampling_params.min_p for r in reqs]),
            is_all_greedy=all(r.sampling_params.top_k <= 1 for r in reqs),
            need_top_p_sampling=False,
            need_top_k_sampling=True,
            need_min_p_sampling=False,
            vocab_size=VOCAB,
            device="cpu",
        )
        info.penalizer_orchestrator = BatchedPenalizerOrchestrator(VOCAB, self.batch, set())
        return info

    def attach_oracle(self):
        """What the target runner's ``ForwardBatch.init_new`` hook attaches (oracle on)."""
        keys = torch.tensor([request_oracle_key(r.rid) for r in self.reqs])
        fb = types.SimpleNamespace(sampling_info=self.batch.sampling_info)
        seam.set_sampling_oracle(fb, OracleBatch(keys=keys, vocab_size=VOCAB))

    def tree_tensors(self, drafts):
        """``drafts[b][i]``: node i's token (node 0: the last committed one)."""
        first, sibling = sglang_tree_lists(self.parents)
        positions = torch.tensor(
            [self.position(b, i) for b in range(self.bs) for i in range(self.n)]
        )
        index = torch.arange(self.bs * self.n).reshape(self.bs, self.n)
        return torch.tensor(drafts).reshape(-1), positions, index, first, sibling

    def expected_path(self, drafts):
        """The root path the oracle's predictions accept, and the committed tokens."""
        out = []
        for b in range(self.bs):
            node, tokens = 0, []
            while True:
                want = self.oracle_at(b, self.position(b, node) + 1)
                tokens.append(want)
                kids = [c for c, p in enumerate(self.parents[b]) if p == node]
                nxt = next((c for c in kids if drafts[b][c] == want), None)
                if nxt is None:
                    break
                node = nxt
            out.append(tokens)
        return out

    def drafts(self, right):
        """Node tokens: node 0 the last committed token; node i the oracle's token of its
        position when ``right[b][i]``, else one off."""
        out = []
        for b in range(self.bs):
            row = [self.oracle_at(b, self.lengths[b])]
            for i in range(1, self.n):
                tok = self.oracle_at(b, self.position(b, i))
                row.append(tok if right[b][i] else (tok + 2) % VOCAB)
            out.append(row)
        return out


CHAIN = [[-1, 0, 1, 2], [-1, 0, 1, 2]]
TREE = [[-1, 0, 0, 1, 2, 3], [-1, 0, 0, 1, 1, 4]]
# drafts right along part of the path: the chain accepts 2 then 1 drafts; the tree accepts
# the root's second child then its child (request 0) and the first child's second child
# (request 1)
CHAIN_RIGHT = [[0, 1, 1, 0], [0, 1, 0, 1]]
TREE_RIGHT = [[0, 0, 1, 0, 1, 0], [0, 1, 0, 0, 1, 1]]


def _eagle_verify_input(rnd: Round, drafts, topk):
    tokens, positions, index, first, sibling = rnd.tree_tensors(drafts)
    steps = max(max(d) for d in rnd.depth)
    spec = EagleVerifyInput(
        draft_token=tokens,
        custom_mask=torch.ones(1, dtype=torch.bool),
        positions=positions,
        retrieve_index=index,
        retrieve_next_token=first,
        retrieve_next_sibling=sibling,
        retrieve_cum_len=None,
        spec_steps=steps,
        topk=topk,
        draft_token_num=rnd.n,
        capture_hidden_mode=None,
        seq_lens_sum=sum(rnd.lengths),
        seq_lens_cpu=rnd.batch.seq_lens_cpu,
    )
    spec.hidden_states = None  # what EAGLEWorker.verify sets: the target's (none here)
    return spec


def _logits(rnd: Round):
    return types.SimpleNamespace(next_token_logits=rnd.logits.clone(), hidden_states=None)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_spec_v1_verify_commits_the_oracles_tokens(monkeypatch, shape):
    """``EagleVerifyInput.verify`` (spec v1) with the oracle on: every committed token (the
    requests' outputs, the accepted tokens, the draft extend's inputs) is the oracle's, along
    the path the oracle's predictions accept, for a greedy and a sampling request alike."""
    parents, right, topk = (CHAIN, CHAIN_RIGHT, 1) if shape == "chain" else (TREE, TREE_RIGHT, 2)
    with_plugin_hooks(monkeypatch)
    rnd = Round(parents, seed=1 if shape == "chain" else 2)
    rnd.attach_oracle()
    drafts = rnd.drafts(right)
    spec = _eagle_verify_input(rnd, drafts, topk)
    rnd.batch.spec_info = spec
    before = [len(r.output_ids) for r in rnd.reqs]
    out = spec.verify(rnd.batch, _logits(rnd), rnd.allocator, 1)
    want = rnd.expected_path(drafts)
    assert [len(w) for w in want] == ([3, 2] if shape == "chain" else [3, 4])
    assert [r.output_ids[n:] for r, n in zip(rnd.reqs, before)] == want
    assert out.accept_tokens.tolist() == [t for w in want for t in w]
    assert out.draft_extend_input.input_ids.tolist() == [t for w in want for t in w]
    assert rnd.batch.sampling_info.is_all_greedy is False  # restored after the verify


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_spec_v1_verify_without_the_oracle_commits_the_targets_argmax(monkeypatch, shape):
    """The hooks pass through with the oracle off: the argmax of the logits is committed."""
    parents, right, topk = (CHAIN, CHAIN_RIGHT, 1) if shape == "chain" else (TREE, TREE_RIGHT, 2)
    with_plugin_hooks(monkeypatch)
    rnd = Round(parents, greedy=(True, True), seed=3)
    drafts = rnd.drafts(right)
    spec = _eagle_verify_input(rnd, drafts, topk)
    rnd.batch.spec_info = spec
    out = spec.verify(rnd.batch, _logits(rnd), rnd.allocator, 1)
    argmax = [
        (rnd.oracle_at(b, rnd.position(b, 0) + 1) + 1) % VOCAB for b in range(rnd.bs)
    ]  # no draft matches an argmax one off the oracle: the root's prediction only
    assert out.accept_tokens.tolist() == argmax


def _dflash_verify(rnd: Round, drafts, *, hooked_walk=True):
    """sglang's ``DFlashVerifyInput.verify`` of ``rnd``'s chains (a block of ``rnd.n`` tokens
    per request: the bonus, then the draft's), as ``DFlashWorker`` calls it (keywords)."""
    tokens, positions, _, _, _ = rnd.tree_tensors(drafts)
    spec = DFlashVerifyInput(draft_token=tokens, positions=positions, draft_token_num=rnd.n)
    rnd.batch.spec_info = spec
    rnd.batch.seq_lens_sum = sum(rnd.lengths)  # the scheduler's, kept in sync by the verify
    logits = _logits(rnd)
    logits.hidden_states = torch.zeros(rnd.bs * rnd.n, 8)  # the target's, for the next append
    return spec.verify(batch=rnd.batch, logits_output=logits, page_size=1)


def test_dflash_verify_commits_the_oracles_tokens(monkeypatch):
    """``DFlashVerifyInput.verify`` with the oracle on: the committed tokens (the requests'
    outputs, the new bonus tokens, the commit lengths) are the oracle's, along the chain the
    oracle's predictions accept, for a greedy and a sampling request alike; without the
    oracle the target's argmax is committed."""
    with_plugin_hooks(monkeypatch)
    rnd = Round(CHAIN, seed=4)
    rnd.attach_oracle()
    drafts = rnd.drafts(CHAIN_RIGHT)
    before = [len(r.output_ids) for r in rnd.reqs]
    bonus, commit_lens, hidden, correct = _dflash_verify(rnd, drafts)
    want = rnd.expected_path(drafts)
    assert [len(w) for w in want] == [3, 2]
    assert [r.output_ids[n:] for r, n in zip(rnd.reqs, before)] == want
    assert bonus.tolist() == [w[-1] for w in want] and commit_lens.tolist() == [3, 2]
    assert correct == [2, 1] and hidden.shape[0] == 5
    assert rnd.batch.sampling_info.is_all_greedy is False  # restored after the verify
    # the oracle off: the hooks pass through, the argmax (one off the oracle) is committed
    off = Round(CHAIN, greedy=(True, True), seed=5)
    bonus, commit_lens, _, _ = _dflash_verify(off, off.drafts(CHAIN_RIGHT))
    argmax = [(off.oracle_at(b, off.position(b, 0) + 1) + 1) % VOCAB for b in range(off.bs)]
    assert bonus.tolist() == argmax and commit_lens.tolist() == [1, 1]


def test_a_dflash_verify_whose_walk_the_oracle_did_not_reach_is_refused(monkeypatch):
    """The planted defect: DFLASH's acceptance rule left unhooked; the verify hook notices
    its committed tokens would not be the oracle's."""
    with_plugin_hooks(monkeypatch, skip_walk_hook=True)
    rnd = Round(CHAIN, seed=6)
    rnd.attach_oracle()
    with pytest.raises(RuntimeError, match="did not run sglang's greedy tree walk"):
        _dflash_verify(rnd, rnd.drafts(CHAIN_RIGHT))


def test_spec_v2_sample_commits_the_oracles_tokens_and_forces_the_greedy_walk(monkeypatch):
    """``EagleVerifyInputV2Mixin.sample`` (spec v2, topk 1): the returned predictions at the
    accepted nodes are the oracle's, with a sampling request in the batch (without the forced
    greedy walk sglang would take its sampling kernel, absent on the CPU)."""
    with_plugin_hooks(monkeypatch)
    rnd = Round(CHAIN, seed=4)
    rnd.attach_oracle()
    drafts = rnd.drafts(CHAIN_RIGHT)
    spec = _eagle_verify_input(rnd, drafts, 1)
    mwb = types.SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY,
        seq_lens=rnd.batch.seq_lens,
        sampling_info=rnd.batch.sampling_info,
        input_ids=spec.draft_token,
    )
    predict, accept_lens, accept_index = spec.sample(mwb, _logits(rnd))
    want = rnd.expected_path(drafts)
    assert accept_lens.tolist() == [len(w) for w in want]
    got = [predict[accept_index[b, : len(w)].long()].tolist() for b, w in enumerate(want)]
    assert got == want
    assert mwb.sampling_info.is_all_greedy is False


def test_ngram_verify_commits_the_oracles_tokens(monkeypatch):
    """NGRAM's ``NgramVerifyInput.verify`` (its own call of sgl-kernel's op, hooked where
    sglang binds it): the requests' outputs are the oracle's along the accepted path."""
    with_plugin_hooks(monkeypatch)
    parents = [[-1, 0, 0, 2, 0, 0], [-1, 0, 1, 2, 0, 0]]  # padding nodes under the root
    rnd = Round(parents, seed=5)
    rnd.attach_oracle()
    drafts = rnd.drafts([[0, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0]])
    tokens, positions, index, first, sibling = rnd.tree_tensors(drafts)
    spec = NgramVerifyInput(
        draft_token=tokens,
        tree_mask=torch.ones(1, dtype=torch.bool),
        positions=positions,
        retrieve_index=index,
        retrieve_next_token=first,
        retrieve_next_sibling=sibling,
        draft_token_num=rnd.n,
    )
    rnd.batch.spec_info = spec
    before = [len(r.output_ids) for r in rnd.reqs]
    spec.verify(rnd.batch, _logits(rnd), 1)
    want = rnd.expected_path(drafts)
    assert [len(w) for w in want] == [3, 3]
    assert [r.output_ids[n:] for r, n in zip(rnd.reqs, before)] == want


def test_a_verify_whose_walk_the_oracle_did_not_reach_is_refused(monkeypatch):
    """The planted defect: the greedy walk left unhooked. The verify still commits the
    target's argmax, and the verify hook refuses it."""
    with_plugin_hooks(monkeypatch, skip_walk_hook=True)
    rnd = Round(TREE, seed=6)
    rnd.attach_oracle()
    spec = _eagle_verify_input(rnd, rnd.drafts(TREE_RIGHT), 2)
    rnd.batch.spec_info = spec
    with pytest.raises(RuntimeError, match="did not run sglang's greedy tree walk"):
        spec.verify(rnd.batch, _logits(rnd), rnd.allocator, 1)


def test_hooks_applied_twice_feed_the_walk_once(monkeypatch):
    """Each verify and walk hooked twice (as a process that applied sglang's hooks and then
    wraps them again would have them): the walk still takes the oracle's predictions once."""
    with_plugin_hooks(monkeypatch)
    hook, kind = registered_hook(monkeypatch, seam.HOOK_EAGLE_V1_VERIFY)
    monkeypatch.setattr(
        EagleVerifyInput, "verify", _wrap_fn(EagleVerifyInput.verify, hook, HookType[kind])
    )
    walk_hook, walk_kind = registered_hook(monkeypatch, seam.HOOK_EAGLE_V1_GREEDY_WALK)
    twice = _wrap_fn(eagle_info.verify_tree_greedy_func, walk_hook, HookType[walk_kind])
    monkeypatch.setattr(eagle_info, "verify_tree_greedy_func", twice)
    rnd = Round(TREE, seed=8)
    rnd.attach_oracle()
    drafts = rnd.drafts(TREE_RIGHT)
    spec = _eagle_verify_input(rnd, drafts, 2)
    rnd.batch.spec_info = spec
    out = spec.verify(rnd.batch, _logits(rnd), rnd.allocator, 1)
    assert out.accept_tokens.tolist() == [t for w in rnd.expected_path(drafts) for t in w]


def test_the_next_token_swap_swaps_two_requests_root_predictions(monkeypatch):
    """The next-token-swap self-test under speculative decoding: the two requests' first
    committed tokens trade places (the write-input check then reports them)."""
    with_plugin_hooks(monkeypatch)
    rnd = Round(CHAIN, seed=7)
    keys = torch.tensor([request_oracle_key(r.rid) for r in rnd.reqs])

    def swap(tokens):
        tokens[0], tokens[1] = int(tokens[1]), int(tokens[0])

    seam.set_sampling_oracle(
        types.SimpleNamespace(sampling_info=rnd.batch.sampling_info),
        OracleBatch(keys=keys, vocab_size=VOCAB, after_sample=swap),
    )
    drafts = rnd.drafts([[0, 0, 0, 0], [0, 0, 0, 0]])
    spec = _eagle_verify_input(rnd, drafts, 1)
    rnd.batch.spec_info = spec
    out = spec.verify(rnd.batch, _logits(rnd), rnd.allocator, 1)
    roots = [rnd.oracle_at(b, rnd.lengths[b] + 1) for b in range(2)]
    assert out.accept_tokens.tolist() == roots[::-1]


def test_the_plugin_hooks_every_verify_and_walk(monkeypatch):
    """The registered targets: the four verifies and the walks as eagle_info / eagle_info_v2 /
    dflash_info look them up; NGRAM's only where sglang binds sgl-kernel's op."""
    for target in (
        seam.HOOK_EAGLE_V1_VERIFY,
        seam.HOOK_EAGLE_V2_VERIFY_SAMPLE,
        seam.HOOK_NGRAM_VERIFY,
        seam.HOOK_DFLASH_VERIFY,
        seam.HOOK_EAGLE_V1_GREEDY_WALK,
        seam.HOOK_EAGLE_V2_GREEDY_WALK,
        seam.HOOK_DFLASH_GREEDY_WALK,
    ):
        assert registered_hook(monkeypatch, target)[1] == "AROUND"
    assert callable(dflash_info.compute_dflash_correct_drafts_and_bonus)
    assert callable(eagle_info.verify_tree_greedy_func)
    assert callable(eagle_info_v2.verify_tree_greedy_func)
    monkeypatch.setattr(seam, "ngram_greedy_walk_bound", lambda: False)
    got = []
    monkeypatch.setattr(seam, "register_hook", lambda t, hook, kind: got.append(t))
    plugin.register()
    assert seam.HOOK_NGRAM_GREEDY_WALK not in got


# ---- the write-input check's expectations for speculative forwards ---------------------------


def _forward(mode, reqs, seq_lens, extend, *, input_ids, positions, spec_info=None):
    n = len(input_ids)
    fb = types.SimpleNamespace(
        forward_mode=mode,
        req_pool_indices=torch.arange(1, len(reqs) + 1),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
        extend_seq_lens=torch.tensor(extend),
        extend_seq_lens_cpu=list(extend),
        extend_prefix_lens=None,
        extend_prefix_lens_cpu=None,
        out_cache_loc=torch.arange(10, 10 + n),
        input_ids=torch.tensor(input_ids),
        positions=torch.tensor(positions),
        spec_info=spec_info,
        sampling_info=types.SimpleNamespace(),
    )
    return fb


def _reqs():
    return [
        types.SimpleNamespace(rid="w0", origin_input_ids=[5, 6, 7]),
        types.SimpleNamespace(rid="w1", origin_input_ids=[8, 9]),
    ]


def _fill(mgr, fb, reqs):
    mgr.attach_batch(fb, batch_state_for(fb), reqs)
    exp = ExpectedInputs(write_entry_capacity=16, device="cpu")
    mgr.fill_expected_inputs(fb, exp)
    n = fb.out_cache_loc.shape[0]
    return exp.tokens[:n].tolist(), exp.positions[:n].tolist()


def test_a_target_verify_expects_the_oracle_at_each_root_and_its_own_proposals():
    """TARGET_VERIFY: each tree's root (the last committed token, at the committed length) is
    the oracle's; the other nodes are proposals and expect the forward's own inputs."""
    reqs = _reqs()
    mgr = TokenOracleManager(vocab_size=VOCAB, device="cpu")
    spec = types.SimpleNamespace(draft_token_num=3)
    ids = [1, 2, 3, 4, 5, 6]
    pos = [5, 6, 6, 4, 5, 6]  # request 0: a root and two siblings at depth 1
    fb = _forward(
        ForwardMode.TARGET_VERIFY,
        reqs,
        [5, 4],
        [3, 3],
        input_ids=ids,
        positions=pos,
        spec_info=spec,
    )
    tokens, positions = _fill(mgr, fb, reqs)
    assert tokens == [oracle("w0", 5), 2, 3, oracle("w1", 4), 5, 6]
    assert positions == pos
    sampled = seam.sampling_oracle(fb.sampling_info)
    assert sampled.keys.tolist() == [request_oracle_key("w0"), request_oracle_key("w1")]


def test_a_draft_pool_expects_the_next_token_and_skips_its_proposals():
    """A draft runner's manager (token offset 1): its prefill chunk's entry at p expects the
    token of p + 1 (the prompt's, then the sampled one: the oracle's), the draft extend after
    a verify the accepted tokens (the oracle's of p + 1), spec v2's draft extend only up to each
    request's accepted count; a draft round's forwards (proposals) expect their own inputs;
    the draft attaches nothing to ``sampling_info``."""
    reqs = _reqs()
    mgr = TokenOracleManager(vocab_size=VOCAB, device="cpu", draft=True, token_offset=1)
    fb = _forward(
        ForwardMode.EXTEND, reqs, [3, 2], [3, 2], input_ids=[0] * 5, positions=[0, 1, 2, 0, 1]
    )
    fb.extend_prefix_lens_cpu = [0, 0]
    tokens, positions = _fill(mgr, fb, reqs)
    assert tokens == [6, 7, oracle("w0", 3), 9, oracle("w1", 2)]
    assert positions == [0, 1, 2, 0, 1]
    assert seam.sampling_oracle(fb.sampling_info) is None

    fb = _forward(
        ForwardMode.DRAFT_EXTEND, reqs, [6, 4], [2, 1], input_ids=[0] * 3, positions=[4, 5, 3]
    )
    tokens, positions = _fill(mgr, fb, reqs)
    assert tokens == [oracle("w0", 5), oracle("w0", 6), oracle("w1", 4)]
    assert positions == [4, 5, 3]

    spec = types.SimpleNamespace(num_accept_tokens=torch.tensor([2, 1], dtype=torch.int32))
    ids = [41, 42, 43, 44, 45, 46]
    fb = _forward(
        ForwardMode.DRAFT_EXTEND_V2,
        reqs,
        [7, 5],
        [3, 3],
        input_ids=ids,
        positions=[4, 5, 6, 2, 3, 4],
        spec_info=spec,
    )
    tokens, positions = _fill(mgr, fb, reqs)
    assert tokens == [oracle("w0", 5), oracle("w0", 6), 43, oracle("w1", 3), 45, 46]
    assert positions == [4, 5, 6, 2, 3, 4]

    fb = _forward(ForwardMode.DECODE, reqs, [7, 5], [1, 1], input_ids=[71, 72], positions=[7, 5])
    tokens, positions = _fill(mgr, fb, reqs)
    assert (tokens, positions) == ([71, 72], [7, 5])
    assert mgr.writes_proposals(fb)


# ---- start-up ---------------------------------------------------------------------------------


def _spec_args(**kw):
    base = dict(
        kv_canary="raise",
        kv_canary_sweep_interval=0,
        kv_canary_real_data="none",
        device="cpu",
        sampling_backend="token_oracle",
        speculative_algorithm="EAGLE",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize(
    "algorithm,topk",
    [
        ("EAGLE", 1),
        ("EAGLE", 2),
        ("EAGLE3", 1),
        ("STANDALONE", 2),
        ("NGRAM", 4),
        ("FROZEN_KV_MTP", 1),
        ("DFLASH", 1),
    ],
)
def test_the_oracle_with_a_covered_algorithm_is_accepted(monkeypatch, algorithm, topk):
    from sglang.srt.kv_canary import startup_checks

    for name in [n for n in __import__("os").environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT", "1")
    config = startup_checks.check_server_args_for_canary(
        _spec_args(speculative_algorithm=algorithm, speculative_eagle_topk=topk)
    )
    assert config.enable_token_oracle and config.enable_write_input_assert


def test_the_oracle_refuses_simulated_acceptance_and_a_draft_only_swap(monkeypatch):
    from sglang.srt.kv_canary import startup_checks

    for name in [n for n in __import__("os").environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(seam, "simulated_acceptance_length", lambda: 2.5)
    with pytest.raises(ValueError, match="SGLANG_SIMULATE_ACC_LEN=2.5"):
        startup_checks.check_server_args_for_canary(_spec_args())
    monkeypatch.setattr(seam, "simulated_acceptance_length", lambda: 0.0)
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_NEXT_TOKEN_SWAP_PROB", "0.5")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_WORKER", "draft")
    with pytest.raises(ValueError, match="TARGET_WORKER=draft injects on the draft"):
        startup_checks.check_server_args_for_canary(_spec_args())
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_WORKER", "target")
    startup_checks.check_server_args_for_canary(_spec_args())


# ---- the write-input check on whole speculative workloads -----------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(v2=False),
        dict(v2=True),
        pytest.param(dict(steps=1), marks=pytest.mark.triton_interpreter),
    ],
    ids=["spec_v1", "spec_v2", "one_step"],
)
def test_speculative_rounds_pass_the_write_input_check(kw):
    """EAGLE rounds (chunked prefill, verifies, draft rounds, draft extends; both pools) whose
    committed tokens are the oracle's pass the write-input check in every forward."""
    from eagle_driver import EagleDriver

    d = EagleDriver(seed=21, token_oracle=True, **{"steps": 3, **kw})
    d.run(40)
    assert d.target.count_violations() == 0 and d.draft.count_violations() == 0
    assert d.rounds >= 10 and d.accepted >= 5 and d.chunked >= 2
    assert d.target.token_oracle is not None and d.draft.token_oracle.draft


@pytest.mark.parametrize("kind", ["tree", "ngram"])
def test_tree_and_ngram_rounds_pass_the_write_input_check(kind):
    """Draft trees (topk 2: lane-planned draft rounds, tree verifies) and NGRAM's verify trees
    (no draft pool), the continuation the oracle's: every forward passes the check."""
    from eagle_tree_driver import EagleTreeDriver
    from ngram_driver import NgramDriver

    if kind == "tree":
        d = EagleTreeDriver(seed=3, token_oracle=True, topk=2, steps=3, num_draft=6)
    else:
        d = NgramDriver(seed=4, token_oracle=True)
    d.run(30)
    assert d.target.count_violations() == 0
    assert d.draft is None or d.draft.count_violations() == 0
    assert d.rounds >= 10 and d.accepted >= 10


def test_a_verify_root_that_is_not_the_oracles_is_a_write_token_violation():
    """A committed token that is not the oracle's (a verify whose bonus went to another
    request): the next verify writes it at its root and the target's write-input check
    reports ``write_token`` there; the draft pool's check reports the draft extend's."""
    from eagle_driver import EagleDriver
    from sglang.srt.kv_canary.violations.lines import parse_violation_lines

    d = EagleDriver(seed=22, token_oracle=True, steps=3, mode="raise")
    d.run(12)
    victim = next(r for r in d.running if len(r.output) >= 1)
    truth = d.truth
    wrong = {"rid": victim.rid, "position": victim.kv_len}

    def planted(req, position):  # the victim's next committed token is off by one
        tok = truth(req, position)
        if req.rid == wrong["rid"] and position == wrong["position"] + 1:
            return (tok + 1) % 1000
        return tok

    d.truth = planted
    with pytest.raises(RuntimeError, match="kv_canary detected") as exc:
        d.run(20)
    reasons = {r for v in parse_violation_lines(str(exc.value)) for r in v.fail_reasons}
    assert "write_token" in reasons, reasons


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
