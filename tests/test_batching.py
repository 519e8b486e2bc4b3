"""Many requests at once (engine.Engine with N slots): every row's output == the same request run alone, whatever
else is in the batch, for every acceptance length on every row, any pattern of rounds (of any verify block) and
plain steps, stop tokens, max_new_tokens, arrival orders and N from 1 to 8. The policy's own tests: test_policy.py."""
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dflash
import engine
from engine import Sampling
import mtp
from helpers import Early, OracleProposer, property_cases, raise_case, kind_draft_config, random_drafter, random_target, randomize_, tiny_target_config
from policy import Alternate, Scripted
from test_spec_equals_ar import first_divergence_is_near_tie, target_configs

pytestmark = pytest.mark.usefixtures("one_thread")      # tiny eager models: one thread (conftest.py)

MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=20)


class Pattern(Scripted):
    """A stand-in policy (policy.Scripted) that cycles through a fixed pattern of rounds (True: the
    whole block; k: a round that verifies min(k, block) tokens) and plain steps (False)."""

    def __init__(self, pattern, block):
        self.pattern, self.block, self.i = pattern, block, 0
        self.blocks = tuple(sorted({self.k(x) for x in pattern if x}, reverse=True)) or (block,)

    def k(self, x) -> int:
        return self.block if x is True else min(int(x), self.block)

    def speculate(self):
        self.i += 1
        return self.k(self.pattern[(self.i - 1) % len(self.pattern)])


class RandomPattern(Pattern):
    """A stand-in policy: a round or a plain step by a seeded coin, a round's verify block drawn from 1..block
    (the whole block half the time): the output must not depend on either."""

    def __init__(self, seed, block=16):
        self.rng, self.block = random.Random(seed), block
        self.blocks = tuple(range(block, 0, -1))

    def speculate(self):
        if self.rng.random() >= 0.6:
            return 0
        return self.block if self.rng.random() < 0.5 else self.rng.randint(1, self.block)


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
        reqs.append(engine.Request(prompt, max_new, stops))
    return reqs


def check_batch(target, reqs, slots, block, seed, dtype, drafter_kind="dflash"):
    """AR at N slots, DFlash at N slots behind the oracle (with and without a random pattern of plain steps and rounds
    of random verify blocks) and behind a random drafter (whole-block rounds, and the random pattern): each request's
    output == its run alone (engine.run, AR, one slot)."""
    alone = [engine.run(target, r.prompt_ids, r.max_new_tokens, r.stop_ids).output_ids for r in reqs]
    cont = {tuple(r.prompt_ids): out for r, out in zip(reqs, alone)}
    capacity = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs) + block
    oracle = OracleProposer(cont, target.cfg.vocab_size, seed)
    drafter = random_drafter(kind_draft_config(target.cfg, drafter_kind, target_layer_ids=[seed % target.cfg.num_hidden_layers],
                                               num_target_layers=None), seed, dtype)
    runs = {
        "ar": engine.Engine(target, None, 1, slots, capacity).run(reqs),
        "oracle": engine.Engine(target, oracle, block, slots, capacity).run(reqs),
        "pattern": engine.Engine(target, OracleProposer(cont, target.cfg.vocab_size, seed + 1), block, slots, capacity,
                                 policy=RandomPattern(seed, block)).run(reqs),
        "drafter": engine.Engine(target, engine.DrafterProposer(drafter, target), block, slots, capacity).run(reqs),
        "drafter pattern": engine.Engine(target, engine.DrafterProposer(drafter, target), block, slots, capacity,
                                         policy=RandomPattern(seed + 2, block)).run(reqs),
    }
    for name, results in runs.items():
        for r, res, want in zip(reqs, results, alone):
            if dtype == torch.float64 or res.output_ids == want:
                assert res.output_ids == want, (name, r)
            else:
                assert first_divergence_is_near_tie(target, r.prompt_ids, want, res.output_ids, 1e-4), name
            assert res.prompt_ids == r.prompt_ids
            # the trace contract, per row: the steps' tokens make up the output, acceptance lengths sum to it, one
            # entry per step after prefill; a plain step commits 1 and drafted nothing, a round's drafts are k - 1
            assert [t for s in res.steps for t in s.tokens] == res.output_ids
            assert sum(res.acceptance_lengths) + 1 == len(res.output_ids) or name == "ar"
            assert len(res.acceptance_lengths) == len(res.draft_ids) == len(res.step_kinds)
            assert all(1 <= a <= block for a in res.acceptance_lengths)
            assert all(s.accepted <= len(s.draft_ids) <= block - 1 for s in res.steps if s.kind == "verify")
            assert all((a, d) == (1, []) for a, d, k in zip(res.acceptance_lengths, res.draft_ids, res.step_kinds)
                       if k == "plain")
            assert {s.kind for s in res.steps[1:]} <= ({"decode"} if name == "ar" else {"verify", "plain"})
            assert "plain" not in res.step_kinds or "pattern" in name
            assert [s.stop for s in res.steps] == [False] * (len(res.steps) - 1) + [True]
    return oracle, runs


