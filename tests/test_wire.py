"""The typed messages between the models: every config.pbtxt declares exactly the tensors the
wire module writes, and each message survives its encoding (batched or not)."""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, asdict, dataclass, field, fields, make_dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from python_backends.params import SamplingParams
from python_backends.wire import (
    MODEL_INTERFACES,
    ClientChunk,
    ClientOutput,
    EngineRequest,
    GenerationRequest,
    Kind,
    Message,
    PrefillReply,
    TensorSpec,
    TokenizedRequest,
    TokenStep,
    _tensor,
)

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
_TENSOR = re.compile(r'\{\s*name:\s*"(\w+)"\s+data_type:\s*(\w+)\s+dims:\s*\[\s*(-?\d+)\s*\]'
                     r'([^}]*)\}')


def declared(model: str, section: str,
             repository: Path = REPOSITORY) -> dict[str, tuple[str, list[int], bool]]:
    """The `input` or `output` tensors of a config.pbtxt: name -> (type, dims, optional)."""
    text = (repository / model / "config.pbtxt").read_text()
    text = "\n".join(line.split("#")[0] for line in text.splitlines())
    body = re.search(rf"^{section}\s*\[(.*?)^\]", text, re.S | re.M)
    assert body is not None, f"{model}: no {section} section"
    return {m[1]: (m[2], [int(m[3])], "optional: true" in m[4])
            for m in _TENSOR.finditer(body.group(1))}


def expected(specs: list[TensorSpec]) -> dict[str, tuple[str, list[int], bool]]:
    return {s.name: (s.kind.triton_type, s.dims, s.optional) for s in specs}


@pytest.mark.parametrize("model", sorted(MODEL_INTERFACES))
def test_config_declares_the_wire_tensors(model: str) -> None:
    inputs, outputs = MODEL_INTERFACES[model]
    assert declared(model, "input") == expected(inputs)
    outs = declared(model, "output")
    assert {k: v[:2] for k, v in outs.items()} == {k: v[:2] for k, v in expected(outputs).items()}


def test_every_model_in_the_repository_has_an_interface() -> None:
    models = {p.parent.name for p in REPOSITORY.glob("*/config.pbtxt")}
    assert models == set(MODEL_INTERFACES)


def test_a_drifted_config_is_caught(tmp_path: Path) -> None:
    """The check above can fail: a renamed or retyped tensor in a config is reported."""
    text = (REPOSITORY / "worker" / "config.pbtxt").read_text()
    for old, new in (('"REQUEST"', '"REQUEST_JSON"'), ("TYPE_FP32", "TYPE_FP16")):
        (tmp_path / "worker").mkdir(exist_ok=True)
        (tmp_path / "worker" / "config.pbtxt").write_text(text.replace(old, new))
        drifted = declared("worker", "input", tmp_path), declared("worker", "output", tmp_path)
        assert drifted != (expected(MODEL_INTERFACES["worker"][0]),
                           expected(MODEL_INTERFACES["worker"][1]))


REQUEST = GenerationRequest(
    prompt_ids=[1, 2, 3], stream=True, tenant="acme", priority=4, route="disaggregated",
    params=SamplingParams(max_tokens=5, temperature=0.5, seed=7, end_ids=(2,),
                          stop_sequences=((4, 5),), return_log_probs=True),
)
MESSAGES: list[Message] = [
    TokenizedRequest(REQUEST),
    EngineRequest(REQUEST),
    EngineRequest(REQUEST, "triton_llm_cancel_1_2", 9, b'{"x":1}', 42, -0.5),
    TokenStep([7], [-0.25], "", 3, 1),
    TokenStep([], [], "cancelled", 3, 0),
    TokenStep([7, 8], [-0.25, -1.0], "", 3, 2, top_ids=[7, 9, 8, 1],
              top_log_probs=[-0.25, -2.0, -1.0, -1.5]),
    PrefillReply(11, -1.5, "", b"handle", [], []),
    PrefillReply(11, -1.5, "", b"handle", [11, 4], [-1.5, -2.5]),
    ClientChunk("board", 3, [1, 2, 3], 1, [2, 3], "stop", 5, 2, -3.0, [], "", [], []),
    ClientOutput("Paris. 中国", "length", 5, 2, -1.0, [-0.5, -0.5], [10, 11], "", [10, 12],
                 [-0.5, -3.0]),
]


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Message, batched: bool) -> None:
    arrays = message.encode(batched)
    assert all(arr.ndim == (2 if batched else 1) for arr in arrays.values())
    assert type(message).decode(arrays) == message


def previous_version_reads(text: str) -> Any:
    """How an engine server of the version before `stream_interval` read a request: the class
    without that field, every params key it indexes required, and no unknown key taken."""
    older = make_dataclass("GenerationRequest", [
        (f.name, f.type, field(default=f.default) if f.default is not MISSING
         else field(default_factory=f.default_factory) if f.default_factory is not MISSING
         else field())
        for f in fields(GenerationRequest) if f.name != "stream_interval"], frozen=True)
    d = json.loads(text)
    p = d.pop("params")
    p["end_ids"] = tuple(p["end_ids"])
    p["stop_sequences"] = tuple(tuple(s) for s in p["stop_sequences"])
    p["bad_sequences"] = tuple(tuple(s) for s in p["bad_sequences"])
    p["logit_bias"] = tuple((int(t), float(b)) for t, b in p["logit_bias"])
    return older(params=SamplingParams(**p), **d)


