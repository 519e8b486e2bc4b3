"""Side-by-side benchmark: plain AR and DFlash on the same prompts and weights, in one process.

    python bench.py                                     # embedded tiny pair, 64 held-out Python prompts
    python bench.py --target DIR --draft DIR --prompt "..." --prompt "..." --max-new-tokens 256

Warm-up runs are excluded. Printed: per-prompt and median tok/s of both, their ratio (the speedup), mean
acceptance length and its histogram, ms per decode / draft / verify step, the weight bandwidth of a decode
step (on CUDA also as a fraction of a device copy measured in the same run), whether the outputs are identical.
The last stdout line is one JSON object. Machines are noisy: compare ratios measured in the same run.

    python bench.py --preset qwen3.5-9b --random-weights --compile --compile-mode reduce-overhead   # on a GPU
    python bench.py --preset tiny-9b-shape --random-weights                                       # the same code, CPU, seconds
    python bench.py --preset qwen3.5-35b-a3b --random-weights      # mixture of experts: a GPU (about 70 GB of bf16 weights)
    python bench.py --preset tiny-35b-a3b-shape --random-weights   # its layers, experts and routing at 1/32 width, CPU

`--preset` builds the model shapes with random weights on the device (step times do not depend on the weight
values, so no download is needed) and times AR decode, verify and draft steps; it reports the achieved weight
bandwidth of a decode step against a measured device-to-device copy (CUDA), and the PROJECTED DFlash tok/s at
a published mean acceptance length (`--tau`, default 5.60: MMFlash's average on Qwen3.5-9B).

    python bench.py --threads 1 --parting --dtype bfloat16          # where DFlash and AR part in bf16, and why
    python bench.py --methods dflash,mtp3,mtp7,mtp15 --no-adaptive  # DFlash and Qwen3.5's MTP head (K = 3, 7, 15) vs AR
    python bench.py --draft-rules 0.3,0.5,0.8,1.0 --heldout 16      # sampled DFlash2 drafts: coupled vs ratio acceptance
    python bench.py --profile-decode --compile --threads 1 --heldout 4  # where a compiled AR decode step's time goes
    python bench.py --concurrency 1,8,32                            # many requests in flight: DFlash vs AR per N

`--parting` times nothing: per prompt it runs greedy DFlash and greedy AR in --dtype, finds the first output token
where they differ, re-runs the target teacher-forced in float32 and float64 over the prompt + the agreed tokens,
and reports the gap between the two tokens' logits there, in rounding steps of --dtype (a parting is legitimate
only at a near-tie: docs/method.md#exactness-and-precision), and the float32 top-2 margins at every AR position.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import adaptive
import batching
import dflash
import checkpoint as ckpt
import model as M
from check import NEAR_TIE_STEPS, margin_errors, rounding_step, teacher_forced_logits
from generate import ATTENTION, COMPILE_MODES, DEFAULT_DRAFT, DEFAULT_TARGET, DTYPES, compile_options, pick_dtype, use_onednn

MMFLASH_TAU = 5.60      # mean acceptance length published for FSCCS/Qwen3.5-9B-MMFlash (average over its benchmarks)
PRESETS = ("qwen3.5-9b", "tiny-9b-shape", "qwen3.5-35b-a3b", "tiny-35b-a3b-shape")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--prompt", action="append", default=[], help="a prompt text; repeat for several")
    p.add_argument("--prompts", help="a file with one prompt per line")
    p.add_argument("--heldout", type=int, default=64,
                   help="without prompts: this many held-out stdlib prompts of 30-60 tokens (train.heldout_prompts); "
                        "acceptance varies a lot from prompt to prompt, so a handful is too few to measure it")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=1,
                   help="run every prompt this many times (each engine in turn) and take its median tok/s: steadier "
                        "ratios on a noisy machine")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="torch.compile the step functions (compile time reported apart)")
    p.add_argument("--compile-mode", default="max-autotune", choices=COMPILE_MODES, help="torch.compile mode with --compile (default max-autotune)")
    p.add_argument("--cpp-wrapper", action=argparse.BooleanOptionalAction, default=True,
                   help="with --compile on a CPU: inductor's C++ wrapper (see generate.py)")
    p.add_argument("--vs-reference", action="store_true",
                   help="also time the z-lab reference loop (dflash package + transformers) on the same checkpoints")
    p.add_argument("--onednn", action=argparse.BooleanOptionalAction, default=None,
                   help="oneDNN products of a few rows on a float32 CPU (default: where measured faster at load; see generate.py)")
    p.add_argument("--attention", choices=sorted(ATTENTION), default="sdpa", help="attention of the cached steps (see generate.py)")
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="time the steps of these shapes instead of checkpoints: qwen3.5-9b (real 9B text shapes + a 5-layer "
                        "block-16 drafter), tiny-9b-shape (the same layer pattern and heads at 1/32 of the width, for CPU), "
                        "qwen3.5-35b-a3b (the mixture-of-experts text shapes, 256 experts top-8, + an 8-layer drafter: "
                        "about 70 GB in bf16, so a GPU; it does not fit a 24 GiB machine), tiny-35b-a3b-shape (its "
                        "40 layers, 256 experts and top-8 at 1/32 of the widths, for CPU)")
    p.add_argument("--parting", action="store_true",
                   help="instead of timing: run greedy DFlash and greedy AR in --dtype on each prompt, find the first output "
                        "token where they part, and report how near a tie the target was there (the gap between the two "
                        "tokens' logits, the target re-run teacher-forced in float32 and float64, in rounding steps of "
                        "--dtype at that logit size) and the float32 top-2 margins at every AR position for context "
                        "(docs/method.md#exactness-and-precision). Eager (--compile and --onednn do not apply); use with --dtype bfloat16")
    p.add_argument("--random-weights", action="store_true", help="with --preset: random weights built on the device (required)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="with --preset: random prompt length (default 512; 64 for the tiny ones); with checkpoints: held-out "
                        "prompts of this many tokens (long_prompts) instead of the 30-60 token ones")
    p.add_argument("--draft-window", type=int, default=None, help="as generate.py's (default: the drafter's training context; 0 = none)")
    p.add_argument("--no-adaptive", action="store_true", help="pure DFlash rounds (default: adaptive speculation, as generate.py)")
    p.add_argument("--methods", default=None,
                   help="instead of one drafter: AR and each of these proposers on the same prompts in one run, e.g. "
                        "dflash,mtp3,mtp7,mtp15 (mtpK: the target's MTP head, K chained steps); a table of tau and speedup "
                        "per method, as the MMFlash paper compares them")
    p.add_argument("--draft-rules", default=None, metavar="T1,T2,...",
                   help="instead of timing: acceptance of sampled drafts under the coupled and the ratio rule at these "
                        "temperatures (pure rounds, one seed per prompt), with --draft in DFlash2 form if it is a DFlash "
                        "drafter (draft_rules_main), beside the drafter drafting greedily")
    p.add_argument("--selector-top-k", type=int, default=8, help="with --draft-rules: candidates per row of the DFlash2 form")
    p.add_argument("--top-p", type=float, default=1.0, help="with --draft-rules: nucleus sampling mass (1 = off)")
    p.add_argument("--tau", type=float, default=MMFLASH_TAU, help="with --preset: acceptance length for the projected tok/s")
    p.add_argument("--replay", action="store_true",
                   help="instead of timing the policy: record each prompt's drafts at every position (a look at every step) "
                        "and pure rounds once, then replay adaptive speculation on the recording at the run's median step "
                        "costs (adaptive.replay): its decisions without the timing noise, per prompt, against AR and pure rounds")
    p.add_argument("--vs-pure", action="store_true",
                   help="instead of AR vs DFlash: adaptive speculation against pure rounds on one engine, each prompt in turn "
                        "(--repeat times each, medians): their ratio per prompt, side by side (separate runs drift apart "
                        "with the machine's speed)")
    p.add_argument("--profile-decode", action="store_true",
                   help="instead of AR vs DFlash: where a plain AR decode step's time goes (compiled with --compile): step "
                        "times, then torch.profiler over the decode steps of the first prompt, self time per step of the top "
                        "entries (the compiled graph, dynamo's checks, the gathering of its inputs, ...)")
    p.add_argument("--concurrency", default=None, metavar="N1,N2,...",
                   help="requests in flight, e.g. 1,8,32: per N, DFlash and AR throughput of a batch (batching.py) kept at "
                        "N requests until the queue runs dry (generated tokens / wall time), speedup, mean acceptance")
    p.add_argument("--round-costs", default=None, metavar="C1,C2,...",
                   help="with --replay: also replay at these fixed costs of a round, in plain steps (a look at its measured "
                        "ratio), e.g. 1.2,2,2.5,3: how the policy and pure rounds trade on other devices")
    p.add_argument("--policy", default="",
                   help="with --replay: adaptive.Adaptive settings, e.g. first_wait=16,confidence=0.5 (default: the defaults)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    try:
        args.policy_kw = policy_settings(args.policy)
    except ValueError as e:
        p.error(str(e))
    if args.policy and not args.replay:
        p.error("--policy is for --replay")
    if args.round_costs is not None:
        args.round_costs = positive_numbers(args.round_costs)
        if not args.replay or not args.round_costs:
            p.error("--round-costs takes positive numbers, comma-separated, with --replay")
    if args.parting and args.preset:
        p.error("--parting runs checkpoints, not a --preset")
    if args.preset and not args.random_weights:
        p.error("--preset needs --random-weights (no checkpoint is loaded for a preset)")
    others = {"--compile": args.compile, "--preset": args.preset, "--parting": args.parting, "--methods": args.methods,
              "--vs-reference": args.vs_reference}
    if args.replay:
        refuse_flags(p, "--replay runs the eager DFlash engine on checkpoints", {**others, "--no-adaptive": args.no_adaptive})
    if args.draft_rules:
        refuse_flags(p, "--draft-rules measures acceptance with eager pure rounds on checkpoints", {**others, "--replay": args.replay})
        temps = positive_numbers(args.draft_rules)
        if not temps:
            p.error(f"--draft-rules takes temperatures > 0, comma-separated (e.g. 0.3,0.8), got {args.draft_rules!r}")
        args.draft_rules = temps
    if args.vs_pure:
        refuse_flags(p, "--vs-pure runs adaptive speculation and pure rounds on one DFlash engine", {
            **others, "--compile": False, "--replay": args.replay, "--draft-rules": args.draft_rules,
            "--no-adaptive": args.no_adaptive})
    if args.concurrency is not None:
        ns = positive_numbers(args.concurrency)
        if not ns or any(n != int(n) for n in ns):
            p.error(f"--concurrency takes whole numbers >= 1, comma-separated (e.g. 1,8,32), got {args.concurrency!r}")
        args.concurrency = [int(n) for n in ns]
        refuse_flags(p, "--concurrency runs batches of requests on checkpoints or a --preset", {
            **others, "--compile": False, "--preset": False, "--replay": args.replay, "--draft-rules": args.draft_rules,
            "--vs-pure": args.vs_pure, "--attention flex": args.attention == "flex"})
    if args.profile_decode:
        refuse_flags(p, "--profile-decode times plain AR decoding of the target", {**others, "--compile": False, "--replay": args.replay,
                     "--draft-rules": args.draft_rules, "--vs-pure": args.vs_pure, "--no-adaptive": args.no_adaptive})
    return args


def refuse_flags(p, mode: str, flags: dict) -> None:
    """A mode that does not run some flags refuses them in one usage line: flags maps each to whether it was given."""
    clash = [flag for flag, on in flags.items() if on]
    if clash:
        p.error(f"{mode}; drop {', '.join(clash)}")


def positive_numbers(text: str) -> list:
    """"0.3,0.8" -> [0.3, 0.8]; [] when an item is not a number or not > 0."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        return []
    return values if values and min(values) > 0 else []


