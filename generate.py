"""Command line: DFlash speculative decoding (greedy or sampled; plain AR with --draft none) on a Qwen3.5 target.

    python generate.py --prompt "def fibonacci(n):"                       # embedded tiny pair, offline
    python generate.py --target Qwen/Qwen3.5-9B --draft z-lab/Qwen3.5-9B-DFlash --prompt "..." --device cuda
    python generate.py --target Qwen/Qwen3.5-9B --draft z-lab/Qwen3.5-9B-DFlash --system "Be brief." --prompt "..." --no-think

With a checkpoint that ships a chat template (chat_template.jinja, or tokenizer_config.json's chat_template),
--prompt is a user turn rendered by that template (--chat is then the default; --no-chat sends raw text);
--system, --messages FILE (earlier turns) and --tools FILE (tool schemas) go into the same rendering.

This is also the oracle interface other engines compare against: with --json the last stdout line is one
JSON object with prompt_ids, output_ids, acceptance_lengths, draft_ids and timings.

Many requests at once (engine.Engine with N slots: continuous batching, each request's output its own run's):
    python generate.py --prompts-file requests.jsonl --concurrency 8 --json     # one JSON line per request, in order

Past one device (tp.py: tensor and expert parallelism on torch.distributed; rank 0 prints):
    torchrun --nproc-per-node 2 generate.py --target DIR --draft DIR --prompt-ids 1,2,3 --json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import sys
import time

import torch

import chat
import compiling
import dflash
import engine
import eagle3
import checkpoint as ckpt
import model as M
import mtp
import tp
import vision
from policy import counts_of, describe, engine_policy, switches
from sampling import DRAFT_RULES
from options import (ATTENTION, DEFAULT_DRAFT, DEFAULT_TARGET, MAX_SEED, HelpFormatter, chat_template_of, compile_options,
                     parallel_fields, parse_ids, pick_dtype, pick_weights, read_requests, request_of, shared_flags,
                     shared_values_check, use_products)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    shared_flags(p)
    p.add_argument("--draft", default=None, help="DFlash drafter folder or repo id, 'mtp' for the target's own MTP head (mtp.py), "
                                               "or 'none' for plain AR (default: the embedded drafter with the embedded target)")
    p.add_argument("--mtp-steps", type=int, default=None, help="with --draft mtp: chained MTP steps per draft, K = 1..15 (the "
                                                           "target verifies K + 1 tokens; default 3)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json); with --chat, the user turn")
    g.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3 (used as is, never templated)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="render --prompt with the checkpoint's chat template (default: on when the checkpoint ships one, "
                        "or with --chat-template)")
    p.add_argument("--chat-template", metavar="FILE.jinja",
                   help="a Jinja chat template used instead of the checkpoint's (e.g. checkpoints/qwen35_chat_template.jinja, "
                        "Qwen3.5's own: chat with the embedded pair offline)")
    p.add_argument("--system", help="system prompt (chat)")
    p.add_argument("--messages", help="JSON file: a list of {role, content} messages before --prompt (chat, several turns)")
    p.add_argument("--tools", help="JSON file: a list of tool schemas the model may call (chat; Qwen3.5's template "
                                   "lists them in a system block)")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for the prompt, repeatable (a multimodal Qwen3.5 checkpoint; needs Pillow). With --chat the "
                        "files fill the image items of --messages, then open the new user turn; otherwise each "
                        "<|image_pad|> in the prompt stands for the next image")
    p.add_argument("--cache-len", type=int, default=None, help="positions in the static caches (default: what the request needs; with --compile rounded up to a "
                        "power of two of at least 256, so that compiled steps are reused across nearby prompt lengths)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line instead of streaming text")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exactly the target's greedy output)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed, 0 .. 2^63-1: the same seed gives the same text, with or without a drafter, whatever the step "
                        "pattern (position-keyed noise; except a DFlash2 drafter under --draft-rule ratio). Default: a "
                        "random one, printed with the statistics and in --json")
    p.add_argument("--num-samples", type=int, default=1, help="independent generations in one run (sampling): sample i "
                                                             "(from 0) uses seed + i")
    p.add_argument("--draft-rule", choices=DRAFT_RULES, default="coupled",
                   help="sampling with a drafter that samples its block (DFlash2): coupled (default; the draft races with "
                        "the target's noise, the output equals --draft none's for the seed) or ratio (min(1, p/q): "
                        "accepts more, the output is distributed as the target's but is another text, and follows the "
                        "step pattern). Greedy drafters (DFlash, MTP) accept the same under both")
    p.add_argument("--tree-size", type=int, default=None, metavar="N",
                   help="verify a tree of N proposals per round instead of the chain of one block: the most probable "
                        "paths through the DFlash drafter's per-position top-k (tree.py; greedy, eager, text)")
    p.add_argument("--tree-top-k", type=int, default=None, metavar="K",
                   help="with --tree-size: candidates per block row (default 4); an EAGLE-3 drafter: candidates per "
                        "expanded node and nodes expanded per depth (default 4)")
    p.add_argument("--tree-depth", type=int, default=None, metavar="D",
                   help="an EAGLE-3 drafter's tree depth (default 6); a DFlash tree is as deep as the block")
    p.add_argument("--prompts-file", metavar="FILE.jsonl",
                   help="many requests, one JSON object per line: prompt, prompt_ids or messages, and optionally "
                        "max_new_tokens, temperature, top_p, top_k, seed (the flags' values otherwise); run as a batch "
                        "of --concurrency requests at a time. With --json: one line per request, in input order")
    p.add_argument("--concurrency", type=int, default=None,
                   help="with --prompts-file: requests in flight at once, the batch's slots (default 1)")
    args = p.parse_args(argv)
    if args.draft is None:
        args.draft = DEFAULT_DRAFT if args.target == DEFAULT_TARGET else "none"
    return args


class TextStream:
    """Prints committed tokens as text, holding back an incomplete UTF-8 sequence at a token boundary."""

    def __init__(self, tokenizer, out=None, hide=(), render=None):
        # sys.stdout looked up now, not at import: a caller (or a test) may have replaced it since
        self.tok, self.out, self.ids, self.shown = tokenizer, out or sys.stdout, [], 0
        self.hide = set(hide)                  # ids never shown (chat: the stop token that ends the turn)
        self.render = render or (lambda text: text)   # decoded text -> what is shown; must only ever grow

    def text(self) -> str:
        return self.tok.decode([i for i in self.ids if i not in self.hide], skip_special_tokens=False)

    def push(self, ids: list) -> None:
        self.ids += ids
        text = self.text()
        if text.endswith("\ufffd"):      # a multi-byte character split across tokens: wait for the rest
            return
        shown = self.render(text)
        self.out.write(shown[self.shown:])
        self.out.flush()
        self.shown = len(shown)

    def close(self) -> None:
        self.out.write(self.render(self.text())[self.shown:] + "\n")
        self.out.flush()


def load(args, device, dtype, parallel: tp.Parallel | None = None) -> tuple:
    """The target, its tokenizer and the proposer (None: plain AR) named by the flags, with the products chosen
    for them (use_products' record); under torchrun cut to this rank's part (parallel.shard). Arithmetic in `dtype`,
    the weights kept as --weight-dtype says (target, DFlash drafter, MTP head; an EAGLE-3 drafter in `dtype`)."""
    weights = pick_weights(args.weight_dtype, dtype, parallel)
    # under torchrun each layer is cut as it is read: no process holds the whole checkpoint
    target = parallel.load_target(args.target, dtype, device) if parallel else ckpt.load_target(args.target, dtype, device, weights)
    tokenizer = ckpt.load_tokenizer(target.path)
    proposer = None
    if args.mtp_steps is not None and args.draft.lower() != "mtp":
        raise dflash.GenerationError(f"--mtp-steps applies to --draft mtp, not to --draft {args.draft}")
    if args.draft.lower() == "mtp":
        if args.draft_window:       # refused before the head is read
            raise dflash.GenerationError("--draft-window applies to DFlash drafters; the MTP head reads the whole context")
        proposer = mtp.MTPProposer(mtp.load_mtp(target.path, target, dtype, weights), target,
                                   3 if args.mtp_steps is None else args.mtp_steps)
    elif args.draft.lower() != "none":
        draft_dir = ckpt.resolve_dir(args.draft)       # once: a Hub id is fetched for the check and the load alike
        if eagle3.is_eagle3(ckpt.read_config(draft_dir)):
            if args.draft_window:
                raise dflash.GenerationError("--draft-window applies to DFlash drafters; an EAGLE-3 drafter reads the whole context")
            proposer = eagle3.Eagle3Tree(eagle3.load_eagle3(draft_dir, target, dtype, device), target, args.tree_depth or 6,
                                         args.tree_top_k or 4)
            args.tree_size = 16 if args.tree_size is None else args.tree_size      # EAGLE-3 drafts trees (the seeds' 16)
        else:
            drafter = ckpt.load_drafter(draft_dir, target.cfg, dtype, device, weights)
            proposer = engine.DrafterProposer(drafter, target, ckpt.draft_window(drafter.cfg, args.draft_window))
    if args.tree_depth is not None and not isinstance(proposer, eagle3.Eagle3Tree):
        raise dflash.GenerationError("--tree-depth applies to EAGLE-3 drafters (a DFlash tree is as deep as the block)")
    if parallel is not None:               # the proposer cut too (before speed/packed.py packs any weight); target.cfg the shard's
        parallel.shard(target, proposer)
    rows = (args.block_size or proposer.max_block_size) if proposer else 1    # a slot's verify block, draft queries
    dense = proposer.drafter if isinstance(proposer, engine.DrafterProposer) else None
    products = use_products(args.products, rows * (args.concurrency or 1), target, dense)
    return target, tokenizer, proposer, products



def preflight(args, device, dtype, parallel: tp.Parallel | None = None) -> None:
    """What the configs alone decide, before any weight is read: --cache-len within what the target's
    max_position_embeddings allows, --max-new-tokens (with --prompt-ids) within it, and the memory the run needs
    (memory_check: the target and a DFlash drafter in `dtype`, the caches of the asked context and slots) within what
    the device has. A text prompt's tokens are counted once tokenized (check_caches). Under torchrun each rank holds
    a part of the weights, and only the caches are checked, once loaded. Weights are counted as --weight-dtype keeps
    them (with auto: as the checkpoint's files store most of their bytes)."""
    weights = pick_weights(args.weight_dtype, dtype, parallel)
    target_dir = ckpt.resolve_dir(args.target)
    cfg = ckpt.target_config(ckpt.read_config(target_dir))
    kind = args.draft.lower()
    draft = draft_dir = None
    if kind not in ("none", "mtp"):
        draft_dir = ckpt.resolve_dir(args.draft)
        raw = ckpt.read_config(draft_dir)
        draft = None if eagle3.is_eagle3(raw) else ckpt.draft_config(raw)
        if draft is not None:
            ckpt.check_fits(draft, cfg)
    # the widest verify call, as load and main settle it: a tree's nodes + 1 (an EAGLE-3 drafter always grows trees),
    # --block-size, or the proposer's own block
    if args.tree_size is not None or (kind not in ("none", "mtp") and draft is None):
        block = (16 if args.tree_size is None else args.tree_size) + 1
    elif args.block_size is not None:
        block = args.block_size
    else:
        if kind == "mtp" and args.mtp_steps is not None:
            mtp.check_steps(args.mtp_steps)
        block = {"none": 1, "mtp": (3 if args.mtp_steps is None else args.mtp_steps) + 1}.get(kind) or draft.block_size
    positions = cfg.max_position_embeddings
    most = positions + block - 1
    if args.cache_len is not None and args.cache_len > most:
        slack = f" ({positions} + {block - 1} for the last verify block)" if block > 1 else ""
        raise dflash.GenerationError(f"--cache-len {args.cache_len} is more than the target can use: its max_position_embeddings "
                                     f"is {positions}, so a cache holds at most {most} positions{slack}; use --cache-len "
                                     f"{most} or less, or drop it")
    prompt = len(parse_ids(args.prompt_ids)) if args.prompt_ids is not None else 0
    if args.prompts_file is None and prompt + args.max_new_tokens > positions:
        raise dflash.GenerationError(f"prompt + max_new_tokens = {prompt + args.max_new_tokens} exceeds the model's "
                                     f"max_position_embeddings {positions}; shorten the request")
    if parallel is not None:
        return
    need = prompt + args.max_new_tokens + block - 1
    capacity = args.cache_len or (dflash.default_capacity(need, most) if args.compile else need)
    slots = args.concurrency or 1
    def kept(path):
        return None if weights is None else ckpt.kept_dtype(ckpt.file_dtype(path), dtype, weights)
    held = ckpt.target_bytes(cfg, dtype, kept(target_dir))
    if kept(target_dir) not in (None, dtype):      # each product widens its weight: the largest, the lm_head, for a moment
        held += cfg.vocab_size * cfg.hidden_size * dtype.itemsize
    held += ckpt.drafter_bytes(draft, dtype, kept(draft_dir)) if draft is not None else 0
    memory_check(args, held, ckpt.cache_bytes(cfg, dtype, capacity, slots, block, draft), device, dtype, slots)


def memory_check(args, weights: int, caches: int, device, dtype, slots: int) -> None:
    """checkpoint.check_memory with the flags that would shrink the run; on a GPU the host's memory too, which the
    weights pass through while loading."""
    fixes = (["--dtype bfloat16 (half the bytes)"] if dtype != torch.bfloat16 else []) + \
            ["a shorter --cache-len" if args.cache_len is not None else "a smaller --max-new-tokens"] + \
            (["fewer --concurrency slots"] if slots > 1 else [])
    cuda = torch.device(device).type == "cuda"
    ckpt.check_memory(weights, caches, ckpt.available_memory(device), "the GPU" if cuda else "this machine", fixes)
    if cuda and weights:
        ckpt.check_memory(weights, 0, ckpt.available_memory("cpu"), "this machine (the weights are read through it)", fixes)


def check_caches(args, target, proposer, capacity: int, slots: int, block: int, device, dtype) -> None:
    """Once loaded and the prompts tokenized: the caches of the run's real capacity within the memory left."""
    draft = proposer.drafter.cfg if isinstance(proposer, engine.DrafterProposer) else None
    memory_check(args, 0, ckpt.cache_bytes(target.cfg, dtype, capacity, slots, block, draft), device, dtype, slots)

def chat_flags_check(args, as_chat: bool) -> None:
    """The chat-only flags without chat mode: say why chat mode is off."""
    used = [f for f, on in (("--system", args.system is not None), ("--messages", args.messages), ("--tools", args.tools),
                            ("--no-think", args.no_think)) if on]
    if as_chat or not used:
        return
    if args.chat is False:
        why = "drop --no-chat"
    elif args.prompt_ids is not None:
        why = "they need --prompt text (--prompt-ids are used as is)"
    else:
        why = f"{args.target} ships no chat template (chat_template.jinja or tokenizer_config.json's chat_template); drop them"
    verb = "belongs" if len(used) == 1 else "belong"
    raise dflash.GenerationError(f"{', '.join(used)} {verb} to chat mode, which is off: {why}")


def prompt_ids_of(args, target, tokenizer, as_chat: bool, template, specials, tools) -> list:
    """The prompt's token ids: a chat turn rendered by the template, plain text, or --prompt-ids."""
    chat_flags_check(args, as_chat)
    if args.prompt is None and args.prompt_ids is None and not (as_chat and args.messages):
        raise dflash.GenerationError("give a prompt: --prompt TEXT, --prompt-ids IDS, or (chat) --messages FILE")
    if as_chat:
        if args.prompt_ids is not None:
            raise dflash.GenerationError("--prompt-ids are used as is and cannot be rendered as a chat; use --prompt or drop --chat")
        if template is None:
            raise dflash.GenerationError(f"{target.path} ships no chat template (chat_template.jinja or tokenizer_config.json's "
                                         "chat_template); drop --chat")
        if tokenizer is None:
            raise dflash.GenerationError(f"{target.path} has no tokenizer.json, which chat mode needs")
        text = chat.chat_prompt(template, specials, messages_file=args.messages, system=args.system, prompt=args.prompt,
                                n_images=len(args.image), thinking=not args.no_think, tools=tools)
        return tokenizer.encode(text, add_special_tokens=False).ids
    if args.prompt is not None:
        if tokenizer is None:
            raise dflash.GenerationError(f"{target.path} has no tokenizer.json; pass --prompt-ids instead of --prompt")
        return tokenizer.encode(args.prompt).ids
    return parse_ids(args.prompt_ids)


def say(msg: str) -> None:
    """Progress and statistics go to stderr: stdout holds the generated text (or the --json line) only."""
    print(msg, file=sys.stderr, flush=True)


def stats_line(res, block_size: int, proposer, load_seconds: float, label: str = "", products: dict | None = None,
               counts: dict | None = None) -> str:
    """The statistics of one generation as one short bracketed stderr line: tokens, load, first-token latency, decode
    tok/s; with a drafter its draft-verify rounds and their mean acceptance length, and the plain steps adaptive
    speculation took (why: --no-adaptive's help), and with the policy's `counts` (policy.counts_of) the shadow drafts
    taken while plain steps ran and its switches by reason; the kind of packed few-row products (use_products'
    record `products`); the seed. Per-round detail is --json's (acceptance_lengths, step_kinds)."""
    n_decode = len(res.output_ids) - 1
    tps = n_decode / res.decode_seconds if res.decode_seconds > 0 and n_decode else 0.0
    line = (f"[{label}{len(res.output_ids)} tokens; load {load_seconds:.1f} s, first token {res.prefill_seconds * 1e3:.0f} ms, "
            f"then {tps:.1f} tok/s")
    if proposer:
        rounds, plain = res.step_kinds.count("verify"), res.step_kinds.count("plain")
        if rounds:
            line += f"; {rounds} draft-verify round{'s' * (rounds != 1)}, mean acceptance length {res.mean_acceptance_length:.2f}"
        elif not plain:
            line += "; no draft-verify round: the generation ended with its first token"
        else:
            line += "; no draft-verify round"
        if plain:
            line += f"; {plain} plain step{'s' * (plain != 1)}"
        if counts is not None:
            shadows = counts["shadow_drafts"]
            line += (f", {shadows} shadow draft{'s' * (shadows != 1)}" if shadows else "") + "; " + switches(counts)
    if products and products["products"] != "plain":
        line += f"; {products['products']} packed products"
    if res.seed is not None:
        line += f"; seed {res.seed}"
    return line + "]"


def main(argv=None) -> int:
    args = parse_args(argv)
    shared_values_check(args)
    if args.num_samples < 1:
        raise dflash.GenerationError(f"--num-samples must be >= 1, got {args.num_samples}")
    sampling = engine.Sampling(args.temperature, args.top_p, args.top_k, args.draft_rule)   # checked before anything loads
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise dflash.GenerationError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    dtype = pick_dtype(args.dtype, device)
    batch_flags_check(args)
    tree_flags_check(args, sampling)
    value_flags_check(args, sampling)
    if args.prompts_file is not None:    # every line checked before anything loads (run_requests reads them again)
        read_requests(args.prompts_file, args)
    parallel, device = tp.launch(device, args.tp_backend, args.expert_parallel, args.tp_drafter == "sharded")
    preflight(args, device, dtype, parallel)

    # on a terminal, what the next seconds go to (in a log or a pipe, stderr holds only errors and statistics)
    if getattr(sys.stderr, "isatty", lambda: False)():
        draft = {"none": "", "mtp": " and its MTP head"}.get(args.draft.lower(), f" and {args.draft}")
        say(f"loading {args.target}{draft} ...")
    t0 = time.perf_counter()
    target, tokenizer, proposer, products = load(args, device, dtype, parallel)
    load_seconds = time.perf_counter() - t0
    tree_flags_check(args, sampling, loaded=True)     # again: an EAGLE-3 drafter always drafts trees
    if args.prompts_file is not None:
        return run_requests(args, target, tokenizer, proposer, products, load_seconds, device, dtype, parallel)
    template, specials = chat_template_of(args, target.path)
    as_chat = args.chat if args.chat is not None else (template is not None and args.prompt_ids is None)
    tools = chat.read_tools(args.tools) if as_chat and args.tools else None
    prompt_ids = prompt_ids_of(args, target, tokenizer, as_chat, template, specials, tools)
    images = None
    if args.image:      # each <|image_pad|> becomes its image's tokens; prompt_ids is the expanded sequence
        pictures = [vision.load_image(f) for f in args.image]
        tower, processor = vision.load_vision(target.path, dtype, device)
        images = vision.encode_images(tower, processor, prompt_ids, pictures)
        prompt_ids = images.ids
    block_size = args.block_size if args.block_size is not None else (proposer.max_block_size if proposer else 1)
    if args.tree_size is not None:       # a tree's nodes after the root, plus the root: its verify's width
        block_size = args.tree_size + 1
    stops = ckpt.stop_token_ids(target.path, target.cfg)
    if as_chat:    # a turn ends at <|im_end|> even when the checkpoint's configs name only <|endoftext|>
        stops = chat.with_chat_stops(tokenizer, stops)
    thinking = as_chat and not args.no_think
    capacity = dflash.check_inputs(target, prompt_ids, args.max_new_tokens, block_size, args.cache_len,
                                   None if args.tree_size else engine.max_block(proposer),
                                   round_up=args.compile)
    check_caches(args, target, proposer, capacity, 1, block_size, device, dtype)
    # adaptive speculation: the batch's policy (a draft tree's rounds are pure: its engine has no policy)
    adaptive = proposer is not None and not (args.no_adaptive or args.tree_size)
    policy = engine_policy(block_size, 1) if adaptive else None
    policy = parallel.synced(policy) if parallel else policy     # rank 0 decides every step for every rank
    eng = make_engine(args, target, proposer, block_size, capacity, policy, device)
    seed = args.seed if args.seed is not None else secrets.randbits(63)    # recorded, so any run can be repeated
    seed = parallel.same(seed) if parallel else seed

    def run(max_new: int, seed: int, on_step=None) -> engine.Result:
        """One generation of the prompt on either engine (the same call)."""
        return eng.generate(prompt_ids, max_new, stops, on_step, sampling=sampling, seed=seed, images=images)

    compile_seconds, graphs = 0.0, NO_GRAPHS
    if args.compile:        # compile on a throw-away run so the timed run measures decoding only
        compile_seconds, graphs = warm_up(
            eng, [engine.Request(prompt_ids, args.max_new_tokens, tuple(stops), sampling, 0, images)],
            f"compiling the step functions for a {capacity}-position cache (mode {args.compile_mode}; a minute or more "
            "on a CPU the first time, seconds when inductor's on-disk cache already holds this cache size)...")
    out = Output(args, tokenizer, stops if as_chat else (), thinking, echo=None if as_chat else args.prompt)
    samples, counts, label = [], [], ""
    try:
        for i in range(args.num_samples):
            label = f"sample {i + 1}/{args.num_samples}: " if args.num_samples > 1 else ""
            out.begin(label)
            samples.append(run(args.max_new_tokens, seed + i, out.push))
            counts.append(counts_of(policy))
            out.end()
            if not args.json:
                say(stats_line(samples[-1], block_size, proposer, load_seconds, label, products, counts[-1]))
    except KeyboardInterrupt:    # Ctrl-C: keep what was generated, say so, exit 130 (the shell's code for SIGINT)
        out.end()
        say(f"interrupted after {len(out.ids)} generated tokens{' of ' + label.rstrip(': ') if label else ''}")
        if args.json:
            print(json.dumps({"prompt_ids": prompt_ids, "output_ids": out.ids, "interrupted": True}))
        return 130
    if args.json:
        res = samples[-1]
        run = dict(load_seconds=load_seconds, compile_seconds=compile_seconds, block_size=block_size if proposer else 1,
                   cache_len=capacity, adaptive=policy is not None, device=device, dtype=dtype, products=products,
                   weight_dtype=target.embed_tokens.weight.dtype, parallel=parallel)
        print(json.dumps({
            **result_fields(res, args, tokenizer, proposer, run, sampling, seed),
            "draft_rule": draft_rule_of(args, proposer), **graphs, "policy": counts[-1],
            **(chat.chat_fields(tokenizer, res.output_ids, stops, thinking, tools)
               if as_chat else {"chat": False}),
            **({"samples": [{"output_ids": r.output_ids, "acceptance_lengths": r.acceptance_lengths, "seed": r.seed}
                            for r in samples]}
               if args.num_samples > 1 else {}),
        }))
    return 0


def result_fields(res, args, tokenizer, proposer, run: dict, sampling, seed) -> dict:
    """The --json fields of one generation (a single run's, or one request's of --prompts-file); `run` holds what
    the run shares: load_seconds, compile_seconds, block_size, cache_len, adaptive, device, dtype (the arithmetic's),
    weight_dtype (the target's weights'), products."""
    n_decode = len(res.output_ids) - 1
    return {
        "prompt_ids": res.prompt_ids, "output_ids": res.output_ids,
        "text": tokenizer.decode(res.output_ids, skip_special_tokens=False) if tokenizer is not None else None,
        "acceptance_lengths": res.acceptance_lengths, "draft_ids": res.draft_ids, "step_kinds": res.step_kinds,
        "mean_acceptance_length": res.mean_acceptance_length,
        "prefill_seconds": res.prefill_seconds, "decode_seconds": res.decode_seconds,
        "decode_tokens_per_s": n_decode / res.decode_seconds if res.decode_seconds > 0 and n_decode else 0.0,
        "load_seconds": run["load_seconds"], "compile_seconds": run["compile_seconds"], "block_size": run["block_size"],
        "cache_len": run["cache_len"], "mode": ("mtp" if args.draft.lower() == "mtp" else "dflash") if proposer else "ar",
        "adaptive": run["adaptive"], "draft_window": proposer.window if proposer else None, "device": run["device"],
        "dtype": str(run["dtype"]).replace("torch.", ""), "weight_dtype": str(run["weight_dtype"]).replace("torch.", ""),
        **run["products"],
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "seed": None if sampling.greedy else seed, "tree_size": getattr(args, "tree_size", None),
        **parallel_fields(run.get("parallel")),
    }


# ---- many requests at once: --prompts-file, --concurrency (engine.Engine with N slots) ---------------------------


def tree_flags_check(args, sampling, loaded: bool = False) -> None:
    """The tree flags without a drafter that grows trees, or with what a tree round does not do: refused before
    loading, and once more after (loaded: an EAGLE-3 drafter, known once read, has set tree_size)."""
    if args.tree_size is None:
        if args.tree_top_k is not None and (loaded or args.draft.lower() in ("none", "mtp")):
            raise dflash.GenerationError("--tree-top-k applies to --tree-size or an EAGLE-3 drafter")
        return
    refused = [(f, why) for f, on, why in (
        ("--tree-size < 1", args.tree_size < 1, f"got {args.tree_size}"),
        ("--tree-top-k < 1", args.tree_top_k is not None and args.tree_top_k < 1, f"got {args.tree_top_k}"),
        (f"--draft {args.draft}", args.draft.lower() in ("none", "mtp"), "trees grow from a DFlash or EAGLE-3 drafter"),
        ("--temperature", not sampling.greedy, "sampling with a tree needs the multi-draft rule, which is not built"),
        ("--compile", args.compile, "the tree verify is the eager reference"),
        ("--image", args.image, "tree rounds serve text prompts"),
        ("--attention flex", args.attention == "flex", "tree masks are boolean (sdpa)"),
        ("--block-size", args.block_size is not None, "a tree round verifies --tree-size + 1 tokens"),
        ("--prompts-file", args.prompts_file is not None, "a batch verifies chains")) if on]
    if refused:
        flag, why = refused[0]
        raise dflash.GenerationError(f"{flag} does not go with a draft tree (--tree-size, or an EAGLE-3 drafter): {why}")


def draft_rule_of(args, proposer) -> str:
    """The rule that decided a run's rounds: a drafter that drafts greedily is verified by the coupled rule under
    either --draft-rule."""
    return args.draft_rule if proposer is not None and proposer.samples_drafts else "coupled"


def make_engine(args, target, proposer, block_size: int, capacity: int, policy, device):
    """The generation's engine: engine.Engine with one slot (the same engine as --prompts-file), or with
    --tree-size its tree form, tree.TreeEngine, over the drafter's trees (a tree's verify is not batched)."""
    if args.tree_size is not None:      # (--compile is refused with a tree: its engine runs eager)
        import tree
        trees = proposer if tree.is_tree_proposer(proposer) else tree.DFlashTree(proposer, args.tree_top_k or 4)
        return tree.TreeEngine(target, trees, args.tree_size, capacity)
    return engine.Engine(target, proposer, block_size, 1, capacity, args.compile_mode if args.compile else None,
                         compile_options(args, device), policy, ATTENTION[args.attention])


def batch_flags_check(args) -> None:
    """--concurrency without --prompts-file, and the flags a batch does not take, each refused before loading."""
    if args.prompts_file is None:
        if args.concurrency is not None:
            raise dflash.GenerationError("--concurrency applies to --prompts-file (one request per line); give one, or drop it")
        return
    if args.concurrency is not None and args.concurrency < 1:
        raise dflash.GenerationError(f"--concurrency must be >= 1, got {args.concurrency}")
    refused = [(f, why) for f, on, why in (
        ("--prompt/--prompt-ids", args.prompt is not None or args.prompt_ids is not None, "the requests are the file's lines"),
        ("--messages", args.messages, "put a request's turns in its line's \"messages\""),
        ("--image", args.image, "give each line's image files in its \"images\" list"),
        ("--num-samples", args.num_samples != 1, "write one line per sample, each with its own seed")) if on]
    if refused:
        flag, why = refused[0]
        raise dflash.GenerationError(f"{flag} does not go with --prompts-file: {why}")


def value_flags_check(args, sampling) -> None:
    """Flag values that would be ignored, misread or overflow, each refused before loading with what to do."""
    if args.cache_len is not None and args.cache_len < 1:
        raise dflash.GenerationError(f"--cache-len must be >= 1 (positions in the static caches), got {args.cache_len}; "
                                     "or drop it to size the caches to the request")
    if args.block_size is not None and args.draft.lower() == "none":
        raise dflash.GenerationError("--block-size applies to a drafter's draft-verify rounds, and --draft none decodes one "
                                     "token per step (a --target other than the embedded one needs --draft DIR); drop "
                                     "--block-size or give a drafter")
    if args.products in ("mkl", "onednn") and args.draft.lower() == "none" and (args.concurrency or 1) == 1:
        raise dflash.GenerationError(f"--products {args.products} packs the products of a few rows (a drafter's rounds, or "
                                     "--concurrency's batch), and --draft none with one request decodes one row per "
                                     "step; drop --products or give a drafter")
    if args.num_samples > 1 and sampling.greedy:
        raise dflash.GenerationError(f"--num-samples {args.num_samples} applies to sampling only: greedy decoding "
                                     "(--temperature 0) gives the same text every time; set --temperature > 0 or drop --num-samples")
    if args.seed is not None:
        if not 0 <= args.seed <= MAX_SEED:
            raise dflash.GenerationError(f"--seed must be in 0 .. 2^63-1 ({MAX_SEED}), got {args.seed}")
        if args.seed + args.num_samples - 1 > MAX_SEED:
            raise dflash.GenerationError(f"--seed {args.seed} + --num-samples {args.num_samples} - 1 exceeds 2^63-1 (sample i "
                                         f"uses seed + i); use a --seed of at most {MAX_SEED - args.num_samples + 1}")


def run_requests(args, target, tokenizer, proposer, products, load_seconds, device, dtype, parallel=None) -> int:
    """--prompts-file: every line's request through an engine.Engine of --concurrency slots; the outputs in input order
    (with --json one line per request: a single run's fields plus its index), then the run's throughput."""
    template, specials = chat_template_of(args, target.path)
    tools = chat.read_tools(args.tools) if args.tools else None
    base_stops = ckpt.stop_token_ids(target.path, target.cfg)
    reqs, chats, towers = [], [], []

    def vision_of():            # the vision tower, loaded on the first line with images
        if not towers:
            towers.append(vision.load_vision(target.path, dtype, device))
        return towers[0]

    for i, (n, line) in enumerate(read_requests(args.prompts_file)):
        try:
            req, as_chat = request_of(line, i, args, tokenizer, template, specials, tools, base_stops, vision_of)
        except (dflash.GenerationError, vision.ImageError) as e:
            raise type(e)(f"{args.prompts_file} line {n}: {e}") from None
        reqs.append(req)
        chats.append(as_chat)
    slots = args.concurrency or 1
    block = args.block_size if args.block_size is not None else (proposer.max_block_size if proposer else 1)
    capacity = 0
    for i, r in enumerate(reqs):
        try:
            most = engine.max_block(proposer)
            capacity = max(capacity, dflash.check_inputs(target, r.prompt_ids, r.max_new_tokens, block, args.cache_len,
                                                         most, round_up=args.compile))
        except dflash.GenerationError as e:
            raise dflash.GenerationError(f"request {i}: {e}") from None
    check_caches(args, target, proposer, capacity, slots, block, device, dtype)
    policy = None if (proposer is None or args.no_adaptive) else engine_policy(block, slots)
    if parallel is not None:          # rank 0 decides every step, and its seeds are every rank's (Parallel.synced, .same)
        policy = parallel.synced(policy)
        seeds = parallel.same([secrets.randbits(63) for _ in reqs])
        reqs = [r if r.seed is not None else dataclasses.replace(r, seed=s) for r, s in zip(reqs, seeds)]
    eng = engine.Engine(target, proposer, block, slots, capacity, args.compile_mode if args.compile else None,
                            compile_options(args, device), policy, ATTENTION[args.attention])
    compile_seconds, graphs = 0.0, NO_GRAPHS
    if args.compile:
        compile_seconds, graphs = warm_up(eng, reqs, f"compiling the batch's step functions ({eng.slots} slots, "
                                                        f"a {eng.capacity}-position cache)...")
    t0 = time.perf_counter()
    results = eng.run(reqs)
    wall = time.perf_counter() - t0
    run = dict(load_seconds=load_seconds, compile_seconds=compile_seconds, block_size=block if proposer else 1,
               cache_len=capacity, adaptive=policy is not None, device=device, dtype=dtype, products=products,
               weight_dtype=target.embed_tokens.weight.dtype, parallel=parallel)
    thinking = not args.no_think
    for i, (req, res, as_chat) in enumerate(zip(reqs, results, chats)):
        if args.json:
            print(json.dumps({"index": i, **result_fields(res, args, tokenizer, proposer, run, req.sampling, res.seed),
                              "draft_rule": draft_rule_of(args, proposer), **graphs,
                              "concurrency": slots, "policy": counts_of(policy),
                              **(chat.chat_fields(tokenizer, res.output_ids, list(req.stop_ids), thinking, tools)
                                 if as_chat else {"chat": False})}))
        else:
            print(f"--- request {i}")
            print(tokenizer.decode(res.output_ids, skip_special_tokens=False) if tokenizer is not None else
                  " ".join(map(str, res.output_ids)), flush=True)
            say(stats_line(res, block, proposer, load_seconds, f"request {i}: ", products))
    generated = sum(len(r.output_ids) for r in results)
    counts = counts_of(policy)
    say(f"[{len(reqs)} requests, {min(slots, len(reqs))} in flight: {generated} tokens in {wall:.2f} s, {generated / wall:.1f} tok/s "
        f"(prefills included){'; ' + describe(counts) if counts else ''}]")
    return 0


NO_GRAPHS = {"graphs_compiled": 0, "graphs_cached": 0}      # the graph counts of a run that compiles nothing


def warm_up(eng, reqs: list, intro: str) -> tuple:
    """--compile: Engine.warm_up on `reqs` before the timed run (every step kind a policy may take, the sampled ones
    when sampling), said (`intro`, then the seconds and graph counts) -> (seconds, graph counts over the warm-up:
    compiling.graph_counts)."""
    say(intro)
    t0, before = time.perf_counter(), compiling.graph_counts()
    eng.warm_up(reqs)
    seconds = time.perf_counter() - t0
    graphs = {k: v - before[k] for k, v in compiling.graph_counts().items()}
    say(f"compiled in {seconds:.1f} s ({graphs['graphs_compiled']} graphs compiled, {graphs['graphs_cached']} from "
        "inductor's cache)")
    return seconds, graphs


class Output:
    """Where generated tokens go while they come: text through the tokenizer (TextStream), token ids when the
    checkpoint has no tokenizer, or nowhere with --json (collected for its line). Plain text prompts are echoed
    first, so stdout holds prompt + continuation; on a terminal the prompt is dimmed to mark where the
    continuation starts."""

    def __init__(self, args, tokenizer, hide, thinking: bool, echo: str | None):
        self.json, self.tok, self.hide, self.thinking, self.echo = args.json, tokenizer, hide, thinking, echo
        self.ids, self.stream = [], None
        if tokenizer is None and not args.json:
            print("(no tokenizer.json: printing token ids)")

    def begin(self, label: str) -> None:
        self.ids = []
        if self.json:
            return
        if label:
            print(f"--- {label.rstrip(': ')}")
        if self.tok is not None:
            self.stream = TextStream(self.tok, hide=self.hide, render=chat.chat_display if self.thinking else None)
            if self.echo is not None:
                dim = sys.stdout.isatty()
                sys.stdout.write(("\x1b[2m" if dim else "") + self.echo + ("\x1b[0m" if dim else ""))

    def push(self, step) -> None:
        self.ids += step.tokens
        if self.json:
            return
        if self.stream is not None:
            self.stream.push(step.tokens)
        else:
            print(*step.tokens, end=" ", flush=True)

    def end(self) -> None:
        if self.json:
            return
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        else:
            print(flush=True)


def cli(argv=None) -> int:
    """main(argv) with the errors a user can act on as one 'error:' line on stderr (exit code 2)."""
    try:
        return main(argv)
    except (M.CheckpointError, dflash.GenerationError, vision.ImageError) as e:
        say(f"error: {e}")
    except torch.cuda.OutOfMemoryError:
        say("error: the GPU ran out of memory; use --dtype bfloat16, a smaller --cache-len / --max-new-tokens, or a larger GPU")
    except KeyboardInterrupt:    # during loading or compiling: nothing generated yet
        say("error: interrupted before generation started")
        return 130
    finally:
        tp.close()
    return 2


if __name__ == "__main__":
    tp.exit_process(cli())