@st.composite
def moe_or_dense(draw):
    cfg = draw(target_configs())
    if draw(st.booleans()):
        cfg = tiny_target_config(**{**vars(cfg), **MOE})
    return cfg


@settings(max_examples=20, deadline=None)
@given(cfg=moe_or_dense(), seed=st.integers(0, 10**6), n_req=st.integers(1, 10), slots=st.integers(1, 8),
       block=st.integers(1, 16), max_len=st.sampled_from([8, 60, 200]))
def batch_equals_alone(dtype, cfg, seed, n_req, slots, block, max_len):
    """test_batch_equals_alone's property, for one dtype."""
    target = random_target(cfg, seed, dtype)
    rng = random.Random(seed)
    reqs = make_requests(rng, cfg.vocab_size, n_req, max_len,
                         lambda p, m, s: engine.run(target, p, m, s).output_ids)
    check_batch(target, reqs, slots, block, seed, dtype, rng.choice(["dflash", "sliding", "dflash2"]))


BATCH_DTYPES = (torch.float64, torch.float32)


def batch_properties() -> list:
    """batch_equals_alone's search for each of BATCH_DTYPES, in a process of its own started with the suite."""
    return property_cases(batch_equals_alone, [{"dtype": d} for d in BATCH_DTYPES])


BATCH_PROPERTIES = Early(batch_properties, process=True, used_by=["test_batch_equals_alone"])


@pytest.mark.parametrize("case", range(len(BATCH_DTYPES)), ids=[str(d).replace("torch.", "") for d in BATCH_DTYPES])
def test_batch_equals_alone(case):
    """Random dense or MoE targets, requests, slots, blocks and drafters (check_batch): every row of the batch equals
    its request run alone (its examples drawn in a process of its own, helpers.Early)."""
    raise_case(BATCH_PROPERTIES.result()[case])


def test_every_acceptance_length_on_every_row():
    """Rows accept independently: in one batch, each row sees every acceptance length 0..block-1, and the rows'
    lengths in the same round differ."""
    cfg = tiny_target_config(vocab_size=50)
    target = random_target(cfg, 3)
    rng = random.Random(1)
    block = 6
    reqs = [engine.Request([rng.randrange(50) for _ in range(rng.randint(5, 40))], 120) for _ in range(4)]
    oracle, _ = check_batch(target, reqs, 4, block, 5, torch.float64)
    for r in reqs:
        seen = {a for p, _, a in oracle.asked if p == tuple(r.prompt_ids)}
        assert seen == set(range(block)), seen
    by_start = {}
    for p, s, a in oracle.asked:
        by_start.setdefault(len(by_start) // 4, []).append(a)
    assert any(len(set(v)) > 1 for v in by_start.values())


def test_a_request_that_ends_at_its_first_token_leaves_its_slot_free():
    """A request with max_new_tokens 1 ends at admission (its token comes from the prompt): its slot then rides at
    position 0 like any free slot, so no step treats it as live (the proposer is never asked to draft for it)."""
    cfg = tiny_target_config(vocab_size=50)
    target = random_target(cfg, 4)
    rng = random.Random(3)
    reqs = [engine.Request([rng.randrange(50) for _ in range(n)], new) for n, new in ((12, 30), (9, 1), (7, 20), (5, 1))]
    alone = [engine.run(target, r.prompt_ids, r.max_new_tokens).output_ids for r in reqs]
    oracle = OracleProposer({tuple(r.prompt_ids): out for r, out in zip(reqs, alone)}, 50, 0, 4)
    got = engine.Engine(target, oracle, 4, 3, 64).run(reqs)
    assert [r.output_ids for r in got] == alone
    assert {p for p, _, _ in oracle.asked} == {tuple(reqs[0].prompt_ids), tuple(reqs[2].prompt_ids)}


def test_admission_order_and_slots_do_not_matter():
    """The same requests in another order, through 1, 3 and 8 slots: each request's output is the same."""
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 8)
    d = random_drafter(kind_draft_config(cfg, "dflash", block_size=8), 4)
    rng = random.Random(2)
    reqs = [engine.Request([rng.randrange(40) for _ in range(rng.randint(1, 50))], rng.randint(1, 30)) for _ in range(9)]
    want = None
    for slots in (1, 3, 8):
        order = list(range(len(reqs)))
        rng.shuffle(order)
        res = engine.Engine(target, engine.DrafterProposer(d, target), 8, slots, 100).run([reqs[i] for i in order])
        got = {i: r.output_ids for i, r in zip(order, res)}
        want = want or got
        assert got == want


