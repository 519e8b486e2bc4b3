"""Adaptive speculation and the default draft window: output == AR whatever the engine does at each step (rounds
and plain steps in any pattern, with a stand-in proposer forcing every acceptance length and with real drafters);
the drafter's proposals after a stretch of plain steps == the drafter run from scratch on full-forward features;
the trace keeps its contract; the measuring policy switches as the costs say; the default window comes from
the drafter's config and the flag overrides it."""
import json
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import adaptive
import checkpoint as ckpt
import dflash
import generate
from helpers import (OracleProposer, embedded_pair, HAS_EMBEDDED_PAIR, kind_draft_config, random_drafter, random_target,
                     tiny_target_config)
from test_spec_equals_ar import scratch_mask


@settings(max_examples=25)
@given(pattern=st.lists(st.sampled_from([True, False, "look"]), min_size=1, max_size=12), seed=st.integers(0, 10 ** 6),
       block=st.sampled_from([2, 4, 8, 16]), prompt_len=st.integers(1, 40))
def test_any_step_pattern_equals_ar(pattern, seed, block, prompt_len):
    """Rounds, plain steps and looks (plain steps that draft first) in a forced pattern: output == AR with the
    stand-in proposer (every acceptance length) and with a random real drafter (float64: exactly); the trace lists
    one entry per step, a plain step (look or not) as 1 with no drafts."""
    rng, dtype = random.Random(seed), torch.float64
    target = random_target(tiny_target_config(vocab_size=50), seed % 97, dtype)
    prompt = [rng.randrange(50) for _ in range(prompt_len)]
    ar = dflash.run(target, prompt, 40)
    oracle = OracleProposer(len(prompt), ar.output_ids, 50, seed)
    drafter = random_drafter(kind_draft_config(target.cfg, rng.choice(["dflash", "sliding", "dflash2"]), target_layer_ids=[0, 2],
                                               num_target_layers=None, block_size=16), seed % 89, dtype)
    for proposer in (oracle, dflash.DrafterProposer(drafter, target)):
        eng = dflash.Engine(target, proposer, block, 128, policy=adaptive.Pattern(pattern))
        res = eng.run(prompt, 40)
        assert res.output_ids == ar.output_ids, (pattern, type(proposer).__name__)
        assert 1 + sum(res.acceptance_lengths) == len(res.output_ids)
        assert len(res.draft_ids) == len(res.acceptance_lengths) == len(res.step_kinds)
        for kind, a, d in zip(res.step_kinds, res.acceptance_lengths, res.draft_ids):
            assert (kind, a, d) == ("plain", 1, []) if kind == "plain" else (kind == "verify" and len(d) == block - 1)


@pytest.mark.parametrize("kind,block,pattern", [("dflash", 8, [False] * 5 + [True]), ("dflash", 4, [True, False, "look"]),
                                                ("sliding", 8, [False] * 7 + ["look"] + [False] * 11 + [True, True]),
                                                ("dflash2", 16, ["look", True]), ("dflash", 8, [False] * 16 + ["look", False, True])])
