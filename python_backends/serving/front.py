"""`front`: the decoupled BLS front of every request.

It routes each tokenized request (see front.routing): to the aggregated `worker` group, or
to the `prefill` group (first token and KV handle; the token is sent at once) and then the
`decode` group with the handle. It turns the engine's per-step responses into client chunks
(one per engine step when streaming, one in all otherwise) and watches for client
cancellation, which it relays to the engine through the cancel board (and to a prefill lease,
which it abandons).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
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
from python_backends.flag_board import BoardCache, BoardFull, FlagBoard
from python_backends.front.admission import (
    OVERLOADED_PREFIX,
    AdmissionControl,
    AdmissionLimits,
    RateLimiter,
    Rejected,
    RejectReason,
    parse_rate_limits,
)
from python_backends.front.liveness import HolderWatch, IdleProber
from python_backends.front.migration import (
    STUB_UNHEALTHY,
    MigrationBudget,
    MigrationReason,
    Moved,
    next_engine,
)
from python_backends.front.remote import RemoteCall, RemoteGroup, Reply, ServerSet
from python_backends.front.routing import Route, Router, RoutingPolicy
from python_backends.front.stream import RequestStream
from python_backends.front.tenancy import CacheSharing
from python_backends.front.validation import InvalidRequest
from python_backends.kv_transfer.base import KVHandle, abandon
from python_backends.procfs import live_stubs
from python_backends.serving.bls import Answers, BLSStreams
from python_backends.serving.common import (
    FINAL,
    ModelArgs,
    bls_request,
    error_response,
    inputs_of,
    outputs_of,
    response,
)
from python_backends.serving.metrics import AdmissionMetrics, RequestMetrics
from python_backends.wire import (
    ClientChunk,
    EngineRequest,
    ErrorKind,
    GenerationRequest,
    Message,
    PrefillAnswer,
    TokenizedRequest,
    TokenStep,
)

log = logging.getLogger(__name__)
EXIT_GRACE_S = 10.0  # after finalize, for a stub whose calls to dead engines never end


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


def remote_groups(margs: ModelArgs, models: list[str]) -> dict[str, RemoteGroup]:
    """The engine groups other servers serve: model -> its group, for each model whose
    `<model>_servers` parameter, else $LLM_<MODEL>_SERVERS, names servers (host:port,... or
    dns:NAME:PORT; see front.remote). Calls carry this server's API key, if it has one."""
    key = os.environ.get(API_KEY_ENV)
    headers = {GRPC_API_KEY_HEADER: key} if key else None
    groups = {}
    for model in filter(None, models):
        spec = (margs.param(f"{model}_servers")
                or os.environ.get(f"LLM_{model.upper()}_SERVERS", ""))
        if not spec:
            continue
        try:
            groups[model] = RemoteGroup(model, ServerSet(spec), headers)
        except ValueError as e:
            raise pb_utils.TritonModelException(f"front: {model}_servers: {e}") from None
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
                self.board.is_cancelled(self.ticket) or self.sender.is_cancelled()):
            self.cancelled = True
            self.board.cancel(self.ticket)
        return self.cancelled

    def send(self, chunk: ClientChunk, final: bool) -> None:
        self._send(response(chunk, batched=True), FINAL if final else 0)
        if not final:
            self._streamed = chunk

    def fail(self, message: str, code: Any) -> None:
        if self._streamed is None:
            self._send(error_response(message, code), FINAL)
        else:
            self._send(response(self._streamed.failed(message), batched=True), FINAL)
        self.cancelled = True  # nothing more goes to this client

    def close(self) -> None:
        """The final flag alone, unless a final response went out already."""
        self._send(None, FINAL)

    def idle_for(self, now: float) -> float:
        return now - self._last_sent

    def probe(self) -> None:
        if self.board is not None:
            self._send(response(ClientChunk.probe(self.board.name, self.ticket), batched=True), 0)

    def _send(self, answer: Any, flags: int) -> None:
        with self._lock:
            if self.closed:
                return
            if answer is None:
                self.sender.send(flags=flags)
            else:
                self.sender.send(answer, flags=flags)
            self._last_sent = self._clock()
            self.closed = flags == FINAL


class _EngineLost(Exception):
    def __init__(self, moved: Moved) -> None:
        super().__init__(moved.detail)
        self.moved = moved


