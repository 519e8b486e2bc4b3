"""Sampling: the noise keyed by position draws from the target's distribution (chi-square, with the power to see a
2% bias); a sampled DFlash, DFlash2 (coupled rule) or MTP run equals plain sampled decoding with the same seed,
token for token, whatever the step pattern and however many requests share the engine's slots; the ratio rule
keeps the target's distribution; seeds reproduce; stop tokens cut accepted runs."""
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import dflash
import engine
import mtp
import noise
import sampling
from sampling import Sampling, sampling_probs, speculative_accept
from helpers import (HAS_EMBEDDED_PAIR, Early, OracleProposer, kind_draft_config, property_cases, raise_case, randomize_,
                     random_drafter, random_target, tiny_draft_config, tiny_target_config)
from test_batching import Pattern

pytestmark = pytest.mark.usefixtures("one_thread")      # tiny eager models: one thread (conftest.py)

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


# ---- The noise keyed by position (noise.py) ---------------------------------------------------------------

def lowbias32_numpy(x: int) -> int:
    """The hash written independently with numpy's wrapping uint32 arithmetic: noise.mix32 must equal it."""
    x = np.uint32(x)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x = np.uint32(x * np.uint32(0x7FEB352D))
        x ^= x >> np.uint32(15)
        x = np.uint32(x * np.uint32(0x846CA68B))
        x ^= x >> np.uint32(16)
    return int(x)


def test_mix32_is_lowbias32_on_ints_and_tensors():
    rng = random.Random(0)
    xs = [0, 1, 2 ** 32 - 1, 0x80000000] + [rng.getrandbits(32) for _ in range(2000)]
    want = [lowbias32_numpy(x) for x in xs]
    assert [noise.mix32(x) for x in xs] == want
    assert noise.mix32(torch.tensor(xs)).tolist() == want
    # the seed key takes any Python int, negative and wide ones too, and distinct seeds get distinct keys here
    keys = {noise.seed_key(s) for s in [0, 1, -1, 2 ** 32, 2 ** 40 + 5, 2 ** 63 - 1, -2 ** 63] + list(range(2, 500))}
    assert len(keys) == 505 and all(0 <= k < 2 ** 32 for k in keys)


def test_noise_is_a_function_of_seed_stream_position_and_token():
    key = torch.tensor(noise.seed_key(7))
    pos, vocab = torch.tensor([5, 9, 5, 1000]), noise.vocab_keys(64, "cpu")
    e = noise.vocab_noise(key, pos, vocab)
    assert torch.equal(e[0], e[2]) and not torch.equal(e[0], e[1])          # the same position, the same numbers
    assert torch.equal(e[1], noise.vocab_noise(key, torch.tensor([9]), vocab)[0])  # whatever else is computed beside it
    # a candidate subset sees the same numbers as the whole vocabulary at those token ids (a coupled draft's race)
    ids = torch.tensor([[3, 60, 11], [0, 1, 2], [63, 62, 7], [5, 5, 5]])
    sub = noise.exponentials(noise.row_keys(key, pos, noise.TARGET), ids)
    assert torch.equal(sub, e.gather(1, ids))
    other = noise.vocab_noise(torch.tensor(noise.seed_key(8)), pos, vocab)
    assert not torch.equal(e, other)
    rows = noise.row_keys(key, pos, noise.DRAFT)
    assert not torch.equal(noise.exponentials(rows, torch.arange(64)), e)     # streams differ
    assert (e > 0).all() and e.dtype == torch.float32


def test_noise_moments():
    """U(0, 1) and Exp(1): mean and variance over 2M numbers, within 5 standard errors."""
    key = torch.tensor(noise.seed_key(3))
    u = noise.uniforms(noise.row_keys(key, torch.arange(2000), noise.TARGET), noise.token_keys(torch.arange(1000))).flatten()
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 5 * (1 / 180 / n) ** 0.5
    e = noise.exponentials(noise.row_keys(key, torch.arange(2000), noise.ACCEPT), torch.arange(1000)).double().flatten()
    assert abs(e.mean().item() - 1) < 5 * (1 / n) ** 0.5 and abs(e.var().item() - 1) < 5 * (8 / n) ** 0.5


