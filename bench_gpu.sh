#!/usr/bin/env bash
# All GPU checks on one GPU, sized for one command of at most 10 minutes (the stages' limits add up to 490 s, 515 s
# with each one's 5 s grace to die), in stages that each run under their own `timeout`, with their stdout and
# stderr (tracebacks, inductor's "skipping cudagraphs" reasons) unbuffered in $OUT/<stage>.log:
#   smoke        (70 s) the tiny 9B-shaped preset (tiny-9b-shape; tiny-35b-a3b-shape for a 35B-A3B PRESET),
#                compiled like the full one: a torch or CUDA problem fails here in about a minute.
#   preset      (220 s) the real Qwen3.5-9B text shapes + a 5-layer block-16 drafter, random bf16 weights built on
#                the device, steps compiled with CUDA graphs (mode reduce-overhead: no autotuning), timed by
#                tools/bench.py --preset: AR's engine first, its decode step and bandwidth printed (and a JSON line of
#                its own) before the DFlash engine is built; then verify, draft and the PROJECTED tok/s.
#   bars         (15 s) the GPU bars, judged on the preset's last JSON line (presets.preset_summary). Each is derived
#                from the bytes of weights the steps read and the copy bandwidth the same run measured, and asks
#                75% of what those allow (presets.gpu_bars): decode bandwidth >= 75% of the copy bandwidth;
#                verify/decode <= its bytes ratio / 0.75; draft/verify <= its bytes ratio / 0.75; PROJECTED tok/s
#                >= 75% of tau / (a round's bytes / the bandwidth). Each bar prints with its derivation.
#   concurrency (115 s) the same preset at N = 1, 8, 32 requests in flight (CONCURRENCY; none skips it), AR measured,
#                DFlash projected; no bar. Same --max-new-tokens and --prompt-len as the preset, so N = 1 has its
#                cache capacity and inductor's on-disk cache serves its compiled steps (each row says how many).
#   gpu-tests    (70 s) tests/test_gpu.py: one host-device sync per draft-verify round, DFlash == AR on the GPU,
#                compiled steps replaying as CUDA graphs (inductor raises on any skip).
# A stage that fails or runs out of time is recorded and the next one runs; the summary at the end lists every
# stage (PASS, FAIL, TIMEOUT, SKIP) and every bar, in $OUT/summary.txt too; the exit code, given after every
# stage ran, is 1 when a stage failed or timed out (a missed bar fails the bars stage), else 0.
# Usage: bash bench_gpu.sh            (ATTENTION=flex bash bench_gpu.sh for the FlexAttention path;
#                                      MODE=max-autotune for autotuned kernels, slower to compile)
# The same script on a CPU, as tests/test_bench_preset.py runs it (no bars there: they are GPU bars):
#   DEVICE=cpu PRESET=tiny-9b-shape COMPILE=0 bash bench_gpu.sh
# (MAX_NEW=N and PROMPT_LEN=N shrink the timed generations: default 64 new tokens, and prompts of 512 tokens on
# CUDA, 64 on a CPU; the smoke stage takes at most 16 and 64. FAIL_STAGE=<stage> makes that stage fail on purpose,
# as the test does. PYTHON=... picks the interpreter: default python, else python3.)
# The JSON lines also go to ${OUT:-.}/bench_gpu_<attention>.json and bench_gpu_concurrency.json.
set -uo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONUNBUFFERED=1
ATTENTION=${ATTENTION:-sdpa}
MODE=${MODE:-reduce-overhead}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-qwen3.5-9b}
COMPILE=${COMPILE:-1}
OUTDIR=${OUT:-.}
MAX_NEW=${MAX_NEW:-64}
CONCURRENCY=${CONCURRENCY:-1,8,32}
FAIL_STAGE=${FAIL_STAGE:-}
GRACE=5                      # seconds a stage gets to die after its limit's SIGTERM, before SIGKILL
if [ -z "$PY" ]; then
    echo "bench_gpu.sh: neither python nor python3 is on PATH; name the interpreter with PYTHON=/path/to/python" >&2
    exit 2
fi
case $FAIL_STAGE in
    "" | smoke | preset | bars | concurrency | gpu-tests) ;;
    *) echo "bench_gpu.sh: FAIL_STAGE=$FAIL_STAGE names no stage (smoke, preset, bars, concurrency, gpu-tests)" >&2; exit 2 ;;
esac
mkdir -p "$OUTDIR"
if [ "$DEVICE" = cuda ]; then
    DTYPE=bfloat16 PROMPT_LEN=${PROMPT_LEN:-512}