def warm_engines(args, target, proposer, block: int, capacity: int, prompt: list, stops) -> tuple:
    """The AR and DFlash engines of one benchmark (compiled with --compile), warmed up on `prompt`:
    compilation, CUDA graph capture, allocator and lazy init, excluded from the figures.
    -> (ar_engine, dflash_engine, warm-up seconds)."""
    mode = args.compile_mode if args.compile else None
    kw = dict(compile_mode=mode, masks=ATTENTION[args.attention], compile_options=compile_options(args, target.embed_tokens.weight.device))
    ar_engine = dflash.Engine(target, None, 1, capacity, **kw)
    # --preset times the steps themselves: every step a round (random drafts would switch adaptive speculation off)
    policy = None if getattr(args, "no_adaptive", True) or getattr(args, "preset", None) else adaptive.Adaptive()
    sp_engine = dflash.Engine(target, proposer, block, capacity, **kw)
    t0 = time.perf_counter()
    ar_engine.run(prompt, 8, stops)
    warm_spec_engine(sp_engine, prompt, stops, policy)
    return ar_engine, sp_engine, time.perf_counter() - t0


def warm_spec_engine(engine, prompt: list, stops, policy) -> None:
    """A throw-away run of a speculative engine; with a policy, every step kind (round, plain, look) runs in it,
    so the timed run compiles nothing new. Then the engine gets `policy` (None: pure rounds)."""
    engine.policy = adaptive.Pattern([True, "look"]) if policy else None
    engine.run(prompt, 3 * engine.block, stops)
    engine.policy = policy


def products_words(products: dict) -> str:
    """use_onednn's record in words: which products the few-row steps ran, and what was measured at load."""
    measured = products["onednn_measured"]
    how = f"measured at load: oneDNN {measured:.2f}x the time of MKL" if measured else "forced or not applicable"
    return f"few-row products: {'oneDNN' if products['onednn'] else 'MKL'} ({how})"


def load_pair(args, dtype, device) -> tuple:
    """The target and drafter of --target / --draft (their products chosen as generate.py does: --onednn), the draft
    window, the proposer, the block size, the prompts as ids, the stop ids and the products' record (use_onednn).
    -> (target, drafter, window, proposer, block, prompts, stops, products)."""
    target = ckpt.load_target(args.target, dtype, device)
    drafter = ckpt.load_drafter(args.draft, target.cfg, dtype, device)
    block = args.block_size or drafter.cfg.block_size
    products = use_onednn(args.onednn, block, target, drafter)
    window = ckpt.draft_window(drafter.cfg, args.draft_window)
    proposer = dflash.DrafterProposer(drafter, target, window)
    prompts = load_prompts(args, ckpt.load_tokenizer(target.path), target.path)
    return target, drafter, window, proposer, block, prompts, ckpt.stop_token_ids(target.path, target.cfg), products


def load_prompts(args, tok, path: str) -> list:
    """The benchmark's prompts as token ids: --prompt and --prompts texts, else --heldout held-out prompts."""
    texts = list(args.prompt)
    if args.prompts:
        with open(args.prompts) as fh:
            texts += [line.rstrip("\n") for line in fh if line.strip()]
    if texts:
        if tok is None:
            raise dflash.GenerationError(f"{path} has no tokenizer.json to encode the prompts")
        return [tok.encode(t).ids for t in texts]
    import train
    if getattr(args, "prompt_len", None):
        return long_prompts(tok, args.heldout, args.prompt_len)
    return train.heldout_prompts(tok, args.heldout)


def long_prompts(tok, n: int, length: int, seed: int = 0) -> list:
    """n prompts of `length` tokens from the held-out standard-library files (never trained on): prompt i starts
    at the top of the i-th file in a seeded order and runs on into the next files when that one is too short."""
    import random
    import train
    files = train.stdlib_files("heldout")
    random.Random(seed).shuffle(files)
    texts = [t for t in map(train.read_text, files) if t.strip()]
    prompts = []
    for i in range(n):
        ids = []
        for t in texts[i % len(texts):] + texts[:i % len(texts)]:
            ids += tok.encode(t).ids
            if len(ids) >= length:
                break
        if len(ids) < length:
            raise dflash.GenerationError(f"the held-out files hold fewer than {length} tokens")
        prompts.append(ids[:length])
    return prompts


def bench_capacity(prompts: list, max_new_tokens: int, block: int) -> int:
    """The cache positions of the benchmark's engines: the longest prompt, its tokens (at least the warm-up's
    3 blocks) and a block of slack."""
    return max(len(p) for p in prompts) + max(max_new_tokens, 3 * block) + block