def test_drafts_after_plain_steps_equal_drafter_from_scratch(kind, block, pattern):
    """After any stretch of plain steps (shorter and longer than a block: the feature buffer appended when full),
    every proposal, a round's or a look's, == the drafter run from scratch on full-forward target features of the
    committed prefix."""
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 7)
    dcfg = kind_draft_config(cfg, kind, block_size=16, target_layer_ids=[0, 2, 3], num_target_layers=None)
    drafter = random_drafter(dcfg, 7)
    prompt = [random.Random(7).randrange(40) for _ in range(23)]
    res = dflash.Engine(target, dflash.DrafterProposer(drafter, target), block, 160, policy=adaptive.Pattern(pattern)).run(prompt, 90)
    assert res.step_kinds.count("plain") >= 20 and res.step_kinds.count("verify") >= 3
    looks = [s for s in res.steps if s.look is not None]
    assert len(looks) >= 2 * ("look" in pattern)
    seq = torch.tensor([prompt + res.output_ids])
    with torch.no_grad():
        _, feats = target(seq, torch.arange(seq.shape[1]), feature_layers=tuple(dcfg.target_layer_ids))
        for step in [s for s in res.steps if s.kind == "verify" or s.look is not None]:
            start = step.start
            blk = torch.full((1, block), dcfg.mask_token_id)
            blk[0, 0] = seq[0, start]
            masks = {k: scratch_mask(start, block, *k) for k in set(drafter.kinds)}
            h = drafter(target.embed_tokens(blk), feats[:, :start], torch.arange(start, start + block), torch.arange(start), masks)
            proposals = step.draft_ids if step.kind == "verify" else step.look
            assert drafter.propose(h[0, 1:], blk[0, :1], target.lm_head)[0].tolist() == proposals, start


class FakeStep:
    def __init__(self, kind, tokens, seconds, look=None, look_s=0.0):
        self.kind, self.tokens, self.draft_seconds, self.verify_seconds, self.look = kind, tokens, look_s, seconds, look


def drive(p, n, round_tokens, proposals=(), round_s=0.020):
    """n steps under policy p: a round commits round_tokens tokens in round_s; a plain step commits token 0 in
    10 ms, and a look proposes `proposals` in 5 ms. -> the steps as a string: R round, . plain step, L look."""
    kinds = ""
    for _ in range(n):
        if p.speculate():
            kinds += "R"
            p.observe(FakeStep("verify", [0] * round_tokens, round_s))
        else:
            look = p.look()
            kinds += "L" if look else "."
            p.observe(FakeStep("plain", [0], 0.010, list(proposals) if look else None, 0.005 if look else 0.0))
    return kinds


def test_policy_follows_the_measured_costs():
    """A generation opens with a look; if it misses, the next comes after first_wait plain steps. Before a round is timed, a round is estimated as a look (5 ms) and two plain
    steps (10 ms each): 25 ms, so the look starts speculating once two of its proposals are matched (3 tokens per
    25 ms beat 1 per 10). Rounds of 3 tokens at 20 ms against plain steps at 10 ms pay (150 vs 100 tok/s) and go
    on; rounds of 1 token lose: `wait` plain steps, the last a look; a look whose proposals the next tokens miss
    doubles the wait (up to max_wait); one whose proposals they match resumes speculating as soon as the matched
    ones would have paid, now at the measured round time."""
    p = adaptive.Adaptive(first_wait=4, max_wait=16, window=2, min_rounds=2)
    assert drive(p, 6, 3, [0, 0, 0]) == "L.RRRR"
    assert drive(p, 2 + 4 + 8 + 16 + 16, 1, [1, 1, 1]) == "RR" + "...L" + "." * 7 + "L" + ("." * 15 + "L") * 2
    assert drive(p, 16 + 2, 4, [0, 0, 0, 5]) == "." * 15 + "L" + "RR"   # 1 matched + bonus: 2 tokens / 20 ms pays
    p = adaptive.Adaptive(first_wait=4, max_wait=16, window=2, min_rounds=2)
    # a missed opening look waits first_wait; later misses double it
    assert drive(p, 1 + 4 + 8 + 16, 1, [1]) == "L" + "..." + "L" + "." * 7 + "L" + "." * 15 + "L"
    p = adaptive.Adaptive(first_wait=4, max_wait=16, window=2, min_rounds=2)
    # resumed on the look's word, the look and one round are judged: (3 + 1) tokens / 2 per 30 ms loses; the look
    # was lucky, so the wait doubles: 8 plain steps, the last a look
    assert drive(p, 4, 1, [0, 0, 0], round_s=0.030) == "L.R."
    assert drive(p, 6 + 6, 4, [0, 0, 0, 5], round_s=0.030) == "." * 6 + "L" + "." + "RRRR"   # at 30 ms: two matches


