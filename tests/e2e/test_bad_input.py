"""Bad input gets a clear error naming the field; the server keeps serving and leaks no block."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from python_backends.bench.client import GenerateError, as_list
from tests.e2e.conftest import MAX_TOKENS, PROMPTS, Reference, Server

pytestmark = pytest.mark.e2e

HTTP_CASES: list[tuple[dict[str, object], str]] = [
    ({"max_tokens": 8}, "text_input"),  # missing
    ({"text_input": "", "max_tokens": 8}, "text_input"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": -5}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 100000}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 8, "max_token": 9}, "max_token"),  # unknown (misspelt)
    ({"text_input": "hi", "max_tokens": 8, "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "max_tokens": 8, "top_p": 0.0}, "top_p"),
    ({"text_input": "hi", "max_tokens": 8, "top_p": 1.5}, "top_p"),
    ({"text_input": "hi", "max_tokens": 8, "top_k": -1}, "top_k"),
    ({"text_input": "hi", "max_tokens": 8, "priority": 12}, "priority"),
    ({"text_input": "hi", "max_tokens": 8, "cache_salt": ""}, "cache_salt"),
    ({"text_input": "hi", "max_tokens": 8, "cache_salt": "x" * 300}, "cache_salt"),
    ({"text_input": "word " * 3000, "max_tokens": 8}, "text_input"),  # longer than the context
]


@pytest.mark.parametrize(("body", "field"), HTTP_CASES)
def test_http_errors_name_the_field(server: Server, body: dict[str, object], field: str) -> None:
    with pytest.raises(GenerateError) as e:
        server.client.generate(None, **body)
    assert f"'{field}'" in e.value.message
    assert 400 <= e.value.status < 500


def test_http_wrong_json_type_is_refused(server: Server) -> None:
    """Triton parses /generate JSON into typed tensors before any model runs; its message for
    a mistyped value does not name the field (Triton 2.51), so only the refusal is checked."""
    with pytest.raises(GenerateError) as e:
        server.client.generate("hi", max_tokens="many")
    assert e.value.status >= 400


def _infer_error(server: Server, inputs: list[grpcclient.InferInput]) -> str:
    errors: list[InferenceServerException] = []
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.options.grpc_port}")

    def callback(result: grpcclient.InferResult, error: InferenceServerException | None) -> None:
        if error is not None:
            errors.append(error)

    client.start_stream(callback=callback)
    client.async_stream_infer("ensemble", inputs)
    client.stop_stream()
    client.close()
    assert errors, "the request should have failed"
    return str(errors[0].message())


def _input(name: str, value: np.ndarray, dtype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def _text(raw: bytes) -> grpcclient.InferInput:
    return _input("text_input", np.array([[raw]], dtype=np.object_), "BYTES")


def test_invalid_utf8_is_refused(server: Server) -> None:
    msg = _infer_error(server, [_text(b"caf\xc3 \xff\xfe")])
    assert "text_input" in msg and "UTF-8" in msg


def test_wrong_dtype_is_refused(server: Server) -> None:
    msg = _infer_error(server, [
        _text(b"hello"), _input("max_tokens", np.array([[8.0]], dtype=np.float32), "FP32"),
    ])
    assert "max_tokens" in msg


def test_unknown_input_is_refused(server: Server) -> None:
    msg = _infer_error(server, [
        _text(b"hello"), _input("bogus", np.array([[1]], dtype=np.int32), "INT32"),
    ])
    assert "bogus" in msg


def test_server_keeps_serving_without_leaks(server: Server, reference: Reference) -> None:
    """Runs after the matrix above (file order): nothing leaked, normal requests still right."""
    wrong_type: dict[str, object] = {"text_input": "hi", "max_tokens": "many"}
    for body in [*(b for b, _field in HTTP_CASES), wrong_type]:
        with pytest.raises(GenerateError):
            server.client.generate(None, **body)
    assert server.wait_idle() == 0
    prompt = PROMPTS[0]
    out = server.client.generate(prompt, max_tokens=MAX_TOKENS, exclude_input_in_output=True)
    assert as_list(out["output_ids"]) == reference.outputs[prompt]
    assert server.kv_blocks_used() == 0
