"""A disaggregated cluster on one machine, for development: engine servers by role on loopback
ports, a front server whose engine groups are those servers, and the gateway in front of it.

    scripts/serve_cluster.sh --prefill 2 --decode 1          # front :8100, engines :8103 ...
    scripts/serve_cluster.sh --worker 2 --gateway-port 0

Each server is what `scripts/serve.sh --role ROLE` starts (launcher.ServerOptions). Engine
servers start first, then the front with their gRPC addresses (its front model calls them over
gRPC: front.remote), then the gateway. A server that dies is reported and started again on its
ports (launcher.RestartBudget per server); Ctrl-C stops the gateway, the front, then the rest.
The same plan, with free ports, is what the end-to-end tests start (tests/e2e/test_cluster.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from python_backends.config import API_KEY_ENV
from python_backends.ops.launcher import (
    GATEWAY_PORT,
    REMOTE_GROUP_ENVS,
    RestartBudget,
    ServerError,
    ServerOptions,
    TritonServer,
    serve_until_stopped,
)

ENGINE_ROLES = tuple(REMOTE_GROUP_ENVS)  # prefill, decode, worker


@dataclass(frozen=True)
class ClusterPlan:
    """How many engine servers of each role, and where. Server i listens on base_port + 3i
    (HTTP), + 1 (gRPC), + 2 (metrics); the front is server 0. `ports`, when given, picks each
    port instead (the tests' free ports)."""

    prefill: int = 1
    decode: int = 1
    worker: int = 0
    host: str = "127.0.0.1"
    base_port: int = 8100
    engine_dir: Path | None = None
    api_key: str | None = None
    log_dir: Path | None = None  # one log file per server; None: the servers' output here

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.worker) < 0:
            raise ServerError("server counts cannot be negative")
        if bool(self.prefill) != bool(self.decode):
            raise ServerError("a disaggregated cluster needs both --prefill and --decode")
        if not (self.prefill or self.worker):
            raise ServerError("no engine server: give --prefill and --decode, or --worker")

    def servers(self, ports: Callable[[], int] | None = None) -> list[ServerOptions]:
        """The engine servers' options, then the front's (last)."""
        numbered = iter(range(self.base_port, 65536))
        pick = ports or (lambda: next(numbered))
        front_ports = (pick(), pick(), pick())
        engines = [self._server(f"{role}-{i}", role, (pick(), pick(), pick()))
                   for role in ENGINE_ROLES for i in range(getattr(self, role))]
        groups = tuple(
            (role, ",".join(o.grpc_address for o in engines if o.role == role))
            for role in ENGINE_ROLES if getattr(self, role))
        front = replace(self._server("front", "front", front_ports), remote_groups=groups)
        return [*engines, front]

    def _server(self, name: str, role: str, ports: tuple[int, int, int]) -> ServerOptions:
        return ServerOptions(
            host=self.host, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2],
            engine_dir=self.engine_dir, api_key=self.api_key, role=role, exit_timeout_s=5,
            log_file=self.log_dir / f"{name}.log" if self.log_dir else None)


class Cluster:
    """The plan's servers, started and stopped together."""

    def __init__(self, servers: list[ServerOptions]) -> None:
        self.servers = [TritonServer(o) for o in servers]
        self._budgets = [RestartBudget() for _ in servers]

    @property
    def front(self) -> TritonServer:
        return self.servers[-1]

    def of_role(self, role: str) -> list[TritonServer]:
        return [s for s in self.servers if s.options.role == role]

    def start(self, timeout_s: float = 900.0, progress: bool = False) -> None:
        """Engine servers first (loading side by side), then the front; stops every server
        started when one fails to come up."""
        try:
            for server in self.servers[:-1]:
                server.start()
            for server in self.servers[:-1]:
                server.wait_ready(timeout_s, progress=progress)
            self.front.start()
            self.front.wait_ready(timeout_s, progress=progress)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for server in reversed(self.servers):  # the front first: no new engine work
            server.stop()

    def restart_dead(self) -> list[str]:
        """Start again each server that died (within its restart budget); what happened, one
        line per dead server."""
        notes = []
        for server, budget in zip(self.servers, self._budgets, strict=True):
            if server.process is None or server.process.poll() is None:
                continue
            o = server.options
            why = server.exit_reason()
            if budget.spend():
                server.restart()
                notes.append(f"{o.role} server :{o.grpc_port} died ({why}); restarted")
            else:
                server.process = None  # given up: not looked at again
                notes.append(f"{o.role} server :{o.grpc_port} died ({why}); died too often, "
                             "left down")
        return notes


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="A disaggregated cluster of Triton servers on "
                                             "this machine (development).")
    ap.add_argument("--prefill", type=int, default=1, help="prefill servers (1)")
    ap.add_argument("--decode", type=int, default=1, help="decode servers (1)")
    ap.add_argument("--worker", type=int, default=0, help="aggregated worker servers (0)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--base-port", type=int, default=8100,
                    help="the front's HTTP port; every server takes the next three ports")
    ap.add_argument("--engine", type=Path, default=None, help="engine directory")
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                    help="the key every server (and the gateway) requires")
    ap.add_argument("--gateway-port", type=int, default=GATEWAY_PORT, help="0: no gateway")
    ap.add_argument("--log-dir", type=Path, default=Path("cluster-logs"),
                    help="one log file per server (cluster-logs)")
    return ap


def _banner(cluster: Cluster, gateway_port: int) -> str:
    lines = ["", "[cluster] ready"]
    for server in cluster.servers:
        o = server.options
        lines.append(f"  {o.role:8} gRPC {o.grpc_address}  HTTP {o.http_url}  "
                     f"metrics {o.metrics_url}  log {o.log_file}")
    o = cluster.front.options
    if gateway_port:
        lines.append(f"  gateway  http://{o.host}:{gateway_port}/v1")
    lines += [f"  try: curl -s -X POST {o.http_url}/v2/models/ensemble/generate "
              "-d '{\"text_input\": \"The capital of France is\", \"max_tokens\": 16}'",
              "  Ctrl-C stops every server.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        plan = ClusterPlan(args.prefill, args.decode, args.worker, args.host, args.base_port,
                           args.engine, args.api_key, args.log_dir)
    except ServerError as e:
        print(f"[cluster] error: {e}", file=sys.stderr, flush=True)
        return 2
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(plan.servers())

    def start() -> ServerOptions:
        print(f"[cluster] starting {len(cluster.servers)} servers (logs in {args.log_dir}) ...",
              flush=True)
        cluster.start(progress=True)
        return cluster.front.options

    def watch() -> int:
        while True:
            for note in cluster.restart_dead():
                print(f"[cluster] {note}", flush=True)
            time.sleep(1.0)

    return serve_until_stopped("cluster", start, lambda: _banner(cluster, args.gateway_port),
                               watch, cluster.stop, args.gateway_port)


if __name__ == "__main__":
    sys.exit(main())
