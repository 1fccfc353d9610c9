"""The peer benchmark's whole matrix, and its verdict against the speed targets.

One cell is a client (aiperf in its plain concurrency mode, or vLLM's `vllm bench serve`), a
dataset (chat or synthetic) and one of the engine's CPU paths (models/cpu_isa.py), measured by
scripts/bench_sweep.py against vLLM-CPU at each concurrency. The targets, as ratios of ours to
the peer's in the same sweep (the median over its rounds):

- output tok/s at least 2x, at every level on the CPU's best path, at 8 and 32 on a capped one;
- on the best path, TTFT p95 at most 0.5x at 8 and 32, and ITL p50 at most 0.5x at 1.

`checks` reads the cells from the rows themselves (each records its client, dataset and path),
so results of any sweeps, run here or earlier, can be judged together.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CLIENTS = ("aiperf", "vllm")
# How bench_sweep's rows name each client (its `client` field).
CLIENT_LABELS = {"aiperf": "aiperf", "vllm": "vllm bench serve"}
DATASETS = ("chat", "synthetic")
PEER = "vllm-cpu"  # bench_sweep's name for the peer it starts; ours is the other target


Ratios = tuple[float, float, float]  # ours / the peer's: throughput, TTFT p95, ITL p50


@dataclass(frozen=True)
class Target:
    ratio: int  # which of Ratios
    label: str
    limit: float
    at_least: bool  # the ratio must be >= limit (else <=)
    best_levels: tuple[int, ...] | None  # judged on the CPU's best path (None: every level)
    capped_levels: tuple[int, ...] = ()  # and on a path below it


TARGETS = (
    Target(0, "tok/s", 2.0, True, None, (8, 32)),
    Target(1, "TTFT p95", 0.5, False, (8, 32)),
    Target(2, "ITL p50", 0.5, False, (1,)),
)


@dataclass(frozen=True)
class Cell:
    client: str  # as the rows record it: "aiperf" or "vllm bench serve"
    dataset: str
    path: str  # the engine's CPU path: amx, avx512_bf16, avx512, avx2


@dataclass(frozen=True)
class Check:
    cell: Cell
    concurrency: int
    label: str
    ratio: float
    limit: float
    at_least: bool

    @property
    def ok(self) -> bool:
        return self.ratio >= self.limit if self.at_least else self.ratio <= self.limit

    def line(self) -> str:
        sign = ">=" if self.at_least else "<="
        return (f"{'ok  ' if self.ok else 'MISS'} {self.cell.client:<17}{self.cell.dataset:<10}"
                f"{self.cell.path:<12}c{self.concurrency:<4}{self.label:<9}"
                f"{self.ratio:6.2f}x  (target {sign} {self.limit:g}x)")


def path_of(row: dict[str, Any]) -> str:
    """The path name of a row's `cpu_path` ("amx (AMX tiles)" -> "amx")."""
    return str(row.get("cpu_path", "")).split(" ", 1)[0] or "unknown"


def cell_of(row: dict[str, Any]) -> Cell:
    return Cell(str(row.get("client", "")), str(row.get("dataset", "")), path_of(row))


def round_ratios(rows: Sequence[dict[str, Any]], ours: str, peer: str
                 ) -> dict[tuple[int, int], Ratios]:
    """(round, concurrency) -> our figures over the peer's of the same round and level."""
    theirs = {(r["round"], r["concurrency"]): r for r in rows if r["target"] == peer}
    out: dict[tuple[int, int], Ratios] = {}
    for r in rows:
        p = theirs.get((r["round"], r["concurrency"]))
        if r["target"] != ours or p is None:
            continue
        out[(r["round"], r["concurrency"])] = (
            r["output_tokens_per_s"] / p["output_tokens_per_s"],
            r["ttft_p95_ms"] / p["ttft_p95_ms"], r["itl_p50_ms"] / p["itl_p50_ms"])
    return out


