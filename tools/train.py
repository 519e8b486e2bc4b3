"""Train the embedded default pair: a tiny Qwen3.5-architecture target and its DFlash drafter.

    python tools/train.py target --out checkpoints/tiny-qwen35 --minutes 25
    python tools/train.py draft  --target checkpoints/tiny-qwen35 --out checkpoints/tiny-qwen35-dflash --minutes 25
    python tools/train.py mtp    --target checkpoints/tiny-qwen35 --out /tmp/mtp-run --minutes 20   (writes mtp.* into --target)
    python tools/train.py eagle3 --target checkpoints/tiny-qwen35 --out checkpoints/tiny-qwen35-eagle3 --minutes 12

`target`: a byte-level BPE tokenizer (`tokenizers`) and a small hybrid model (Gated DeltaNet + gated attention)
trained on the Python standard library's own source, which every machine with Python has; files are split
into train / held-out by a hash of their name. Saved in the real checkpoint format (config.json with
model_type qwen3_5_text, model.safetensors with HF names, tokenizer.json), so transformers loads it too.

`draft`: the DFlash recipe (docs/method.md#training-the-drafter):
  - data: prompts from the training split with responses REGENERATED greedily by the target (the drafter
    learns the target's own distribution, which is what it is asked to predict at inference);
  - anchors: random positions inside each response; anchor a opens the block [tok[a], MASK x (B-1)] at
    positions a .. a+B-1, and block position k (1 <= k < B) predicts tok[a+k];
  - attention: one mask for the whole packed batch (`dflash_mask_mod`): a block sees the target features
    strictly before its anchor and its own block both ways, never other blocks;
  - loss: cross-entropy through the frozen target lm_head, weighted exp(-(k-1)/gamma);
  - the target's embedding and lm_head are shared and frozen; only the drafter trains.
Saved in the z-lab checkpoint format (config.json with dflash_config, model.safetensors), so the z-lab
`dflash` package loads it too.

Both jobs print periodic loss lines, checkpoint to <out>/train_state.pt, resume with --resume, use fixed
seeds, and stop at --minutes (or --steps).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if __package__ in (None, ""):       # run as a script (python tools/train.py): the repository's modules beside tools/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

import checkpoint as ckpt
import model as M
from prompts import read_text, stdlib_files   # the held-out split is the benchmarks' prompts (prompts.py)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]


# ==================================================================================================
# Data: the standard library's source
# ==================================================================================================

def train_tokenizer(vocab_size: int, out: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read_text(f) for f in stdlib_files("train")), trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    return tok


def token_stream(tokenizer, split: str) -> torch.Tensor:
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids = []
    for f in stdlib_files(split):
        text = read_text(f)
        if text:
            ids += tokenizer.encode(text).ids + [eot]
    return torch.tensor(ids, dtype=torch.long)


# ==================================================================================================
# Shared training machinery
# ==================================================================================================

def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine to 10% of peak over the budget (progress in 0..1: steps or minutes used)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class Budget:
    """Stops training at --steps or --minutes, whichever comes first."""

    def __init__(self, minutes: float, steps: int):
        self.start, self.deadline = time.time(), time.time() + 60 * minutes
        self.steps = steps

    def progress(self, step: int) -> float:
        return max(step / self.steps, (time.time() - self.start) / (self.deadline - self.start))

    def done(self, step: int) -> bool:
        return step >= self.steps or time.time() >= self.deadline


def optimizer_step(module, opt, loss) -> None:
    """Backward, clip the gradient norm to 1, step: the same for the target and the drafter."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()


def save_state(path, module, opt, step, extra=None):
    torch.save({"model": module.state_dict(), "opt": opt.state_dict(), "step": step,
                "rng": torch.get_rng_state(), "extra": extra or {}}, path)


def load_state(path, module, opt):
    """weights_only: the state holds tensors, numbers and dicts only, so nothing in a state file from elsewhere runs."""
    st = torch.load(path, weights_only=True)
    module.load_state_dict(st["model"])
    opt.load_state_dict(st["opt"])
    torch.set_rng_state(st["rng"])
    return st["step"], st["extra"]


# ==================================================================================================
# Job 1: the target
# ==================================================================================================

