"""The serving models' parts that need no server, with `triton_python_backend_utils` faked at
the edge: responses are recorded as the tensors or the error they carry."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

FINAL = 1


class FakeError:
    INVALID_ARG, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"

    def __init__(self, message: str, code: str) -> None:
        self.message, self.code = message, code


class FakeResponse:
    def __init__(self, output_tensors: list[Any] | None = None,
                 error: FakeError | None = None) -> None:
        self.outputs = {t.name: t.array for t in output_tensors or []}
        self.error = error


class FakeTensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[FakeResponse | None, int]] = []

    def send(self, answer: FakeResponse | None = None, flags: int = 0) -> None:
        self.sent.append((answer, flags))

    def is_cancelled(self) -> bool:
        return False


def _with_fake_pb_utils(monkeypatch: pytest.MonkeyPatch, module: str
                        ) -> Iterator[types.ModuleType]:
    """`module` imported afresh over the fake `triton_python_backend_utils`."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL  # type: ignore[attr-defined]
    pb.TritonError = FakeError  # type: ignore[attr-defined]
    pb.InferenceResponse = FakeResponse  # type: ignore[attr-defined]
    pb.Tensor = FakeTensor  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    names = ("python_backends.serving.common", module)
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module(module)
    for name in names:
        sys.modules.pop(name, None)  # the next importer gets the real pb_utils, or none


@pytest.fixture
def front(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    yield from _with_fake_pb_utils(monkeypatch, "python_backends.serving.front")


@pytest.fixture
def generator(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    yield from _with_fake_pb_utils(monkeypatch, "python_backends.serving.generator")
