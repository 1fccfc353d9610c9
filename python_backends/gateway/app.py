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
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from python_backends.gateway.backends import Backend, BackendPool
from python_backends.gateway.config import GatewayConfig
from python_backends.gateway.errors import ApiError
from python_backends.gateway.metrics import GatewayMetrics
from python_backends.gateway.protocol import Generation, parse_chat, parse_completion
from python_backends.gateway.responses import Answer, Choice
from python_backends.gateway.service import BackendRequest, Call, Gateway
from python_backends.gateway.sse import EventStream
from python_backends.gateway.stops import StopMatcher
from python_backends.gateway.tools import ToolCalls
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
    top: list[list[tuple[int, float]]]  # each token's alternatives (with top_logprobs)
    finish_reason: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # completed by this delta


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
            gen.prompts = [gw.chat_prompt(gen.messages, gen.tools, gen.tool_choice)]
        token_ids = [gw.tokens(p, tenant) for p in gen.prompts]
        gw.admit(tenant, sum(map(len, token_ids)), gen.max_tokens,
                 choices=len(gen.prompts) * gen.best_of)
    route = gw.route_request(tenant, gen.user, request.headers.get(REGION_HEADER, ""),
                             token_ids[0], gen.cache_salt)
    answer = Answer(gen, lambda t: str(gw.tokenizer.decode([t])))
    # per prompt, its choices' requests: the first is sent alone, the others once it has
    # answered, to the same server, where the prompt's KV blocks are in the prefix cache
    requests = []
    for i, prompt in enumerate(gen.prompts):
        requests.append([BackendRequest(_inputs(gen, prompt, j), {"tenant": tenant}, route,
                                        endpoint) for j in range(gen.best_of)])
        answer.choices += [Choice(i * gen.best_of + j, i, tools=_tool_reader(gen))
                           for j in range(gen.best_of)]
    echoes = [_echo(gw, gen, p) for p in gen.prompts]
    if gen.stream:
        calls = await _open_calls(gw, requests, arrived)
        return EventStream(_sse(gw, calls, answer, endpoint, echoes))

    async def collect(calls: list[Call]) -> None:
        calls += await _open_calls(gw, requests, arrived)

        async def one(call: Call, choice: Choice) -> None:
            choice.text = echoes[choice.prompt_index]
            async for d in _relay(call, choice, gen):
                _add(choice, d)

        await asyncio.gather(*(one(c, ch) for c, ch in zip(calls, answer.choices, strict=True)))

    await _whole(gw, request, endpoint, collect)
    return JSONResponse(answer.whole(_best(answer)))


def _inputs(gen: Generation, prompt: str | list[int], choice: int) -> dict[str, Any]:
    """The ensemble inputs of one choice of `prompt`."""
    inputs: dict[str, Any] = {"stream": True, **gen.sampling}
    inputs["text_input" if isinstance(prompt, str) else "input_ids"] = prompt
    if "seed" in inputs:  # choices of one seeded request differ, and repeat as a whole
        inputs["seed"] += choice
    if gen.max_tokens is not None:
        inputs["max_tokens"] = gen.max_tokens
    if gen.logprobs or gen.best_of > gen.n:  # best_of ranks by cumulative log-probability
        inputs["return_log_probs"] = True
    if gen.top_logprobs:
        inputs["top_log_probs"] = gen.top_logprobs
    if gen.cache_salt is not None:
        inputs["cache_salt"] = gen.cache_salt
    if gen.ignore_eos:
        inputs["end_id"] = -1  # the ensemble's "no end token"
    if gen.guide is not None:
        inputs["guided_decoding_guide_type"], inputs["guided_decoding_guide"] = gen.guide
    return inputs


def _tool_reader(gen: Generation) -> ToolCalls | None:
    if not gen.chat or gen.tool_choice == "none":
        return None
    return ToolCalls(frozenset(f["name"] for f in gen.tools))


def _echo(gw: Gateway, gen: Generation, prompt: str | list[int]) -> str:
    """completions `echo`: the text each choice of `prompt` begins with."""
    if not gen.echo:
        return ""
    return prompt if isinstance(prompt, str) else str(gw.tokenizer.decode(prompt))


