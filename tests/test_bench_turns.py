"""tools/bench.py --concurrency: two engines stepped in turns through their observers (engine.Observer: clock(),
stepped(live)), each timed on its own steps' clock (bench.in_turns, bench.whole_runs, ArmRun's held stretch), and
tools/bench.py --vs-pure."""
import pytest

import engine
from helpers import HAS_EMBEDDED_PAIR, random_target, tiny_target_config


class Clock:
    """A fake time.perf_counter that steps of FakeArm advance."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class FakeArm:
    """A stand-in Engine of one slot whose run(reqs) takes `costs` seconds of the fake clock, one per step (no live
    rows: never a held stretch), each step logging its name and reported to the observer."""

    slots = 1

    def __init__(self, name, costs, clock, log):
        self.name, self.costs, self.time, self.log = name, costs, clock, log

    def run(self, reqs, on_step=None, observer=None):
        for c in self.costs:
            self.time.now += c
            self.log.append(self.name)
            observer.stepped(0)
        return [self.name] * len(reqs)


def test_in_turns_steps_the_arm_behind_in_its_own_time(monkeypatch):
    """bench.in_turns: the arm with the least time of its own goes next (the first listed on a tie); each arm's time is
    the sum of its own steps'; each gets its own results."""
    from tools import bench
    clock, log = Clock(), []
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    arms = [("a", FakeArm("a", [3, 3, 3], clock, log)), ("b", FakeArm("b", [1] * 7, clock, log))]
    out = bench.in_turns(arms, [0, 0])
    # a=0,b=0: a (tie) -> 3; b 1, 2, 3; tie: a -> 6; b 4, 5, 6; tie: a -> 9; b 7; b ends; a ends
    assert log == ["a", "b", "b", "b", "a", "b", "b", "b", "a", "b"]
    assert {k: (v.seconds, v.results) for k, v in out.items()} == {"a": (9, ["a", "a"]), "b": (7, ["b", "b"])}
    assert out["a"].held_seconds == 9 and out["a"].held_tokens == 0          # (no step held a live row: the whole run)
    log.clear()
    assert bench.whole_runs(arms[::-1], [0])["b"].seconds == pytest.approx(7) and log == ["b"] * 7 + ["a"] * 3


def test_in_turns_reads_each_batch_decode_seconds_on_its_own_time(monkeypatch):
    """Two batches in turns, one of them slowed (20 ms per step): the other's requests' decode seconds count its own
    steps only, not the time the slow one stepped between them (and the outputs are those of a run alone)."""
    import time

    from tools import bench
    target = random_target(tiny_target_config(), seed=3)
    reqs = [engine.Request([1, 2, 3], 12), engine.Request([4, 5], 9)]
    fast, slow = (engine.Engine(target, None, 1, 1, 64) for _ in range(2))
    alone = fast.run(reqs)
    step = slow.step
    monkeypatch.setattr(slow, "step", lambda rows: (time.sleep(0.02), step(rows)))
    out = bench.in_turns([("fast", fast), ("slow", slow)], reqs)
    seconds, results = out["fast"].seconds, out["fast"].results
    assert [r.output_ids for r in results] == [r.output_ids for r in alone] == [r.output_ids for r in out["slow"].results]
    assert out["slow"].seconds > 0.02 * 19 > seconds         # 10 + 7 steps of the slow one
    assert sum(r.decode_seconds for r in results) <= seconds


def test_in_turns_measures_the_stretch_with_every_slot_live():
    """ArmRun.held_*: two slots, requests of 12, 4 and 4 tokens (AR, a tiny target). Slot 0 runs the first, slot 1
    the second then the third: steps 1-6 hold two live rows, then the queue is dry and steps 7-11 hold one. The held
    stretch ends with step 6: 15 tokens (12 + 4 + 4 in all), part of the batch's time; the observer's stepped(live)
    gets each step's live rows."""
    from tools import bench
    target = random_target(tiny_target_config(), seed=3)
    reqs = [engine.Request([1, 2, 3], 12), engine.Request([4, 5], 4), engine.Request([6], 4)]
    eng = engine.Engine(target, None, 1, 2, 64)

    class Lives(engine.Observer):
        def __init__(self):
            self.live = []

        def stepped(self, live):
            self.live.append(live)
    lives = Lives()
    eng.run(reqs, observer=lives)
    assert lives.live == [2] * 6 + [1] * 5
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
    """tools/bench.py --concurrency on the embedded pair: in turns (the default) and --whole-runs, the outputs identical to AR's;
    --aa times two AR batches (no rounds); --whole-runs and --aa need --concurrency."""
    from tools import bench
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


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_bench_vs_pure(capsys):
    """tools/bench.py --vs-pure: a line per prompt and a geometric mean that follows from them."""
    from tools import bench
    s = bench.main(["--vs-pure", "--threads", "1", "--heldout", "2", "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    ratios = [float(line.rsplit("ratio ", 1)[1]) for line in out.splitlines() if line.startswith("prompt ")]
    assert len(ratios) == 2 and s["prompts"] == 2
    assert s["adaptive_over_pure_geomean"] == pytest.approx((ratios[0] * ratios[1]) ** 0.5, rel=2e-3)
    assert bench.parse_args(["--vs-pure", "--compile"]).compile                     # it runs compiled steps
    for other in (["--no-adaptive"], ["--methods", "dflash"], ["--vs-reference"]):
        with pytest.raises(SystemExit):                                             # flags it would not run
            bench.parse_args(["--vs-pure", *other])


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_bench_policy_table(capsys):
    """tools/bench.py --policy-table: a row per prompt set (the held-out prompts and every outside set), AR, pure
    rounds and the default with identical outputs, the ratios (the medians of each prompt's, which the JSON gives) and
    the policy's counts; the untuned set marked."""
    import prompts
    from tools import bench
    res = bench.main(["--policy-table", "--threads", "1", "--heldout", "1", "--max-new-tokens", "6"])
    sets = res["sets"]
    assert {"heldout", "library", "prose"} <= set(sets) <= {"heldout", *prompts.OUTSIDE}
    for name, row in sets.items():
        assert row["identical"] == row["prompts"] == 1 and row["untuned"] == (name == prompts.UNTUNED)
        assert row["default_over_pure"] > 0 and row["default_over_ar"] > 0
        assert 1 <= row["policy"]["rounds"] + row["policy"]["plain_steps"] <= 5      # 5 tokens after the first
        (one,) = row["per_prompt_tokens_per_s"]                                        # each prompt's tok/s per arm
        assert row["default_over_ar"] == one["default"] / one["ar"] and row["pure_tokens_per_s"] == one["pure"]
    out = capsys.readouterr().out
    assert all(any(line.startswith(name + " ") for line in out.splitlines()) for name in sets)
    assert set(res["calibration"]) == {"0", "16"}          # (one slot: the whole block alone, policy.engine_blocks)
