"""An engine model's responses (serving.generator): one per sequence per step, or with a
stream_interval above 1 one per that many tokens, the first and the last at once."""

from __future__ import annotations

import types
from typing import Any

import pytest

from python_backends.engine.llm_engine import TokenEvent
from python_backends.params import FinishReason
from python_backends.serving.options import (
    AUTO_STREAM_BATCH,
    AUTO_STREAM_INTERVAL,
    GeneratorOptions,
)
from python_backends.wire import TokenStep
from tests.serving.conftest import FINAL, Sender


class Outbox:
    """Sends at once, on the caller's thread."""

    owner = "worker_0_0"

    def put(self, sender: Any, make_response: Any, flags: int = 0, lane: str = "") -> None:
        sender.send(make_response(), flags)


class Metrics:
    def observe(self, ev: TokenEvent) -> None:
        pass


def _model(generator: types.ModuleType, monkeypatch: pytest.MonkeyPatch, interval: str,
           senders: dict[str, Sender], asked: dict[str, int] | None = None) -> Any:
    """A GeneratorModel with no engine, its callers `senders` (by sequence id), some of whose
    requests asked for a stream_interval of their own (`asked`)."""
    monkeypatch.setattr(generator, "step_response", lambda step: step)
    model = generator.GeneratorModel.__new__(generator.GeneratorModel)
    model.name = "worker"
    model.stream_interval = GeneratorOptions(stream_interval=interval).interval
    model.outbox, model.metrics = Outbox(), Metrics()
    model._callers = {
        seq_id: generator._Caller(generator.EngineCall(sender, None, None, 0), 3,
                                  stream_interval=(asked or {}).get(seq_id, 1))
        for seq_id, sender in senders.items()}
    return model


def _ev(seq_id: str, token: int, n: int, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent(seq_id, token, -0.5, finish, 3, n)


def _sent(sender: Sender) -> list[tuple[list[int], str, bool]]:
    out: list[tuple[list[int], str, bool]] = []
    for step, flags in sender.sent:
        assert isinstance(step, TokenStep)
        out.append((step.output_ids, step.finish_reason, flags == FINAL))
    return out


def test_each_step_is_sent_at_once_by_default(generator: types.ModuleType,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    a = Sender()
    model = _model(generator, monkeypatch, "1", {"a": a})
    model.on_tokens([_ev("a", 10, 1)])
    model.on_tokens([_ev("a", 11, 2), _ev("a", 12, 3)])  # a kept draft: one response
    model.on_tokens([_ev("a", 13, 4, FinishReason.LENGTH)])
    assert _sent(a) == [([10], "", False), ([11, 12], "", False), ([13], "length", True)]
    assert model._callers == {}


def test_an_interval_holds_tokens_but_not_the_first_or_the_last(
        generator: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = Sender(), Sender()
    model = _model(generator, monkeypatch, "3", {"a": a, "b": b})
    model.on_tokens([_ev("a", 10, 1), _ev("b", 20, 1)])
    assert _sent(a) == [([10], "", False)] and _sent(b) == [([20], "", False)]
    model.on_tokens([_ev("a", 11, 2), _ev("b", 21, 2), _ev("b", 22, 3), _ev("b", 23, 4)])
    assert _sent(a) == [([10], "", False)]  # one token due: held
    assert _sent(b)[1:] == [([21, 22, 23], "", False)]  # a draft's three: the interval's
    model.on_tokens([_ev("a", 12, 3), _ev("b", 24, 5, FinishReason.STOP)])
    assert _sent(a)[1:] == []
    assert _sent(b)[1:] == [([21, 22, 23], "", False), ([24], "stop", True)]
    model.on_tokens([_ev("a", 13, 4)])
    model.on_tokens([_ev("a", 14, 5, FinishReason.LENGTH)])
    assert _sent(a)[1:] == [([11, 12, 13], "", False), ([14], "length", True)]
    assert model._callers == {}


def test_held_tokens_go_out_before_an_error_and_not_after_a_cancel(
        generator: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    failed, cancelled = Sender(), Sender()
    model = _model(generator, monkeypatch, "4", {"f": failed, "c": cancelled})
    model.on_tokens([_ev("f", 10, 1), _ev("c", 20, 1)])
    model.on_tokens([_ev("f", 11, 2), _ev("c", 21, 2)])
    model.on_finished_early("f", RuntimeError("the engine broke"))
    model.on_finished_early("c", None)
    assert _sent(failed) == [([10], "", False), ([11], "", False), ([], "error", True)]
    assert _sent(cancelled) == [([20], "", False), ([], "cancelled", True)]
    assert model._callers == {}


def test_auto_holds_tokens_only_in_steps_of_many_sequences(
        generator: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    senders = {f"s{i}": Sender() for i in range(AUTO_STREAM_BATCH)}
    model = _model(generator, monkeypatch, "auto", senders)
    few = list(senders)[:AUTO_STREAM_BATCH - 1]
    for n in (1, 2):  # the first token, then a step of one sequence too few: each sent
        model.on_tokens([_ev(s, 10 + n, n) for s in few])
    assert all(len(senders[s].sent) == 2 for s in few)
    for n in range(3, 3 + AUTO_STREAM_INTERVAL):  # every sequence in the step: held in runs
        model.on_tokens([_ev(s, 10 + n, n) for s in senders])
    for s in few:
        assert _sent(senders[s])[2:] == [([13, 14], "", False)]
    assert _sent(senders[list(senders)[-1]]) == [([13], "", False)]  # its first; 14 held
    assert AUTO_STREAM_INTERVAL == 2  # the test's runs are two tokens long


def test_a_request_may_ask_for_a_longer_interval_but_not_a_shorter_one(
        generator: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    longer, shorter, plain = Sender(), Sender(), Sender()
    model = _model(generator, monkeypatch, "2", {"l": longer, "s": shorter, "p": plain},
                   asked={"l": 3, "s": 1})
    for n in range(1, 6):
        model.on_tokens([_ev(s, 10 + n, n) for s in ("l", "s", "p")])
    assert _sent(longer) == [([11], "", False), ([12, 13, 14], "", False)]  # 15 held
    assert _sent(shorter) == _sent(plain) == [([11], "", False), ([12, 13], "", False),
                                              ([14, 15], "", False)]
