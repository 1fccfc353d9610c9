#!/usr/bin/env bash
# Run the whole test suite (unit tests, then end-to-end tests against one real Triton server).
#   scripts/test.sh [pytest args]
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
ensure_aiperf  # for tests/e2e/test_aiperf.py
ensure_vllm  # vLLM's benchmark client, for tests/e2e/test_openai_api.py
cd "$ROOT"
"$PY" -m ruff check .
"$PY" -m mypy
"$VENV/bin/lint-imports" --no-cache --no-logo  # the import layering contracts in pyproject.toml
exec "$PY" -m pytest "$@"
