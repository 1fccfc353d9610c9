"""OpenAI request bodies: served fields become a Generation, every other field is refused by
name, with a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from python_backends.gateway.errors import ApiError
from python_backends.gateway.protocol import parse_chat, parse_completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
TAG = {"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}],
       "triggers": ["<f="]}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_completion_fields_map_to_the_ensemble() -> None:
    gen = parse_completion({"model": "m", "prompt": ["Once"], "max_tokens": 8, "stream": True,
                            "stream_options": {"include_usage": True}, "stop": "\n",
                            "temperature": 0, "top_p": 0.5, "seed": 3, "presence_penalty": 1,
                            "frequency_penalty": 0.5, "logprobs": 1, "user": "team-a",
                            "cache_salt": "s"})
    assert (gen.prompts, gen.max_tokens, gen.stream, gen.include_usage) == (["Once"], 8, True,
                                                                            True)
    assert gen.stops == ["\n"] and gen.logprobs and not gen.chat
    assert gen.sampling == {"temperature": 0.0, "top_p": 0.5, "seed": 3,
                            "presence_penalty": 1.0, "frequency_penalty": 0.5}
    assert (gen.user, gen.cache_salt) == ("team-a", "s")


def test_vllms_extra_fields_keep_vllms_meanings() -> None:
    # what vLLM's benchmark client sends, and what clients written for vLLM often add
    gen = parse_completion({"model": "m", "prompt": "x", "repetition_penalty": 1.0,
                            "ignore_eos": True, "top_k": -1, "min_tokens": 4, "min_p": 0,
                            "stop_token_ids": [], "include_stop_str_in_output": True,
                            "skip_special_tokens": True, "spaces_between_special_tokens": False})
    assert gen.sampling == {"repetition_penalty": 1.0, "top_k": 0, "min_tokens": 4}
    assert gen.ignore_eos and gen.include_stop
    chat = parse_chat({**CHAT, "top_k": 5, "ignore_eos": False, "stream_interval": 3})
    assert chat.sampling == {"top_k": 5, "stream_interval": 3}
    assert not chat.ignore_eos and not chat.include_stop


def test_chat_messages_and_max_completion_tokens() -> None:
    gen = parse_chat({**CHAT, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text",
                                                                      "text": " there"}]}],
        "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 0})
    assert gen.chat and gen.max_tokens == 5 and gen.logprobs
    assert gen.messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi there"}]


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "m", "prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m"}, "prompt"),
    ({"prompt": "x"}, "model"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "m", "prompt": "x", "seed": -1}, "seed"),
    ({"model": "m", "prompt": "x", "top_k": -2}, "top_k"),
    ({"model": "m", "prompt": "x", "top_k": 1.5}, "top_k"),
    ({"model": "m", "prompt": "x", "repetition_penalty": "none"}, "repetition_penalty"),
    ({"model": "m", "prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"model": "m", "prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"model": "m", "prompt": "x", "stream_interval": 0}, "stream_interval"),
    ({"model": "m", "prompt": "x", "stream_interval": 2.5}, "stream_interval"),
    ({"model": "m", "prompt": "x", "stop_token_ids": "2"}, "stop_token_ids"),
    ({"model": "m", "prompt": "x", "skip_special_tokens": False}, "skip_special_tokens"),
    ({"model": "m", "prompt": "x", "include_stop_str_in_output": 1},
     "include_stop_str_in_output"),
    ({"model": "m", "prompt": "x", "best_of_n": 2}, "best_of_n"),
    ({"model": "m", "prompt": "x", "logit_bias": {"a": 5}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"1": 500}}, "logit_bias.1"),
    ({"model": "m", "prompt": "x", "logit_bias": [1]}, "logit_bias"),
    ({"model": "m", "prompt": [[]]}, "prompt"),
    ({"model": "m", "prompt": [1.5]}, "prompt"),
    ({"model": "m", "prompt": ["a", ""]}, "prompt[1]"),
    ({"model": "m", "prompt": [[1], [-1]]}, "prompt[1]"),
    ({"model": "m", "prompt": ["x"] * 65}, "prompt"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m", "prompt": "x", "n": 17}, "n"),
    ({"model": "m", "prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ({"model": "m", "prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ({"model": "m", "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": "m", "prompt": "x", "min_p": "low"}, "min_p"),
    ({"model": "m", "prompt": "x", "priority": 1}, "priority"),
    ({"model": "m", "prompt": "x", "priority": -10}, "priority"),
    ({"model": "m", "prompt": "x", "tools": []}, "tools"),
])
def test_completion_refusals_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == field and f"'{field}'" in e.value.message


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools[0]"),
    ({**CHAT, "tools": {"type": "function"}}, "tools"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": ""}}]},
     "tools[0].function.name"),
    ({**CHAT, "tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": 1}}]},
     "tools[0].function.parameters"),
    ({**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nope"}}}], "tool_choice": "required"}, "tools"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),
    ({**CHAT, "tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
    ({**CHAT, "tools": [TOOL], "tool_choice": {"type": "function",
                                               "function": {"name": "other"}}}, "tool_choice"),
    ({**CHAT, "tools": [TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({**CHAT, "tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({**CHAT, "messages": [{"role": "tool", "content": "22C"}]}, "messages[0].tool_call_id"),
    ({**CHAT, "messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ({**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({**CHAT, "messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0]"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "logprobs": 1}, "logprobs"),
    ({**CHAT, "prompt": "x"}, "prompt"),
])
def test_chat_refusals_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == field


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(ApiError) as e:
        parse_chat(["not", "an", "object"])
    assert e.value.status == 400


def test_structured_output_fields_map_to_the_ensembles_guide() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    cases: list[tuple[dict[str, Any], tuple[str, str] | None]] = [
        ({"response_format": fmt}, ("json_schema", json.dumps(schema))),
        ({"response_format": {"type": "json_object"}}, ("json", "")),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"json": schema}}, ("json_schema", json.dumps(schema))),
        ({"guided_json": json.dumps(schema)}, ("json_schema", json.dumps(schema))),
        ({"structured_outputs": {"regex": "[a-z]+"}}, ("regex", "[a-z]+")),
        ({"guided_choice": ["a", "b"]}, ("choice", '["a", "b"]')),
        ({"guided_grammar": 'root ::= "x"'}, ("ebnf_grammar", 'root ::= "x"')),
        ({"response_format": {"type": "structural_tag", **TAG}},
         ("structural_tag", json.dumps(TAG))),
        ({"structured_outputs": {"structural_tag": json.dumps(TAG)}},
         ("structural_tag", json.dumps(TAG))),
    ]
    for extra, guide in cases:
        assert parse_chat({**CHAT, **extra}).guide == guide, extra


@pytest.mark.parametrize(("extra", "field"), [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}},
     "response_format.json_schema"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
    ({"structured_outputs": {"xml": "x"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_structured_output_refusals_name_the_field(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat({**CHAT, **extra})
    assert e.value.status == 400 and e.value.param == field, e.value.message


def test_choices_prompts_biases_and_priority_map_to_the_ensemble() -> None:
    gen = parse_completion({"model": "m", "prompt": [[1, 2], "text"], "n": 2, "best_of": 3,
                            "echo": True, "logit_bias": {"7": -100, "03": 2},
                            "min_p": 0.1, "stop_token_ids": [9], "priority": -3})
    assert gen.prompts == [[1, 2], "text"] and (gen.n, gen.best_of, gen.echo) == (2, 3, True)
    assert gen.sampling == {"logit_bias": '{"7": -100.0, "3": 2.0}', "min_p": 0.1,
                            "stop_token_ids": [9], "priority": 3}
    assert parse_completion({"model": "m", "prompt": "x", "n": 4}).best_of == 4
    assert parse_completion({"model": "m", "prompt": "x", "priority": 0}).sampling == {}


def test_tools_and_their_messages() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    gen = parse_chat({**CHAT, "tools": [TOOL], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]})
    assert gen.tool_choice == "auto" and gen.guide is None
    assert [f["name"] for f in gen.tools] == ["get_weather"]
    assert gen.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert gen.messages[2] == {"role": "tool", "content": "22C", "tool_call_id": "call_1"}
    assert parse_chat(CHAT).tool_choice == "none"
    assert parse_chat({**CHAT, "tools": [TOOL], "tool_choice": "none"}).guide is None
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        required = parse_chat({**CHAT, "tools": [TOOL], "tool_choice": choice})
        assert required.guide is not None and required.guide[0] == "ebnf_grammar"
        assert '"const": "get_weather"' in required.guide[1]
