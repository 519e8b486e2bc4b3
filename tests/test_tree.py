"""Draft trees on the hybrid target (tree.py): every node's logits and GDN state equal its root-to-node path run
alone as a chain; a committed path leaves the caches as a chain of its tokens would; a tree of one chain is the
block verify; and TreeEngine's greedy output is AR's for random targets and trees, every accepted depth forced."""
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import engine
import model as M
import tree as TR
from helpers import HAS_EMBEDDED_PAIR, random_target, tiny_target_config
from test_spec_equals_ar import first_divergence_is_near_tie

MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=20)


def random_tree(rng: random.Random, size: int, vocab: int, root: int) -> TR.Tree:
    """`size` nodes after the root, each under a random earlier node, random tokens."""
    parents = [-1] + [rng.randrange(i) for i in range(1, size + 1)]
    return TR.Tree([root] + [rng.randrange(vocab) for _ in range(size)], parents)


def clone(cache: M.TargetCache) -> M.TargetCache:
    out = object.__new__(M.TargetCache)
    out.capacity, out.masks = cache.capacity, cache.masks
    out.layers = [type(lc)(*(t.clone() for t in vars(lc).values())) for lc in cache.layers]
    return out


def prefilled(target, prompt: list, capacity: int = 96, max_block: int = 40) -> M.TargetCache:
    cache = M.TargetCache(target.cfg, capacity, torch.float64, "cpu", max_block=max_block)
    with torch.inference_mode():
        target(torch.tensor([prompt]), torch.arange(len(prompt)), cache)
    return cache


def chain(target, cache, tokens: list, start: int, verify: bool):
    with torch.inference_mode():
        return target(torch.tensor([tokens]), start + torch.arange(len(tokens)), cache, verify=verify)[0][0]


def test_tree_structure_and_refusals():
    t = TR.Tree([7, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 3, 2])
    assert t.depth == [0, 1, 1, 2, 3, 2] and t.path(4) == [0, 1, 3, 4]
    rows = t.conv_rows(4, "cpu")             # K = 4: 3 committed rows (0..2), then node j at row 3 + j
    assert rows[0].tolist() == [0, 1, 2, 3] and rows[1].tolist() == [1, 2, 3, 4]
    assert rows[4].tolist() == [3, 4, 6, 7] and rows[5].tolist() == [2, 3, 5, 8]
    assert t.ancestors("cpu")[4].tolist() == [True, True, False, True, True, False]
    for tokens, parents in (([1, 2], [-1, 1]), ([1, 2], [0, 0]), ([1], [-1, 0]), ([], [])):
        with pytest.raises(M.GenerationError, match="draft tree"):
            TR.Tree(tokens, parents)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), moe=st.booleans(), size=st.integers(1, 32), plen=st.integers(1, 30))
def test_every_node_equals_its_path_run_alone(seed, moe, size, plen):
    """float64: node i's logits == the last logits of its path verified as a chain; node i's GDN state and conv
    window == those of the path run alone; committing any node's path == decoding the path's tokens."""
    rng = random.Random(seed)
    target = random_target(tiny_target_config(**(MOE if moe else {})), seed % 1000)
    V = target.cfg.vocab_size
    prompt = [rng.randrange(V) for _ in range(plen)]
    cache = prefilled(target, prompt)
    t = random_tree(rng, size, V, rng.randrange(V))
    logits, kept, _ = TR.verify_tree(target, t, plen, clone(cache))
    for i in range(len(t)):
        path = t.path(i)
        toks = [t.tokens[j] for j in path]
        alone = clone(cache)
        torch.testing.assert_close(logits[i], chain(target, alone, toks, plen, verify=True)[-1], rtol=0, atol=1e-10)
        ran = clone(cache)
        chain(target, ran, toks, plen, verify=False)          # the path decoded: every token committed
        for lc, st_, window in zip(ran.layers, kept.states, kept.windows):
            if isinstance(lc, M.GDNCache):
                torch.testing.assert_close(st_[i], lc.rec[0], rtol=0, atol=1e-12)
                rows = t.conv_rows(lc.conv.shape[1] + 1, "cpu")[i, 1:]
                torch.testing.assert_close(window[rows], lc.conv[0], rtol=0, atol=1e-12)
    # commit one node's path: the caches equal the chain's, attention slots included
    i = rng.randrange(len(t))
    path = t.path(i)
    work = clone(cache)
    logits, kept, _ = TR.verify_tree(target, t, plen, work)
    TR.commit_path(work, kept, path, plen)
    ref = clone(cache)
    chain(target, ref, [t.tokens[j] for j in path], plen, verify=False)
    end = plen + len(path)
    for a, b in zip(work.layers, ref.layers):
        if isinstance(a, M.GDNCache):
            torch.testing.assert_close(a.rec, b.rec, rtol=0, atol=1e-12)
            torch.testing.assert_close(a.conv, b.conv, rtol=0, atol=1e-12)
        else:
            torch.testing.assert_close(a.k[:, :, :end], b.k[:, :, :end], rtol=0, atol=1e-12)
            torch.testing.assert_close(a.v[:, :, :end], b.v[:, :, :end], rtol=0, atol=1e-12)


