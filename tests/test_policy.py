"""Adaptive speculation (policy.py): the Policy's decisions on scripted costs, observed as plain data (the tokens each
live row committed, the seconds of each step kind, the drafter's upkeep); on the Engine and through generate.py the
output is AR's whichever steps it takes. And the default draft window: from the drafter's config, the flag
overriding it."""
import json
import random

import pytest
import torch

import checkpoint as ckpt
import dflash
import engine
import generate
import prompts
import sampling
from helpers import embedded_pair, EMBEDDED_TARGET, HAS_EMBEDDED_PAIR, kind_draft_config, random_drafter, random_target, tiny_target_config
import policy
from policy import Policy, verify_blocks

pytestmark = pytest.mark.usefixtures("one_thread")      # tiny eager models: one thread (conftest.py)


def drive(policy, steps, round_s, tokens, plain_s=0.001, rows=1, blocks=None):
    """`steps` steps under the policy, its rows 0..rows-1 live (admitted first if not yet): a round of k commits
    min(tokens, k) in each row (tokens: a number, or a list per row) in round_s seconds (or a function of k), a plain
    step commits 1 in plain_s -> the steps as a string (R round, . plain step); each round's k is appended to
    `blocks` when given."""
    for b in range(rows):
        if b not in policy.live:
            policy.admit(b)
    per_row = tokens if isinstance(tokens, list) else [tokens] * rows
    out = ""
    for _ in range(steps):
        k = policy.speculate()
        if k:
            out += "R"
            if blocks is not None:
                blocks.append(k)
            policy.observe_round([min(t, k) for t in per_row], k, round_s(k) if callable(round_s) else round_s)
        else:
            out += "."
            policy.observe_plain(plain_s)
    return out


CALIBRATED = {0: 0.001, 16: 0.004, 8: 0.003, 4: 0.0025, 2: 0.002}    # seconds of a plain step and of rounds of k


def test_policy_takes_rounds_while_they_pay():
    """12 tokens for a round of 16 that costs 4 plain steps: rounds only, of the whole block once a round of 8 (the
    prior's best) has committed all 8."""
    p, blocks = Policy(block=16, calibration=CALIBRATED), []
    assert drive(p, 50, round_s=CALIBRATED.get, tokens=12, blocks=blocks) == "R" * 50 and set(blocks[5:]) == {16}
    assert p.counts["rounds"] == 50 and p.counts["plain_steps"] == 0


def test_policy_turns_to_plain_steps_when_acceptance_falls_and_probes_as_evidence_ages():
    """A text that turns hard (1 token a round): plain steps within a few rounds (reason: acceptance), then a probe
    round now and then as the evidence ages toward the prior (reason: aging), each probe that loses halving the
    aging's budget (down to an eighth), so the gaps between probes grow and then hold: few enough to cost little.
    When the text turns easy again rounds come back at the next probe, and a round that pays restores the budget:
    nothing concluded outlives its evidence."""
    p = Policy(block=16, calibration=CALIBRATED)
    drive(p, 20, round_s=CALIBRATED.get, tokens=8)
    hard = drive(p, 600, round_s=CALIBRATED.get, tokens=1)
    assert hard.find("." * 20) < 40 and hard.count("R") < 40
    assert p.counts["to_plain_acceptance"] >= 1 and p.counts["to_rounds_aging"] >= 3
    assert p.counts["to_plain_costs"] == 0
    gaps = [len(g) for g in hard.strip("R").split("R") if g]
    assert gaps[1] < gaps[2] < gaps[3]     # each losing probe (a round of 2 for 1 token: 1 plain step lost) halves
    assert min(gaps[3:-1]) >= 50           # the budget; at budget / 8 the weight falls by e every 80 plain steps
    assert p.rate == p.budget / 8
    easy = drive(p, 200, round_s=CALIBRATED.get, tokens=12)
    assert easy.find("R") <= max(gaps) and easy.count("R") > 150 and p.rate == p.budget


