"""front.orchestrator without Triton: every branch of a request's way through the front,
admission then the engine groups, driven by scripted channels and a recording client (the cancel
board is a real one, in shared memory)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from python_backends.flag_board import FlagBoard
from python_backends.front.admission import (
    AdmissionControl,
    AdmissionLimits,
    RateLimit,
    RateLimiter,
)
from python_backends.front.channel import Caller, EngineLost, Reply
from python_backends.front.liveness import IdleProber
from python_backends.front.migration import MigrationReason, Moved
from python_backends.front.orchestrator import EngineGroups, Gates, Orchestrator
from python_backends.front.routing import DisaggregationPolicy, Router
from python_backends.front.stream import RequestStream
from python_backends.front.tenancy import CacheSharing
from python_backends.params import SamplingParams
from python_backends.wire import (
    ClientChunk,
    EngineRequest,
    ErrorKind,
    GenerationRequest,
    Message,
    PrefillReply,
    TokenStep,
)

PROMPT = [1, 2, 3, 4]
HANDLE = b'{"lease": 1}'
Answer = Reply | Exception  # an exception ends the call by raising it


def step(ids: list[int], finish: str = "", error: str = "",
         kind: ErrorKind = ErrorKind.INTERNAL) -> Reply:
    return Reply(outputs=TokenStep(ids, [-0.5] * len(ids), finish, len(PROMPT), 0, error,
                                   kind.value if error else "").encode(False))


def prefilled(token: int, finish: str = "") -> Reply:
    return Reply(outputs=PrefillReply(token, -0.25, finish, HANDLE, [], []).encode(True))


ACCEPTED = Reply()  # an engine's acceptance: an empty response before the first step


def lost(reason: MigrationReason = MigrationReason.ENGINE_DIED) -> EngineLost:
    return EngineLost(Moved(reason, "the engine went away"))


@dataclass
class ScriptedGroup:
    """A channel whose calls answer from a script, one list of answers per call."""

    model: str
    script: list[list[Answer]]
    steers_away: bool = False
    alive: bool = True
    calls: list[EngineRequest] = field(default_factory=list)
    on_answer: Callable[[], None] | None = None  # runs before each answer is handed out

    def replies(self, message: EngineRequest, reply_type: type[Message],
                caller: Caller) -> Iterator[Reply]:
        self.calls.append(message)
        assert self.script, f"{self.model} called more often than scripted"
        for item in self.script.pop(0):
            if self.on_answer is not None:
                self.on_answer()
            if isinstance(item, Exception):
                raise item
            yield item

    def live(self) -> bool:
        return self.alive


@dataclass(eq=False)  # hashable by identity, as the prober keeps its clients in a set
class RecordingClient:
    ticket: int = -1  # set by attach
    left: Callable[[], None] | None = None
    cancelled: bool = False
    cancel_now: bool = False  # the client goes away: seen at the next check
    chunks: list[tuple[ClientChunk, bool]] = field(default_factory=list)
    failures: list[tuple[str, ErrorKind]] = field(default_factory=list)
    first_responses: int = 0

    def check_cancelled(self) -> bool:
        self.cancelled = self.cancelled or self.cancel_now
        return self.cancelled

    def attach(self, board: FlagBoard, ticket: int, leave: Callable[[], None]) -> None:
        self.ticket, self.left = ticket, leave

    def first_response(self) -> None:
        self.first_responses += 1
        if self.left is not None:
            self.left()
            self.left = None

    def idle_for(self, now: float) -> float:
        return 0.0

    def probe(self) -> None:
        pass

    def send(self, chunk: ClientChunk, final: bool) -> None:
        self.chunks.append((chunk, final))

    def fail(self, message: str, kind: ErrorKind) -> None:
        self.failures.append((message, kind))
        self.cancelled = True

    def output_ids(self) -> list[int]:
        return [i for chunk, _ in self.chunks for i in chunk.output_ids]


@dataclass
class CountingMetrics:
    routes: list[str] = field(default_factory=list)
    migrations: list[str] = field(default_factory=list)
    unserved_count: int = 0
    finished_count: int = 0
    rejections: list[tuple[str, str]] = field(default_factory=list)

    def routed(self, route: str) -> None:
        self.routes.append(route)

    def migrated(self, reason: str) -> None:
        self.migrations.append(reason)

    def unserved(self) -> None:
        self.unserved_count += 1

    def finished(self, state: RequestStream) -> None:
        self.finished_count += 1

    def rejected(self, reason: str, tenant: str) -> None:
        self.rejections.append((reason, tenant))


@dataclass
class Front:
    orchestrator: Orchestrator
    metrics: CountingMetrics
    abandoned: list[bytes]

    def serve(self, client: RecordingClient, route: str = "auto",
              resume_ids: list[int] | None = None, stream: bool = True,
              tenant: str = "t") -> None:
        req = GenerationRequest(list(PROMPT), SamplingParams(max_tokens=8), stream=stream,
                                tenant=tenant, route=route, resume_ids=list(resume_ids or []))
        self.orchestrator.serve(req, client)
        # whatever happened, the request holds nothing when it ends
        admission = self.orchestrator.gates.admission
        assert (admission.waiting_requests, admission.waiting_tokens) == (0, 0)
        assert not self.orchestrator.prober._links
        board = self.orchestrator.board
        assert len(board._free) == board.size  # its cancel ticket went back
        assert self.orchestrator.router.inflight_prefills == 0


@pytest.fixture
def board() -> Iterator[FlagBoard]:
    board = FlagBoard.create(size=4)
    yield board
    board.close()


def front(board: FlagBoard, worker: ScriptedGroup | None = None,
          prefill: ScriptedGroup | None = None, decode: ScriptedGroup | None = None,
          migration_limit: int = 3, gates: Gates | None = None) -> Front:
    router = Router(DisaggregationPolicy(disaggregation=prefill is not None,
                                         aggregation=worker is not None, min_prompt_tokens=1))
    gates = gates or Gates(AdmissionControl(AdmissionLimits()), RateLimiter({}))
    metrics, abandoned = CountingMetrics(), list[bytes]()
    orchestrator = Orchestrator(gates, EngineGroups(worker, prefill, decode), router, board,
                                IdleProber(60.0), metrics, abandoned.append, migration_limit)
    return Front(orchestrator, metrics, abandoned)


def test_aggregated_the_worker_steps_reach_the_client_in_order(board: FlagBoard) -> None:
    worker = ScriptedGroup("worker", [[ACCEPTED, step([7]), step([8, 9]), step([10], "length")]])
    f, client = front(board, worker=worker), RecordingClient()
    f.serve(client)
    assert client.output_ids() == [7, 8, 9, 10] and not client.failures
    assert [final for _, final in client.chunks] == [False, False, True]
    assert f.metrics.routes == ["aggregated"] and f.metrics.finished_count == 1
    [call] = worker.calls
    assert (call.cancel_board, call.cancel_ticket, call.kv_handle) == (
        board.name, client.ticket, None)
    assert call.request.cache_salt == "tenant:t"  # each tenant its own cache, by default


def test_a_request_not_streamed_gets_one_chunk(board: FlagBoard) -> None:
    worker = ScriptedGroup("worker", [[step([7]), step([8], "stop")]])
    client = RecordingClient()
    front(board, worker=worker).serve(client, stream=False)
    [(chunk, final)] = client.chunks
    assert chunk.output_ids == [7, 8] and final


def test_disaggregated_the_first_token_goes_out_then_decode_continues_from_the_handle(
        board: FlagBoard) -> None:
    prefill = ScriptedGroup("prefill", [[prefilled(7)]])
    decode = ScriptedGroup("decode", [[ACCEPTED, step([8]), step([9], "stop")]])
    f, client = front(board, prefill=prefill, decode=decode), RecordingClient()
    f.serve(client)
    assert client.output_ids() == [7, 8, 9] and f.metrics.routes == ["disaggregated"]
    [call] = decode.calls
    assert (call.kv_handle, call.first_token, call.first_log_prob) == (HANDLE, 7, -0.25)
    assert f.orchestrator.router.inflight_prefills == 0 and not f.abandoned


def test_a_prompt_that_ends_at_its_first_token_never_reaches_decode(board: FlagBoard) -> None:
    decode = ScriptedGroup("decode", [])
    client = RecordingClient()
    prefill = ScriptedGroup("prefill", [[prefilled(2, "stop")]])
    front(board, prefill=prefill, decode=decode).serve(client)
    assert client.output_ids() == [2] and client.chunks[-1][1] and not decode.calls


def test_a_failed_prefill_falls_back_to_decode_computing_the_prompt(board: FlagBoard) -> None:
    prefill = ScriptedGroup("prefill", [[Reply(error="out of KV blocks")]])
    decode = ScriptedGroup("decode", [[step([7]), step([8], "stop")]])
    f, client = front(board, prefill=prefill, decode=decode), RecordingClient()
    f.serve(client)
    assert client.output_ids() == [7, 8] and f.metrics.routes == ["disaggregated_fallback"]
    assert decode.calls[0].kv_handle is None and decode.calls[0].first_token is None


def test_a_lost_prefill_is_retried_on_another_server_of_its_group(board: FlagBoard) -> None:
    prefill = ScriptedGroup("prefill", [[lost(MigrationReason.INSTANCE_DOWN)], [prefilled(7)]],
                            steers_away=True)
    decode = ScriptedGroup("decode", [[step([8], "stop")]])
    f, client = front(board, prefill=prefill, decode=decode), RecordingClient()
    f.serve(client)
    assert len(prefill.calls) == 2 and client.output_ids() == [7, 8]
    assert f.metrics.migrations == ["instance_down"] and f.metrics.routes == ["disaggregated"]


def test_a_lost_prefill_that_cannot_steer_away_falls_back_at_once(board: FlagBoard) -> None:
    prefill = ScriptedGroup("prefill", [[lost()]], steers_away=False)
    decode = ScriptedGroup("decode", [[step([8], "stop")]])
    f, client = front(board, prefill=prefill, decode=decode), RecordingClient()
    f.serve(client)
    assert len(prefill.calls) == 1 and f.metrics.routes == ["disaggregated_fallback"]


def test_a_worker_that_dies_midway_hands_its_tokens_to_the_next_engine(board: FlagBoard) -> None:
    worker = ScriptedGroup("worker", [[step([7]), step([8]), lost()]], alive=False)
    decode = ScriptedGroup("decode", [[step([9]), step([10], "length")]])
    prefill = ScriptedGroup("prefill", [])
    f, client = front(board, worker=worker, prefill=prefill, decode=decode), RecordingClient()
    f.serve(client, route="aggregated")
    assert client.output_ids() == [7, 8, 9, 10] and not client.failures
    [moved] = decode.calls
    assert moved.resume_ids == [7, 8] and moved.kv_handle is None
    assert f.metrics.migrations == ["engine_died"]


def test_an_engine_that_cannot_go_on_moves_the_request_and_frees_its_lease(
        board: FlagBoard) -> None:
    prefill = ScriptedGroup("prefill", [[prefilled(7)]])
    decode = ScriptedGroup("decode", [
        [step([8]), step([], "error", error="shutting down", kind=ErrorKind.UNAVAILABLE)],
        [step([9], "stop")]])
    f, client = front(board, prefill=prefill, decode=decode), RecordingClient()
    f.serve(client)
    assert client.output_ids() == [7, 8, 9] and f.abandoned == [HANDLE]
    assert decode.calls[1].resume_ids == [7, 8] and decode.calls[1].first_token is None
    assert f.metrics.migrations == ["engine_unavailable"]


def test_a_request_resumed_from_another_server_goes_to_an_engine_with_its_tokens(
        board: FlagBoard) -> None:
    worker = ScriptedGroup("worker", [[step([9], "stop")]])
    f, client = front(board, worker=worker), RecordingClient()
    f.serve(client, resume_ids=[7, 8])
    assert worker.calls[0].resume_ids == [7, 8] and client.output_ids() == [9]
    assert client.chunks[-1][0].num_output_tokens == 3  # the resumed tokens count


def test_no_engine_left_ends_the_request_with_a_clear_error(board: FlagBoard) -> None:
    worker = ScriptedGroup("worker", [[step([7]), lost()]], alive=False)
    f, client = front(board, worker=worker), RecordingClient()
    f.serve(client)
    [(message, kind)] = client.failures
    assert kind is ErrorKind.UNAVAILABLE and "no engine instance is left" in message
    assert f.metrics.unserved_count == 1 and client.output_ids() == [7]


def test_the_move_budget_bounds_a_request_that_keeps_losing_its_engine(board: FlagBoard) -> None:
    worker = ScriptedGroup("worker", [[lost()] for _ in range(3)])
    f, client = front(board, worker=worker, migration_limit=2), RecordingClient()
    f.serve(client)
    assert len(worker.calls) == 3 and f.metrics.migrations == ["engine_died"] * 2
    [(message, _)] = client.failures
    assert "moved 2 times already" in message


def test_an_engine_error_after_the_first_token_ends_the_request_with_its_kind(
        board: FlagBoard) -> None:
    worker = ScriptedGroup("worker", [[step([7]), step([], "error", error="too long",
                                                      kind=ErrorKind.INVALID)]])
    f, client = front(board, worker=worker), RecordingClient()
    f.serve(client)
    assert client.output_ids() == [7] and client.failures == [("too long", ErrorKind.INVALID)]
    assert f.metrics.finished_count == 0 and not f.metrics.migrations


def test_an_error_reply_keeps_the_engines_kind(board: FlagBoard) -> None:
    worker = ScriptedGroup("worker", [[Reply(error="bad input", kind=ErrorKind.INVALID.value)]])
    client = RecordingClient()
    front(board, worker=worker).serve(client)
    assert client.failures == [("bad input", ErrorKind.INVALID)]


def test_a_route_the_front_does_not_serve_is_refused_naming_the_field(board: FlagBoard) -> None:
    client = RecordingClient()
    front(board, worker=ScriptedGroup("worker", [])).serve(client, route="disaggregated")
    [(message, kind)] = client.failures
    assert kind is ErrorKind.INVALID and "route" in message


def test_cancelled_during_prefill_nothing_more_is_called(board: FlagBoard) -> None:
    client = RecordingClient()
    prefill = ScriptedGroup("prefill", [[Reply(error="cancelled")]])
    prefill.on_answer = lambda: setattr(client, "cancel_now", True)
    decode = ScriptedGroup("decode", [])
    f = front(board, prefill=prefill, decode=decode)
    f.serve(client)
    assert not decode.calls and not client.chunks and not client.failures
    assert f.orchestrator.router.inflight_prefills == 0


def test_cancelled_after_the_first_token_the_prefills_lease_is_freed(board: FlagBoard) -> None:
    client = RecordingClient()
    prefill = ScriptedGroup("prefill", [[prefilled(7)]])
    prefill.on_answer = lambda: setattr(client, "cancel_now", True)
    decode = ScriptedGroup("decode", [])
    f = front(board, prefill=prefill, decode=decode)
    f.serve(client)
    assert not decode.calls and f.abandoned == [HANDLE] and client.output_ids() == [7]


def test_cancelled_while_decoding_the_rest_is_drained_not_sent(board: FlagBoard) -> None:
    client = RecordingClient()
    steps: list[Answer] = [step([7]), step([8]), step([], "cancelled")]
    worker = ScriptedGroup("worker", [steps])
    worker.on_answer = lambda: setattr(client, "cancel_now", len(client.chunks) >= 1)
    f = front(board, worker=worker)
    f.serve(client)
    assert client.output_ids() == [7] and not worker.script  # the call was read to its end
    assert f.metrics.finished_count == 0


def test_a_cancelled_request_is_not_moved_when_its_engine_dies(board: FlagBoard) -> None:
    client = RecordingClient()
    worker = ScriptedGroup("worker", [[step([7]), lost()]])
    worker.on_answer = lambda: setattr(client, "cancel_now", len(client.chunks) >= 1)
    f = front(board, worker=worker)
    f.serve(client)
    assert len(worker.calls) == 1 and not f.metrics.migrations and not client.failures


def test_the_finishing_chunk_is_counted_before_it_goes_out(board: FlagBoard) -> None:
    client = RecordingClient()
    counted_at: list[int] = []
    worker = ScriptedGroup("worker", [[step([7]), step([8], "length")]])
    f = front(board, worker=worker)
    f.metrics.finished = lambda state: counted_at.append(len(client.chunks))  # type: ignore[method-assign]
    f.serve(client)
    assert counted_at == [1]  # one chunk out, the final one not yet


def test_a_rate_limited_tenant_is_refused_before_any_engine_work(board: FlagBoard) -> None:
    worker = ScriptedGroup("worker", [[step([7], "stop")]])
    gates = Gates(AdmissionControl(AdmissionLimits()),
                  RateLimiter({"slow": RateLimit(requests_per_s=0.001, burst_requests=1)}))
    f = front(board, worker=worker, gates=gates)
    f.serve(RecordingClient(), tenant="slow")
    refused = RecordingClient()
    f.serve(refused, tenant="slow")
    assert len(worker.calls) == 1 and f.metrics.rejections == [("rate_limited", "slow")]
    [(message, kind)] = refused.failures
    assert kind is ErrorKind.UNAVAILABLE and "slow" in message


def test_too_much_waiting_is_refused_and_a_waiting_request_counts_until_its_first_token(
        board: FlagBoard) -> None:
    gates = Gates(AdmissionControl(AdmissionLimits(max_waiting_requests=1)), RateLimiter({}))
    late = RecordingClient()
    f: Front
    worker = ScriptedGroup("worker", [[ACCEPTED, step([7], "stop")]])
    # a second request arrives while the first waits for its first token
    late_req = GenerationRequest(list(PROMPT), SamplingParams(max_tokens=8))
    worker.on_answer = lambda: None if late.failures else f.orchestrator.serve(late_req, late)
    f = front(board, worker=worker, gates=gates)
    first = RecordingClient()
    f.orchestrator.serve(GenerationRequest(list(PROMPT), SamplingParams(max_tokens=8)), first)
    assert first.output_ids() == [7] and len(worker.calls) == 1
    assert gates.admission.waiting_requests == 0
    [(message, kind)] = late.failures
    assert kind is ErrorKind.UNAVAILABLE and "waiting" in message
    assert [r for r, _ in f.metrics.rejections] == ["overloaded"]


def test_no_cancel_ticket_left_is_refused_as_overloaded(board: FlagBoard) -> None:
    worker = ScriptedGroup("worker", [[step([7], "stop")]])
    f = front(board, worker=worker)
    held = [board.acquire() for _ in range(board.size)]
    client = RecordingClient()
    f.orchestrator.serve(GenerationRequest(list(PROMPT), SamplingParams(max_tokens=8)), client)
    assert f.orchestrator.gates.admission.waiting_requests == 0
    [(message, kind)] = client.failures
    assert kind is ErrorKind.UNAVAILABLE and "overloaded" in message and not worker.calls
    for ticket in held:
        board.release(ticket)


def test_tenants_that_share_a_cache_get_one_salt(board: FlagBoard) -> None:
    worker = ScriptedGroup("worker", [[step([7], "stop")], [step([7], "stop")]])
    gates = Gates(AdmissionControl(AdmissionLimits()), RateLimiter({}),
                  CacheSharing.parse("a,b"))
    f = front(board, worker=worker, gates=gates)
    f.serve(RecordingClient(), tenant="a")
    f.serve(RecordingClient(), tenant="b")
    assert {c.request.cache_salt for c in worker.calls} == {"shared"}


def test_groups_must_give_the_front_a_path(board: FlagBoard) -> None:
    with pytest.raises(ValueError, match="both prefill and decode"):
        EngineGroups(prefill=ScriptedGroup("prefill", []))
    with pytest.raises(ValueError, match="no engine group"):
        EngineGroups()
