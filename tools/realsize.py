#!/usr/bin/env python3
"""Real checkpoint sizes on this machine: random weights at the real Qwen3.5 shapes, written in the published
sharded format, then loaded, generated from and checked the way a user runs them, each under /usr/bin/time.

    python tools/realsize.py write qwen3.5-4b DIR        # bfloat16 shards, one per layer (checkpoint.save_target_in_parts)
    python tools/realsize.py measure DIR [DIR ...] [--prompt-len 900] [--new-tokens 100] [--weight-dtypes auto,float32]

`write` builds the target of a tools/presets.py preset one layer at a time (never the whole model: a 9B target is
18 GB of bfloat16) and writes it where `generate.py --target DIR` and `check.py --target DIR` read it.

`measure`, per checkpoint: for each --weight-dtypes entry, `generate.py --target DIR --draft none --prompt-ids
<prompt-len random ids> --max-new-tokens N --json --weight-dtype W` (float32 arithmetic, eager) under `/usr/bin/time
-v`: its load seconds, decode tokens/s and peak RSS (a run the memory check refuses is reported with its one line);
the runs' tokens must be equal. Then `check.py --target DIR TRACE --json` on the first run's output (a trace as it
is: prompt + output, prompt-len + N tokens, judged in one teacher-forced forward): seconds, peak RSS and verdict.
Prints one markdown table, then one JSON line. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def write(name: str, out: str) -> None:
    """The preset's random target, bfloat16, one shard per part (presets.random_target_parts)."""
    import torch
    import checkpoint as ckpt
    from tools import presets
    os.makedirs(out, exist_ok=True)
    cfg, _ = presets.preset_configs(name)
    t0 = time.perf_counter()
    ckpt.save_target_in_parts(cfg, presets.random_target_parts(name, torch.bfloat16), out, torch.bfloat16)
    print(f"wrote {name} to {out}: {file_gb(out):.2f} GB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def timed(cmd: list) -> tuple:
    """cmd under /usr/bin/time -v -> (returncode, stdout, stderr, wall seconds, peak RSS in GB)."""
    t0 = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    own = re.split(r"\n(?:Command exited with non-zero status \d+\n)?\tCommand being timed", done.stderr)[0]   # the command's stderr
    return done.returncode, done.stdout, own, wall, int(m.group(1)) / 1e6 if m else None


def last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def file_gb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")) / 1e9


def measure(path: str, args) -> dict:
    """One checkpoint's runs (the module docstring): -> a dict of its numbers."""
    with open(os.path.join(path, "config.json")) as fh:
        vocab = json.load(fh)["vocab_size"]
    ids = [random.Random(0).randrange(vocab) for _ in range(args.prompt_len)]
    row = {"checkpoint": path, "file_gb": round(file_gb(path), 2), "runs": {}}
    trace, outputs = None, {}
    for w in args.weight_dtypes:
        print(f"{path}: generate.py --weight-dtype {w}", file=sys.stderr)
        rc, out, err, wall, rss = timed([sys.executable, "generate.py", "--target", path, "--draft", "none",
                                         "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens",
                                         str(args.new_tokens), "--json", "--weight-dtype", w, "--threads",
                                         str(args.threads)])
        got = last_json(out) if rc == 0 else None
        run = {"returncode": rc, "wall_s": round(wall, 1), "peak_rss_gb": rss and round(rss, 2)}
        if got is None:
            run["error"] = (err.strip().splitlines() or ["?"])[-1][:300]
        else:
            run.update(load_s=round(got["load_seconds"], 1), decode_tok_s=round(got["decode_tokens_per_s"], 3),
                       dtype=got["dtype"], weight_dtype=got["weight_dtype"])
            outputs[w] = got["output_ids"]
            if trace is None:
                trace = got
        row["runs"][w] = run
    row["tokens_equal"] = len(set(map(tuple, outputs.values()))) <= 1 if outputs else None
    if trace is not None and not args.no_check:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump({k: trace[k] for k in ("prompt_ids", "output_ids", "dtype")}, fh)
        print(f"{path}: check.py on its {len(trace['prompt_ids']) + len(trace['output_ids'])}-token trace", file=sys.stderr)
        rc, out, err, wall, rss = timed([sys.executable, "check.py", "--target", path, fh.name, "--json"])
        os.unlink(fh.name)
        verdict = last_json(out) if out.strip() else None
        row["check"] = {"returncode": rc, "wall_s": round(wall, 1), "peak_rss_gb": rss and round(rss, 2),
                        "verdicts": verdict.get("verdicts") if isinstance(verdict, dict) else None,
                        "error": None if rc in (0, 1) else (err.strip().splitlines() or ["?"])[-1][:300]}
    return row


def table(rows: list, weight_dtypes: list) -> str:
    head = ["checkpoint", "file GB"]
    for w in weight_dtypes:
        head += [f"{w}: load s", f"{w}: peak RSS GB", f"{w}: decode tok/s"]
    head += ["tokens equal", "check.py s", "check.py peak RSS GB", "check.py verdicts"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [os.path.basename(r["checkpoint"].rstrip("/")), f"{r['file_gb']:.2f}"]
        for w in weight_dtypes:
            run = r["runs"][w]
            if "error" in run:
                cells += [run["error"][:80], f"{run['peak_rss_gb']}", "-"]
            else:
                cells += [f"{run['load_s']}", f"{run['peak_rss_gb']}", f"{run['decode_tok_s']}"]
        c = r.get("check") or {}
        cells += [str(r["tokens_equal"]), str(c.get("wall_s", "-")), str(c.get("peak_rss_gb", "-")),
                  json.dumps(c.get("verdicts")) if c.get("verdicts") else (c.get("error") or "-")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write a preset's random target as a sharded bfloat16 checkpoint")
    from tools.presets import PRESETS
    w.add_argument("preset", choices=PRESETS)
    w.add_argument("out")
    m = sub.add_parser("measure", help="load, generate and check each checkpoint under /usr/bin/time")
    m.add_argument("paths", nargs="+")
    m.add_argument("--prompt-len", type=int, default=900)
    m.add_argument("--new-tokens", type=int, default=100)
    m.add_argument("--weight-dtypes", type=lambda s: s.split(","), default=["auto", "float32"])
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--no-check", action="store_true", help="skip check.py")
    args = p.parse_args(argv)
    if args.cmd == "write":
        write(args.preset, args.out)
        return 0
    rows = [measure(path, args) for path in args.paths]
    print(table(rows, args.weight_dtypes))
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