def test_a_request_reads_on_an_older_engine_unless_it_asks_for_something_newer() -> None:
    """Fields at their defaults stay out of the JSON, so mixed versions serve what both know."""
    plain = GenerationRequest(prompt_ids=[1, 2], params=SamplingParams(max_tokens=3))
    assert json.loads(plain.to_json()) == {"prompt_ids": [1, 2], "params": {
        "max_tokens": 3, "end_ids": [], "stop_sequences": [], "bad_sequences": [],
        "logit_bias": []}}
    for request in (plain, REQUEST):
        old = previous_version_reads(request.to_json())
        assert asdict(old) == {k: v for k, v in asdict(request).items() if k != "stream_interval"}
    newer = replace(REQUEST, stream_interval=3)
    assert json.loads(newer.to_json())["stream_interval"] == 3
    assert GenerationRequest.from_json(newer.to_json()) == newer
    with pytest.raises(TypeError, match="stream_interval"):
        previous_version_reads(newer.to_json())  # refused, not served without it
    with pytest.raises(TypeError, match="not_a_field"):
        GenerationRequest.from_json(json.dumps({**json.loads(plain.to_json()), "not_a_field": 1}))


def test_fields_at_their_defaults_read_back_as_defaults() -> None:
    busy = GenerationRequest(
        prompt_ids=[5], params=SamplingParams(max_tokens=9, top_k=3, bad_sequences=((1, 2),),
                                              logit_bias=((4, -1.5),), guide_type="regex",
                                              guide="a+"),
        exclude_input_in_output=True, kv_transport="nixl", cache_salt="s", resume_ids=[7, 8],
        stream_interval=2)
    for request in (busy, GenerationRequest(prompt_ids=[5], params=SamplingParams(max_tokens=9))):
        assert GenerationRequest.from_json(request.to_json()) == request


def test_optional_fields_are_left_out_and_required_ones_named() -> None:
    arrays = EngineRequest(REQUEST).encode(batched=False)
    assert set(arrays) == {"REQUEST", "CANCEL_TICKET"}
    with pytest.raises(KeyError, match="OUTPUT_IDS"):
        PrefillReply.decode({"FINISH_REASON": np.array([b""], dtype=np.object_)})
    with pytest.raises(KeyError, match="STEP"):
        TokenStep.decode({"OUTPUT_IDS": np.array([1], dtype=np.int32)})


def test_a_token_step_travels_as_one_packed_tensor() -> None:
    step = TokenStep([7, 8], [-0.25, -1.5], "", 3, 2)
    [(name, arr)] = step.encode(batched=False).items()
    assert (name, arr.dtype, TokenStep.names()) == ("STEP", np.uint8, ["STEP"])
    assert arr.nbytes == len(step.pack()) < 64
    failed = TokenStep([], [], "error", 3, 0, "engine: 中文 failed", "internal")
    assert TokenStep.unpack(failed.pack()) == failed


@dataclass(frozen=True)
class EveryKind(Message):
    PACKED: ClassVar[str] = "ALL"
    JSON_TYPES: ClassVar[dict[str, type]] = {"request": GenerationRequest}
    i: int = _tensor("I", Kind.INT)
    u: int = _tensor("U", Kind.UINT64)
    f: float = _tensor("F", Kind.FLOAT)
    b: bool = _tensor("B", Kind.BOOL)
    text: str = _tensor("T", Kind.TEXT)
    blob: bytes = _tensor("BL", Kind.BLOB)
    request: GenerationRequest = _tensor("J", Kind.JSON)
    ints: list[int] = _tensor("IS", Kind.INTS)
    floats: list[float] = _tensor("FS", Kind.FLOATS)
    texts: list[str] = _tensor("TS", Kind.TEXTS)


def test_every_kind_of_field_can_be_packed() -> None:
    message = EveryKind(-7, 2**64 - 1, 0.5, True, "é", b"\0\xff", REQUEST, [1, -2], [0.25],
                        ["a", "", "中"])
    assert EveryKind.decode(message.encode(batched=False)) == message
    assert EveryKind.names() == ["ALL"]


def test_a_damaged_packed_message_is_refused() -> None:
    packed = TokenStep([7], [-0.25], "stop", 3, 1).pack()
    with pytest.raises(ValueError, match="not a packed message"):
        TokenStep.unpack(packed[:-3])
    with pytest.raises(ValueError, match="bytes after the message"):
        TokenStep.unpack(packed + b"\0")
    with pytest.raises(ValueError, match="carries every field"):
        EngineRequest.pack(EngineRequest(REQUEST))


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=8),
       text=st.text(max_size=20), n=st.integers(0, 2**31 - 1))
def test_packing_keeps_every_value(ids: list[int], text: str, n: int) -> None:
    log_probs = [float(np.float32(-i / 7)) for i in range(len(ids))]
    step = TokenStep(ids, log_probs, text, n, len(ids), text, "")
    assert TokenStep.decode(step.encode(batched=True)) == step
