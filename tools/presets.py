"""--preset: the step costs of real model shapes with random weights, no checkpoint needed (tools/bench.py --preset).

    python tools/bench.py --preset qwen3.5-9b --random-weights --compile --compile-mode reduce-overhead   # on a GPU
    python tools/bench.py --preset tiny-9b-shape --random-weights                                       # the same code, CPU
    python tools/bench.py --preset tiny-9b-shape --random-weights --concurrency 1,8,32                  # per N in flight
    python tools/bench.py --preset qwen3.5-2b --random-weights --compile --weight-dtype bfloat16        # CPU default

Random weights are made in --dtype (nothing stores them); --weight-dtype bfloat16 keeps them as a published
bfloat16 checkpoint's are kept under float32 arithmetic (generate.py's default on a CPU).

Step times do not depend on the weights' values, so random weights built on the device time the real shapes:
AR decode, verify and draft steps, the weight bandwidth a decode step achieves against a measured device copy
(CUDA), and DFlash tok/s PROJECTED at a published mean acceptance length (--tau). bench_gpu.sh judges a CUDA run
by gpu_bars: bars derived from the bytes of weights each step reads and the copy bandwidth the run measured.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

import checkpoint as ckpt
import compiling
import engine
import model as M
from tools import tables
from kernels import state_dtype
from options import compile_options, pick_dtype, pick_weights, use_products

BAR_FRACTION = 0.75     # every GPU bar asks this fraction of what the bytes its steps read allow (gpu_bars)
MMFLASH_TAU = 5.60      # mean acceptance length published for FSCCS/Qwen3.5-9B-MMFlash (average over its benchmarks)
PRESETS = ("qwen3.5-9b", "tiny-9b-shape", "qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-35b-a3b",
           "tiny-35b-a3b-shape")


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
    if name in SMALL:
        return small_preset_configs(name)
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


# The small dense sizes: (layers, hidden, FFN, q heads, kv heads, GDN value heads), each with 256-wide attention
# heads, 16 GDN key heads of 128, value heads of 128, vocab 248320, tied embeddings, rope theta 1e7.
SMALL = {"qwen3.5-0.8b": (24, 1024, 3584, 8, 2, 16),
         "qwen3.5-2b": (24, 2048, 6144, 8, 2, 16),
         "qwen3.5-4b": (32, 2560, 9216, 16, 4, 32)}


def small_preset_configs(name: str = "qwen3.5-0.8b") -> tuple:
    """The text models of Qwen/Qwen3.5-0.8B, 2B and 4B (SMALL): layers [GDN x3, attention] repeated, tied embeddings
    (the lm_head is the embedding table). 0.8B as its model card describes it; 2B and 4B from their published
    configs' sizes as public training recipes spell them (2B: 24 layers, hidden 2048, FFN 6144, 8 q / 2 kv heads;
    4B: 32 layers, hidden 2560, FFN 9216, 16 q / 4 kv heads, 16 key / 32 value GDN heads); the 2B's 16 GDN value
    heads (its hidden width, as the 0.8B's) are an assumption. On a CPU these are the memory-bound regime: a float32
    0.8B decode step reads about 3 GB of weights, far more than any cache holds.
    Drafter: 5 layers of the target's width at block 16 with Qwen3-0.6B-style layers (16 q / 8 kv heads of 128,
    FFN 3072) reading target layers spaced by z-lab's rule (0.8B: 1, 6, 11, 16, 21): an assumption, as no drafter
    for these sizes was read here."""
    L, hidden, ffn, heads, kv, value_heads = SMALL[name]
    target = M.TargetConfig(
        vocab_size=248320, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=L,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=value_heads, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(L)],
        rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10], max_position_embeddings=262144,
        tie_word_embeddings=True)
    draft = M.DraftConfig(
        hidden_size=hidden, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8,
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


def random_models(name: str, device, dtype, weights=None) -> tuple:
    """Target and drafter of a preset with random weights, allocated directly on `device` (no CPU copy, no second
    dtype copy) for arithmetic in `dtype`, every weight kept in `weights` (None: in `dtype`; a narrower dtype that
    `dtype` holds exactly: a published bfloat16 checkpoint kept as stored under float32 arithmetic, as
    checkpoint.load_target keeps it). Values are nn.Linear / nn.Embedding default inits: step times do not depend
    on them. A_log and dt_bias are in float32 (state_dtype), as load_target keeps them."""
    tcfg, dcfg = preset_configs(name)
    old = torch.get_default_dtype()
    torch.set_default_dtype(weights or dtype)
    try:
        with torch.device(device), torch.no_grad():
            target = M.Qwen35(tcfg)
            drafter = M.DFlashDrafter(dcfg)
            for n, p in target.named_parameters():
                if n.endswith(ckpt.TARGET_FP32):          # as the checkpoint loader keeps them
                    p.data = p.data.to(state_dtype(dtype))
    finally:
        torch.set_default_dtype(old)
    target.dtype = drafter.dtype = dtype    # (kept narrower: the arithmetic starts at the embedding, as load_target's)
    return target.eval(), drafter.eval()


def random_target_parts(name: str, dtype=torch.bfloat16, seed: int = 0):
    """The target of a preset with random weights, one part at a time for checkpoint.save_target_in_parts: ("", the
    embedding, final norm and untied lm_head), then ("layers.i.", decoder layer i), each built in `dtype` on the CPU
    (nn.Linear / nn.Embedding default inits, small random GDN convolutions) and dropped by the caller before the
    next: a 9B target is never held whole."""
    tcfg, _ = preset_configs(name)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        outer = torch.nn.Module()
        outer.embed_tokens = M.Embedding(tcfg.vocab_size, tcfg.hidden_size)
        outer.norm = M.ZeroCenteredRMSNorm(tcfg.hidden_size, tcfg.rms_norm_eps)
        if not tcfg.tie_word_embeddings:
            outer.lm_head = M.Linear(tcfg.hidden_size, tcfg.vocab_size, bias=False)
        yield "", outer
        del outer
        for i, kind in enumerate(tcfg.layer_types):
            with torch.no_grad():
                layer = M.DecoderLayer(tcfg, kind)
                if kind == "linear_attention":
                    layer.linear_attn.conv_weight.normal_(0, 0.5)
            yield f"layers.{i}.", layer
            del layer
    finally:
        torch.set_default_dtype(old)


def weight_bytes_per_decode(target: M.Qwen35, tokens: int = 1) -> int:
    """Bytes of weights one target step of `tokens` tokens reads (1: a decode step; a block: a verify): every target
    parameter except the embedding table, of which it reads `tokens` rows, and in a mixture of experts
    min(tokens * top_k, E) of every layer's E routed experts (SparseMoE's gathered path copies one expert's weights
    per routed slot). (The GDN states and attention K/V it also reads are not counted: a conservative figure.)"""
    emb, cfg = target.embed_tokens.weight, target.cfg
    total = sum(p.numel() * p.element_size() for p in target.parameters())
    if cfg.num_experts:
        routed = sum(p.numel() * p.element_size() for m in target.modules() if isinstance(m, M.Experts) for p in m.parameters())
        total -= routed * (cfg.num_experts - min(tokens * cfg.num_experts_per_tok, cfg.num_experts)) // cfg.num_experts
    if target.lm_head.weight is emb:          # tied: the table is read in full by the head anyway
        return total
    return total - emb.numel() * emb.element_size() + tokens * emb.shape[1] * emb.element_size()


def draft_weight_bytes(drafter: M.DFlashDrafter, target: M.Qwen35) -> int:
    """Bytes of weights one draft reads: every drafter parameter and the target's lm_head, which the drafter shares
    (its logits over the block). (The block's embedding rows and the drafter's context K/V are not counted.)"""
    return (sum(p.numel() * p.element_size() for p in drafter.parameters())
            + target.lm_head.weight.numel() * target.lm_head.weight.element_size())


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


def preset_weights(args, dtype):
    """--weight-dtype for random weights -> random_models' `weights`: `auto` keeps them in the arithmetic's dtype (no
    file stores them), bfloat16 or float16 keeps them narrower as a published checkpoint's are kept (options.pick_weights
    refuses a dtype the arithmetic does not hold exactly)."""
    weights = pick_weights(args.weight_dtype, dtype)
    return None if weights == "auto" else weights


def prompt_length(args) -> int:
    """A preset run's random prompt: --prompt-len, else 64 tokens for the tiny presets and 512 for the real shapes."""
    return args.prompt_len or (64 if args.preset.startswith("tiny") else 512)