def test_policy_opens_with_a_look_and_estimates_rounds():
    """The first step is a plain step that looks, whatever came before reset(); a round's cost is estimated from
    the look and the plain steps until a round is timed, then measured."""
    p = adaptive.Adaptive(verify_steps=2.0)
    for _ in range(2):
        assert p.speculate() is False and p.look() is True
        assert p.round_s is None
        p.observe(FakeStep("plain", [0], 0.010, [9], 0.004))
        assert p.round_s == pytest.approx(0.004 + 2 * 0.010)
        p.observe(FakeStep("verify", [0], 0.050))
        assert p.round_s == pytest.approx(0.050)
        p.reset()


def test_policy_judges_the_mean_of_rounds_against_medians():
    """The defaults: no verdict before 3 rounds (unless a look started them); the mean tokens of the last 8 rounds against the median step
    times: 2 tokens per 20 ms round vs 10 ms plain steps goes on, 1.9 stops; one slow plain step among others
    does not move the baseline; after a look resumed speculation, the look and one round are judged."""
    for tokens, goes_on in ((2.0, True), (1.9, False)):
        p = adaptive.Adaptive()
        p.plain_times, p.round_times, p.taus = [0.010] * 4, [0.020] * 4, [tokens] * 8
        assert p.paying() is goes_on
    p = adaptive.Adaptive()
    p.plain_times, p.round_times, p.taus = [0.010, 0.010, 0.500], [0.020] * 3, [1.9] * 8
    assert not p.paying()                                     # the 0.5 s outlier would have made 1.9 tokens pay
    p.taus = [1, 1]
    assert p.paying()                                         # two rounds: too few to judge
    p.resumed = True
    assert not p.paying()


