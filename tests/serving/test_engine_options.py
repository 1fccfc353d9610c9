"""The engine models' `cpu_threads` and `num_speculative_tokens` parameters (pb_utils faked at
the edge)."""

from __future__ import annotations

import importlib
import json
import sys
import types
from collections.abc import Iterator

import pytest


class FakeModelException(Exception):
    pass


@pytest.fixture
def options(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TritonModelException = FakeModelException  # type: ignore[attr-defined]
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    names = ("python_backends.serving.common", "python_backends.serving.engine_options")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module("python_backends.serving.engine_options")
    for name in names:
        sys.modules.pop(name, None)  # the next importer gets the real pb_utils, or none


def _args(options: types.ModuleType, value: str | None) -> object:
    params = {} if value is None else {"cpu_threads": {"string_value": value}}
    common = sys.modules["python_backends.serving.common"]
    return common.ModelArgs({"model_name": "worker",
                             "model_config": json.dumps({"parameters": params})})


@pytest.mark.parametrize(("value", "want"), [(None, 0), ("auto", 0), (" auto ", 0), ("", 0),
                                             ("3", 3)])
def test_cpu_threads(options: types.ModuleType, value: str | None, want: int) -> None:
    assert options.cpu_threads(_args(options, value)) == want


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_bad_cpu_threads_name_the_parameter(options: types.ModuleType, value: str) -> None:
    with pytest.raises(FakeModelException, match="cpu_threads"):
        options.cpu_threads(_args(options, value))


def _spec_args(value: str | None) -> object:
    params = {} if value is None else {"num_speculative_tokens": {"string_value": value}}
    common = sys.modules["python_backends.serving.common"]
    return common.ModelArgs({"model_name": "worker",
                             "model_config": json.dumps({"parameters": params})})


@pytest.mark.parametrize(("value", "want"), [(None, 0), ("0", 0), (" 4 ", 4)])
def test_num_speculative_tokens(options: types.ModuleType, value: str | None, want: int) -> None:
    assert options.speculation(_spec_args(value)).num_tokens == want


@pytest.mark.parametrize("value", ["-1", "four", "2.5"])
def test_bad_num_speculative_tokens_name_the_parameter(options: types.ModuleType,
                                                       value: str) -> None:
    with pytest.raises(FakeModelException, match="num_speculative_tokens"):
        options.speculation(_spec_args(value))