def median_ratios(ratios: dict[tuple[int, int], Ratios]
                  ) -> dict[int, tuple[float, float, float, int]]:
    """Concurrency -> each ratio's median over the rounds, and how many rounds: on a shared
    machine one round's baseline can move a ratio by a tenth (docs/benchmarks.md)."""
    by_level: dict[int, list[Ratios]] = {}
    for (_, c), one in ratios.items():
        by_level.setdefault(c, []).append(one)
    out: dict[int, tuple[float, float, float, int]] = {}
    for c, rounds in by_level.items():
        throughput, ttft, itl = (statistics.median(v[i] for v in rounds) for i in range(3))
        out[c] = (throughput, ttft, itl, len(rounds))
    return out


def checks(rows: Sequence[dict[str, Any]], best_path: str) -> list[Check]:
    """Every target that applies to the cells and levels in `rows` (bench_sweep's, ours against
    vLLM-CPU), judged on each ratio's median over the rounds; `best_path`: the CPU's best
    (models.cpu_isa.available()[0]), where every target applies."""
    by_cell: dict[Cell, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_cell[cell_of(row)].append(row)
    found: list[Check] = []
    for cell in sorted(by_cell, key=lambda c: (c.path, c.client, c.dataset)):
        ours = {str(r["target"]) for r in by_cell[cell]} - {PEER}
        if len(ours) > 1:
            raise ValueError(f"{cell}: one target besides {PEER} expected, found {sorted(ours)}")
        medians = median_ratios(round_ratios(by_cell[cell], ours.pop(), PEER)) if ours else {}
        for target in TARGETS:
            levels = target.best_levels if cell.path == best_path else target.capped_levels
            for c in sorted(medians):
                if levels is None or c in levels:
                    found.append(Check(cell, c, target.label, medians[c][target.ratio],
                                       target.limit, target.at_least))
    return found


def missing(rows: Sequence[dict[str, Any]], clients: Sequence[str], datasets: Sequence[str],
            paths: Sequence[str]) -> list[str]:
    """The cells a full matrix has that `rows` lack (clients as CLIENTS names)."""
    have = {(c.client, c.dataset, c.path) for c in map(cell_of, rows)}
    return [f"{client} {dataset} {path}" for path in paths for client in clients
            for dataset in datasets if (CLIENT_LABELS[client], dataset, path) not in have]


def markdown(found: Sequence[Check]) -> str:
    """The checks as a table for docs/benchmarks.md."""
    lines = ["| path | client | dataset | level | figure | ours / vLLM-CPU | target | met |",
             "|---|---|---|---|---|---|---|---|"]
    for ch in found:
        sign = ">=" if ch.at_least else "<="
        lines.append(f"| {ch.cell.path} | {ch.cell.client} | {ch.cell.dataset} | "
                     f"{ch.concurrency} | {ch.label} | {ch.ratio:.2f}x | {sign} {ch.limit:g}x | "
                     f"{'yes' if ch.ok else '**no**'} |")
    return "\n".join(lines) + "\n"


def sweep_command(python: str, script: str, client: str, dataset: str, *, concurrency: str,
                  requests: int, rounds: int, out_dir: str, breakdown: bool) -> list[str]:
    """scripts/bench_sweep.py's command line for one cell against vLLM-CPU started by it,
    unpaced (aiperf's plain concurrency mode; vLLM's client refills every free slot at once).
    The path is the environment's (cpu_isa.CAP_ENV)."""
    if client not in CLIENTS or dataset not in DATASETS:
        raise ValueError(f"a client of {CLIENTS} and a dataset of {DATASETS}, got {client!r}, "
                         f"{dataset!r}")
    return [python, script, "--start-server", "--peer", "vllm", "--client", client,
            "--dataset", dataset, "--concurrency", concurrency, "--requests", str(requests),
            "--rounds", str(rounds), *(("--pace-hz", "0") if client == "aiperf" else ()),
            *(("--breakdown",) if breakdown else ()), "--out-dir", out_dir]
