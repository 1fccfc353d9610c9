#!/usr/bin/env python3
"""Autoscale a running server's instance groups from its metrics
(see python_backends/ops/autoscaler).

Every --interval seconds it scrapes Triton's metrics endpoint, computes TTFT/TPOT P95 from
histogram deltas over the sliding --window, and resizes the worker, prefill and decode groups
through the model-repository API (start the server with `scripts/serve.sh --model-control
explicit`). Every decision is logged with its reason and counted on this command's own metrics
endpoint (--metrics-port) as llm_autoscaler_decisions_total{group, direction}.

    python scripts/autoscaler.py --dry-run                 # log what it would do
    python scripts/autoscaler.py --ttft-p95 0.2 --tpot-p95 0.05 --max-instances 4
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from python_backends.ops.autoscaler import Autoscaler, Controller, Policy
from python_backends.ops.repository import TritonRepository


def serve_metrics(controller: Controller, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = controller.exposition().encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body if self.path == "/metrics" else b"")

        def log_message(self, *_args: object) -> None:
            return None

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="Triton HTTP endpoint")
    ap.add_argument("--grpc-url", default="127.0.0.1:8001",
                    help="Triton gRPC endpoint (models are reloaded through it)")
    ap.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    ap.add_argument("--api-key", default=os.environ.get("LLM_API_KEY"),
                    help="the server's --api-key, if it has one")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between evaluations")
    ap.add_argument("--window", type=float, default=60.0, help="sliding window, seconds")
    ap.add_argument("--ttft-p95", type=float, default=0.2, help="seconds; above: scale prefill")
    ap.add_argument("--tpot-p95", type=float, default=0.05, help="seconds; above: scale decode")
    ap.add_argument("--kv-usage", type=float, default=0.8, help="0-1; above: scale that pool")
    ap.add_argument("--idle-fraction", type=float, default=0.3,
                    help="0-1; queue empty and instances idle more than this: scale down")
    ap.add_argument("--scale-up-cooldown", type=float, default=60.0)
    ap.add_argument("--scale-down-cooldown", type=float, default=300.0)
    ap.add_argument("--min-instances", type=int, default=1)
    ap.add_argument("--max-instances", type=int, default=4)
    ap.add_argument("--bounds", default="{}",
                    help='per-group bounds as JSON, e.g. {"prefill": [1, 3]}')
    ap.add_argument("--dry-run", action="store_true", help="log decisions, change nothing")
    ap.add_argument("--metrics-host", default="127.0.0.1")
    ap.add_argument("--metrics-port", type=int, default=9402, help="0: no endpoint")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [autoscaler] %(message)s")
    policy = Policy(
        ttft_p95_s=args.ttft_p95, tpot_p95_s=args.tpot_p95, kv_usage=args.kv_usage,
        idle_fraction=args.idle_fraction, window_s=args.window,
        scale_up_cooldown_s=args.scale_up_cooldown, scale_down_cooldown_s=args.scale_down_cooldown,
        min_instances=args.min_instances, max_instances=args.max_instances,
        bounds={g: (int(lo), int(hi)) for g, (lo, hi) in json.loads(args.bounds).items()},
    )
    repo = TritonRepository(args.url, args.grpc_url, api_key=args.api_key)
    controller = Controller(Autoscaler(policy), repo, args.metrics_url, dry_run=args.dry_run)
    if args.metrics_port:
        serve_metrics(controller, args.metrics_host, args.metrics_port)
    controller.refresh_counts()
    logging.info("groups %s; policy %s%s", controller.counts, policy,
                 " (dry run)" if args.dry_run else "")
    try:
        while True:
            try:
                controller.tick()
            except Exception:  # a restarting server must not end the autoscaler
                logging.exception("evaluation failed; retrying")
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
