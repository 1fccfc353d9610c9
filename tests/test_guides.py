"""guides.py: a guide compiles once per distinct text, and one that cannot is refused saying
why."""

from __future__ import annotations

import pytest

from python_backends import guides


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
])
def test_what_cannot_be_a_guide_is_refused(guide_type: str, guide: str, why: str) -> None:
    with pytest.raises(guides.InvalidGuide, match=why):
        guides.grammar(guide_type, guide)
