"""--preset: the step costs of real model shapes with random weights, no checkpoint needed (bench.py --preset).

    python bench.py --preset qwen3.5-9b --random-weights --compile --compile-mode reduce-overhead   # on a GPU
    python bench.py --preset tiny-9b-shape --random-weights                                       # the same code, CPU
    python bench.py --preset tiny-9b-shape --random-weights --concurrency 1,8,32                  # per N in flight

Step times do not depend on the weights' values, so random weights built on the device time the real shapes:
AR decode, verify and draft steps, the weight bandwidth a decode step achieves against a measured device copy
(CUDA), and DFlash tok/s PROJECTED at a published mean acceptance length (--tau).
"""
from __future__ import annotations

import json
import statistics
import time

import torch

import checkpoint as ckpt
import engine
import model as M
import tables
from generate import compile_options, pick_dtype, use_products

MMFLASH_TAU = 5.60      # mean acceptance length published for FSCCS/Qwen3.5-9B-MMFlash (average over its benchmarks)
PRESETS = ("qwen3.5-9b", "tiny-9b-shape", "qwen3.5-0.8b", "qwen3.5-35b-a3b", "tiny-35b-a3b-shape")


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
    if name == "qwen3.5-0.8b":
        return small_preset_configs()
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


def small_preset_configs() -> tuple:
    """qwen3.5-0.8b: the text model of Qwen/Qwen3.5-0.8B as its model card describes it: 24 layers
    [GDN x3, attention] x 6, hidden 1024, FFN 3584, 8 q / 2 kv heads of 256, GDN 16 key / 16 value heads of 128,
    vocab 248320, tied embeddings (the lm_head is the embedding table), rope theta 1e7. On a CPU it is the
    memory-bound regime: a float32 decode step reads about 3 GB of weights, far more than any cache holds.
    Drafter: 5 layers of the target's width at block 16 with Qwen3-0.6B-style layers (16 q / 8 kv heads of 128,
    FFN 3072) reading target layers 1, 6, 11, 16, 21 (z-lab's spacing rule): an assumption, as no drafter for
    this size was read here."""
    L = 24
    target = M.TargetConfig(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=L,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(L)],
        rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10], max_position_embeddings=262144,
        tie_word_embeddings=True)
    draft = M.DraftConfig(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=target.vocab_size, target_layer_ids=ckpt.default_target_layer_ids(L, 5),
        mask_token_id=target.vocab_size - 1, block_size=16, num_target_layers=L, rope_theta=1e7)
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
                if n.endswith(ckpt.TARGET_FP32):          # float32, as the checkpoint loader keeps them
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
    """Time AR decode, verify and draft steps of a preset's shapes on generate.py's engine (tables.single_engine: the same steps and
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
    products = use_products(args.products, block, target, drafter)
    proposer = engine.DrafterProposer(drafter, target)
    ar_engine, sp_engine, warmup_seconds = tables.warm_engines(args, target, proposer, block, capacity, prompt, ())
    print(f"{args.preset}: target {sum(p.numel() for p in target.parameters()) / 1e9:.3f} B params, drafter "
          f"{sum(p.numel() for p in drafter.parameters()) / 1e9:.3f} B, {dtype}, built in {build_seconds:.1f} s on {device}; "
          f"warm-up {'(compilation, mode ' + mode + ') ' if mode else ''}{warmup_seconds:.1f} s", flush=True)
    # Random weights: the drafter's proposals are rejected, so every round commits ~1 token, but each still
    # runs a full B-token verify and a full draft: the per-step costs are the real ones.
    ar = ar_engine.generate(prompt, new, profile=True)
    sp = sp_engine.generate(prompt, new, profile=True)
    decode_ms = tables.step_ms([ar], "decode", "verify_seconds")
    verify_ms = tables.step_ms([sp], "verify", "verify_seconds")
    draft_ms = tables.step_ms([sp], "verify", "draft_seconds")
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
    if cuda:   # the GPU bars (docs/usage.md#gpu-checks-and-the-9b-step-costs)
        out["bars"] = {"decode_bandwidth_ge_75pct": fraction >= 0.75, "verify_le_1.3x_decode": verify_ms <= 1.3 * decode_ms,
                       "draft_le_15pct_verify": draft_ms <= 0.15 * verify_ms, "projected_ge_1000_tok_s": projected >= 1000}
        if target.cfg.num_experts:    # a verify reads up to block * top_k experts per layer, a decode top_k: no such bar
            del out["bars"]["verify_le_1.3x_decode"]
    print(json.dumps(out))
    return out


def preset_concurrency(args, device, dtype) -> dict:
    """--preset with --concurrency N1,...: per N, an engine.Engine's AR decode step and DFlash round (draft, verify of
    N x block tokens, commit; pure rounds) on the preset's shapes with random weights, N requests of --prompt-len
    random tokens in flight. The step costs are measured; DFlash's tok/s is PROJECTED at --tau (random weights
    accept nothing): N * tau / round seconds, against AR's measured N / decode seconds."""
    target, drafter = random_models(args.preset, device, dtype)
    block = args.block_size or drafter.cfg.block_size
    prompt_len = args.prompt_len or (64 if args.preset.startswith("tiny") else 512)
    products = use_products(args.products, block, target, drafter)
    mode = args.compile_mode if args.compile else None
    options = compile_options(args, target.embed_tokens.weight.device)
    g = torch.Generator().manual_seed(0)
    table = []
    for n in args.concurrency:
        reqs = [engine.Request(torch.randint(0, target.cfg.vocab_size - 1, (prompt_len,), generator=g).tolist(),
                                 args.max_new_tokens) for _ in range(n)]
        capacity = prompt_len + max(args.max_new_tokens, 3 * block) + block
        ar = engine.Engine(target, None, 1, n, capacity, mode, options)
        sp = engine.Engine(target, engine.DrafterProposer(drafter, target), block, n, capacity, mode, options)
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
