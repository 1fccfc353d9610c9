"""Structured output guides: what a request constrains its output to, as the TensorRT-LLM backend
names it (`guided_decoding_guide_type`, `guided_decoding_guide`), turned into an llguidance
grammar and checked before any engine work.

llguidance (not xgrammar): one self-contained wheel (xgrammar needs OpenAI Triton and TVM's FFI
on x86_64 Linux), JSON schema, regular expressions, Lark and GBNF grammars and choices, and a
matcher per sequence that fills one row of a batch's token bitmask (engine.sampler applies it).
"""

from __future__ import annotations

import functools
import json
from typing import Any

# TensorRT-LLM's guide types, and the choice list vLLM's `structured_outputs.choice` sends.
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag", "choice")
_FORMAT: dict[str, Any] = {"json_schema": "json_schema", "regex": "regex",
                           "ebnf_grammar": "grammar", "choice": "choice"}
MAX_GUIDE_CHARS = 200_000


class InvalidGuide(ValueError):
    """A guide llguidance cannot compile; the message says why."""


@functools.lru_cache(maxsize=256)
def grammar(guide_type: str, guide: str) -> str:
    """The llguidance grammar of a guide, compiled and checked once per distinct guide (a
    server sees the same schema many times); InvalidGuide if it is not one."""
    import llguidance

    if guide_type not in GUIDE_TYPES:
        raise InvalidGuide(f"unknown guide type {guide_type!r}; one of {', '.join(GUIDE_TYPES)}")
    if len(guide) > MAX_GUIDE_CHARS:
        raise InvalidGuide(f"{len(guide)} characters; at most {MAX_GUIDE_CHARS}")
    if guide_type == "json":  # any JSON object; the guide text, if any, is not read
        text, fmt = '{"type": "object"}', _FORMAT["json_schema"]
    else:
        text, fmt = guide, _FORMAT.get(guide_type, "")
        if guide_type in ("json_schema", "choice", "structural_tag"):
            try:
                value = json.loads(text)
            except ValueError as e:
                raise InvalidGuide(f"not JSON: {e}") from None
            if guide_type == "choice" and not (isinstance(value, list) and value and all(
                    isinstance(c, str) for c in value)):
                raise InvalidGuide("a choice is a JSON list of one or more strings")
    if guide_type == "structural_tag":
        text, fmt = _structural_tag(text), _FORMAT["ebnf_grammar"]
    try:
        if fmt == "json_schema":
            # No free whitespace between JSON tokens: with it, a model can spend its whole
            # max_tokens on blank lines inside a valid object (small models do).
            compiled = llguidance.JsonCompiler(separators=(", ", ": "),
                                               whitespace_flexible=False).compile(text)
        else:
            compiled = llguidance.grammar_from(fmt, text)
    except ValueError as e:
        raise InvalidGuide(str(e)) from None
    problem = llguidance.LLMatcher.validate_grammar(compiled)
    if problem:
        raise InvalidGuide(problem)
    return str(compiled)


def _structural_tag(text: str) -> str:
    """A structural tag (vLLM's and xgrammar's form, as TensorRT-LLM takes it): free text in
    which each `triggers` string opens one of the `structures`, `begin`, then JSON that follows
    its `schema`, then `end`. As a Lark grammar (llguidance.StructTag)."""
    import llguidance

    spec = json.loads(text)
    structures = spec.get("structures") if isinstance(spec, dict) else None
    triggers = spec.get("triggers") if isinstance(spec, dict) else None
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or \
            not all(isinstance(t, str) and t for t in triggers):
        raise InvalidGuide('a structural tag is {"structures": [{"begin", "schema", "end"}, '
                           '...], "triggers": [...]}')
    tags = []
    for i, st in enumerate(structures):
        if not isinstance(st, dict) or not isinstance(st.get("begin"), str) or not isinstance(
                st.get("end"), str) or not isinstance(st.get("schema"), dict):
            raise InvalidGuide(f"structures[{i}]: begin and end strings and a schema object")
        trigger = next((t for t in triggers if st["begin"].startswith(t)), None)
        if trigger is None:
            raise InvalidGuide(f"structures[{i}]: its begin {st['begin']!r} starts with none "
                               "of the triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=st["begin"], end=st["end"],
                                         grammar=st["schema"]))
    return str(llguidance.StructTag.to_grammar(tags, assume_special=False))