def test_sampled_rows_equal_their_runs_alone():
    """float64: a request's samples at concurrency 1, 4 and 8, AR and DFlash == its run alone (engine.run: one slot,
    caches sized for it, AR) for its own seed, beside greedy rows and rows with other settings."""
    cfg = tiny_target_config(vocab_size=30)
    target = random_target(cfg, 9)
    d = random_drafter(kind_draft_config(cfg, "dflash", block_size=8), 4)
    rng = random.Random(3)
    settings_ = [Sampling(), Sampling(0.7), Sampling(1.3, top_p=0.8), Sampling(1.0, top_k=4), Sampling(0.9, 0.9, 6)]
    reqs = [engine.Request([rng.randrange(30) for _ in range(rng.randint(1, 30))], rng.randint(5, 30), (),
                           settings_[i % len(settings_)], seed=100 + i) for i in range(8)]
    alone = [engine.run(target, r.prompt_ids, r.max_new_tokens, sampling=r.sampling, seed=r.seed).output_ids for r in reqs]
    for slots in (1, 4, 8):
        for proposer, block in ((None, 1), (engine.DrafterProposer(d, target), 8)):
            res = engine.Engine(target, proposer, block, slots, 80).run(reqs)
            assert [r.output_ids for r in res] == alone, (slots, proposer)
            assert [r.seed for r in res] == [None if r.sampling.greedy else r.seed for r in reqs]


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_dflash2_sampled_drafts_rows_equal_their_runs_alone(slots):
    """float64: DFlash2 samples a sampled request's block (the coupled rule: the TARGET stream; the ratio rule: its
    own DRAFT stream, judged by min(1, p/q)); each row's drafts, acceptances and output == its run alone
    (engine.run: one slot) for its seed, beside greedy rows and rows under the other rule, at any concurrency."""
    cfg = tiny_target_config(vocab_size=30)
    target = random_target(cfg, 5)
    d = random_drafter(kind_draft_config(cfg, "dflash2", block_size=6, target_layer_ids=[0, 2], num_target_layers=None), 6)
    rng = random.Random(8)
    settings_ = [Sampling(0.8, draft_rule="ratio"), Sampling(), Sampling(1.2), Sampling(1.0, 0.9, 5, "ratio"),
                 Sampling(0.0, draft_rule="ratio"), Sampling(0.7, top_k=4)]
    reqs = [engine.Request([rng.randrange(30) for _ in range(rng.randint(1, 20))], rng.randint(5, 30), (),
                           settings_[i % len(settings_)], seed=40 + i) for i in range(9)]
    proposer = engine.DrafterProposer(d, target)
    alone = [engine.run(target, r.prompt_ids, r.max_new_tokens, (), proposer, 6, sampling=r.sampling, seed=r.seed)
             for r in reqs]
    res = engine.Engine(target, engine.DrafterProposer(d, target), 6, slots, 60).run(reqs)
    for r, got, want in zip(reqs, res, alone):
        assert got.draft_ids == want.draft_ids and got.acceptance_lengths == want.acceptance_lengths, r.sampling
        assert got.output_ids == want.output_ids, r.sampling
    ratio = [a for r, x in zip(reqs, res) if r.sampling.draft_rule == "ratio" and not r.sampling.greedy
             for a in x.acceptance_lengths]
    assert 1 in ratio and max(ratio) > 1                       # rejections and acceptances under the ratio rule
    ar = [engine.run(target, r.prompt_ids, r.max_new_tokens, sampling=r.sampling, seed=r.seed).output_ids for r in reqs]
    assert all((x.output_ids == a) == (r.sampling.draft_rule == "coupled" or r.sampling.greedy)
               for r, x, a in zip(reqs, res, ar))            # the ratio rule's text is another sample than AR's


