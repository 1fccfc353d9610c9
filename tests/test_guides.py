"""guides.py: a guide compiles once per distinct text, and one that cannot is refused saying
why."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from python_backends import guides
from python_backends.config import DEFAULT_ENGINE_DIR

TAG = {"triggers": ["<f="], "structures": [{
    "begin": "<f=weather>", "end": "</f>",
    "schema": {"type": "object", "properties": {"city": {"type": "string"}},
               "required": ["city"], "additionalProperties": False}}]}


def test_a_guide_compiles_once_per_distinct_text() -> None:
    guides.grammar.cache_clear()
    first = guides.grammar("regex", "[0-9]+")
    assert guides.grammar("regex", "[0-9]+") is first
    assert guides.grammar.cache_info().hits == 1
    assert guides.grammar("json", "") == guides.grammar("json", "ignored")  # any object


@pytest.mark.parametrize(("guide_type", "guide", "why"), [
    ("xml", "<a/>", "unknown guide type 'xml'"),
    ("json_schema", "{", "not JSON"),
    ("json_schema", '{"type": "nonsense"}', "nonsense"),
    ("choice", "[]", "a choice is a JSON list"),
    ("regex", "((", "."),
    ("ebnf_grammar", "root ::= (", "."),
    ("regex", "a" * (guides.MAX_GUIDE_CHARS + 1), "at most"),
    ("structural_tag", "[1]", "a structural tag is"),
    ("structural_tag", json.dumps({**TAG, "triggers": ["<tool"]}), "starts with none"),
    ("structural_tag", json.dumps({**TAG, "structures": [{"begin": "<f=x>"}]}),
     r"structures\[0\]"),
])
def test_what_cannot_be_a_guide_is_refused(guide_type: str, guide: str, why: str) -> None:
    with pytest.raises(guides.InvalidGuide, match=why):
        guides.grammar(guide_type, guide)


def test_a_structural_tag_leaves_text_free_and_holds_each_call_to_its_schema() -> None:
    hf: Any = AutoTokenizer.from_pretrained(str(DEFAULT_ENGINE_DIR))
    grammar = guides.grammar("structural_tag", json.dumps(TAG))

    def follows(text: str) -> bool:
        matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(hf), grammar)
        return bool(matcher.consume_tokens(hf(text, add_special_tokens=False)["input_ids"]))

    assert follows("Any text at all, then <f=weather>{\"city\": \"Oslo\"}</f> and more.")
    assert not follows("Text, then <f=weather>{\"town\": \"Oslo\"}</f>")
