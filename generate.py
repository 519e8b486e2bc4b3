"""Command line: DFlash speculative decoding (greedy or sampled; plain AR with --draft none) on a Qwen3.5 target.

    python generate.py --prompt "def fibonacci(n):"                       # embedded tiny pair, offline
    python generate.py --target Qwen/Qwen3.5-9B --draft z-lab/Qwen3.5-9B-DFlash --prompt "..." --device cuda
    python generate.py --target Qwen/Qwen3.5-9B --draft z-lab/Qwen3.5-9B-DFlash --system "Be brief." --prompt "..." --no-think

With a checkpoint that ships a chat template (chat_template.jinja, or tokenizer_config.json's chat_template),
--prompt is a user turn rendered by that template (--chat is then the default; --no-chat sends raw text);
--system, --messages FILE (earlier turns) and --tools FILE (tool schemas) go into the same rendering.

This is also the oracle interface other engines compare against: with --json the last stdout line is one
JSON object with prompt_ids, output_ids, acceptance_lengths, draft_ids and timings.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

import chat
import dflash
import flex
import checkpoint as ckpt
import model as M
import vision

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TARGET = os.path.join(HERE, "checkpoints", "tiny-qwen35")
DEFAULT_DRAFT = os.path.join(HERE, "checkpoints", "tiny-qwen35-dflash")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
# The attention backend of the cached steps, chosen here only: the masks class the Engine builds once.
ATTENTION = {"sdpa": M.DenseMasks, "flex": flex.FlexMasks}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET, help="Qwen3.5 checkpoint folder or Hugging Face repo id (default: the embedded tiny model)")
    p.add_argument("--draft", default=None, help="DFlash drafter folder or repo id, or 'none' for plain AR (default: the embedded drafter with the embedded target)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json); with --chat, the user turn")
    g.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3 (used as is, never templated)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="render --prompt with the checkpoint's chat template (default: on when the checkpoint ships one)")
    p.add_argument("--system", help="system prompt (chat)")
    p.add_argument("--messages", help="JSON file: a list of {role, content} messages before --prompt (chat, several turns)")
    p.add_argument("--tools", help="JSON file: a list of tool schemas the model may call (chat; Qwen3.5's template "
                                   "lists them in a system block)")
    p.add_argument("--no-think", action="store_true", help="chat: answer without a reasoning block (enable_thinking=False)")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for the prompt, repeatable (a multimodal Qwen3.5 checkpoint; needs Pillow). With --chat the "
                        "files fill the image items of --messages, then open the new user turn; otherwise each "
                        "<|image_pad|> in the prompt stands for the next image")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=None, help="tokens per draft-verify step (default: the drafter's block_size)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--cache-len", type=int, default=None, help="positions in the static caches (default: just enough for the request)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line instead of streaming text")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exactly the target's greedy output)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (same seed, same output)")
    p.add_argument("--num-samples", type=int, default=1, help="independent generations in one run (sampling)")
    p.add_argument("--draft-window", type=int, default=None, help="drafts see only the last W context positions (long prompts)")
    p.add_argument("--compile", action="store_true", help="torch.compile the fixed-shape step functions (warm-up timed apart)")
    p.add_argument("--compile-mode", default="max-autotune", help="torch.compile mode used with --compile")
    p.add_argument("--cpp-wrapper", action=argparse.BooleanOptionalAction, default=True,
                   help="with --compile on a CPU: inductor's C++ wrapper around each compiled step (cppwrapper.py)")
    p.add_argument("--onednn", action="store_true",
                   help="float32 on a CPU: products of a few rows (verify, draft) through oneDNN on prepacked weights "
                        "(onednn.py; faster on some CPUs, not on others: see the README)")
    p.add_argument("--attention", choices=sorted(ATTENTION), default="sdpa",
                   help="attention of the cached steps: sdpa (default; boolean masks) or flex (FlexAttention block masks "
                        "built once; use with --compile on CUDA, eager flex on CPU is slow)")
    args = p.parse_args(argv)
    if args.draft is None:
        args.draft = DEFAULT_DRAFT if args.target == DEFAULT_TARGET else "none"
    return args


def compile_options(args, device) -> dict:
    """Inductor options added to --compile-mode's: on a CPU the C++ wrapper (cppwrapper.py), unless --no-cpp-wrapper."""
    if not (args.cpp_wrapper and torch.device(device).type == "cpu"):
        return {}
    import cppwrapper
    return cppwrapper.options()