def step_ms(results, kind, attr):
    vals = [getattr(s, attr) for r in results for s in r.steps if s.kind == kind]
    return 1000 * statistics.median(vals) if vals else None


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    modes = ((args.preset, preset_main), (args.parting, parting_main), (args.methods, methods_main),
             (args.replay, replay_main), (args.draft_rules, draft_rules_main), (args.vs_pure, vs_pure_main),
             (args.profile_decode, profile_decode_main), (args.concurrency, concurrency_main))
    for chosen, mode_main in modes:         # the modes instead of AR vs DFlash, first given first
        if chosen:
            return mode_main(args, device)
    dtype = pick_dtype(args.dtype, device)
    peak = peak_copy_gb_s() if torch.device(device).type == "cuda" else None     # before the model takes the memory
    target, drafter, window, proposer, block, prompts, stops, products = load_pair(args, dtype, device)

    capacity = bench_capacity(prompts, args.max_new_tokens, block)
    mode = args.compile_mode if args.compile else None
    ar_engine, sp_engine, warmup_seconds = warm_engines(args, target, proposer, block, capacity, prompts[0], stops)
    print(f"warm-up {'(compilation, mode ' + mode + ') ' if mode else ''}{warmup_seconds:.1f} s; {products_words(products)}",
          flush=True)

    # With --compile, eager DFlash runs too, on the same prompts in the same process: compiled / eager side by side.
    eager_engine = dflash.Engine(target, proposer, block, capacity, masks=ATTENTION[args.attention]) if mode else None
    if eager_engine is not None:
        eager_engine.run(prompts[0], 3 * block, stops)

    def tps(res):
        return (len(res.output_ids) - 1) / res.decode_seconds

    ar_res, sp_res, rows, eager_tps = [], [], [], []     # per prompt (the last repeat: greedy runs repeat exactly)
    ar_all, sp_all = [], []                              # every run, for step times and the whole-run ratio
    for i, p in enumerate(prompts):
        a_t, s_t, e_t, same = [], [], [], True
        for _ in range(args.repeat):
            ar = ar_engine.run(p, args.max_new_tokens, stops, profile=True)
            sp = sp_engine.run(p, args.max_new_tokens, stops, profile=True)
            a_t.append(tps(ar)), s_t.append(tps(sp)), ar_all.append(ar), sp_all.append(sp)
            same = same and ar.output_ids == sp.output_ids
            if eager_engine is not None:
                ea = eager_engine.run(p, args.max_new_tokens, stops, profile=True)
                e_t.append(tps(ea))
                same = same and ea.output_ids == sp.output_ids
        ar_tps, sp_tps = statistics.median(a_t), statistics.median(s_t)
        extra = ""
        if eager_engine is not None:
            eager_tps.append(statistics.median(e_t))
            extra = f"  eager DFlash {eager_tps[-1]:8.1f} tok/s"
        rows.append((ar_tps, sp_tps, sp.mean_acceptance_length, same))
        ar_res.append(ar), sp_res.append(sp)
        plain, looks = sp.step_kinds.count("plain"), sum(s.look is not None for s in sp.steps)
        print(f"prompt {i}: {len(p)} tokens -> {len(sp.output_ids)}  AR {ar_tps:8.1f} tok/s  DFlash {sp_tps:8.1f} tok/s  "
              f"speedup {sp_tps / ar_tps:5.2f}x  tau {sp.mean_acceptance_length:5.2f}  plain steps {plain:3d} "
              f"(looks {looks})  identical {same}{extra}", flush=True)

    ar_med = statistics.median(r[0] for r in rows)
    sp_med = statistics.median(r[1] for r in rows)
    speedups = [r[1] / r[0] for r in rows]
    quart = statistics.quantiles(speedups, n=4) if len(speedups) > 1 else speedups * 3
    # all tokens over all decode time: the throughput of the whole run, hard prompts weighted by their time
    agg = (sum(len(r.output_ids) - 1 for r in sp_all) / sum(r.decode_seconds for r in sp_all)) / \
          (sum(len(r.output_ids) - 1 for r in ar_all) / sum(r.decode_seconds for r in ar_all))
    all_acc = [a for r in sp_res for a in r.verify_lengths]
    tau = sum(all_acc) / len(all_acc) if all_acc else 0.0
    hist = [all_acc.count(k) for k in range(1, block + 1)]
    decode_ms, draft_ms, verify_ms = step_ms(ar_all, "decode", "verify_seconds"), step_ms(sp_all, "verify", "draft_seconds"), step_ms(sp_all, "verify", "verify_seconds")
    plain_ms = step_ms(sp_all, "plain", "verify_seconds")         # a decode that also feeds the drafter's context
    look_ms = 1000 * statistics.median(looks) if (looks := [s.draft_seconds for r in sp_all for s in r.steps if s.look is not None]) else None
    print(f"median: AR {ar_med:.1f} tok/s, DFlash {sp_med:.1f} tok/s, median per-prompt speedup {statistics.median(speedups):.2f}x "
          f"(quartiles {quart[0]:.2f} / {quart[2]:.2f}, min {min(speedups):.2f}, max {max(speedups):.2f}); "
          f"whole run (all tokens / all decode time) {agg:.2f}x")
    print(f"mean acceptance length {tau:.2f} (block {block}); histogram of tokens per verify step 1..{block}: {hist}")
    print(f"ms per step (median): decode {decode_ms:.2f}, draft {draft_ms:.2f}, verify {verify_ms:.2f}"
          + (f", plain (decode + the drafter's context) {plain_ms:.2f}" if plain_ms else "")
          + (f", look (a draft alone) {look_ms:.2f}" if look_ms else ""))
    wbytes, achieved, bw_line, fraction = bandwidth(target, decode_ms, peak)
    print(bw_line)
    print(f"outputs identical to AR{' (and to eager DFlash)' if eager_tps else ''}: {sum(r[3] for r in rows)}/{len(rows)}")
    compiled = {}
    if eager_tps:
        ratios = [r[1] / e for r, e in zip(rows, eager_tps)]
        compiled = {"eager_dflash_tokens_per_s": statistics.median(eager_tps),
                    "compiled_over_eager": statistics.median(ratios)}
        print(f"compiled DFlash / eager DFlash (same prompts, same run): median per-prompt {compiled['compiled_over_eager']:.2f}x "
              f"(eager median {compiled['eager_dflash_tokens_per_s']:.1f} tok/s)")
    ref = reference_loop(args, target, drafter, prompts, stops, rows) if args.vs_reference else {}
    print(json.dumps({**ref, **compiled,
        "device": device, "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
        "prompts": len(prompts), "repeat": args.repeat, "max_new_tokens": args.max_new_tokens, "block_size": block,
        "ar_tokens_per_s": ar_med, "dflash_tokens_per_s": sp_med, "speedup": statistics.median(speedups),
        "speedup_quartiles": [quart[0], quart[2]], "speedup_whole_run": agg,
        "mean_acceptance_length": tau, "acceptance_histogram": hist,
        "decode_ms": decode_ms, "draft_ms": draft_ms, "verify_ms": verify_ms,
        "weight_bytes_per_decode": wbytes, "achieved_gb_s": achieved, "peak_copy_gb_s": peak,
        "bandwidth_fraction": fraction, "identical_outputs": sum(r[3] for r in rows), "compile_seconds": warmup_seconds if mode else 0.0,
        "compile_mode": mode, "attention": args.attention, **products, "cpp_wrapper": bool(mode and args.cpp_wrapper),
        "adaptive": not args.no_adaptive, "draft_window": window, "plain_ms": plain_ms, "look_ms": look_ms, "prompt_len": args.prompt_len,
        "plain_steps": sum(r.step_kinds.count("plain") for r in sp_res), "looks": sum(s.look is not None for r in sp_res for s in r.steps), "rounds": sum(r.step_kinds.count("verify") for r in sp_res),
    }))


# ---------------------------------------------------------------------------------------------------------------
# --replay: the adaptive policy without the timing noise
# ---------------------------------------------------------------------------------------------------------------

def policy_settings(text: str) -> dict:
    """"first_wait=16,confidence=0.5" -> keyword arguments of adaptive.Adaptive (numbers of its defaults' types),
    checked by name."""
    import inspect
    known = {k: type(p.default) for k, p in inspect.signature(adaptive.Adaptive).parameters.items()}
    kw = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if key not in known or not eq:
            raise ValueError(f"--policy: {item!r} is not NAME=NUMBER with NAME one of {', '.join(known)}")
        try:
            kw[key] = known[key](value)
        except ValueError:
            raise ValueError(f"--policy: {key} must be a number, got {value!r}") from None
    return kw


def replay_main(args, device) -> dict:
    """Per prompt: one generation with a look at every step (adaptive.Pattern(["look"])) records the drafter's
    proposals after every output token, and one generation of pure rounds measures a round; then
    adaptive.replay runs the policy on the recording at the run's median costs of a plain step, a look and a
    round. A plain step stands for an AR step (the same target call). The machine's noise moves the costs, not the
    decisions, so policies can be compared prompt by prompt; the real timing is bench.py without --replay."""
    dtype = pick_dtype(args.dtype, device)
    target, _, _, proposer, block, prompts, stops, _ = load_pair(args, dtype, device)
    engine = dflash.Engine(target, proposer, block, bench_capacity(prompts, args.max_new_tokens, block))
    warm_spec_engine(engine, prompts[0], stops, True)
    looked, rounds = [], []
    for p in prompts:
        engine.policy = adaptive.Pattern(["look"])
        looked.append(engine.run(p, args.max_new_tokens, stops))
        engine.policy = None
        rounds.append(engine.run(p, args.max_new_tokens, stops))
        if rounds[-1].output_ids != looked[-1].output_ids:      # a float32 near-tie between two kernels' rounding
            print(f"note: prompt {len(rounds) - 1}: rounds and plain steps part at a near-tie; replayed on the plain output")
    plain_s = statistics.median(s.verify_seconds for r in looked for s in r.steps if s.kind == "plain")
    look_s = statistics.median(s.draft_seconds for r in looked for s in r.steps if s.look is not None)
    round_s = statistics.median(s.draft_seconds + s.verify_seconds for r in rounds for s in r.steps if s.kind == "verify")
    print(f"costs (medians): plain step {1000 * plain_s:.2f} ms, look {1000 * look_s:.2f} ms, round {1000 * round_s:.2f} ms")
    adaptive_x, rounds_x = [], []
    for i, (lk, rd) in enumerate(zip(looked, rounds)):
        drafts = [s.look or [] for s in lk.steps[1:]]
        x, kinds = adaptive.replay(adaptive.Adaptive(**args.policy_kw), lk.output_ids, drafts, plain_s, look_s, round_s)
        pure = (len(rd.output_ids) - 1) * plain_s / (len(rd.acceptance_lengths) * round_s) if rd.acceptance_lengths else 1.0
        adaptive_x.append(x), rounds_x.append(pure)
        print(f"prompt {i}: {len(lk.prompt_ids)} tokens  adaptive {x:5.2f}x  pure rounds {pure:5.2f}x (tau {rd.mean_acceptance_length:5.2f})  "
              f"rounds {kinds.count('R')}, plain steps {kinds.count('.') + kinds.count('L')}, looks {kinds.count('L')}  {kinds[:60]}"
              f"{'...' if len(kinds) > 60 else ''}", flush=True)
    summary = {"replay": True, "policy": args.policy_kw, "prompts": len(prompts), "prompt_len": args.prompt_len,
               "max_new_tokens": args.max_new_tokens, "plain_ms": 1000 * plain_s, "look_ms": 1000 * look_s,
               "round_ms": 1000 * round_s, "adaptive_speedup": statistics.median(adaptive_x), "adaptive_min": min(adaptive_x),
               "adaptive_geomean": statistics.geometric_mean(adaptive_x), "rounds_speedup": statistics.median(rounds_x),
               "rounds_min": min(rounds_x), "adaptive_below_1": sum(x < 1 for x in adaptive_x)}
    print(f"replayed speedup over AR: adaptive median {summary['adaptive_speedup']:.2f}x (min {summary['adaptive_min']:.3f}, "
          f"geometric mean {summary['adaptive_geomean']:.2f}, {summary['adaptive_below_1']} below 1), pure rounds median "
          f"{summary['rounds_speedup']:.2f}x (min {summary['rounds_min']:.2f})")
    if args.round_costs:
        summary["by_round_cost"] = replay_at_costs(args, looked, rounds, look_s / plain_s)
    print(json.dumps(summary))
    return summary