def test_a_plain_decision_plans_the_plain_steps_after_it(monkeypatch):
    """With steady step costs the planned policy (a decision for a plain step settling the plain steps after it,
    Policy.plan) takes the steps the rule asked at every step takes (PLAN = 0), rounds and probes at the same
    steps, for one row and for three with their own acceptance; through a run of plain steps the rule decides
    about once per PLAN steps, where asked at every step it decides every step; and an admission in the middle of a
    plan has the rule decide at the next step (a round for the new row's prior)."""
    rng = random.Random(5)
    script = [rng.choice([1, 1, 1, 1, 2, 9, 16]) for _ in range(400)]

    def decisions(p) -> list:
        """Counts, per step, whether the rule decided it (1) or the plan of an earlier plain step did (0)."""
        decided, speculate = [], p.speculate
        monkeypatch.setattr(p, "speculate", lambda: decided.append(int(p.ahead == 0)) or speculate())
        return decided

    planning = policy.PLAN
    for rows in (1, 3):
        runs = []
        for plan in (planning, 0):
            monkeypatch.setattr(policy, "PLAN", plan)
            p = Policy(block=16, calibration=CALIBRATED)
            decided = decisions(p)
            runs.append(("".join(drive(p, 1, round_s=CALIBRATED.get, tokens=[t if b == 0 else 1 + b % 2 for b in range(rows)],
                                       rows=rows) for t in script), sum(decided)))
        (planned, decided_planned), (stepwise, decided_stepwise) = runs
        assert planned == stepwise and "R" in planned and "...." in planned, rows
        assert decided_stepwise == len(script) and decided_planned < len(script) - planned.count(".") // 2, rows
    monkeypatch.setattr(policy, "PLAN", planning)
    p = Policy(block=16, calibration=CALIBRATED)
    drive(p, 300, round_s=CALIBRATED.get, tokens=1)                 # rounds lose: long runs of plain steps
    decided = decisions(p)
    steps = drive(p, 170, round_s=CALIBRATED.get, tokens=1)
    assert steps.count(".") >= 160 and sum(decided) <= 170 // planning + 4, (steps, sum(decided))
    while p.ahead == 0:                                              # into the middle of a plan
        drive(p, 1, round_s=CALIBRATED.get, tokens=1)
    p.admit(1)                                                       # a new request: its prior pays a round
    assert p.ahead == 0 and p.speculate() > 0 and p.counts["to_rounds_admission"] == 1


def test_shadow_drafts_come_while_plain_steps_run_and_their_evidence_turns_the_rule():
    """While the rule takes plain steps, every SHADOW_EVERY-th hand-over of the drafter's context is a shadow draft of
    the longest block (none while rounds run); a shadow draft judged to commit a whole block is a round's evidence,
    and the rule takes rounds again at the next step, for that reason."""
    p = Policy(block=16, calibration=CALIBRATED)
    assert drive(p, 30, 0.004, 1).endswith(".")                     # rounds commit 1: plain steps
    asked = [p.shadow() for _ in range(2 * policy.SHADOW_EVERY)]
    assert asked == [16 if (i + 1) % policy.SHADOW_EVERY == 0 else 0 for i in range(len(asked))]
    aging = p.counts["to_rounds_aging"]
    assert p.counts["shadow_drafts"] == 2 and p.speculate() == 0
    p.observe_shadow(0, 16, 16)
    p.observe_shadow(0, 16, 16)
    assert p.speculate() == 16 and p.counts["to_rounds_shadow"] == 1 and p.counts["to_rounds_aging"] == aging
    assert p.shadow() == 0


def test_policy_chooses_the_verify_block_that_pays_most():
    """A compute-bound verify (1 ms + 0.45 ms per token; a plain step 1 ms), 6 tokens accepted of any longer block:
    per second, 16 -> 6 tokens in 8.2 ms, 8 -> 6 in 4.6, 4 -> 4 in 2.8, 2 -> 2 in 1.9: rounds of 4 once measured.
    Where no block pays (1 token a round), plain steps."""
    cost = lambda k: 0.001 + 0.00045 * k
    p, blocks = Policy(block=16, calibration={0: 0.001, **{k: cost(k) for k in (16, 8, 4, 2)}}), []
    drive(p, 100, round_s=cost, tokens=6, blocks=blocks)
    assert set(blocks[-50:]) <= {4, 8} and blocks[-50:].count(4) >= 10      # (a round of 4 that commits all 4
    #                                     counts 8 for a round of 8, which is then tried again: its estimate is optimistic)
    p = Policy(block=16, calibration={0: 0.001, **{k: cost(k) for k in (16, 8, 4, 2)}})
    assert drive(p, 300, round_s=cost, tokens=1).count("R") < 30
    assert verify_blocks(16) == (16, 8, 4, 2) and verify_blocks(6) == (6, 3) == Policy(block=6).blocks
    with pytest.raises(dflash.GenerationError, match="policy blocks"):
        Policy(block=8, blocks=(16, 4))


