import numpy as np
import pytest

from python_backends.config import EngineLimits
from python_backends.engine import sampler
from python_backends.front.validation import FAULT_PARAMETERS, InvalidRequest, parse_request
from python_backends.wire import GenerationRequest

LIMITS = EngineLimits(max_seq_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=4)


def tokenize(text: str, add_special_tokens: bool) -> list[int]:
    return [ord(c) % 1000 for c in text]


def text(s: str | bytes) -> np.ndarray:
    return np.array([[s.encode() if isinstance(s, str) else s]], dtype=np.object_)


def parse(params: dict[str, object] | None = None, **inputs: np.ndarray) -> GenerationRequest:
    return parse_request(inputs, params or {}, tokenize, LIMITS, (2,))


def parse_inputs(inputs: dict[str, np.ndarray]) -> GenerationRequest:
    return parse_request(inputs, {}, tokenize, LIMITS, (2,))


def i32(v: int) -> np.ndarray:
    return np.array([[v]], dtype=np.int32)


def f32(v: float) -> np.ndarray:
    return np.array([[v]], dtype=np.float32)


def test_defaults_and_round_trip() -> None:
    req = parse(text_input=text("hello"), stop_words=np.array([[b"lo", b""]], dtype=np.object_),
                min_length=i32(2), stream=np.array([[True]]))
    assert req.prompt_ids == tokenize("hello", True)
    assert req.params.greedy and req.params.end_ids == (2,) and req.params.min_tokens == 2
    assert set(req.params.stop_sequences) == {tuple(tokenize("lo", False)),
                                              tuple(tokenize(" lo", False))}
    assert req.stream
    assert GenerationRequest.from_json(req.to_json()) == req
    assert parse(text_input=text("x"), end_id=i32(-1)).params.end_ids == ()
    assert parse(text_input=text("x"), end_id=i32(7)).params.end_ids == (7,)


