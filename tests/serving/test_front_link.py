"""The front model's parts that need no server. ClientLink: exactly one final flag per request,
and a failure after a stream's first chunk ends the stream as data (finish_reason "error"),
never as a Triton error, which the 2.51 ensemble would leave in flight. served_groups: the
engine groups a front sends work to, by its server's role. pb_utils is faked at the edge
(conftest)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from python_backends.wire import FINISH_ERROR, ClientChunk, ErrorKind
from tests.serving.conftest import FINAL, FakeError, FakeResponse, Sender


def _chunk(ids: list[int], finish_reason: str = "") -> ClientChunk:
    return ClientChunk("board", 1, ids, 0, ids, finish_reason, 5, len(ids), -1.5, [], "", [],
                       [])


def _sent_chunk(response: FakeResponse) -> ClientChunk:
    return ClientChunk.decode(response.outputs)


def test_a_failure_before_any_chunk_is_a_triton_error(front: types.ModuleType) -> None:
    sender = Sender()
    link = front.ClientLink(sender)
    link.fail("bad top_p", ErrorKind.INVALID)
    link.close()
    [(answer, flags)] = sender.sent
    assert flags == FINAL and answer is not None and answer.error is not None
    assert (answer.error.message, answer.error.code) == ("bad top_p", "INVALID_ARG")
    assert link.cancelled


def test_a_failure_after_a_streamed_chunk_ends_the_stream_as_data(
    front: types.ModuleType,
) -> None:
    sender = Sender()
    link = front.ClientLink(sender)
    link.send(_chunk([7, 8]), final=False)
    link.fail("no engine instance is left", ErrorKind.UNAVAILABLE)
    link.close()
    link.probe()
    assert [flags for _, flags in sender.sent] == [0, FINAL]  # nothing after the final one
    last = sender.sent[-1][0]
    assert last is not None and last.error is None
    chunk = _sent_chunk(last)
    assert (chunk.finish_reason, chunk.error) == (FINISH_ERROR, "no engine instance is left")
    assert chunk.output_ids == [] and chunk.tokens == []
    assert chunk.num_output_tokens == 2  # the counts so far


def test_close_sends_the_final_flag_once(front: types.ModuleType) -> None:
    sender = Sender()
    link = front.ClientLink(sender)
    link.send(_chunk([7], "stop"), final=True)
    link.close()
    link.fail("late", ErrorKind.INTERNAL)
    assert [flags for _, flags in sender.sent] == [FINAL]


class QuietBoard:
    """A cancel board no one has raised a flag on; records the tickets the link cancels."""

    name = "quiet-board"

    def __init__(self) -> None:
        self.cancelled: list[int] = []

    def is_cancelled(self, ticket: int) -> bool:
        return False

    def cancel(self, ticket: int) -> None:
        self.cancelled.append(ticket)


class FreedSender(Sender):
    """Triton 2.51 frees a response sender with its final response: asking it is a segfault."""

    def is_cancelled(self) -> bool:
        assert not any(flags == FINAL for _, flags in self.sent), "asked after the final flag"
        return False


def test_a_sender_is_never_asked_after_its_final_response(front: types.ModuleType) -> None:
    sender = FreedSender()
    link = front.ClientLink(sender)
    link.attach(QuietBoard(), 1, lambda: None)
    assert not link.check_cancelled()
    link.send(_chunk([7], "stop"), final=True)
    assert not link.check_cancelled()  # a remote call's reader looks once more
    link.probe()  # the prober's thread, which may find the request just ended
    assert [flags for _, flags in sender.sent] == [FINAL]


class CountingSender(Sender):
    def __init__(self) -> None:
        super().__init__()
        self.asked = 0
        self.cancelled = False

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.cancelled


def test_the_sender_is_asked_at_most_once_per_interval(front: types.ModuleType) -> None:
    now = [100.0]
    sender, board = CountingSender(), QuietBoard()
    link = front.ClientLink(sender, clock=lambda: now[0])
    link.attach(board, 4, lambda: None)
    assert not link.check_cancelled() and sender.asked == 1  # the first check asks
    sender.cancelled = True  # the direct caller went away
    for _ in range(5):  # every step of the next SENDER_CHECK_S reads only the board
        now[0] += front.SENDER_CHECK_S / 10
        assert not link.check_cancelled()
    assert sender.asked == 1
    now[0] += front.SENDER_CHECK_S
    assert link.check_cancelled() and sender.asked == 2
    assert board.cancelled == [4]  # the engine sees it on the board


def test_a_probe_asks_the_sender_and_goes_only_to_a_caller_still_there(
    front: types.ModuleType,
) -> None:
    now = [100.0]
    sender, board = CountingSender(), QuietBoard()
    link = front.ClientLink(sender, clock=lambda: now[0])
    link.attach(board, 6, lambda: None)
    link.probe()
    assert sender.asked == 1 and [flags for _, flags in sender.sent] == [0]
    probe = sender.sent[0][0]
    assert probe is not None and _sent_chunk(probe).is_probe
    sender.cancelled = True  # a direct caller (the gateway) went away while its request waited
    now[0] += front.SENDER_CHECK_S
    link.probe()
    assert sender.asked == 2 and len(sender.sent) == 1  # no probe to a caller gone
    assert board.cancelled == [6] and link.cancelled


def test_triton_error_codes_map_to_engine_error_kinds_and_back(front: types.ModuleType) -> None:
    for code in (FakeError.INVALID_ARG, FakeError.UNAVAILABLE, FakeError.INTERNAL):
        assert front.error_code(front.error_kind(code)) == code
    assert front.error_kind("NOT_FOUND") == "internal"


MODELS = ("worker", "prefill", "decode")


def test_a_front_serves_the_groups_its_role_runs_or_other_servers_serve(
    front: types.ModuleType,
) -> None:
    served = front.served_groups
    assert served("all", MODELS, set()) == MODELS
    assert served("all", ("worker", "", ""), set()) == ("worker", "", "")  # config turned off
    assert served("aggregated", MODELS, set()) == ("worker", "", "")
    assert served("aggregated", MODELS, {"prefill", "decode"}) == MODELS
    assert served("front", MODELS, {"worker"}) == ("worker", "", "")
    assert served("front", MODELS, {"prefill", "decode"}) == ("", "prefill", "decode")
    with pytest.raises(ValueError, match="a front server has no engine group"):
        served("front", MODELS, set())
    with pytest.raises(ValueError, match="LLM_WORKER_SERVERS"):
        served("aggregated", ("", "prefill", "decode"), set())


def test_groups_share_cpu_cores_when_all_run_here_on_cpu_instances(
    front: types.ModuleType, tmp_path: Path,
) -> None:
    for model in MODELS:
        (tmp_path / model).mkdir()
        (tmp_path / model / "config.pbtxt").write_text(
            "# KIND_GPU (with `gpus`) runs the engine on GPUs\n"
            "instance_group [ { count: 1 kind: KIND_CPU } ]\n")
    shares = front.shares_cpu_cores
    here = tmp_path / "front"
    assert shares(here, MODELS, set())
    assert not shares(here, MODELS, {"prefill"})  # served elsewhere: cores of its own
    assert not shares(here, ("worker", "", ""), set())
    (tmp_path / "decode" / "config.pbtxt").write_text("instance_group [ { kind: KIND_GPU } ]")
    assert not shares(here, MODELS, set())
    assert not shares(tmp_path / "elsewhere" / "front", MODELS, set())  # unreadable: unknown