def test_policy_weighs_every_live_row():
    """Two rows, rounds of 16 costing 4 plain steps: one row committing 9 a round and one 1 make 10 tokens for 8 plain
    steps' worth (two rows): rounds; 2 and 1: plain steps. A request admitted starts from the prior."""
    p = Policy(block=16, blocks=(16,), calibration={0: 0.001, 16: 0.004})
    assert drive(p, 40, round_s=0.004, tokens=[9, 1], rows=2) == "R" * 40
    p = Policy(block=16, blocks=(16,), calibration={0: 0.001, 16: 0.004})
    kinds = drive(p, 40, round_s=0.004, tokens=[2, 1], rows=2)
    assert kinds.count("R") < 8 and kinds.count(".") >= 30 and "." * 15 in kinds
    p.leave(1)
    p.admit(1)                                       # a new request in slot 1: its prior brings rounds
    assert p.speculate() == 16 and p.counts["to_rounds_admission"] == 1


def test_policy_corrects_its_calibration_with_the_steps_it_times():
    """A calibration that says rounds of 16 take 2 plain steps, where they take 8: once they are timed their median
    says 8 and the policy turns to plain steps (reason: costs; 6 tokens a round pay at the 5 of one timing), probing
    again only after tens of plain steps (a probe loses 2 plain steps: the aging's budget takes that long)."""
    p = Policy(block=16, blocks=(16,), calibration={0: 0.001, 16: 0.002})
    kinds = drive(p, 100, round_s=0.008, tokens=6)
    assert kinds.startswith("RR.") and kinds.count("R") <= 3 and "." * 50 in kinds[:80]
    assert p.counts["to_plain_costs"] == 1 and p.counts["to_plain_acceptance"] == kinds.count("R") - 2     # the probe's


def test_the_plain_step_after_a_round_charges_its_extra_to_the_round():
    """The first plain step after a round also carries the round's features into the drafter's context: what it takes
    beyond a plain step's median is the round's (a switch back costs that round more), and it is no plain step sample.
    Where rounds lose and the policy probes, a switch back that costs 2 more plain steps makes each probe dearer, and
    probes come less often."""
    p = Policy(block=16, blocks=(16,), calibration={0: 0.001, 16: 0.003})
    p.admit(0)
    p.observe_round([4], 16, 0.003)
    p.observe_plain(0.003)
    assert list(p.costs.samples[16]) == [0.003, pytest.approx(0.005)] and list(p.costs.samples[0]) == [0.001]
    p.observe_plain(0.0012)                                  # a steady plain step: a plain sample, nothing charged
    assert list(p.costs.samples[0]) == [0.001, 0.0012] and p.costs.samples[16][-1] == pytest.approx(0.005)

    def steps(switch_s):            # rounds of 16 at 4 plain steps commit 2 tokens: plain steps, and probes
        p = Policy(block=16, blocks=(16,), calibration={0: 0.001, 16: 0.004})
        p.admit(0)
        out = ""
        for _ in range(600):
            k = p.speculate()
            out += "R" if k else "."
            if k:
                p.observe_round([2], k, 0.004)
            else:
                p.observe_plain(0.001 + (switch_s if out[-2:-1] == "R" else 0))
        return out
    cheap, costly = steps(0.0), steps(0.002)
    assert cheap.count("R") >= 8 and costly.count("R") < cheap.count("R")     # a dearer probe comes less often


