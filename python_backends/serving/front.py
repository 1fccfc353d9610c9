"""`front`: the decoupled BLS front of every request, as Triton glue.

Each tokenized request goes to front.orchestrator, which admits it (rate limits, waiting
bounds, a cancel ticket), routes it over the engine groups and relays their steps as client
chunks. What is Triton's stays here: the response sender behind each request's ClientLink, and
LocalGroup, the engine groups of this server called over BLS (front.channel's other
implementation, for groups on other servers, is front.remote.RemoteGroup).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from python_backends.config import (
    API_KEY_ENV,
    ENGINE_GROUPS,
    FRONT_LOCAL_GROUPS,
    GRPC_API_KEY_HEADER,
    ROLE_ENV,
)
from python_backends.diagnostics import set_up_process
from python_backends.flag_board import BoardCache, FlagBoard
from python_backends.front.admission import (
    AdmissionControl,
    AdmissionLimits,
    RateLimiter,
    RejectReason,
    parse_rate_limits,
)
from python_backends.front.channel import Caller, Channel, EngineLost, Reply, batched
from python_backends.front.liveness import HolderWatch, IdleProber
from python_backends.front.migration import STUB_UNHEALTHY, MigrationReason, Moved
from python_backends.front.orchestrator import EngineGroups, Gates, Orchestrator
from python_backends.front.remote import RemoteGroup, ServerSet
from python_backends.front.routing import DisaggregationPolicy, Router
from python_backends.front.tenancy import CacheSharing
from python_backends.kv_transfer.base import KVHandle, abandon
from python_backends.procfs import live_stubs
from python_backends.serving.bls import BLSStreams, Responses
from python_backends.serving.common import (
    FINAL,
    ModelArgs,
    bls_request,
    error_response,
    inputs_of,
    outputs_of,
    response,
)
from python_backends.serving.metrics import RequestMetrics
from python_backends.serving.options import FrontOptions
from python_backends.wire import (
    ClientChunk,
    EngineRequest,
    ErrorKind,
    GenerationRequest,
    Message,
    TokenizedRequest,
)

log = logging.getLogger(__name__)
EXIT_GRACE_S = 10.0  # after finalize, for a stub whose calls to dead engines never end
# How often a request's response sender is asked whether its caller cancelled (a direct caller
# of this model, such as the gateway; the ensemble's clients cancel through the board): a stream
# cancelled meanwhile costs the engine at most this much more work.
SENDER_CHECK_S = 0.2


def error_code(kind: str) -> Any:
    """The Triton error code for an engine error of this ErrorKind (looked up at call time: the
    stub's pb_utils has no TritonError while it imports the model)."""
    return {
        ErrorKind.INVALID: pb_utils.TritonError.INVALID_ARG,
        ErrorKind.UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE,
        ErrorKind.INTERNAL: pb_utils.TritonError.INTERNAL,
    }[ErrorKind(kind)]


def error_kind(code: Any) -> str:
    """The ErrorKind value of a Triton error code (the inverse of error_code)."""
    return {
        pb_utils.TritonError.INVALID_ARG: ErrorKind.INVALID,
        pb_utils.TritonError.UNAVAILABLE: ErrorKind.UNAVAILABLE,
    }.get(code, ErrorKind.INTERNAL).value


def remote_groups(options: FrontOptions) -> dict[str, RemoteGroup]:
    """The engine groups other servers serve: model -> its group, for each group whose
    `<group>_servers` parameter, else $LLM_<GROUP>_SERVERS, names servers (host:port,... or
    dns:NAME:PORT; see front.remote). Calls carry this server's API key, if it has one."""
    key = os.environ.get(API_KEY_ENV)
    headers = {GRPC_API_KEY_HEADER: key} if key else None
    groups = {}
    for group in ENGINE_GROUPS:
        model = getattr(options, f"{group}_model")
        spec = (getattr(options, f"{group}_servers")
                or os.environ.get(f"LLM_{group.upper()}_SERVERS", ""))
        if not (model and spec):
            continue
        try:
            groups[model] = RemoteGroup(model, ServerSet(spec), headers,
                                        options.engine_check_interval_seconds)
        except ValueError as e:
            raise pb_utils.TritonModelException(f"front: {group}_servers: {e}") from None
    return groups


def served_groups(role: str, models: tuple[str, str, str],
                  remote: set[str]) -> tuple[str, str, str]:
    """The worker, prefill and decode models this front sends work to, "" for a group it has
    not: a group is served when the server's role runs it here (config.FRONT_LOCAL_GROUPS) or
    other servers serve it (`remote`)."""
    local = FRONT_LOCAL_GROUPS.get(role, ENGINE_GROUPS)
    worker, prefill, decode = (m if m and (group in local or m in remote) else ""
                               for group, m in zip(ENGINE_GROUPS, models, strict=True))
    if not (worker or prefill):
        raise ValueError(f"a {role} server has no engine group to send work to: set "
                         "LLM_WORKER_SERVERS, or LLM_PREFILL_SERVERS and LLM_DECODE_SERVERS")
    return worker, prefill, decode


def shares_cpu_cores(repository: Path, groups: tuple[str, str, str], remote: set[str]) -> bool:
    """Whether the worker, prefill and decode groups all run here on CPU instances: served by
    this server (none in `remote`) from models beside the front's directory `repository` whose
    config.pbtxt asks for no KIND_GPU instance. They then share this machine's cores, and a
    request prefilled apart takes cores from the worker's batch (at concurrency 32 on 2 cores,
    aggregated 228 output tok/s against 184 with long prompts disaggregated). False where a
    config cannot be read."""
    if not all(groups) or any(m in remote for m in groups):
        return False
    for model in groups:
        try:
            text = (repository.parent / model / "config.pbtxt").read_text()
        except OSError:
            return False
        if "KIND_GPU" in re.sub(r"#[^\n]*", "", text):
            return False
    return True


class ClientLink:
    """One request's link to its client. Every response goes through it, under a lock, so
    exactly one carries the final flag (Triton counts the request in flight until then) and a
    probe (front.liveness) never follows it. A failure after the first streamed chunk ends the
    stream as data (finish_reason "error"): a Triton error then would leave the ensemble
    request in flight for ever (the 2.51 ensemble bug, docs/platform.md)."""

    def __init__(self, sender: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.sender = sender
        self.board: FlagBoard | None = None
        self.ticket = 0
        self.cancelled = False  # the client went away, or an error answered it
        self.closed = False  # the final response went out
        self._leave: Callable[[], None] | None = None
        self._streamed: ClientChunk | None = None  # the last chunk sent before the final one
        self._lock = threading.Lock()
        self._clock = clock
        self._last_sent = clock()
        self._sender_checked = -math.inf  # never asked: the first check asks

    def attach(self, board: FlagBoard, ticket: int, leave: Callable[[], None]) -> None:
        """The request was admitted: its cancel ticket and the admission wait it holds."""
        self.board, self.ticket, self._leave = board, ticket, leave

    def first_response(self) -> None:
        """The request stops waiting (counted by admission control) at its first response."""
        if self._leave is not None:
            self._leave()
            self._leave = None

    def check_cancelled(self) -> bool:
        # Postprocessing raises the flag when the client goes away (see flag_board); a direct
        # caller of this model cancels the sender itself. Engines see the flag. A sender is
        # never asked after its final response: Triton 2.51 has freed it (a segfault).
        if not self.cancelled and not self.closed and self.board is not None and (
                self.board.is_cancelled(self.ticket) or self._sender_cancelled()):
            self.cancelled = True
            self.board.cancel(self.ticket)
        return self.cancelled

    def _sender_cancelled(self) -> bool:
        """The sender's own flag, asked at most every SENDER_CHECK_S: each ask is a round trip
        to tritonserver, and the relay checks before every step (the board is shared memory)."""
        now = self._clock()
        if now - self._sender_checked < SENDER_CHECK_S:
            return False
        self._sender_checked = now
        return bool(self.sender.is_cancelled())

    def send(self, chunk: ClientChunk, final: bool) -> None:
        self._send(response(chunk, batched=True), FINAL if final else 0)
        if not final:
            self._streamed = chunk

    def fail(self, message: str, kind: ErrorKind) -> None:
        if self._streamed is None:
            self._send(error_response(message, error_code(kind.value)), FINAL)
        else:
            self._send(response(self._streamed.failed(message), batched=True), FINAL)
        self.cancelled = True  # nothing more goes to this client

    def close(self) -> None:
        """The final flag alone, unless a final response went out already."""
        self._send(None, FINAL)

    def idle_for(self, now: float) -> float:
        return now - self._last_sent

    def probe(self) -> None:
        """From the prober's thread. A direct caller that went away (the gateway) is found here,
        by its sender, asked under the lock so that the request's own thread cannot send the
        final response (which frees the sender) meanwhile; an ensemble client is found by
        postprocessing, which ends the probe."""
        if self.board is None:
            return
        with self._lock:
            if not self.check_cancelled():  # never asks a closed link's sender
                self._send_locked(
                    response(ClientChunk.probe(self.board.name, self.ticket), batched=True), 0)

    def _send(self, triton_response: Any, flags: int) -> None:
        with self._lock:
            self._send_locked(triton_response, flags)

    def _send_locked(self, triton_response: Any, flags: int) -> None:
        if self.closed:
            return
        if triton_response is None:
            self.sender.send(flags=flags)
        else:
            self.sender.send(triton_response, flags=flags)
        self._last_sent = self._clock()
        self.closed = flags == FINAL


class LocalGroup:
    """An engine model of this server, called over BLS (a front.channel.Channel)."""

    steers_away = False  # Triton may hand a call to the same dead instance again

    def __init__(self, model: str, bls: BLSStreams, board: FlagBoard, check_every_s: float
                 ) -> None:
        """`check_every_s`: how long a call may be quiet before the engine holding it is
        looked for (its death ends no BLS call: see serving.bls.Responses)."""
        self.model = model
        self._bls = bls
        self._board = board
        self.check_every_s = check_every_s

    def replies(self, message: EngineRequest, reply_type: type[Message],
                caller: Caller) -> Iterator[Reply]:
        watch = HolderWatch(self._board, caller.ticket)
        watch.clear()  # the engine that takes this call records itself
        responses = Responses(self._bls, bls_request(self.model, message, batched(reply_type),
                                                     reply_type))
        while True:
            try:
                item = responses.next(timeout=self.check_every_s)
            except queue.Empty:
                if watch.engine_gone():
                    raise EngineLost(Moved(MigrationReason.ENGINE_DIED,
                                           f"{self.model} process {watch.holder()} died")
                                     ) from None
                continue
            if item is Responses.END:
                return
            if isinstance(item, Exception):
                raise item
            if not item.has_error():
                yield Reply(outputs=outputs_of(item))
                continue
            error = item.error()
            if STUB_UNHEALTHY in error.message():
                raise EngineLost(Moved(MigrationReason.INSTANCE_DOWN, error.message()))
            yield Reply(error=error.message(), kind=error_kind(error.code()))

    def live(self) -> bool:
        """Whether some instance has a live stub (stubs are tritonserver's children, as this
        one is)."""
        return any(stub.model == self.model for stub in live_stubs(os.getppid()))


class FrontModel:
    def initialize(self, args: dict[str, str]) -> None:
        margs = ModelArgs(args)
        set_up_process(margs.instance_name)
        options = margs.options(FrontOptions)
        engine_check_s = options.engine_check_interval_seconds
        models = (options.worker_model, options.prefill_model, options.decode_model)
        self.remote = remote_groups(options)
        try:
            worker, prefill, decode = served_groups(
                os.environ.get(ROLE_ENV, "all"), models, set(self.remote))
        except ValueError as e:
            raise pb_utils.TritonModelException(f"front: {e}") from None
        self._boards = BoardCache()  # prefill instances' release boards
        self.bls = BLSStreams()  # every BLS call goes through it (see serving.bls)
        self.board = FlagBoard.create()

        def group(model: str) -> Channel | None:
            if not model:
                return None
            return self.remote.get(model) or LocalGroup(model, self.bls, self.board,
                                                        engine_check_s)

        try:
            groups = EngineGroups(group(worker), group(prefill), group(decode))
        except ValueError as e:
            raise pb_utils.TritonModelException(
                f"front: {e} (prefill_model and decode_model go together)") from None
        shared = shares_cpu_cores(Path(args.get("model_repository", "")),
                                  (worker, prefill, decode), set(self.remote))
        auto = options.disaggregation_on_shared_cpu or not shared
        if shared:
            log.info("worker, prefill and decode share this machine's CPU cores: auto routing %s",
                     "disaggregates long prompts (disaggregation_on_shared_cpu)" if auto
                     else "keeps requests aggregated (the route parameter still forces a path)")
        router = Router(DisaggregationPolicy(
            disaggregation=bool(prefill),
            aggregation=bool(worker),
            min_prompt_tokens=options.disaggregation_min_prompt_tokens,
            max_inflight_prefills=options.disaggregation_max_inflight_prefills,
            auto=auto,
        ))
        try:
            limits = parse_rate_limits(options.rate_limits)
        except ValueError as e:
            raise pb_utils.TritonModelException(f"front: bad rate_limits: {e}") from None
        gates = Gates(
            AdmissionControl(AdmissionLimits(
                max_waiting_requests=options.max_waiting_requests,
                max_waiting_tokens=options.max_waiting_tokens,
            )),
            RateLimiter(limits),
            CacheSharing.parse(options.prefix_cache_shared_tenants),
        )
        self.prober = IdleProber(options.client_probe_interval_seconds)
        self.orchestrator = Orchestrator(
            gates, groups, router, self.board, self.prober,
            RequestMetrics(margs.model_name, tuple(r.value for r in RejectReason)),
            lambda handle: abandon(KVHandle.from_json(handle), self._boards),
            migration_limit=options.migration_limit)
        self.pool = ThreadPoolExecutor(
            max_workers=options.max_concurrent_requests, thread_name_prefix="request")
        self.prober.start()

    def execute(self, requests: list[Any]) -> None:
        # Requests are read here, while Triton still holds them (their input tensors live in
        # shared memory the server frees once execute returns); the threads get copies.
        for request in requests:
            sender = request.get_response_sender()
            try:
                req = TokenizedRequest.decode(inputs_of(request)).request
            except Exception as e:
                sender.send(error_response(f"front: bad request: {e}",
                                           pb_utils.TritonError.INVALID_ARG), flags=FINAL)
                continue
            self.pool.submit(self._serve, sender, req)
        return None

    def _serve(self, sender: Any, req: GenerationRequest) -> None:
        link = ClientLink(sender)
        try:
            self.orchestrator.serve(req, link)
        except Exception as e:
            log.exception("request failed")
            link.fail(f"front: {e}", ErrorKind.INTERNAL)
        finally:
            link.close()  # every request ends inside Triton too, whatever happened

    def finalize(self) -> None:
        self.prober.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.bls.close()
        for group in self.remote.values():
            group.close()
        self.board.close()
        self._boards.close()
        if Responses.reading():
            # Calls to engines that died never end, and their readers would keep this stub
            # alive after a reload.
            log.warning("%d calls to dead engines still open; this stub exits in %.0f s",
                        Responses.reading(), EXIT_GRACE_S)
            threading.Timer(EXIT_GRACE_S, os._exit, args=(0,)).start()