def test_bad_requests_name_the_request():
    """Every request is checked before any runs; among several, the error names the first bad one."""
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 1)
    b = engine.Engine(target, None, 1, 2, 30)
    with pytest.raises(dflash.GenerationError, match="request 1: .*exceeds the cache length 30"):
        b.run([engine.Request([1, 2], 5), engine.Request([1] * 20, 20)])
    with pytest.raises(dflash.GenerationError, match="request 0: the prompt is empty"):
        b.run([engine.Request([], 5), engine.Request([1], 5)])
    with pytest.raises(dflash.GenerationError, match="^the prompt is empty"):      # one request: the message alone
        b.run([engine.Request([], 5)])
    with pytest.raises(dflash.GenerationError, match="--concurrency must be >= 1"):
        engine.Engine(target, None, 1, 0, 30)
    d = random_drafter(kind_draft_config(cfg, "dflash", block_size=8), 1)
    with pytest.raises(dflash.GenerationError, match="block size 9 exceeds the drafter's block_size 8"):
        engine.Engine(target, engine.DrafterProposer(d, target), 9, 2, 30)
    with pytest.raises(dflash.GenerationError, match="block size must be >= 1"):
        engine.Engine(target, engine.DrafterProposer(d, target), 0, 2, 30)


def batches_without_recompiles() -> list:
    """The work of the test below, in a process of its own (helpers.Early): per proposer kind, a traced batch
    (helpers.dynamo_only) warmed up on 4 requests, then 7 later ones under error_on_recompile -> (kind, dynamo's
    unique graphs after the warm-up and after the later requests, whether any later request verified, per later
    request whether its tokens are the eager batch's or part from them only at a near-tie)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from helpers import dynamo_only
    out = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        dynamo_only(monkeypatch)
        cfg = tiny_target_config(vocab_size=40)
        target = random_target(cfg, 2, torch.float32)
        rng = random.Random(5)

        def requests(k):
            return [engine.Request([rng.randrange(40) for _ in range(rng.randint(1, 30))], rng.randint(1, 20))
                    for _ in range(k)]

        def drafter(kind, seed):
            return engine.DrafterProposer(random_drafter(kind_draft_config(cfg, kind, block_size=4), seed, torch.float32),
                                          target)
        head = randomize_(mtp.MTPHead(cfg), 4).float().eval()
        # the DFlash drafter through rounds of every verify block and plain steps; the other drafters and the MTP
        # head (its pending rows one column wider, its next ids kept) through whole-block rounds and plain steps
        for kind, make, policy in (("dflash", lambda: drafter("dflash", 3), Alternate((2, 4))),
                                   ("sliding", lambda: drafter("sliding", 6), Alternate((4,))),
                                   ("dflash2", lambda: drafter("dflash2", 7), Alternate((4,))),
                                   ("mtp", lambda: mtp.MTPProposer(head, target, 3), Alternate((4,)))):
            eng = engine.Engine(target, make(), 4, 3, 64, compile_mode="default", policy=policy)
            eng.run(requests(4))                                    # warm-up: every step kind compiles once
            graphs = counters["stats"]["unique_graphs"]
            later = requests(7)
            with torch._dynamo.config.patch(error_on_recompile=True):
                got = eng.run(later)
            eager = engine.Engine(target, make(), 4, 3, 64).run(later)
            same = [a.output_ids == b.output_ids or
                    first_divergence_is_near_tie(target, a.prompt_ids, b.output_ids, a.output_ids, 1e-4)
                    for a, b in zip(got, eager)]
            out.append((kind, graphs, counters["stats"]["unique_graphs"], any(len(r.verify_lengths) for r in got), same))
    return out


# started with the suite, in a process of its own
NO_RECOMPILES = Early(batches_without_recompiles, process=True, used_by=["test_no_recompiles_across_admissions_and_finishes"])


def test_no_recompiles_across_admissions_and_finishes():
    """Compiled with N = 3, DFlash, sliding-window and DFlash2 drafters and the MTP head: requests of other lengths
    arriving and finishing at other times, greedy, never recompile (a recompile raises); the tokens are the eager
    batch's. Dynamo's guards decide recompiles, so the steps run traced but without inductor's code
    (helpers.dynamo_only); the inductor-compiled batch is tested against eager in test_compile.py and test_flex.py."""
    for kind, before, after, verified, same in NO_RECOMPILES.result():
        assert after == before, kind
        assert verified, kind
        assert all(same), (kind, same)


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
    reqs = [engine.Request([rng.randrange(40) for _ in range(rng.randint(shortest, 30 if shortest > 1 else 4))],
                           rng.randint(20, 70)) for _ in range(5 if shortest > 1 else 9)]
    results = engine.Engine(target, engine.DrafterProposer(drafter, target), block, slots, 120,
                            policy=Pattern(pattern, block)).run(reqs)
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