def check_preset_memory(args, device, dtype, slots: int = 1) -> None:
    """Before a preset's random models are built: the target and drafter (kept as --weight-dtype says) and the caches
    of `slots` rows within the memory `device` has (checkpoint.check_memory: one line naming the need and the
    options). What compiling and packed copies take on top is not counted, so a run that passes may still not fit."""
    tcfg, dcfg = preset_configs(args.preset)
    weights = preset_weights(args, dtype) or dtype
    block = args.block_size or dcfg.block_size
    prompt_len = prompt_length(args)
    capacity = tables.warm_capacity(prompt_len, args.max_new_tokens, block)
    held = ckpt.target_bytes(tcfg, dtype, weights) + ckpt.drafter_bytes(dcfg, dtype, weights)
    fixes = (["--weight-dtype bfloat16 (weights in half the bytes)"] if weights == torch.float32 else []) + \
            (["--dtype bfloat16"] if dtype != torch.bfloat16 else []) + ["a smaller preset"]
    where = "the GPU" if torch.device(device).type == "cuda" else "this machine"
    ckpt.check_memory(held, ckpt.cache_bytes(tcfg, dtype, capacity, slots, block, dcfg), ckpt.available_memory(device),
                      where, fixes)


def preset_main(args, device) -> dict:
    """Time AR decode, verify and draft steps of a preset's shapes on generate.py's engine (tables.single_engine: the
    same steps and timings as the checkpoint benchmark). AR goes first: its engine is built, warmed up and timed,
    and its decode step and bandwidth printed (with a JSON line of its own, "part": "ar") before the DFlash engine
    is built, so that a DFlash compile that fails or runs out of time leaves AR's numbers behind. Then the DFlash
    steps, the projection and the JSON line of the whole run, last."""
    cuda = torch.device(device).type == "cuda"
    dtype = pick_dtype(args.dtype, device)
    if args.concurrency:
        return preset_concurrency(args, device, dtype)
    check_preset_memory(args, device, dtype)
    peak = peak_copy_gb_s() if cuda else None              # before the model takes the memory
    t0 = time.perf_counter()
    target, drafter = random_models(args.preset, device, dtype, preset_weights(args, dtype))
    build_seconds = time.perf_counter() - t0
    block = args.block_size or drafter.cfg.block_size
    prompt_len = prompt_length(args)
    new = args.max_new_tokens
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.cfg.vocab_size - 1, (prompt_len,), generator=g).tolist()
    capacity = tables.warm_capacity(prompt_len, new, block)
    mode = args.compile_mode if args.compile else None
    products = use_products(args.products, block, target, drafter)
    print(f"{args.preset}: target {sum(p.numel() for p in target.parameters()) / 1e9:.3f} B params, drafter "
          f"{sum(p.numel() for p in drafter.parameters()) / 1e9:.3f} B, {dtype}, built in {build_seconds:.1f} s on "
          f"{platform(device)}", flush=True)
    ar, ar_warm = timed_run(args, target, None, 1, capacity, prompt)
    decode_ms = tables.step_ms([ar], "decode", "verify_seconds")
    wbytes, achieved, bw_line, fraction = bandwidth(target, decode_ms, peak)
    head = {"preset": args.preset, "device": device, "platform": platform(device), "dtype": str(dtype).replace("torch.", ""),
            "weight_dtype": str(target.embed_tokens.weight.dtype).replace("torch.", ""),
            "attention": args.attention, **products, "compile_mode": mode, "block_size": block, "prompt_len": prompt_len,
            "max_new_tokens": new}
    ar_part = {"decode_ms": decode_ms, "ar_tokens_per_s": 1000 / decode_ms, "weight_bytes_per_decode": wbytes,
               "weight_bytes_per_verify": weight_bytes_per_decode(target, block),
               "weight_bytes_per_draft": draft_weight_bytes(drafter, target), "achieved_gb_s": achieved,
               "peak_copy_gb_s": peak, "bandwidth_fraction": fraction, "projected_tau": args.tau}
    print(f"AR: decode {decode_ms:.3f} ms per step (median), {1000 / decode_ms:.1f} tok/s measured; warm-up "
          f"{'(compilation, mode ' + mode + ') ' if mode else ''}{ar_warm:.1f} s", flush=True)
    print(bw_line, flush=True)
    print(json.dumps({**head, "part": "ar", **ar_part, "compile_seconds": ar_warm if mode else 0.0}), flush=True)
    # Random weights: the drafter's proposals are rejected, so every round commits ~1 token, but each still
    # runs a full B-token verify and a full draft: the per-step costs are the real ones.
    sp, sp_warm = timed_run(args, target, engine.DrafterProposer(drafter, target), block, capacity, prompt)
    verify_ms = tables.step_ms([sp], "verify", "verify_seconds")
    draft_ms = tables.step_ms([sp], "verify", "draft_seconds")
    projected = args.tau / (verify_ms + draft_ms) * 1000
    formula = f"projected tok/s = tau / (verify_ms + draft_ms) * 1000 = {args.tau:.2f} / ({verify_ms:.3f} + {draft_ms:.3f}) * 1000"
    print(f"DFlash warm-up {sp_warm:.1f} s. ms per step (median): decode {decode_ms:.3f}, verify ({block} tokens) "
          f"{verify_ms:.3f}, draft {draft_ms:.3f}; verify/decode {verify_ms / decode_ms:.2f}x, draft/verify {draft_ms / verify_ms:.1%}")
    print(f"PROJECTED (not measured) DFlash at tau {args.tau:.2f}: {projected:.1f} tok/s; AR measured {1000 / decode_ms:.1f} tok/s")
    print(f"  {formula}")
    out = {
        **head, "compile_seconds": ar_warm + sp_warm if mode else 0.0, **ar_part,
        "verify_ms": verify_ms, "draft_ms": draft_ms, "verify_over_decode": verify_ms / decode_ms,
        "draft_over_verify": draft_ms / verify_ms, "projected_dflash_tokens_per_s": projected, "projected_formula": formula,
        "max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        # compiled steps that inductor ran kernel by kernel instead of as a CUDA graph (its log says why)
        "cudagraph_skips": cudagraph_skips() if cuda and mode else None,
    }
    print(json.dumps(out))
    return out


