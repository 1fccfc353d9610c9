"""The gateway's core, free of HTTP: who the caller is, whether its tenant may send now, which
server serves the request, the next server when one fails it before its first token, and
another one, from the tokens so far, when one breaks its stream mid-way. The HTTP layer
(gateway.app) only shapes requests and answers."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from python_backends.front.admission import RateLimiter, Rejected
from python_backends.front.validation import DEFAULT_MAX_TOKENS
from python_backends.gateway import tools
from python_backends.gateway.backends import Backend, BackendPool
from python_backends.gateway.config import GatewayConfig
from python_backends.gateway.errors import ApiError
from python_backends.gateway.metrics import GatewayMetrics
from python_backends.gateway.routing import (
    Canary,
    LatencyAware,
    LeastLoaded,
    PrefixAware,
    Residency,
    RouteRequest,
    RoutingPolicy,
)
from python_backends.gateway.triton import Piece, stream
from python_backends.wire import DEFAULT_TENANT

BEARER = "bearer "
log = logging.getLogger(__name__)


@dataclass
class BackendRequest:
    """What the gateway sends a server, kept to send it again elsewhere."""

    inputs: dict[str, Any]
    parameters: dict[str, str]
    route: RouteRequest
    endpoint: str


@dataclass
class Call:
    """A request a server accepted: its first piece, and the rest to read. A stream the
    server breaks after that (it died, or has no engine left) goes on on another server from
    the tokens received so far (`Gateway.move`): the reader sees one stream. `close` ends the
    request on the server too when the reader stops early."""

    gateway: Gateway
    request: BackendRequest
    backend: Backend
    first: Piece
    rest: AsyncIterator[Piece]
    token_ids: list[int] = field(default_factory=list)  # received so far, over all servers
    moves: int = 0
    _closed: bool = False

    async def pieces(self) -> AsyncIterator[Piece]:
        piece: Piece | None = self.first
        while piece is not None:
            self.token_ids += piece.token_ids
            yield piece
            if piece.finish_reason:
                return
            piece = await self._next()

    async def _next(self) -> Piece | None:
        try:
            return await anext(self.rest)
        except StopAsyncIteration:
            return None
        except ApiError as e:
            if not e.retryable or not self.request.inputs.get("stream"):
                raise
            return await self.gateway.move(self, e)

    def switch(self, backend: Backend, rest: AsyncIterator[Piece]) -> None:
        """Go on reading from another server (the failed one's request is over)."""
        self.backend.in_flight -= 1
        self.backend, self.rest = backend, rest
        self.moves += 1

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.backend.in_flight -= 1
            with contextlib.suppress(Exception):
                await self.rest.aclose()  # type: ignore[attr-defined]


class Gateway:
    def __init__(self, config: GatewayConfig, pool: BackendPool, tokenizer: Any,
                 metrics: GatewayMetrics, policy: RoutingPolicy | None = None) -> None:
        self.config = config
        self.pool = pool
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.policy = policy or build_policy(config)
        self.rate_limiter = RateLimiter(config.rate_limits)

    def tenant(self, headers: dict[str, str], user: str | None) -> str:
        """The caller's tenant: its API key's, when keys are configured (401 otherwise);
        else the request's `user`, else the default tenant."""
        if not self.config.api_keys:
            return user or DEFAULT_TENANT
        key = headers.get("x-api-key") or ""
        auth = headers.get("authorization", "")
        if auth.lower().startswith(BEARER):
            key = auth[len(BEARER):].strip()
        tenant = self.config.api_keys.get(key)
        if tenant is None:
            raise ApiError(401, "a valid API key is required (Authorization: Bearer <key>)"
                           if not key else "invalid API key")
        return tenant

    def admit(self, tenant: str, prompt_tokens: int, max_tokens: int | None,
              choices: int = 1) -> None:
        """The tenant's rate limits, charged as the front charges them (requests, and prompt
        plus max_tokens tokens, per choice): 429 when over."""
        try:
            self.rate_limiter.check(
                tenant, prompt_tokens + choices * (max_tokens or DEFAULT_MAX_TOKENS))
        except Rejected as e:
            raise ApiError(429, str(e)) from None

    def tokens(self, prompt: str | list[int], tenant: str) -> list[int]:
        """The prompt's token ids when something here reads them (the tenant's token rate
        limit, prefix-aware routing), else none: tokenizing blocks the event loop, and the
        server tokenizes the prompt anyway."""
        if isinstance(prompt, list):
            return prompt
        if not (self.rate_limiter.limit(tenant).tokens_per_s
                or self.config.routing.policy == "prefix_aware"):
            return []
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def route_request(self, tenant: str, user: str | None, region: str, token_ids: list[int],
                      cache_salt: str | None) -> RouteRequest:
        """What routing needs of a request; the prompt only when a policy reads it."""
        prefix_aware = self.config.routing.policy == "prefix_aware"
        return RouteRequest(tenant=tenant, user=user or "", region=region,
                            token_ids=tuple(token_ids) if prefix_aware else (),
                            cache_salt=cache_salt or "")

    def chat_prompt(self, messages: list[dict[str, Any]], functions: list[dict[str, Any]],
                    tool_choice: str) -> str:
        """The conversation through the checkpoint's chat template, with the tools unless
        tool_choice is none (gateway.tools)."""
        functions = functions if tool_choice != "none" else []
        native = tools.template_takes_tools(self.tokenizer)
        extra = {"tools": [{"type": "function", "function": f} for f in functions]} if (
            native and functions) else {}
        try:
            return str(self.tokenizer.apply_chat_template(
                tools.conversation(messages, functions, native), tokenize=False,
                add_generation_prompt=True, **extra))
        except Exception as e:  # a template that rejects the conversation (roles, order)
            raise ApiError(400, f"invalid request field 'messages': {e}", "messages") from None

    async def open(self, request: BackendRequest, arrived: float, prefer: str = "") -> Call:
        """Send the request to the best server that takes it (`prefer`, a server's name,
        first when it is in the running): a server that fails it before its first piece with
        a retryable error (down, overloaded, no engine left) passes it to the next, up to
        `max_attempts` servers."""
        self.metrics.overhead.observe(time.monotonic() - arrived)
        backend, first, rest = await self._first_piece(request, request.inputs, exclude=(),
                                                       prefer=prefer)
        return Call(self, request, backend, first, rest)

    async def move(self, call: Call, error: ApiError) -> Piece:
        """The server streaming `call` failed mid-way: send the prompt and the tokens so far
        (`resume_ids`) to another server and return its first piece; the client's stream goes
        on with no gap and no duplicate. Raises `error` past the migration limit."""
        failed = call.backend.name
        self.metrics.count(call.request.endpoint, call.backend, error.status)
        if call.moves >= self.config.migration_limit:
            raise ApiError(error.status, f"{error.message} (moved {call.moves} times already)")
        inputs = {**call.request.inputs, "resume_ids": list(call.token_ids)}
        backend, first, rest = await self._first_piece(
            call.request, inputs, exclude=() if error.server_ok else (failed,))
        self.metrics.migrations.labels(backend=backend.name).inc()
        log.warning("stream moved from %s to %s after %d tokens: %s", failed, backend.name,
                    len(call.token_ids), error.message)
        call.switch(backend, rest)
        return first

    async def _first_piece(self, request: BackendRequest, inputs: dict[str, Any],
                           exclude: tuple[str, ...], prefer: str = "",
                           ) -> tuple[Backend, Piece, AsyncIterator[Piece]]:
        route = request.route
        ranked = [v for v in self.policy.rank(self.pool.views(), route)
                  if v.name not in exclude]
        ranked.sort(key=lambda v: v.name != prefer)  # stable: the policy's order otherwise
        if not ranked:
            raise ApiError(503, "no healthy backend server" + (
                f" in the regions tenant '{route.tenant}' may use"
                if route.tenant in self.config.routing.residency else ""))
        error = ApiError(503, "no healthy backend server")
        for attempt, view in enumerate(ranked[:self.config.max_attempts]):
            backend = self.pool.backends[view.name]
            if attempt:
                self.metrics.retries.labels(backend=backend.name).inc()
            backend.in_flight += 1
            rest = stream(backend.client, inputs, request.parameters, backend.headers,
                          self.config.request_timeout_s, backend.breaker,
                          self.tokenizer if self.config.pipeline == "front" else None)
            try:
                first = await anext(rest)
            except ApiError as e:
                backend.in_flight -= 1
                await rest.aclose()  # type: ignore[attr-defined]
                self.metrics.count(request.endpoint, backend, e.status)
                if not e.retryable:
                    raise
                error = e
                continue
            except BaseException:
                backend.in_flight -= 1
                await rest.aclose()  # type: ignore[attr-defined]
                raise
            self.policy.record(backend.name, route)
            return backend, first, rest
        raise error


def build_policy(config: GatewayConfig) -> RoutingPolicy:
    """The configured chain: residency filters, the canary splits, latency prefers the
    client's region, and least-loaded or prefix-aware orders (docs/gateway.md)."""
    r = config.routing
    policy: RoutingPolicy = (PrefixAware(r.overlap_weight,
                                         default_block_size=r.prefix_block_tokens)
                             if r.policy == "prefix_aware"
                             else LeastLoaded())
    if r.latency_bound_s is not None:
        policy = LatencyAware(policy, r.latency_bound_s)
    if r.canary_fraction > 0:
        policy = Canary(policy, r.canary_fraction)
    if r.residency:
        policy = Residency(policy, {t: frozenset(rs) for t, rs in r.residency.items()})
    return policy
