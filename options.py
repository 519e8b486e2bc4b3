"""What the command line (generate.py), the checker (check.py) and the tools (tools/bench.py, tools/tables.py, tools/presets.py) share:
the embedded checkpoints, the dtype and attention choices, the flags generate.py and tools/bench.py both take, the
compile options and the few-row products of a run, and the request files (--prompts-file) with their checks.

    DEFAULT_TARGET, DEFAULT_DRAFT, DEFAULT_EAGLE3   the embedded pair (checkpoints/) and its EAGLE-3 head
    pick_dtype, DTYPES        --dtype (the arithmetic), and each device's default
    pick_weights              --weight-dtype: how the weights are kept (checkpoint.load_target's `weights`)
    ATTENTION                 --attention: the masks class of the cached steps (SDPA or FlexAttention)
    shared_flags              the flags generate.py and tools/bench.py share
    shared_values_check       their values no run can take, refused before anything loads
    compile_options           inductor options added to --compile-mode's on a CPU
    use_products              --products: packed few-row products (speed/packed.py), chosen and swapped in
    read_requests, request_of --prompts-file lines, checked, and each line's engine.Request
"""
from __future__ import annotations

import argparse
import json
import os
import re

import torch

import chat
import checkpoint as ckpt
import dflash
import engine
from speed import flex
import model as M
import tp
import vision

HERE = os.path.dirname(os.path.abspath(__file__))


DEFAULT_TARGET = os.path.join(HERE, "checkpoints", "tiny-qwen35")


DEFAULT_DRAFT = os.path.join(HERE, "checkpoints", "tiny-qwen35-dflash")


DEFAULT_EAGLE3 = os.path.join(HERE, "checkpoints", "tiny-qwen35-eagle3")     # the embedded EAGLE-3 head (tools/train.py eagle3)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
WEIGHT_DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_dtype(name: str | None, device) -> torch.dtype:
    """--dtype NAME, else the device's default: bfloat16 on a GPU, float32 on a CPU."""
    return DTYPES[name or ("bfloat16" if torch.device(device).type == "cuda" else "float32")]


def pick_weights(name: str | None, dtype, parallel=None):
    """--weight-dtype NAME (default auto) for arithmetic in `dtype` -> checkpoint.load_target's `weights`: None (the
    arithmetic's own dtype: every weight kept in `dtype`), "auto" (each weight as stored where `dtype` holds it
    exactly: a bfloat16 checkpoint under float32 arithmetic; None under torchrun, which cuts weights kept in the
    arithmetic's dtype: tp.py), or a narrower dtype that `dtype` holds exactly (checkpoint.HELD_EXACTLY). Weights
    the arithmetic would round at every product, and a narrower dtype asked for under torchrun, are refused."""
    name = name or "auto"
    if WEIGHT_DTYPES[name] == dtype or (name == "auto" and parallel is not None):
        return None
    weights, arith = WEIGHT_DTYPES[name], str(dtype).replace("torch.", "")
    if parallel is not None:
        raise dflash.GenerationError(f"--weight-dtype {name} does not go with torchrun: tp.py cuts weights kept in --dtype "
                                     f"({arith}); drop --weight-dtype")
    if weights != "auto" and weights not in ckpt.HELD_EXACTLY.get(dtype, ()):
        raise dflash.GenerationError(f"--weight-dtype {name} under {arith} arithmetic (--dtype) would round the weights at "
                                     f"every product; use --weight-dtype auto, or {arith}")
    return weights


# The attention backend of the cached steps, chosen here only: the masks class the Engine builds once.
ATTENTION = {"sdpa": M.DenseMasks, "flex": flex.FlexMasks}


COMPILE_MODES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]    # torch.compile's modes


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help of generate.py, tools/bench.py and check.py: each flag's default appended as "(default: ...)", unless its
    help already says what the default is, or there is none to say (None, off, empty)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (re.search(r"(\(|^|\. |; )default\b|\bdefault[:;]", text, re.IGNORECASE) or not action.option_strings
                or action.default is argparse.SUPPRESS
                or action.default is None or action.default is False or action.default in ([], "")):
            return text
        return text + " (default: %(default)s)"


MAX_SEED = 2 ** 63 - 1      # seeds are 0 .. 2^63-1 (noise.py keys the low 64 bits: 2^64 would be seed 0's text)


