"""Speculative sampling preserves the target distribution; seeds reproduce; stop tokens cut accepted runs."""
import random

import pytest
import torch

import dflash
from dflash import Sampling, sampling_probs, speculative_accept
from helpers import kind_draft_config, random_drafter, random_target, tiny_draft_config, tiny_target_config

CONFIGS = [Sampling(0.5), Sampling(1.0), Sampling(1.5), Sampling(1.0, top_p=0.8), Sampling(1.0, top_k=3)]


def chi2_pvalue(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def two_sample_chi2(a: list, b: list) -> float:
    """p-value of 'a and b are draws from the same categorical distribution' (cells with no counts dropped)."""
    keys = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(k) for k in keys], dtype=torch.float64)
    cb = torch.tensor([b.count(k) for k in keys], dtype=torch.float64)
    tot = ca + cb
    ea, eb = tot * len(a) / (len(a) + len(b)), tot * len(b) / (len(a) + len(b))
    stat = (((ca - ea) ** 2 / ea) + ((cb - eb) ** 2 / eb)).sum().item()
    return chi2_pvalue(stat, len(keys) - 1)


def goodness_of_fit(counts: torch.Tensor, p: torch.Tensor) -> float:
    keep = p > 0
    assert counts[~keep].sum() == 0, "a zero-probability token was emitted"
    e = p[keep] * counts.sum()
    stat = ((counts[keep] - e) ** 2 / e).sum().item()
    return chi2_pvalue(stat, int(keep.sum()) - 1)


def test_sampling_probs_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = sampling_probs(logits, Sampling(1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.allclose(p[:2], torch.softmax(logits[:2], 0))
    full = torch.softmax(logits, 0)
    p = sampling_probs(logits, Sampling(1.0, top_p=0.8))      # 0.665 < 0.8 <= 0.909: the top two... plus the third
    n_kept = int((full.cumsum(0) - full < 0.8).sum())
    assert int((p > 0).sum()) == n_kept and abs(p.sum().item() - 1) < 1e-6
    assert torch.allclose(sampling_probs(logits, Sampling(2.0)), torch.softmax(logits / 2, 0))
    with pytest.raises(dflash.GenerationError):
        Sampling(-1.0)
    with pytest.raises(dflash.GenerationError):
        Sampling(1.0, top_p=0.0)


@pytest.mark.parametrize("case", range(4))
def test_accept_rule_is_exact(case):
    """The one-block rejection rule, 400k vectorised trials: the first committed token ~ p0 exactly, and given
    that the first proposal was accepted, the second ~ p1. This catches a bias far below 2%."""
    g = torch.Generator().manual_seed(case)
    B, V, N = 4, 7, 400_000
    probs = torch.softmax(torch.randn(B, V, generator=g) * 1.5, -1)
    if case == 3:
        probs[0] = torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0])   # zero-probability cells, incl. the proposal
    proposals = torch.tensor([case % V, 2, 5])
    u = torch.rand(N, B - 1, generator=g)
    if case == 3:
        u[:1000, 0] = 0.0                                                  # an exact-zero draw must not accept p = 0
    expo = torch.empty(N, B, V).exponential_(generator=g)
    acc, tok = torch.vmap(speculative_accept, in_dims=(None, None, 0, 0))(probs, proposals, u, expo)
    first = torch.where(acc >= 1, proposals[0], tok[:, 0])
    assert goodness_of_fit(torch.bincount(first, minlength=V).double(), probs[0].double()) > 1e-4
    sel = acc >= 1
    second = torch.where(acc[sel] >= 2, proposals[1], tok[sel, 1])
    if sel.sum() > 1000:
        assert goodness_of_fit(torch.bincount(second, minlength=V).double(), probs[1].double()) > 1e-4
    # power check: the same statistic rejects a 2% bias in p0
    biased = probs[0].clone()
    i, j = int(probs[0].argmax()), int(probs[0].argmin())
    biased[i] -= 0.02
    biased[j] += 0.02
    assert goodness_of_fit(torch.bincount(first, minlength=V).double(), biased.double()) < 1e-6


