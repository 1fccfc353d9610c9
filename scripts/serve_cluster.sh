#!/usr/bin/env bash
# A disaggregated cluster of Triton servers on this machine, for development (docs/cluster.md):
#
#   scripts/serve_cluster.sh [--prefill N] [--decode N] [--worker N] [--base-port P]
#                            [--engine DIR] [--api-key KEY] [--gateway-port P] [--log-dir DIR]
#
# Engine servers by role (scripts/serve.sh --role ...), a front server calling them over gRPC,
# and the gateway; one log per server in --log-dir. Ctrl-C stops every server.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec "$PY" -m python_backends.ops.cluster "$@"