def vs_pure_main(args, device) -> dict:
    """--vs-pure: one DFlash engine (compiled with --compile), each prompt run with adaptive speculation and with pure
    rounds in turn, --repeat times each; per prompt the ratio of their median tok/s, and its geometric mean."""
    dtype = pick_dtype(args.dtype, device)
    target, _, _, proposer, block, prompts, stops, products = load_pair(args, dtype, device)
    print(products_words(products), flush=True)
    _, engine, _ = warm_engines(args, target, proposer, block, bench_capacity(prompts, args.max_new_tokens, block), prompts[0], stops)
    ratios, plain = [], 0
    for i, p in enumerate(prompts):
        tps = {"adaptive": [], "pure": []}
        for _ in range(args.repeat):
            for name in ("pure", "adaptive"):
                engine.policy = adaptive.Adaptive() if name == "adaptive" else None
                res = engine.run(p, args.max_new_tokens, stops, profile=True)
                tps[name].append((len(res.output_ids) - 1) / res.decode_seconds)
                plain += res.step_kinds.count("plain") if name == "adaptive" else 0
        ratios.append(statistics.median(tps["adaptive"]) / statistics.median(tps["pure"]))
        print(f"prompt {i}: {len(p)} tokens  adaptive {statistics.median(tps['adaptive']):7.1f} tok/s  pure rounds "
              f"{statistics.median(tps['pure']):7.1f} tok/s  ratio {ratios[-1]:.3f}", flush=True)
    result = {"mode": "vs_pure", "prompts": len(prompts), "repeat": args.repeat, "compile": args.compile,
              "adaptive_over_pure_geomean": statistics.geometric_mean(ratios), "adaptive_over_pure_median": statistics.median(ratios),
              "adaptive_over_pure_min": min(ratios), "adaptive_plain_steps": plain, "device": device,
              "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(), "prompt_len": args.prompt_len, **products}
    print(f"adaptive / pure rounds per prompt: geometric mean {result['adaptive_over_pure_geomean']:.3f}, median "
          f"{result['adaptive_over_pure_median']:.3f}, min {result['adaptive_over_pure_min']:.2f}")
    print(json.dumps(result))
    return result


def profile_decode_main(args, device, top: int = 8) -> dict:
    """--profile-decode: plain AR decoding of the target (compiled with --compile, after a warm-up), each prompt
    --repeat times: the median decode step (Step.verify_seconds: the step call, the token's choice and its host
    sync); then torch.profiler over the decode steps of the first prompt (its prefill left out): the `top` entries
    by self CPU time, per step. Under a compiled step: "Call CompiledFxGraph" is the compiled graph, "TorchDynamo
    Cache Lookup" dynamo's checks, "Pregraph bytecode" the gathering of the graph's inputs."""
    from torch.profiler import ProfilerActivity, profile
    dtype = pick_dtype(args.dtype, device)
    target = ckpt.load_target(args.target, dtype, device)
    prompts = load_prompts(args, ckpt.load_tokenizer(target.path), target.path)
    mode = args.compile_mode if args.compile else None
    engine = dflash.Engine(target, None, 1, bench_capacity(prompts, args.max_new_tokens, 1), mode,
                           masks=ATTENTION[args.attention], compile_options=compile_options(args, device))
    engine.run(prompts[0], 8)                                         # warm-up: compilation
    res = [engine.run(p, args.max_new_tokens, profile=True) for _ in range(args.repeat) for p in prompts]
    decode_ms = step_ms(res, "decode", "verify_seconds")
    steps = engine.generate(prompts[0], args.max_new_tokens)
    next(steps)                                                       # the prefill, not profiled
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        n = sum(1 for _ in steps)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    print(f"decode step, median over {len(res)} generations: {decode_ms:.3f} ms ({'compiled, ' + mode if mode else 'eager'}, "
          f"{torch.get_num_threads()} threads)\nunder torch.profiler, {n} decode steps, self CPU time per step:")
    for e in rows:
        print(f"  {e.key[:60]:60s} {e.self_cpu_time_total / n:9.1f} us  ({e.count / n:.1f} calls)")
    result = {"mode": "profile_decode", "decode_ms": decode_ms, "compile_mode": mode, "threads": torch.get_num_threads(),
              "device": device, "dtype": str(dtype).replace("torch.", ""), "profiled_steps": n,
              "self_us_per_step": {e.key: e.self_cpu_time_total / n for e in rows}}
    print(json.dumps(result))
    return result


def concurrency_main(args, device) -> dict:
    """--concurrency N1,N2,...: per N, a batching.Batch of N slots with a DFlash drafter (adaptive unless --no-adaptive)
    and one without (AR) run the same requests, each prompt --repeat times, alternately; N requests are in flight
    until the queue runs dry (requests: the prompts, repeated up to 3N so that the tail of the queue, when fewer
    are left, is short). Throughput = generated tokens / wall time of the whole run (admissions' prefills included,
    the same for both); per-request tok/s = a request's tokens after its first / its decode time."""
    dtype = pick_dtype(args.dtype, device)
    target, drafter, window, _, block, prompts, stops, products = load_pair(args, dtype, device)
    print(f"{products_words(products)}; {torch.get_num_threads()} threads", flush=True)
    mode = args.compile_mode if args.compile else None
    options = compile_options(args, target.embed_tokens.weight.device)
    table = []
    for n in args.concurrency:
        reqs = [batching.Request(p, args.max_new_tokens, tuple(stops)) for p in (prompts * (3 * n))[:max(len(prompts), 3 * n)]]
        capacity = bench_capacity([r.prompt_ids for r in reqs], args.max_new_tokens, block)
        policy = None if args.no_adaptive else batching.Policy(block=block)
        engines = {"ar": batching.Batch(target, None, 1, n, capacity, mode, options),
                   "dflash": batching.Batch(target, batching.SlotDrafter(drafter, target, window), block, n, capacity,
                                            mode, options, policy)}
        t0 = time.perf_counter()
        for eng in engines.values():               # warm-up: compiles every step kind the policy may take
            eng.warm_up(reqs)
        warm = time.perf_counter() - t0
        runs = {"ar": [], "dflash": []}
        for _ in range(args.repeat):
            for name, eng in engines.items():
                t0 = time.perf_counter()
                results = eng.run(reqs)
                runs[name].append((time.perf_counter() - t0, results))
        row = concurrency_row(n, runs, warm)
        table.append(row)
        print(f"N={n:3d}  AR {row['ar_tokens_per_s']:8.1f} tok/s  DFlash {row['dflash_tokens_per_s']:8.1f} tok/s  "
              f"speedup {row['speedup']:.2f}x  per request: AR {row['ar_request_tokens_per_s']:.1f}, DFlash "
              f"{row['dflash_request_tokens_per_s']:.1f} tok/s  mean acceptance {row['mean_acceptance']:.2f}  "
              f"rounds {row['round_share']:.0%} of DFlash steps  identical {row['identical']}  ({len(reqs)} requests; "
              f"warm-up {warm:.1f} s)", flush=True)
    out = {"mode": "concurrency", "device": device, "dtype": str(dtype).replace("torch.", ""), "block_size": block,
           "max_new_tokens": args.max_new_tokens, "repeat": args.repeat, "adaptive": not args.no_adaptive,
           "compile": bool(mode), **products, "concurrency": table}
    print(json.dumps(out))
    return out


def concurrency_row(n: int, runs: dict, warm: float) -> dict:
    """One N's line of the concurrency table from runs {name: [(seconds, [Result])] per repeat}: medians over repeats."""
    def throughput(name):
        return statistics.median(sum(len(r.output_ids) for r in res) / sec for sec, res in runs[name])

    def per_request(name):
        return statistics.median((len(r.output_ids) - 1) / r.decode_seconds for _, res in runs[name] for r in res
                                 if r.decode_seconds > 0 and len(r.output_ids) > 1)
    rounds = [a for _, res in runs["dflash"] for r in res for a in r.verify_lengths]
    kinds = [k for _, res in runs["dflash"] for r in res for k in r.step_kinds]
    ar, sp = throughput("ar"), throughput("dflash")
    identical = all(a.output_ids == b.output_ids for (_, x), (_, y) in zip(runs["ar"], runs["dflash"]) for a, b in zip(x, y))
    return {"n": n, "dflash_tokens_per_s": sp, "ar_tokens_per_s": ar, "speedup": sp / ar,
            "mean_acceptance": sum(rounds) / len(rounds) if rounds else 0.0,
            "ar_request_tokens_per_s": per_request("ar"), "dflash_request_tokens_per_s": per_request("dflash"),
            "round_share": kinds.count("verify") / len(kinds) if kinds else 0.0, "identical": identical,
            "requests": len(runs["ar"][0][1]), "warmup_seconds": warm}


def replay_at_costs(args, looked, rounds, look: float) -> dict:
    """--round-costs: the recordings replayed with a plain step = 1, a look = `look` and a round = each given cost;
    per cost the per-prompt speedups over AR of the policy and of pure rounds, and their medians, minima and the
    geometric mean of policy / pure rounds."""
    out = {}
    print("\n| round / plain step | pure rounds: median, min | adaptive: median, min | adaptive / pure (geometric mean) |\n|---|---|---|---|")
    for cost in args.round_costs:
        ad = [adaptive.replay(adaptive.Adaptive(**args.policy_kw), lk.output_ids, [s.look or [] for s in lk.steps[1:]],
                              1.0, look, cost)[0] for lk in looked]
        pure = [(len(rd.output_ids) - 1) / (len(rd.acceptance_lengths) * cost) if rd.acceptance_lengths else 1.0 for rd in rounds]
        rel = statistics.geometric_mean([a / p for a, p in zip(ad, pure)])
        out[str(cost)] = {"adaptive": ad, "pure_rounds": pure, "adaptive_over_pure": rel}
        print(f"| {cost:g} | {statistics.median(pure):.2f}x, {min(pure):.2f}x | {statistics.median(ad):.2f}x, {min(ad):.2f}x | {rel:.3f} |")
    return out


# ---------------------------------------------------------------------------------------------------------------
# --methods: DFlash and the MTP head side by side
# ---------------------------------------------------------------------------------------------------------------

def method_proposers(args, target, dtype, device) -> dict:
    """--methods names -> {name: (proposer, block size)}: dflash (--draft, its block size and default window) and
    mtpK (the target checkpoint's MTP head, K chained steps, block K + 1)."""
    import mtp
    out, head = {}, None
    for name in args.methods.split(","):
        if name == "dflash":
            drafter = ckpt.load_drafter(args.draft, target.cfg, dtype, device)
            window = ckpt.draft_window(drafter.cfg, args.draft_window)
            out[name] = (dflash.DrafterProposer(drafter, target, window), args.block_size or drafter.cfg.block_size)
        elif name.startswith("mtp") and name[3:].isdigit():
            head = head or mtp.load_mtp(target.path, target, dtype)
            out[name] = (mtp.MTPProposer(head, target, int(name[3:])), int(name[3:]) + 1)
        else:
            raise dflash.GenerationError(f"--methods: unknown method '{name}'; use dflash or mtpK (K = 1..15), comma-separated")
    return out


def methods_main(args, device) -> dict:
    """AR and every --methods proposer on each prompt in turn (each engine warmed up first), in one process:
    per method the mean tokens per round (tau, rounds only) and the median per-prompt speedup over AR."""
    dtype = pick_dtype(args.dtype, device)
    target = ckpt.load_target(args.target, dtype, device)
    tok = ckpt.load_tokenizer(target.path)
    prompts, stops = load_prompts(args, tok, target.path), ckpt.stop_token_ids(target.path, target.cfg)
    methods = method_proposers(args, target, dtype, device)
    widest = max(b for _, b in methods.values())
    drafters = [getattr(p, "drafter", None) for p, _ in methods.values()]     # (the MTP head keeps nn.Linear, as in generate.py)
    products = use_onednn(args.onednn, widest, target, *drafters)             # chosen at the widest block
    print(products_words(products), flush=True)
    capacity = bench_capacity(prompts, args.max_new_tokens, widest)
    ar_engine = dflash.Engine(target, None, 1, capacity)
    ar_engine.run(prompts[0], 8, stops)
    engines = {}
    for name, (proposer, block) in methods.items():
        engines[name] = dflash.Engine(target, proposer, block, capacity)
        warm_spec_engine(engines[name], prompts[0], stops, None if args.no_adaptive else adaptive.Adaptive())
    runs = {name: [] for name in engines}
    speedups = {name: [] for name in engines}
    for i, p in enumerate(prompts):
        ar_t, sp_t = [], {name: [] for name in engines}
        for _ in range(args.repeat):
            ar = ar_engine.run(p, args.max_new_tokens, stops, profile=True)
            ar_t.append((len(ar.output_ids) - 1) / ar.decode_seconds)
            for name, eng in engines.items():
                res = eng.run(p, args.max_new_tokens, stops, profile=True)
                if res.output_ids != ar.output_ids:
                    raise SystemExit(f"{name} output differs from AR on prompt {i}: a bug (greedy, {dtype})")
                sp_t[name].append((len(res.output_ids) - 1) / res.decode_seconds)
                runs[name].append(res)
        line = []
        for name in engines:
            speedups[name].append(statistics.median(sp_t[name]) / statistics.median(ar_t))
            line.append(f"{name} {speedups[name][-1]:.2f}x tau {runs[name][-1].mean_acceptance_length:.2f}")
        print(f"prompt {i}: {len(p)} tokens; " + ", ".join(line), flush=True)
    table = {}
    for name in engines:
        acc = [a for r in runs[name] for a in r.verify_lengths]
        table[name] = {"tau": sum(acc) / len(acc) if acc else 0.0, "speedup": statistics.median(speedups[name]),
                       "speedup_min": min(speedups[name]), "block_size": methods[name][1]}
    print("\n| method | tau | speedup (median per prompt) | slowest prompt |\n|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} (block {row['block_size']}) | {row['tau']:.2f} | {row['speedup']:.2f}x | {row['speedup_min']:.2f}x |")
    print("outputs identical to AR: all")
    result = {"methods": table, "prompts": len(prompts), "repeat": args.repeat, "max_new_tokens": args.max_new_tokens,
              "device": device, "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
              "adaptive": not args.no_adaptive, "prompt_len": args.prompt_len, **products}
    print(json.dumps(result))
    return result


# ---------------------------------------------------------------------------------------------------------------
# --draft-rules: sampled drafts verified by the coupled and the ratio rule
# ---------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def dflash2_form(drafter: M.DFlashDrafter, top_k: int) -> M.DFlashDrafter:
    """A DFlash drafter as a DFlash2 drafter that drafts what it drafts: identity convolutions (base tap 1 at offset
    0, no predicted taps) and a candidate selector with zero codebooks, so a row's scores are its top_k logits and
    its sampled draft comes from q = softmax(top-k logits / T), the drafter's own distribution. (No DFlash2 drafter
    was trained here; this one isolates the acceptance rules from what a trained selector adds.)"""
    import dataclasses
    cfg = drafter.cfg
    if cfg.dflash2:
        return drafter
    d2cfg = dataclasses.replace(cfg, conv_kernel_size=2, conv_group_size=cfg.hidden_size, selector_rank=1, selector_top_k=top_k)
    w = drafter.fc.weight
    d2 = M.DFlashDrafter(d2cfg).to(w.device, w.dtype).eval()
    missing = d2.load_state_dict(drafter.state_dict(), strict=False).missing_keys
    for name, p in d2.named_parameters():
        if name in missing:
            p.zero_()
            if name.endswith("base_kernel"):
                p[:, 0] = 1.0                                  # x[t] itself: the identity
    return d2


def draft_rules_main(args, device) -> dict:
    """Per temperature, over the prompts (seed i for prompt i, pure rounds): tokens per round of the drafter drafting
    greedily (a one-hot q: both rules accept p(x)) and of its sampled drafts under the coupled and the ratio rule,
    and how many outputs equal plain sampled decoding's for the seed."""
    dtype = pick_dtype(args.dtype, device)
    target = ckpt.load_target(args.target, dtype, device)
    drafter = ckpt.load_drafter(args.draft, target.cfg, dtype, device)
    window = ckpt.draft_window(drafter.cfg, args.draft_window)
    prompts, stops = load_prompts(args, ckpt.load_tokenizer(target.path), target.path), ckpt.stop_token_ids(target.path, target.cfg)
    block = args.block_size or drafter.cfg.block_size
    capacity = bench_capacity(prompts, args.max_new_tokens, block)
    greedy_draft = drafter if not drafter.cfg.dflash2 else None
    sampled_draft = dflash2_form(drafter, args.selector_top_k)
    ar = dflash.Engine(target, None, 1, capacity)
    arms = {"sampled, coupled": (sampled_draft, "coupled"), "sampled, ratio": (sampled_draft, "ratio")}
    if greedy_draft is not None:
        arms = {"greedy draft": (greedy_draft, "coupled"), **arms}
    engines = {k: dflash.Engine(target, dflash.DrafterProposer(d, target, window), block, capacity) for k, (d, _) in arms.items()}
    table = {}
    for T in args.draft_rules:
        row = {}
        for name, (_, rule) in arms.items():
            s, lengths, same = dflash.Sampling(T, args.top_p, draft_rule=rule), [], 0
            for i, p in enumerate(prompts):
                res = engines[name].run(p, args.max_new_tokens, stops, sampling=s, seed=i)
                lengths += res.verify_lengths
                same += res.output_ids == ar.run(p, args.max_new_tokens, stops, sampling=s, seed=i).output_ids
            row[name] = {"tau": sum(lengths) / len(lengths), "rounds": len(lengths), "same_as_ar": same}
        table[T] = row
        print(f"T={T}: " + ", ".join(f"{k} {v['tau']:.2f} ({v['same_as_ar']}/{len(prompts)} = AR)" for k, v in row.items()), flush=True)
    print(f"\n| temperature | {' | '.join(arms)} |\n|---|{'---|' * len(arms)}")
    for T, row in table.items():
        print(f"| {T} | " + " | ".join(f"{v['tau']:.2f} ({v['same_as_ar']}/{len(prompts)})" for v in row.values()) + " |")
    result = {"mode": "draft_rules", "table": {str(T): row for T, row in table.items()}, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "block_size": block, "selector_top_k": sampled_draft.cfg.selector_top_k,
              "top_p": args.top_p, "device": device, "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads()}
    print(json.dumps(result))
    return result


# ---------------------------------------------------------------------------------------------------------------
# --preset: the real Qwen3.5-9B shapes with random weights
# ---------------------------------------------------------------------------------------------------------------

def preset_configs(name: str) -> tuple:
    """-> (TargetConfig, DraftConfig). qwen3.5-9b: the text model of docs/qwen35.md#config
    (32 layers [GDN x3, attention] x 8, hidden 4096, FFN 12288, 16 q / 4 kv heads of 256, 16 / 32 linear heads of
    128, vocab 248320) and a 5-layer block-16 drafter reading target layers 1, 8, 15, 22, 29 (as
    FSCCS/Qwen3.5-9B-MMFlash and z-lab/Qwen3.5-9B-DFlash do). The drafter's layer widths (32 q / 8 kv heads of
    128, FFN 12288: Qwen3-8B-style layers) are an assumption: those configs were not read here.
    tiny-9b-shape: the same layer pattern, head counts, drafter layers and block at 1/32 of every width (and
    of the vocabulary), so the same code runs on a CPU in seconds."""
    if "35b" in name:
        return moe_preset_configs(name)
    div = {"qwen3.5-9b": 1, "tiny-9b-shape": 32}[name]
    L = 32
    target = M.TargetConfig(
        vocab_size=248320 // div, hidden_size=4096 // div, intermediate_size=12288 // div, num_hidden_layers=L,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256 // div,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128 // div,
        linear_value_head_dim=128 // div, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(L)],
        rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10], max_position_embeddings=262144)
    draft = M.DraftConfig(
        hidden_size=target.hidden_size, intermediate_size=12288 // div, num_hidden_layers=5,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128 // div, vocab_size=target.vocab_size,
        target_layer_ids=[1, 8, 15, 22, 29], mask_token_id=target.vocab_size - 1, block_size=16,
        num_target_layers=L, rope_theta=1e7)
    return target, draft


def moe_preset_configs(name: str) -> tuple:
    """qwen3.5-35b-a3b: the text model of Qwen3.5-35B-A3B (and Qwen3.6-35B-A3B) as transformers'
    Qwen3_5MoeTextConfig defaults give it: 40 layers [GDN x3, attention] x 10, hidden 2048, 16 q / 2 kv heads of
    256, GDN 16 key / 32 value heads of 128, 256 experts of width 512 with top-8 routing, a shared expert of 512,
    vocab 248320, rope theta 1e7 (docs/qwen35.md#mixture-of-experts). Drafter: 8 layers, block 16, reading target
    layers 1, 10, 19, 28, 37, 32 q / 4 kv heads of 128, FFN 6144: the shapes reported publicly for
    z-lab/Qwen3.5-35B-A3B-DFlash (0.47B parameters, a 0.9 GB bf16 file), an assumption: not read here.
    tiny-35b-a3b-shape: the same layers, experts, top-8 and heads at 1/32 of every width (and of the vocabulary).
    It keeps all 256 experts on purpose: a 16-token verify routes 128 slots, <= 256, so it runs the same expert
    path (SparseMoE's gathered one) as the full shapes; with fewer experts eager verify would loop instead."""
    div = {"qwen3.5-35b-a3b": 1, "tiny-35b-a3b-shape": 32}[name]
    L = 40
    target = M.TargetConfig(
        vocab_size=248320 // div, hidden_size=2048 // div, intermediate_size=0, num_hidden_layers=L,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256 // div,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128 // div,
        linear_value_head_dim=128 // div, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(L)],
        rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10], max_position_embeddings=262144,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512 // div, shared_expert_intermediate_size=512 // div)
    draft = M.DraftConfig(
        hidden_size=target.hidden_size, intermediate_size=6144 // div, num_hidden_layers=8,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128 // div, vocab_size=target.vocab_size,
        target_layer_ids=[1, 10, 19, 28, 37], mask_token_id=target.vocab_size - 1, block_size=16,
        num_target_layers=L, rope_theta=1e7)
    return target, draft


def random_models(name: str, device, dtype) -> tuple:
    """Target and drafter of a preset with random weights, allocated directly on `device` in `dtype` (no CPU
    copy, no second dtype copy). Values are nn.Linear / nn.Embedding default inits: step times do not depend on
    them. A_log and dt_bias are float32, as load_target keeps them."""
    tcfg, dcfg = preset_configs(name)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.no_grad():
            target = M.Qwen35(tcfg)
            drafter = M.DFlashDrafter(dcfg)
            for n, p in target.named_parameters():
                if n.endswith(("A_log", "dt_bias")):
                    p.data = p.data.float()
    finally:
        torch.set_default_dtype(old)
    return target.eval(), drafter.eval()


def weight_bytes_per_decode(target: M.Qwen35) -> int:
    """Bytes of weights one decode step reads: every target parameter except the embedding table, of which it
    reads one row, and in a mixture of experts only top_k of every layer's E routed experts. (The GDN states and
    attention K/V it also reads are not counted: a conservative figure.)"""
    emb, cfg = target.embed_tokens.weight, target.cfg
    total = sum(p.numel() * p.element_size() for p in target.parameters())
    if cfg.num_experts:
        routed = sum(p.numel() * p.element_size() for m in target.modules() if isinstance(m, M.Experts) for p in m.parameters())
        total -= routed * (cfg.num_experts - cfg.num_experts_per_tok) // cfg.num_experts
    if target.lm_head.weight is emb:          # tied: the table is read in full by the head anyway
        return total
    return total - emb.numel() * emb.element_size() + emb.shape[1] * emb.element_size()


def bandwidth(target: M.Qwen35, decode_ms: float, peak: float | None) -> tuple:
    """The weight bandwidth an AR decode step achieves -> (bytes read per step, GB/s, a printable line, the
    fraction of `peak` (the measured copy bandwidth, CUDA) or None)."""
    wbytes = weight_bytes_per_decode(target)
    achieved = wbytes / (decode_ms / 1000) / 1e9
    fraction = achieved / peak if peak else None
    line = (f"decode reads {wbytes / 1e9:.3g} GB of weights per step: {achieved:.1f} GB/s"
            + (f" = {fraction:.1%} of the measured copy bandwidth {peak:.0f} GB/s" if peak else " (CPU: no peak measured)"))
    return wbytes, achieved, line, fraction


def peak_copy_gb_s(n_bytes: int = 2 << 30, reps: int = 10) -> float:
    """Device memory bandwidth measured with a large device-to-device copy (reads + writes), in GB/s (CUDA)."""
    a = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)                                              # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / reps
    del a, b
    torch.cuda.empty_cache()
    return 2 * n_bytes / seconds / 1e9