class FrontModel:
    def initialize(self, args: dict[str, str]) -> None:
        margs = ModelArgs(args)
        set_up_process(margs.instance_name)
        self.worker_model = margs.param("worker_model", "worker")
        self.prefill_model = margs.param("prefill_model")
        self.decode_model = margs.param("decode_model")
        self.remote = remote_groups(
            margs, [self.worker_model, self.prefill_model, self.decode_model])
        try:
            self.worker_model, self.prefill_model, self.decode_model = served_groups(
                os.environ.get(ROLE_ENV, "all"),
                (self.worker_model, self.prefill_model, self.decode_model), set(self.remote))
        except ValueError as e:
            raise pb_utils.TritonModelException(f"front: {e}") from None
        if bool(self.prefill_model) != bool(self.decode_model):
            raise pb_utils.TritonModelException(
                "front: set both prefill_model and decode_model, or neither"
            )
        self.router = Router(RoutingPolicy(
            disaggregation=bool(self.prefill_model),
            aggregation=bool(self.worker_model),
            min_prompt_tokens=margs.int_param("disaggregation_min_prompt_tokens", 256),
            max_inflight_prefills=margs.int_param("disaggregation_max_inflight_prefills", 8),
        ))
        self._boards = BoardCache()  # prefill instances' release boards
        self.bls = BLSStreams()  # every BLS call goes through it (see serving.bls)
        self.board = FlagBoard.create()
        self.metrics = RequestMetrics(margs.model_name)
        self.admission_metrics = AdmissionMetrics(
            margs.model_name, tuple(r.value for r in RejectReason)
        )
        self.admission = AdmissionControl(AdmissionLimits(
            max_waiting_requests=margs.int_param("max_waiting_requests", 256),
            max_waiting_tokens=margs.int_param("max_waiting_tokens", 65536),
        ))
        try:
            limits = parse_rate_limits(margs.param("rate_limits"))
        except ValueError as e:
            raise pb_utils.TritonModelException(f"front: bad rate_limits: {e}") from None
        self.rate_limiter = RateLimiter(limits)
        self.cache_sharing = CacheSharing.parse(margs.param("prefix_cache_shared_tenants"))
        self.pool = ThreadPoolExecutor(
            max_workers=margs.int_param("max_concurrent_requests", 1024),
            thread_name_prefix="request",
        )
        self.migration_limit = margs.int_param("migration_limit", 3)
        self.engine_check_s = float(margs.param("engine_check_interval_seconds", "0.5"))
        self.prober = IdleProber(float(margs.param("client_probe_interval_seconds", "1.0")))
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
            self._serve_one(link, req)
        except Exception as e:
            log.exception("request failed")
            link.fail(f"front: {e}", pb_utils.TritonError.INTERNAL)
        finally:
            link.close()  # every request ends inside Triton too, whatever happened

    def _serve_one(self, link: ClientLink, req: GenerationRequest) -> None:
        req = dataclasses.replace(req, cache_salt=self.cache_sharing.salt(req.tenant,
                                                                          req.cache_salt))
        prompt_tokens = len(req.prompt_ids)
        try:
            self.rate_limiter.check(req.tenant, prompt_tokens + req.params.max_tokens)
            self.admission.enter(prompt_tokens)
        except Rejected as e:
            self.admission_metrics.rejected(e.reason.value, req.tenant)
            link.fail(str(e), pb_utils.TritonError.UNAVAILABLE)
            return
        try:
            ticket = self.board.acquire()
        except BoardFull as e:
            self.admission.leave(prompt_tokens)
            link.fail(f"{OVERLOADED_PREFIX} {e}", pb_utils.TritonError.UNAVAILABLE)
            return
        link.attach(self.board, ticket, lambda: self.admission.leave(prompt_tokens))
        state = RequestStream(req.prompt_ids, req.stream, req.exclude_input_in_output,
                              req.params.return_log_probs, self.board.name, ticket)
        state.resume(req.resume_ids)
        self.prober.add(link)
        try:
            self._route(req, state, link)
        finally:
            self.prober.discard(link)
            self.board.release(ticket)
            link.first_response()

    def _deliver(self, link: ClientLink, state: RequestStream, chunk: ClientChunk) -> None:
        """Send a chunk; the one that finishes the request is counted before it goes out, so a
        client holding its answer finds the request in the metrics."""
        final = bool(chunk.finish_reason)
        if final and not link.cancelled:
            self.metrics.finished(state)
        link.send(chunk, final=final)

    def _route(self, req: GenerationRequest, state: RequestStream, link: ClientLink) -> None:
        if req.resume_ids:  # moved here from another server: an engine computes them with
            # the prompt and goes on (no prefill: there is more than a prompt to compute)
            self.metrics.routed(Route.AGGREGATED.value)
            self._generate(self.worker_model or self.decode_model, EngineRequest(
                req, self.board.name, link.ticket, resume_ids=list(req.resume_ids)), state, link)
            return
        try:
            route = self.router.choose(req.route, len(req.prompt_ids))
        except InvalidRequest as e:
            link.fail(str(e), pb_utils.TritonError.INVALID_ARG)
            return
        engine_request = EngineRequest(req, self.board.name, link.ticket)
        if route is Route.AGGREGATED:
            self.metrics.routed(route.value)
            self._generate(self.worker_model, engine_request, state, link)
            return
        try:
            prefilled = self._prefill(engine_request, link)
        finally:
            self.router.prefill_done()
        if prefilled is None and link.check_cancelled():
            return  # the prefill was dropped because the client went away
        if prefilled is None:  # the prefill group failed: decode computes the prompt itself
            self.metrics.routed("disaggregated_fallback")
            self._generate(self.decode_model, engine_request, state, link)
            return
        self.metrics.routed(route.value)
        link.first_response()
        chunk = state.add([prefilled.token_id], [prefilled.log_prob], prefilled.finish_reason)
        if chunk is not None:
            self._deliver(link, state, chunk)
        if prefilled.finish_reason:
            return
        if link.check_cancelled():  # the decode step never comes: free the lease now
            abandon(KVHandle.from_json(prefilled.kv_handle), self._boards)
            return
        self._generate(self.decode_model, dataclasses.replace(
            engine_request, kv_handle=prefilled.kv_handle, first_token=prefilled.token_id,
            first_log_prob=prefilled.log_prob,
        ), state, link)

    def _answers(self, model: str, message: EngineRequest, answer: type[Message],
                 link: ClientLink) -> Iterator[Reply]:
        """The answers of one engine call of `message` to `model`, local (BLS) or on another
        server. Raises _EngineLost when the engine holding the request died, or its instance
        or server is not there to take it."""
        batched = answer is PrefillAnswer  # prefill takes dynamic batches; engines do not
        group = self.remote.get(model)
        if group is not None:
            yield from self._remote_answers(group, message, batched, answer, link)
            return
        watch = HolderWatch(self.board, link.ticket)
        watch.clear()  # the engine that takes this call records itself
        answers = Answers(self.bls, bls_request(model, message, batched, answer))
        while True:
            try:
                item = answers.next(timeout=self.engine_check_s)
            except queue.Empty:
                if watch.engine_gone():
                    raise _EngineLost(Moved(MigrationReason.ENGINE_DIED,
                                            f"{model} process {watch.holder()} died")) from None
                continue
            if item is Answers.END:
                return
            if isinstance(item, Exception):
                raise item
            if not item.has_error():
                yield Reply(outputs=outputs_of(item))
                continue
            error = item.error()
            if STUB_UNHEALTHY in error.message():
                raise _EngineLost(Moved(MigrationReason.INSTANCE_DOWN, error.message()))
            yield Reply(error=error.message(), kind=error_kind(error.code()))

    def _remote_answers(self, group: RemoteGroup, message: EngineRequest, batched: bool,
                        answer: type[Message], link: ClientLink) -> Iterator[Reply]:
        """A call on another server. No cancel board crosses servers: when the client goes
        away the front cancels the call's stream, which the engine sees as a cancellation."""
        message = dataclasses.replace(message, cancel_board=None, cancel_ticket=0)
        call = group.call(message.encode(batched), answer.names())
        while True:
            if link.check_cancelled():
                call.cancel()
            try:
                reply = call.next(timeout=self.engine_check_s)
            except queue.Empty:
                continue
            if reply is RemoteCall.END:
                return
            if reply.unavailable:
                raise _EngineLost(Moved(MigrationReason.INSTANCE_DOWN, reply.error))
            yield reply

    def _prefill(self, engine_request: EngineRequest, link: ClientLink) -> PrefillAnswer | None:
        """The prefill group's answer; None when it failed or died (logged: decode then
        computes the prompt itself). A remote prefill server that is gone is tried once more
        on another server of its group."""
        group = self.remote.get(self.prefill_model)
        for attempt in range(2):
            try:
                return self._prefill_once(engine_request, link)
            except _EngineLost as e:
                self.metrics.migrated(e.moved.reason.value)
                retry = attempt == 0 and group is not None and group.live()
                log.warning("prefill lost (%s), %s", e,
                            "trying another server" if retry else "decode will recompute")
                if not retry:
                    break
        return None

    def _prefill_once(self, engine_request: EngineRequest, link: ClientLink
                      ) -> PrefillAnswer | None:
        result = None
        for reply in self._answers(self.prefill_model, engine_request, PrefillAnswer, link):
            if reply.error:
                log.warning("prefill failed, decode will recompute: %s", reply.error)
            elif reply.outputs:
                result = PrefillAnswer.decode(reply.outputs)
        return result

    def _generate(self, model: str, engine_request: EngineRequest, state: RequestStream,
                  link: ClientLink) -> None:
        """Relay an engine's tokens to the client, moving the request to a live engine when
        the one holding it dies (front.migration)."""
        budget = MigrationBudget(self.migration_limit)
        while True:
            moved = self._relay(model, engine_request, state, link)
            if moved is None or link.check_cancelled():
                return
            if engine_request.kv_handle:  # its lease is not needed any more, pulled or not
                abandon(KVHandle.from_json(engine_request.kv_handle), self._boards)
            target = next_engine(model, [m for m in (self.worker_model, self.decode_model)
                                         if m != model], moved.reason, self._live)
            if target is None or not budget.spend():
                self.metrics.unserved()
                why = "no engine instance is left" if target is None else (
                    f"moved {budget.limit} times already")
                link.fail(f"the engine serving this request failed ({moved.detail}) and {why}",
                          pb_utils.TritonError.UNAVAILABLE)
                return
            self.metrics.migrated(moved.reason.value)
            log.warning("request moved from %s to %s after %d tokens: %s", model, target,
                        len(state.output_ids), moved.detail)
            model = target
            engine_request = dataclasses.replace(
                engine_request, kv_handle=None, first_token=None, first_log_prob=None,
                resume_ids=list(state.output_ids))

    def _live(self, model: str) -> bool:
        """Whether some instance of `model` has a live stub (stubs are tritonserver's
        children, as this one is), or for a remote group, whether some server is up."""
        group = self.remote.get(model)
        if group is not None:
            return group.live()
        return any(stub.model == model for stub in live_stubs(os.getppid()))

    def _relay(self, model: str, engine_request: EngineRequest, state: RequestStream,
               link: ClientLink) -> Moved | None:
        """Stream one engine call's responses to the client as chunks; a Moved when the
        request must go on elsewhere."""
        moved = None
        try:
            for reply in self._answers(model, engine_request, TokenStep, link):
                if not (reply.outputs or reply.error):
                    continue  # the engine's acceptance (serving.common.accepted)
                link.first_response()  # a token or an error ends the wait
                if reply.error:  # keeps the engine's kind: a refusal is the client's
                    link.fail(reply.error, error_code(reply.kind))
                    continue
                if link.check_cancelled() or not reply.outputs:
                    continue  # drain until the engine's final response
                step = TokenStep.decode(reply.outputs)
                if not step.error:
                    chunk = state.add(step.output_ids, step.output_log_probs,
                                      step.finish_reason)
                    if chunk is not None:
                        self._deliver(link, state, chunk)
                elif step.error_kind == ErrorKind.UNAVAILABLE.value:
                    moved = Moved(MigrationReason.ENGINE_UNAVAILABLE, step.error)
                else:  # keeps the engine's kind: a refusal is the client's mistake
                    link.fail(step.error, error_code(step.error_kind))
        except _EngineLost as e:
            return e.moved
        return moved

    def finalize(self) -> None:
        self.prober.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.bls.close()
        for group in self.remote.values():
            group.close()
        self.board.close()
        self._boards.close()
        if Answers.reading():
            # Calls to engines that died never end, and their readers kept this stub from
            # exiting once finalized (an old front version then lingered after a reload).
            log.warning("%d calls to dead engines still open; this stub exits in %.0f s",
                        Answers.reading(), EXIT_GRACE_S)
            threading.Timer(EXIT_GRACE_S, os._exit, args=(0,)).start()