def _best(answer: Answer) -> list[Choice]:
    """`best_of`: per prompt, the n choices of highest cumulative log-probability."""
    gen = answer.gen
    if gen.best_of == gen.n:
        return answer.choices
    best = []
    for i in range(len(gen.prompts)):
        of_prompt = [c for c in answer.choices if c.prompt_index == i]
        best += sorted(of_prompt, key=lambda c: -c.cumulative_logprob)[:gen.n]
    return best


async def _open_calls(gw: Gateway, requests: list[list[BackendRequest]],
                      arrived: float) -> list[Call]:
    """The calls of every choice, in order. Per prompt, its first call alone, then the rest
    on the same server once the first has answered (its prompt is in the prefix cache then:
    `n` choices compute it once). A failure closes every call that was opened, once all the
    opening has ended (none is left open on a server)."""
    opened: list[list[Call]] = [[] for _ in requests]

    async def of_prompt(i: int) -> None:
        first = await gw.open(requests[i][0], arrived)
        opened[i].append(first)
        _raise_first(opened[i], await asyncio.gather(
            *(gw.open(r, arrived, prefer=first.backend.name) for r in requests[i][1:]),
            return_exceptions=True))

    try:
        _raise_first([], await asyncio.gather(*(of_prompt(i) for i in range(len(requests))),
                                              return_exceptions=True))
    except BaseException:
        for calls in opened:
            for call in calls:
                await call.close()
        raise
    return [call for calls in opened for call in calls]


def _raise_first(calls: list[Call], results: list[Any]) -> None:
    """Add the calls among `results` (asyncio.gather's, exceptions returned) to `calls`, then
    raise the first exception among them, if any."""
    calls += [r for r in results if not isinstance(r, BaseException) and r is not None]
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        raise error


async def _relay(call: Call, choice: Choice, gen: Generation) -> AsyncIterator[Delta]:
    """The call's pieces as what the client may see of `choice`: stop strings cut the text
    (and end the call), held-back text goes out at the end, tool calls are read out of it."""
    stops = StopMatcher(gen.stops, gen.include_stop)
    async for piece in call.pieces():
        choice.prompt_tokens = piece.num_input_tokens or choice.prompt_tokens
        choice.completion_tokens = piece.num_output_tokens or choice.completion_tokens
        text = stops.feed(piece.text)
        finish = "stop" if stops.stopped else (piece.finish_reason or None)
        if finish and not stops.stopped:
            text += stops.flush()
        calls: list[dict[str, Any]] = []
        if choice.tools is not None:
            text, calls = choice.tools.feed(text)
            if finish:
                text += choice.tools.flush()
                if finish == "stop" and choice.tools.calls:
                    finish = "tool_calls"
        yield Delta(text, piece.token_ids, piece.logprobs, _alternatives(piece, gen), finish,
                    calls)
        if finish:
            return


def _alternatives(piece: Piece, gen: Generation) -> list[list[tuple[int, float]]]:
    """The piece's alternatives, `gen.top_logprobs` per token (none known: id -1)."""
    k = gen.top_logprobs
    if not k:
        return []
    return [[(t, lp) for t, lp in zip(piece.top_ids[i * k:(i + 1) * k],
                                      piece.top_logprobs[i * k:(i + 1) * k], strict=True)
             if t >= 0] for i in range(len(piece.token_ids))]


def _add(choice: Choice, d: Delta) -> None:
    choice.text += d.text
    choice.token_ids += d.token_ids
    choice.logprobs += d.logprobs
    choice.top += d.top
    choice.finish_reason = d.finish_reason


async def _sse(gw: Gateway, calls: list[Call], answer: Answer, endpoint: str,
               echoes: list[str]) -> AsyncIterator[str]:
    async def events_of(call: Call, choice: Choice) -> AsyncIterator[str]:
        first = True
        async for d in _relay(call, choice, answer.gen):
            if first:
                d.text = echoes[choice.prompt_index] + d.text
            if d.text or d.finish_reason or d.tool_calls or first:
                event = answer.chunk(choice, d.text, d.token_ids, d.logprobs, d.top,
                                     d.finish_reason, first, d.tool_calls)
                yield f"data: {json.dumps(event)}\n\n"
                first = False
            _add(choice, d)

    async def events() -> AsyncIterator[str]:
        streams = [events_of(c, ch) for c, ch in zip(calls, answer.choices, strict=True)]
        async for event in (streams[0] if len(streams) == 1 else _merged(streams)):
            yield event
        if answer.gen.include_usage:
            yield f"data: {json.dumps(answer.usage_chunk())}\n\n"

    async for event in _counted(gw, calls, endpoint, events(),
                                lambda e: f"data: {json.dumps(e.body())}\n\n"):
        yield event
    yield SSE_DONE