def cudagraph_skips() -> int:
    """How many compiled graphs inductor has declined to run as CUDA graphs in this process."""
    from torch._dynamo.utils import counters
    return counters["inductor"]["cudagraph_skips"]


def preset_main(args, device) -> dict:
    """Time AR decode, verify and draft steps of a preset's shapes with the Engine (the same step functions and
    timings as the checkpoint benchmark), then print the step costs, the bandwidth and the projection."""
    cuda = torch.device(device).type == "cuda"
    dtype = pick_dtype(args.dtype, device)
    if args.concurrency:
        return preset_concurrency(args, device, dtype)
    peak = peak_copy_gb_s() if cuda else None              # before the model takes the memory
    t0 = time.perf_counter()
    target, drafter = random_models(args.preset, device, dtype)
    build_seconds = time.perf_counter() - t0
    block = args.block_size or drafter.cfg.block_size
    prompt_len = args.prompt_len or (64 if args.preset.startswith("tiny") else 512)
    new = args.max_new_tokens
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.cfg.vocab_size - 1, (prompt_len,), generator=g).tolist()
    capacity = prompt_len + max(new, 3 * block) + block       # the warm-up runs 3 blocks
    mode = args.compile_mode if args.compile else None
    products = use_onednn(args.onednn, block, target, drafter)
    proposer = dflash.DrafterProposer(drafter, target)
    ar_engine, sp_engine, warmup_seconds = warm_engines(args, target, proposer, block, capacity, prompt, ())
    print(f"{args.preset}: target {sum(p.numel() for p in target.parameters()) / 1e9:.3f} B params, drafter "
          f"{sum(p.numel() for p in drafter.parameters()) / 1e9:.3f} B, {dtype}, built in {build_seconds:.1f} s on {device}; "
          f"warm-up {'(compilation, mode ' + mode + ') ' if mode else ''}{warmup_seconds:.1f} s", flush=True)
    # Random weights: the drafter's proposals are rejected, so every round commits ~1 token, but each still
    # runs a full B-token verify and a full draft: the per-step costs are the real ones.
    ar = ar_engine.run(prompt, new, profile=True)
    sp = sp_engine.run(prompt, new, profile=True)
    decode_ms = step_ms([ar], "decode", "verify_seconds")
    verify_ms = step_ms([sp], "verify", "verify_seconds")
    draft_ms = step_ms([sp], "verify", "draft_seconds")
    projected = args.tau / (verify_ms + draft_ms) * 1000
    formula = f"projected tok/s = tau / (verify_ms + draft_ms) * 1000 = {args.tau:.2f} / ({verify_ms:.3f} + {draft_ms:.3f}) * 1000"
    wbytes, achieved, bw_line, fraction = bandwidth(target, decode_ms, peak)
    print(f"ms per step (median): decode {decode_ms:.3f}, verify ({block} tokens) {verify_ms:.3f}, draft {draft_ms:.3f}; "
          f"verify/decode {verify_ms / decode_ms:.2f}x, draft/verify {draft_ms / verify_ms:.1%}")
    print(bw_line)
    print(f"PROJECTED (not measured) DFlash at tau {args.tau:.2f}: {projected:.1f} tok/s; AR measured {1000 / decode_ms:.1f} tok/s")
    print(f"  {formula}")
    out = {
        "preset": args.preset, "device": device, "dtype": str(dtype).replace("torch.", ""), "attention": args.attention, **products,
        "compile_mode": mode, "compile_seconds": warmup_seconds if mode else 0.0, "block_size": block,
        "prompt_len": prompt_len, "max_new_tokens": new,
        "decode_ms": decode_ms, "verify_ms": verify_ms, "draft_ms": draft_ms,
        "verify_over_decode": verify_ms / decode_ms, "draft_over_verify": draft_ms / verify_ms,
        "ar_tokens_per_s": 1000 / decode_ms, "weight_bytes_per_decode": wbytes, "achieved_gb_s": achieved,
        "peak_copy_gb_s": peak, "bandwidth_fraction": fraction,
        "projected_tau": args.tau, "projected_dflash_tokens_per_s": projected, "projected_formula": formula,
        "max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        # compiled steps that inductor ran kernel by kernel instead of as a CUDA graph (its log says why)
        "cudagraph_skips": cudagraph_skips() if cuda and mode else None,
    }
    if cuda:   # the GPU bars (README, "GPU checks")
        out["bars"] = {"decode_bandwidth_ge_75pct": fraction >= 0.75, "verify_le_1.3x_decode": verify_ms <= 1.3 * decode_ms,
                       "draft_le_15pct_verify": draft_ms <= 0.15 * verify_ms, "projected_ge_1000_tok_s": projected >= 1000}
        if target.cfg.num_experts:    # a verify reads up to block * top_k experts per layer, a decode top_k: no such bar
            del out["bars"]["verify_le_1.3x_decode"]
    print(json.dumps(out))
    return out


