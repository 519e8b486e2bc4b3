"""Many requests at once (batching.py): every row's output == the same request run alone, whatever else is in the
batch, for every acceptance length on every row, stop tokens, max_new_tokens, arrival orders and N from 1 to 8."""
import random

import statistics

import pytest
import torch
from hypothesis import given, settings, strategies as st

import batching
import dflash
from dflash import Sampling
import mtp
from helpers import HAS_EMBEDDED_PAIR, kind_draft_config, random_drafter, random_target, randomize_, tiny_target_config
from test_spec_equals_ar import first_divergence_is_near_tie, target_configs

MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=20)


class BatchOracle:
    """Stand-in BatchProposer: for each row, the true continuation of the request in it (known from a run alone)
    with one corruption at an index drawn per row and per round, so every row accepts exactly what its own plan
    says, independently of the other rows; each row's plan cycles through a shuffled 0..n (n = all accepted)."""

    feature_layers = ()
    wants_next_ids = False

    def __init__(self, continuations: dict, vocab: int, seed: int, max_block_size: int = 16):
        self.cont, self.V, self.rng = continuations, vocab, random.Random(seed)
        self.max_block_size = max_block_size
        self.asked = []                                    # (prompt, start, planned acceptance) per live row and round

    def reset(self, slots, capacity, masks=None):
        self.rows, self.plans = [None] * slots, [[] for _ in range(slots)]

    def admit(self, row, feats, pos, prompt_ids, first):
        self.rows[row] = tuple(prompt_ids)

    def append(self, feats, pos, next_ids):
        pass

    def propose(self, last, start, feats, feat_pos, n, next_ids):
        out = []
        for b, prompt in enumerate(self.rows):
            if prompt is None or int(start[b]) < len(prompt):      # a free slot (it rides along at position 0)
                out.append([0] * n)
                continue
            cont = self.cont[prompt]
            if not self.plans[b]:
                self.plans[b] = list(range(n + 1))
                self.rng.shuffle(self.plans[b])
            a = self.plans[b].pop()
            i = int(start[b]) - len(prompt) + 1                 # index in the continuation of the token after last
            row = (cont[i:i + n] + [self.rng.randrange(self.V) for _ in range(n)])[:n]
            if a < n:
                row[a] = (row[a] + 1 + self.rng.randrange(self.V - 1)) % self.V
            self.asked.append((prompt, int(start[b]), a))
            out.append(row)
        return torch.tensor(out, dtype=torch.long)


class RandomPattern:
    """A stand-in batch policy: a round or a plain step by a seeded coin, a round's verify block drawn from 1..block
    (the whole block, True, half the time), and plain steps that feed the drafter's context or not (`feeds`, as
    Policy when it gives rounds up): the output must not depend on any of these."""

    def __init__(self, seed, block=16):
        self.rng, self.block = random.Random(seed), block
        self.feeds = True

    def reset(self):
        pass

    def speculate(self, rows):
        self.feeds = self.rng.random() < 0.8
        if self.rng.random() >= 0.6:
            return False
        return True if self.rng.random() < 0.5 else self.rng.randint(1, self.block)

    def observe_round(self, rows, seconds):
        pass

    def observe_plain(self, rows, seconds):
        pass


def make_requests(rng, vocab, n, max_len, alone_runner, stop_rate=0.3):
    """n random requests; some stop at a token their run alone produces (so the stop is hit mid-output)."""
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_len))]
        max_new = rng.randint(1, 40)
        stops = ()
        if rng.random() < stop_rate:
            out = alone_runner(prompt, max_new, ())
            stops = (out[rng.randrange(len(out))],)
        reqs.append(batching.Request(prompt, max_new, stops))
    return reqs


def check_batch(target, reqs, slots, block, seed, dtype, drafter_kind="dflash"):
    """Batched AR, batched DFlash behind the oracle (with and without a random plain/round pattern) and behind a
    random drafter: each request's output == its run alone (dflash.run, AR)."""
    alone = [dflash.run(target, r.prompt_ids, r.max_new_tokens, r.stop_ids).output_ids for r in reqs]
    cont = {tuple(r.prompt_ids): out for r, out in zip(reqs, alone)}
    capacity = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs) + block
    oracle = BatchOracle(cont, target.cfg.vocab_size, seed)
    drafter = random_drafter(kind_draft_config(target.cfg, drafter_kind, target_layer_ids=[seed % target.cfg.num_hidden_layers],
                                               num_target_layers=None), seed, dtype)
    runs = {
        "ar": batching.Batch(target, None, 1, slots, capacity).run(reqs),
        "oracle": batching.Batch(target, oracle, block, slots, capacity).run(reqs),
        "pattern": batching.Batch(target, BatchOracle(cont, target.cfg.vocab_size, seed + 1), block, slots, capacity,
                                  policy=RandomPattern(seed, block)).run(reqs),
        "drafter": batching.Batch(target, batching.SlotDrafter(drafter, target), block, slots, capacity).run(reqs),
    }
    for name, results in runs.items():
        for r, res, want in zip(reqs, results, alone):
            if dtype == torch.float64 or res.output_ids == want:
                assert res.output_ids == want, (name, r)
            else:
                assert first_divergence_is_near_tie(target, r.prompt_ids, want, res.output_ids, 1e-4), name
            assert res.prompt_ids == r.prompt_ids
            # the trace contract, per row: the steps' tokens make up the output, acceptance lengths sum to it
            assert [t for s in res.steps for t in s.tokens] == res.output_ids
            assert sum(res.acceptance_lengths) + 1 == len(res.output_ids) or name == "ar"
            assert all(1 <= a <= block for a in res.acceptance_lengths)
            assert all(s.accepted <= len(s.draft_ids) <= block - 1 for s in res.steps if s.kind == "verify")
            assert [s.stop for s in res.steps] == [False] * (len(res.steps) - 1) + [True]
    return oracle, runs


