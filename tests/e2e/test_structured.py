"""Structured outputs through the gateway and the running server, as clients call them: the
official `openai` client's `chat.completions.parse` with a pydantic model, 50 generated JSON
schemas whose outputs validate (greedy and sampled, streamed and not), vLLM's
`structured_outputs` and `guided_*` fields, the ensemble's TensorRT-LLM inputs, and a bad schema
refused by name before any engine work."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from python_backends.bench.client import GenerateError, as_list
from tests.e2e.conftest import ENGINE_DIR, Gateway, Server, steady_metric

pytestmark = pytest.mark.e2e
MODEL = "smollm2"
SCHEMAS = 50


def make_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A small random object schema: nested objects, arrays, enums, number ranges, required
    fields; strings and arrays bounded, so a small model's output ends within max_tokens."""
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array"]
                          + (["object"] if depth < 1 else []))
        if kind == "string":
            spec: dict[str, Any] = {"type": "string", "maxLength": rng.randint(3, 12)}
        elif kind in ("integer", "number"):
            lo = rng.randint(-50, 50)
            spec = {"type": kind, "minimum": lo, "maximum": lo + rng.randint(1, 100)}
        elif kind == "boolean":
            spec = {"type": "boolean"}
        elif kind == "enum":
            spec = {"enum": rng.sample(["red", "green", "blue", "cyan", "gold"], 3)}
        elif kind == "array":
            spec = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "maxItems": rng.randint(1, 3)}
        else:
            spec = make_schema(rng, depth + 1)
        props[f"f{i}_{kind}"] = spec
    required = sorted(rng.sample(sorted(props), rng.randint(1, len(props))))
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def test_fifty_generated_schemas_each_give_output_that_validates(gateway: Gateway) -> None:
    rng = random.Random(2026)
    schemas = [make_schema(rng) for _ in range(SCHEMAS)]
    client = gateway.openai()

    def ask(i: int) -> tuple[str, str]:
        sampled, streamed = i % 2 == 1, i % 4 >= 2
        kwargs: dict[str, Any] = dict(
            model=MODEL, max_tokens=160,
            messages=[{"role": "user", "content": f"Fill in this JSON schema: "
                                                  f"{json.dumps(schemas[i])}"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schemas[i],
                                             "strict": True}},
            temperature=0.7 if sampled else 0, seed=i if sampled else None)
        if not streamed:
            out = client.chat.completions.create(**kwargs)
            return out.choices[0].message.content or "", out.choices[0].finish_reason
        text, reason = "", ""
        for event in client.chat.completions.create(**kwargs, stream=True):
            if event.choices:
                text += event.choices[0].delta.content or ""
                reason = event.choices[0].finish_reason or reason
        return text, reason

    with ThreadPoolExecutor(8) as pool:  # bounded: 50 requests, 8 at a time
        answers = list(pool.map(ask, range(SCHEMAS)))
    for i, (text, reason) in enumerate(answers):
        assert reason == "stop", (i, schemas[i], text)
        jsonschema.validate(json.loads(text), schemas[i])


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population_millions: int = pydantic.Field(ge=0, le=50)


def test_the_openai_clients_parse_returns_a_parsed_object(gateway: Gateway) -> None:
    out = gateway.openai().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=100, temperature=0)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, City), out.choices[0].message.content


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: len(t) == 4 and t.isdigit()),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                      "required": ["ok"], "additionalProperties": False}},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
    ({"structured_outputs": {"grammar": 'root ::= "A" [b-d]+ "!"'}},
     lambda t: t[0] == "A" and t[-1] == "!"),
    ({"response_format": {"type": "json_object"}}, lambda t: t.startswith("{")),
])
def test_vllms_fields_and_json_mode(gateway: Gateway, extra: dict[str, Any], check: Any) -> None:
    out = gateway.openai().completions.create(model=MODEL, prompt="Answer: ", max_tokens=40,
                                              temperature=0, extra_body=extra)
    assert check(out.choices[0].text), out.choices[0].text


def test_a_bad_schema_is_refused_by_name_before_any_engine_work(
        gateway: Gateway, server: Server) -> None:
    from python_backends.metrics_text import metric_sum

    def computed() -> float:
        return metric_sum(server.metrics(), "llm_prompt_tokens_computed_total")

    server.wait_idle()  # and the earlier tests' last steps published (a full run read 3 late)
    before = steady_metric([server.options.metrics_url], "llm_prompt_tokens_computed_total")
    with pytest.raises(openai.BadRequestError, match=r"response_format.json_schema.schema"):
        gateway.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    with pytest.raises(openai.BadRequestError, match=r"structured_outputs.regex"):
        gateway.openai().completions.create(model=MODEL, prompt="x",
                                            extra_body={"structured_outputs": {"regex": "(("}})
    assert computed() == before


def test_the_ensembles_tensorrt_llm_inputs(server: Server) -> None:
    """The TensorRT-LLM backend's guided_decoding_guide_type / guided_decoding_guide on the
    ensemble, aggregated and disaggregated (the prefill instance draws the first token under
    the guide, the decode instance goes on from it)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ENGINE_DIR))
    for route in ("aggregated", "disaggregated"):
        out = server.client.generate("A number as JSON:", max_tokens=30, route=route,
                                     exclude_input_in_output=True,
                                     guided_decoding_guide_type="json_schema",
                                     guided_decoding_guide=json.dumps(schema))
        text = str(tokenizer.decode(as_list(out["output_ids"]), skip_special_tokens=True))
        jsonschema.validate(json.loads(text), schema)
    with pytest.raises(GenerateError, match="invalid input 'guided_decoding_guide'") as e:
        server.client.generate("x", guided_decoding_guide_type="regex",
                               guided_decoding_guide="((")
    assert e.value.status == 400
