"""Engine calls as an engine model receives them: each valid call is accepted at once with an
empty, non-final response (so the caller's BLS thread in tritonserver is free while the request
queues), a malformed one gets only its error; both on the caller's outbox lane, never sent from
`execute` itself (a send to a dead caller never returns)."""

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


class Outbox:
    """Records what is put on which lane, as (response, flags, lane), in order."""

    def __init__(self) -> None:
        self.put_: list[tuple[Any, int, str]] = []

    def put(self, sender: Sender, make_response: Any, flags: int = 0, lane: str = "") -> None:
        self.put_.append((make_response(), flags, lane))


def test_a_call_is_accepted_before_it_is_handed_over_and_a_bad_one_only_refused(
    front: types.ModuleType,
) -> None:
    common: Any = sys.modules["python_backends.serving.common"]
    message = EngineRequest(GenerationRequest([1, 2, 3], SamplingParams(max_tokens=4)))
    good, bad = Request(message.encode(False)), Request({"REQUEST": np.array([b"{"])})
    outbox, seen = Outbox(), []
    for call in common.engine_calls([bad, good], BoardCache(), outbox, "worker"):
        seen.append(call)
        refusal, acceptance = outbox.put_  # on the lanes by the time the engine gets the call
    assert [c.message for c in seen] == [message] and seen[0].sender is good.sender
    answer, flags, lane = acceptance
    assert (flags, lane) == (0, "") and not answer.outputs and answer.error is None
    answer, flags, lane = refusal
    assert flags == FINAL and answer.error is not None
    assert "worker: bad request" in answer.error.message
    assert not good.sender.sent and not bad.sender.sent  # nothing sent from execute itself


def _margs(kind: str) -> Any:
    common = sys.modules["python_backends.serving.common"]
    return common.ModelArgs({"model_name": "prefill", "model_config": "{}",
                             "model_instance_kind": kind, "model_instance_device_id": "0"})


def test_auto_transports_offer_nixl_from_gpu_memory_only_where_its_build_fits(
        front: types.ModuleType, monkeypatch: Any) -> None:
    from python_backends.kv_transfer import nixl

    kv_transports = sys.modules["python_backends.serving.common"].kv_transports

    monkeypatch.setattr(nixl, "available", lambda: True)
    monkeypatch.setattr(nixl, "vram_problem", lambda: None)
    assert kv_transports(_margs("GPU"), "auto") == ["cuda_ipc", "nixl"]
    monkeypatch.setattr(nixl, "vram_problem", lambda: "nixl_cu12 is built for another CUDA")
    assert kv_transports(_margs("GPU"), "auto") == ["cuda_ipc"]
    assert kv_transports(_margs("GPU"), "nixl,cuda_ipc") == ["nixl", "cuda_ipc"]  # as asked
    assert kv_transports(_margs("CPU"), "auto") == ["nixl", "host_shm"]  # DRAM: any build
    monkeypatch.setattr(nixl, "available", lambda: False)
    assert kv_transports(_margs("CPU"), "auto") == ["host_shm"]