@st.composite
def moe_or_dense(draw):
    cfg = draw(target_configs())
    if draw(st.booleans()):
        cfg = tiny_target_config(**{**vars(cfg), **MOE})
    return cfg


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=20, deadline=None)
@given(cfg=moe_or_dense(), seed=st.integers(0, 10**6), n_req=st.integers(1, 10), slots=st.integers(1, 8),
       block=st.integers(1, 16), max_len=st.sampled_from([8, 60, 200]))
def test_batch_equals_alone(dtype, cfg, seed, n_req, slots, block, max_len):
    target = random_target(cfg, seed, dtype)
    rng = random.Random(seed)
    reqs = make_requests(rng, cfg.vocab_size, n_req, max_len,
                         lambda p, m, s: dflash.run(target, p, m, s).output_ids)
    oracle, _ = check_batch(target, reqs, slots, block, seed, dtype, rng.choice(["dflash", "sliding", "dflash2"]))


def test_every_acceptance_length_on_every_row():
    """Rows accept independently: in one batch, each row sees every acceptance length 0..block-1, and the rows'
    lengths in the same round differ."""
    cfg = tiny_target_config(vocab_size=50)
    target = random_target(cfg, 3)
    rng = random.Random(1)
    block = 6
    reqs = [batching.Request([rng.randrange(50) for _ in range(rng.randint(5, 40))], 120) for _ in range(4)]
    oracle, _ = check_batch(target, reqs, 4, block, 5, torch.float64)
    for r in reqs:
        seen = {a for p, _, a in oracle.asked if p == tuple(r.prompt_ids)}
        assert seen == set(range(block)), seen
    by_start = {}
    for p, s, a in oracle.asked:
        by_start.setdefault(len(by_start) // 4, []).append(a)
    assert any(len(set(v)) > 1 for v in by_start.values())


def test_admission_order_and_slots_do_not_matter():
    """The same requests in another order, through 1, 3 and 8 slots: each request's output is the same."""
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 8)
    d = random_drafter(kind_draft_config(cfg, "dflash", block_size=8), 4)
    rng = random.Random(2)
    reqs = [batching.Request([rng.randrange(40) for _ in range(rng.randint(1, 50))], rng.randint(1, 30)) for _ in range(9)]
    want = None
    for slots in (1, 3, 8):
        order = list(range(len(reqs)))
        rng.shuffle(order)
        res = batching.Batch(target, batching.SlotDrafter(d, target), 8, slots, 100).run([reqs[i] for i in order])
        got = {i: r.output_ids for i, r in zip(order, res)}
        want = want or got
        assert got == want


def test_sampled_rows_equal_concurrency_one_and_the_engine():
    """float64: a request's samples at concurrency N == at concurrency 1 == dflash.Engine's, for its own seed, beside
    greedy rows and rows with other settings."""
    cfg = tiny_target_config(vocab_size=30)
    target = random_target(cfg, 9)
    d = random_drafter(kind_draft_config(cfg, "dflash", block_size=8), 4)
    rng = random.Random(3)
    settings_ = [Sampling(), Sampling(0.7), Sampling(1.3, top_p=0.8), Sampling(1.0, top_k=4), Sampling(0.9, 0.9, 6)]
    reqs = [batching.Request([rng.randrange(30) for _ in range(rng.randint(1, 30))], rng.randint(5, 30), (),
                             settings_[i % len(settings_)], seed=100 + i) for i in range(8)]
    alone = [dflash.run(target, r.prompt_ids, r.max_new_tokens, sampling=r.sampling, seed=r.seed).output_ids for r in reqs]
    for slots in (1, 4, 8):
        for proposer, block in ((None, 1), (batching.SlotDrafter(d, target), 8)):
            res = batching.Batch(target, proposer, block, slots, 80).run(reqs)
            assert [r.output_ids for r in res] == alone, (slots, proposer)
            assert [r.seed for r in res] == [None if r.sampling.greedy else r.seed for r in reqs]


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_dflash2_sampled_drafts_rows_equal_the_engine(slots):
    """float64: DFlash2 samples a sampled request's block (the coupled rule: the TARGET stream; the ratio rule: its
    own DRAFT stream, judged by min(1, p/q)); each row's drafts, acceptances and output == dflash.Engine's for its
    seed, beside greedy rows and rows under the other rule, at any concurrency."""
    cfg = tiny_target_config(vocab_size=30)
    target = random_target(cfg, 5)
    d = random_drafter(kind_draft_config(cfg, "dflash2", block_size=6, target_layer_ids=[0, 2], num_target_layers=None), 6)
    rng = random.Random(8)
    settings_ = [Sampling(0.8, draft_rule="ratio"), Sampling(), Sampling(1.2), Sampling(1.0, 0.9, 5, "ratio"),
                 Sampling(0.0, draft_rule="ratio"), Sampling(0.7, top_k=4)]
    reqs = [batching.Request([rng.randrange(30) for _ in range(rng.randint(1, 20))], rng.randint(5, 30), (),
                             settings_[i % len(settings_)], seed=40 + i) for i in range(9)]
    proposer = dflash.DrafterProposer(d, target)
    alone = [dflash.run(target, r.prompt_ids, r.max_new_tokens, (), proposer, 6, sampling=r.sampling, seed=r.seed)
             for r in reqs]
    res = batching.Batch(target, batching.SlotDrafter(d, target), 6, slots, 60).run(reqs)
    for r, got, want in zip(reqs, res, alone):
        assert got.draft_ids == want.draft_ids and got.acceptance_lengths == want.acceptance_lengths, r.sampling
        assert got.output_ids == want.output_ids, r.sampling
    ratio = [a for r, x in zip(reqs, res) if r.sampling.draft_rule == "ratio" and not r.sampling.greedy
             for a in x.acceptance_lengths]
    assert 1 in ratio and max(ratio) > 1                       # rejections and acceptances under the ratio rule
    ar = [dflash.run(target, r.prompt_ids, r.max_new_tokens, sampling=r.sampling, seed=r.seed).output_ids for r in reqs]
    assert all((x.output_ids == a) == (r.sampling.draft_rule == "coupled" or r.sampling.greedy)
               for r, x, a in zip(reqs, res, ar))            # the ratio rule's text is another sample than AR's


