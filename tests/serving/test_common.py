"""Engine calls as an engine model receives them: each valid call is accepted at once with an
empty, non-final response (so the caller's BLS thread in tritonserver is free while the request
queues), a malformed one gets only its error."""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np

from python_backends.flag_board import BoardCache
from python_backends.params import SamplingParams
from python_backends.wire import EngineRequest, GenerationRequest
from tests.serving.conftest import FINAL, Sender


class Input:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class Request:
    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.sender = Sender()
        self._inputs = [Input(n, a) for n, a in arrays.items()]

    def get_response_sender(self) -> Sender:
        return self.sender

    def inputs(self) -> list[Input]:
        return self._inputs


def test_a_call_is_accepted_before_it_is_handed_over_and_a_bad_one_only_refused(
    front: types.ModuleType,
) -> None:
    common: Any = sys.modules["python_backends.serving.common"]
    message = EngineRequest(GenerationRequest([1, 2, 3], SamplingParams(max_tokens=4)))
    good, bad = Request(message.encode(False)), Request({"REQUEST": np.array([b"{"])})
    seen = []
    for call in common.engine_calls([bad, good], BoardCache(), "worker"):
        seen.append(call)
        [(answer, flags)] = good.sender.sent  # accepted by the time the engine gets it
        assert flags == 0 and answer is not None and not answer.outputs and answer.error is None
    assert [c.message for c in seen] == [message] and seen[0].sender is good.sender
    [(refusal, flags)] = bad.sender.sent
    assert flags == FINAL and refusal is not None and refusal.error is not None
    assert "worker: bad request" in refusal.error.message