def test_a_chain_tree_is_the_block_verify():
    target = random_target(tiny_target_config(), 3)
    rng = random.Random(3)
    prompt = [rng.randrange(61) for _ in range(20)]
    cache = prefilled(target, prompt)
    toks = [rng.randrange(61) for _ in range(16)]
    logits, _, _ = TR.verify_tree(target, TR.Tree(toks, [-1] + list(range(15))), 20, clone(cache))
    torch.testing.assert_close(logits, chain(target, clone(cache), toks, 20, verify=True), rtol=0, atol=1e-10)


class OracleTree:
    """Stand-in tree proposer (tree.TreeEngine's one slot): knows the AR continuation; each round builds a random tree
    in which the true continuation runs down one branch to a planned depth (cycling through every depth
    0..deepest), its next node a wrong token, the other nodes random."""

    feature_layers = ()
    wants_next_ids, samples_drafts, window = False, False, None

    def __init__(self, continuation: list, vocab: int, seed: int, size: int):
        self.cont, self.V, self.rng, self.size = continuation, vocab, random.Random(seed), size
        self.max_block_size, self.plan, self.depths, self.T0 = size + 1, [], [], None

    def reset(self, slots, capacity, masks):
        self.plan = []

    def admit(self, row, feats, pos, prompt_ids, first):
        self.T0 = len(prompt_ids)

    def append(self, feats, pos, next_ids):
        pass

    def propose_tree(self, last: int, start: int, n: int, feats=None, feat_pos=None, next_ids=None) -> tuple:
        n = self.rng.randint(1, n)
        if not self.plan:
            self.plan = list(range(n + 1))
            self.rng.shuffle(self.plan)
        depth = min(self.plan.pop(), n)
        i = start - self.T0 + 1                          # index in the continuation of the token after `last`
        true = (self.cont[i:i + depth] + [self.rng.randrange(self.V) for _ in range(depth)])[:depth]
        # the true branch (each node under the previous one) interleaved with other nodes, in node order: the
        # branch's nodes are not the first indices, so its commit moves attention slots
        kinds = ["true"] * depth + ["other"] * (n - depth)
        self.rng.shuffle(kinds)
        tokens, parents, node, branch = [], [], 0, []
        for kind in kinds:
            if kind == "true":
                tokens.append(true[len(branch)]), parents.append(node)
                node = len(tokens)
                branch.append(node)
                continue
            p = self.rng.randrange(len(tokens) + 1)      # anywhere, but never a true token under a branch node
            tok = self.rng.randrange(self.V)
            if p in [0] + branch:
                d = ([0] + branch).index(p)              # the true token under p is the continuation's i + d
                if i + d < len(self.cont) and tok == self.cont[i + d]:
                    tok = (tok + 1) % self.V
            tokens.append(tok), parents.append(p)
        self.depths.append(depth)
        return tokens, parents


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), moe=st.booleans(), size=st.integers(1, 32), plen=st.integers(1, 40),
       new=st.integers(1, 40), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_tree_rounds_equal_ar(seed, moe, size, plen, new, dtype):
    """TreeEngine's greedy output == plain AR decoding, whatever the trees and the accepted depths: exactly in
    float64; in float32 any parting must be at a near-tie of the target (as the chain's test judges it)."""
    rng = random.Random(seed)
    target = random_target(tiny_target_config(**(MOE if moe else {})), seed % 1000, dtype)
    V = target.cfg.vocab_size
    prompt = [rng.randrange(V) for _ in range(plen)]
    ar = engine.run(target, prompt, new).output_ids
    prop = OracleTree(ar + [0] * 64, V, seed, size)        # (ar[0] is the token at position plen)
    eng = TR.TreeEngine(target, prop, size, plen + new + size + 1)
    res = eng.generate(prompt, new)
    if dtype == torch.float32 and res.output_ids != ar:
        assert first_divergence_is_near_tie(target, prompt, ar, res.output_ids, 1e-4)
        return
    assert res.output_ids == ar
    steps = [s for s in res.steps if s.kind == "verify"]
    assert [s.accepted for s in steps] == [min(d, len(s.tokens) - 1) if not s.stop else s.accepted
                                           for d, s in zip(prop.depths, steps)]


