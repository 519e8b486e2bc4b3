"""tools/bench.py: the --preset 9B shapes are right, the small preset runs the same code path on CPU, the GPU bars follow
from the bytes the steps read, bench_gpu.sh runs every stage whatever fails, and the default checkpoint benchmark
reports what it promises on its held-out prompts."""
import json
import os

import pytest
import torch

from tools import bench
import checkpoint as ckpt
from helpers import Early
import options
from tools import presets
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
    # a 16-token verify: 16 x 8 = 128 routed slots, each one expert's weights copied, and 16 embedding rows
    assert presets.weight_bytes_per_decode(target, 16) == 4 * (34_660_610_688 - experts * 128 // 256 - 248320 * 2048 + 16 * 2048)
    assert dcfg.target_layer_ids == [1, 10, 19, 28, 37] and dcfg.num_hidden_layers == 8 and dcfg.block_size == 16
    ckpt.check_fits(dcfg, tcfg)


@pytest.mark.parametrize("extra", [[], ["--concurrency", "1,2"]])
def test_a_preset_too_large_for_the_memory_is_refused_before_it_is_built(monkeypatch, capsys, extra):
    """--preset checks the weights (target and drafter, as --weight-dtype keeps them) and the caches against the
    memory available before building anything: one line naming the need, what the machine has and the options,
    exit code 2."""
    monkeypatch.setattr(ckpt, "available_memory", lambda device: 10 ** 6)      # 1 MB free
    built = []
    monkeypatch.setattr(presets, "random_models", lambda *a, **k: built.append(a))
    assert bench.cli(["--preset", "tiny-9b-shape", "--random-weights", "--max-new-tokens", "4", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "this run needs about" in err and "this machine has 1.0 MB available" in err
    assert "--weight-dtype bfloat16" in err and not built


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


def test_tiny_preset_runs_and_reports(capsys, monkeypatch):
    """The small preset on the CPU: the JSON line it returns printed last, its figures consistent; AR's decode step,
    bandwidth and a JSON line of its own ("part": "ar") printed before the DFlash engine is built."""
    from tools import tables
    printed_before = {}
    single_engine = tables.single_engine

    def noting(args, target, proposer, *rest):
        if proposer is not None:
            printed_before["dflash"] = capsys.readouterr().out
            print(printed_before["dflash"], end="")
        return single_engine(args, target, proposer, *rest)
    monkeypatch.setattr(tables, "single_engine", noting)
    out = bench.main(["--preset", "tiny-9b-shape", "--random-weights", "--max-new-tokens", "6", "--prompt-len", "20",
                      "--device", "cpu"])
    lines = capsys.readouterr().out.strip().splitlines()
    last = json.loads(lines[-1])
    assert last == json.loads(json.dumps(out))
    for key in ("decode_ms", "verify_ms", "draft_ms", "achieved_gb_s", "projected_dflash_tokens_per_s", "weight_bytes_per_decode",
                "weight_bytes_per_verify", "weight_bytes_per_draft"):
        assert last[key] > 0, key
    assert last["projected_tau"] == 5.60 and "tau / (verify_ms + draft_ms)" in last["projected_formula"]
    expected = last["projected_tau"] / (last["verify_ms"] + last["draft_ms"]) * 1000
    assert abs(last["projected_dflash_tokens_per_s"] - expected) < 1e-6 * expected
    assert last["peak_copy_gb_s"] is None and "bars" not in last          # CUDA only
    before = printed_before["dflash"].splitlines()
    assert any(line.startswith("AR: decode ") for line in before) and any(line.startswith("decode reads ") for line in before)
    ar = json.loads(before[-1])
    assert ar["part"] == "ar" and ar["decode_ms"] == last["decode_ms"] and "verify_ms" not in ar


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
    target = ckpt.load_target(options.DEFAULT_TARGET, torch.float32, "cpu", "auto")   # as the bench keeps it (bfloat16)
    assert last["weight_bytes_per_decode"] == presets.weight_bytes_per_decode(target)
    expected = last["weight_bytes_per_decode"] / (last["decode_ms"] / 1000) / 1e9
    assert abs(last["achieved_gb_s"] - expected) < 1e-6 * expected
    assert last["peak_copy_gb_s"] is None and last["bandwidth_fraction"] is None      # CUDA only
    assert any(line.startswith("decode reads ") and "GB/s" in line for line in lines)
    # the few-row products were chosen as generate.py chooses them: measured once, a packed kind only past the margin
    from speed import packed
    measured = last["products_measured"]
    if packed.KINDS and measured:
        narrow = last["weight_dtype"] in ("bfloat16", "float16")       # kept as stored: packed.KEPT_MARGIN
        assert last["products"] == packed.verdict(measured, narrow), last
        assert (last["products"] != "plain") == (min(measured.values()) <= 1 - (packed.KEPT_MARGIN if narrow else packed.MARGIN))
    else:
        assert last["products"] == "plain", last
    assert any(line.startswith("warm-up ") and "few-row products: " in line for line in lines)


def test_side_by_side_engines_keep_their_own_drafter_cache(monkeypatch, capsys):
    """With --compile the default benchmark builds a compiled DFlash engine and then an eager one. An engine resets
    its proposer's cache when it is built, and the compiled engine's steps hold that cache as theirs (on CUDA a
    static address): so every engine's proposer still holds, after the run, the cache made for that engine, and no
    two engines share a proposer. (The engines are built eager here, tables.single_engine with eager=True: the
    construction is --compile's, without inductor's minutes.)"""
    from tools import tables
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
    tok = ckpt.load_tokenizer(options.DEFAULT_TARGET)
    few, many = prompts.heldout_prompts(tok, 8), prompts.heldout_prompts(tok, 64)
    assert many[:8] == few and len(many) == 64 and len({tuple(p) for p in many}) == 64
    assert all(30 <= len(p) <= 60 for p in many)


STAGES = ["smoke", "preset", "bars", "concurrency", "gpu-tests"]


def run_bench_gpu_on_cpu(**env) -> tuple:
    """bench_gpu.sh with the small preset on the CPU, short generations and prompts (MAX_NEW, PROMPT_LEN: the script
    is checked, not its numbers), `env` added; the time limit only guards against a hang.
    -> (the run, {name: text} of every file it wrote under $OUT)."""
    import subprocess
    import tempfile
    from helpers import ROOT
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "DEVICE": "cpu", "PRESET": "tiny-9b-shape", "COMPILE": "0", "OUT": out, "CONCURRENCY": "1,2",
               "MAX_NEW": "8", "PROMPT_LEN": "16", "OMP_NUM_THREADS": "1", **env}
        run = subprocess.run(["bash", os.path.join(ROOT, "bench_gpu.sh")], env=env, capture_output=True, text=True,
                             timeout=1200)
        files = {}
        for name in os.listdir(out):
            with open(os.path.join(out, name)) as fh:
                files[name] = fh.read()
        return run, files


def bench_gpu_smoke_failing():
    return run_bench_gpu_on_cpu(FAIL_STAGE="smoke")


# started with the suite, in the background: one run serves both tests below (the smoke stage made to fail, every
# later stage run as the GPU run runs it)
BENCH_GPU = Early(bench_gpu_smoke_failing, used_by=["test_bench_gpu_script_runs_on_cpu",
                                                    "test_bench_gpu_goes_on_past_a_failed_stage"])


def summary_verdicts(text: str) -> dict:
    """{stage: verdict} from the summary bench_gpu.sh prints last."""
    rows = text[text.index("== summary"):].splitlines()[1:]
    return {stage: verdict for verdict, stage in (r.split() for r in rows[:rows.index("bars:")])}


def test_bench_gpu_script_runs_on_cpu():
    """bench_gpu.sh end to end with the small preset on the CPU (the GPU run uses the same lines), its first stage
    made to fail: every later stage in order, each with its log; the JSON files; PASS for the preset, the bars and
    the concurrency table, SKIP for the GPU tests (pytest skips them) and no bars to judge off CUDA."""
    run, files = BENCH_GPU.result()
    assert summary_verdicts(run.stdout) == {"smoke": "FAIL", **dict.fromkeys(STAGES[1:-1], "PASS"), "gpu-tests": "SKIP"}
    assert all(f"{s}.log" in files for s in STAGES) and files["summary.txt"] in run.stdout
    assert "no bars" in run.stdout.split("\nbars:\n")[-1]
    r, c = json.loads(files["bench_gpu_sdpa.json"]), json.loads(files["bench_gpu_concurrency.json"])
    assert r["preset"] == "tiny-9b-shape" and r["device"] == "cpu" and r["verify_ms"] > 0
    assert [row["n"] for row in c["concurrency"]] == [1, 2] and all(row["round_ms"] > 0 for row in c["concurrency"])


def test_bench_gpu_goes_on_past_a_failed_stage():
    """FAIL_STAGE=smoke makes the first stage fail: every later stage still runs, in order, and writes its log; the
    summary names the failed stage; the exit code, given at the end, is 1."""
    run, files = BENCH_GPU.result()
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    starts = [run.stdout.index(f"== {s} (limit ") for s in STAGES]
    assert starts == sorted(starts)
    assert "made to fail on purpose" in files["smoke.log"]
    assert json.loads(files["bench_gpu_sdpa.json"])["verify_ms"] > 0 and "no bars" in files["bars.log"]
    assert "N=  1" in files["concurrency.log"] and "skipped" in files["gpu-tests.log"]


def test_bench_gpu_stage_limits_fit_one_command():
    """The stages' time limits, each with its grace to die, add up to less than 540 s (the device machine's command
    limit is 600 s), `timeout` runs nowhere but in the stage function, and the header states each stage's limit."""
    import re
    from helpers import ROOT
    with open(os.path.join(ROOT, "bench_gpu.sh")) as fh:
        src = fh.read()
    limits = [(name, int(s)) for name, s in re.findall(r"^\s*stage (\S+) (\d+) ", src, re.M)]
    grace = int(re.search(r"^GRACE=(\d+)", src, re.M).group(1))
    assert [name for name, _ in limits] == STAGES
    assert sum(s + grace for _, s in limits) < 540, limits
    code = [line for line in src.splitlines() if not line.lstrip().startswith("#")]
    assert sum("timeout" in line.split("#")[0] for line in code) == 1
    for name, s in limits:
        assert re.search(rf"^#\s+{name}\s+\({s} s\)", src, re.M), f"the header's limit of {name}"


def test_bench_gpu_refuses_an_unknown_fail_stage(tmp_path):
    """FAIL_STAGE naming no stage is an error before anything runs (a typo would otherwise test nothing)."""
    import subprocess
    from helpers import ROOT
    run = subprocess.run(["bash", os.path.join(ROOT, "bench_gpu.sh")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FAIL_STAGE": "smoek", "OUT": str(tmp_path)})
    assert run.returncode == 2 and "FAIL_STAGE=smoek names no stage" in run.stderr and not os.listdir(tmp_path)


def nine_b_run(decode_eff: float, verify_eff: float, draft_eff: float, peak: float = 3000.0) -> dict:
    """A CUDA --preset JSON line of the 9B shapes (their byte counts, built on the meta device) whose decode, verify
    and draft steps stream their bytes at the given fractions of copy bandwidth `peak` (GB/s)."""
    target, drafter = presets.random_models("qwen3.5-9b", "meta", torch.bfloat16)
    wd, wv = presets.weight_bytes_per_decode(target), presets.weight_bytes_per_decode(target, 16)
    wr = presets.draft_weight_bytes(drafter, target)
    ms = lambda n, eff: 1000 * n / (eff * peak * 1e9)
    decode, verify, draft = ms(wd, decode_eff), ms(wv, verify_eff), ms(wr, draft_eff)
    return {"preset": "qwen3.5-9b", "device": "cuda", "decode_ms": decode, "verify_ms": verify, "draft_ms": draft,
            "weight_bytes_per_decode": wd, "weight_bytes_per_verify": wv, "weight_bytes_per_draft": wr,
            "achieved_gb_s": wd / decode * 1000 / 1e9, "peak_copy_gb_s": peak, "bandwidth_fraction": decode_eff,
            "verify_over_decode": verify / decode, "draft_over_verify": draft / verify, "block_size": 16,
            "projected_tau": 5.6, "projected_dflash_tokens_per_s": 5.6 / (verify + draft) * 1000,
            "max_memory_allocated_gb": 20.0, "cudagraph_skips": 0}


def test_gpu_bars_follow_from_bytes_and_bandwidth():
    """The 9B preset's steps read 15.87 GB (decode, verify) and 4.13 GB (draft: the drafter's 2.10 GB and the shared
    lm_head's 2.03), so a round at a 3,000 GB/s copy bandwidth allows at most about 840 tok/s at tau 5.6. Every bar
    asks 75% of what the bytes allow: a run at 80% of the bandwidth in every step meets them all, one at 70% misses
    the absolute two (decode bandwidth, tok/s) and meets the ratios; a verify and draft at 70% of the rate of a
    decode at the full bandwidth miss verify/decode and tok/s, a draft alone at 70% of the others' rate draft/verify."""
    r = nine_b_run(0.8, 0.8, 0.8)
    assert abs(r["weight_bytes_per_verify"] / 1e9 - 15.87) < 0.01 and abs(r["weight_bytes_per_draft"] / 1e9 - 4.13) < 0.01
    bars = {b["bar"]: b for b in presets.gpu_bars(r)}
    assert list(bars) == ["decode_bandwidth", "verify_over_decode", "draft_over_verify", "projected_tok_s"]
    assert all(b["ok"] for b in bars.values()), bars
    assert 835 < bars["projected_tok_s"]["bound"] / 0.75 < 845 and "840 tok/s at most" in bars["projected_tok_s"]["derivation"]
    assert abs(bars["draft_over_verify"]["bound"] - 0.2603 / 0.75) < 1e-3
    missed = lambda r: sorted(b["bar"] for b in presets.gpu_bars(r) if not b["ok"])
    assert missed(nine_b_run(0.7, 0.7, 0.7)) == ["decode_bandwidth", "projected_tok_s"]
    assert missed(nine_b_run(1.0, 0.7, 0.7)) == ["projected_tok_s", "verify_over_decode"]
    assert missed(nine_b_run(1.0, 1.0, 0.7)) == ["draft_over_verify"]        # a round still at 92% of its bound
    assert presets.gpu_bars({**r, "peak_copy_gb_s": None}) == []          # off CUDA: no bandwidth, no bars


def test_preset_summary_judges_the_gpu_bars(tmp_path, capsys):
    """The verdict bench_gpu.sh prints from a CUDA run's log: each bar PASS/FAIL with its bar, measured value and
    derivation, exit code 1 on any FAIL; AR's own line alone (the run ended in its DFlash part): the decode bar
    judged, the others MISSING, exit code 1; a log without a JSON line: exit code 1."""
    path = tmp_path / "preset.log"
    r = nine_b_run(0.7, 0.8, 0.8)
    path.write_text("a warning\n" + json.dumps(r) + "\nTraceback (most recent call last):\n")
    assert presets.preset_summary(str(path)) == 1
    out = capsys.readouterr().out
    assert "FAIL  decode_bandwidth: 2.1e+03 GB/s >= bar 2.25e+03 GB/s" in out and "PASS  draft_over_verify" in out
    assert "decode reads 15.87 GB a step, >= 5.29 ms at the measured copy bandwidth 3000 GB/s" in out
    path.write_text(json.dumps({**nine_b_run(0.8, 0.8, 0.8), "cudagraph_skips": 2}) + "\n")
    assert presets.preset_summary(str(path)) == 0
    assert "2 compiled graphs NOT run as CUDA graphs" in capsys.readouterr().out
    ar = {k: v for k, v in nine_b_run(0.8, 0.8, 0.8).items() if k not in ("verify_ms", "draft_ms", "verify_over_decode",
                                                                          "draft_over_verify", "projected_dflash_tokens_per_s")}
    path.write_text(json.dumps({**ar, "part": "ar"}) + "\nKilled\n")
    assert presets.preset_summary(str(path)) == 1
    out = capsys.readouterr().out
    assert "AR only" in out and "PASS  decode_bandwidth" in out and out.count("MISSING  ") == 3
    path.write_text("Traceback (most recent call last):\n")
    assert presets.preset_summary(str(path)) == 1
    assert "no JSON line" in capsys.readouterr().out


def test_profile_decode_reports_per_step_self_times(capsys):
    """tools/bench.py --profile-decode (eager here, kept tiny): a decode-step median, then the profiler's top entries per
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
    """tools/bench.py --profile-round (eager here, 3 calls of each step): the medians of a draft of the whole block, its
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