def preset_concurrency(args, device, dtype) -> dict:
    """--preset with --concurrency N1,...: per N, a batching.Batch's AR decode step and DFlash round (draft, verify of
    N x block tokens, commit; pure rounds) on the preset's shapes with random weights, N requests of --prompt-len
    random tokens in flight. The step costs are measured; DFlash's tok/s is PROJECTED at --tau (random weights
    accept nothing): N * tau / round seconds, against AR's measured N / decode seconds."""
    target, drafter = random_models(args.preset, device, dtype)
    block = args.block_size or drafter.cfg.block_size
    prompt_len = args.prompt_len or (64 if args.preset.startswith("tiny") else 512)
    products = use_onednn(args.onednn, block, target, drafter)
    mode = args.compile_mode if args.compile else None
    options = compile_options(args, target.embed_tokens.weight.device)
    g = torch.Generator().manual_seed(0)
    table = []
    for n in args.concurrency:
        reqs = [batching.Request(torch.randint(0, target.cfg.vocab_size - 1, (prompt_len,), generator=g).tolist(),
                                 args.max_new_tokens) for _ in range(n)]
        capacity = prompt_len + max(args.max_new_tokens, 3 * block) + block
        ar = batching.Batch(target, None, 1, n, capacity, mode, options)
        sp = batching.Batch(target, batching.SlotDrafter(drafter, target), block, n, capacity, mode, options)
        t0 = time.perf_counter()
        for eng in (ar, sp):
            eng.warm_up(reqs)
        warm = time.perf_counter() - t0
        decode_ms = 1000 * statistics.median(s.verify_seconds for s in ar.run(reqs)[0].steps[1:])
        round_ms = 1000 * statistics.median(s.draft_seconds + s.verify_seconds for s in sp.run(reqs)[0].steps[1:])
        row = {"n": n, "decode_ms": decode_ms, "round_ms": round_ms, "round_over_decode": round_ms / decode_ms,
               "ar_tokens_per_s": 1000 * n / decode_ms, "projected_dflash_tokens_per_s": 1000 * n * args.tau / round_ms,
               "projected_speedup": args.tau * decode_ms / round_ms, "warmup_seconds": warm}
        table.append(row)
        print(f"{args.preset} N={n:3d}: decode {decode_ms:.3f} ms, round ({n}x{block} verified) {round_ms:.3f} ms "
              f"({row['round_over_decode']:.2f}x); AR {row['ar_tokens_per_s']:.0f} tok/s measured, DFlash "
              f"{row['projected_dflash_tokens_per_s']:.0f} tok/s PROJECTED at tau {args.tau:.2f} "
              f"({row['projected_speedup']:.2f}x); warm-up {warm:.1f} s", flush=True)
    out = {"preset": args.preset, "mode": "concurrency", "device": device, "dtype": str(dtype).replace("torch.", ""),
           "compile_mode": mode, "block_size": block, "prompt_len": prompt_len, "projected_tau": args.tau, **products,
           "concurrency": table}
    print(json.dumps(out))
    return out