def draws_over(keys: torch.Tensor, pos: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The token each (key, position) pair draws from p [V], as sampling.choose draws it."""
    rows = noise.row_keys(keys, pos, noise.TARGET)
    return sampling.draw(p[None].expand(len(rows), -1), noise.exponentials(rows, torch.arange(len(p))))


@pytest.mark.parametrize("over", ["seeds", "positions"])
def test_position_noise_draws_fit_the_distribution(over):
    """200k draws from one distribution, across seeds at one position or across positions of one seed: a
    chi-square goodness of fit passes, and the same statistic rejects a copy of p with 2% moved (the test's power).
    Consecutive positions are independent: the pair counts fit the product distribution."""
    p = torch.softmax(torch.randn(7, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1.5, -1)
    p[3] = 0.0                                                                  # a zero-probability token never wins
    p = p / p.sum()
    N = 200_000
    if over == "seeds":
        keys, pos = noise.seed_key(torch.arange(N)), torch.full((N,), 17)
    else:
        keys, pos = torch.tensor(noise.seed_key(11)), torch.arange(N)
    tok = draws_over(keys, pos, p.float())
    counts = torch.bincount(tok, minlength=7).double()
    assert goodness_of_fit(counts, p) > 1e-4
    biased = p.clone()
    i, j = int(p.argmax()), int(torch.where(p > 0, p, 2.0).argmin())
    biased[i] -= 0.02
    biased[j] += 0.02
    assert goodness_of_fit(counts, biased) < 1e-6
    if over == "positions":
        pairs = torch.bincount(tok[:-1] * 7 + tok[1:], minlength=49).double()
        assert goodness_of_fit(pairs, torch.outer(p, p).flatten()) > 1e-4


# ---- Sampled runs == plain sampled decoding with the same seed -------------------------------------------

def random_head(target, seed, dtype=torch.float64):
    return randomize_(mtp.MTPHead(target.cfg), seed).to(dtype).eval()


SETTINGS = [Sampling(0.7), Sampling(1.0), Sampling(1.3, top_p=0.9), Sampling(1.0, top_k=5), Sampling(0.4, top_p=0.8, top_k=8)]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(-2 ** 40, 2 ** 40), pattern=st.lists(st.sampled_from([True, True, False, 2, 3]), min_size=1, max_size=8),
       block=st.sampled_from([2, 4, 8, 16]), prompt_len=st.integers(1, 30), s=st.sampled_from(SETTINGS),
       kind=st.sampled_from(["dflash", "sliding", "dflash2"]), slots=st.sampled_from([1, 3]))
def sampled_output_for_the_seed(seed, pattern, block, prompt_len, s, kind, slots):
    """test_sampled_output_equals_plain_decoding_for_the_seed's property. float64, random target: with one seed, the
    stand-in proposer (every acceptance length), a random DFlash / sliding / DFlash2 drafter (the coupled rule) and
    a random MTP head, in a forced pattern of rounds (of the whole block and shorter ones) and plain steps, all give
    exactly the text of plain sampled decoding; on one slot, or on three beside other requests (other seeds and
    settings, greedy ones among them), each its own text."""
    rng = random.Random(seed)
    target = random_target(tiny_target_config(vocab_size=50), abs(seed) % 97)
    prompt = [rng.randrange(50) for _ in range(prompt_len)]
    reqs = [engine.Request(prompt, 40, (), s, seed)]
    reqs += [engine.Request([rng.randrange(50) for _ in range(rng.randint(1, 30))], rng.randint(1, 40), (),
                            rng.choice(SETTINGS + [Sampling()]), seed + 1 + i) for i in range(slots - 1)]
    ar = [engine.run(target, r.prompt_ids, r.max_new_tokens, sampling=r.sampling, seed=r.seed) for r in reqs]
    assert ar[0].seed == seed
    oracle = OracleProposer({tuple(r.prompt_ids): a.output_ids for r, a in zip(reqs, ar)}, 50, abs(seed))
    drafter = random_drafter(kind_draft_config(target.cfg, kind, target_layer_ids=[0, 2], num_target_layers=None,
                                               block_size=16), abs(seed) % 89)
    proposers = (oracle, engine.DrafterProposer(drafter, target), mtp.MTPProposer(random_head(target, abs(seed) % 83), target, block - 1))
    for proposer in proposers if block > 1 else proposers[:2]:
        eng = engine.Engine(target, proposer, block, slots, 128, policy=Pattern(pattern, block))
        res = eng.run(reqs)
        assert [r.output_ids for r in res] == [a.output_ids for a in ar], (type(proposer).__name__, pattern)
    assert engine.run(target, prompt, 40, sampling=s, seed=seed + 1).output_ids != ar[0].output_ids or len(set(ar[0].output_ids)) < 3


def seed_properties() -> list:
    """sampled_output_for_the_seed's search, in a process of its own started with the suite (helpers.Early)."""
    return property_cases(sampled_output_for_the_seed, [{}])


SEED_PROPERTIES = Early(seed_properties, process=True,
                        used_by=["test_sampled_output_equals_plain_decoding_for_the_seed"])


def test_sampled_output_equals_plain_decoding_for_the_seed():
    """With one seed, every proposer (the stand-in, DFlash, sliding, DFlash2, MTP) in forced patterns of rounds and
    plain steps, alone or beside other requests, gives plain sampled decoding's text (sampled_output_for_the_seed)."""
    raise_case(SEED_PROPERTIES.result()[0])


@pytest.mark.parametrize("slots", [1, 3])
def test_every_acceptance_length_when_sampling(slots):
    """Behind the stand-in proposer (the sampled continuation with one token changed), sampled rounds accept every
    length 0..B-1 and still commit plain decoding's tokens, in every row."""
    target = random_target(tiny_target_config(vocab_size=40), 5)
    s = Sampling(1.0, top_p=0.95)
    prompts = [list(range(3, 20)), list(range(20, 31)), [7, 1, 38, 2]][:slots]
    reqs = [engine.Request(p, 150, (), s, 99 + i) for i, p in enumerate(prompts)]
    ar = [engine.run(target, r.prompt_ids, 150, sampling=s, seed=r.seed).output_ids for r in reqs]
    oracle = OracleProposer({tuple(r.prompt_ids): a for r, a in zip(reqs, ar)}, 40, 1)
    res = engine.Engine(target, oracle, 8, slots, 20 + 150 + 8).run(reqs)
    assert [r.output_ids for r in res] == ar
    assert all(set(range(1, 9)) <= set(r.acceptance_lengths) for r in res)


class GreedyTargetProposer:
    """Stand-in engine.Proposer that proposes LIKELY tokens: for each row, the target's own greedy continuation of
    that request's committed prefix (full forward, no cache). Under sampling these are accepted often, so accept and
    reject paths both run many times. It follows each row's text from its rounds (start moves by the accepted
    proposals plus one): an engine without a policy, every step a round."""
    feature_layers = ()
    max_block_size = 16
    wants_next_ids = False
    samples_drafts = False
    window = None

    MEMO = {}                                               # (target id, prefix) -> greedy next token

    def __init__(self, target):
        self.target = target

    def greedy_next(self, seq):
        key = (id(self.target), tuple(seq))
        if key not in self.MEMO:
            with torch.no_grad():
                logits, _ = self.target(torch.tensor([seq]), torch.arange(len(seq)))
            self.MEMO[key] = int(logits[0, -1].argmax())
        return self.MEMO[key]

    def reset(self, slots, capacity, masks=None):
        self.rows = [None] * slots

    def admit(self, row, feats, pos, prompt_ids, first):
        self.rows[row] = {"seq": list(prompt_ids), "prompt": len(prompt_ids), "props": [], "start": None}

    def append(self, feats, pos, next_ids):
        pass

    def propose(self, last, start, feats, feat_pos, n, next_ids, rows=None, temperature=None):
        out = []
        for b, row in enumerate(self.rows):
            at = int(start[b])
            if row is None or at < row["prompt"]:           # a free slot (it rides along at position 0)
                out.append([0] * n)
                continue
            if row["start"] is not None:                    # tokens committed since the previous call
                row["seq"] += row["props"][:at - row["start"] - 1]
            row["seq"].append(int(last[b]))
            assert len(row["seq"]) == at + 1
            seq = list(row["seq"])
            for _ in range(n):
                seq.append(self.greedy_next(seq))
            row["props"], row["start"] = seq[-n:] if n else [], at
            out.append(row["props"])
        return engine.Draft(torch.tensor(out, dtype=torch.long).view(len(self.rows), n))


@pytest.fixture(scope="module")
def small_target():
    return random_target(tiny_target_config(vocab_size=6, num_hidden_layers=2,
                                            layer_types=["linear_attention", "full_attention"]), 11, torch.float32)


def ar_runs(target, prompt, new, s, seeds) -> list:
    """Plain sampled decoding of `prompt` for each seed -> output ids: many at a time on an Engine of 16 slots, each
    row its run alone for its seed (test_batching.py; 1500 runs one by one took 2.6x as long)."""
    return [r.output_ids for r in engine.Engine(target, None, 1, 16, 16).run(
        [engine.Request(prompt, new, (), s, seed) for seed in seeds])]


@pytest.mark.parametrize("s", CONFIGS, ids=lambda s: f"T{s.temperature}-p{s.top_p}-k{s.top_k}")
def test_sampled_runs_keep_the_target_distribution(s, small_target):
    """End to end at each temperature / top-k / top-p: the first token of 1500 seeded AR runs (ar_runs) fits the
    target's distribution (chi-square against sampling_probs of a full forward), and DFlash runs 8 at a time behind a
    proposer of likely tokens (accepts and rejects both frequent) give each seed's AR text exactly; with the draws'
    distribution exact (test_position_noise_draws_fit_the_distribution) that is the whole distribution."""
    target = small_target
    prompt = [1, 4, 2, 0, 3]
    n, new = 1500, 4
    sp_eng = engine.Engine(target, GreedyTargetProposer(target), 4, 8, 16)
    ar = ar_runs(target, prompt, new, s, range(n))
    with torch.no_grad():
        logits, _ = target(torch.tensor([prompt]), torch.arange(len(prompt)))
    p0 = sampling_probs(logits[0, -1], s).double()
    assert goodness_of_fit(torch.bincount(torch.tensor([o[0] for o in ar]), minlength=6).double(), p0) > 1e-4
    sp_runs = sp_eng.run([engine.Request(prompt, new, (), s, i) for i in range(300)])
    assert [r.output_ids for r in sp_runs] == ar[:300]
    accepted = [st.accepted for r in sp_runs for st in r.steps if st.kind == "verify"]
    assert 0.2 < sum(1 for a in accepted if a > 0) / len(accepted) < 0.95     # both paths exercised


def test_dflash2_ratio_rule_keeps_the_distribution(small_target):
    """A DFlash2 drafter under the ratio rule samples its block from q with noise of its own and min(1, p/q)
    decides: the output is another text than AR's for a seed, distributed the same. Two-sample chi-square at each
    position and on pairs, 1500 generations each (8 at a time), on disjoint seeds; the coupled rule gives AR's text."""
    target, prompt, n, new = small_target, [1, 4, 2, 0, 3], 1500, 4
    dcfg = kind_draft_config(target.cfg, "dflash2", block_size=4, target_layer_ids=[0, 1], num_target_layers=None)
    proposer = engine.DrafterProposer(random_drafter(dcfg, 12, torch.float32), target)
    ratio, coupled = Sampling(1.0, draft_rule="ratio"), Sampling(1.0)
    sp_eng = engine.Engine(target, proposer, 4, 8, 16)
    ar = ar_runs(target, prompt, new, coupled, range(n))

    def runs(s, seeds):
        return sp_eng.run([engine.Request(prompt, new, (), s, seed) for seed in seeds])
    sp_runs = runs(ratio, range(n, 2 * n))
    accepted = [st.accepted for r in sp_runs for st in r.steps if st.kind == "verify"]
    assert 0.1 < sum(1 for a in accepted if a > 0) / len(accepted) < 0.95     # accepts and rejects both occur
    for k in range(1, new):
        assert two_sample_chi2([o[k] for o in ar], [r.output_ids[k] for r in sp_runs]) > 1e-4, f"position {k}"
    assert two_sample_chi2([tuple(o[1:3]) for o in ar], [tuple(r.output_ids[1:3]) for r in sp_runs]) > 1e-4
    # and the test has teeth: the same statistic separates AR from a 2%-biased copy of it
    biased = [o[1] if random.Random(i).random() > 0.04 else 0 for i, o in enumerate(ar)]
    assert two_sample_chi2([o[1] for o in ar] * 4, biased * 4) < 1e-3
    same = [r.output_ids for r in runs(ratio, range(200))]
    assert same != ar[:200]                                    # the ratio rule's text is not AR's for the seed
    assert [r.output_ids for r in runs(coupled, range(200))] == ar[:200]


def test_same_seed_same_output():
    cfg = tiny_target_config(vocab_size=30)
    target = random_target(cfg, 2, torch.float32)
    drafter = random_drafter(tiny_draft_config(cfg, block_size=6), 3, torch.float32)
    prompt = list(range(1, 20))
    s = Sampling(0.9, top_p=0.95, top_k=20)
    for proposer in (None, engine.DrafterProposer(drafter, target), GreedyTargetProposer(target)):
        outs = [engine.run(target, prompt, 30, (), proposer, 6, sampling=s, seed=seed).output_ids for seed in (5, 5, 6)]
        assert outs[0] == outs[1] and outs[0] != outs[2]
    runs = [engine.run(target, prompt, 30, sampling=s) for _ in range(2)]       # no seed: a random one, recorded
    assert runs[0].seed != runs[1].seed
    assert engine.run(target, prompt, 30, sampling=s, seed=runs[0].seed).output_ids == runs[0].output_ids


def test_temperature_zero_is_greedy():
    cfg = tiny_target_config(vocab_size=30)
    target = random_target(cfg, 2, torch.float64)
    prompt = list(range(1, 20))
    greedy = engine.run(target, prompt, 20).output_ids
    assert engine.run(target, prompt, 20, sampling=Sampling(0.0), seed=1).output_ids == greedy


def test_stop_token_in_the_middle_of_an_accepted_run_sampling():
    cfg = tiny_target_config(vocab_size=8, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    target = random_target(cfg, 4, torch.float32)
    prompt = [1, 2, 3]
    seen_mid = False
    for seed in range(40):
        r = engine.run(target, prompt, 30, [5], GreedyTargetProposer(target), 8, sampling=Sampling(1.0),
                       seed=seed)
        if 5 in r.output_ids:
            assert r.output_ids.index(5) == len(r.output_ids) - 1          # nothing after the stop token
        last = r.steps[-1]
        if last.kind == "verify" and last.tokens[-1] == 5 and len(last.tokens) <= last.accepted:
            seen_mid = True                                                # the stop was an accepted proposal
    assert seen_mid


def test_dflash2_form_drafts_what_the_drafter_drafts():
    """bench.dflash2_form (how --draft-rules measures the two rules with the embedded DFlash drafter): greedy, its
    rounds propose exactly the DFlash drafter's tokens; sampling, its q is softmax(top-k logits / T) of the same
    rows, and under the coupled rule the output is plain decoding's for the seed."""
    from tools import bench
    target = random_target(tiny_target_config(vocab_size=40), 3, torch.float64)
    drafter = random_drafter(tiny_draft_config(target.cfg, block_size=6, target_layer_ids=[0, 2], num_target_layers=None), 4)
    d2 = bench.dflash2_form(drafter, 5)
    assert d2.cfg.dflash2 and d2.cfg.selector_top_k == 5
    prompt = list(range(2, 22))
    one, two = (engine.run(target, prompt, 30, (), engine.DrafterProposer(d, target), 6) for d in (drafter, d2))
    assert one.draft_ids == two.draft_ids and one.output_ids == two.output_ids
    h = torch.randn(5, target.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rows = noise.row_keys(torch.tensor(noise.seed_key(1)), torch.arange(5), noise.TARGET)
    _, q = d2.propose(h, torch.tensor([7]), target.lm_head, rows, 0.7)
    top = drafter.draft_logits(h, target.lm_head).topk(5, dim=-1)
    want = torch.zeros_like(q).scatter(1, top.indices, torch.softmax(top.values.float() / 0.7, -1))
    assert torch.allclose(q, want, atol=1e-6)
    s = Sampling(0.8)
    assert engine.run(target, prompt, 30, (), engine.DrafterProposer(d2, target), 6, sampling=s, seed=3).output_ids == \
        engine.run(target, prompt, 30, sampling=s, seed=3).output_ids


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_bench_draft_rules_on_the_embedded_pair(capsys):
    """tools/bench.py --draft-rules: the three arms per temperature; the greedy draft and the coupled rule give every
    prompt's plain sampled text, the ratio rule its own; a flag it does not run is refused."""
    from tools import bench
    res = bench.main(["--draft-rules", "0.8", "--heldout", "3", "--max-new-tokens", "16", "--threads", "1"])
    row = res["table"]["0.8"]
    assert set(row) == {"greedy draft", "sampled, coupled", "sampled, ratio"}
    assert row["greedy draft"]["same_as_ar"] == row["sampled, coupled"]["same_as_ar"] == 3
    assert all(v["tau"] >= 1 and v["rounds"] > 0 for v in row.values())
    assert "| 0.8 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--draft-rules", "0.8", "--compile"])
    with pytest.raises(SystemExit):
        bench.main(["--draft-rules", "0,x"])