@pytest.mark.parametrize("case", range(3))
def test_accept_rule_with_a_sampled_draft_is_exact(case):
    """The general rule (proposals drawn from a draft distribution q, accepted with min(1, p/q), residual
    max(p - q, 0)), as DFlash2 samples: 400k trials, each with its own proposals drawn from q; the first committed
    token ~ p0 and, after an acceptance, the second ~ p1. Case 2: q puts mass where p has none, and p == q on
    the second row (nothing is ever rejected there)."""
    g = torch.Generator().manual_seed(10 + case)
    B, V, N = 3, 6, 400_000
    probs = torch.softmax(torch.randn(B, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(B - 1, V, generator=g) * 2.0, -1)
    if case == 2:
        probs[0] = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0])
        q[1] = probs[1]
    proposals = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(B - 1)], 1)   # [N, B-1]
    u = torch.rand(N, B - 1, generator=g)
    expo = torch.empty(N, B, V).exponential_(generator=g)
    acc, tok = torch.vmap(speculative_accept, in_dims=(None, 0, 0, 0, None))(probs, proposals, u, expo, q)
    first = torch.where(acc >= 1, proposals[:, 0], tok[:, 0])
    assert goodness_of_fit(torch.bincount(first, minlength=V).double(), probs[0].double()) > 1e-4
    sel = acc >= 1
    second = torch.where(acc[sel] >= 2, proposals[sel, 1], tok[sel, 1])
    assert goodness_of_fit(torch.bincount(second, minlength=V).double(), probs[1].double()) > 1e-4
    if case == 2:
        assert bool((acc[sel] >= 2).all())                  # p == q: every proposal of that row is accepted
    # power: the rule given the wrong q (uniform, not the one the proposals came from) is biased, and the test
    # sees it. (A one-hot q would not be: accepting with p(x) and resampling p without x is exact for a proposal
    # drawn from anything, only less often accepted.)
    acc1, tok1 = torch.vmap(speculative_accept, in_dims=(None, 0, 0, 0, None))(probs, proposals, u, expo, torch.full_like(q, 1 / V))
    wrong = torch.where(acc1 >= 1, proposals[:, 0], tok1[:, 0])
    assert goodness_of_fit(torch.bincount(wrong, minlength=V).double(), probs[0].double()) < 1e-6


class GreedyTargetProposer:
    """Stand-in drafter that proposes LIKELY tokens: the target's own greedy continuation of the committed
    prefix (full forward, no cache). Under sampling these are accepted often, so accept and reject paths
    both run many times."""
    feature_layers = ()
    max_block_size = 16

    MEMO = {}                                               # (target id, prefix) -> greedy next token

    def __init__(self, target, prompt):
        self.target, self.prompt = target, list(prompt)

    def greedy_next(self, seq):
        key = (id(self.target), tuple(seq))
        if key not in self.MEMO:
            with torch.no_grad():
                logits, _ = self.target(torch.tensor([seq]), torch.arange(len(seq)))
            self.MEMO[key] = int(logits[0, -1].argmax())
        return self.MEMO[key]

    def reset(self, capacity, masks):
        self.seq, self.last_props, self.last_start = list(self.prompt), [], None

    def prefill(self, feats, pos):
        pass

    def propose(self, last, start, feats, feat_pos, n):
        start = int(start)
        if self.last_start is not None:                     # tokens committed since the previous call
            a = start - self.last_start - 1
            self.seq += self.last_props[:a]
        self.seq.append(int(last))
        seq = list(self.seq)
        for _ in range(n):
            seq.append(self.greedy_next(seq))
        self.last_props, self.last_start = seq[-n:], start
        return torch.tensor(seq[-n:])


@pytest.fixture(scope="module")
def small_target():
    return random_target(tiny_target_config(vocab_size=6, num_hidden_layers=2,
                                            layer_types=["linear_attention", "full_attention"]), 11, torch.float32)