def test_batched_sampling_keeps_the_target_distribution():
    """Chi-square: the second token of 400 seeded requests, run 8 at a time behind a drafter (accepts and rejects
    both occur), against the same requests' plain AR draws; and the AR draws fit the target's distribution."""
    from test_sampling import goodness_of_fit, two_sample_chi2
    cfg = tiny_target_config(vocab_size=6, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    target = random_target(cfg, 11, torch.float32)
    d = random_drafter(kind_draft_config(cfg, "dflash", block_size=4, target_layer_ids=[0, 1], num_target_layers=None),
                       2, torch.float32)
    prompt, s = [1, 4, 2, 0, 3], Sampling(1.0)
    reqs = [batching.Request(prompt, 3, (), s, seed=i) for i in range(400)]
    sp = batching.Batch(target, batching.SlotDrafter(d, target), 4, 8, 16).run(reqs)
    ar = batching.Batch(target, None, 1, 1, 16).run(reqs[:200] + [batching.Request(prompt, 3, (), s, seed=10**6 + i)
                                                                  for i in range(200)])
    assert two_sample_chi2([r.output_ids[1] for r in sp], [r.output_ids[1] for r in ar]) > 1e-4
    with torch.no_grad():
        logits, _ = target(torch.tensor([prompt]), torch.arange(len(prompt)))
    p0 = dflash.sampling_probs(logits[0, -1], s).double()
    assert goodness_of_fit(torch.bincount(torch.tensor([r.output_ids[0] for r in ar]), minlength=6).double(), p0) > 1e-4
    accepted = [st.accepted for r in sp for st in r.steps if st.kind == "verify"]
    assert 0 < sum(a > 0 for a in accepted) < len(accepted)


def test_batch_policy_plain_steps_and_rounds_are_both_exact():
    """The batch policy (batching.Policy) on a drafter that never agrees: it turns to plain steps, probes with a
    round now and then, and the output is AR's."""
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 12)
    d = random_drafter(kind_draft_config(cfg, "dflash", block_size=8), 6)
    rng = random.Random(4)
    reqs = [batching.Request([rng.randrange(40) for _ in range(20)], 60) for _ in range(3)]
    res = batching.Batch(target, batching.SlotDrafter(d, target), 8, 3, 100, policy=batching.Policy(block=8)).run(reqs)
    for r, got in zip(reqs, res):
        assert got.output_ids == dflash.run(target, r.prompt_ids, r.max_new_tokens).output_ids
        assert {"plain", "verify"} <= set(got.step_kinds)


def test_bad_requests_name_the_request():
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 1)
    b = batching.Batch(target, None, 1, 2, 30)
    with pytest.raises(dflash.GenerationError, match="request 1: .*exceeds the cache length 30"):
        b.run([batching.Request([1, 2], 5), batching.Request([1] * 20, 20)])
    with pytest.raises(dflash.GenerationError, match="request 0: the prompt is empty"):
        b.run([batching.Request([], 5)])
    with pytest.raises(dflash.GenerationError, match="--concurrency must be >= 1"):
        batching.Batch(target, None, 1, 0, 30)
    d = random_drafter(kind_draft_config(cfg, "dflash", block_size=8), 1)
    with pytest.raises(dflash.GenerationError, match="block size 9 exceeds the drafter's block_size 8"):
        batching.Batch(target, batching.SlotDrafter(d, target), 9, 2, 30)
    with pytest.raises(dflash.GenerationError, match="block size must be >= 1"):
        batching.Batch(target, batching.SlotDrafter(d, target), 0, 2, 30)


def test_no_recompiles_across_admissions_and_finishes(monkeypatch):
    """Compiled with N = 3, DFlash, sliding-window and DFlash2 drafters and the MTP head: requests of other lengths
    arriving and finishing at other times, greedy, never recompile; the tokens are the eager batch's. Dynamo's
    guards decide recompiles, so the steps run traced but without inductor's code (helpers.dynamo_only); the
    inductor-compiled batch is tested against eager in test_compile.py and test_flex.py."""
    from torch._dynamo.utils import counters
    from helpers import dynamo_only
    dynamo_only(monkeypatch)
    torch._dynamo.reset()
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 2, torch.float32)
    rng = random.Random(5)

    def requests(k):
        return [batching.Request([rng.randrange(40) for _ in range(rng.randint(1, 30))], rng.randint(1, 20)) for _ in range(k)]

    def drafter(kind, seed):
        return batching.SlotDrafter(random_drafter(kind_draft_config(cfg, kind, block_size=4), seed, torch.float32), target)
    head = randomize_(mtp.MTPHead(cfg), 4).float().eval()
    # the DFlash drafter through rounds of every verify block and plain steps fed or not; the other drafters and
    # the MTP head (its pending rows one column wider, its next ids kept) through whole-block rounds and plain steps
    for make, policy in ((lambda: drafter("dflash", 3), batching.Alternate((2, True))),
                         (lambda: drafter("sliding", 6), batching.Alternate((True,))),
                         (lambda: drafter("dflash2", 7), batching.Alternate((True,))),
                         (lambda: mtp.SlotMTP(head, target, 3), batching.Alternate((True,)))):
        eng = batching.Batch(target, make(), 4, 3, 64, compile_mode="default", policy=policy)
        eng.run(requests(4))                                    # warm-up: every step kind compiles once
        graphs = counters["stats"]["unique_graphs"]
        later = requests(7)
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = eng.run(later)
        assert counters["stats"]["unique_graphs"] == graphs
        eager = batching.Batch(target, make(), 4, 3, 64).run(later)
        assert any(len(r.verify_lengths) for r in got)
        for a, b in zip(got, eager):
            assert a.output_ids == b.output_ids or first_divergence_is_near_tie(target, a.prompt_ids, b.output_ids, a.output_ids, 1e-4)


