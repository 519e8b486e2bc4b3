"""Side-by-side benchmark: plain AR and DFlash on the same prompts and weights, in one process.

    python bench.py                                     # embedded tiny pair, 8 held-out Python prompts
    python bench.py --target DIR --draft DIR --prompt "..." --prompt "..." --max-new-tokens 256

Warm-up runs are excluded. Printed: per-prompt and median tok/s of both, their ratio (the speedup), mean
acceptance length and its histogram, ms per decode / draft / verify step, whether the outputs are identical.
The last stdout line is one JSON object. Machines are noisy: compare ratios measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import dflash
import model as M
from generate import DEFAULT_DRAFT, DEFAULT_TARGET, DTYPES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--prompt", action="append", default=[], help="a prompt text; repeat for several")
    p.add_argument("--prompts", help="a file with one prompt per line")
    p.add_argument("--heldout", type=int, default=8, help="without prompts: this many held-out stdlib prompts (30-60 tokens)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="torch.compile the step functions (compile time reported apart)")
    p.add_argument("--compile-mode", default="max-autotune", help="torch.compile mode with --compile (default max-autotune)")
    p.add_argument("--vs-reference", action="store_true",
                   help="also time the z-lab reference loop (dflash package + transformers) on the same checkpoints")
    return p.parse_args(argv)


def step_ms(results, kind, attr):
    vals = [getattr(s, attr) for r in results for s in r.steps if s.kind == kind]
    return 1000 * statistics.median(vals) if vals else None


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype or ("bfloat16" if device == "cuda" else "float32")]
    target = M.load_target(args.target, dtype, device)
    drafter = M.load_drafter(args.draft, target.cfg, dtype, device)
    proposer = dflash.DrafterProposer(drafter, target)
    block = args.block_size or drafter.cfg.block_size
    tok = M.load_tokenizer(target.path)

    texts = list(args.prompt)
    if args.prompts:
        with open(args.prompts) as fh:
            texts += [line.rstrip("\n") for line in fh if line.strip()]
    if texts:
        if tok is None:
            raise dflash.GenerationError(f"{target.path} has no tokenizer.json to encode the prompts")
        prompts = [tok.encode(t).ids for t in texts]
    else:
        import train
        prompts = train.heldout_prompts(tok, args.heldout)
    stops = M.stop_token_ids(target.path, target.cfg)

    capacity = max(len(p) for p in prompts) + args.max_new_tokens + block
    mode = args.compile_mode if args.compile else None
    ar_engine = dflash.Engine(target, None, 1, capacity, compile_mode=mode)
    sp_engine = dflash.Engine(target, proposer, block, capacity, compile_mode=mode)
    # warm-up (compilation, allocator, lazy init), excluded from the figures and reported apart
    t0 = time.perf_counter()
    ar_engine.run(prompts[0], 8, stops)
    sp_engine.run(prompts[0], 3 * block, stops)
    warmup_seconds = time.perf_counter() - t0
    print(f"warm-up {'(compilation, mode ' + mode + ') ' if mode else ''}{warmup_seconds:.1f} s", flush=True)

    ar_res, sp_res, rows = [], [], []
    for i, p in enumerate(prompts):
        ar = ar_engine.run(p, args.max_new_tokens, stops, profile=True)
        sp = sp_engine.run(p, args.max_new_tokens, stops, profile=True)
        ar_tps = (len(ar.output_ids) - 1) / ar.decode_seconds
        sp_tps = (len(sp.output_ids) - 1) / sp.decode_seconds
        same = ar.output_ids == sp.output_ids
        rows.append((ar_tps, sp_tps, sp.mean_acceptance_length, same))
        ar_res.append(ar), sp_res.append(sp)
        print(f"prompt {i}: {len(p)} tokens -> {len(sp.output_ids)}  AR {ar_tps:8.1f} tok/s  DFlash {sp_tps:8.1f} tok/s  "
              f"speedup {sp_tps / ar_tps:5.2f}x  tau {sp.mean_acceptance_length:5.2f}  identical {same}", flush=True)

    ar_med = statistics.median(r[0] for r in rows)
    sp_med = statistics.median(r[1] for r in rows)
    speedups = [r[1] / r[0] for r in rows]
    all_acc = [a for r in sp_res for a in r.acceptance_lengths]
    tau = sum(all_acc) / len(all_acc)
    hist = [all_acc.count(k) for k in range(1, block + 1)]
    decode_ms, draft_ms, verify_ms = step_ms(ar_res, "decode", "verify_seconds"), step_ms(sp_res, "verify", "draft_seconds"), step_ms(sp_res, "verify", "verify_seconds")
    print(f"median: AR {ar_med:.1f} tok/s, DFlash {sp_med:.1f} tok/s, median per-prompt speedup {statistics.median(speedups):.2f}x")
    print(f"mean acceptance length {tau:.2f} (block {block}); histogram of tokens per verify step 1..{block}: {hist}")
    print(f"ms per step (median): decode {decode_ms:.2f}, draft {draft_ms:.2f}, verify {verify_ms:.2f}")
    print(f"outputs identical to AR: {sum(r[3] for r in rows)}/{len(rows)}")
    ref = reference_loop(args, target, drafter, prompts, stops, rows) if args.vs_reference else {}
    print(json.dumps({**ref,
        "device": device, "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "block_size": block,
        "ar_tokens_per_s": ar_med, "dflash_tokens_per_s": sp_med, "speedup": statistics.median(speedups),
        "mean_acceptance_length": tau, "acceptance_histogram": hist,
        "decode_ms": decode_ms, "draft_ms": draft_ms, "verify_ms": verify_ms,
        "identical_outputs": sum(r[3] for r in rows), "compile_seconds": warmup_seconds if mode else 0.0,
        "compile_mode": mode,
    }))


def reference_loop(args, target, drafter, prompts, stops, rows) -> dict:
    """Time the z-lab package's own loop (`dflash_generate` over transformers models) on the same checkpoints
    and prompts. Its output is not compared: that loop is not lossless on Qwen3.5 (notes 3)."""
    import importlib.metadata
    import importlib.util
    from transformers import AutoModelForCausalLM
    f = importlib.metadata.distribution("dflash").locate_file("dflash/model.py")      # our dflash.py shadows the name
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", f)
    zm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zm)
    dtype = target.embed_tokens.weight.dtype
    hf = AutoModelForCausalLM.from_pretrained(target.path, dtype=dtype).to(target.embed_tokens.weight.device).eval()
    zd = zm.DFlashDraftModel.from_pretrained(drafter.path, dtype=dtype).to(hf.device).eval()
    ids0 = torch.tensor([prompts[0]], device=hf.device)
    zm.dflash_generate(zd, hf, ids0, 8, None)                                           # warm-up
    tps = []
    for p, row in zip(prompts, rows):
        ids = torch.tensor([p], device=hf.device)
        out = zm.dflash_generate(zd, hf, ids, args.max_new_tokens, stops or None, block_size=args.block_size, return_stats=True) \
            if hf.device.type == "cuda" else None
        if out is not None:
            tps.append(out.num_output_tokens / (out.time_per_output_token * out.num_output_tokens))
            continue
        t0 = time.perf_counter()
        o = zm.dflash_generate(zd, hf, ids, args.max_new_tokens, stops or None, block_size=args.block_size)
        tps.append((o.shape[1] - len(p)) / (time.perf_counter() - t0))
    med = statistics.median(tps)
    ours = statistics.median(r[1] for r in rows)
    print(f"z-lab reference loop: median {med:.1f} tok/s; ours {ours:.1f} tok/s = {ours / med:.2f}x")
    return {"reference_tokens_per_s": med, "speedup_vs_reference": ours / med}


if __name__ == "__main__":
    try:
        main()
    except (M.CheckpointError, dflash.GenerationError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
