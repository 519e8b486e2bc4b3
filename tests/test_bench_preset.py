"""bench.py: the --preset 9B shapes are right, the small preset runs the same code path on CPU, and the default
checkpoint benchmark reports what it promises on its held-out prompts."""
import json

import pytest
import torch

import bench
import checkpoint as ckpt
from helpers import Early
import generate
import presets
import model as M


def test_9b_preset_shapes_match_the_spec():
    """Built on the meta device (no memory): the parameter count of docs/qwen35.md#config (8,953,803,264 for the
    text model) and the drafter's target layers 1, 8, 15, 22, 29 at block 16."""
    tcfg, dcfg = presets.preset_configs("qwen3.5-9b")
    with torch.device("meta"):
        target = M.Qwen35(tcfg)
    assert sum(p.numel() for p in target.parameters()) == 8_953_803_264
    assert tcfg.layer_types.count("full_attention") == 8 and tcfg.rotary_dim == 64
    assert dcfg.target_layer_ids == [1, 8, 15, 22, 29] and dcfg.num_hidden_layers == 5 and dcfg.block_size == 16
    ckpt.check_fits(dcfg, tcfg)


def test_35b_a3b_preset_shapes():
    """The mixture-of-experts preset on the meta device: the 34,660,610,688 text-model parameters of
    docs/qwen35.md#mixture-of-experts, 32,212,254,720 of them in the routed experts, of which a decode step reads
    top-8 of 256 per layer (the weight bytes the bandwidth figure counts); the drafter fits."""
    tcfg, dcfg = presets.preset_configs("qwen3.5-35b-a3b")
    with torch.device("meta"):
        target = M.Qwen35(tcfg)
    experts = sum(p.numel() for m in target.modules() if isinstance(m, M.Experts) for p in m.parameters())
    assert sum(p.numel() for p in target.parameters()) == 34_660_610_688 and experts == 32_212_254_720
    assert presets.weight_bytes_per_decode(target) == 4 * (34_660_610_688 - experts * 248 // 256 - 248320 * 2048 + 2048)
    assert dcfg.target_layer_ids == [1, 10, 19, 28, 37] and dcfg.num_hidden_layers == 8 and dcfg.block_size == 16
    ckpt.check_fits(dcfg, tcfg)


def test_tiny_moe_preset_runs(capsys):
    """The CPU variant of the mixture-of-experts preset end to end (one thread: the models are tiny)."""
    n = torch.get_num_threads()
    try:
        out = bench.main(["--preset", "tiny-35b-a3b-shape", "--random-weights", "--max-new-tokens", "4", "--prompt-len", "20",
                          "--device", "cpu", "--threads", "1"])
    finally:
        torch.set_num_threads(n)
    assert out["verify_ms"] > 0 and out["decode_ms"] > 0 and out["verify_over_decode"] > 0
    assert "verify/decode" in capsys.readouterr().out


def test_tiny_preset_runs_and_reports(capsys):
    out = bench.main(["--preset", "tiny-9b-shape", "--random-weights", "--max-new-tokens", "6", "--prompt-len", "20",
                      "--device", "cpu"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(out))
    for key in ("decode_ms", "verify_ms", "draft_ms", "achieved_gb_s", "projected_dflash_tokens_per_s", "weight_bytes_per_decode"):
        assert last[key] > 0, key
    assert last["projected_tau"] == 5.60 and "tau / (verify_ms + draft_ms)" in last["projected_formula"]
    expected = last["projected_tau"] / (last["verify_ms"] + last["draft_ms"]) * 1000
    assert abs(last["projected_dflash_tokens_per_s"] - expected) < 1e-6 * expected
    assert last["peak_copy_gb_s"] is None and "bars" not in last          # CUDA only


def test_checkpoint_bench_reports_side_by_side(capsys):
    """The default benchmark path on the embedded pair, kept tiny: per-prompt lines, the summary, and a JSON
    line whose speedups are consistent with its throughputs."""
    bench.main(["--heldout", "3", "--max-new-tokens", "20", "--repeat", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert sum(line.startswith("prompt ") for line in lines) == 3
    last = json.loads(lines[-1])
    assert last["prompts"] == 3 and last["repeat"] == 2 and last["identical_outputs"] == 3
    assert last["ar_tokens_per_s"] > 0 and last["dflash_tokens_per_s"] > 0 and last["mean_acceptance_length"] >= 1
    lo, hi = last["speedup_quartiles"]
    assert lo <= last["speedup"] <= hi and last["speedup_whole_run"] > 0
    assert sum(last["acceptance_histogram"]) > 0 and len(last["acceptance_histogram"]) == last["block_size"]
    target = ckpt.load_target(generate.DEFAULT_TARGET, torch.float32, "cpu")   # decode bandwidth: weights read / step time
    assert last["weight_bytes_per_decode"] == presets.weight_bytes_per_decode(target)
    expected = last["weight_bytes_per_decode"] / (last["decode_ms"] / 1000) / 1e9
    assert abs(last["achieved_gb_s"] - expected) < 1e-6 * expected
    assert last["peak_copy_gb_s"] is None and last["bandwidth_fraction"] is None      # CUDA only
    assert any(line.startswith("decode reads ") and "GB/s" in line for line in lines)
    # the few-row products were chosen as generate.py chooses them: measured once, a packed kind only past the margin
    import packed
    measured = last["products_measured"]
    if packed.KINDS and measured:
        assert (last["products"] != "plain") == (min(measured.values()) <= 1 - packed.MARGIN), last
    else:
        assert last["products"] == "plain", last
    assert any(line.startswith("warm-up ") and "few-row products: " in line for line in lines)


def test_side_by_side_engines_keep_their_own_drafter_cache(monkeypatch, capsys):
    """With --compile the default benchmark builds a compiled DFlash engine and then an eager one. An engine resets
    its proposer's cache when it is built, and the compiled engine's steps hold that cache as theirs (on CUDA a
    static address): so every engine's proposer still holds, after the run, the cache made for that engine, and no
    two engines share a proposer. (The engines are built eager here, tables.single_engine with eager=True: the
    construction is --compile's, without inductor's minutes.)"""
    import tables
    built, single = [], tables.single_engine

    def record(*a, **kw):
        engine = single(*a, **{**kw, "eager": True})
        built.append((engine, engine.proposer, None if engine.proposer is None else engine.proposer.cache))
        return engine
    monkeypatch.setattr(tables, "single_engine", record)
    out = bench.main(["--heldout", "1", "--max-new-tokens", "8", "--repeat", "1", "--compile"])
    drafting = [(e, p, c) for e, p, c in built if p is not None]
    assert len(drafting) == 2 and "eager_dflash_tokens_per_s" in out and out["identical_outputs"] == 1
    for engine, proposer, cache in drafting:
        assert engine.proposer is proposer and proposer.cache is cache
    assert drafting[0][1] is not drafting[1][1]


def test_heldout_prompts_extend_without_changing_the_first():
    """More prompts than held-out files: further windows of the same files; the first ones do not move."""
    import prompts
    tok = ckpt.load_tokenizer(generate.DEFAULT_TARGET)
    few, many = prompts.heldout_prompts(tok, 8), prompts.heldout_prompts(tok, 64)
    assert many[:8] == few and len(many) == 64 and len({tuple(p) for p in many}) == 64
    assert all(30 <= len(p) <= 60 for p in many)


def run_bench_gpu_on_cpu() -> tuple:
    """bench_gpu.sh with the small preset on the CPU, short generations and prompts (MAX_NEW, PROMPT_LEN: the script
    is checked, not its numbers); the time limit only guards against a hang. -> (the run, its two JSON lines)."""
    import os
    import subprocess
    import tempfile
    from helpers import ROOT
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, DEVICE="cpu", PRESET="tiny-9b-shape", COMPILE="0", OUT=out, CONCURRENCY="1,2",
                   MAX_NEW="8", PROMPT_LEN="16", OMP_NUM_THREADS="1")
        run = subprocess.run(["bash", os.path.join(ROOT, "bench_gpu.sh")], env=env, capture_output=True, text=True,
                             timeout=1200)
        read = lambda name: json.loads(open(os.path.join(out, name)).read()) if run.returncode == 0 else None
        return run, read("bench_gpu_sdpa.json"), read("bench_gpu_concurrency.json")


# started with the suite, in the background
BENCH_GPU = Early(run_bench_gpu_on_cpu, used_by=["test_bench_gpu_script_runs_on_cpu"])


def test_bench_gpu_script_runs_on_cpu():
    """bench_gpu.sh end to end with the small preset on the CPU (the GPU run uses the same lines): it writes
    the JSON, prints the summary, and has no bars to judge off CUDA."""
    run, r, c = BENCH_GPU.result()
    assert run.returncode == 0, run.stderr[-2000:]
    assert "SKIP  tests/test_gpu.py" in run.stdout and "no bars" in run.stdout
    assert r["preset"] == "tiny-9b-shape" and r["device"] == "cpu" and r["verify_ms"] > 0
    assert [row["n"] for row in c["concurrency"]] == [1, 2] and all(row["round_ms"] > 0 for row in c["concurrency"])


def test_preset_summary_judges_the_gpu_bars(tmp_path, capsys):
    """The verdict bench_gpu.sh prints from a CUDA run's JSON: PASS/FAIL per bar, exit code 1 on any FAIL."""
    r = {"preset": "qwen3.5-9b", "device": "cuda", "decode_ms": 8.0, "achieved_gb_s": 2240.0, "peak_copy_gb_s": 4000.0,
         "bandwidth_fraction": 0.56, "verify_over_decode": 1.1, "draft_over_verify": 0.1,
         "projected_dflash_tokens_per_s": 1100.0, "projected_tau": 5.6, "max_memory_allocated_gb": 20.0,
         "bars": {"decode_bandwidth_ge_75pct": False, "verify_le_1.3x_decode": True}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(r))
    assert presets.preset_summary(str(path)) == 1
    out = capsys.readouterr().out
    assert "56.0% of 4000 GB/s" in out and "FAIL  decode_bandwidth_ge_75pct" in out and "PASS  verify_le_1.3x_decode" in out
    r["bars"]["decode_bandwidth_ge_75pct"] = True
    r["cudagraph_skips"] = 2
    path.write_text(json.dumps(r))
    assert presets.preset_summary(str(path)) == 0
    assert "2 compiled graphs NOT run as CUDA graphs" in capsys.readouterr().out


def test_profile_decode_reports_per_step_self_times(capsys):
    """bench.py --profile-decode (eager here, kept tiny): a decode-step median, then the profiler's top entries per
    decode step of one generation, its prefill left out; the JSON line says how many steps were profiled. It refuses
    the flags of the modes it does not run."""
    out = bench.main(["--profile-decode", "--threads", "1", "--heldout", "2", "--max-new-tokens", "12", "--repeat", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == json.loads(json.dumps(out))
    assert out["mode"] == "profile_decode" and out["profiled_steps"] == 11 and out["decode_ms"] > 0
    assert out["compile_mode"] is None and 0 < len(out["self_us_per_step"]) <= 8
    assert all(v >= 0 for v in out["self_us_per_step"].values())
    assert any(line.startswith("decode step, median over 2 generations: ") for line in lines)
    assert bench.parse_args(["--profile-decode", "--compile"]).compile                 # compiled steps are its point
    for other in (["--vs-pure"], ["--no-adaptive"], ["--methods", "dflash"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--profile-decode", *other])


def test_profile_round_times_each_step_called_directly(capsys, monkeypatch):
    """bench.py --profile-round (eager here, 3 calls of each step): the medians of a draft of the whole block, its
    verify (which commits) and an AR decode step on a live state, their ratios, the draft and verify again in turn,
    then the profiler's top entries per call of each; the JSON line carries them. The draft called again on the same
    state drafts the same block (its context appends rewrite the same slots). It refuses the flags of the modes it
    does not run."""
    import torch
    monkeypatch.setattr(bench, "ROUND_CALLS", 3)
    out = bench.main(["--profile-round", "--threads", "1", "--heldout", "1", "--max-new-tokens", "12"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == json.loads(json.dumps(out))
    kinds = {"decode", "draft", "verify"}
    assert out["mode"] == "profile_round" and set(out["ms"]) == set(out["self_us_per_call"]) == kinds
    assert all(v > 0 for v in out["ms"].values()) and out["block_size"] == 16 and out["compile_mode"] is None
    assert out["verify_over_decode"] == out["ms"]["verify"] / out["ms"]["decode"]
    assert set(out["in_turn_ms"]) == {"draft", "verify"} and all(v > 0 for v in out["in_turn_ms"].values())
    assert any(line.startswith("per call, median of 3 (eager, 1 threads") for line in lines)
    assert any(line.startswith("in turn (draft, verify, draft, ...), median of 3: draft ") for line in lines)
    target, _, _, proposer, block, prompts, _, _ = bench.load_pair(bench.parse_args(["--heldout", "1"]), torch.float32, "cpu")
    eng, ar = (bench.tables.single_engine(bench.parse_args([]), target, p, b, 200, False)
               for p, b in ((proposer, block), (None, 1)))
    with torch.inference_mode():
        steps = bench.live_round_steps(eng, ar, prompts[0], 12)
        assert steps["draft"]() == steps["draft"]() and len(steps["draft"]()[0]) == block - 1
        assert len(steps["verify"]()[0]) == 2 * block            # accepted, the target's block, the proposals
    for other in (["--vs-pure"], ["--no-adaptive"], ["--profile-decode"], ["--concurrency", "2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--profile-round", *other])
