"""A request's whole way through the front: admission (its tenant's cache salt, rate limits,
the waiting bounds, a cancel ticket), then the engine groups: route, prefill (with its fallback
and one retry), relay, migration. Triton-free: engine groups are Channels (front.channel) and
the client is a Client, so every branch runs in unit tests with fakes; serving/front.py is the
Triton glue around it (a BLS channel, the client's response sender).

    admit ─► refused (rate limit, too much waiting, no ticket left) ─► a clear error
          └► route ─► aggregated ─────────────────────────────► relay ─► done
                   └► disaggregated ─► prefill ─► first token ─► relay (decode, with the handle)
                                          │ failed or lost (a remote one: once more elsewhere)
                                          └─────────────────► relay (decode computes the prompt)
    relay ─► the engine is lost or says it cannot go on ─► migrate (resume_ids = tokens so far)
          ─► no engine left, or the move budget spent ─► a clear error
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from python_backends.flag_board import BoardFull, FlagBoard
from python_backends.front.admission import (
    OVERLOADED_PREFIX,
    AdmissionControl,
    RateLimiter,
    Rejected,
)
from python_backends.front.channel import Caller, Channel, EngineLost
from python_backends.front.liveness import IdleProber, Probed
from python_backends.front.migration import MigrationBudget, MigrationReason, Moved, next_engine
from python_backends.front.routing import Route, Router
from python_backends.front.stream import RequestStream
from python_backends.front.tenancy import CacheSharing
from python_backends.front.validation import InvalidRequest
from python_backends.wire import (
    ClientChunk,
    EngineRequest,
    ErrorKind,
    GenerationRequest,
    PrefillReply,
    TokenStep,
)

log = logging.getLogger(__name__)


class Client(Caller, Probed, Protocol):
    """The request's link to its client (serving.front.ClientLink in a server)."""

    def attach(self, board: FlagBoard, ticket: int, leave: Callable[[], None]) -> None:
        """The request was admitted: its cancel ticket, and `leave` to call at its first
        response (it stops waiting then)."""
        ...

    @property
    def cancelled(self) -> bool:
        """The client went away, or an error answered it: nothing more goes to it."""
        ...

    def first_response(self) -> None:
        """The request stops waiting (admission control counts it until then)."""
        ...

    def send(self, chunk: ClientChunk, final: bool) -> None: ...

    def fail(self, message: str, kind: ErrorKind) -> None:
        """End the request with an error (as data when a chunk went out before)."""
        ...


class FlowMetrics(Protocol):
    def routed(self, route: str) -> None: ...

    def migrated(self, reason: str) -> None: ...

    def unserved(self) -> None: ...

    def finished(self, state: RequestStream) -> None: ...

    def rejected(self, reason: str, tenant: str) -> None: ...


@dataclass(frozen=True)
class Gates:
    """What a request passes before any engine work: its tenant's cache salt, its tenant's
    rate limits, and the bounds on what may wait (front.admission, front.tenancy)."""

    admission: AdmissionControl
    rate_limiter: RateLimiter
    cache_sharing: CacheSharing = field(default_factory=CacheSharing)


@dataclass(frozen=True)
class EngineGroups:
    """The groups a front sends work to; None for a group it has not."""

    worker: Channel | None = None
    prefill: Channel | None = None
    decode: Channel | None = None

    def __post_init__(self) -> None:
        if (self.prefill is None) != (self.decode is None):
            raise ValueError("set both prefill and decode groups, or neither")
        if self.worker is None and self.prefill is None:
            raise ValueError("no engine group to send work to")

    def streaming(self) -> list[Channel]:
        """The groups that generate (a migrated request may go to any of them)."""
        return [g for g in (self.worker, self.decode) if g is not None]


