"""A bounded soak: a server of its own, on loopback, at saturation, under a fault schedule, with
every request accounted for. `scripts/soak.py` is its command line.

Client threads send, until the duration is over, a mix of greedy streaming and non-streaming
requests on every route (compared token for token with Hugging Face's greedy output), long
prompts, streams dropped mid-way, non-streaming clients that go away, bad inputs, requests of a
rate-limited tenant, handoffs with injected NIXL failures and sampled requests. Meanwhile the
fault schedule kills, at even intervals, the worker, decode and prefill stubs, a rank of a
parallel worker (with --worker-tp) and the front's stub.

Each request ends in one outcome (`Outcome`). None may be `hung`, `mismatched`, `server_error`
or `unexpected`. `lost_with_front` is separate: requests in flight in the front's stub when it
was killed, which Triton 2.51 never fails (their clients' own timeouts end them;
docs/operations.md), and so is `lost_with_server`: requests unanswered because tritonserver
itself was gone (the report's `server_died` fails such a run). At the end the soak waits for
the engines to go idle, for as long as they still compute (abandoned non-streaming requests run
to their end), and reports the KV blocks still held, the migrations, and each server process's
resident memory against its size after warm-up.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from python_backends import procfs
from python_backends.bench.client import GenerateError, LLMClient, as_list
from python_backends.config import RANK_MODULE
from python_backends.diagnostics import request_stack_dumps
from python_backends.metrics_text import metric_sum, scrape
from python_backends.ops.launcher import TritonServer
from python_backends.procfs import STUB_SEGMENT_PREFIX, live_stubs, stub_of

PROMPTS = [
    "The capital of France is",
    "La recette de la crêpe bretonne commence par",
    "中国的首都是",
    "def fibonacci(n):",
    "Write a short poem about the sea.",
    "List the planets of the solar system:",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
]
FILLER = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)
LONG_PROMPTS = [f"{p}\n{FILLER}\n{p}" for p in PROMPTS[:3]]
MAX_TOKENS = 24
LIMITED_TENANT = "soak-limited"
RATE_LIMITS = {LIMITED_TENANT: {"requests_per_s": 0.2, "burst_requests": 1}}
BAD_INPUTS: list[dict[str, Any]] = [
    {"text_input": ""},
    {"text_input": "hi", "max_tokens": -3},
    {"text_input": "hi", "temperature": -1.0},
    {"text_input": "hi", "top_p": 1.5},
    {"text_input": "hi", "max_token": 5},  # misspelt: refused by name
    {"text_input": "hi", "route": "sideways"},
    {"text_input": "x " * 20000},  # longer than the engine takes
]
# The request mix: (kind, weight).
MIX = (("stream", 4), ("unary", 3), ("long", 1), ("drop_stream", 1), ("disconnect", 1),
       ("bad_input", 1), ("limited", 1), ("kv_fault", 1), ("sampled", 1))
FAULTS = ("worker", "decode", "prefill", "rank", "front")


class Outcome(enum.Enum):
    COMPLETED = "completed"  # answered (greedy answers equal to the reference)
    MISMATCHED = "mismatched"  # a greedy answer that differs from the reference
    CANCELLED = "cancelled"  # the client went away on purpose
    REFUSED = "refused"  # bad input or the rate limit: a clear client error, as expected
    FAILED_CLEARLY = "failed_clearly"  # ended with a clear error (a fault, no engine left)
    SERVER_ERROR = "server_error"  # HTTP 5xx, or a refusal of a valid request with no message
    LOST_WITH_FRONT = "lost_with_front"  # held by the front's stub when it was killed
    LOST_WITH_SERVER = "lost_with_server"  # unanswered because tritonserver itself was gone
    HUNG = "hung"  # no answer within the client's timeout
    UNEXPECTED = "unexpected"  # the soak itself failed to classify it


BAD_OUTCOMES = (Outcome.MISMATCHED, Outcome.SERVER_ERROR, Outcome.HUNG, Outcome.UNEXPECTED)


@dataclass
class SoakOptions:
    duration_s: float = 150.0
    clients: int = 8
    request_timeout_s: float = 60.0
    faults: tuple[str, ...] = FAULTS
    seed: int = 0
    warmup_s: float = 30.0  # resident memory is compared with its size this long after start


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: Outcome, detail: str = "") -> None:
        with self.lock:
            self.counts[outcome.value] += 1
            self.by_kind[f"{kind}/{outcome.value}"] += 1
            if detail and outcome is not Outcome.COMPLETED:
                shown = self.examples.setdefault(outcome.value, [])
                if len(shown) < 5:
                    shown.append(f"{kind}: {detail[:200]}")


class FaultLog:
    """When each fault struck; `front_killed_during` tells a lost request from a hung one."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []  # (time, fault, what happened)

    def record(self, fault: str, what: str) -> None:
        self.events.append((time.monotonic(), fault, what))
        print(f"[soak] fault {fault}: {what}", flush=True)

    def front_killed_during(self, start: float, end: float) -> bool:
        return any(f == "front" and start <= t <= end and w.startswith("killed")
                   for t, f, w in self.events)