def timed_run(args, target, proposer, block: int, capacity: int, prompt: list) -> tuple:
    """One engine of a preset (tables.single_engine, pure rounds: random drafts would switch adaptive speculation
    off), warmed up on `prompt` (compilation and CUDA graph capture), then one profiled generation of
    --max-new-tokens. -> (its Result, the warm-up seconds)."""
    eng = tables.single_engine(args, target, proposer, block, capacity, False)
    t0 = time.perf_counter()
    tables.warm_up(eng, prompt, (), args.max_new_tokens)
    warm = time.perf_counter() - t0
    return eng.generate(prompt, args.max_new_tokens, profile=True), warm


def platform(device) -> str:
    """What a run ran on, for its report: "cpu" or the GPU's name and the CUDA version, with torch's version."""
    if torch.device(device).type != "cuda":
        return f"cpu, torch {torch.__version__}"
    return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def preset_concurrency(args, device, dtype) -> dict:
    """--preset with --concurrency N1,...: per N, an engine.Engine's AR decode step and DFlash round (draft, verify of
    N x block tokens, commit; pure rounds) on the preset's shapes with random weights, N requests of --prompt-len
    random tokens in flight. The step costs are measured; DFlash's tok/s is PROJECTED at --tau (random weights
    accept nothing): N * tau / round seconds, against AR's measured N / decode seconds. At N = 1 with the same
    --max-new-tokens and --prompt-len as a --preset run (the same cache capacity), the steps are the same
    fixed-shape graphs as that run's, so inductor's on-disk cache serves them to a later process (each row
    counts the graphs compiled and served: compiling.graph_counts)."""
    check_preset_memory(args, device, dtype, max(args.concurrency))
    target, drafter = random_models(args.preset, device, dtype, preset_weights(args, dtype))
    block = args.block_size or drafter.cfg.block_size
    prompt_len = prompt_length(args)
    products = use_products(args.products, block, target, drafter)
    mode = args.compile_mode if args.compile else None
    options = compile_options(args, target.embed_tokens.weight.device)
    g = torch.Generator().manual_seed(0)
    table = []
    for n in args.concurrency:
        reqs = [engine.Request(torch.randint(0, target.cfg.vocab_size - 1, (prompt_len,), generator=g).tolist(),
                                 args.max_new_tokens) for _ in range(n)]
        capacity = tables.warm_capacity(prompt_len, args.max_new_tokens, block)
        before = compiling.graph_counts()
        ar = engine.Engine(target, None, 1, n, capacity, mode, options)
        sp = engine.Engine(target, engine.DrafterProposer(drafter, target), block, n, capacity, mode, options)
        t0 = time.perf_counter()
        for eng in (ar, sp):
            eng.warm_up(reqs)
        warm = time.perf_counter() - t0
        graphs = {k: v - before[k] for k, v in compiling.graph_counts().items()}
        decode_ms = 1000 * statistics.median(s.verify_seconds for s in ar.run(reqs)[0].steps[1:])
        round_ms = 1000 * statistics.median(s.draft_seconds + s.verify_seconds for s in sp.run(reqs)[0].steps[1:])
        row = {"n": n, "decode_ms": decode_ms, "round_ms": round_ms, "round_over_decode": round_ms / decode_ms,
               "ar_tokens_per_s": 1000 * n / decode_ms, "projected_dflash_tokens_per_s": 1000 * n * args.tau / round_ms,
               "projected_speedup": args.tau * decode_ms / round_ms, "warmup_seconds": warm, **graphs}
        table.append(row)
        print(f"{args.preset} N={n:3d}: decode {decode_ms:.3f} ms, round ({n}x{block} verified) {round_ms:.3f} ms "
              f"({row['round_over_decode']:.2f}x); AR {row['ar_tokens_per_s']:.0f} tok/s measured, DFlash "
              f"{row['projected_dflash_tokens_per_s']:.0f} tok/s PROJECTED at tau {args.tau:.2f} "
              f"({row['projected_speedup']:.2f}x); warm-up {warm:.1f} s" + (f" ({graphs['graphs_compiled']} graphs "
              f"compiled, {graphs['graphs_cached']} served by inductor's on-disk cache)" if mode else ""), flush=True)
    out = {"preset": args.preset, "mode": "concurrency", "device": device, "dtype": str(dtype).replace("torch.", ""),
           "compile_mode": mode, "block_size": block, "prompt_len": prompt_len, "projected_tau": args.tau, **products,
           "concurrency": table}
    print(json.dumps(out))
    return out


