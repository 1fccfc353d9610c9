"""Where a token's time goes in a running server: CPU time per output token of tritonserver and
of each model's stubs (read from /proc), and the engines' time per phase of their steps (read
from their `llm_engine_step_seconds_total` counters). Two snapshots around a load give the
figures; `scripts/bench_sweep.py --breakdown` prints them for each concurrency level.

CPU time and wall time answer different questions: a process's CPU time per token adds up all
its threads (an engine's OpenMP threads included, spinning ones too), so the processes' sum is
what the serving path costs the machine; the engine phases are wall time on the engine loop
(divided by the tokens of all sequences, so a batched step's time is shared by its tokens).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from python_backends import procfs
from python_backends.metrics_text import Metrics, metric_delta, scrape
from python_backends.procfs import stub_of

STEP_PHASES_METRIC = "llm_engine_step_seconds_total"
KERNEL_CHUNKS_METRIC = "llm_kernel_chunks_total"
HELPER_CHUNKS_METRIC = "llm_idle_helper_chunks_total"
HELPER_BOOSTED_METRIC = "llm_idle_helper_boosted_total"
DRAFT_METRIC = "llm_spec_draft_tokens_total"
ACCEPTED_METRIC = "llm_spec_accepted_tokens_total"


def server_pid(metrics_port: int) -> int | None:
    """The tritonserver process serving metrics on `metrics_port` (None: not on this host)."""
    for proc in procfs.processes():
        argv = proc.cmdline() or []
        if (argv and argv[0].endswith("tritonserver")
                and f"--metrics-port={metrics_port}" in argv):
            return proc.pid
    return None


def process_names(pid: int) -> dict[int, str]:
    """tritonserver and its stubs, by pid: "tritonserver" or the stub's model name."""
    names = {pid: "tritonserver"}
    for proc in procfs.running_children(pid):
        stub = stub_of(proc)
        if stub is not None:
            names[proc.pid] = stub.model
    return names


@dataclass(frozen=True)
class Snapshot:
    cpu: dict[int, float]  # CPU seconds by pid
    names: dict[int, str]
    metrics: Metrics


def snapshot(pid: int, metrics_url: str, others: dict[int, str] | None = None) -> Snapshot:
    """`pid`'s tritonserver and stubs, and `others` (more processes of the serving path, a
    gateway: by pid, their names)."""
    names = {**process_names(pid), **(others or {})}
    return Snapshot({p: procfs.cpu_seconds(p) for p in names}, names, scrape(metrics_url))


@dataclass(frozen=True)
class Breakdown:
    tokens: int
    wall_s: float
    cpu_ms: dict[str, float]  # CPU ms per token, by process name (a model's instances summed)
    phases_ms: dict[str, dict[str, float]]  # engine wall ms per token, by model then phase
    helper_share: dict[str, float] = field(default_factory=dict)  # by model: helper's chunks
    helper_boosted: dict[str, float] = field(default_factory=dict)  # by model: its heavy jobs
    drafts: dict[str, tuple[float, float]] = field(default_factory=dict)  # by model: drafted, kept


def breakdown(before: Snapshot, after: Snapshot, tokens: int, wall_s: float) -> Breakdown:
    """The figures between two snapshots, per output token (`tokens` produced in `wall_s`).
    Processes that started in between count from 0; ones that ended are left out."""
    per_token = 1e3 / max(1, tokens)
    cpu: dict[str, float] = defaultdict(float)
    for pid, name in after.names.items():
        cpu[name] += (after.cpu[pid] - before.cpu.get(pid, 0.0)) * per_token
    phases: dict[str, dict[str, float]] = defaultdict(dict)
    for labels in after.metrics.get(STEP_PHASES_METRIC, {}):
        want = dict(labels)
        model, phase = want["model"], want["phase"]
        if phase in phases[model]:
            continue
        phases[model][phase] = metric_delta(before.metrics, after.metrics, STEP_PHASES_METRIC,
                                            model=model, phase=phase) * per_token
    busy = {m: p for m, p in phases.items() if sum(p.values()) > 0}

    def moved(whole: str, part: str) -> dict[str, tuple[float, float]]:
        """By busy model whose counter `whole` grew: its growth, and that of `part` of it."""
        out = {}
        for model in busy:
            grew = metric_delta(before.metrics, after.metrics, whole, model=model)
            if grew > 0:
                out[model] = (grew, metric_delta(before.metrics, after.metrics, part, model=model))
        return out

    share = {m: helped / chunks for m, (chunks, helped)
             in moved(KERNEL_CHUNKS_METRIC, HELPER_CHUNKS_METRIC).items()}
    boosted = {m: jobs for m, (_, jobs)
               in moved(KERNEL_CHUNKS_METRIC, HELPER_BOOSTED_METRIC).items()}
    return Breakdown(tokens, wall_s, dict(cpu), busy, share, boosted,
                     moved(DRAFT_METRIC, ACCEPTED_METRIC))


def format_breakdown(b: Breakdown, cores: int) -> str:
    available = cores * b.wall_s * 1e3 / max(1, b.tokens)
    lines = [f"  CPU ms per output token by process ({b.tokens} tokens; the machine had "
             f"{available:.2f} core-ms per token):"]
    for name, ms in sorted(b.cpu_ms.items(), key=lambda kv: -kv[1]):
        if ms >= 0.005:
            lines.append(f"    {name:<16}{ms:8.2f}")
    lines.append(f"    {'all':<16}{sum(b.cpu_ms.values()):8.2f}")
    for model, phases in sorted(b.phases_ms.items()):
        parts = ", ".join(f"{phase} {ms:.2f}" for phase, ms in
                          sorted(phases.items(), key=lambda kv: -kv[1]))
        lines.append(f"  {model} engine loop, wall ms per token: {parts} "
                     f"(sum {sum(phases.values()):.2f})")
        if model in b.helper_share:
            lines.append(f"  {model} idle-CPU helper: {100 * b.helper_share[model]:.0f}% of the "
                         f"native kernels' work chunks; "
                         f"{b.helper_boosted.get(model, 0):.0f} prompts' jobs at normal priority")
        if model in b.drafts:
            drafted, kept = b.drafts[model]
            lines.append(f"  {model} speculative drafts: {drafted:.0f} drafted, {kept:.0f} kept "
                         f"({100 * kept / drafted:.0f}%); kept drafts were "
                         f"{100 * kept / max(1, b.tokens):.0f}% of the output tokens")
    return "\n".join(lines)