else
    DTYPE=float32 PROMPT_LEN=${PROMPT_LEN:-64}
fi
case $PRESET in
    *35b*) SMOKE=tiny-35b-a3b-shape ;;
    *) SMOKE=tiny-9b-shape ;;
esac
FLAGS=()
[ "$COMPILE" = 1 ] && FLAGS=(--compile --compile-mode "$MODE")
RUN=(--random-weights --device "$DEVICE" --dtype "$DTYPE" "${FLAGS[@]}")
NAMES=() VERDICTS=()

stage() {   # stage NAME LIMIT COMMAND...: COMMAND under timeout LIMIT, its output in $OUTDIR/NAME.log; the verdict kept
    local name=$1 limit=$2 start=$SECONDS rc verdict
    shift 2
    if [ "$FAIL_STAGE" = "$name" ]; then
        set -- "$PY" -c "raise SystemExit('FAIL_STAGE=$name: this stage made to fail on purpose')"
    fi
    echo "== $name (limit $limit s): $*"
    timeout -k "$GRACE" "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
    rc=$?
    case $rc in
        0) verdict=PASS ;;
        124 | 137) verdict=TIMEOUT ;;
        *) verdict=FAIL ;;
    esac
    # pytest skipping every test (tests/test_gpu.py without CUDA) exits 0: SKIP, not PASS
    if [ $rc = 0 ] && grep -Eq '^[0-9]+ skipped(, [0-9]+ warnings?)? in ' "$OUTDIR/$name.log"; then
        verdict=SKIP
    fi
    grep -v '^{' "$OUTDIR/$name.log" | tail -n 20         # (the JSON lines are in the log and the .json files)
    echo "== $name: $verdict (exit $rc, $((SECONDS - start)) s, log $OUTDIR/$name.log)"
    NAMES+=("$name") VERDICTS+=("$verdict")
}

skip() {    # skip NAME REASON: a stage not run, its log saying why
    echo "not run: $2" > "$OUTDIR/$1.log"
    echo "== $1: SKIP ($2)"
    NAMES+=("$1") VERDICTS+=(SKIP)
}

last_json() {   # last_json LOG FILE: the log's last JSON line into FILE (nothing when it has none)
    grep '^{' "$1" | tail -n 1 > "$2" || rm -f "$2"
}

stage smoke 70 "$PY" tools/bench.py --preset "$SMOKE" "${RUN[@]}" --attention "$ATTENTION" \
    --max-new-tokens $(( MAX_NEW < 16 ? MAX_NEW : 16 )) --prompt-len $(( PROMPT_LEN < 64 ? PROMPT_LEN : 64 ))
stage preset 220 "$PY" tools/bench.py --preset "$PRESET" "${RUN[@]}" --attention "$ATTENTION" \
    --max-new-tokens "$MAX_NEW" --prompt-len "$PROMPT_LEN"
last_json "$OUTDIR/preset.log" "$OUTDIR/bench_gpu_$ATTENTION.json"
stage bars 15 "$PY" -c 'import sys; from tools import presets; sys.exit(presets.preset_summary(sys.argv[1]))' "$OUTDIR/preset.log"
# The preset's --max-new-tokens and --prompt-len: at N = 1 the same cache capacity, so the same compiled steps.
if [ "$ATTENTION" = sdpa ] && [ "$CONCURRENCY" != none ]; then
    stage concurrency 115 "$PY" tools/bench.py --preset "$PRESET" "${RUN[@]}" --max-new-tokens "$MAX_NEW" \
        --prompt-len "$PROMPT_LEN" --concurrency "$CONCURRENCY"
    last_json "$OUTDIR/concurrency.log" "$OUTDIR/bench_gpu_concurrency.json"
else
    skip concurrency "CONCURRENCY=none, or ATTENTION is not sdpa"
fi
stage gpu-tests 70 "$PY" -m pytest -q tests/test_gpu.py

failed=0
for verdict in "${VERDICTS[@]}"; do
    case $verdict in FAIL | TIMEOUT) failed=1 ;; esac
done
{
    echo "== summary ($PRESET on $DEVICE, attention $ATTENTION; logs in $OUTDIR)"
    for i in "${!NAMES[@]}"; do
        printf '  %-8s %s\n' "${VERDICTS[$i]}" "${NAMES[$i]}"
    done
    echo "bars:"
    sed 's/^/  /' "$OUTDIR/bars.log"            # the preset in a line, then each bar, its verdict and derivation
} | tee "$OUTDIR/summary.txt"
exit "$failed"
