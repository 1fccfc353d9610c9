#!/usr/bin/env bash
# Serve the model repository with a real Triton Inference Server on 127.0.0.1.
#
#   scripts/serve.sh [--host H] [--http-port P] [--grpc-port P] [--metrics-port P]
#                    [--engine DIR] [--model-repository DIR] [--api-key KEY]
#                    [--model-control explicit|none] [-- extra tritonserver args]
#
# Creates the environment and builds the default engine when missing, waits until the models
# are ready, prints the endpoints and a curl example, and stops cleanly on Ctrl-C / SIGTERM.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec "$PY" -m python_backends.ops.launcher "$@"