def test_policy_without_a_calibration_times_a_plain_step_first():
    """No calibration (an eager run, no warm-up): one plain step to time one, then a round of the whole block (the
    prior pays against a round not timed yet: interpolated between the plain step and the timed blocks)."""
    p, blocks = Policy(block=16), []
    assert drive(p, 6, round_s=lambda k: 0.001 + 0.0002 * k, tokens=8, blocks=blocks) == ".RRRRR"
    assert p.counts["plain_untimed"] == 1 and blocks[0] == 16
    assert p.costs.seconds(4) == pytest.approx(0.001 + (0.0042 - 0.001) * 4 / 16)


def test_policy_reset_starts_the_rows_and_counts_over_and_keeps_the_timings():
    p = Policy(block=16, blocks=(16,), calibration={0: 0.001, 16: 0.004})
    drive(p, 1, round_s=0.006, tokens=1)
    p.reset()
    assert p.counts["rounds"] == 0 and not p.live and p.costs.seconds(16) == pytest.approx(0.005)   # (0.004 + 0.006) / 2


# ---- The Policy on the Engine, and through generate.py ----------------------------------------------------------

@pytest.mark.parametrize("slots", [1, 3])
def test_policy_plain_steps_and_rounds_are_both_exact(slots):
    """policy.Policy on an Engine whose drafter never agrees: it takes rounds and plain steps (which, and when, follows
    the times it measures), and every request's output is AR's, on one slot or three."""
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 12)
    d = random_drafter(kind_draft_config(cfg, "dflash", block_size=8), 6)
    rng = random.Random(4)
    reqs = [engine.Request([rng.randrange(40) for _ in range(20)], 60) for _ in range(3)]
    res = engine.Engine(target, engine.DrafterProposer(d, target), 8, slots, 100,
                        policy=Policy(block=8, prior_p=0.5)).run(reqs)      # (a prior of 2 tokens for 8)
    for r, got in zip(reqs, res):
        assert got.output_ids == engine.run(target, r.prompt_ids, r.max_new_tokens).output_ids
    # both kinds ran (which request gets a round follows the measured times: a later request's prior may not pay)
    assert {"plain", "verify"} <= {k for got in res for k in got.step_kinds}


class Shadowing(policy.Scripted):
    """A policy for the Engine that takes plain steps, asks for a shadow draft of k at every hand-over of the drafter's
    context (recording the row's position then), and takes one round of k when the row stands at position `round_at`
    (recording what it committed)."""
    counts = None

    def __init__(self, eng, k, round_at=None):
        self.eng, self.k, self.round_at = eng, k, round_at
        self.shadows, self.judged, self.rounds = [], [], []

    def speculate(self):
        return self.k if int(self.eng.start[0]) == self.round_at else 0

    def shadow(self):
        self.shadows.append(int(self.eng.start[0]))
        return self.k

    def observe_shadow(self, b, k, committed):
        self.judged.append((k, committed))

    def observe_round(self, committed, k, seconds):
        self.rounds.append(committed[0])


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
@pytest.mark.parametrize("sampled", [False, True])
def test_a_shadow_draft_is_judged_as_a_round_there_would_commit(sampled):
    """A shadow draft (taken with a hand-over of the drafter's context during plain steps, judged by the tokens the
    plain steps after it commit) reports what a round of the same k at the same position commits, or, once its
    first SHADOW_SURE proposals are confirmed, a round of SHADOW_SURE + 1 committing all (the real round commits at
    least that): greedy, and sampled under the coupled rule (the same seed); the output stays AR's."""
    target, drafter, p1, _ = embedded_pair()
    req = engine.Request(p1, 60, (), sampling.Sampling(0.3) if sampled else sampling.Sampling(), 11 if sampled else None)
    eng = engine.Engine(target, engine.DrafterProposer(drafter, target), 16, 1, 200)
    eng.policy = shadowed = Shadowing(eng, 8)
    got = eng.run([req])[0]
    ar = engine.Engine(target, None, 1, 1, 200).run([req])[0]
    assert got.output_ids == ar.output_ids and set(got.step_kinds) == {"plain"}
    assert len(shadowed.judged) >= 3 and max(c for _, c in shadowed.judged) > 1       # (some proposals accepted)
    for at, (k, committed) in zip(shadowed.shadows, shadowed.judged):
        eng.policy = one = Shadowing(eng, 8, round_at=at)
        eng.run([req])
        if k == 8:
            assert one.rounds[0] == committed, (at, one.rounds, committed)
        else:               # reported once its first SHADOW_SURE proposals were confirmed: the round commits more
            assert k == committed == policy.SHADOW_SURE + 1 and one.rounds[0] >= committed, (at, one.rounds, k)
    if not sampled:                                                             # (both kinds of verdict met)
        assert {k for k, _ in shadowed.judged} == {8, policy.SHADOW_SURE + 1}