def unanswered(server_alive: bool, front_killed: bool) -> Outcome:
    """A request whose answer did not come in time, or whose connection failed: lost with the
    server if tritonserver is gone, with the front's stub if it was killed meanwhile, else
    hung."""
    if not server_alive:
        return Outcome.LOST_WITH_SERVER
    return Outcome.LOST_WITH_FRONT if front_killed else Outcome.HUNG


class Soak:
    def __init__(self, triton: TritonServer, reference: dict[str, list[int]],
                 options: SoakOptions) -> None:
        self.triton = triton
        self.reference = reference
        self.options = options
        self.tally = Tally()
        self.faults = FaultLog()
        self.memory = MemoryWatch(options.warmup_s)
        self.load = LoadWatch(lambda: scrape(triton.options.metrics_url))
        self.first_hang: dict[str, Any] | None = None
        self._hang_lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def server_pid(self) -> int:
        assert self.triton.process is not None
        return self.triton.process.pid

    def server_alive(self) -> bool:
        return self.triton.process is not None and self.triton.process.poll() is None

    def run(self) -> dict[str, Any]:
        start = self.started = time.monotonic()
        clients = [threading.Thread(target=self._client, args=(i,), name=f"soak-client-{i}")
                   for i in range(self.options.clients)]
        for t in clients:
            t.start()
        self._fault_schedule(start)
        self._stop.set()
        for t in clients:
            t.join(self.options.request_timeout_s + 30)
        return self._report(time.monotonic() - start, any(t.is_alive() for t in clients))

    def _fault_schedule(self, start: float) -> None:
        faults = self.options.faults
        duration = self.options.duration_s
        times = [start + duration * (i + 1) / (len(faults) + 1) for i in range(len(faults))]
        for at, fault in zip(times, faults, strict=True):
            while time.monotonic() < at and self.server_alive():
                self._sample()
                time.sleep(min(2.0, max(0.0, at - time.monotonic())))
            if not self.server_alive():
                return  # nothing left to soak: the report says so
            self.faults.record(fault, inject(fault, self.server_pid))
        while time.monotonic() < start + duration and self.server_alive():
            self._sample()
            time.sleep(2.0)

    def _sample(self) -> None:
        self.memory.sample(self.server_pid)
        self.load.sample(time.monotonic() - self.started)

    def _client(self, index: int) -> None:
        rng = random.Random(self.options.seed * 1000 + index)
        client = LLMClient(self.triton.options.http_url, timeout=self.options.request_timeout_s)
        kinds, weights = zip(*MIX, strict=True)
        while not self._stop.is_set():
            kind = rng.choices(kinds, weights)[0]
            start = time.monotonic()
            try:
                outcome, detail = REQUESTS[kind](self, client, rng)
            except (requests.Timeout, requests.ConnectionError) as e:
                outcome = unanswered(self.server_alive(),
                                     self.faults.front_killed_during(start, time.monotonic()))
                detail = repr(e)
            except Exception as e:
                outcome, detail = Outcome.UNEXPECTED, repr(e)
            if outcome is Outcome.HUNG:
                self._on_hang(kind, start)
            self.tally.add(kind, outcome, detail)

    def _on_hang(self, kind: str, sent: float) -> None:
        """The first hung request: note when it was sent and given up on, the engines' load
        then, and have every stub write its stacks into the server log while the hang lasts."""
        with self._hang_lock:
            if self.first_hang is not None or not self.server_alive():
                return
            now = time.monotonic()
            self.first_hang = {"kind": kind, "sent_at_s": round(sent - self.started, 1),
                               "given_up_at_s": round(now - self.started, 1),
                               "load": self.load.sample(now - self.started, force=True),
                               "stacks_dumped": request_stack_dumps(self.server_pid)}
        print(f"[soak] first hung request: {self.first_hang}", flush=True)

    def greedy_outcome(self, prompt: str, ids: list[int]) -> tuple[Outcome, str]:
        want = self.reference[prompt]
        if ids == want:
            return Outcome.COMPLETED, ""
        return Outcome.MISMATCHED, f"{prompt[:40]!r}: got {ids}, want {want}"

    def _report(self, elapsed: float, clients_stuck: bool) -> dict[str, Any]:
        died = not self.server_alive()
        metrics, drained_s = ({}, 0.0) if died else self._metrics_once_idle()
        held = metric_sum(metrics, BLOCKS_METRIC)
        if not died:
            self.memory.sample(self.server_pid)
        report: dict[str, Any] = {
            "duration_s": round(elapsed, 1),
            "sent": sum(self.tally.counts.values()),
            "outcomes": {o.value: self.tally.counts.get(o.value, 0) for o in Outcome},
            "by_kind": dict(sorted(self.tally.by_kind.items())),
            "examples": self.tally.examples,
            "first_hang": self.first_hang,
            "load": self.load.samples,
            "faults": [{"at_s": round(t - self.faults.events[0][0], 1) if self.faults.events
                        else 0, "fault": f, "what": w} for t, f, w in self.faults.events],
            "kv_blocks_held_at_end": held,
            "drain_s": round(drained_s, 1),  # the wait for the engines' last work to end
            "kv_blocks_held_by_instance": held_by_instance(metrics),
            "migrations": metric_sum(metrics, "llm_request_migrations_total"),
            "unserved": metric_sum(metrics, "llm_requests_unserved_total"),
            "memory": self.memory.report(),
            "clients_stuck": clients_stuck,
            "server_died": died,
            "server_exit": self.triton.exit_reason(),  # why it died, if it did
        }
        report["ok"] = not died and not clients_stuck and held == 0 and all(
            report["outcomes"][o.value] == 0 for o in BAD_OUTCOMES)
        return report

    def _metrics_once_idle(self) -> tuple[dict[str, Any], float]:
        """The server's metrics once its engines hold no KV block, and the seconds that took
        (see `wait_engines_idle`)."""
        url = self.triton.options.metrics_url
        return wait_engines_idle(lambda: scrape(url))