class Pattern:
    """A stand-in batch policy that cycles through a fixed pattern of rounds (True: the whole block; k: a round that
    verifies k tokens) and plain steps (False)."""

    def __init__(self, pattern):
        self.pattern, self.i = pattern, 0

    def reset(self):
        pass

    def speculate(self, rows):
        self.i += 1
        return self.pattern[(self.i - 1) % len(self.pattern)]

    def observe_round(self, rows, seconds):
        pass

    def observe_plain(self, rows, seconds):
        pass


@pytest.mark.parametrize("kind,block,pattern,slots,shortest", [("dflash", 8, [False] * 5 + [True], 2, 3),
                                                               ("sliding", 8, [False] * 11 + [True, True], 3, 3),
                                                               ("dflash", 4, [True, False], 2, 3),
                                                               ("dflash2", 16, [False, True], 2, 3),
                                                               ("dflash", 8, [False] * 19 + [True], 1, 3),
                                                               ("dflash", 8, [3, False, 8, 5, 2, False, 1, 4], 2, 3),
                                                               ("dflash", 8, [False] * 15 + [True], 3, 1)])
def test_drafts_after_plain_steps_and_admissions_equal_drafter_from_scratch(kind, block, pattern, slots, shortest):
    """The drafter's context in a batch (a round's features, plain steps' columns taken whole when full, a request
    admitted beside them joining the pending columns with its prompt's last features, or, with a prompt shorter
    than the columns before the next plain step's, after they are taken early): every row's every proposal == the
    drafter run from scratch on full-forward target features of that request's committed prefix. shortest: the
    shortest prompt (1: prompts of 1..4 tokens, many shorter than a run of plain steps)."""
    from test_spec_equals_ar import scratch_mask
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 7)
    dcfg = kind_draft_config(cfg, kind, block_size=16, target_layer_ids=[0, 2, 3], num_target_layers=None)
    drafter = random_drafter(dcfg, 7)
    rng = random.Random(7)
    reqs = [batching.Request([rng.randrange(40) for _ in range(rng.randint(shortest, 30 if shortest > 1 else 4))],
                             rng.randint(20, 70)) for _ in range(5 if shortest > 1 else 9)]
    results = batching.Batch(target, batching.SlotDrafter(drafter, target), block, slots, 120,
                             policy=Pattern(pattern)).run(reqs)
    rounds = 0
    for req, res in zip(reqs, results):
        seq = torch.tensor([req.prompt_ids + res.output_ids])
        with torch.no_grad():
            _, feats = target(seq, torch.arange(seq.shape[1]), feature_layers=tuple(dcfg.target_layer_ids))
            for step in [s for s in res.steps if s.kind == "verify" and s.draft_ids]:
                start, block = step.start, len(step.draft_ids) + 1        # (a round's own verify block)
                blk = torch.full((1, block), dcfg.mask_token_id)
                blk[0, 0] = seq[0, start]
                masks = {k: scratch_mask(start, block, *k) for k in set(drafter.kinds)}
                h = drafter(target.embed_tokens(blk), feats[:, :start], torch.arange(start, start + block),
                            torch.arange(start), masks)
                assert drafter.propose(h[0, 1:], blk[0, :1], target.lm_head)[0].tolist() == step.draft_ids, start
                rounds += 1
    assert rounds >= 5 and sum(r.step_kinds.count("plain") for r in results) >= 20


# ---- generate.py --prompts-file --concurrency --------------------------------------------------------