def test_warm_up_calibrates_the_policy_once_per_machine_and_shape(tmp_path, monkeypatch):
    """Engine.warm_up times every step kind (policy.Alternate) and hands the seconds to the policy; they are cached
    (policy.costs_path), so a second Engine of the same shape reads them instead of timing; another N times again."""
    import policy
    monkeypatch.setattr(policy, "costs_path", lambda: str(tmp_path / "costs.json"))
    stored = []
    monkeypatch.setattr(engine, "store_costs", lambda key, costs: (stored.append(key), policy.store_costs(key, costs)))
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 12)
    d = random_drafter(kind_draft_config(cfg, "dflash", block_size=8), 6)
    reqs = [engine.Request(list(range(3, 15)), 20)]

    def warmed(slots):
        p = Policy(block=8)
        engine.Engine(target, engine.DrafterProposer(d, target), 8, slots, 100, policy=p).warm_up(reqs)
        return p
    first = warmed(1)
    assert set(first.calibration) == {0, 8, 4, 2} and all(s > 0 for s in first.calibration.values())
    assert warmed(1).calibration == first.calibration and len(stored) == 1
    warmed(2)
    assert len(stored) == 2 and len(json.loads((tmp_path / "costs.json").read_text())) == 2
    from speed import packed            # the same shape on other few-row products: timed again
    target, d = target.float(), d.float()
    warmed(1)
    if "onednn" in packed.KINDS:
        assert packed.swap_linears_(target, "onednn", 8) > 0
        warmed(1)
        assert len(stored) == 4