@pytest.mark.parametrize("s", CONFIGS, ids=lambda s: f"T{s.temperature}-p{s.top_p}-k{s.top_k}")
def test_dflash_sampling_matches_ar_sampling(s, small_target):
    """Two-sample chi-square on the tokens at each generated position (and on pairs), DFlash vs AR, same
    target, 1500 generations each. This end-to-end check catches a gross error (a temperature ignored, a
    wrong residual); test_accept_rule_is_exact carries the fine-grained (2%) power on the accept rule itself."""
    target = small_target
    prompt = [1, 4, 2, 0, 3]
    n, new = 1500, 4
    g = torch.Generator().manual_seed(0)
    ar_eng = dflash.Engine(target, None, 1, 16)
    sp_eng = dflash.Engine(target, GreedyTargetProposer(target, prompt), 4, 16)
    ar = [ar_eng.run(prompt, new, sampling=s, generator=g).output_ids for _ in range(n)]
    sp_runs = [sp_eng.run(prompt, new, sampling=s, generator=g) for _ in range(n)]
    sp = [r.output_ids for r in sp_runs]
    accepted = [st.accepted for r in sp_runs for st in r.steps if st.kind == "verify"]
    assert 0.2 < sum(1 for a in accepted if a > 0) / len(accepted) < 0.95     # both paths exercised
    for k in range(1, new):
        assert two_sample_chi2([o[k] for o in ar], [o[k] for o in sp]) > 1e-4, f"position {k}"
    assert two_sample_chi2([tuple(o[1:3]) for o in ar], [tuple(o[1:3]) for o in sp]) > 1e-4
    # and the test has teeth: the same statistic separates AR from a 2%-biased copy of it
    biased = [o[1] if random.Random(i).random() > 0.04 else 0 for i, o in enumerate(ar)]
    assert two_sample_chi2([o[1] for o in ar] * 4, biased * 4) < 1e-3


def test_dflash2_sampling_matches_ar_sampling(small_target):
    """A DFlash2 drafter samples its block from q (its candidate selector): the general accept rule keeps the
    target's distribution. The same two-sample test as above, 1500 generations each."""
    target, prompt, n, new = small_target, [1, 4, 2, 0, 3], 1500, 4
    dcfg = kind_draft_config(target.cfg, "dflash2", block_size=4, target_layer_ids=[0, 1], num_target_layers=None)
    proposer = dflash.DrafterProposer(random_drafter(dcfg, 12, torch.float32), target)
    s, g = Sampling(1.0), torch.Generator().manual_seed(1)
    ar_eng, sp_eng = dflash.Engine(target, None, 1, 16), dflash.Engine(target, proposer, 4, 16)
    ar = [ar_eng.run(prompt, new, sampling=s, generator=g).output_ids for _ in range(n)]
    sp_runs = [sp_eng.run(prompt, new, sampling=s, generator=g) for _ in range(n)]
    accepted = [st.accepted for r in sp_runs for st in r.steps if st.kind == "verify"]
    assert 0.1 < sum(1 for a in accepted if a > 0) / len(accepted) < 0.95     # accepts and rejects both occur
    for k in range(1, new):
        assert two_sample_chi2([o[k] for o in ar], [r.output_ids[k] for r in sp_runs]) > 1e-4, f"position {k}"
    assert two_sample_chi2([tuple(o[1:3]) for o in ar], [tuple(r.output_ids[1:3]) for r in sp_runs]) > 1e-4


def test_same_seed_same_output():
    cfg = tiny_target_config(vocab_size=30)
    target = random_target(cfg, 2, torch.float32)
    drafter = random_drafter(tiny_draft_config(cfg, block_size=6), 3, torch.float32)
    prompt = list(range(1, 20))
    s = Sampling(0.9, top_p=0.95, top_k=20)
    for proposer in (None, dflash.DrafterProposer(drafter, target), GreedyTargetProposer(target, prompt)):
        outs = [dflash.run(target, prompt, 30, (), proposer, 6, sampling=s,
                           generator=torch.Generator().manual_seed(seed)).output_ids for seed in (5, 5, 6)]
        assert outs[0] == outs[1] and outs[0] != outs[2]


def test_temperature_zero_is_greedy():
    cfg = tiny_target_config(vocab_size=30)
    target = random_target(cfg, 2, torch.float64)
    prompt = list(range(1, 20))
    greedy = dflash.run(target, prompt, 20).output_ids
    assert dflash.run(target, prompt, 20, sampling=Sampling(0.0), generator=torch.Generator().manual_seed(1)).output_ids == greedy


def test_stop_token_in_the_middle_of_an_accepted_run_sampling():
    cfg = tiny_target_config(vocab_size=8, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    target = random_target(cfg, 4, torch.float32)
    prompt = [1, 2, 3]
    seen_mid = False
    for seed in range(40):
        r = dflash.run(target, prompt, 30, [5], GreedyTargetProposer(target, prompt), 8, sampling=Sampling(1.0),
                       generator=torch.Generator().manual_seed(seed))
        if 5 in r.output_ids:
            assert r.output_ids.index(5) == len(r.output_ids) - 1          # nothing after the stop token
        last = r.steps[-1]
        if last.kind == "verify" and last.tokens[-1] == 5 and len(last.tokens) <= last.accepted:
            seen_mid = True                                                # the stop was an accepted proposal
    assert seen_mid
