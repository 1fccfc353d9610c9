"""The gateway's HTTP API (Starlette): OpenAI's /v1 endpoints, Triton's KServe generate
endpoints proxied with meaningful statuses, /health and /metrics. docs/gateway.md describes
them; gateway.service decides who serves what."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from python_backends.gateway.backends import BackendPool
from python_backends.gateway.config import GatewayConfig
from python_backends.gateway.errors import ApiError
from python_backends.gateway.metrics import GatewayMetrics
from python_backends.gateway.protocol import Generation, parse_chat, parse_completion
from python_backends.gateway.responses import Answer
from python_backends.gateway.service import BackendRequest, Call, Gateway
from python_backends.gateway.sse import EventStream
from python_backends.gateway.stops import StopMatcher
from python_backends.gateway.triton import ENSEMBLE, Piece
from python_backends.wire import CLIENT_INPUTS

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there
CLIENT_CLOSED = 499  # the status counted for a request whose client went away
SSE_DONE = "data: [DONE]\n\n"
REGION_HEADER = "x-region"  # the client's region, for latency-aware routing


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


def create_app(config: GatewayConfig, tokenizer: Any = None) -> Starlette:
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(config.engine_dir))
    pool = BackendPool(config)
    gw = Gateway(config, pool, tokenizer, GatewayMetrics())
    gw.metrics.register(pool)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await pool.start()
        yield
        await pool.close()

    async def api_error(request: Request, e: Exception) -> Response:
        if isinstance(e, HTTPException):  # no such path (404) or method (405)
            e = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}")
        assert isinstance(e, ApiError)
        body = {"error": e.message} if request.url.path.startswith("/v2/") else e.body()
        return JSONResponse(body, status_code=e.status)

    return Starlette(routes=_routes(gw), lifespan=lifespan,
                     exception_handlers={ApiError: api_error, HTTPException: api_error})


def _routes(gw: Gateway) -> list[Route]:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(gw)]})

    async def model(request: Request) -> Response:
        _check_model(gw, request.path_params["model"])
        return JSONResponse(_model_card(gw))

    async def completions(request: Request) -> Response:
        return await _openai(gw, request, parse_completion, "completions")

    async def chat(request: Request) -> Response:
        return await _openai(gw, request, parse_chat, "chat")

    async def generate(request: Request) -> Response:
        return await _kserve(gw, request, request.path_params["model"], streaming=False)

    async def generate_stream(request: Request) -> Response:
        return await _kserve(gw, request, request.path_params["model"], streaming=True)

    async def health(request: Request) -> Response:
        ok = any(v.healthy for v in gw.pool.views())
        return JSONResponse({"healthy": ok}, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return Response(gw.metrics.render(gw.pool), media_type="text/plain; version=0.0.4")

    return [Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model}", model, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v2/models/{model}/generate", generate, methods=["POST"]),
            Route("/v2/models/{model}/generate_stream", generate_stream, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"])]


def _model_card(gw: Gateway) -> dict[str, Any]:
    return {"id": gw.config.model, "object": "model", "created": 0, "owned_by": "python-backends"}


def _check_model(gw: Gateway, model: str) -> None:
    if model != gw.config.model:
        raise ApiError(404, f"model '{model}' does not exist; this gateway serves "
                       f"'{gw.config.model}' (GET /v1/models)", "model")


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 ({e.reason} at byte "
                       f"{e.start})") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


@contextlib.contextmanager
def _refusals(gw: Gateway, endpoint: str) -> Iterator[None]:
    """Counts a request the gateway refuses before any server sees it."""
    try:
        yield
    except ApiError as e:
        gw.metrics.count(endpoint, None, e.status)
        raise


async def _openai(gw: Gateway, request: Request, parse: Callable[[Any], Generation],
                  endpoint: str) -> Response:
    arrived = time.monotonic()
    with _refusals(gw, endpoint):
        gen = parse(await _json(request))
        _check_model(gw, gen.model)
        tenant = gw.tenant(dict(request.headers), gen.user)
        if gen.chat:
            gen.prompt = gw.chat_prompt(gen.messages)
        token_ids = gw.tokens(gen.prompt, tenant)
        gw.admit(tenant, len(token_ids), gen.max_tokens)
    route = gw.route_request(tenant, gen.user, request.headers.get(REGION_HEADER, ""),
                             token_ids, gen.cache_salt)
    inputs: dict[str, Any] = {"text_input": gen.prompt, "stream": True, **gen.sampling}
    if gen.max_tokens is not None:
        inputs["max_tokens"] = gen.max_tokens
    if gen.logprobs:
        inputs["return_log_probs"] = True
    if gen.cache_salt is not None:
        inputs["cache_salt"] = gen.cache_salt
    if gen.ignore_eos:
        inputs["end_id"] = -1  # the ensemble's "no end token"
    if gen.guide is not None:
        inputs["guided_decoding_guide_type"], inputs["guided_decoding_guide"] = gen.guide
    upstream = BackendRequest(inputs, {"tenant": tenant}, route, endpoint)
    answer = Answer(gen, lambda t: str(gw.tokenizer.decode([t])))
    if gen.stream:
        call = await gw.open(upstream, arrived)
        return EventStream(_sse(gw, call, answer, endpoint))

    async def collect(call: Call) -> None:
        async for d in _relay(call, answer):
            _add(answer, d)

    await _whole(gw, request, upstream, arrived, collect)
    return JSONResponse(answer.whole())


async def _relay(call: Call, answer: Answer) -> AsyncIterator[Delta]:
    """The call's pieces as what the client may see: stop strings cut the text (and end the
    call), held-back text goes out at the end."""
    stops = StopMatcher(answer.gen.stops, answer.gen.include_stop)
    async for piece in call.pieces():
        answer.prompt_tokens = piece.num_input_tokens or answer.prompt_tokens
        answer.completion_tokens = piece.num_output_tokens or answer.completion_tokens
        text = stops.feed(piece.text)
        finish = "stop" if stops.stopped else (piece.finish_reason or None)
        if finish and not stops.stopped:
            text += stops.flush()
        yield Delta(text, piece.token_ids, piece.logprobs, finish)
        if finish:
            return


def _add(answer: Answer, d: Delta) -> None:
    answer.text += d.text
    answer.token_ids += d.token_ids
    answer.logprobs += d.logprobs
    answer.finish_reason = d.finish_reason


async def _sse(gw: Gateway, call: Call, answer: Answer, endpoint: str) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        first = True
        async for d in _relay(call, answer):
            if d.text or d.finish_reason or first:
                event = answer.chunk(d.text, d.token_ids, d.logprobs, d.finish_reason, first)
                yield f"data: {json.dumps(event)}\n\n"
                first = False
            _add(answer, d)
        if answer.gen.include_usage:
            yield f"data: {json.dumps(answer.usage_chunk())}\n\n"

    async for event in _counted(gw, call, endpoint, events(),
                                lambda e: f"data: {json.dumps(e.body())}\n\n"):
        yield event
    yield SSE_DONE


async def _counted(gw: Gateway, call: Call, endpoint: str, events: AsyncIterator[str],
                   error_event: Callable[[ApiError], str]) -> AsyncIterator[str]:
    """A streamed answer's events, its status counted once (200; the error's, sent as a last
    event since the stream has begun; 499 when the client went away) and the call closed
    however the stream ends: a client that goes away ends the request on the server."""
    try:
        async for event in events:
            yield event
        gw.metrics.count(endpoint, call.backend, 200)
    except (GeneratorExit, asyncio.CancelledError):
        gw.metrics.count(endpoint, call.backend, CLIENT_CLOSED)
        raise
    except Exception as e:
        error = e if isinstance(e, ApiError) else _internal(e)
        gw.metrics.count(endpoint, call.backend, error.status)
        yield error_event(error)
    finally:
        await call.close()


def _internal(e: Exception) -> ApiError:
    log.exception("gateway bug", exc_info=e)
    return ApiError(500, f"the gateway failed: {type(e).__name__}: {e}")


async def _whole(gw: Gateway, request: Request, upstream: BackendRequest, arrived: float,
                 consume: Callable[[Call], Coroutine[Any, Any, None]]) -> None:
    """Open a call for `upstream` and `consume` its whole answer; a client that goes away
    meanwhile, while a server is chosen included, cancels it on the server (Triton's own
    /generate cannot notice that, docs/operations.md). Counts the status once and closes the
    call."""
    endpoint = upstream.endpoint
    call: Call | None = None

    async def work() -> None:
        nonlocal call
        call = await gw.open(upstream, arrived)
        await consume(call)

    task = asyncio.create_task(work())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                gw.metrics.count(endpoint, call.backend if call else None, CLIENT_CLOSED)
                raise ApiError(CLIENT_CLOSED, "the client went away")
        try:
            task.result()
        except ApiError as e:
            if call is not None:  # a refusal before any call was counted where it happened
                gw.metrics.count(endpoint, call.backend, e.status)
            raise
        assert call is not None
        gw.metrics.count(endpoint, call.backend, 200)
    finally:
        if not task.done():
            task.cancel()
        if call is not None:
            await call.close()


async def _kserve(gw: Gateway, request: Request, model: str, streaming: bool) -> Response:
    """Triton's generate endpoints, proxied: the body's inputs and parameters as Triton reads
    them, the outputs as Triton writes them, and 429 / 503 where Triton says 400."""
    arrived = time.monotonic()
    endpoint = "generate_stream" if streaming else "generate"
    with _refusals(gw, endpoint):
        if model != ENSEMBLE:
            raise ApiError(404, f"unknown model '{model}': the generate endpoints serve "
                           f"'{ENSEMBLE}'")
        body = await _json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        inputs = {k: v for k, v in body.items() if k in CLIENT_INPUTS}
        parameters = {k: v for k, v in body.items() if k not in CLIENT_INPUTS}
        tenant = gw.tenant(dict(request.headers), parameters.get("tenant"))
        parameters["tenant"] = tenant
        text = inputs.get("text_input")
        token_ids = gw.tokens(text, tenant) if isinstance(text, str) else []
        gw.admit(tenant, len(token_ids), inputs.get("max_tokens"))
    salt = inputs.get("cache_salt")
    route = gw.route_request(tenant, None, request.headers.get(REGION_HEADER, ""), token_ids,
                             salt if isinstance(salt, str) else None)
    upstream = BackendRequest({**inputs, "stream": streaming}, parameters, route, endpoint)
    if streaming:
        call = await gw.open(upstream, arrived)
        events = _counted(gw, call, endpoint, _kserve_events(call),
                          lambda e: f"data: {json.dumps({'error': e.message})}\n\n")
        return EventStream(events)
    pieces: list[Piece] = []

    async def collect(call: Call) -> None:  # the whole answer is the first piece
        pieces.extend([p async for p in call.pieces()])

    await _whole(gw, request, upstream, arrived, collect)
    return JSONResponse(_kserve_outputs(pieces[-1]))


async def _kserve_events(call: Call) -> AsyncIterator[str]:
    async for piece in call.pieces():
        yield f"data: {json.dumps(_kserve_outputs(piece))}\n\n"


def _kserve_outputs(piece: Piece) -> dict[str, Any]:
    return {"model_name": ENSEMBLE, "model_version": "1", "text_output": piece.text,
            "finish_reason": piece.finish_reason, "num_input_tokens": piece.num_input_tokens,
            "num_output_tokens": piece.num_output_tokens, "output_ids": piece.token_ids,
            "output_log_probs": piece.logprobs}
