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
import prompts
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


def test_policy_opens_with_two_plain_steps_then_rounds():
    """The first two steps are plain steps (no look): they time one, whatever came before reset(); then rounds. The
    faster of the first plain steps sets the break-even (the first after a long prefill can be slow), their median
    once there are 3 or more."""
    p = adaptive.Adaptive()
    for _ in range(2):
        assert drive(p, 5, 3) == "..RRR"
        assert p.break_even == pytest.approx(2.0)                 # 20 ms rounds against 10 ms plain steps
        p.reset()
    p.plain_times, p.round_times = [0.030, 0.010], [0.020]
    assert p.break_even == pytest.approx(2.0)
    p.plain_times = [0.030, 0.010, 0.030]
    assert p.break_even == pytest.approx(2.0 / 3)


def test_policy_stops_only_when_acceptance_is_clearly_below_break_even():
    """Rounds of 20 ms against 10 ms plain steps: break-even 2 tokens. Nothing is judged before min_rounds samples;
    then the mean must stay above 2 x (1 - confidence / sqrt(n)): rounds of 1 token stop at the 8th round (1 <
    1.29), then first_wait plain steps, the last a look; a look whose proposals are missed at once counts as a
    1-token round and doubles the wait (up to max_wait)."""
    p = adaptive.Adaptive(first_wait=4, max_wait=16)
    assert drive(p, 2 + 8 + 4 + 8 + 16 + 16, 1, [1, 1, 1]) == ".." + "R" * 8 + "...L" + "." * 7 + "L" + ("." * 15 + "L") * 2
    # 1.8 tokens a round goes on while 8 rounds are all there is (1.8 >= 1.29) ...
    p = adaptive.Adaptive()
    p.plain_times, p.round_times = [0.010] * 4, [0.020] * 4
    p.samples = [1.8] * 8
    assert p.pays()
    # ... and with 32 rounds it still does (margin 1 / sqrt(32): 1.65), while 1.6 does not
    p.samples = [1.8] * 32
    assert p.pays()
    p.samples = [1.6] * 32
    assert not p.pays()
    # one slow plain step among others does not move the break-even (medians)
    p.plain_times = [0.010, 0.010, 0.500]
    assert p.break_even == pytest.approx(2.0)


def test_policy_resumes_on_a_look_as_soon_as_it_pays():
    """After a stop, a look whose proposals the plain tokens match counts as a round of n + 1 tokens; rounds resume
    as soon as the mean with it pays, without waiting for the first miss: here after 8 losing rounds of 1 token,
    the mean of nine samples must exceed 2 x (1 - 1/3), which 4 matched proposals do (13 / 9; the look's own
    token is the first match), and the wait is first_wait again."""
    p = adaptive.Adaptive(first_wait=4)
    assert drive(p, 2 + 8 + 4, 1, [0] * 15) == ".." + "R" * 8 + "...L"
    assert drive(p, 12, 16) == "..." + "R" * 9
    assert p.samples[-10] == 5 and p.wait == 4


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
    target, drafter, _, _ = embedded_pair()
    prompt = prompts.long_prompts(ckpt.load_tokenizer(target.path), 1, 600)[0]
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
    x, kinds = adaptive.replay(adaptive.Adaptive(), out, drafts, 1.0, 0.5, 2.0)
    # the opening plain steps at t = 0, 1; rounds at t = 2, 3 commit 1 each (too few to judge), then 4 at t = 4, 8,
    # 12 and 3 at 16 (the end)
    assert kinds == ".." + "R" * 6, kinds
    assert x == pytest.approx(19 / (2 + 6 * 2.0))


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
    s = bench.main(["--replay", "--threads", "1", "--heldout", "2", "--max-new-tokens", "24", "--policy", "first_wait=4,confidence=0.5",
                    "--round-costs", "1.5,3"])
    out = capsys.readouterr().out
    assert out.count("\nprompt ") + out.startswith("prompt ") == 2 and s["prompts"] == 2
    assert s["policy"] == {"first_wait": 4, "confidence": 0.5} and 0 < s["adaptive_min"] <= s["adaptive_speedup"] and s["rounds_speedup"] > 0
    assert json.loads(out.strip().splitlines()[-1]) == s
    at = s["by_round_cost"]
    assert set(at) == {"1.5", "3.0"} and "| 1.5 | " in out
    for cost, row in at.items():     # pure rounds' replayed speedup is tokens / (rounds x cost): halving with twice the cost
        assert len(row["adaptive"]) == len(row["pure_rounds"]) == 2 and row["adaptive_over_pure"] > 0
    assert [a / b for a, b in zip(at["1.5"]["pure_rounds"], at["3.0"]["pure_rounds"])] == pytest.approx([2.0, 2.0])
    for bad in (["--replay", "--policy", "wait=4"], ["--replay", "--policy", "first_wait=x"], ["--policy", "first_wait=4"],
                ["--replay", "--compile"], ["--round-costs", "2"], ["--replay", "--round-costs", "x"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(bad)
        assert e.value.code == 2


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_bench_vs_pure(capsys):
    """bench.py --vs-pure: a line per prompt and a geometric mean that follows from them."""
    import bench
    s = bench.main(["--vs-pure", "--threads", "1", "--heldout", "2", "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    ratios = [float(line.rsplit("ratio ", 1)[1]) for line in out.splitlines() if line.startswith("prompt ")]
    assert len(ratios) == 2 and s["prompts"] == 2
    assert s["adaptive_over_pure_geomean"] == pytest.approx((ratios[0] * ratios[1]) ** 0.5, rel=2e-3)
    assert bench.parse_args(["--vs-pure", "--compile"]).compile                     # it runs compiled steps
    for other in (["--no-adaptive"], ["--methods", "dflash"], ["--vs-reference"], ["--replay"]):
        with pytest.raises(SystemExit):                                             # flags it would not run
            bench.parse_args(["--vs-pure", *other])