def preset_summary(json_path: str) -> int:
    """bench_gpu.sh's verdict on a --preset JSON line: a one-line summary, then PASS/FAIL per GPU bar (CUDA runs
    only carry them). -> exit code: 1 when a bar is missed, else 0."""
    with open(json_path) as fh:
        r = json.load(fh)
    if r["peak_copy_gb_s"]:
        bw = f"{r['achieved_gb_s']:.0f} GB/s = {r['bandwidth_fraction']:.1%} of {r['peak_copy_gb_s']:.0f} GB/s"
    else:
        bw = f"{r['achieved_gb_s']:.1f} GB/s (no peak measured off CUDA)"
    extra = f"; max memory {r['max_memory_allocated_gb']:.1f} GB" if r["max_memory_allocated_gb"] is not None else ""
    if r.get("cudagraph_skips"):
        extra += f"; {r['cudagraph_skips']} compiled graphs NOT run as CUDA graphs (see inductor's log)"
    print(f"{r['preset']} on {r['device']}: decode {r['decode_ms']:.3f} ms = {bw}; verify {r['verify_over_decode']:.2f}x "
          f"decode; draft {r['draft_over_verify']:.1%} of verify; PROJECTED {r['projected_dflash_tokens_per_s']:.0f} tok/s "
          f"at tau {r['projected_tau']}{extra}")
    bars = r.get("bars")
    if bars is None:
        print("  no bars: they are GPU bars (CUDA runs only)")
        return 0
    for bar, ok in bars.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {bar}")
    return 0 if all(bars.values()) else 1


def reference_loop(args, target, drafter, prompts, stops, rows) -> dict:
    """Time the z-lab package's own loop (`dflash_generate` over transformers models) on the same checkpoints
    and prompts. Its output is not compared: that loop is not lossless on Qwen3.5 (docs/method.md#rollback-on-a-hybrid-target)."""
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))
    from helpers import zlab_module     # the z-lab package's model.py (a test oracle, loaded by the tests' helper)
    zm = zlab_module()
    dtype = target.embed_tokens.weight.dtype
    hf = AutoModelForCausalLM.from_pretrained(target.path, dtype=dtype).to(target.embed_tokens.weight.device).eval()
    zd = zm.DFlashDraftModel.from_pretrained(drafter.path, dtype=dtype).to(hf.device).eval()
    ids0 = torch.tensor([prompts[0]], device=hf.device)
    zm.dflash_generate(zd, hf, ids0, 8, None)                                           # warm-up
    tps = []
    for p in prompts:            # timed like ours: wall clock around the whole call, the device synchronised
        ids = torch.tensor([p], device=hf.device)
        dflash._sync(hf.device)
        t0 = time.perf_counter()
        o = zm.dflash_generate(zd, hf, ids, args.max_new_tokens, stops or None, block_size=args.block_size)
        dflash._sync(hf.device)
        tps.append((o.shape[1] - len(p)) / (time.perf_counter() - t0))
    med = statistics.median(tps)
    ours = statistics.median(r[1] for r in rows)
    print(f"z-lab reference loop: median {med:.1f} tok/s; ours {ours:.1f} tok/s = {ours / med:.2f}x")
    return {"reference_tokens_per_s": med, "speedup_vs_reference": ours / med}


# ---------------------------------------------------------------------------------------------------------------
# --parting: where greedy DFlash and greedy AR part in a low precision, and how near a tie the target was there
# ---------------------------------------------------------------------------------------------------------------

# Rounding steps, the near-tie bound and the teacher-forced pass are the checker's (check.py): a parting is a
# near-tie when both runs' tokens lie within NEAR_TIE_STEPS rounding steps of the run's dtype of the reference's
# best logit (why 2: check.py).


def first_difference(a: list, b: list) -> int | None:
    """The first index where token lists a and b differ, or None where one is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@dataclass
class Parting:
    """The first output token where two greedy runs of one prompt part, judged by a reference: the same weights
    in a higher precision, teacher-forced over the prompt + the tokens both runs agreed on."""
    index: int            # output index of the first difference (0 = the token prefill chose)
    dflash: int           # the DFlash run's token there
    ar: int               # the AR run's token there
    top: int              # the reference's argmax there (usually one of the two)
    gap: float            # the reference's top logit minus the lower of the two tokens' logits (>= 0)
    top_logit: float      # the reference's top logit there

    @property
    def prefers(self) -> str:
        """Which run's token the reference chose: "dflash", "ar", or "neither" (a third token)."""
        return "dflash" if self.top == self.dflash else "ar" if self.top == self.ar else "neither"

    def steps(self, dtype) -> float:
        """The gap in rounding steps of `dtype` at the top logit's magnitude."""
        return self.gap / rounding_step(self.top_logit, dtype)