def gpu_bars(r: dict) -> list:
    """The GPU bars of a --preset JSON line, derived from the bytes of weights its steps read (weight_bytes_per_decode,
    draft_weight_bytes) and the copy bandwidth P the same run measured (peak_copy_gb_s: CUDA only, so no bars
    elsewhere). A step cannot beat its bytes / P; each bar asks for BAR_FRACTION f of that:
        decode_bandwidth     the decode step's weight bandwidth >= f * P
        verify_over_decode   verify / decode <= (verify bytes / decode bytes) / f
        draft_over_verify    draft / verify <= (draft bytes / verify bytes) / f
        projected_tok_s      projected DFlash tok/s >= f * tau / ((verify bytes + draft bytes) / P): a round reads both
    (the two ratios: the one step streams its bytes at >= f of the other's rate). A run at f of P in every step
    meets every bar exactly. -> [{"bar", "ok" (None: not measured, the run ended before that step), "measured",
    "bound", "line": the comparison, "derivation"}]; [] without a measured bandwidth."""
    peak, f = r.get("peak_copy_gb_s"), BAR_FRACTION
    if not peak:
        return []
    wd, wv, wr, tau = r["weight_bytes_per_decode"], r["weight_bytes_per_verify"], r["weight_bytes_per_draft"], r["projected_tau"]
    decode, verify, draft = r["decode_ms"], r.get("verify_ms"), r.get("draft_ms")
    floor_ms = lambda n: 1000 * n / (peak * 1e9)             # the least time reading n bytes takes at the copy bandwidth
    bound_tok_s = tau * 1000 / floor_ms(wv + wr)
    rows = (
        ("decode_bandwidth", r["achieved_gb_s"], f * peak, True, " GB/s",
         f"decode reads {wd / 1e9:.2f} GB a step, >= {floor_ms(wd):.2f} ms at the measured copy bandwidth {peak:.0f} GB/s; "
         f"bar {f:.0%} of that bandwidth (decode <= {floor_ms(wd) / f:.2f} ms; measured {decode:.2f} ms)"),
        ("verify_over_decode", None if verify is None else verify / decode, wv / wd / f, False, "x",
         f"verify ({r['block_size']} tokens) reads {wv / 1e9:.2f} GB, decode {wd / 1e9:.2f} GB: bytes ratio {wv / wd:.3f}; "
         f"bar ratio / {f:.2f}"),
        ("draft_over_verify", None if draft is None else draft / verify, wr / wv / f, False, "",
         f"draft reads {wr / 1e9:.2f} GB (the drafter and the target's lm_head), verify {wv / 1e9:.2f} GB: bytes ratio "
         f"{wr / wv:.3f}; bar ratio / {f:.2f}"),
        ("projected_tok_s", r.get("projected_dflash_tokens_per_s"), f * bound_tok_s, True, " tok/s",
         f"a round reads {(wv + wr) / 1e9:.2f} GB, >= {floor_ms(wv + wr):.2f} ms at {peak:.0f} GB/s: tau {tau:.2f} / that = "
         f"{bound_tok_s:.0f} tok/s at most; bar {f:.0%} of that"))
    bars = []
    for name, measured, bound, at_least, unit, derivation in rows:
        ok = None if measured is None else (measured >= bound if at_least else measured <= bound)
        shown = "not measured" if measured is None else f"{measured:.3g}{unit}"
        bars.append({"bar": name, "ok": ok, "measured": measured, "bound": bound, "derivation": derivation,
                     "line": f"{shown} {'>=' if at_least else '<='} bar {bound:.3g}{unit}"})
    return bars


