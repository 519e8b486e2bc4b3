#!/usr/bin/env bash
# All GPU checks on one GPU (sized for one H200, within 10 minutes):
#   the real Qwen3.5-9B text shapes + a 5-layer block-16 drafter, random bf16 weights built on the device,
#   steps compiled with CUDA graphs (mode reduce-overhead: no autotuning, so it compiles in minutes), timed by
#   bench.py --preset. Bars: AR decode >= 75% of the measured copy bandwidth, verify (16 tokens) <= 1.3x decode,
#   draft <= 15% of verify, PROJECTED DFlash tok/s at tau 5.60 >= 1000. First, tests/test_gpu.py: one host-device
#   sync per draft-verify round (torch.cuda.set_sync_debug_mode), DFlash == AR on the GPU, and compiled steps
#   replaying as CUDA graphs (inductor raises on any skip).
# Usage: bash bench_gpu.sh            (ATTENTION=flex bash bench_gpu.sh for the FlexAttention path;
#                                      MODE=max-autotune for autotuned kernels, slower to compile)
# The same script on a CPU, as tests/test_bench_preset.py runs it (no bars there: they are GPU bars):
#   DEVICE=cpu PRESET=tiny-9b-shape COMPILE=0 bash bench_gpu.sh
# (MAX_NEW=N and PROMPT_LEN=N shrink the timed generations: default 64 new tokens, 32 in the concurrency table, and
# prompts of 512 tokens on CUDA, 64 on a CPU; the test sets them small, since it checks the script, not the numbers.)
# Then the concurrency table of the same preset (CONCURRENCY=1,8,32; none skips it).
# The JSON lines go to ${OUT:-.}/bench_gpu_<attention>.json and bench_gpu_concurrency.json; the exit code is 1
# when a bar is missed.
set -euo pipefail
cd "$(dirname "$0")"
ATTENTION=${ATTENTION:-sdpa}
MODE=${MODE:-reduce-overhead}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-qwen3.5-9b}
COMPILE=${COMPILE:-1}
OUTDIR=${OUT:-.}
MAX_NEW=${MAX_NEW:-64}
if [ "$DEVICE" = cuda ]; then
    DTYPE=bfloat16 PROMPT_LEN=${PROMPT_LEN:-512}
    nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
    TESTS=PASS
    timeout 180 python -m pytest -q tests/test_gpu.py 2>&1 | tee "$OUTDIR/test_gpu.log" || TESTS=FAIL
    echo "  $TESTS  tests/test_gpu.py (one sync per round, DFlash == AR on the GPU)"
else
    DTYPE=float32 PROMPT_LEN=${PROMPT_LEN:-64} TESTS=PASS
    echo "  SKIP  tests/test_gpu.py (needs CUDA)"
fi
FLAGS=()
[ "$COMPILE" = 1 ] && FLAGS=(--compile --compile-mode "$MODE")
timeout 390 python bench.py --preset "$PRESET" --random-weights --device "$DEVICE" --dtype "$DTYPE" \
    "${FLAGS[@]}" --attention "$ATTENTION" --max-new-tokens "$MAX_NEW" --prompt-len "$PROMPT_LEN" \
    | tee "$OUTDIR/bench_gpu_$ATTENTION.log"
tail -n 1 "$OUTDIR/bench_gpu_$ATTENTION.log" > "$OUTDIR/bench_gpu_$ATTENTION.json"
python -c 'import presets, sys; sys.exit(presets.preset_summary(sys.argv[1]))' "$OUTDIR/bench_gpu_$ATTENTION.json"
# Many requests in flight (batching.py): the preset's decode step and DFlash round at N = 1, 8, 32 (CONCURRENCY),
# AR tok/s measured, DFlash tok/s projected at tau 5.60; no bar, a table. Its own time limit: a miss loses only it.
CONCURRENCY=${CONCURRENCY:-1,8,32}
if [ "$ATTENTION" = sdpa ] && [ "$CONCURRENCY" != none ]; then
    timeout 240 python bench.py --preset "$PRESET" --random-weights --device "$DEVICE" --dtype "$DTYPE" \
        "${FLAGS[@]}" --max-new-tokens $(( (MAX_NEW + 1) / 2 )) --prompt-len "$PROMPT_LEN" --concurrency "$CONCURRENCY" \
        | tee "$OUTDIR/bench_gpu_concurrency.log" || echo "  FAIL  --concurrency $CONCURRENCY (time limit or error)"
    tail -n 1 "$OUTDIR/bench_gpu_concurrency.log" > "$OUTDIR/bench_gpu_concurrency.json"
fi
[ "$TESTS" = PASS ]
