#!/usr/bin/env python3
"""Stress the front's stub the way that used to kill it under Triton 2.51's Python backend.

Each round reloads the `worker` model (onto a copy of the engine with a batch of 8), opens
--streams streaming requests, lets them run a few seconds, closes them (the server sees client
cancellations) and reloads the worker with its original config. Stops at the first stub death
the launcher's watchdog reports (it restarts the model) or after --seconds, and prints the
server-log lines about it. Before `python_backends/serving/bls.py` (see its docstring for the
cause: BLS iterators freed without the GIL), the front's stub died here with `double free or
corruption (fasttop)` or `malloc_consolidate(): unaligned fastbin chunk detected` after 1 to 22
rounds of 16 streams on the 2-core development machine.

    python scripts/stress_stub_crash.py [--seconds 900] [--streams 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from python_backends.bench.client import LLMClient
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.engine.builder import engine_variant
from python_backends.net import free_port
from python_backends.ops.launcher import ServerOptions, TritonServer

sys.path.insert(0, str(Path(__file__).parent))
from bench_scheduling_server import WORD, Streams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", type=Path, default=DEFAULT_ENGINE_DIR)
    ap.add_argument("--seconds", type=float, default=900)
    ap.add_argument("--streams", type=int, default=16)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        batch8 = engine_variant(args.engine, root / "batch8", max_num_seqs=8)
        log = root / "triton.log"
        opts = ServerOptions(http_port=free_port(), grpc_port=free_port(),
                             metrics_port=free_port(), engine_dir=args.engine, log_file=log)
        with TritonServer(opts) as server:
            server.wait_ready(progress=True)
            assert server.watchdog is not None
            client = LLMClient(opts.http_url, timeout=60)
            repo = opts.repository()
            start, rounds = time.monotonic(), 0
            while time.monotonic() - start < args.seconds and not server.watchdog.restarts:
                rounds += 1
                with repo.reloaded("worker", engine_dir=str(batch8)):
                    streams = Streams(client)
                    for k in range(args.streams):
                        streams.start(f"s{k}", WORD * 128, 200)
                    time.sleep(3.0)
                    streams.close()  # every stream cancelled by its client
                print(f"[stress] round {rounds} ({rounds * args.streams} streams cancelled)",
                      flush=True)
            time.sleep(5.0)  # the watchdog's reload lines
            log_lines = log.read_text(errors="replace").splitlines()
            first = next((i for i, line in enumerate(log_lines) if "[watchdog]" in line), None)
            # What the stub printed as it died is on the lines just before the watchdog's.
            lines = [] if first is None else log_lines[max(0, first - 4):first + 8]
        if not lines:
            print(f"[stress] no stub died in {rounds} rounds")
            return 0
        print(f"[stress] a stub died during round {rounds}:", *lines, sep="\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
