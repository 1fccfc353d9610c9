#!/usr/bin/env bash
# The GPU checks in one run, for a CUDA machine (the CPU suite skips them: `gpu` marker).
#   scripts/gpu_check.sh [OUT_DIR]        # default OUT_DIR: ./gpu-check (git-ignored)
#
# Needs python3 with a CUDA build of torch, transformers, safetensors, numpy and pytest (the
# lent H200 machine's image has them; nothing is installed here). Runs, with the output of
# each step in OUT_DIR:
#   1. nvidia-smi and what torch sees;
#   2. the engine on GPUs: tests/engine/test_cuda_engine.py (one GPU; TP/PP/EP over NCCL where
#      enough GPUs are visible, else skipped with the count needed) and the CUDA IPC handoff
#      between processes (tests/kv_transfer/test_gpu_transports.py);
#   3. scripts/bench_parallel.py --gpu on the layouts that fit the visible GPUs.
# Each step is bounded by STEP_TIMEOUT seconds (default 300): a hung step fails, the next runs.
# tests/e2e/test_gpu.py (the models as KIND_GPU instances in the Triton server) needs the full
# environment of scripts/setup_env.sh and the default engine: run it with scripts/test.sh -m gpu.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR=${1:-gpu-check}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the project need not be installed there
status=0

step() {  # step NAME COMMAND...: run, keep its output, remember a failure
    local name=$1
    shift
    echo "== $name: $*"
    local start=$SECONDS
    timeout "${STEP_TIMEOUT:-300}" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc in $((SECONDS - start)) s"
    [[ $rc == 0 ]] || status=1
}

step devices bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, \
torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.get_device_name(0))'"
step tests "$PY" -m pytest -p no:cacheprovider -q -rs -m gpu \
    tests/engine/test_cuda_engine.py tests/kv_transfer/test_gpu_transports.py
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
layouts=tp1,moe-ep1
(( gpus >= 2 )) && layouts+=,tp2,pp2,moe-ep2,moe-tp2-ep2
(( gpus >= 4 )) && layouts+=,tp4,tp2-pp2,moe-ep4
step bench "$PY" scripts/bench_parallel.py --gpu --layouts "$layouts" --decode-steps 32
echo "== gpu_check: $([[ $status == 0 ]] && echo passed || echo FAILED); logs in $OUT_DIR"
exit $status