class Orchestrator:
    """Serves requests; thread-safe (one `serve` call per request, on a thread of its own)."""

    def __init__(self, gates: Gates, groups: EngineGroups, router: Router, board: FlagBoard,
                 prober: IdleProber, metrics: FlowMetrics,
                 abandon_lease: Callable[[bytes], None], migration_limit: int = 3) -> None:
        """`board`: the front's cancel board, which engines in this server watch; `prober`
        looks after requests that sent nothing for a while (front.liveness).
        `abandon_lease`: frees a prefill's KV lease that no decode will pull (its handle)."""
        self.gates = gates
        self.groups = groups
        self.router = router
        self.board = board
        self.prober = prober
        self.metrics = metrics
        self.abandon_lease = abandon_lease
        self.migration_limit = migration_limit

    def serve(self, req: GenerationRequest, client: Client) -> None:
        """Admit `req`, route it and relay its engines' tokens to `client` until it ends; every
        way it can end (answer, error, cancellation) goes out through `client`."""
        gates = self.gates
        req = dataclasses.replace(req, cache_salt=gates.cache_sharing.salt(req.tenant,
                                                                           req.cache_salt))
        prompt_tokens = len(req.prompt_ids)
        try:
            gates.rate_limiter.check(req.tenant, prompt_tokens + req.params.max_tokens)
            gates.admission.enter(prompt_tokens)
        except Rejected as e:
            self.metrics.rejected(e.reason.value, req.tenant)
            client.fail(str(e), ErrorKind.UNAVAILABLE)
            return
        try:
            ticket = self.board.acquire()
        except BoardFull as e:
            gates.admission.leave(prompt_tokens)
            client.fail(f"{OVERLOADED_PREFIX} {e}", ErrorKind.UNAVAILABLE)
            return
        client.attach(self.board, ticket, lambda: gates.admission.leave(prompt_tokens))
        state = RequestStream(req.prompt_ids, req.stream, req.exclude_input_in_output,
                              req.params.return_log_probs, self.board.name, ticket,
                              req.params.top_log_probs)
        state.resume(req.resume_ids)
        self.prober.add(client)
        try:
            self._route(req, state, client)
        finally:
            self.prober.discard(client)
            self.board.release(ticket)
            client.first_response()

    def _route(self, req: GenerationRequest, state: RequestStream, client: Client) -> None:
        message = EngineRequest(req, self.board.name, client.ticket)
        if req.resume_ids:  # moved here from another server: an engine computes them with
            # the prompt and goes on (no prefill: there is more than a prompt to compute)
            self.metrics.routed(Route.AGGREGATED.value)
            self._generate(self._resuming_group(), dataclasses.replace(
                message, resume_ids=list(req.resume_ids)), state, client)
            return
        try:
            route = self.router.choose(req.route, len(req.prompt_ids))
        except InvalidRequest as e:
            client.fail(str(e), ErrorKind.INVALID)
            return
        if route is Route.AGGREGATED:
            assert self.groups.worker is not None  # the router chooses only configured paths
            self.metrics.routed(route.value)
            self._generate(self.groups.worker, message, state, client)
            return
        assert self.groups.decode is not None
        try:
            prefilled = self._prefill(message, client)
        finally:
            self.router.prefill_done()
        if prefilled is None and client.check_cancelled():
            return  # the prefill was dropped because the client went away
        if prefilled is None:  # the prefill group failed: decode computes the prompt itself
            self.metrics.routed("disaggregated_fallback")
            self._generate(self.groups.decode, message, state, client)
            return
        self.metrics.routed(route.value)
        client.first_response()
        chunk = state.add([prefilled.token_id], [prefilled.log_prob], prefilled.finish_reason,
                          prefilled.top_ids, prefilled.top_log_probs)
        if chunk is not None:
            self._deliver(client, state, chunk)
        if prefilled.finish_reason:
            return
        if client.check_cancelled():  # the decode step never comes: free the lease now
            if prefilled.kv_handle:
                self.abandon_lease(prefilled.kv_handle)
            return
        self._generate(self.groups.decode, dataclasses.replace(
            message, kv_handle=prefilled.kv_handle, first_token=prefilled.token_id,
            first_log_prob=prefilled.log_prob,
        ), state, client)

    def _resuming_group(self) -> Channel:
        group = self.groups.worker or self.groups.decode
        assert group is not None
        return group

    def _deliver(self, client: Client, state: RequestStream, chunk: ClientChunk) -> None:
        """Send a chunk; the one that finishes the request is counted before it goes out, so a
        client holding its answer finds the request in the metrics."""
        final = bool(chunk.finish_reason)
        if final and not client.cancelled:
            self.metrics.finished(state)
        client.send(chunk, final=final)

    def _prefill(self, message: EngineRequest, client: Client) -> PrefillReply | None:
        """The prefill group's reply; None when it failed or died (logged: decode then
        computes the prompt itself). A lost prefill is tried once more where the group steers
        away from what was lost (another server) and has something live."""
        group = self.groups.prefill
        assert group is not None
        for attempt in range(2):
            try:
                return self._prefill_once(group, message, client)
            except EngineLost as e:
                self.metrics.migrated(e.moved.reason.value)
                retry = attempt == 0 and group.steers_away and group.live()
                log.warning("prefill lost (%s), %s", e,
                            "trying another server" if retry else "decode will recompute")
                if not retry:
                    break
        return None

    @staticmethod
    def _prefill_once(group: Channel, message: EngineRequest, client: Client
                      ) -> PrefillReply | None:
        result = None
        for reply in group.replies(message, PrefillReply, client):
            if reply.error:
                log.warning("prefill failed, decode will recompute: %s", reply.error)
            elif reply.outputs:
                result = PrefillReply.decode(reply.outputs)
        return result

    def _generate(self, group: Channel, message: EngineRequest, state: RequestStream,
                  client: Client) -> None:
        """Relay an engine's tokens to the client, moving the request to a live engine when
        the one holding it is lost (front.migration)."""
        budget = MigrationBudget(self.migration_limit)
        by_model = {g.model: g for g in self.groups.streaming()}
        while True:
            moved = self._relay(group, message, state, client)
            if moved is None or client.check_cancelled():
                return
            if message.kv_handle:  # its lease is not needed any more, pulled or not
                self.abandon_lease(message.kv_handle)
            target = next_engine(group.model, [m for m in by_model if m != group.model],
                                 moved.reason, lambda m: by_model[m].live())
            if target is None or not budget.spend():
                self.metrics.unserved()
                why = "no engine instance is left" if target is None else (
                    f"moved {budget.limit} times already")
                client.fail(f"the engine serving this request failed ({moved.detail}) and {why}",
                            ErrorKind.UNAVAILABLE)
                return
            self.metrics.migrated(moved.reason.value)
            log.warning("request moved from %s to %s after %d tokens: %s", group.model, target,
                        len(state.output_ids), moved.detail)
            group = by_model[target]
            message = dataclasses.replace(message, kv_handle=None, first_token=None,
                                          first_log_prob=None,
                                          resume_ids=list(state.output_ids))

    def _relay(self, group: Channel, message: EngineRequest, state: RequestStream,
               client: Client) -> Moved | None:
        """Stream one engine call's steps to the client as chunks; a Moved when the request
        must go on elsewhere."""
        moved = None
        try:
            for reply in group.replies(message, TokenStep, client):
                if not (reply.outputs or reply.error):
                    continue  # the engine's acceptance (serving.common.accepted)
                client.first_response()  # a token or an error ends the wait
                if reply.error:  # keeps the engine's kind: a refusal is the client's
                    client.fail(reply.error, ErrorKind(reply.kind))
                    continue
                if client.check_cancelled() or not reply.outputs:
                    continue  # drain until the engine's final response
                step = TokenStep.decode(reply.outputs)
                if not step.error:
                    chunk = state.add(step.output_ids, step.output_log_probs,
                                      step.finish_reason, step.top_ids, step.top_log_probs)
                    if chunk is not None:
                        self._deliver(client, state, chunk)
                elif step.error_kind == ErrorKind.UNAVAILABLE.value:
                    moved = Moved(MigrationReason.ENGINE_UNAVAILABLE, step.error)
                else:  # keeps the engine's kind: a refusal is the client's mistake
                    client.fail(step.error, ErrorKind(step.error_kind))
        except EngineLost as e:
            return e.moved
        return moved
