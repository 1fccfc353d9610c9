"""`python -m python_backends.gateway`: serve the gateway (scripts/serve.sh starts it beside the
Triton server it starts; docs/gateway.md)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

from python_backends.gateway.config import (
    DEFAULT_PORT,
    PIPELINES,
    BackendConfig,
    ConfigError,
    GatewayConfig,
)
from python_backends.wire import DEFAULT_TENANT

KEY_ENV = "LLM_API_KEY"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m python_backends.gateway", description=__doc__)
    p.add_argument("--config", type=Path, help="a JSON configuration file (docs/gateway.md)")
    p.add_argument("--backend", action="append", default=[], metavar="GRPC,METRICS_URL",
                   help="a Triton server, without --config (repeatable)")
    p.add_argument("--engine", type=Path, help="engine directory (its tokenizer)")
    p.add_argument("--model", default="smollm2", help="the model name clients use (smollm2)")
    p.add_argument("--pipeline", choices=PIPELINES,
                   help="how requests enter a server (the config's `pipeline`; default front)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> GatewayConfig:
    """--config, or one server per --backend. Without --config, an API key in LLM_API_KEY
    (scripts/serve.sh --api-key) is both what clients must send and the servers' key."""
    if args.config:
        config = GatewayConfig.load(args.config)
    else:
        key = os.environ.get(KEY_ENV) or None
        backends = []
        for i, spec in enumerate(args.backend):
            grpc, _, metrics = spec.partition(",")
            backends.append(BackendConfig(name=f"server-{i}", grpc=grpc, metrics=metrics,
                                          api_key=key))
        config = GatewayConfig(backends=tuple(backends), model=args.model,
                               api_keys={key: DEFAULT_TENANT} if key else {})
    if args.engine:
        config = dataclasses.replace(config, engine_dir=args.engine)
    if args.pipeline:
        config = dataclasses.replace(config, pipeline=args.pipeline)
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[gateway] %(message)s")
    try:
        config = load_config(args)
    except ConfigError as e:
        print(f"gateway: bad configuration: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from python_backends.gateway.app import create_app

    print(f"[gateway] serving '{config.model}' from {len(config.backends)} server(s) on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(create_app(config), host=args.host, port=args.port, http="httptools",
                log_level=args.log_level.lower(), access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
