"""The seeds' tables: tau / speedup per method and prompt set, as markdown, JSON and plots (`tools/bench.py --methods`,
`tools/bench.py --dataset`).

    python tools/bench.py --dataset humaneval --limit 16 --methods dflash,mtp3 --out results/
    python tools/bench.py --dataset gsm8k,math500,humaneval,mbpp,mt-bench,alpaca --methods dflash --no-adaptive   # a GPU

Rows are methods, columns prompt sets, and each cell is "tau / speedup", with an Avg. column: the shape of the
z-lab and MMFlash cards' tables. Every prompt (every turn of a multi-turn sample) runs plain AR decoding first and
then each method, one after the other on the same weights, greedy; each method's output is compared with AR's
(they must be equal: exactly in float64, up to near-ties in float32 and bfloat16). The figures are the seeds'
(z-lab's benchmark, `_print_decode_summary`):
    tau      the mean over prompts of each prompt's mean tokens per round (its acceptance lengths)
    speedup  AR's mean time per output token / the method's, over the set's prompts
A multi-turn sample (MT-Bench) feeds AR's reply to each turn back before the next, so every method sees the
same conversation. `--out DIR` writes table.md, results.json and, with matplotlib installed, one PNG of the
acceptance-length histograms per set and one of the speedups (plots()).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

import chat
import checkpoint as ckpt
import dflash
import engine
import prompts as P
from compiling import cpu_model
import tree
from policy import PerRun, engine_policy


def method_proposers(args, target, dtype, device, weights=None) -> dict:
    """--methods names -> {name: (proposer, block size)}: dflash (--draft, its block size and default window),
    dflash-treeN (trees of N proposals from the same drafter's blocks, tree.DFlashTree; verify width N + 1), mtpK
    (the target checkpoint's MTP head, K chained steps, block K + 1), eagle3 (--eagle3-draft's dynamic trees of 16
    nodes, 6 deep, top 4: the seeds' baseline) and eagle3-chainK (the same head, one candidate per node, K deep).
    weights: how the DFlash drafters keep theirs (checkpoint.load_drafter's), as the target keeps its own."""
    import mtp
    out, head, eagle_head = {}, None, None
    for name in args.methods.split(","):
        if name == "dflash":
            drafter = ckpt.load_drafter(args.draft, target.cfg, dtype, device, weights)
            window = ckpt.draft_window(drafter.cfg, args.draft_window)
            out[name] = (engine.DrafterProposer(drafter, target, window), args.block_size or drafter.cfg.block_size)
        elif name.startswith("dflash-tree") and name[11:].isdigit() and int(name[11:]) >= 1:
            drafter = ckpt.load_drafter(args.draft, target.cfg, dtype, device, weights)
            inner = engine.DrafterProposer(drafter, target, ckpt.draft_window(drafter.cfg, args.draft_window))
            out[name] = (tree.DFlashTree(inner), int(name[11:]) + 1)
        elif name == "eagle3" or (name.startswith("eagle3-chain") and name[12:].isdigit() and int(name[12:]) >= 1):
            import eagle3
            drafter = eagle_head = eagle_head or eagle3.load_eagle3(args.eagle3_draft, target, dtype, device)
            k = int(name[12:]) if name != "eagle3" else None       # a chain of k: one candidate per node, k deep
            out[name] = (eagle3.Eagle3Tree(drafter, target, k or 6, 1 if k else 4), (k or 16) + 1)
        elif name.startswith("mtp") and name[3:].isdigit() and 1 <= int(name[3:]) <= 15:
            head = head or mtp.load_mtp(target.path, target, dtype)
            out[name] = (mtp.MTPProposer(head, target, int(name[3:])), int(name[3:]) + 1)
        else:
            raise dflash.GenerationError(f"--methods: unknown method '{name}'; use dflash, dflash-treeN (a tree of N "
                                         "proposals from the drafter's blocks), mtpK (K = 1..15), eagle3 (trees of 16 from "
                                         "--eagle3-draft) or eagle3-chainK, comma-separated")
    return out


def warm_capacity(prompt_len: int, max_new_tokens: int, block: int) -> int:
    """The cache positions of a benchmark's engine: its longest prompt, its tokens (at least the warm-up's 3 blocks,
    warm_up) and a block of slack."""
    return prompt_len + max(max_new_tokens, 3 * block) + block


def single_engine(args, target, proposer, block: int, capacity: int, adapt: bool, parallel=None, eager: bool = False):
    """The engine a benchmark runs single requests on: generate.py's, an engine.Engine of one slot, with a fresh
    policy.Policy for every request when `adapt` (policy.PerRun), and the --attention masks. AR: proposer None.
    parallel: under torchrun, rank 0's policy decides for every rank (tp.Synced). eager: not compiled whatever
    --compile says."""
    from options import ATTENTION, compile_options
    mode = args.compile_mode if args.compile and not eager else None
    options = compile_options(args, target.embed_tokens.weight.device)
    eng = engine.Engine(target, proposer, block, 1, capacity, mode, options, None,
                           ATTENTION[getattr(args, "attention", "sdpa")])
    adapt_(eng, adapt and proposer is not None, parallel)
    return eng


def adapt_(eng, on: bool, parallel=None) -> None:
    """An engine's next runs with a fresh adaptive policy each (on; under torchrun rank 0's decides: tp.Synced),
    calibrated by the engine's warm-up when it had one, or pure rounds (off)."""
    def make():
        policy = engine_policy(eng.block, eng.slots, getattr(eng, "calibration", None))
        return parallel.synced(policy) if parallel else policy
    eng.policy = PerRun(make) if on else None


def warm_up(eng, prompt: list, stops, max_new_tokens: int) -> None:
    """A throw-away run of a single_engine (or a tree.TreeEngine) that compiles every step kind its policy may take
    (excluded from timings)."""
    eng.warm_up([engine.Request(list(prompt), max_new_tokens, tuple(stops))])


def warm_engines(args, target, proposer, block: int, capacity: int, prompt: list, stops, parallel=None) -> tuple:
    """The AR and DFlash engines of one benchmark (single_engine; compiled with --compile), warmed up on `prompt`:
    compilation, CUDA graph capture, allocator and lazy init, excluded from the figures.
    -> (ar_engine, dflash_engine, warm-up seconds)."""
    adapt = not getattr(args, "no_adaptive", True)
    ar_engine = single_engine(args, target, None, 1, capacity, False)
    sp_engine = single_engine(args, target, proposer, block, capacity, adapt, parallel)
    t0 = time.perf_counter()
    warm_up(ar_engine, prompt, stops, args.max_new_tokens)
    warm_up(sp_engine, prompt, stops, args.max_new_tokens)
    return ar_engine, sp_engine, time.perf_counter() - t0


def step_ms(results, kind, attr):
    """Median milliseconds of attribute `attr` of the `kind` steps of Results."""
    vals = [getattr(s, attr) for r in results for s in r.steps if s.kind == kind]
    return 1000 * statistics.median(vals) if vals else None


# ---- what one prompt gives -------------------------------------------------------------------------

@dataclass
class Turn:
    """One prompt's run by one method: output tokens after the first, decode seconds, its acceptance lengths (one
    per round), and whether its output equals AR's."""
    tokens: int
    seconds: float
    lengths: list
    identical: bool = True

    @property
    def tpot(self) -> float:
        return self.seconds / max(1, self.tokens)


@dataclass
class Cell:
    """One method on one set: its turns, in order."""
    turns: list = field(default_factory=list)

    def tau(self) -> float:
        """The seeds' tau: the mean over prompts of each prompt's mean acceptance length (prompts without a round, as
        adaptive speculation may run, are left out)."""
        per = [statistics.mean(t.lengths) for t in self.turns if t.lengths]
        return statistics.mean(per) if per else 0.0

    def histogram(self, block: int) -> list:
        """How many rounds committed 1, 2, ..., block tokens."""
        lengths = [a for t in self.turns for a in t.lengths]
        return [lengths.count(k) for k in range(1, block + 1)]


def speedup(ar: Cell, cell: Cell) -> float:
    """The seeds' speedup: AR's mean time per output token over the method's, on the same prompts."""
    return statistics.mean(t.tpot for t in ar.turns) / statistics.mean(t.tpot for t in cell.turns)


# ---- running the sets ---------------------------------------------------------------------------------

class Runner:
    """AR and every method's engine on one target (tables.single_engine; trees: tree.TreeEngine), with caches grown
    when a prompt needs more room (rebuilt; with --compile that recompiles, so the first set's longest prompt sets
    the size with room to spare)."""

    def __init__(self, args, target, methods: dict, stops: list):
        self.args, self.target, self.methods, self.stops = args, target, methods, stops
        self.widest = max([b for _, b in methods.values()] + [1])          # the widest verify among the methods
        self.capacity, self.engines = 0, {}

    def fit(self, need: int, warm_prompt: list) -> None:
        if need <= self.capacity:
            return
        self.capacity = max(256, -(-int(need * 1.5) // 256) * 256)
        self.engines = {"ar": single_engine(self.args, self.target, None, 1, self.capacity, False)}
        warm_up(self.engines["ar"], warm_prompt, self.stops, self.args.max_new_tokens)
        for name, (proposer, block) in self.methods.items():
            if tree.is_tree_proposer(proposer):          # pure tree rounds, eager (the tree verify is the reference)
                eng = self.engines[name] = tree.TreeEngine(self.target, proposer, block - 1, self.capacity)
                eng.generate(warm_prompt, 8, self.stops)
                continue
            eng = self.engines[name] = single_engine(self.args, self.target, proposer, block, self.capacity,
                                                     not self.args.no_adaptive)
            warm_up(eng, warm_prompt, self.stops, self.args.max_new_tokens)

    def run(self, name: str, ids: list, images=None):
        """The median run of --repeat (by decode seconds) of one engine on one prompt -> engine.Result."""
        self.fit(len(ids) + self.args.max_new_tokens + self.widest, ids)
        runs = [self.engines[name].generate(ids, self.args.max_new_tokens, self.stops, profile=True, images=images)
                for _ in range(self.args.repeat)]
        return sorted(runs, key=lambda r: r.decode_seconds)[len(runs) // 2]


def progress(total: int, desc: str):
    """A progress bar on stderr for a terminal (tqdm, which comes with huggingface_hub), shown after 2 seconds."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="prompt", file=sys.stderr, delay=2, disable=None, leave=False)


def run_set(runner: Runner, samples: list, label: str, text) -> dict:
    """Every sample of one set through AR and each method -> {name: Cell} (AR's under "ar")."""
    cells = {name: Cell() for name in ["ar", *runner.methods]}
    with progress(sum(max(1, len(s.turns)) for s in samples), label) as bar:
        for sample in samples:
            replies = []
            for k in range(max(1, len(sample.turns))):
                ids, images = text.prompt(sample, k, replies)
                ar = runner.run("ar", ids, images)
                cells["ar"].turns.append(Turn(len(ar.output_ids) - 1, ar.decode_seconds, []))
                for name in runner.methods:
                    res = runner.run(name, ids, images)
                    cells[name].turns.append(Turn(len(res.output_ids) - 1, res.decode_seconds, res.verify_lengths,
                                                  res.output_ids == ar.output_ids))
                replies.append(text.reply(ar.output_ids))
                bar.update(1)
    return cells


class Text:
    """How the table's samples become prompts for this target: its tokenizer and chat template (thinking on or off),
    its vision tower for image samples (loaded when the first one comes), and AR's replies decoded back to text."""

    def __init__(self, target, tokenizer, thinking: bool, dtype, device):
        self.target, self.tok, self.thinking, self.dtype, self.device = target, tokenizer, thinking, dtype, device
        self.template, self.specials = chat.load_chat_template(target.path)
        self.vision = None

    def stops(self, stops: list) -> list:
        return chat.with_chat_stops(self.tok, stops) if self.template is not None else stops

    def prompt(self, sample: P.Sample, k: int, replies: list) -> tuple:
        """-> (prompt ids, vision.ImagePrompt or None) of turn k."""
        if sample.ids is not None:
            return sample.ids, None
        if self.tok is None:
            raise dflash.GenerationError(f"{self.target.path} has no tokenizer.json to encode the prompt sets")
        ids = P.conversation(sample, k, replies, self.tok, self.template, self.specials, self.thinking)
        if not sample.images:
            return ids, None
        import vision
        if self.vision is None:
            self.vision = vision.load_vision(self.target.path, self.dtype, self.device)
        images = vision.encode_images(*self.vision, ids, [vision.load_image(f) for f in sample.images])
        return images.ids, images

    def reply(self, output_ids: list) -> str:
        return self.tok.decode(output_ids, skip_special_tokens=True) if self.tok is not None else ""


# ---- the table ----------------------------------------------------------------------------------------

def table_main(args, device) -> dict:
    """--methods / --dataset: AR and every method on every set's prompts -> the table, printed (markdown), and with
    --out written with results.json and the plots; the last stdout line is the JSON."""
    from options import pick_dtype, pick_weights, products_words, use_products
    # the sets first: a set that cannot be read stops the run before the models load
    sets = [(P.set_label(n), P.select(P.load_set(n), args.limit or P.default_count(n))) for n in args.dataset or []]
    dtype = pick_dtype(args.dtype, device)
    weights = pick_weights(args.weight_dtype, dtype)                            # --weight-dtype, the drafters' too
    target = ckpt.load_target(args.target, dtype, device, weights)
    tok = ckpt.load_tokenizer(target.path)
    text = Text(target, tok, not args.no_think, dtype, device)
    methods = method_proposers(args, target, dtype, device, weights)
    widest = max(b for _, b in methods.values())
    # DFlash drafters (also inside a DFlashTree) take the products generate.py chooses; the MTP and EAGLE-3 heads keep nn.Linear
    inner = [p.inner if isinstance(p, tree.DFlashTree) else p for p, _ in methods.values()]
    drafters = [p.drafter if isinstance(p, engine.DrafterProposer) else None for p in inner]
    products = use_products(args.products, widest, target, *drafters)             # chosen at the widest block
    print(f"{products_words(products)}; {torch.get_num_threads()} threads; {cpu_model()}", flush=True)
    if not sets:                                              # --methods alone: tools/bench.py's own prompts, one column
        sets = [("heldout" if not (args.prompt or args.prompts) else "prompts",
                 [P.Sample(ids=ids) for ids in P.from_args(args, tok, target.path)][:args.limit])]
    runner = Runner(args, target, methods, text.stops(ckpt.stop_token_ids(target.path, target.cfg)))
    t0, results = time.perf_counter(), {}
    for label, samples in sets:
        results[label] = run_set(runner, samples, label, text)
        line = ", ".join(f"{name} tau {results[label][name].tau():.2f} speedup {speedup(results[label]['ar'], results[label][name]):.2f}x"
                         for name in methods)
        print(f"{label}: {len(results[label]['ar'].turns)} prompts; {line}", flush=True)
    out = summary(args, device, dtype, methods, results, products, time.perf_counter() - t0)
    md = markdown(out)
    print("\n" + md)
    wrong = sum(c["prompts"] - c["identical"] for m in out["methods"].values() for c in m["sets"].values())
    print(f"outputs identical to AR: {'all' if wrong == 0 else f'all but {wrong} (see identical in the JSON)'}")
    if args.out:
        write_out(args.out, out, md)
    print(json.dumps(out))
    return out


def summary(args, device, dtype, methods: dict, results: dict, products: dict, seconds: float) -> dict:
    """The raw numbers: per method, per set: tau, speedup, the acceptance histogram, prompts, identical outputs,
    tokens per second; and the Avg. over sets."""
    table = {}
    for name, (_, block) in methods.items():
        sets = {}
        for label, cells in results.items():
            c, ar = cells[name], cells["ar"]
            sets[label] = {"tau": c.tau(), "speedup": speedup(ar, c), "acceptance_histogram": c.histogram(block),
                           "prompts": len(c.turns), "identical": sum(t.identical for t in c.turns),
                           "tokens_per_s": sum(t.tokens for t in c.turns) / sum(t.seconds for t in c.turns),
                           "ar_tokens_per_s": sum(t.tokens for t in ar.turns) / sum(t.seconds for t in ar.turns)}
        table[name] = {"block_size": block, "sets": sets, "tau": statistics.mean(s["tau"] for s in sets.values()),
                       "speedup": statistics.mean(s["speedup"] for s in sets.values())}
    return {"mode": "table", "sets": list(results), "methods": table, "device": device, "cpu": cpu_model(),
            "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(), "limit": args.limit,
            "max_new_tokens": args.max_new_tokens, "repeat": args.repeat, "thinking": not args.no_think,
            "adaptive": not args.no_adaptive, "compile": bool(args.compile), "seconds": seconds, **products}


def markdown(out: dict) -> str:
    """The seeds' table: a row per method, a column per set and Avg., each cell "tau / speedup"."""
    sets = out["sets"]
    lines = ["| method | " + " | ".join(sets) + " | Avg. |", "|---" * (len(sets) + 2) + "|"]
    for name, m in out["methods"].items():
        cells = [f"{m['sets'][s]['tau']:.2f} / {m['sets'][s]['speedup']:.2f}x" for s in sets]
        label = (f"{name} (top-4 tree)" if name.startswith("dflash-tree") else f"{name} (tree of 16)" if name == "eagle3"
                 else f"{name} (block {m['block_size']})")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {m['tau']:.2f} / {m['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def write_out(folder: str, out: dict, md: str) -> None:
    """table.md, results.json and the plots into `folder`."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "table.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(folder, "results.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    written = plots(out, folder)
    print(f"wrote {folder}/table.md, results.json" + (f" and {len(written)} plots" if written else
          " (no plots: matplotlib is not installed; pip install matplotlib)"))


def plots(out: dict, folder: str) -> list:
    """PNG files: acceptance_SET.png (each method's acceptance-length histogram on that set, as fractions of its
    rounds) and speedup.png (speedup per method and set) -> their paths; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names, written = list(out["methods"]), []
    width = 0.8 / len(names)
    for s in out["sets"]:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for i, name in enumerate(names):
            hist = out["methods"][name]["sets"][s]["acceptance_histogram"]
            total = max(1, sum(hist))
            ax.bar([k + 1 + (i - (len(names) - 1) / 2) * width for k in range(len(hist))], [h / total for h in hist],
                   width, label=name)
        ax.set(xlabel="tokens committed per round", ylabel="fraction of rounds", title=f"acceptance lengths: {s}")
        ax.legend()
        written.append(_save(fig, plt, os.path.join(folder, f"acceptance_{s}.png")))
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 + 1.2 * len(out["sets"])), 3.5))
    for i, name in enumerate(names):
        ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(out["sets"]))],
               [out["methods"][name]["sets"][s]["speedup"] for s in out["sets"]], width, label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(out["sets"])), out["sets"])
    ax.set(ylabel="speedup over AR", title=f"speedup ({out['device']}, {out['dtype']})")
    ax.legend()
    written.append(_save(fig, plt, os.path.join(folder, "speedup.png")))
    return written


def _save(fig, plt, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