def use_onednn(*modules) -> None:
    """--onednn: swap the linears of the loaded, final models for oneDNN ones (onednn.py, optional; a no-op where
    it does not apply: not float32, not a CPU, no oneDNN in this torch, or too little free memory)."""
    import onednn
    for m in modules:
        if m is not None:
            onednn.swap_linears_(m)


def parse_ids(text: str) -> list:
    """'1,2,3' (spaces allowed around or instead of the commas) -> [1, 2, 3]. Spaces are separators, never
    dropped: '1 2' is [1, 2], not [12]."""
    try:
        return [int(t) for t in re.split(r"[,\s]+", text.strip()) if t != ""]
    except ValueError:
        raise dflash.GenerationError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


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


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.block_size is not None and args.block_size < 1:   # 0 must not fall back to the default
        raise dflash.GenerationError(f"--block-size must be >= 1, got {args.block_size}")
    if args.num_samples < 1:
        raise dflash.GenerationError(f"--num-samples must be >= 1, got {args.num_samples}")
    sampling = dflash.Sampling(args.temperature, args.top_p, args.top_k)     # checked before anything loads
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise dflash.GenerationError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    dtype = DTYPES[args.dtype or ("bfloat16" if device == "cuda" else "float32")]

    t0 = time.perf_counter()
    target = ckpt.load_target(args.target, dtype, device)
    tokenizer = ckpt.load_tokenizer(target.path)
    proposer = None
    if args.draft.lower() != "none":
        proposer = dflash.DrafterProposer(ckpt.load_drafter(args.draft, target.cfg, dtype, device), target, args.draft_window)
    if args.onednn:
        use_onednn(target, proposer.drafter if proposer else None)
    load_seconds = time.perf_counter() - t0

    template, specials = chat.load_chat_template(target.path)
    as_chat = args.chat if args.chat is not None else (template is not None and args.prompt_ids is None)
    if not as_chat and (args.system is not None or args.messages or args.no_think or args.tools):
        raise dflash.GenerationError("--system, --messages, --tools and --no-think belong to chat mode; drop --no-chat "
                                     "(or use a checkpoint that ships a chat template)")
    if args.prompt is None and args.prompt_ids is None and not (as_chat and args.messages):
        raise dflash.GenerationError("give a prompt: --prompt TEXT, --prompt-ids IDS, or (chat) --messages FILE")
    tools = chat.read_tools(args.tools) if as_chat and args.tools else None
    if as_chat:
        if args.prompt_ids is not None:
            raise dflash.GenerationError("--prompt-ids are used as is and cannot be rendered as a chat; use --prompt or drop --chat")
        if template is None:
            raise dflash.GenerationError(f"{target.path} ships no chat template (chat_template.jinja or tokenizer_config.json's "
                                         "chat_template); drop --chat")
        if tokenizer is None:
            raise dflash.GenerationError(f"{target.path} has no tokenizer.json, which chat mode needs")
        prompt_ids = tokenizer.encode(chat.chat_prompt(template, specials, messages_file=args.messages, system=args.system, prompt=args.prompt,
                                                       n_images=len(args.image), thinking=not args.no_think, tools=tools), add_special_tokens=False).ids
    elif args.prompt is not None:
        if tokenizer is None:
            raise dflash.GenerationError(f"{target.path} has no tokenizer.json; pass --prompt-ids instead of --prompt")
        prompt_ids = tokenizer.encode(args.prompt).ids
    else:
        prompt_ids = parse_ids(args.prompt_ids)
    images = None
    if args.image:      # each <|image_pad|> becomes its image's tokens; prompt_ids is the expanded sequence
        pictures = [vision.load_image(f) for f in args.image]
        tower, processor = vision.load_vision(target.path, dtype, device)
        images = vision.encode_images(tower, processor, prompt_ids, pictures)
        prompt_ids = images.ids
    block_size = args.block_size if args.block_size is not None else (proposer.max_block_size if proposer else 1)
    stops = ckpt.stop_token_ids(target.path, target.cfg)
    if as_chat:    # a turn ends at <|im_end|> even when the checkpoint's configs name only <|endoftext|>
        stops += [i for i in map(tokenizer.token_to_id, chat.CHAT_STOPS) if i is not None and i not in stops]
    thinking = as_chat and not args.no_think

    def new_stream():
        return TextStream(tokenizer, hide=stops if as_chat else (), render=chat.chat_display if thinking else None)

    stream = new_stream() if (tokenizer is not None and not args.json) else None
    if stream is None and not args.json:
        print("(no tokenizer.json: printing token ids)")
    print_ids = None if args.json else (lambda s: print(*s.tokens, end=" ", flush=True))   # when there is no stream
    capacity = dflash.check_inputs(target, prompt_ids, args.max_new_tokens, block_size, args.cache_len, proposer)
    engine = dflash.Engine(target, proposer, block_size, capacity, args.compile_mode if args.compile else None,
                           masks=ATTENTION[args.attention], compile_options=compile_options(args, device))
    compile_seconds = 0.0
    if args.compile:        # compile on a throw-away run so the timed run measures decoding only
        t0 = time.perf_counter()
        engine.run(prompt_ids, min(args.max_new_tokens, 3 * block_size), stops, images=images)
        compile_seconds = time.perf_counter() - t0
    gen = torch.Generator(device=device)
    if args.seed is not None:
        gen.manual_seed(args.seed)
    else:
        gen.seed()
    samples = []
    for i in range(args.num_samples):
        if args.num_samples > 1 and not args.json:
            print(f"--- sample {i + 1}/{args.num_samples}")
        if stream:
            stream = new_stream()
        res = engine.run(prompt_ids, args.max_new_tokens, stops, print_ids if stream is None else (lambda s, st=stream: st.push(s.tokens)),
                         sampling=sampling, generator=gen, images=images)
        samples.append(res)
        if stream:
            stream.close()
        elif not args.json:
            print()

    n_decode = len(res.output_ids) - 1
    tps = n_decode / res.decode_seconds if res.decode_seconds > 0 and n_decode else 0.0
    if args.json:
        print(json.dumps({
            "prompt_ids": res.prompt_ids, "output_ids": res.output_ids,
            "acceptance_lengths": res.acceptance_lengths, "draft_ids": res.draft_ids,
            "mean_acceptance_length": res.mean_acceptance_length,
            "prefill_seconds": res.prefill_seconds, "decode_seconds": res.decode_seconds,
            "decode_tokens_per_s": tps, "load_seconds": load_seconds, "compile_seconds": compile_seconds, "block_size": block_size if proposer else 1,
            "mode": "dflash" if proposer else "ar", "device": device, "dtype": str(dtype).replace("torch.", ""),
            "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
            **(chat.chat_fields(tokenizer, res.output_ids, stops, thinking, tools) if as_chat else {"chat": False}),
            **({"samples": [{"output_ids": r.output_ids, "acceptance_lengths": r.acceptance_lengths} for r in samples]}
               if args.num_samples > 1 else {}),
        }))
    else:
        stats = f"[{len(res.output_ids)} tokens, {tps:.1f} tok/s after the first"
        if proposer:
            stats += (f", mean acceptance length {res.mean_acceptance_length:.2f}, "
                      f"histogram (1..{block_size} tokens/step) {res.histogram(block_size)}")
        print(stats + "]")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (M.CheckpointError, dflash.GenerationError, vision.ImageError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except torch.cuda.OutOfMemoryError:
        print("error: the GPU ran out of memory; use --dtype bfloat16, a smaller --cache-len / --max-new-tokens, or a larger GPU", file=sys.stderr)
        sys.exit(2)
