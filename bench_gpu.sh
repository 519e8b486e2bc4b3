#!/usr/bin/env bash
# All GPU checks of issue 4 on one GPU (sized for one H200, within 10 minutes):
#   the real Qwen3.5-9B text shapes + a 5-layer block-16 drafter, random bf16 weights built on the device,
#   steps compiled with CUDA graphs (mode reduce-overhead: no autotuning, so it compiles in minutes), timed by
#   bench.py --preset. Bars: AR decode >= 75% of the measured copy bandwidth, verify (16 tokens) <= 1.3x decode,
#   draft <= 15% of verify, PROJECTED DFlash tok/s at tau 5.60 >= 1000. First, tests/test_gpu.py: one host-device
#   sync per draft-verify round (torch.cuda.set_sync_debug_mode) and DFlash == AR on the GPU.
# Usage: bash bench_gpu.sh            (ATTENTION=flex bash bench_gpu.sh for the FlexAttention path;
#                                      MODE=max-autotune for autotuned kernels, slower to compile)
# The JSON lines go to ${OUT:-.}/bench_gpu_<attention>.json; the exit code is 1 when a bar is missed.
set -euo pipefail
cd "$(dirname "$0")"
ATTENTION=${ATTENTION:-sdpa}
MODE=${MODE:-reduce-overhead}
OUTDIR=${OUT:-.}
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
TESTS=PASS
timeout 120 python -m pytest -q tests/test_gpu.py 2>&1 | tee "$OUTDIR/test_gpu.log" || TESTS=FAIL
echo "  $TESTS  tests/test_gpu.py (one sync per round, DFlash == AR on the GPU)"
timeout 540 python bench.py --preset qwen3.5-9b --random-weights --device cuda --dtype bfloat16 \
    --compile --compile-mode "$MODE" --attention "$ATTENTION" --max-new-tokens 64 --prompt-len 512 \
    | tee "$OUTDIR/bench_gpu_$ATTENTION.log"
tail -n 1 "$OUTDIR/bench_gpu_$ATTENTION.log" > "$OUTDIR/bench_gpu_$ATTENTION.json"
python - "$OUTDIR/bench_gpu_$ATTENTION.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"decode {r['decode_ms']:.3f} ms = {r['achieved_gb_s']:.0f} GB/s = {r['bandwidth_fraction']:.1%} of {r['peak_copy_gb_s']:.0f} GB/s; "
      f"verify {r['verify_over_decode']:.2f}x decode; draft {r['draft_over_verify']:.1%} of verify; "
      f"PROJECTED {r['projected_dflash_tokens_per_s']:.0f} tok/s at tau {r['projected_tau']}; "
      f"max memory {r['max_memory_allocated_gb']:.1f} GB")
for bar, ok in r["bars"].items():
    print(f"  {'PASS' if ok else 'FAIL'}  {bar}")
sys.exit(0 if all(r["bars"].values()) else 1)
PY
[ "$TESTS" = PASS ]