async def _merged(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The items of several streams as each comes; the first failure ends all of them."""
    queue: asyncio.Queue[tuple[str | None, BaseException | None]] = asyncio.Queue()

    async def drain(stream: AsyncIterator[str]) -> None:
        try:
            async for item in stream:
                await queue.put((item, None))
            await queue.put((None, None))
        except Exception as e:
            await queue.put((None, e))

    tasks = [asyncio.create_task(drain(s)) for s in streams]
    try:
        for _ in range(len(tasks)):
            while True:
                item, error = await queue.get()
                if error is not None:
                    raise error
                if item is None:
                    break
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _counted(gw: Gateway, calls: list[Call], endpoint: str, events: AsyncIterator[str],
                   error_event: Callable[[ApiError], str]) -> AsyncIterator[str]:
    """A streamed answer's events, its status counted once (200; the error's, sent as a last
    event since the stream has begun; 499 when the client went away) and the calls closed
    however the stream ends: a client that goes away ends the request on the server."""
    backend = calls[0].backend
    try:
        async for event in events:
            yield event
        gw.metrics.count(endpoint, backend, 200)
    except (GeneratorExit, asyncio.CancelledError):
        gw.metrics.count(endpoint, backend, CLIENT_CLOSED)
        raise
    except Exception as e:
        error = e if isinstance(e, ApiError) else _internal(e)
        gw.metrics.count(endpoint, backend, error.status)
        yield error_event(error)
    finally:
        for call in calls:
            await call.close()


def _internal(e: Exception) -> ApiError:
    log.exception("gateway bug", exc_info=e)
    return ApiError(500, f"the gateway failed: {type(e).__name__}: {e}")


async def _whole(gw: Gateway, request: Request, endpoint: str,
                 work: Callable[[list[Call]], Coroutine[Any, Any, None]]) -> None:
    """Run `work`, which opens calls (adding them to the list it is given) and consumes their
    whole answers; a client that goes away meanwhile, while a server is chosen included,
    cancels them on the server (Triton's own /generate cannot notice that,
    docs/operations.md). Counts the status once and closes the calls."""
    calls: list[Call] = []

    def backend() -> Backend | None:
        return calls[0].backend if calls else None

    task = asyncio.create_task(work(calls))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                gw.metrics.count(endpoint, backend(), CLIENT_CLOSED)
                raise ApiError(CLIENT_CLOSED, "the client went away")
        try:
            task.result()
        except ApiError as e:
            if calls:  # a refusal before any call was counted where it happened
                gw.metrics.count(endpoint, backend(), e.status)
            raise
        gw.metrics.count(endpoint, backend(), 200)
    finally:
        if not task.done():
            task.cancel()
        for call in calls:
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
        events = _counted(gw, [call], endpoint, _kserve_events(call),
                          lambda e: f"data: {json.dumps({'error': e.message})}\n\n")
        return EventStream(events)
    pieces: list[Piece] = []

    async def collect(calls: list[Call]) -> None:  # the whole answer is the first piece
        calls.append(await gw.open(upstream, arrived))
        pieces.extend([p async for p in calls[0].pieces()])

    await _whole(gw, request, endpoint, collect)
    return JSONResponse(_kserve_outputs(pieces[-1]))


async def _kserve_events(call: Call) -> AsyncIterator[str]:
    async for piece in call.pieces():
        yield f"data: {json.dumps(_kserve_outputs(piece))}\n\n"


def _kserve_outputs(piece: Piece) -> dict[str, Any]:
    return {"model_name": ENSEMBLE, "model_version": "1", "text_output": piece.text,
            "finish_reason": piece.finish_reason, "num_input_tokens": piece.num_input_tokens,
            "num_output_tokens": piece.num_output_tokens, "output_ids": piece.token_ids,
            "output_log_probs": piece.logprobs}
