#!/usr/bin/env bash
# GPU checks and benchmarks in one pass, sized for a short lease on one CUDA GPU (H100/H200 class).
#
#   bash benchmarks/gpu_suite.sh [OUTDIR]
#
# Runs, each stage time-boxed so one slow stage cannot starve the rest:
#   1. the GPU-marked tests (pytest -m gpu), in parallel when pytest-xdist is installed;
#   2. benchmarks/kernels.py --quick   (fused Triton kernels vs eager / Liger-Kernel);
#   3. benchmarks/hrr.py --device cuda (bind/unbind/superpose/cleanup vs NumPy and torchhd);
#   4. benchmarks/memory.py --quick    (checkpointing, planner, finder, FP8 vs bf16 on the GPU);
#   5. torchnitro optimize on the built-in lm and encoder (GPU recipes: fp16, bf16, CUDA graphs, compile).
# Result tables go to OUTDIR/results (TORCHNITRO_RESULTS), logs to OUTDIR/logs, and everything is
# re-packed into OUTDIR/gpu_suite.tgz after every stage, so a cut-off run still returns what it finished.
# Optional wheels in .whl/ (starlette, uvicorn, orjson, torch-hd, liger-kernel) are installed first
# into /tmp/site when the image lacks them.
set -u
OUTDIR="${1:-${OUT:-gpu_out}}"
mkdir -p "$OUTDIR/results" "$OUTDIR/logs"
export TORCHNITRO_RESULTS="$OUTDIR/results" PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TORCHNITRO_CACHE_DIR=/tmp/torchnitro-cache
PY=${PY:-python3}
T_TESTS=${T_TESTS:-150} T_KERNELS=${T_KERNELS:-110} T_HRR=${T_HRR:-60} T_MEMORY=${T_MEMORY:-80} T_OPT=${T_OPT:-90}
# STAGES picks and orders the stages; KERNEL_ARGS narrows the kernel benchmark (e.g. "--quick --ops fp8,linear").
STAGES=${STAGES:-"tests kernels hrr memory optimize"}
KERNEL_ARGS=${KERNEL_ARGS:-"--quick"}

pack() { tar czf "$OUTDIR/gpu_suite.tgz" -C "$OUTDIR" results logs 2>/dev/null; }
stage() {  # stage NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${secs}s): $*"
  timeout -k 5 "$secs" "$@" >"$OUTDIR/logs/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"
  tail -n "${TAIL:-25}" "$OUTDIR/logs/$name.log"
  pack
}

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  $PY -m torchnitro doctor
} >"$OUTDIR/logs/env.log" 2>&1
cat "$OUTDIR/logs/env.log" | head -40

XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n 8"
for st in $STAGES; do
  case $st in
    tests) stage tests "$T_TESTS" $PY -m pytest -q -m gpu $XDIST -p no:cacheprovider --timeout 120 tests ;;
    kernels) stage kernels "$T_KERNELS" $PY benchmarks/kernels.py $KERNEL_ARGS ;;
    hrr) stage hrr "$T_HRR" $PY benchmarks/hrr.py --device cuda --min-time 0.05 --max-time 0.5 ;;
    memory) stage memory "$T_MEMORY" $PY benchmarks/memory.py --quick ;;
    optimize)
      stage optimize "$T_OPT" $PY -m torchnitro optimize --model lm --budget 75 --out /tmp/opt-lm \
        -x compile-max-autotune -x onnxruntime -x onnxruntime-int8 -x int8-mixed
      cp /tmp/opt-lm/report.* "$OUTDIR/results/" 2>/dev/null ;;
    *) echo "unknown stage: $st (known: tests kernels hrr memory optimize)" ;;
  esac
done
pack
echo "=== done in ${SECONDS}s"
