#!/usr/bin/env bash
# The GPU checks of docs/gpu-results.md, one phase per call, logs under $OUT (default ./gpu-out).
# Run from the repository root: bash scripts/gpu/run_all.sh 1   (then 2). On a CPU the steps run as smoke tests.
#   phase 1: the CUDA test of tests/test_formats.py, hardware_checks.py, doctor / autoconfig / env overrides
#   phase 2: benchmarks/predict.py (speed model vs measurement), tf32lab check --target native vs h100
#   phase 3: more kernels probed, the emulation with ties-to-even operands, solvers, env overrides, fixed costs
#   phase 4: a Policy on CUDA (pinned backward, torch.compile), the compile cache's warm start on CUDA
#   phase 5: the checks docs/gpu-results.md listed as waiting (pending_checks.py), check of two models on the GPU
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
phase=${1:-1}

step() {  # step LOG SECONDS COMMAND...: run one step, its output appended to $OUT/LOG, never stopping the phase
    local log=$1 limit=$2
    shift 2
    echo "\$ $*" >>"$OUT/$log"
    local started=$SECONDS
    timeout "$limit" "$@" >>"$OUT/$log" 2>&1
    echo "[exit $?, $((SECONDS - started)) s]" >>"$OUT/$log"
}

if [ "$phase" = 1 ]; then
    {
        date -u
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv || true
        $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn',
torch.backends.cudnn.version(), torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU',
torch.cuda.get_device_capability() if torch.cuda.is_available() else '')"
    } >"$OUT/info.log" 2>&1
    step info.log 120 $PY -m pytest -p no:cacheprovider -q -rA tests/test_formats.py::test_same_bits_on_cuda
    step checks.log 420 $PY scripts/gpu/hardware_checks.py --json "$OUT/checks.json"
    step env.log 60 $PY -m tf32lab.cli doctor
    step env.log 60 $PY -m tf32lab.cli doctor --json
    step env.log 120 $PY scripts/gpu/env_checks.py
elif [ "$phase" = 3 ]; then  # follow-ups: more kernels probed, the emulation with RNE, linalg, fixed costs
    step checks3.log 300 $PY scripts/gpu/hardware_checks.py --sections kernels,emu_rounding,linalg \
        --json "$OUT/checks3.json"
    step env3.log 120 $PY scripts/gpu/env_checks.py
    step speed3.log 120 $PY scripts/gpu/speed_overhead.py
elif [ "$phase" = 5 ]; then  # what docs/gpu-results.md listed as waiting (2026-11-30), and check on the GPU
    step pending5.log 300 $PY scripts/gpu/pending_checks.py --json "$OUT/pending5.json"
    for target in native h200 a100; do
        step check5.log 60 $PY -m tf32lab.cli check scripts/gpu/covariance_spec.py:cuda --target "$target" \
            --levels highest,high --no-speed
    done
    step check5.log 150 $PY -m tf32lab.cli check scripts/gpu/training_spec.py:encoder_cuda --train --target h200 \
        --levels highest,high --steps 5
elif [ "$phase" = 4 ]; then  # a Policy on CUDA: pinned backward in autograd's device threads, torch.compile
    step policy4.log 200 $PY scripts/gpu/policy_checks.py
    step compile4.log 380 $PY scripts/gpu/compile_cache_cuda.py
else
    step predict.log 330 $PY benchmarks/predict.py --skip-cost --rounds 5
    step check.log 120 $PY -m tf32lab.cli check scripts/gpu/minilm_spec.py:cuda --target native \
        --levels highest,high --json "$OUT/check_native.json"
    step check.log 240 $PY -m tf32lab.cli check scripts/gpu/minilm_spec.py:cpu --target h100 \
        --levels highest,high --json "$OUT/check_h100.json"
fi