# Waiting for the engines to drain at the end. A non-streaming request whose client went away
# runs to its end on Triton's own HTTP endpoint (Triton notices the closed connection only when
# it writes the answer; docs/operations.md): the soak's abandoned requests ask for 400 tokens,
# which a 3-rank worker on 2 cores takes over a minute to compute. Blocks held while engines
# compute are that work draining; blocks held while no engine computes are held for good.
DRAIN_STALL_S = 30.0  # no engine computed for this long: what is held now stays held
DRAIN_TIMEOUT_S = 600.0  # the longest the soak waits for its abandoned requests to end
BUSY_METRIC = "llm_engine_busy_seconds_total"
BLOCKS_METRIC = "llm_kv_cache_blocks_used"


def wait_engines_idle(
    scrape_metrics: Callable[[], dict[str, Any]], stall_s: float = DRAIN_STALL_S,
    timeout_s: float = DRAIN_TIMEOUT_S, poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> tuple[dict[str, Any], float]:
    """Scrape until no engine holds a KV block, while the engines keep computing (their busy
    time grows), for at most `timeout_s`; stops after `stall_s` without computation. Returns the
    last metrics and the seconds waited."""
    start = last_progress = clock()
    metrics = scrape_metrics()
    busy = metric_sum(metrics, BUSY_METRIC)
    while metric_sum(metrics, BLOCKS_METRIC) and (
            clock() - start < timeout_s and clock() - last_progress < stall_s):
        sleep(poll_s)
        metrics = scrape_metrics()
        if (now_busy := metric_sum(metrics, BUSY_METRIC)) > busy:
            busy, last_progress = now_busy, clock()
    return metrics, clock() - start


# What an instance holding KV blocks at the end also reports: sequences still there or not
# tells a leak in the instance from a stale series of one that exited.
HOLDER_GAUGES = ("llm_num_requests_running", "llm_num_requests_waiting", "llm_engine_healthy")


def held_by_instance(metrics: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The engine instances whose KV blocks are counted in use: the count, and the instance's
    other gauges."""
    def by_instance(name: str) -> dict[str, float]:
        return {dict(labels).get("instance", "?"): value
                for labels, value in metrics.get(name, {}).items()}

    held = {i: v for i, v in by_instance(BLOCKS_METRIC).items() if v}
    gauges = {name: by_instance(name) for name in HOLDER_GAUGES}
    return {i: {"blocks": v, **{name.removeprefix("llm_"): gauges[name].get(i, float("nan"))
                                for name in HOLDER_GAUGES}}
            for i, v in held.items()}


ENGINE_GROUPS = ("worker", "prefill", "decode")
LOAD_INTERVAL_S = 10.0


class LoadWatch:
    """The engines' load over the run, every `interval_s`: sequences running and waiting and KV
    blocks used per engine group, and preemptions so far. A request can go unanswered for the
    client's timeout because it is stuck or because it waits behind a backlog; a timeline whose
    waiting sequences and preemptions climb tells the second."""

    def __init__(self, scrape_metrics: Callable[[], dict[str, Any]],
                 interval_s: float = LOAD_INTERVAL_S) -> None:
        self._scrape = scrape_metrics
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._last = float("-inf")
        self._lock = threading.Lock()

    def sample(self, at_s: float, force: bool = False) -> dict[str, Any] | None:
        """Scrape if `interval_s` passed since the last sample (or `force`); returns the sample,
        None when not due or the scrape failed (a fault may have the server busy restarting)."""
        with self._lock:
            if not force and at_s - self._last < self.interval_s:
                return None
            self._last = at_s
        try:
            metrics = self._scrape()
        except requests.RequestException:
            return None
        row: dict[str, Any] = {"at_s": round(at_s, 1)}
        for key, name in (("running", "llm_num_requests_running"),
                          ("waiting", "llm_num_requests_waiting"),
                          ("kv_blocks", BLOCKS_METRIC)):
            row[key] = {g: metric_sum(metrics, name, model=g) for g in ENGINE_GROUPS}
        row["preemptions"] = metric_sum(metrics, "llm_num_preemptions_total")
        with self._lock:
            self.samples.append(row)
        return row


def format_load(row: dict[str, Any]) -> str:
    """One load sample on one line: running/waiting/KV blocks per engine group."""
    groups = "  ".join(f"{g} {row['running'][g]:.0f}/{row['waiting'][g]:.0f}/"
                       f"{row['kv_blocks'][g]:.0f}" for g in ENGINE_GROUPS)
    return f"{row['at_s']:>7.1f} s  {groups}  preemptions {row['preemptions']:.0f}"


def inject(fault: str, server_pid: int) -> str:
    """Strike one fault; returns what happened."""
    if fault == "rank":
        ranks = [p for p in procfs.running_descendants(server_pid)
                 if RANK_MODULE in (p.cmdline() or [])]
        if not ranks:
            return "skipped: no engine runs on more than one rank (see --worker-tp)"
        os.kill(ranks[0].pid, signal.SIGKILL)
        return f"killed engine rank pid {ranks[0].pid}"
    stubs = [s for s in live_stubs(server_pid) if s.model == fault]
    if not stubs:
        return "skipped: no live stub"
    os.kill(stubs[0].pid, signal.SIGKILL)
    return f"killed {stubs[0].instance} (pid {stubs[0].pid})"


def _greedy_inputs(rng: random.Random) -> dict[str, Any]:
    return {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True,
            "route": rng.choice(["auto", "aggregated", "disaggregated"])}


def _error_outcome(e: GenerateError) -> tuple[Outcome, str]:
    if e.status >= 500 or not e.message:
        return Outcome.SERVER_ERROR, f"HTTP {e.status}: {e.message}"
    return Outcome.FAILED_CLEARLY, e.message


def _stream(soak: Soak, client: LLMClient, rng: random.Random) -> tuple[Outcome, str]:
    prompt = rng.choice(PROMPTS)
    try:
        ids: list[int] = []
        for event in client.stream(prompt, **_greedy_inputs(rng)):
            ids.extend(as_list(event.get("output_ids", [])))
    except GenerateError as e:
        return _error_outcome(e)
    return soak.greedy_outcome(prompt, ids)


def _unary(soak: Soak, client: LLMClient, rng: random.Random, prompts: list[str] = PROMPTS,
           **extra: Any) -> tuple[Outcome, str]:
    prompt = rng.choice(prompts)
    try:
        out = client.generate(prompt, **{**_greedy_inputs(rng), **extra})
    except GenerateError as e:
        return _error_outcome(e)
    return soak.greedy_outcome(prompt, as_list(out["output_ids"]))


def _drop_stream(soak: Soak, client: LLMClient, rng: random.Random) -> tuple[Outcome, str]:
    events = client.stream(rng.choice(PROMPTS), max_tokens=400, end_id=-1)
    wanted = rng.randint(1, 4)
    try:
        for n, _ in enumerate(events, 1):
            if n == wanted:
                break
    except GenerateError as e:
        return _error_outcome(e)
    finally:
        events.close()  # drops the connection
    return Outcome.CANCELLED, ""


def _disconnect(soak: Soak, client: LLMClient, rng: random.Random) -> tuple[Outcome, str]:
    impatient = LLMClient(client.base_url, timeout=rng.uniform(0.5, 2.0))
    try:
        impatient.generate(rng.choice(PROMPTS), max_tokens=400, end_id=-1)
    except GenerateError as e:
        return _error_outcome(e)
    except (requests.Timeout, requests.ConnectionError):
        return Outcome.CANCELLED, ""
    return Outcome.COMPLETED, ""


def _bad_input(soak: Soak, client: LLMClient, rng: random.Random) -> tuple[Outcome, str]:
    body = dict(rng.choice(BAD_INPUTS))
    try:
        client.generate(body.pop("text_input"), **body)
    except GenerateError as e:
        if e.status == 400 and e.message:
            return Outcome.REFUSED, ""
        return Outcome.SERVER_ERROR, f"HTTP {e.status} for {body}: {e.message}"
    return Outcome.SERVER_ERROR, f"accepted a bad input: {body}"


def _limited(soak: Soak, client: LLMClient, rng: random.Random) -> tuple[Outcome, str]:
    outcome, detail = _unary(soak, client, rng, tenant=LIMITED_TENANT)
    if outcome is Outcome.FAILED_CLEARLY and "rate limit" in detail:
        return Outcome.REFUSED, ""
    return outcome, detail


def _kv_fault(soak: Soak, client: LLMClient, rng: random.Random) -> tuple[Outcome, str]:
    return _unary(soak, client, rng, route="disaggregated",
                  kv_fault=rng.choice(["transfer_error", "expire_lease"]))


def _long(soak: Soak, client: LLMClient, rng: random.Random) -> tuple[Outcome, str]:
    return _unary(soak, client, rng, prompts=LONG_PROMPTS)


def _sampled(soak: Soak, client: LLMClient, rng: random.Random) -> tuple[Outcome, str]:
    try:
        client.generate(rng.choice(PROMPTS), max_tokens=MAX_TOKENS, temperature=0.8,
                        top_p=0.9, seed=rng.randrange(1 << 31))
    except GenerateError as e:
        return _error_outcome(e)
    return Outcome.COMPLETED, ""


REQUESTS: dict[str, Callable[[Soak, LLMClient, random.Random], tuple[Outcome, str]]] = {
    "stream": _stream, "unary": _unary, "long": _long, "drop_stream": _drop_stream,
    "disconnect": _disconnect, "bad_input": _bad_input, "limited": _limited,
    "kv_fault": _kv_fault, "sampled": _sampled,
}


class MemoryWatch:
    """Resident memory of the server's processes: each one's size `warmup_s` after it was first
    seen (its baseline), and its latest; split into private memory and the shared memory it
    touched (a Python stub's and tritonserver's message arenas in /dev/shm grow to the busiest
    moment's need and stay that size). Growth over the second half of a process's time after
    warm-up tells memory that settled from memory still growing. A process gone by the last
    sample (a fault killed it) is reported as exited, with its last size.

    For tritonserver it also tells, at its baseline and at the end, its threads and the
    segments it still maps of stubs that died: Triton 2.51 never frees a dead decoupled stub's
    instance (docs/platform.md), so each killed stub leaves its segment and thread pool there."""

    def __init__(self, warmup_s: float) -> None:
        self.warmup_s = warmup_s
        self._seen: dict[int, tuple[str, float]] = {}  # pid -> (name, first seen)
        self._baseline: dict[int, procfs.Memory] = {}
        self._latest: dict[int, procfs.Memory] = {}
        self._rss: dict[int, list[tuple[float, int]]] = {}  # pid -> (time, rss) after warm-up
        self._alive: set[int] = set()  # in the last sample
        self._server: tuple[int, DeadStubs] | None = None  # its pid and baseline's DeadStubs

    def sample(self, server_pid: int) -> None:
        now = time.monotonic()
        server = procfs.process(server_pid)
        self._alive = set()
        for proc in [*([server] if server else []), *procfs.running_descendants(server_pid)]:
            # named anew each time: a stub is first seen as the shell Triton starts it with
            # (and an exiting one has no command line left: "?")
            known, since = self._seen.get(proc.pid, ("?", now))
            name = _name(proc)
            self._seen[proc.pid] = (known if name == "?" else name, since)
            memory = proc.memory()
            if memory is None:
                continue
            self._alive.add(proc.pid)
            self._latest[proc.pid] = memory
            if now - since >= self.warmup_s:
                if proc.pid not in self._baseline and proc.pid == server_pid:
                    self._server = (server_pid, DeadStubs.of(server_pid))
                self._baseline.setdefault(proc.pid, memory)
                self._rss.setdefault(proc.pid, []).append((now, memory.rss))

    def report(self) -> list[dict[str, Any]]:
        rows = []
        for pid, base in self._baseline.items():
            latest = self._latest.get(pid, base)
            rows.append({"process": self._seen[pid][0], "pid": pid,
                         "after_warmup_mb": _mib(base.rss), "at_end_mb": _mib(latest.rss),
                         "growth_pct": round(100.0 * (latest.rss - base.rss) / base.rss, 1),
                         "private_growth_mb": _mib(latest.anon - base.anon),
                         "shared_growth_mb": _mib(latest.shmem - base.shmem),
                         "second_half_growth_pct": self._second_half_growth(pid),
                         "exited": pid not in self._alive})
            if self._server and pid == self._server[0] and pid in self._alive:
                rows[-1].update(self._server[1].compare(DeadStubs.of(pid), base, latest))
        return sorted(rows, key=lambda r: (bool(r["exited"]), str(r["process"])))

    def _second_half_growth(self, pid: int) -> float:
        """Growth from the midpoint of the process's time after warm-up to its last sample, in
        percent of its baseline."""
        samples = self._rss.get(pid, [])
        if len(samples) < 2:
            return 0.0
        (start, base), (end, last) = samples[0], samples[-1]
        middle = next(rss for t, rss in samples if t >= (start + end) / 2)
        return round(100.0 * (last - middle) / base, 1)


@dataclass(frozen=True)
class DeadStubs:
    """What tritonserver holds of stubs that died: the stub segments it maps that no running
    stub uses, their resident bytes, and its thread count."""

    threads: int
    segments: int
    resident: int

    @classmethod
    def of(cls, server_pid: int) -> DeadStubs:
        server = procfs.process(server_pid)
        if server is None:
            return cls(0, 0, 0)
        live = {stub.region for stub in live_stubs(server_pid)}
        dead = [rss for name, rss in server.shm_resident().items()
                if name.startswith(STUB_SEGMENT_PREFIX) and name not in live]
        return cls(server.threads(), len(dead), sum(dead))

    def compare(self, end: DeadStubs, base: procfs.Memory,
                latest: procfs.Memory) -> dict[str, Any]:
        """The report's fields: threads and dead stubs' segments at baseline and end, and the
        growth of what is left once those segments are taken out."""
        rest_base, rest_end = base.rss - self.resident, latest.rss - end.resident
        return {"threads": [self.threads, end.threads],
                "dead_stub_segments": [self.segments, end.segments],
                "dead_stub_segments_mb": [_mib(self.resident), _mib(end.resident)],
                "growth_without_dead_stub_segments_pct":
                    round(100.0 * (rest_end - rest_base) / rest_base, 1)}


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


def _name(proc: procfs.Process) -> str:
    stub = stub_of(proc)
    if stub is not None:
        return stub.instance
    argv = proc.cmdline() or []
    if RANK_MODULE in argv:
        return "engine rank"
    return Path(argv[0]).name if argv else "?"


def print_report(report: dict[str, Any]) -> None:
    print(f"\nsoak: {report['sent']} requests in {report['duration_s']:.0f} s")
    if report["server_died"]:
        print(f"  TRITONSERVER DIED: {report['server_exit']} (the end of its log is above)")
    for name, count in report["outcomes"].items():
        print(f"  {name:<16} {count}")
    print(f"  migrations {report['migrations']:.0f}, unserved {report['unserved']:.0f}, "
          f"KV blocks held at the end {report['kv_blocks_held_at_end']:.0f} "
          f"{report['kv_blocks_held_by_instance'] or ''}(after {report['drain_s']:.0f} s "
          "waiting for the engines' last work to end)")
    print("fault schedule:")
    for f in report["faults"]:
        print(f"  {f['at_s']:>7.1f} s  {f['fault']:<8} {f['what']}")
    print("resident memory (after warm-up -> at end; growth: private, shared memory):")
    for row in report["memory"]:
        print(f"  {row['process']:<18} {row['after_warmup_mb']:>8.1f} -> "
              f"{row['at_end_mb']:>8.1f} MiB ({row['growth_pct']:+6.1f}%; "
              f"{row['private_growth_mb']:+.1f}, {row['shared_growth_mb']:+.1f} MiB; "
              f"{row['second_half_growth_pct']:+.1f}% in the second half)"
              + ("  exited" if row["exited"] else ""))
        if "threads" in row:
            print(f"  {'':<18} threads {row['threads'][0]} -> {row['threads'][1]}; segments of "
                  f"dead stubs {row['dead_stub_segments'][0]} -> {row['dead_stub_segments'][1]}"
                  f" ({row['dead_stub_segments_mb'][1]:.1f} MiB resident); without them "
                  f"{row['growth_without_dead_stub_segments_pct']:+.1f}%")
    if report["load"]:
        every = max(1, round(60.0 / LOAD_INTERVAL_S))  # about a line a minute
        print("engine load (running/waiting/KV blocks used per group):")
        for row in report["load"][::every]:
            print(f"  {format_load(row)}")
    if report["first_hang"]:
        hang = report["first_hang"]
        print(f"first hung request: {hang['kind']}, sent at {hang['sent_at_s']:.0f} s, given up "
              f"at {hang['given_up_at_s']:.0f} s; {hang['stacks_dumped']} processes wrote "
              "their stacks into the server log then; load: "
              + (format_load(hang["load"]) if hang["load"] else "unknown"))
    for outcome, shown in report["examples"].items():
        print(f"examples of {outcome}:", *shown, sep="\n  ")
    if report.get("server_log"):
        print(f"server log kept: {report['server_log']}")
    print("OK" if report["ok"] else "FAILED", flush=True)


def as_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, default=lambda o: dataclasses.asdict(o))