@pytest.mark.parametrize(
    ("inputs", "field"),
    [
        ({}, "text_input"),
        ({"text_input": text("")}, "text_input"),
        ({"text_input": text(b"\xff\xfe")}, "text_input"),
        ({"text_input": np.array([[1.0]], dtype=np.float32)}, "text_input"),
        ({"text_input": text("x"), "max_tokens": i32(0)}, "max_tokens"),
        ({"text_input": text("x"), "max_tokens": i32(-3)}, "max_tokens"),
        ({"text_input": text("x"), "max_tokens": i32(64)}, "max_tokens"),
        ({"text_input": text("x"), "max_tokens": f32(3.0)}, "max_tokens"),
        ({"text_input": text("x" * 60), "max_tokens": i32(8)}, "text_input"),
        ({"text_input": text("x" * 64 * 65)}, "text_input"),
        ({"text_input": text("x"), "temperature": f32(-0.1)}, "temperature"),
        ({"text_input": text("x"), "temperature": f32(float("nan"))}, "temperature"),
        ({"text_input": text("x"), "top_p": f32(0.0)}, "top_p"),
        ({"text_input": text("x"), "top_p": f32(1.5)}, "top_p"),
        ({"text_input": text("x"), "top_k": i32(-1)}, "top_k"),
        ({"text_input": text("x"), "repetition_penalty": f32(0.0)}, "repetition_penalty"),
        ({"text_input": text("x"), "min_tokens": i32(100)}, "min_tokens"),
        ({"text_input": text("x"), "min_tokens": i32(1), "min_length": i32(2)}, "min_length"),
        ({"text_input": text("x"), "stream": i32(1)}, "stream"),
        ({"text_input": text("x"), "bogus": i32(1)}, "bogus"),
        ({"text_input": text("x"), "end_id": i32(-2)}, "end_id"),
        ({"text_input": np.array([[b"a", b"b"]], dtype=np.object_)}, "text_input"),
    ],
)
def test_invalid_inputs_name_the_field(inputs: dict[str, np.ndarray], field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        parse_inputs(inputs)
    assert e.value.field == field and f"'{field}'" in str(e.value)


def test_tenant_from_parameter_or_forwarded_header() -> None:
    assert parse(text_input=text("x")).tenant == "default"
    assert parse({"tenant": "acme"}, text_input=text("x")).tenant == "acme"
    assert parse({"x-tenant": "beta"}, text_input=text("x")).tenant == "beta"
    for bad in ("", 7, "x" * 65, "a\nb"):
        with pytest.raises(InvalidRequest) as e:
            parse({"tenant": bad}, text_input=text("x"))
        assert e.value.field == "tenant"


def test_priority_from_input_or_parameter() -> None:
    assert parse(text_input=text("x")).priority == 0
    assert parse(text_input=text("x"), priority=i32(7)).priority == 7
    assert parse({"priority": 3}, text_input=text("x")).priority == 3
    for bad in (10, -1, "high", True):
        with pytest.raises(InvalidRequest) as e:
            parse({"priority": bad}, text_input=text("x"))
        assert e.value.field == "priority"


def test_unknown_parameters_are_refused_but_triton_ones_pass() -> None:
    ok = parse({"triton_enable_empty_final_response": True, "sequence_id": 0},
               text_input=text("x"))
    assert ok.prompt_ids == [ord("x")]
    with pytest.raises(InvalidRequest) as e:
        parse({"max_token": 5}, text_input=text("x"))
    assert e.value.field == "max_token"


def test_fault_injection_is_refused_by_name_unless_the_server_allows_it() -> None:
    for name, values in FAULT_PARAMETERS.items():
        value = values[0]
        with pytest.raises(InvalidRequest, match="fault injection is off") as e:
            parse({name: value}, text_input=text("x"))
        assert e.value.field == name
        allowed = parse_request({"text_input": text("x")}, {name: value}, tokenize, LIMITS, (2,),
                                faults_allowed=True)
        assert getattr(allowed, name) == value
    assert parse({"route": "aggregated"}, text_input=text("x")).route == "aggregated"


def test_cache_salt_from_input_or_parameter() -> None:
    assert parse(text_input=text("x")).cache_salt == ""  # the front salts by tenant
    assert parse({"cache_salt": "s1"}, text_input=text("x")).cache_salt == "s1"
    salted = parse(text_input=text("x"), cache_salt=np.array([[b"s2"]], dtype=np.object_))
    assert salted.cache_salt == "s2"
    cases: list[tuple[dict[str, object], dict[str, np.ndarray]]] = [
        ({"cache_salt": ""}, {}), ({"cache_salt": 7}, {}),
        ({"cache_salt": "a\nb"}, {}),
        ({}, {"cache_salt": np.array([[b"\xff"]], dtype=np.object_)}),
    ]
    for params, inputs in cases:
        with pytest.raises(InvalidRequest) as e:
            parse(params, text_input=text("x"), **inputs)
        assert e.value.field == "cache_salt"


def test_stream_interval_is_at_least_one() -> None:
    assert parse(text_input=text("x")).stream_interval == 1
    assert parse(text_input=text("x"), stream_interval=i32(4)).stream_interval == 4
    for bad in (i32(0), np.array([[2.0]], dtype=np.float32)):
        with pytest.raises(InvalidRequest) as e:
            parse(text_input=text("x"), stream_interval=bad)
        assert e.value.field == "stream_interval"


def test_resume_ids_carry_tokens_generated_elsewhere() -> None:
    ids = np.array([[5, 6, 7]], dtype=np.int32)
    req = parse_request({"text_input": text("hi"), "max_tokens": i32(8), "resume_ids": ids},
                        {}, tokenize, LIMITS, (2,), vocab_size=100)
    assert req.resume_ids == [5, 6, 7]
    assert GenerationRequest.from_json(req.to_json()) == req
    assert parse(text_input=text("hi")).resume_ids == []


@pytest.mark.parametrize(("ids", "message"), [
    (np.array([[1, 2, 3, 4]], dtype=np.int32), "nothing to generate"),
    (np.array([[1.0]], dtype=np.float32), "integer"),
    (np.array([[1, 100]], dtype=np.int32), "outside the vocabulary"),
    (np.array([[-1]], dtype=np.int32), "outside the vocabulary"),
])
def test_bad_resume_ids_are_refused_by_name(ids: np.ndarray, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as e:
        parse_request({"text_input": text("hi"), "max_tokens": i32(4), "resume_ids": ids},
                      {}, tokenize, LIMITS, (2,), vocab_size=100)
    assert e.value.field == "resume_ids"


def test_a_guide_is_compiled_at_the_edge_and_carried_to_the_engines() -> None:
    req = parse(text_input=text("x"), guided_decoding_guide_type=text("json_schema"),
                guided_decoding_guide=text('{"type": "object"}'))
    assert (req.params.guide_type, req.params.guide) == ("json_schema", '{"type": "object"}')
    assert req.params.guided and not sampler.argmax_only(req.params)
    assert GenerationRequest.from_json(req.to_json()) == req
    assert parse(text_input=text("x"),
                 guided_decoding_guide_type=text("json")).params.guide_type == "json"
    assert not parse(text_input=text("x")).params.guided


@pytest.mark.parametrize(("guide_type", "guide", "field"), [
    ("xml", "<a/>", "guided_decoding_guide_type"),
    ("regex", None, "guided_decoding_guide"),
    ("regex", "((", "guided_decoding_guide"),
    ("json_schema", "{not json", "guided_decoding_guide"),
    ("json_schema", '{"type": "nonsense"}', "guided_decoding_guide"),
    ("choice", '"not a list"', "guided_decoding_guide"),
    (None, "[a-z]", "guided_decoding_guide_type"),
])
def test_a_guide_that_cannot_be_one_is_refused_by_name(guide_type: str | None,
                                                        guide: str | None, field: str) -> None:
    inputs = {"text_input": text("x")}
    if guide_type is not None:
        inputs["guided_decoding_guide_type"] = text(guide_type)
    if guide is not None:
        inputs["guided_decoding_guide"] = text(guide)
    with pytest.raises(InvalidRequest) as e:
        parse_inputs(inputs)
    assert e.value.field == field, str(e.value)


def ids(*values: int) -> np.ndarray:
    return np.array([list(values)], dtype=np.int32)


def test_token_id_prompts_bias_min_p_and_stop_token_ids_reach_the_engine() -> None:
    req = parse_request({"input_ids": ids(5, 6, 7), "stop_token_ids": ids(9, 2),
                         "logit_bias": text('{"7": -100, "3": 2.5}'), "min_p": f32(0.25),
                         "temperature": f32(1.0)}, {}, tokenize, LIMITS, (2,), vocab_size=100)
    assert req.prompt_ids == [5, 6, 7]
    assert req.params.end_ids == (2, 9)
    assert req.params.logit_bias == ((3, 2.5), (7, -100.0))
    assert req.params.min_p == 0.25
    assert GenerationRequest.from_json(req.to_json()) == req
    # stop_token_ids still end the output when the end token does not (ignore_eos)
    no_eos = parse(input_ids=ids(5), end_id=i32(-1), stop_token_ids=ids(9))
    assert no_eos.params.end_ids == (9,)


@pytest.mark.parametrize(("inputs", "field", "message"), [
    ({"input_ids": ids(5), "text_input": text("x")}, "input_ids", "not both"),
    ({"input_ids": np.zeros((1, 0), dtype=np.int32)}, "input_ids", "must not be empty"),
    ({"input_ids": ids(5, 100)}, "input_ids", "token id 100 is outside"),
    ({"input_ids": np.array([[1.0]], dtype=np.float32)}, "input_ids", "integer"),
    ({"input_ids": ids(*range(60)), "max_tokens": i32(8)}, "input_ids", "context length"),
    ({"text_input": text("x"), "stop_token_ids": ids(-1)}, "stop_token_ids", "outside"),
    ({"text_input": text("x"), "logit_bias": text("[1]")}, "logit_bias", "JSON object"),
    ({"text_input": text("x"), "logit_bias": text('{"a": 1}')}, "logit_bias", "not a token"),
    ({"text_input": text("x"), "logit_bias": text('{"100": 1}')}, "logit_bias", "outside"),
    ({"text_input": text("x"), "logit_bias": text('{"1": 101}')}, "logit_bias", "-100, 100"),
    ({"text_input": text("x"), "logit_bias": text("{")}, "logit_bias", "not JSON"),
    ({"text_input": text("x"), "min_p": f32(1.5)}, "min_p", r"\[0, 1\]"),
])
def test_bad_ids_biases_and_min_p_are_refused_by_name(inputs: dict[str, np.ndarray], field: str,
                                                      message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as e:
        parse_request(inputs, {}, tokenize, LIMITS, (2,), vocab_size=100)
    assert e.value.field == field
