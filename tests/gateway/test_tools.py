"""Tool calling: the tools and calls written into the conversation, the grammar that holds a
required call to its function's schema, and the calls read back out of streamed text."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from python_backends import guides
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.gateway.tools import ToolCalls, call_grammar, conversation

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object",
                                           "properties": {"zone": {"enum": ["UTC", "CET"]}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_calls_are_read_out_of_streamed_text_in_any_split() -> None:
    text = f"Let me look.\n{CALL}\n{CALL.replace('Paris', 'Rome')}"
    for size in (1, 3, 7, len(text)):
        reader = ToolCalls(frozenset({"get_weather"}))
        content, calls = "", []
        for at in range(0, len(text), size):
            c, done = reader.feed(text[at:at + size])
            content += c
            calls += done
            assert "<" not in c, "part of a block went out as content"
        content += reader.flush()
        assert content.strip() == "Let me look."
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [
            {"city": "Paris"}, {"city": "Rome"}]
        assert [c["index"] for c in calls] == [0, 1]
        assert calls[0]["id"] != calls[1]["id"] and calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("text", [
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # never closed
    "a < b, <tool",
])
def test_what_is_not_a_call_stays_text(text: str) -> None:
    reader = ToolCalls(frozenset({"get_weather"}))
    content, calls = reader.feed(text)
    assert content + reader.flush() == text and not calls and not reader.calls


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "22C", "tool_call_id": "c1"}]
    out = conversation(messages, [WEATHER], native=False)
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": CALL}
    assert out[3] == {"role": "user", "content": "<tool_response>\n22C\n</tool_response>"}
    with_system = conversation([{"role": "system", "content": "Be brief."}, *messages],
                               [WEATHER], native=False)
    assert with_system[0]["content"].startswith("Be brief.\n\n") and len(with_system) == 4
    native = conversation(messages, [WEATHER], native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[2]["role"] == "tool"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(DEFAULT_ENGINE_DIR))


def accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer),
                                   guides.grammar("ebnf_grammar", grammar))
    ok = matcher.consume_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])
    return bool(ok) and matcher.is_accepting()


def test_required_and_named_grammars_hold_calls_to_the_schemas(tokenizer: Any) -> None:
    required = call_grammar([WEATHER, TIME], "required")
    assert accepts(tokenizer, required, CALL)
    time_call = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    assert accepts(tokenizer, required, f"{CALL}\n<tool_call>\n{time_call}\n</tool_call>")
    assert not accepts(tokenizer, call_grammar([WEATHER, TIME], "required", parallel=False),
                       f"{CALL}\n{CALL}")
    assert not accepts(tokenizer, required, "Sure! " + CALL)
    assert not accepts(tokenizer, required, CALL.replace('"city"', '"town"'))
    named = call_grammar([WEATHER, TIME], "get_time")
    assert not accepts(tokenizer, named, CALL)
    assert accepts(tokenizer, named,
                   '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