def parting(ref: M.Qwen35, prompt: list, ar_out: list, dflash_out: list) -> Parting | None:
    """Where `dflash_out` and `ar_out` (greedy outputs of `prompt`) first differ, judged by `ref` teacher-forced
    over prompt + the agreed tokens (one forward). None when neither output leaves the other."""
    i = first_difference(ar_out, dflash_out)
    if i is None:
        return None
    z = teacher_forced_logits(ref, prompt + ar_out[:i])[-1]
    top, a, d = int(z.argmax()), ar_out[i], dflash_out[i]
    return Parting(i, d, a, top, float(z[top] - torch.minimum(z[a], z[d])), float(z[top]))


def near_tie(p: Parting, dtype, steps: float = NEAR_TIE_STEPS) -> bool:
    """Whether both runs' tokens lay within `steps` rounding steps of `dtype` of the reference's best logit: a
    choice either run could legitimately make in that precision."""
    return p.steps(dtype) <= steps


def position_margins(ref: M.Qwen35, prompt: list, out: list) -> tuple:
    """`ref` teacher-forced over prompt + out; at each output position -> (its top-2 logit margin [n], its top
    logit [n], its top logit minus the logit of out's token [n]: 0 where out took its argmax)."""
    z = teacher_forced_logits(ref, prompt + out[:-1])[len(prompt) - 1:]
    top2 = z.topk(2, dim=-1).values
    taken = z.gather(1, torch.tensor(out, device=z.device)[:, None])[:, 0]
    return (top2[:, 0] - top2[:, 1]).cpu(), top2[:, 0].cpu(), (top2[:, 0] - taken).cpu()


def quantiles(x: torch.Tensor, qs=(0.0, 0.01, 0.05, 0.25, 0.5)) -> list:
    """The given quantiles of a 1-D tensor (0.0 = the minimum)."""
    return [float(v) for v in torch.quantile(x.double(), torch.tensor(qs, dtype=torch.float64))]


def parting_row(i: int, prompt: list, parts: dict, dtype) -> str:
    """One table line: the prompt, and where its runs part with the references' gaps there (or that they do not)."""
    p32 = parts["float32"]
    if p32 is None:
        return f"| {i} | {len(prompt)} | - | | | | | | | |"
    step = rounding_step(p32.top_logit, dtype)
    return (f"| {i} | {len(prompt)} | {p32.index} | {p32.dflash} / {p32.ar} | {p32.prefers} | {p32.gap:.5f} | "
            f"{parts['float64'].gap:.5f} | {p32.top_logit:.3f} | {step:.5f} | {p32.steps(dtype):.2f} |")


def parting_main(args, device) -> dict:
    """--parting: greedy DFlash and greedy AR in --dtype on every prompt; where they part, the float32 and float64
    teacher-forced gaps between the two tokens; the float32 margins at every AR position. A table, a summary, and
    one JSON line last."""
    t_start = time.perf_counter()
    dtype = pick_dtype(args.dtype, device)
    target = ckpt.load_target(args.target, dtype, device)
    proposer = dflash.DrafterProposer(ckpt.load_drafter(args.draft, target.cfg, dtype, device), target)
    refs = {name: ckpt.load_target(args.target, DTYPES[name], device) for name in ("float32", "float64")}
    block = args.block_size or proposer.max_block_size
    prompts = load_prompts(args, ckpt.load_tokenizer(target.path), target.path)
    stops = ckpt.stop_token_ids(target.path, target.cfg)
    capacity = bench_capacity(prompts, args.max_new_tokens, block)
    masks = ATTENTION[args.attention]
    ar_engine = dflash.Engine(target, None, 1, capacity, masks=masks)
    sp_engine = dflash.Engine(target, proposer, block, capacity, masks=masks)
    print(f"greedy DFlash vs AR in {str(dtype).replace('torch.', '')}, {len(prompts)} prompts, {args.max_new_tokens} new "
          f"tokens, block {block}; gaps from float32 / float64 teacher-forced re-runs, steps = rounding steps of the run's "
          f"dtype at the top logit", flush=True)
    print("| prompt | tokens | parts at | DFlash / AR token | float32 prefers | float32 gap | float64 gap | top logit | step | gap in steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    partings, margins, tops, ar_gaps, errors, compared = [], [], [], [], [], 0    # compared: token positions up to a parting
    for i, p in enumerate(prompts):
        ar = ar_engine.run(p, args.max_new_tokens, stops).output_ids
        sp = sp_engine.run(p, args.max_new_tokens, stops).output_ids
        parts = {name: parting(ref, p, ar, sp) for name, ref in refs.items()}
        if parts["float32"] is not None:
            partings.append((i, parts))
        compared += len(ar) if parts["float32"] is None else parts["float32"].index + 1
        m, t, g = position_margins(refs["float32"], p, ar)
        margins.append(m), tops.append(t), ar_gaps.append(g)
        errors.append(margin_errors(target, refs["float64"], p + ar[:-1], len(p) - 1)[0])
        print(parting_row(i, p, parts, dtype), flush=True)
    return parting_summary(args, dtype, block, prompts, partings, compared, torch.cat(margins), torch.cat(tops),
                           torch.cat(ar_gaps), torch.cat(errors), time.perf_counter() - t_start)


def parting_summary(args, dtype, block, prompts, partings, compared, margins, tops, ar_gaps, errors, seconds) -> dict:
    """Print what the --parting table adds up to and the JSON line; -> that JSON object."""
    steps = torch.tensor([rounding_step(float(t), dtype) for t in tops], dtype=torch.float64)
    p32 = [parts["float32"] for _, parts in partings]
    gaps = [p.gap for p in p32]
    gap_steps = [p.steps(dtype) for p in p32]
    f64_diff = max((abs(parts["float64"].gap - parts["float32"].gap) for _, parts in partings), default=0.0)
    off = ar_gaps > 0                                  # AR positions where the run's token is not float32's argmax
    bound = NEAR_TIE_STEPS * steps
    n = len(prompts)
    print(f"parted: {len(p32)}/{n} prompts ({len(p32) / n:.1%}), at output indices {[p.index for p in p32]} "
          f"(of {args.max_new_tokens}); {len(p32)} partings in {compared} token positions compared")
    if p32:
        print(f"float32 gap at the partings: max {max(gaps):.5f} ({max(gap_steps):.2f} steps), median "
              f"{statistics.median(gaps):.5f} ({statistics.median(gap_steps):.2f} steps); float32 prefers "
              + ", ".join(f"{w} {sum(p.prefers == w for p in p32)}" for w in ("dflash", "ar", "neither"))
              + f"; float64 gaps differ from float32's by at most {f64_diff:.2e}")
    all_near = all(near_tie(p, dtype) for p in p32)
    print(f"every parting a near-tie (gap <= {NEAR_TIE_STEPS:g} steps): {all_near}{'' if p32 else ' (none parted)'}")
    print(f"context, all {len(margins)} AR positions: float32 top-2 margin quantiles (min, 1%, 5%, 25%, median) "
          f"{[round(v, 4) for v in quantiles(margins)]}, in steps {[round(v, 2) for v in quantiles(margins / steps)]}; "
          f"{int((margins <= bound).sum())} positions ({float((margins <= bound).double().mean()):.2%}) within "
          f"{NEAR_TIE_STEPS:g} steps" + (f", {int((margins / steps <= max(gap_steps)).sum())} within the largest parting "
          f"gap ({max(gap_steps):.2f} steps)" if p32 else ""))
    print(f"the AR run's own token is not float32's argmax at {int(off.sum())} positions"
          + (f" (gap max {float(ar_gaps.max()):.5f} = {float((ar_gaps / steps).max()):.2f} steps)" if off.any() else ""))
    print(f"{str(dtype).replace('torch.', '')} teacher-forced vs float64: top-2 margin moved by max {float(errors.max()):.5f} "
          f"({float((errors / steps).max()):.2f} steps), median {float(errors.median()):.5f} "
          f"({float((errors / steps).median()):.2f} steps)")
    out = {"mode": "parting", "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
           "prompts": n, "max_new_tokens": args.max_new_tokens, "block_size": block, "parted": len(p32),
           "parting_rate": len(p32) / n, "positions_compared": compared, "near_tie_steps": NEAR_TIE_STEPS, "all_near_ties": all_near,
           "partings": [{"prompt": i, "index": parts["float32"].index, "dflash_token": parts["float32"].dflash,
                         "ar_token": parts["float32"].ar, "float32_prefers": parts["float32"].prefers,
                         "float32_gap": parts["float32"].gap, "float64_gap": parts["float64"].gap,
                         "top_logit": parts["float32"].top_logit, "step": rounding_step(parts["float32"].top_logit, dtype),
                         "gap_steps": parts["float32"].steps(dtype)} for i, parts in partings],
           "max_gap": max(gaps, default=None), "max_gap_steps": max(gap_steps, default=None),
           "positions": len(margins), "margin_quantiles": quantiles(margins),
           "margin_quantiles_steps": quantiles(margins / steps),
           "positions_within_bound": int((margins <= bound).sum()),
           "positions_within_max_gap": int((margins / steps <= max(gap_steps)).sum()) if p32 else None,
           "ar_not_float32_argmax": int(off.sum()), "margin_error_max": float(errors.max()),
           "margin_error_max_steps": float((errors / steps).max()), "seconds": seconds}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    try:
        main()
    except (M.CheckpointError, dflash.GenerationError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