def last_json(path: str) -> dict | None:
    """The last line of file `path` that is a JSON object (a log mixes them with other output), or None."""
    found = None
    with open(path, errors="replace") as fh:
        for line in fh:
            if line.startswith("{"):
                try:
                    found = json.loads(line)
                except ValueError:
                    pass
    return found if isinstance(found, dict) else None


def preset_summary(path: str) -> int:
    """bench_gpu.sh's verdict on a --preset run: the last JSON line of `path` (the run's log or JSON file; AR's own
    line, "part": "ar", when the run ended before its DFlash part) in one line, then each GPU bar (gpu_bars): PASS,
    FAIL or MISSING (its step not measured), the measured value against the bar, and how the bar was derived.
    -> exit code: 1 when a bar is missed or missing or `path` holds no JSON line, else 0 (no bars off CUDA)."""
    r = last_json(path)
    if r is None:
        print(f"no JSON line in {path}: the --preset run printed none (its log says why)")
        return 1
    if r["peak_copy_gb_s"]:
        bw = f"{r['achieved_gb_s']:.0f} GB/s = {r['bandwidth_fraction']:.1%} of {r['peak_copy_gb_s']:.0f} GB/s"
    else:
        bw = f"{r['achieved_gb_s']:.1f} GB/s (no peak measured off CUDA)"
    line = f"{r['preset']} on {r.get('platform', r['device'])}: decode {r['decode_ms']:.3f} ms = {bw}"
    if r.get("part") == "ar":
        line += "; AR only: the run ended before its DFlash part finished (its log says why)"
    else:
        line += (f"; verify {r['verify_over_decode']:.2f}x decode; draft {r['draft_over_verify']:.1%} of verify; "
                 f"PROJECTED {r['projected_dflash_tokens_per_s']:.0f} tok/s at tau {r['projected_tau']}")
        if r["max_memory_allocated_gb"] is not None:
            line += f"; max memory {r['max_memory_allocated_gb']:.1f} GB"
        if r.get("cudagraph_skips"):
            line += f"; {r['cudagraph_skips']} compiled graphs NOT run as CUDA graphs (see inductor's log)"
    print(line)
    bars = gpu_bars(r)
    if not bars:
        print("  no bars: they are GPU bars (derived from the copy bandwidth a CUDA run measures)")
        return 0
    for b in bars:
        verdict = "MISSING" if b["ok"] is None else ("PASS" if b["ok"] else "FAIL")
        print(f"  {verdict}  {b['bar']}: {b['line']}")
        print(f"      {b['derivation']}")
    return 0 if all(b["ok"] for b in bars) else 1