def test_prompts_file_equals_single_runs(tmp_path, capsys):
    """The embedded pair through --prompts-file at concurrency 3: one JSON line per request, in input order, each ==
    the same request run alone by generate.py (greedy and sampled, its own settings, text and ids, a stop)."""
    import json

    import generate
    lines = [{"prompt": "def fibonacci(n):", "max_new_tokens": 30},
             {"prompt_ids": [1, 2, 3, 4], "max_new_tokens": 12, "temperature": 0.8, "seed": 7, "top_k": 20},
             {"prompt": "import os\nimport sys\n", "max_new_tokens": 40},
             {"prompt": "class Point:", "max_new_tokens": 5, "temperature": 1.1, "top_p": 0.9, "seed": 3},
             {"prompt": "x = ", "max_new_tokens": 1}]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    capsys.readouterr()
    assert generate.main(["--prompts-file", str(path), "--concurrency", "3", "--json", "--threads", "1"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [o["index"] for o in out] == list(range(len(lines)))
    for line, got in zip(lines, out):
        argv = ["--json", "--threads", "1", "--max-new-tokens", str(line["max_new_tokens"])]
        argv += ["--prompt", line["prompt"]] if "prompt" in line else ["--prompt-ids", ",".join(map(str, line["prompt_ids"]))]
        for key, flag in (("temperature", "--temperature"), ("seed", "--seed"), ("top_k", "--top-k"), ("top_p", "--top-p")):
            if key in line:
                argv += [flag, str(line[key])]
        assert generate.main(argv) == 0
        alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        for key in ("prompt_ids", "output_ids", "text", "seed", "temperature", "mode", "block_size"):
            assert got[key] == alone[key], (key, line)
        assert got["concurrency"] == 3 and sum(got["acceptance_lengths"]) + 1 == len(got["output_ids"])
    capsys.readouterr()
    assert generate.main(["--prompts-file", str(path), "--concurrency", "2", "--draft", "none", "--json"]) == 0
    ar = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [o["output_ids"] for o in ar] == [o["output_ids"] for o in out] and ar[0]["mode"] == "ar"


@pytest.mark.parametrize("content,args,message", [
    ('{"prompt": "a", "temprature": 1}', [], "line 1: unknown key 'temprature'; a line holds prompt, "),
    ('{"prompt": "a"}\nnot json', [], "line 2 is not JSON"),
    ('[1, 2]', [], "line 1 is not a JSON object"),
    ('{"prompt": "a", "prompt_ids": [1]}', [], "line 1: give exactly one of prompt, prompt_ids, messages"),
    ('{"prompt_ids": "1,2"}', [], "line 1: prompt_ids has the wrong type (str)"),
    ('{"prompt_ids": [1, "2"]}', [], "line 1: prompt_ids must be a list of token ids (integers)"),
    ('{"prompt_ids": [1, 2], "max_new_tokens": 5000}', [], "request 0: .*exceeds the model's max_position_embeddings"),
    ('{"prompt_ids": [1, 2], "temperature": -1}', [], "line 1: temperature must be >= 0"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', [], "ships no chat template"),
    ('', [], "holds no requests"),
    ('{"prompt_ids": [1]}', ["--concurrency", "0"], "--concurrency must be >= 1"),
    ('{"prompt_ids": [1]}', ["--image", "x.png"], "--image does not go with --prompts-file"),
    ('{"prompt_ids": [1]}', ["--prompt", "x"], "--prompt/--prompt-ids does not go with --prompts-file"),
])
def test_prompts_file_errors(tmp_path, capsys, content, args, message):
    import re

    import generate
    path = tmp_path / "r.jsonl"
    path.write_text(content)
    assert generate.cli(["--prompts-file", str(path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and (message in err or re.search(message, err)), err


def test_concurrency_needs_a_prompts_file(capsys):
    import generate
    assert generate.cli(["--prompt", "x", "--concurrency", "4"]) == 2
    assert "--concurrency applies to --prompts-file" in capsys.readouterr().err
    assert generate.cli(["--prompts-file", "/no/such/file.jsonl"]) == 2
    assert "no such file" in capsys.readouterr().err


# ---- bench.py --concurrency: the arms in turns ------------------------------------------------------------


class Clock:
    """A fake time.perf_counter that steps of FakeArm advance."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class FakeArm:
    """A stand-in Batch whose steps(reqs) takes `costs` seconds of the fake clock, one per step, logging its name."""

    def __init__(self, name, costs, clock, log):
        self.name, self.costs, self.time, self.log = name, costs, clock, log

    def steps(self, reqs, on_step=None):
        for c in self.costs:
            self.time.now += c
            self.log.append(self.name)
            yield
        return [self.name] * len(reqs)

    def run(self, reqs):
        return batching.drain(self.steps(reqs))


def test_in_turns_steps_the_arm_behind_in_its_own_time(monkeypatch):
    """bench.in_turns: the arm with the least time of its own goes next (the first listed on a tie); each arm's time is
    the sum of its own steps'; each gets its own results."""
    import bench
    clock, log = Clock(), []
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    arms = [("a", FakeArm("a", [3, 3, 3], clock, log)), ("b", FakeArm("b", [1] * 7, clock, log))]
    out = bench.in_turns(arms, [0, 0])
    # a=0,b=0: a (tie) -> 3; b 1, 2, 3; tie: a -> 6; b 4, 5, 6; tie: a -> 9; b 7; b ends; a ends
    assert log == ["a", "b", "b", "b", "a", "b", "b", "b", "a", "b"]
    assert {k: (v.seconds, v.results) for k, v in out.items()} == {"a": (9, ["a", "a"]), "b": (7, ["b", "b"])}
    assert out["a"].held_seconds == 9 and out["a"].held_tokens == 0          # (no live rows yielded: the whole run)
    log.clear()
    assert bench.whole_runs(arms[::-1], [0])["b"].seconds == pytest.approx(7) and log == ["b"] * 7 + ["a"] * 3


def test_in_turns_reads_each_batch_decode_seconds_on_its_own_time(monkeypatch):
    """Two batches in turns, one of them slowed (20 ms per step): the other's requests' decode seconds count its own
    steps only, not the time the slow one stepped between them (and the outputs are those of a run alone)."""
    import time

    import bench
    target = random_target(tiny_target_config(), seed=3)
    reqs = [batching.Request([1, 2, 3], 12), batching.Request([4, 5], 9)]
    fast, slow = (batching.Batch(target, None, 1, 1, 64) for _ in range(2))
    alone = fast.run(reqs)
    step = slow.step
    monkeypatch.setattr(slow, "step", lambda rows: (time.sleep(0.02), step(rows)))
    out = bench.in_turns([("fast", fast), ("slow", slow)], reqs)
    seconds, results = out["fast"].seconds, out["fast"].results
    assert [r.output_ids for r in results] == [r.output_ids for r in alone] == [r.output_ids for r in out["slow"].results]
    assert out["slow"].seconds > 0.02 * 19 > seconds         # 10 + 7 steps of the slow one
    assert sum(r.decode_seconds for r in results) <= seconds and "clock" not in vars(fast)


def test_in_turns_measures_the_stretch_with_every_slot_live():
    """ArmRun.held_*: two slots, requests of 12, 4 and 4 tokens (AR, a tiny target). Slot 0 runs the first, slot 1
    the second then the third: steps 1-6 hold two live rows, then the queue is dry and steps 7-11 hold one. The held
    stretch ends with step 6: 15 tokens (12 + 4 + 4 in all), part of the batch's time; Batch.steps yields each step's
    live rows."""
    import bench
    target = random_target(tiny_target_config(), seed=3)
    reqs = [batching.Request([1, 2, 3], 12), batching.Request([4, 5], 4), batching.Request([6], 4)]
    eng = batching.Batch(target, None, 1, 2, 64)
    with torch.inference_mode():
        assert list(eng.steps(reqs)) == [2] * 6 + [1] * 5
    run = bench.in_turns([("ar", eng)], reqs)["ar"]
    assert [len(r.output_ids) for r in run.results] == [12, 4, 4]
    assert run.held_tokens == 15 and 0 < run.held_seconds < run.seconds
    assert run.tokens_per_s() == pytest.approx(15 / run.held_seconds)
    assert run.tokens_per_s(held=False) == pytest.approx(20 / run.seconds)
    # steady: the 12 tokens steps committed by then (15 less the 3 admissions' first tokens), over those steps'
    # seconds plus 12 x the admissions' seconds per step token (all 3 admissions / 17 step tokens)
    firsts = [r.prefill_seconds for r in run.results]
    assert run.held_admissions == 3 and run.admission_seconds == pytest.approx(sum(firsts))
    assert run.held_admission_seconds == pytest.approx(sum(firsts))
    steps = run.held_seconds - sum(firsts)
    assert steps > 0 and run.steady_tokens_per_s() == pytest.approx(12 / (steps + 12 * sum(firsts) / 17))


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_bench_concurrency_in_turns_whole_runs_and_aa(capsys):
    """bench.py --concurrency on the embedded pair: in turns (the default) and --whole-runs, the outputs identical to AR's;
    --aa times two AR batches (no rounds); --whole-runs and --aa need --concurrency."""
    import bench
    base = ["--concurrency", "2", "--heldout", "3", "--max-new-tokens", "12", "--threads", "1", "--repeat", "2"]
    for extra, timing in (([], "in_turns"), (["--whole-runs"], "whole_runs")):
        res = bench.main(base + extra)
        (row,) = res["concurrency"]
        assert res["timing"] == timing and not res["aa"] and row["identical"] and row["mean_acceptance"] > 1
        assert row["paired_range"][0] <= row["paired_speedup"] <= row["paired_range"][1]
        assert 0 < row["dflash_held_share"] <= 1 and row["queue_dflash_tokens_per_s"] > 0
        assert row["held_paired_speedup"] > 0 and row["ar_admission_ms"] > 0 and row["dflash_admission_ms"] > 0
    res = bench.main(base + ["--aa"])
    (row,) = res["concurrency"]
    assert res["aa"] and not res["adaptive"] and row["identical"] and row["round_share"] == 0 and not row["verify_blocks"]
    capsys.readouterr()
    for flag in ("--whole-runs", "--aa"):
        with pytest.raises(SystemExit):
            bench.parse_args([flag])
        assert f"{flag} is for --concurrency" in capsys.readouterr().err


class FakeRow:
    def __init__(self, tokens, block=16):
        step = type("S", (), {"tokens": [0] * tokens, "draft_ids": [0] * (block - 1)})()
        self.result = type("R", (), {"steps": [step]})()


def drive(policy, steps, round_s, tokens, plain_s=0.001, rows=4, blocks=None):
    """`steps` steps under the policy: a round of k commits min(`tokens`, k) per row in round_s (seconds, or a
    function of k), a plain step 1 in plain_s (seconds, or a function of whether a round came just before) -> the
    steps as a string (R round, . plain step); each round's k is appended to `blocks` when given."""
    out = ""
    for _ in range(steps):
        seconds = plain_s(out.endswith("R")) if callable(plain_s) else plain_s
        k = policy.speculate([FakeRow(1)] * rows)
        if k:
            k = 16 if k is True else k
            out += "R"
            if blocks is not None:
                blocks.append(k)
            policy.observe_round([FakeRow(min(tokens, k), k)] * rows, round_s(k) if callable(round_s) else round_s)
        else:
            out += "."
            policy.observe_plain([FakeRow(1)] * rows, seconds)
    return out


def test_policy_rounds_while_they_pay_and_probes_rarely_when_they_lose():
    """One verify block (blocks=(16,)): rounds or plain steps, from the measured costs."""
    p = batching.Policy(block=16, blocks=(16,))
    assert drive(p, 40, round_s=0.004, tokens=6) == "..." + ("R" * 16 + "..") * 2 + "R"   # 6 tokens for 4 plain
    # steps: rounds, with two plain steps after every 16 (the second re-times one: the first after a round also
    # carries the round's features into the drafter's context)
    p = batching.Policy(block=16, blocks=(16,))
    kinds = drive(p, 400, round_s=0.010, tokens=6, rows=8)                      # 6 tokens for 10 plain steps: loses
    assert kinds.startswith("...R.") and kinds.count("R") <= 8 and p.feeds      # probes, a few; a full block could pay
    waits = [len(w) for w in kinds.split("R")[1:-1]]                            # every 4 steps until 32 rows' acceptance
    assert waits[:3] == [4, 4, 4] and min(waits[3:]) >= 100                     # is in (4 rounds of 8), then a 4-step
    #                                                                             loss each: waits of 200
    kinds += drive(p, 1600, round_s=0.010, tokens=6, rows=8)
    assert kinds.count("R") == 8 and not p.feeds and kinds.endswith("." * 500)  # timed 3 times and 32 rows seen: 4
    #                                                                             losing probes: given up
    p = batching.Policy(block=16, blocks=(16,))
    kinds = drive(p, 1200, round_s=0.0065, tokens=6)              # losing within the margin: probes every 4 steps for
    assert kinds.count("R") == 29 and not p.feeds and kinds.endswith("." * 500)   # 32 rows, then every 26: given up
    #                                                                               when 16 in a row span 512 steps
    p = batching.Policy(block=16, blocks=(16,))
    kinds = drive(p, 1200, round_s=0.0057, tokens=6, rows=1)      # gain 1.05, one row: short of 1.1; probes every
    assert kinds.count("R") == 160 and not p.feeds                # 5 steps, given up once they span 512 plain steps
    p = batching.Policy(block=16, blocks=(16,))
    assert drive(p, 1200, round_s=0.0065, tokens=6, rows=1).count("R") == 64 and not p.feeds   # losing, one row: 32
    #                         probes at 4-step waits (they never count to give up), then 32 more spanning 512 steps
    p = batching.Policy(block=16, blocks=(16,))
    assert drive(p, 600, round_s=0.005, tokens=6, rows=1).count(".") < 80 and p.feeds          # paying, one row
    p = batching.Policy(block=16, blocks=(16,))
    kinds = drive(p, 300, round_s=0.020, tokens=15)                             # 20 plain steps a round: never pays
    assert kinds.count("R") == 3 and not p.feeds and kinds.endswith("." * 200)  # given up, the context unfed
    p = batching.Policy(block=16, blocks=(16,))      # one row whose first round commits 1 token (a text's first rounds
    assert drive(p, 4, round_s=0.005, tokens=1, rows=1) == "...R"       # are its worst): a probe again after 4 plain
    kinds = drive(p, 60, round_s=0.005, tokens=6, rows=1)                           # steps, not after 200, and rounds
    assert kinds.startswith("....R") and "RRR" in kinds                               # again once the mean pays


def test_policy_gives_rounds_up_when_they_do_not_pay_for_the_drafters_upkeep():
    """Rounds worth 1.13 plain steps (6 tokens per row in 5.3 ms, a plain step 1 ms) save 0.7 ms each; the
    drafter's upkeep outside rounds (observe_upkeep: appends, admitted prompts) charged 0.9 ms per step outweighs
    that, and the ledger ends rounds once 32 rounds of 8 rows are counted; at 0.3 ms per step rounds go on."""
    def run(upkeep):
        p, kinds = batching.Policy(block=16, blocks=(16,)), ""
        for _ in range(400):
            kinds += drive(p, 1, round_s=0.0053, tokens=6, rows=8)
            p.observe_upkeep(upkeep)
        return p, kinds
    p, kinds = run(0.0003)
    assert p.feeds and p.ledger > 0 and kinds.count("R") > 300
    p, kinds = run(0.0009)
    assert not p.feeds and p.ledger < 0 and p.ledger_rounds >= 32 and kinds.count("R") < 60
    assert kinds.endswith("." * 300)


def test_policy_gives_up_near_break_even_after_seconds_not_only_steps():
    """At N = 32 a plain step takes 16 ms: probes near break-even (gain 0.95) in a row, four or more (each holds 32
    rows: four hold 128), end rounds once they span `settle` seconds (2 s: 125 plain steps), not only after 512
    plain steps (8 s of the batch feeding the drafter's context for nothing)."""
    def until_given_up(policy):
        out = ""
        while policy.feeds and len(out) < 3000:
            out += drive(policy, 1, round_s=0.101, tokens=6, plain_s=0.016, rows=32)
        return out
    quick, slow = (until_given_up(batching.Policy(block=16, blocks=(16,), settle=s)) for s in (2.0, float("inf")))
    assert 7 <= quick.count("R") <= 14 and 125 <= quick.count(".") <= 200
    assert slow.count(".") > 400 and len(slow) < 3000       # the steps' guard (or the ledger, its 32 probes having
    #                                                         lost: 476 plain steps) alone: more than twice as long
    p = batching.Policy(block=16, blocks=(16,))                 # 1 ms steps: 512 of them (0.5 s) end it, after
    kinds = drive(p, 2000, round_s=0.0063, tokens=6, plain_s=0.001, rows=32)   # twice as many probes
    assert 32 <= kinds.count("R") <= 40 and not p.feeds


def test_policy_times_every_block_soon_when_rounds_lose():
    """N = 32 as measured on a CPU (plain step 16 ms; rounds of 16 / 8 / 4 / 2 in 136 / 68 / 60 / 40 ms, 3 tokens
    per row): every block loses (the best, 0.8 plain steps a round). No verdict comes before each block is timed
    three times, so those timings come as quick probes, every 4 plain steps, not at the waits of losing probes
    (38 steps here): rounds are given up after 2.6 s of plain steps, not 6.8 s."""
    cost, blocks = {16: 0.136, 8: 0.068, 4: 0.060, 2: 0.040}, []
    p, kinds = batching.Policy(block=16), ""
    while p.feeds and len(kinds) < 3000:
        kinds += drive(p, 1, round_s=lambda k: cost[k], tokens=3, plain_s=0.016, rows=32, blocks=blocks)
    assert sorted(blocks[:12]) == sorted([16, 8, 4, 2] * 3) and kinds[:50].count("R") == 12
    assert len(kinds) < 200 and not p.feeds


def test_policy_probes_remeasure_longer_blocks():
    """A round of k measures the acceptance of blocks up to k only. After a stretch where every block loses and the
    best is the shortest (2 tokens a round), the text turns easy (12 tokens): probes of the best block alone would
    never see it (a round of 2 still commits 2); every other probe takes the next longer block, so the acceptance of
    longer blocks is re-measured, and rounds of 8 and 16 come back."""
    cost = lambda k: 0.002 + 0.0002 * k                          # 16: 5.2 ms, 8: 3.6, 4: 2.8, 2: 2.4; plain 1 ms
    p, blocks = batching.Policy(block=16, patience=10**9), []
    drive(p, 400, round_s=cost, tokens=2, blocks=blocks)
    assert p.best() == 2 and p.feeds
    kinds = drive(p, 1500, round_s=cost, tokens=12, blocks=blocks)
    assert "R" * 16 in kinds and p.best() in (8, 16) and blocks[-20:].count(2) <= 2


def test_policy_compares_costs_timed_over_the_same_stretch():
    """The machine's speed drifts. Rounds pay while the machine is slow (12 tokens for 6.5 ms against 1.3 ms
    plain steps), then the text turns hard (4 tokens) as the machine turns fast (rounds 5 ms, plain steps 1 ms):
    rounds are worth 0.8 plain steps. While rounds go on a plain step is timed once per 16 rounds, so its samples
    reach far back: set against the fast rounds, the slow plain steps made rounds look worth 1.04 and run on for
    about 130 rounds. Compared over the same stretch of steps, the costs say 0.8 within a few rounds."""
    fast = [False]
    plain = lambda after_round: 0.001 if fast[0] else 0.0013
    p = batching.Policy(block=16, blocks=(16,))
    assert drive(p, 300, round_s=0.0065, tokens=12, plain_s=plain).count("R") > 250
    fast[0] = True
    kinds = drive(p, 300, round_s=0.005, tokens=4, plain_s=plain)
    assert kinds.find("." * 20) < 40, kinds[:80]                 # plain steps within a few rounds, and for good
    assert kinds[40:].count("R") < 10


def test_policy_times_plain_steps_without_the_switch_from_rounds():
    """The first plain step after a round also carries the round's features into the drafter's context (here 3 ms
    against 1 ms). Rounds pay (6 tokens in 5 ms), then cost 7 ms (0.86 plain steps): the plain steps that re-time
    one after 16 rounds must say 1 ms, or rounds would look worth 2.6 plain steps and go on losing."""
    p = batching.Policy(block=16, blocks=(16,))
    switch = lambda after_round: 0.003 if after_round else 0.001
    assert drive(p, 300, round_s=0.005, tokens=6, plain_s=switch).count("R") > 250
    assert drive(p, 300, round_s=0.007, tokens=6, plain_s=switch).count("R") < 40
    assert max(p.plain) == 0.001


def test_policy_charges_the_switch_after_a_round_to_that_round():
    """A probe between plain steps costs its round and the next plain step's extra (the round's features carried
    into the drafter's context: 2 ms here). Probes of 5.2 ms for 6 tokens alone would look worth 1.15 plain steps
    and bring rounds back; with the switch, 7.2 ms (0.83): rounds stay off."""
    switch = lambda after_round: 0.003 if after_round else 0.001
    p = batching.Policy(block=16, blocks=(16,), min_samples=4, min_rounds=1)
    drive(p, 30, round_s=0.010, tokens=6, plain_s=switch)                           # losing: plain steps, probes
    assert "RR" not in drive(p, 600, round_s=0.0052, tokens=6, plain_s=switch)
    assert statistics.median(p.seconds[16]) == pytest.approx(0.0072)
    p = batching.Policy(block=16, blocks=(16,), min_samples=4, min_rounds=1)         # without a switch's cost the same
    drive(p, 30, round_s=0.010, tokens=6)                                           # probes bring rounds back
    assert "RRR" in drive(p, 600, round_s=0.0052, tokens=6)


def test_policy_margin_keeps_noise_near_break_even_from_starting_rounds():
    p = batching.Policy(block=16, blocks=(16,), min_samples=4, min_rounds=1)     # (no quick probes after the first round)
    drive(p, 5, round_s=0.010, tokens=6)                                       # loses: plain steps
    assert drive(p, 20, round_s=0.0058, tokens=6).count("R") <= 1              # gain 1.03: not enough to come back
    assert "RRR" in drive(p, 600, round_s=0.005, tokens=6)                     # gain 1.2: rounds again


def test_policy_chooses_the_verify_block_that_pays_most():
    """A verify whose cost grows with its tokens (a compute-bound batch): 1 ms + 0.45 ms per token, a plain step 1 ms,
    6 tokens accepted of any longer block. Per round: 16 -> 6 tokens in 8.2 ms (0.73 plain steps), 8 -> 6 in 4.6
    (1.30), 4 -> 4 in 2.8 (1.43), 2 -> 2 in 1.9 (1.05). The policy times each block, the longest first, then
    takes rounds of 4, with a round of 8 now and then (its acceptance re-measured); where no block pays it takes
    plain steps. Where a round's cost hardly grows with its block, the whole block wins."""
    assert batching.verify_blocks(16) == (16, 8, 4, 2) and batching.verify_blocks(6) == (6, 3) == batching.Policy(block=6).blocks
    p = batching.Policy(block=16)
    assert drive(p, 4, round_s=0.01, tokens=6) == "...R"          # one round of 16 estimates every shorter block
    assert {k: list(v) for k, v in p.tokens.items()} == {16: [6], 8: [6], 4: [4], 2: [2]}
    p, blocks = batching.Policy(block=16), []
    kinds = drive(p, 300, round_s=lambda k: 0.001 + 0.00045 * k, tokens=6, blocks=blocks)
    assert kinds.startswith("...RRRR") and kinds.count(".") < 40 and blocks[:4] == [16, 8, 4, 2] and blocks[4:].count(16) == 2
    assert blocks[4:].count(4) > 0.9 * len(blocks[4:]) and 8 in blocks[4:]
    p, blocks = batching.Policy(block=16), []                                   # 0.3 ms + 0.9 ms per token: none pays
    kinds = drive(p, 1000, round_s=lambda k: 0.0003 + 0.0009 * k, tokens=1, blocks=blocks)    # each block timed 3
    assert kinds.startswith("...RRRR.") and blocks[:12] == [16, 8, 4, 2] * 3          # times, then losing probes of 2
    assert kinds.count("R") == 19 and kinds.endswith("." * 100) and not p.feeds      # until 32 rows: given up
    p = batching.Policy(block=16)                                               # the same with one row: no verdict
    kinds = drive(p, 600, round_s=lambda k: 0.0003 + 0.0009 * k, tokens=1, rows=1)    # from 4 probes of one row
    assert p.feeds and kinds.count("R") > 8
    p, blocks = batching.Policy(block=16), []                                   # 3 ms + 0.1 ms per token, 12 accepted
    kinds = drive(p, 200, round_s=lambda k: 0.003 + 0.0001 * k, tokens=12, blocks=blocks)
    assert blocks[:4] == [16, 8, 4, 2] and blocks[-60:] == [16] * 60            # (after re-timing the others)
    first = {}                                  # a slow moment of the machine times the first rounds of 8 and 4 at 3x

    def noisy(k):
        first[k] = first.get(k, 0) + 1
        return (0.001 + 0.00045 * k) * (3 if k in (8, 4) and first[k] == 1 else 1)
    p, blocks = batching.Policy(block=16), []
    kinds = drive(p, 300, round_s=noisy, tokens=6, blocks=blocks)     # probes re-time them: rounds of 4 again
    assert kinds.count("R") > 200 and blocks[-100:].count(4) > 90
    with pytest.raises(dflash.GenerationError, match="policy blocks"):
        batching.Policy(block=8, blocks=(16, 4))