def test_outside_prompt_sets_are_outside_the_training_and_held_out_files():
    """Each of prompts.OUTSIDE gives 16 prompts, the same every time, none of them a piece of a held-out file, and the
    library set's files lie outside the standard library (what tools/train.py trained on)."""
    import os
    import sysconfig
    if not HAS_EMBEDDED_PAIR:
        pytest.skip("embedded pair not present")
    tok = ckpt.load_tokenizer(EMBEDDED_TARGET)
    heldout = "".join(prompts.read_text(f) for f in prompts.stdlib_files("heldout"))
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep
    files = [f for lib in prompts.LIBRARIES for f in prompts.library_files(lib)]
    assert files and not any(os.path.realpath(f).startswith(stdlib) and "site-packages" not in f for f in files)
    for name in prompts.OUTSIDE:
        if name == "humaneval16" and prompts.humaneval_rows() is None:
            continue
        got = prompts.outside_prompts(name, tok, 16)
        assert len(got) == 16 and (name == "library" or got == prompts.outside_prompts(name, tok, 16))
        assert all(tok.decode(p)[:80] not in heldout for p in got), name
    assert prompts.UNTUNED in prompts.OUTSIDE


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_adaptive_generate_equals_ar_on_a_long_prompt(capsys):
    """The embedded pair on a prompt longer than its training context, default settings (the Policy): the output is
    AR's and the trace's contract holds (plain steps appear as 1 with no drafts). (--no-adaptive's text == the
    Policy's == AR's: test_cli.py's test_same_seed_same_text_whatever_the_step_pattern.)"""
    target, drafter, _, _ = embedded_pair()
    prompt = prompts.long_prompts(ckpt.load_tokenizer(target.path), 1, 600)[0]
    ids = ",".join(map(str, prompt))
    assert generate.main(["--prompt-ids", ids, "--max-new-tokens", "48", "--json", "--draft", "none"]) == 0
    ar = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert generate.main(["--prompt-ids", ids, "--max-new-tokens", "48", "--json"]) == 0
    sp = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sp["output_ids"] == ar["output_ids"] and len(sp["prompt_ids"]) == 600 and sp["adaptive"] is True
    assert 1 + sum(sp["acceptance_lengths"]) == 48 and len(sp["step_kinds"]) == len(sp["draft_ids"]) == len(sp["acceptance_lengths"])
    assert all((a, d) == (1, []) for a, d, k in zip(sp["acceptance_lengths"], sp["draft_ids"], sp["step_kinds"]) if k == "plain")
    counts = sp["policy"]                   # what the policy did, and why it switched (one counter per reason)
    assert counts["rounds"] == sp["step_kinds"].count("verify") and counts["plain_steps"] == sp["step_kinds"].count("plain")
    assert set(counts) == {"rounds", "plain_steps", "shadow_drafts", *policy.REASONS}
    switches = sum(a != b for a, b in zip(sp["step_kinds"], sp["step_kinds"][1:]))
    assert sum(counts[r] for r in policy.REASONS if r.startswith("to_")) == switches
    assert generate.main(["--prompt-ids", "5,6,7", "--max-new-tokens", "8"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "; switches: " in line or "; no switch" in line


# ---- The default draft window ------------------------------------------------------------------------------

def test_default_window_from_the_config(tmp_path):
    """train_context_length (dflash_config, written by tools/train.py), else none, a sliding drafter's included (its
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
def test_one_request_rounds_only_the_whole_block(monkeypatch, tmp_path, capsys):
    """An Engine of one slot weighs rounds of the whole block only; several slots every verify block
    (policy.engine_blocks): generate.py's single prompt and --prompts-file with --concurrency 2 hand their engines
    those blocks, and the single prompt's rounds each verify the whole block."""
    assert policy.engine_blocks(16, 1) == (16,) and policy.engine_blocks(16, 2) == verify_blocks(16) == (16, 8, 4, 2)
    seen = []
    real = engine.Engine.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        seen.append((self.slots, getattr(self.policy, "blocks", None)))
    monkeypatch.setattr(engine.Engine, "__init__", spy)
    assert generate.main(["--prompt-ids", "5,6,7", "--max-new-tokens", "24", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["adaptive"] and all(len(d) == 15 for d, k in zip(res["draft_ids"], res["step_kinds"]) if k == "verify")
    requests = tmp_path / "r.jsonl"
    requests.write_text("".join(json.dumps({"prompt_ids": [5 + i, 6, 7], "max_new_tokens": 4}) + "\n" for i in range(3)))
    assert generate.main(["--prompts-file", str(requests), "--concurrency", "2", "--json"]) == 0
    blocks = dict((n, b) for n, b in seen if b is not None)
    assert blocks == {1: (16,), 2: (16, 8, 4, 2)}


def test_policy_sim_replays_acceptance_maps():
    """tools/policy_sim.py replay: the Policy on acceptance maps at given costs. A text every round drafts whole
    (A = 16 everywhere; 127 tokens after the prefill's: 7 rounds of 16 and one of 15 at 4 plain steps each) and one
    no round drafts (A = 1): the policy takes every round of the first, and on the second pays only its first
    rounds and its backed-off probes (pure rounds: a quarter of AR's speed)."""
    from tools import policy_sim
    maps = {"easy": [{"tokens": 128, "block": 16, "A": [16] * 127}], "hard": [{"tokens": 128, "block": 16, "A": [1] * 127}]}
    costs = {0: 1.0, 16: 4.0, 8: 3.5, 4: 3.0, 2: 2.5}
    table = policy_sim.replay(maps, costs, {})
    assert costs == {0: 1.0, 16: 4.0, 8: 3.5, 4: 3.0, 2: 2.5}               # (the caller's costs left as they were)
    assert table["easy"]["pure_over_ar"] == pytest.approx(127 / 32) and table["easy"]["policy_over_pure"] == 1.0
    assert table["hard"]["pure_over_ar"] == pytest.approx(0.25) and 0.85 < table["hard"]["policy_over_ar"] < 1.0


def test_policy_sim_reads_each_blocks_own_acceptance():
    """A map of each verify block's own acceptance ({k: [..]}, as `maps` writes it: a shorter block drafts other
    proposals than the whole block's first k - 1) is read per block; a single list stands for the whole block, a
    round of k committing min(A[j], k); pure rounds read the whole block's alone; a map lacking a block the policy
    chooses among is refused."""
    from tools import policy_sim
    own = policy_sim.committer({"16": [5, 3], "8": [2, 8], "4": [1, 4], "2": [2, 1]})
    assert [own(0, 16), own(1, 16), own(0, 8), own(1, 8), own(0, 4), own(1, 2)] == [5, 3, 2, 8, 1, 1]
    whole = policy_sim.committer([5, 3])
    assert [whole(0, 16), whole(0, 4), whole(1, 8), whole(1, 2)] == [5, 4, 3, 2]
    costs = {0: 1.0, 16: 4.0, 8: 3.5, 4: 3.0, 2: 2.5}
    A = [1, 3, 16, 5, 2, 16, 16, 9] * 16
    as_list = {"s": [{"tokens": 128, "block": 16, "A": A[:127]}]}
    as_dict = {"s": [{"tokens": 128, "block": 16, "A": {str(k): [min(a, k) for a in A[:127]] for k in (16, 8, 4, 2)}}]}
    assert policy_sim.replay(as_dict, costs, {}) == policy_sim.replay(as_list, costs, {})
    worse = {"s": [{"tokens": 128, "block": 16, "A": {**as_dict["s"][0]["A"], "8": [1] * 127}}]}
    assert policy_sim.replay(worse, costs, {})["s"]["pure_over_ar"] == policy_sim.replay(as_list, costs, {})["s"]["pure_over_ar"]
    del worse["s"][0]["A"]["16"]          # (the policy of one slot rounds the whole block: policy.engine_blocks)
    with pytest.raises(ValueError, match=r"verify blocks \[16\]"):
        policy_sim.replay(worse, costs, {})


@pytest.mark.parametrize("setting, value", [("budget", 0.0), ("budget", -0.1), ("keep", 1.5), ("keep", -0.1),
                                            ("prior_p", 0.0), ("prior_weight", -1.0), ("prior_floor", -0.5),
                                            ("window", 0)])
def test_a_setting_out_of_range_is_refused_in_one_line(setting, value, capsys):
    """A Policy setting outside its range is refused by name (a budget of 0 divided by zero at the first plain step
    before: the aging's rate over the probe's loss); tools/policy_sim.py says so in one line and exits 2."""
    with pytest.raises(dflash.GenerationError, match=setting):
        Policy(**{setting: value})
    from tools import policy_sim
    flag = {"budget": "--budget", "keep": "--keep", "prior_weight": "--prior-weight", "prior_floor": "--prior-floor"}.get(setting)
    if flag:
        with pytest.raises(SystemExit) as e:
            policy_sim.main(["replay", "maps.json", flag, str(value)])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert setting in err[-1] and "Traceback" not in "".join(err)


def test_policy_sim_memory_forecasts_each_round_from_the_last():
    """tools/policy_sim.py memory: the rounds pure rounds take on a map (each where the last one's tokens end), the
    correlation of consecutive rounds' tokens and each decay's forecast error. A map on which they commit 4, 4, 1, 1
    (worked by hand): pairs (4, 4), (4, 1), (1, 1) correlate 0.5; the last round alone (keep 0) misses by 0, 3, 0;
    keep 0.5 forecasts 4, 6 / 1.5 = 4 and 4 / 1.75, missing by 0, 3 and 9/7."""
    from tools import policy_sim
    maps = {"s": [{"tokens": 11, "block": 16, "A": [4, 1, 1, 1, 4, 1, 1, 1, 1, 1]}]}
    got = policy_sim.memory(maps, keeps=(0.0, 0.5))["s"]
    assert got["correlation"] == pytest.approx(0.5)
    assert got["error"][0.0] == pytest.approx(1.0) and got["error"][0.5] == pytest.approx((3 + 9 / 7) / 3)