def test_tree_engine_refuses_sampling_and_bad_sizes():
    target = random_target(tiny_target_config(), 1)
    prop = OracleTree([1] * 40, 61, 0, 4)
    with pytest.raises(M.GenerationError, match="sampling with a draft tree"):
        TR.TreeEngine(target, prop, 4, 64).generate([1, 2, 3], 8, sampling=engine.Sampling(0.8))
    with pytest.raises(M.GenerationError, match="--tree-size must be >= 1"):
        TR.TreeEngine(target, prop, 0, 64)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10**6), moe=st.booleans(), size=st.integers(1, 40), top_k=st.integers(1, 5),
       plen=st.integers(1, 30))
def test_dflash_tree_rounds_equal_ar(seed, moe, size, top_k, plen):
    """A random DFlash drafter's blocks as trees (DFlashTree), float64: the output is AR's."""
    from helpers import random_drafter, tiny_draft_config
    rng = random.Random(seed)
    cfg = tiny_target_config(**(MOE if moe else {}))
    target = random_target(cfg, seed % 1000)
    drafter = random_drafter(tiny_draft_config(cfg, block_size=8), seed % 997)
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(plen)]
    ar = engine.run(target, prompt, 24).output_ids
    prop = TR.DFlashTree(engine.DrafterProposer(drafter, target), top_k)
    assert TR.TreeEngine(target, prop, size, plen + 24 + size + 1).generate(prompt, 24).output_ids == ar


@torch.inference_mode()
def test_dflash_tree_holds_the_chain():
    """The tree's first branch (each node's first child: its most probable token) is a prefix of the chain's
    greedy block, and with one candidate per row the tree is the chain."""
    from helpers import random_drafter, tiny_draft_config
    cfg = tiny_target_config()
    target, drafter = random_target(cfg, 5), random_drafter(tiny_draft_config(cfg, block_size=8), 6)
    prompt = list(range(3, 20))
    inner = engine.DrafterProposer(drafter, target)
    eng = engine.Engine(target, inner, 8, capacity=64)
    logits, feats = target(torch.tensor([prompt]), torch.arange(len(prompt)), eng.cache, feature_layers=inner.feature_layers)
    last, start = int(logits[0, -1].argmax()), len(prompt)
    inner.reset(1, 64, eng.masks)
    inner.admit(0, feats, torch.arange(len(prompt)), prompt, last)
    pad, pad_pos = feats.new_zeros(1, 8, feats.shape[-1]), start + torch.arange(8)     # pending rows, all stale
    chain = inner.propose(torch.tensor([last]), torch.tensor([start]), pad, pad_pos[None], 7, None).tokens[0].tolist()
    for k, n in ((1, 7), (3, 20)):
        p = TR.DFlashTree(engine.DrafterProposer(drafter, target), k)
        p.reset(1, 64, eng.masks)
        p.admit(0, feats, torch.arange(len(prompt)), prompt, last)
        tokens, parents = p.propose_tree(last, start, n, pad, pad_pos)
        t = TR.Tree([last] + tokens, [-1] + parents)
        branch = [0]
        while any(q == branch[-1] for q in t.parents):
            branch.append(t.parents.index(branch[-1]))
        assert [t.tokens[i] for i in branch[1:]] == chain[:len(branch) - 1] and len(branch) > 1
        assert len(tokens) == n and (k > 1 or (parents == list(range(7)) and tokens == chain))


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_cli_tree_equals_ar_and_refusals(capsys):
    """generate.py --tree-size on the embedded pair: AR's output, the tree size recorded; the tree flags refused in
    one line where a tree round does not apply."""
    import json
    import generate
    base = ["--prompt-ids", "1,2,3,4,5,6,7,8", "--max-new-tokens", "40", "--json", "--threads", "1"]
    outs = {}
    for name, extra in {"tree": ["--tree-size", "20", "--tree-top-k", "3"], "ar": ["--draft", "none"]}.items():
        assert generate.main(base + extra) == 0
        outs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert outs["tree"]["output_ids"] == outs["ar"]["output_ids"] and outs["tree"]["tree_size"] == 20
    assert outs["tree"]["mean_acceptance_length"] > 1 and outs["tree"]["block_size"] == 21
    for extra, words in [(["--tree-size", "4", "--draft", "none"], "--draft none does not go with a draft tree"),
                         (["--tree-size", "4", "--temperature", "0.5"], "--temperature does not go with a draft tree"),
                         (["--tree-size", "4", "--compile"], "--compile does not go with a draft tree"),
                         (["--tree-size", "0"], "--tree-size < 1 does not go"),
                         (["--tree-top-k", "2"], "--tree-top-k applies to --tree-size or an EAGLE-3 drafter")]:
        assert generate.cli(["--prompt-ids", "1,2"] + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0]