def shared_flags(p) -> None:
    """The flags generate.py and tools/bench.py share, declared once: the target, the dtype and device, the step settings."""
    p.add_argument("--target", default=DEFAULT_TARGET, help="Qwen3.5 checkpoint folder or Hugging Face repo id (default: the embedded tiny model)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="generate at most this many tokens, the first included (fewer when a stop token comes first)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per draft-verify step (default: the drafter's block_size)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice, one per core; on a busy machine 1 can be many times "
                        "faster, since threads that wait for each other stall when another process holds a core)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="the arithmetic (activations, caches, states, "
                   "logits); default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--weight-dtype", choices=list(WEIGHT_DTYPES), default="auto",
                   help="how the weights are kept. auto (default): a bfloat16 or float16 checkpoint's weights as stored "
                        "when --dtype holds them exactly (float32 or float64 arithmetic), widened as each product reads "
                        "them: the widened model's results at half its weight memory, and faster compiled decoding on a "
                        "CPU; else in --dtype. float32 (or --dtype's name): every weight in --dtype, widened at load; or "
                        "a narrower dtype --dtype holds exactly")
    p.add_argument("--draft-window", type=int, default=None,
                   help="drafts see only the last W context positions (default: the context the drafter was trained on, "
                        "where its config says: train_context_length, or a sliding drafter's sliding_window; past it "
                        "acceptance collapses. 0 = the whole context)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="pure DFlash: a draft-verify round every step, even where plain decoding is measured faster "
                        "(default: policy.Policy decodes plainly while speculation loses; the output is the same)")
    p.add_argument("--compile", action="store_true", help="torch.compile the fixed-shape step functions (warm-up timed apart)")
    p.add_argument("--compile-mode", default="max-autotune", choices=COMPILE_MODES, help="torch.compile mode used with --compile")
    p.add_argument("--cpp-wrapper", action=argparse.BooleanOptionalAction, default=True,
                   help="with --compile on a CPU: inductor's C++ wrapper around each compiled step (speed/cppwrapper.py)")
    p.add_argument("--products", choices=["auto", "plain", "mkl", "onednn"], default="auto",
                   help="float32 on a CPU with a drafter: the products of a few rows (verify, draft) on weights packed "
                        "once (speed/packed.py): MKL's packed sgemm, oneDNN's, or plain F.linear. auto: the fastest kind "
                        "on this machine, measured on the first run and cached beside inductor's cache")
    p.add_argument("--attention", choices=sorted(ATTENTION), default="sdpa",
                   help="attention of the cached steps: sdpa (default; boolean masks) or flex (FlexAttention block masks "
                        "built once; use with --compile on CUDA, eager flex on CPU is slow)")
    p.add_argument("--no-think", action="store_true", help="chat (and tools/bench.py --dataset's prompts): answer without a "
                                                           "reasoning block (enable_thinking=False)")
    g = p.add_argument_group("tensor parallelism (under torchrun --nproc-per-node N: tp.py)")
    g.add_argument("--tp-backend", choices=sorted(tp.SERVES), default=None,
                   help="torch.distributed backend (default: nccl on cuda, gloo on cpu)")
    g.add_argument("--expert-parallel", action="store_true",
                   help="mixture of experts: each rank holds whole experts (default: every expert's channels split)")
    g.add_argument("--tp-drafter", choices=["replicated", "sharded"], default="replicated",
                   help="the DFlash drafter whole on every rank (default) or cut by head like the target")


def shared_values_check(args) -> None:
    """The values of shared_flags that no run can take, refused by generate.py and tools/bench.py alike before
    anything loads (dflash.GenerationError: one 'error:' line, exit code 2): --max-new-tokens, --block-size and
    --threads below 1, --draft-window below 0."""
    if args.max_new_tokens < 1:
        raise dflash.GenerationError(f"max_new_tokens must be >= 1 (--max-new-tokens), got {args.max_new_tokens}")
    if args.block_size is not None and args.block_size < 1:   # 0 must not fall back to the default
        raise dflash.GenerationError(f"--block-size must be >= 1, got {args.block_size}")
    if args.threads is not None and args.threads < 1:
        raise dflash.GenerationError(f"--threads must be >= 1, got {args.threads}")
    if args.draft_window is not None and args.draft_window < 0:
        raise dflash.GenerationError(f"--draft-window must be >= 0 (0 = the whole context), got {args.draft_window}")


def compile_options(args, device) -> dict:
    """Inductor options added to --compile-mode's: on a CPU the C++ wrapper (speed/cppwrapper.py), unless --no-cpp-wrapper;
    with --attention flex on a CPU no epilogue fusion (torch 2.13's CPU flex kernel refuses to take the
    one-query steps' following ops as epilogues: NotImplementedError in CppFlexAttentionTemplate)."""
    if torch.device(device).type != "cpu" or not getattr(args, "compile", True):
        return {}                     # (eager: nothing to add, and importing inductor would cost seconds)
    options = {"epilogue_fusion": False} if getattr(args, "attention", "sdpa") == "flex" else {}
    if not args.cpp_wrapper:
        return options
    from speed import cppwrapper
    return {**options, **cppwrapper.options()}


def use_products(choice: str, rows: int, *modules) -> dict:
    """--products: swap the linears of the loaded, final models (None entries skipped) for packed ones of the chosen
    kind (speed/packed.py, optional); auto: packed.choose (measured once per machine, then cached). A no-op where it does
    not apply: not float32, not a CPU, the kind missing in this torch, too little available memory for any copy (the
    largest products are packed first, as many as half of it holds), or (auto) no products of 2-64 rows, as in plain
    decoding (rows 1).
    -> {"products": the kind the first model (the target) runs ("plain" when none: its copies would not fit, say,
    though a smaller drafter's did), "products_measured": {kind: its time / plain's} as measured or read from the
    cache (None when forced), "products_cached": whether read from the cache}."""
    if choice == "plain":
        return {"products": "plain", "products_measured": None, "products_cached": False}
    from speed import packed
    modules = [m for m in modules if m is not None]
    measured, cached = None, False
    if choice == "auto":
        choice, measured, cached = packed.choose(modules, rows)
    if choice != "plain":
        for m in modules:
            packed.swap_linears_(m, choice, rows)
    return {"products": packed.kind_of(modules[:1]), "products_measured": measured, "products_cached": cached}


def products_words(products: dict) -> str:
    """use_products' record in words: which products the few-row steps ran, and what was measured."""
    measured = products["products_measured"]
    if measured:
        times = ", ".join(f"{k} {v:.2f}x" for k, v in measured.items())
        how = f"{'cached' if products['products_cached'] else 'measured now'}: {times} plain's time"
    else:
        how = "forced or not applicable"
    return f"few-row products: {products['products']} ({how})"


def parse_ids(text: str) -> list:
    """'1,2,3' (spaces allowed around or instead of the commas) -> [1, 2, 3]. Spaces are separators, never
    dropped: '1 2' is [1, 2], not [12]."""
    try:
        return [int(t) for t in re.split(r"[,\s]+", text.strip()) if t != ""]
    except ValueError:
        raise dflash.GenerationError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def chat_template_of(args, path: str) -> tuple:
    """(template, special tokens): the checkpoint's chat template, or --chat-template's file in its place."""
    template, specials = chat.load_chat_template(path)
    if args.chat_template is None:
        return template, specials
    if not os.path.isfile(args.chat_template):
        raise dflash.GenerationError(f"--chat-template {args.chat_template}: no such file")
    with open(args.chat_template, encoding="utf-8") as fh:
        return fh.read(), specials


def parallel_fields(parallel: tp.Parallel | None) -> dict:
    """--json's record of tensor parallelism: the degree (1: one process) and how experts and drafter were cut."""
    if parallel is None:
        return {"tensor_parallel": 1}
    return {"tensor_parallel": parallel.world, "expert_parallel": parallel.expert_parallel,
            "tp_drafter": "sharded" if parallel.shard_drafter else "replicated"}


REQUEST_KEYS = {"prompt": str, "prompt_ids": list, "messages": list, "max_new_tokens": int, "temperature": (int, float),
                "top_p": (int, float), "top_k": int, "seed": int, "images": list}   # what a line of --prompts-file may hold


PROMPT_KEYS = ("prompt", "prompt_ids", "messages")


def read_requests(path: str, args=None) -> list:
    """--prompts-file -> [(line number, the line's object)], each checked: exactly one of prompt, prompt_ids and
    messages; only REQUEST_KEYS, each of its type."""
    if os.path.isdir(path):
        raise dflash.GenerationError(f"--prompts-file {path} is a directory; give a JSON-lines file (one request per line)")
    if not os.path.isfile(path):
        raise dflash.GenerationError(f"--prompts-file {path}: no such file")
    try:
        with open(path, encoding="utf-8") as fh:
            fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise dflash.GenerationError(f"--prompts-file {path} cannot be read as UTF-8 text "
                                     f"({getattr(e, 'strerror', None) or getattr(e, 'reason', e)})") from None
    lines = []
    with open(path, encoding="utf-8") as fh:
        for n, text in enumerate(fh, 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
            except json.JSONDecodeError as e:
                raise dflash.GenerationError(f"{path} line {n} is not JSON ({e.msg}); write one object per line") from None
            if not isinstance(line, dict):
                raise dflash.GenerationError(f"{path} line {n} is not a JSON object; write one object per line")
            unknown = sorted(set(line) - set(REQUEST_KEYS))
            if unknown:
                raise dflash.GenerationError(f"{path} line {n}: unknown key {unknown[0]!r}; a line holds {', '.join(REQUEST_KEYS)}")
            bad = [k for k, v in line.items() if not isinstance(v, REQUEST_KEYS[k]) or isinstance(v, bool)]
            if bad:
                raise dflash.GenerationError(f"{path} line {n}: {bad[0]} has the wrong type ({type(line[bad[0]]).__name__})")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in line.get("prompt_ids", [])):
                raise dflash.GenerationError(f"{path} line {n}: prompt_ids must be a list of token ids (integers)")
            if not all(isinstance(f, str) for f in line.get("images", [])):
                raise dflash.GenerationError(f"{path} line {n}: images must be a list of image file paths (strings)")
            if sum(k in line for k in PROMPT_KEYS) != 1:
                raise dflash.GenerationError(f"{path} line {n}: give exactly one of {', '.join(PROMPT_KEYS)}")
            if args is not None:
                try:
                    request_values_check(line, len(lines), args)
                except dflash.GenerationError as e:
                    raise dflash.GenerationError(f"{path} line {n}: {e}") from None
            lines.append((n, line))
    if not lines:
        raise dflash.GenerationError(f"--prompts-file {path} holds no requests")
    return lines


def request_values_check(line: dict, index: int, args) -> None:
    """The values of a --prompts-file line as its request will take them (the flags' where the line has none),
    checked before anything loads: an empty prompt, max_new_tokens < 1, sampling settings that engine.Sampling
    refuses, a seed outside 0 .. 2^63-1 (or --seed + the line's index past it)."""
    if line.get("prompt_ids") == [] or line.get("messages") == []:
        raise dflash.GenerationError("the prompt is empty")
    new = line.get("max_new_tokens", args.max_new_tokens)
    if new < 1:
        raise dflash.GenerationError(f"max_new_tokens must be >= 1, got {new}")
    engine.Sampling(line.get("temperature", args.temperature), line.get("top_p", args.top_p), line.get("top_k", args.top_k),
                    args.draft_rule)
    if "seed" in line:
        if not 0 <= line["seed"] <= MAX_SEED:
            raise dflash.GenerationError(f"seed must be in 0 .. 2^63-1 ({MAX_SEED}), got {line['seed']}")
    elif args.seed is not None and args.seed + index > MAX_SEED:
        raise dflash.GenerationError(f"--seed {args.seed} + the request's index {index} exceeds 2^63-1 (a line without "
                                     "\"seed\" takes --seed + its index); give a smaller --seed, or the line its own \"seed\"")


def request_of(line: dict, index: int, args, tokenizer, template, specials, tools, stops: list, vision_of) -> tuple:
    """One line -> (engine.Request, whether it is a chat turn). A "prompt" is a user turn rendered by the chat
    template as --prompt is (unless --no-chat), "messages" a whole conversation, "prompt_ids" used as is; the
    line's settings override the flags'; the seed is the line's, else --seed + index, else a random one. "images":
    files for the line's image pads as --image gives them to a single run (a chat "prompt" opens with them);
    vision_of() -> (tower, processor), loaded once for the lines that have images."""
    as_chat = "messages" in line or ("prompt" in line and (args.chat if args.chat is not None else template is not None))
    files = line.get("images", [])
    if as_chat:
        if template is None:
            raise dflash.GenerationError("the checkpoint ships no chat template, which \"messages\" (or --chat) needs")
        messages = line.get("messages") or [{"role": "user", "content": line["prompt"]}]
        if "prompt" in line and files:      # images first, then the text, as chat_prompt places --image files
            messages = [{"role": "user", "content": [{"type": "image"} for _ in files] + [{"type": "text", "text": line["prompt"]}]}]
        if args.system is not None:
            messages = [{"role": "system", "content": args.system}] + messages
        text = chat.render_chat(template, messages, enable_thinking=not args.no_think, special_tokens=specials, tools=tools)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
    elif "prompt" in line:
        if tokenizer is None:
            raise dflash.GenerationError("the checkpoint has no tokenizer.json; give \"prompt_ids\" instead of \"prompt\"")
        ids = tokenizer.encode(line["prompt"]).ids
    else:
        ids = line["prompt_ids"]
    if as_chat:
        stops = chat.with_chat_stops(tokenizer, stops)
    sampling = engine.Sampling(line.get("temperature", args.temperature), line.get("top_p", args.top_p),
                               line.get("top_k", args.top_k), args.draft_rule)
    seed = line.get("seed", None if args.seed is None else args.seed + index)
    images = None
    if files:           # each <|image_pad|> becomes its image's tokens; the request's ids are the expanded ones
        try:
            tower, processor = vision_of()
        except M.CheckpointError as e:    # a text-only target: the line's "images" are what to drop (run_requests names the line)
            raise dflash.GenerationError(str(e).replace("drop --image", "drop the line's \"images\"")) from None
        images = vision.encode_images(tower, processor, ids, [vision.load_image(f) for f in files])
        ids = images.ids
    return (engine.Request(ids, line.get("max_new_tokens", args.max_new_tokens), tuple(stops), sampling, seed, images),
            as_chat)
