#!/usr/bin/env bash
# The GPU checks in one run, for a CUDA machine (the CPU suite skips them: `gpu` marker).
#   scripts/gpu_check.sh [OUT_DIR]        # default OUT_DIR: ./gpu-check (git-ignored)
#
# Needs python3 with a CUDA build of torch (Triton comes with it), transformers, safetensors,
# numpy and pytest (the lent H200 machine's image has them; nothing is installed here). NIXL's
# build for torch's CUDA, where a zip of it lies in NIXL_ZIP (default .whl/nixl.zip: a wheel of
# PyPI's nixl-cu13 for that machine's Python), is unpacked into a temporary folder first.
# Runs, with the output of each step in OUT_DIR:
#   1. nvidia-smi and what torch sees;
#   2. the engine on GPUs: tests/engine/test_cuda_engine.py (one GPU, CUDA graphs on and off;
#      TP/PP/EP over NCCL where enough GPUs are visible, else skipped with the count needed),
#      the Triton kernels compiled (attention, layer ops: tests/models/test_gpu_attention.py),
#      the CUDA IPC handoff and NIXL from GPU memory between processes
#      (tests/kv_transfer/test_gpu_transports.py);
#   3. NIXL over GPU memory step by step (agent, registration, metadata; bounded), and what
#      `kv_transports: auto` offers a GPU instance here;
#   4. scripts/bench_gpu.py: decode step times, graphs off and on, against the HBM roofline,
#      and the CUDA IPC handoff's bandwidth;
#   5. scripts/bench_parallel.py --gpu on the layouts that fit the visible GPUs.
# Each step is bounded by STEP_TIMEOUT seconds (default 240): a hung step fails, the next runs.
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
    timeout "${STEP_TIMEOUT:-240}" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc in $((SECONDS - start)) s"
    [[ $rc == 0 ]] || status=1
}

NIXL_ZIP=${NIXL_ZIP:-.whl/nixl.zip}
if [[ -f $NIXL_ZIP ]]; then
    site=$(mktemp -d)
    "$PY" -m zipfile -e "$NIXL_ZIP" "$site" && export PYTHONPATH="$PYTHONPATH:$site"
fi

step devices bash -c "nvidia-smi; $PY -c 'import torch, triton; print(torch.__version__, \
torch.version.cuda, triton.__version__, torch.cuda.is_available(), torch.cuda.device_count(), \
torch.cuda.get_device_name(0))'"
step tests "$PY" -m pytest -p no:cacheprovider -q -rs -m gpu \
    tests/engine/test_cuda_engine.py tests/kv_transfer/test_gpu_transports.py
step kernels "$PY" -m pytest -p no:cacheprovider -q -rs tests/models/test_gpu_attention.py
step nixl timeout 60 "$PY" - <<'PY'
import time, torch
from python_backends.kv_transfer import nixl
print("nixl build:", nixl.build(), "| torch CUDA:", torch.version.cuda,
      "| GPU memory offered by auto:", nixl.vram_problem() or "yes", flush=True)
api = nixl._api()
if api is not None:
    t = time.perf_counter()
    agent = api.nixl_agent("probe", api.nixl_agent_config(enable_prog_thread=False))
    print(f"agent created in {time.perf_counter() - t:.2f} s", flush=True)
    pool = torch.zeros(1 << 24, device="cuda")
    t = time.perf_counter()
    reg = agent.register_memory(pool)
    print(f"64 MiB of GPU memory registered in {time.perf_counter() - t:.2f} s", flush=True)
    print(f"metadata: {len(agent.get_agent_metadata())} bytes", flush=True)
    agent.deregister_memory(reg)
PY
step bench_gpu "$PY" scripts/bench_gpu.py
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
layouts=tp1,moe-ep1
(( gpus >= 2 )) && layouts+=,tp2,pp2,moe-ep2,moe-tp2-ep2
(( gpus >= 4 )) && layouts+=,tp4,tp2-pp2,moe-ep4
step bench "$PY" scripts/bench_parallel.py --gpu --layouts "$layouts" --decode-steps 32
echo "== gpu_check: $([[ $status == 0 ]] && echo passed || echo FAILED); logs in $OUT_DIR"
exit $status