def tiny_target_config(vocab_size: int) -> M.TargetConfig:
    """Both layer types, GQA in attention, 2 key heads shared by 4 value heads in GDN, partial RoPE."""
    return M.TargetConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[3, 3, 2], max_position_embeddings=4096)


def init_weights_(model: torch.nn.Module, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(math.log(0.001), math.log(0.1), generator=g).exp().expm1().log())
            elif "norm" in name:
                p.fill_(0.0 if isinstance(model, M.Qwen35) and "linear_attn.norm" not in name else 1.0)
            elif name.endswith("conv_weight"):
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                    p.mul_(1 / math.sqrt(2 * 6))


def batches(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
        x = torch.stack([stream[s:s + seq + 1] for s in starts])
        yield x[:, :-1], x[:, 1:]


@torch.no_grad()
def eval_loss(model, stream, seq=256, n=16) -> float:
    model.eval()
    losses = []
    for i in range(n):
        s = (len(stream) - seq - 1) * i // n
        x = stream[s:s + seq + 1][None]
        logits, _ = model(x[:, :-1], torch.arange(seq))
        losses.append(F.cross_entropy(logits[0], x[0, 1:]).item())
    model.train()
    return sum(losses) / len(losses)


def train_target(args):
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    tok_path = os.path.join(args.out, "tokenizer.json")
    if args.resume and os.path.exists(tok_path):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(tok_path)
    else:
        tok = train_tokenizer(args.vocab_size, args.out)
    train_ids, held_ids = token_stream(tok, "train"), token_stream(tok, "heldout")
    print(f"tokens: train {len(train_ids):,}  held-out {len(held_ids):,}  vocab {tok.get_vocab_size()}", flush=True)
    cfg = tiny_target_config(tok.get_vocab_size())
    model = M.Qwen35(cfg)
    init_weights_(model, args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    state_path = os.path.join(args.out, "train_state.pt")
    step = 0
    if args.resume and os.path.exists(state_path):
        step, _ = load_state(state_path, model, opt)
        print(f"resumed at step {step}", flush=True)
    gen = torch.Generator().manual_seed(args.seed + step)
    data = batches(train_ids, args.batch, args.seq, gen)
    budget = Budget(args.minutes, args.steps)
    model.train()
    t0, ema = time.time(), None
    while not budget.done(step):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, budget.progress(step), args.lr, 50)
        x, y = next(data)
        logits, _ = model(x, torch.arange(args.seq))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        optimizer_step(model, opt, loss)
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0:
            tps = step * args.batch * args.seq / (time.time() - t0) if step else 0
            print(f"step {step}  loss {loss.item():.3f}  ema {ema:.3f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"{tps:,.0f} tok/s  {(time.time() - t0) / 60:.1f} min", flush=True)
        if step % args.save_every == 0:
            save_state(state_path, model, opt, step)
            ckpt.save_target(model, args.out)
    save_state(state_path, model, opt, step)
    ckpt.save_target(model, args.out)
    held = eval_loss(model, held_ids)
    summary = {"job": "target", "steps": step, "minutes": (time.time() - t0) / 60, "final_train_loss_ema": ema,
               "heldout_loss": held, "params": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(args.out, "training.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    print(json.dumps(summary), flush=True)


# ==================================================================================================
# Job 2: the drafter
# ==================================================================================================

def dflash_mask_mod(anchors: torch.Tensor, block_size: int, ctx_len: int, window: int | None = None):
    """The training mask as a FlexAttention mask_mod over (batch b, head h, query q, key kv).
    anchors [N, nA]: row b packs nA blocks; block i = queries i*B .. i*B+B-1, anchored at anchors[b, i].
    Keys are the ctx_len context positions of row b followed by the same packed blocks.
    Visible: a context key strictly before the query's anchor (its features exist at inference time) and, with
    a window, no more than `window` positions before it (what `--draft-window` lets a draft see), or a key in
    the query's own block (both ways). Never another block."""
    def mask_mod(b, h, q, kv):
        blk = q // block_size
        is_ctx = kv < ctx_len
        ctx_ok = is_ctx & (kv < anchors[b, blk])
        if window is not None:
            ctx_ok = ctx_ok & (kv >= anchors[b, blk] - window)
        own = (~is_ctx) & ((kv - ctx_len) // block_size == blk)
        return ctx_ok | own
    return mask_mod


def dense_mask(mask_mod, n_batch: int, n_q: int, n_kv: int) -> torch.Tensor:
    """Materialise a mask_mod as a dense bool [N, 1, n_q, n_kv] for SDPA (CPU: FlexAttention has no CPU backward)."""
    b = torch.arange(n_batch)[:, None, None, None]
    q = torch.arange(n_q)[None, None, :, None]
    kv = torch.arange(n_kv)[None, None, None, :]
    return mask_mod(b, 0, q, kv)


def training_mask(anchors: torch.Tensor, block_size: int, ctx_len: int, device, window: int | None = None):
    """One mask for the whole packed batch: a FlexAttention BlockMask on CUDA, the same mask dense elsewhere."""
    N, nA = anchors.shape
    mm = dflash_mask_mod(anchors, block_size, ctx_len, window)
    n_q = nA * block_size
    if torch.device(device).type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask
        return create_block_mask(mm, N, None, n_q, ctx_len + n_q, device=device)
    return dense_mask(mm, N, n_q, ctx_len + n_q)


@torch.no_grad()
def regenerate(target: M.Qwen35, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuations of a batch of equal-length prompts [N, P] -> [N, new_tokens] through the static caches."""
    N, P = prompts.shape
    cache = M.TargetCache(target.cfg, P + new_tokens, torch.float32, "cpu", batch=N)
    logits, _ = target(prompts, torch.arange(P), cache, last_logits_only=True)
    nxt = logits[:, -1].argmax(-1)
    out = [nxt]
    for t in range(P, P + new_tokens - 1):
        logits, _ = target(nxt[:, None], torch.tensor([t]), cache)
        nxt = logits[:, -1].argmax(-1)
        out.append(nxt)
    return torch.stack(out, 1)


def build_draft_data(target, tok, n_seq: int, prompt_len: int, resp_len: int, seed: int, batch: int = 64):
    """Sequences prompt + target's greedy response: prompts are random windows of the training split."""
    stream = token_stream(tok, "train")
    g = torch.Generator().manual_seed(seed)
    seqs = []
    t0 = time.time()
    for i in range(0, n_seq, batch):
        starts = torch.randint(0, len(stream) - prompt_len, (min(batch, n_seq - i),), generator=g)
        prompts = torch.stack([stream[s:s + prompt_len] for s in starts])
        seqs.append(torch.cat([prompts, regenerate(target, prompts, resp_len)], 1))
        print(f"regenerated {i + len(starts)}/{n_seq} sequences  {time.time() - t0:.0f}s", flush=True)
    return torch.cat(seqs)


def draft_hidden(drafter, target, seqs, anchors, feats, offset: int = 0, window: int | None = None):
    """The drafter's output for blocks anchored at anchors [N, nA] (columns of seqs [N, S]; column 0 is position
    `offset` of the sequence), packed into one forward with one mask: feats [N, S, F] the target's features of
    those columns; window: the drafter's attention span over the context (None: everything before the
    anchor), as `--draft-window` at inference. -> [N, nA, B, H]."""
    cfg = drafter.cfg
    N, S = seqs.shape
    n_anchors, B = anchors.shape[1], cfg.block_size
    blocks = torch.full((N, n_anchors, B), cfg.mask_token_id, device=seqs.device)
    blocks[:, :, 0] = seqs.gather(1, anchors)
    with torch.no_grad():
        emb = target.embed_tokens(blocks.flatten(1)) * cfg.input_embedding_scale   # shared, frozen
    bpos = offset + (anchors[:, :, None] + torch.arange(B)).flatten(1)     # [N, nA*B], positions in the sequence
    mask = training_mask(anchors, B, S, seqs.device, window)
    h = drafter(emb, feats, bpos, offset + torch.arange(S), mask)           # [N, nA*B, H]
    return h.view(N, n_anchors, B, -1)


def draft_loss(drafter, target, seqs, prompt_len, n_anchors, block_size, gamma, gen, feats=None, offset: int = 0,
               window: int | None = None):
    """One packed batch: each row of seqs [N, S] gets n_anchors random anchors inside its response (columns
    prompt_len ..); all N * n_anchors blocks go through the drafter in one forward (draft_hidden).
    feats [N, S, F]: the target's features of those columns when precomputed (a long-prompt crop, whose column 0
    is position `offset` of the sequence); else computed here. -> (weighted CE, acceptance)."""
    cfg = drafter.cfg
    N, S = seqs.shape
    B = block_size
    assert B == cfg.block_size, "the block size is the drafter's"
    k = torch.arange(1, B)
    w = torch.exp(-(k - 1).float() / gamma)                                  # exp(-(k-1)/gamma), k = 1..B-1
    if feats is None:
        with torch.no_grad():                                                # the target is frozen
            _, feats = target(seqs, torch.arange(S), feature_layers=tuple(cfg.target_layer_ids))
    # anchors inside the response, with room for the whole block: [N, nA]
    anchors = torch.stack([prompt_len + torch.randperm(S - prompt_len - B + 1, generator=gen)[:n_anchors]
                           for _ in range(N)])
    labels = seqs.gather(1, (anchors[:, :, None] + k).flatten(1)).view(N, n_anchors, B - 1)
    h = draft_hidden(drafter, target, seqs, anchors, feats, offset, window)[:, :, 1:]   # position 0 is not trained
    logits = drafter.draft_logits(h, target.lm_head)                        # through the frozen lm_head
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(N, n_anchors, B - 1)
    loss = (ce * w).sum() / (w.sum() * N * n_anchors)
    with torch.no_grad():                                                   # tokens a verify would commit
        acc = (logits.argmax(-1) == labels).int().cumprod(-1).sum(-1).float().mean() + 1
    return loss, float(acc)


@torch.no_grad()
def build_long_data(target, tok, feature_layers: tuple, n_seq: int, prompt_len: int, resp_len: int, window: int,
                    seed: int, batch: int = 8) -> dict:
    """Long-context training data for a windowed drafter: prompts of prompt_len tokens (random windows of the
    training split) + the target's greedy response, of which only what a draft with a `window` reads is kept:
    tokens and target features (a full forward over the whole sequence, so they carry the long context) at
    positions prompt_len - window .. prompt_len + resp_len - 1. -> {"tokens" [n,W+R], "feats" [n,W+R,F], "offset"}."""
    stream = token_stream(tok, "train")
    g = torch.Generator().manual_seed(seed)
    keep, toks, feats = prompt_len - window, [], []
    t0 = time.time()
    for i in range(0, n_seq, batch):
        starts = torch.randint(0, len(stream) - prompt_len, (min(batch, n_seq - i),), generator=g)
        prompts = torch.stack([stream[s:s + prompt_len] for s in starts])
        seqs = torch.cat([prompts, regenerate(target, prompts, resp_len)], 1)
        _, f = target(seqs, torch.arange(seqs.shape[1]), feature_layers=feature_layers, last_logits_only=True)
        toks.append(seqs[:, keep:])
        feats.append(f[:, keep:].clone())
        print(f"long prompts of {prompt_len}: {i + len(starts)}/{n_seq} sequences  {time.time() - t0:.0f}s", flush=True)
    return {"tokens": torch.cat(toks), "feats": torch.cat(feats), "offset": keep}


def grow_drafter_(big: M.DFlashDrafter, small: M.DFlashDrafter) -> None:
    """Warm start of a drafter from a trained one with the same widths and as many target layers, and no more
    drafter layers: fc, the norms and the first layers are copied; each extra layer gets zero o_proj and
    down_proj, so it adds nothing to the residual stream and `big` computes exactly what `small` does on the
    same features until training moves it. The target layer ids may differ (same count): fc's slices are copied
    slot by slot, so slot i of `big` reads big's i-th target layer with the weights small learnt for its i-th
    (e.g. [1, 3, 5] -> [1, 3, 4]: the slice trained on layer 5 starts as layer 4's)."""
    a, b = big.cfg, small.cfg
    same = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "block_size", "mask_token_id", "vocab_size", "is_causal", "conv_kernel_size")   # (full layers, no DFlash2)
    diff = [f for f in same if getattr(a, f) != getattr(b, f)]
    if len(a.target_layer_ids) != len(b.target_layer_ids):
        diff.append("the number of target_layer_ids")
    if set(b.layer_types) != {"full_attention"}:
        diff.append("layer_types (this trainer builds full-attention layers only)")
    if diff or b.num_hidden_layers > a.num_hidden_layers:
        raise SystemExit(f"--init-from drafter differs in {diff or ['num_hidden_layers (more layers)']}: it cannot seed this one")
    with torch.no_grad():
        own = big.state_dict()
        for name, p in small.state_dict().items():
            own[name].copy_(p)
        for layer in big.layers[b.num_hidden_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def train_draft(args):
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    target = ckpt.load_target(args.target, torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(args.target, "tokenizer.json"))
    data_path = os.path.join(args.out, "regenerated.pt")
    seqs = torch.load(data_path, weights_only=True) if os.path.exists(data_path) else None
    if seqs is not None and seqs.shape[1] != args.prompt_len + args.resp_len:
        raise SystemExit(f"{data_path} holds sequences of {seqs.shape[1]} tokens, not --prompt-len + --resp-len = "
                         f"{args.prompt_len + args.resp_len}; delete it or pass the lengths it was built with")
    have = 0 if seqs is None else len(seqs)
    if have < args.n_seq:   # build, or extend with fresh prompts (a seed of its own per extension)
        more = build_draft_data(target, tok, args.n_seq - have, args.prompt_len, args.resp_len, args.seed + 7919 * have)
        seqs = more if seqs is None else torch.cat([seqs, more])
        torch.save(seqs, data_path)
    print(f"training on {len(seqs)} regenerated sequences", flush=True)
    if args.long_prompts and args.window is None:
        raise SystemExit("--long-prompts needs --window (the drafter's attention span: the data keeps only that much context)")
    if args.window is not None and not 1 <= args.window <= min(args.long_prompts or [args.window]):
        raise SystemExit(f"--window must be between 1 and the shortest --long-prompts length, got {args.window}")
    L = target.cfg.num_hidden_layers
    cfg = M.DraftConfig(
        hidden_size=target.cfg.hidden_size, intermediate_size=args.draft_intermediate, num_hidden_layers=args.draft_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=target.cfg.vocab_size,
        target_layer_ids=args.target_layers or ckpt.default_target_layer_ids(L, args.draft_layers),
        mask_token_id=tok.token_to_id("<|mask|>"), block_size=args.block_size, num_target_layers=L,
        rope_theta=10000.0,    # the context a draft saw in training: generate.py's default draft window
        train_context_length=args.window or args.prompt_len + args.resp_len)
    drafter = M.DFlashDrafter(cfg)
    init_weights_(drafter, args.seed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    state_path = os.path.join(args.out, "train_state.pt")
    step = 0
    if args.init_from and not (args.resume and os.path.exists(state_path)):
        src = ckpt.load_drafter(args.init_from, target.cfg, torch.float32)
        grow_drafter_(drafter, src)
        moved = "" if src.cfg.target_layer_ids == cfg.target_layer_ids else \
            f"; fc slices of target layers {src.cfg.target_layer_ids} now read {cfg.target_layer_ids}"
        print(f"initialised from {args.init_from}: its layers first, the new ones adding nothing yet{moved}", flush=True)
    if args.resume and os.path.exists(state_path):
        step, _ = load_state(state_path, drafter, opt)
        print(f"resumed at step {step}", flush=True)
    # Buckets of training data: the regenerated short sequences, then one per --long-prompts length (built once,
    # kept in <out>/long-<P>.pt). Each step trains on one bucket: a long one (drawn uniformly) with probability
    # --long-share, else the short sequences.
    buckets = [(seqs, None, args.prompt_len, 0)]
    for P in args.long_prompts or []:
        path = os.path.join(args.out, f"long-{P}.pt")
        data = torch.load(path, weights_only=True) if os.path.exists(path) else None
        if data is None or len(data["tokens"]) < args.long_n_seq or data["offset"] != P - args.window:
            data = build_long_data(target, tok, tuple(cfg.target_layer_ids), args.long_n_seq, P, args.resp_len,
                                   args.window, args.seed + P)
            torch.save(data, path)
        buckets.append((data["tokens"], data["feats"], args.window, data["offset"]))
    gen = torch.Generator().manual_seed(args.seed + step)
    budget = Budget(args.minutes, args.steps)
    t0, ema = time.time(), None
    drafter.train()
    while not budget.done(step):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, budget.progress(step), args.lr, 50)
        long_step = len(buckets) > 1 and float(torch.rand((), generator=gen)) < args.long_share
        pick = 1 + int(torch.randint(0, len(buckets) - 1, (), generator=gen)) if long_step else 0
        toks, feats, prompt_len, offset = buckets[pick]
        idx = torch.randint(0, len(toks), (args.batch,), generator=gen)
        loss, acc = draft_loss(drafter, target, toks[idx], prompt_len, args.anchors, args.block_size, args.gamma, gen,
                               None if feats is None else feats[idx], offset, args.window)
        optimizer_step(drafter, opt, loss)
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0:
            print(f"step {step}  loss {loss.item():.3f}  ema {ema:.3f}  train acceptance {acc:.2f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {(time.time() - t0) / 60:.1f} min", flush=True)
        if step % args.save_every == 0:
            save_state(state_path, drafter, opt, step)
            ckpt.save_drafter(drafter, args.out)
    save_state(state_path, drafter, opt, step)
    ckpt.save_drafter(drafter, args.out)
    summary = {"job": "draft", "steps": step, "minutes": (time.time() - t0) / 60, "final_loss_ema": ema,
               "params": sum(p.numel() for p in drafter.parameters())}
    with open(os.path.join(args.out, "training.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    print(json.dumps(summary), flush=True)


# ==================================================================================================
# Job 3: the MTP head (Qwen3.5's multi-token prediction, the baseline DFlash is compared with)
# ==================================================================================================

def mtp_training_mask(S: int, steps: int) -> torch.Tensor:
    """[steps*S, steps*S] over rows (step k, index i), k = 1..steps: step 1 is the causal pass over the committed
    rows (i at position i); step k row i sits at position i + k - 1 and sees step-1 rows j <= i and its own row
    of steps 2..k, which is what the k-th chained step of a draft anchored after row i sees in the KV cache."""
    k = torch.arange(steps).repeat_interleave(S)            # 0-based step of each row
    i = torch.arange(S).repeat(steps)
    qk, qi, kk, ki = k[:, None], i[:, None], k[None, :], i[None, :]
    first = (kk == 0) & (ki <= qi)
    chain = (kk > 0) & (kk <= qk) & (ki == qi)
    return first | chain


def mtp_hidden(head, target, seqs, steps: int) -> torch.Tensor:
    """seqs [N, S]. Step 1 pairs the target's post-norm hidden state at i with token i+1 (it predicts token i+2);
    step k pairs step k-1's output at row i with token i+k (teacher forcing) and predicts token i+k+1. Step k
    needs step k-1's outputs, so k passes, each over steps 1..k with mtp_training_mask.
    -> the head's outputs [N, steps, R, H] for rows i < R = S - steps - 1 (a label at every step)."""
    N, S = seqs.shape
    with torch.no_grad():
        _, hidden = target(seqs, torch.arange(S), feature_layers=(target.cfg.num_hidden_layers - 1,))
        emb_all = target.embed_tokens(seqs)
    R = S - steps - 1
    mask = mtp_training_mask(R, steps)
    h, embs, hids, pos = hidden[:, :R], [], [], []
    for k in range(1, steps + 1):
        embs.append(emb_all[:, k:k + R])
        hids.append(h)
        pos.append(torch.arange(R) + k - 1)
        p = torch.cat(pos)
        cos, sin = target.rope(p, hidden.dtype)
        outs = head(torch.cat(embs, 1), torch.cat(hids, 1), cos, sin, p, mask[:k * R, :k * R])
        h = outs[:, (k - 1) * R:]
    return outs.view(N, steps, R, -1)


def chain_loss(logits, seqs, steps: int) -> tuple:
    """logits [N, steps, R, V] of chained steps (step k row i predicts token i+k+1 of seqs [N, S]) -> (mean
    cross-entropy, the tokens per round `steps` chained steps would give, teacher-forced)."""
    R = logits.shape[2]
    labels = torch.stack([seqs[:, k + 1:k + 1 + R] for k in range(1, steps + 1)], 1)
    loss = F.cross_entropy(logits.flatten(0, 2), labels.flatten())
    with torch.no_grad():
        acc = (logits.argmax(-1) == labels).int().cumprod(1).sum(1).float().mean() + 1
    return loss, float(acc)


def mtp_loss(head, target, seqs, steps: int) -> tuple:
    """seqs [N, S] of the target's own greedy text -> chain_loss of the head's chained steps."""
    return chain_loss(target.lm_head(mtp_hidden(head, target, seqs, steps)), seqs, steps)


def frozen_target_text(args) -> tuple:
    """The frozen target at --target and --n-seq sequences of its own greedy text: what a chained head trains on."""
    torch.manual_seed(args.seed)
    target = ckpt.load_target(args.target, torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(args.target, "tokenizer.json"))
    return target, build_draft_data(target, tok, args.n_seq, args.prompt_len, args.resp_len, args.seed)


def train_chained(head, batch_loss, seqs, args, job: str) -> dict:
    """The loop shared by the MTP and EAGLE-3 heads: AdamW on batch_loss(batch) -> (loss, acceptance) until the
    budget ends -> the run's summary."""
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    budget, step, t0, ema = Budget(args.minutes, args.steps), 0, time.time(), None
    head.train()
    while not budget.done(step):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, budget.progress(step), args.lr, 50)
        loss, acc = batch_loss(seqs[torch.randint(0, len(seqs), (args.batch,), generator=gen)])
        optimizer_step(head, opt, loss)
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0:
            print(f"step {step}  loss {loss.item():.3f}  ema {ema:.3f}  train acceptance ({args.train_steps} steps) {acc:.2f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {(time.time() - t0) / 60:.1f} min", flush=True)
    head.eval()
    return {"job": job, "steps": step, "minutes": (time.time() - t0) / 60, "final_loss_ema": ema,
            "params": sum(p.numel() for p in head.parameters())}


def write_summary(out: str, summary: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "training.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    print(json.dumps(summary), flush=True)


def train_mtp(args):
    """Train an MTP head for the target at --target (frozen) and write it into that checkpoint as mtp.*."""
    import mtp
    target, seqs = frozen_target_text(args)
    head = mtp.MTPHead(target.cfg)
    init_weights_(head, args.seed)
    with torch.no_grad():
        for n, p in head.named_parameters():
            if "norm" in n:
                p.zero_()                                    # zero-centred norms: 0 is the identity
    summary = train_chained(head, lambda batch: mtp_loss(head, target, batch, args.train_steps), seqs, args, "mtp")
    mtp.save_mtp(head, args.target)
    write_summary(args.out, summary)


def eagle3_hidden(drafter, target, seqs, steps: int) -> torch.Tensor:
    """EAGLE-3's training-time test, teacher-forced: seqs [N, S]. Step 1 row i is the context entry at position i,
    (token i+1, fc(the target's tapped features at i)), and predicts token i+2; step k row i pairs token i+k with
    step k-1's output at row i, at position i+k-1, and sees step-1 rows j <= i and its own row of steps 2..k
    (mtp_training_mask): what the k-th node of a chain drafted after row i sees at inference (eagle3.Eagle3Tree).
    -> the drafter's outputs [N, steps, R, H] for rows i < R = S - steps - 1."""
    N, S = seqs.shape
    mid = drafter.midlayer
    with torch.no_grad():
        _, feats = target(seqs, torch.arange(S), feature_layers=drafter.feature_layers(target.cfg.num_hidden_layers))
        emb_all = target.embed_tokens(seqs)
    R = S - steps - 1
    mask = mtp_training_mask(R, steps)
    h, embs, hids, pos = drafter.fc(feats[:, :R]), [], [], []
    for k in range(1, steps + 1):
        embs.append(emb_all[:, k:k + R])
        hids.append(h)
        pos.append(torch.arange(R) + k - 1)
        p = torch.cat(pos)
        x, residual = mid.inputs(torch.cat(embs, 1), torch.cat(hids, 1))
        cos, sin = drafter.rope(p, x.dtype)
        keys, values = mid.kv(x, cos, sin)
        outs = mid(x, residual, cos, sin, keys, values, mask[:k * R, :k * R])
        h = outs[:, (k - 1) * R:]
    return outs.view(N, steps, R, -1)


def train_eagle3(args):
    """Train an EAGLE-3 head (full draft vocabulary) for the frozen target at --target; saved to --out in the
    published layout (eagle3.save_eagle3)."""
    import eagle3
    target, seqs = frozen_target_text(args)
    c = target.cfg
    cfg = eagle3.Eagle3Config(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                              c.rms_norm_eps, c.rope_theta, c.vocab_size, c.vocab_size, c.hidden_size,
                              tuple(args.aux_layers))
    drafter = eagle3.Eagle3Drafter(cfg)
    init_weights_(drafter, args.seed)

    def batch_loss(batch):
        outs = eagle3_hidden(drafter, target, batch, args.train_steps)
        return chain_loss(drafter.lm_head(drafter.norm(outs)), batch, args.train_steps)
    summary = train_chained(drafter, batch_loss, seqs, args, "eagle3")
    eagle3.save_eagle3(drafter, args.out)
    write_summary(args.out, summary)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="job", required=True)
    for job in ("target", "draft", "mtp", "eagle3"):
        s = sub.add_parser(job)
        s.add_argument("--out", required=True)
        s.add_argument("--minutes", type=float, default=20.0)
        s.add_argument("--steps", type=int, default=100000)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--resume", action="store_true")
        s.add_argument("--log-every", type=int, default=10)
        s.add_argument("--save-every", type=int, default=100)
        s.add_argument("--threads", type=int, default=2)
    t = sub.choices["target"]
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--seq", type=int, default=128)
    t.add_argument("--lr", type=float, default=3e-3)
    d = sub.choices["draft"]
    d.add_argument("--target", required=True)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--gamma", type=float, default=7.0, help="loss decay: 7 for block 16, 5 for 10, 4 for 8 (the DFlash paper)")
    d.add_argument("--draft-layers", type=int, default=1)
    d.add_argument("--draft-intermediate", type=int, default=768)
    d.add_argument("--init-from", default=None,
                   help="a trained drafter with the same widths and number of target layers, and no more layers, to start "
                        "from; its extra layers start at zero output. --target-layers may name other layers than its own: "
                        "fc's slices are copied in order (1,3,5 -> 1,3,4: layer 5's slice starts as layer 4's)")
    d.add_argument("--target-layers", type=lambda x: [int(i) for i in x.split(",")], default=None,
                   help="target layers whose outputs the drafter reads, e.g. 1,3,5 (default: the z-lab spacing)")
    d.add_argument("--n-seq", type=int, default=1024,
                   help="regenerated sequences to train on; an existing regenerated.pt with fewer is extended")
    d.add_argument("--prompt-len", type=int, default=48)
    d.add_argument("--resp-len", type=int, default=160)
    d.add_argument("--anchors", type=int, default=32)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--lr", type=float, default=2e-3)
    d.add_argument("--window", type=int, default=None,
                   help="the drafter's attention span over the context in training (default: all of it); recorded as "
                        "the drafter's train_context_length, generate.py's default --draft-window")
    d.add_argument("--long-prompts", type=lambda x: [int(i) for i in x.split(",")], default=None,
                   help="also train on prompts of these lengths, e.g. 500,1500,3000 (needs --window): the target's "
                        "features then carry a long context, as at inference on long prompts")
    d.add_argument("--long-n-seq", type=int, default=64, help="sequences per --long-prompts length")
    d.add_argument("--long-share", type=float, default=0.5, help="with --long-prompts: the share of steps on long prompts")
    m = sub.choices["mtp"]
    m.add_argument("--target", required=True, help="the target checkpoint folder; the head is written into it (mtp.*)")
    m.add_argument("--train-steps", type=int, default=3, help="chained MTP steps trained together (teacher-forced)")
    m.add_argument("--n-seq", type=int, default=512, help="sequences of the target's own greedy text to train on")
    m.add_argument("--prompt-len", type=int, default=48)
    m.add_argument("--resp-len", type=int, default=160)
    m.add_argument("--batch", type=int, default=8)
    m.add_argument("--lr", type=float, default=2e-3)
    e = sub.choices["eagle3"]
    e.add_argument("--target", required=True)
    e.add_argument("--aux-layers", type=lambda x: [int(i) for i in x.split(",")], default=[1, 3, 5],
                   help="the target layers whose inputs it reads, counted as vLLM counts them (default 1,3,5: the "
                        "embedded target's layers 0, 2 and 4 outputs)")
    e.add_argument("--train-steps", type=int, default=5, help="chained draft steps trained together (training-time test)")
    e.add_argument("--n-seq", type=int, default=512, help="sequences of the target's own greedy text to train on")
    e.add_argument("--prompt-len", type=int, default=48)
    e.add_argument("--resp-len", type=int, default=160)
    e.add_argument("--batch", type=int, default=8)
    e.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    {"target": train_target, "draft": train_draft, "mtp": train_mtp, "eagle3": train_eagle3}[args.job](args)


if __name__ == "__main__":
    main()