def test_default_window_from_the_config(tmp_path):
    """train_context_length (dflash_config, written by train.py), else none, a sliding drafter's included (its
    sliding layers keep their own window, its full layers see everything: the z-lab package's reading);
    generate.py applies it unless --draft-window says otherwise (0 = none)."""
    from helpers import tiny_draft_config
    cfg = tiny_target_config()
    assert ckpt.default_draft_window(tiny_draft_config(cfg)) is None
    assert ckpt.default_draft_window(kind_draft_config(cfg, "sliding")) is None
    assert ckpt.draft_window(kind_draft_config(cfg, "sliding"), 7) == 7
    assert ckpt.default_draft_window(tiny_draft_config(cfg, train_context_length=300)) == 300
    d = random_drafter(tiny_draft_config(cfg, train_context_length=300, num_target_layers=None), 1, torch.float32)
    ckpt.save_drafter(d, str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dflash_config"]["train_context_length"] == 300
    assert ckpt.load_drafter(str(tmp_path), cfg).cfg.train_context_length == 300


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
@pytest.mark.parametrize("flag, window", [([], 208), (["--draft-window", "0"], None), (["--draft-window", "64"], 64)])
def test_generate_applies_the_default_window(capsys, flag, window):
    assert generate.main(["--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--json", *flag]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["draft_window"] == window and res["adaptive"] is True


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_adaptive_generate_equals_ar_on_a_long_prompt(capsys):
    """The embedded pair on a prompt longer than its training context, default settings: the output is AR's and the
    trace's contract holds (plain steps appear as 1 with no drafts)."""
    import bench
    target, drafter, _, _ = embedded_pair()
    prompt = bench.long_prompts(ckpt.load_tokenizer(target.path), 1, 600)[0]
    ids = ",".join(map(str, prompt))
    assert generate.main(["--prompt-ids", ids, "--max-new-tokens", "48", "--json", "--draft", "none"]) == 0
    ar = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert generate.main(["--prompt-ids", ids, "--max-new-tokens", "48", "--json"]) == 0
    sp = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sp["output_ids"] == ar["output_ids"] and len(sp["prompt_ids"]) == 600
    assert 1 + sum(sp["acceptance_lengths"]) == 48 and len(sp["step_kinds"]) == len(sp["draft_ids"]) == len(sp["acceptance_lengths"])


def test_replay_counts_what_the_policy_would_commit():
    """adaptive.replay on a hand-made recording: a round at t commits the proposals that equal the output, plus one;
    the time is summed from the given costs. Here drafts after token t propose the true next 3 tokens at t >= 4,
    nothing right before. Costs: plain 1, look 0.5, round 2."""
    out = list(range(20))
    drafts = [[99, 99, 99] if t < 4 else out[t + 1:t + 4] + [99] * (3 - len(out[t + 1:t + 4])) for t in range(19)]
    x, kinds = adaptive.replay(adaptive.Pattern([True]), out, drafts, 1.0, 0.5, 2.0)
    # rounds at t = 0, 1, 2, 3 commit 1 each; at 4, 8, 12, 16 commit 4 each (3 proposals + the bonus): 19 tokens
    assert kinds == "R" * 8 and x == pytest.approx(19 / 16)
    x, kinds = adaptive.replay(adaptive.Pattern([False, "look"]), out, drafts, 1.0, 0.5, 2.0)
    assert kinds == ".L" * 9 + "." and x == pytest.approx(19 / (19 + 9 * 0.5))
    x, kinds = adaptive.replay(adaptive.Adaptive(first_wait=4, verify_steps=2.0), out, drafts, 1.0, 0.5, 2.0)
    # the opening look at t = 0 misses (wait 4); the look at t = 4 matches 1, then 2: 3 tokens per estimated round
    # (none timed yet: a look and 2 plain steps, 2.5) pay, and rounds take the rest (4 + 4 + 4 + 1 tokens)
    assert kinds == "L" + "..." + "L." + "RRRR", kinds
    assert x == pytest.approx(19 / (1.5 + 3 + 1.5 + 1 + 4 * 2.0))


def test_recorded_drafts_are_the_drafts_of_rounds():
    """replay's premise: the proposals a look records after each token are those a round starting there drafts (the
    drafter's context is the committed prefix's features either way). float64, a random target and drafter."""
    rng, dtype = random.Random(3), torch.float64
    target = random_target(tiny_target_config(vocab_size=50), 3, dtype)
    prompt = [rng.randrange(50) for _ in range(17)]
    drafter = random_drafter(kind_draft_config(target.cfg, "dflash", target_layer_ids=[0, 2], num_target_layers=None,
                                               block_size=8), 5, dtype)
    prop = dflash.DrafterProposer(drafter, target)
    looked = dflash.Engine(target, prop, 8, 128, policy=adaptive.Pattern(["look"])).run(prompt, 60)
    rounds = dflash.Engine(target, prop, 8, 128).run(prompt, 60)
    assert looked.output_ids == rounds.output_ids
    drafts = [s.look for s in looked.steps[1:]]
    t = 0
    for a, d in zip(rounds.acceptance_lengths, rounds.draft_ids):
        assert drafts[t] == d, t
        t += a


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_bench_replay(capsys):
    """bench.py --replay on the embedded pair: a line per prompt and a summary whose figures follow from them;
    --policy settings reach the policy and bad ones are usage errors."""
    import bench
    s = bench.main(["--replay", "--threads", "1", "--heldout", "2", "--max-new-tokens", "24", "--policy", "first_wait=4"])
    out = capsys.readouterr().out
    assert out.count("\nprompt ") + out.startswith("prompt ") == 2 and s["prompts"] == 2
    assert s["policy"] == {"first_wait": 4} and 0 < s["adaptive_min"] <= s["adaptive_speedup"] and s["rounds_speedup"] > 0
    assert json.loads(out.strip().splitlines()[-1]) == s
    for bad in (["--replay", "--policy", "wait=4"], ["--replay", "--policy", "first_wait=x"], ["--policy", "first_wait=4"],
                ["--replay", "--compile"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(bad)
        assert e.value.code == 2
