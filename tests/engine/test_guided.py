"""Structured outputs in the engine (engine/guided.py) on the default model: every guided
output is in its guide's language (JSON schema, regex, choice, grammar), greedy and sampled,
alone and batched with unguided rows, which are left as they are."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import jsonschema
import pytest
from transformers import AutoTokenizer

from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.sequence import Sequence
from python_backends.engine.speculative import SpeculationConfig
from python_backends.params import FinishReason, SamplingParams

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}}}


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    if not (DEFAULT_ENGINE_DIR / "config.json").is_file():
        pytest.fail("no default engine: run scripts/test.sh (it builds it)")
    e = LLMEngine.from_engine_dir(DEFAULT_ENGINE_DIR, num_kv_blocks=256)
    yield e
    e.close()


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return AutoTokenizer.from_pretrained(str(DEFAULT_ENGINE_DIR))


def chat(tokenizer: object, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return list(tokenizer(prompt)["input_ids"])  # type: ignore[operator]


def run(engine: LLMEngine, seqs: list[tuple[list[int], SamplingParams]]) -> list[Sequence]:
    out = [engine.add_request(str(i), p, params) for i, (p, params) in enumerate(seqs)]
    while engine.has_unfinished:
        engine.step()
    assert engine.blocks.num_used == 0
    return out


def params(guide_type: str, guide: str, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=120, end_ids=(2,), guide_type=guide_type, guide=guide,
                          **kw)  # type: ignore[arg-type]


def text(tokenizer: object, seq: Sequence) -> str:
    return str(tokenizer.decode(seq.output_ids, skip_special_tokens=True))  # type: ignore


def test_json_schema_outputs_validate_greedy_and_sampled_beside_unguided_rows(
        engine: LLMEngine, tokenizer: object) -> None:
    prompt = chat(tokenizer, "Describe a person as JSON.")
    schema = json.dumps(PERSON)
    free = SamplingParams(max_tokens=12)
    guided = [params("json_schema", schema), params("json_schema", schema, temperature=0.8,
                                                    seed=3)]
    seqs = run(engine, [(prompt, guided[0]), (prompt, free), (prompt, guided[1])])
    for seq in (seqs[0], seqs[2]):
        assert seq.finish_reason is FinishReason.STOP, text(tokenizer, seq)
        jsonschema.validate(json.loads(text(tokenizer, seq)), PERSON)
    alone = run(engine, [(prompt, free)])[0]
    assert seqs[1].output_ids == alone.output_ids  # the unguided row is untouched


@pytest.mark.parametrize("guide_type,guide,check", [
    ("regex", r"[0-9]{3}-[a-z]{2}", lambda t: len(t) == 6 and t[3] == "-"),
    ("choice", json.dumps(["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
    ("ebnf_grammar", 'root ::= "(" [a-c]+ ")"', lambda t: t[0] == "(" and t[-1] == ")"),
])
def test_each_guide_type(engine: LLMEngine, tokenizer: object, guide_type: str, guide: str,
                         check: object) -> None:
    seq = run(engine, [(chat(tokenizer, "Answer."), params(guide_type, guide))])[0]
    out = text(tokenizer, seq)
    assert seq.finish_reason is FinishReason.STOP and check(out), out  # type: ignore[operator]


def test_any_json_object(engine: LLMEngine, tokenizer: object) -> None:
    """`json`: any object, so it may outrun max_tokens (this small model writes long keys):
    what it wrote is then a prefix the matcher accepted, and it ends in a whole object when
    it stops."""
    seq = run(engine, [(chat(tokenizer, "Give me a JSON object with one key."),
                        params("json", ""))])[0]
    out = text(tokenizer, seq)
    assert out.startswith("{") and not seq.matcher.is_error(), out
    if seq.finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(out), dict)


def test_a_guided_sequence_resumed_elsewhere_continues_in_its_language(
        engine: LLMEngine, tokenizer: object) -> None:
    """A migrated request (or a prefill instance's first token): the tokens so far are fed to
    the new matcher, which goes on from there."""
    prompt = chat(tokenizer, "Describe a person as JSON.")
    p = params("json_schema", json.dumps(PERSON))
    whole = run(engine, [(prompt, p)])[0]
    seq = Sequence("resumed", prompt, p)
    seq.continue_from(whole.output_ids[:5], [0.0] * 5)
    engine.add(seq)
    while engine.has_unfinished:
        engine.step()
    assert seq.output_ids == whole.output_ids
    bad = Sequence("bad", prompt, p)
    bad.continue_from(chat(tokenizer, "not json")[:3], [0.0] * 3)
    with pytest.raises(ValueError, match="do not follow the guide"):
        engine.add(bad)


TEAM = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "role", "level"],
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "role": {"enum": ["dev", "ops", "qa"]},
                   "level": {"type": "integer", "minimum": 1, "maximum": 5}}}}


# As three sequences draft by default (steps of few rows: full length), and as they would in a
# large batch: past no free rows, a draft token only if kept 80% of the time, else a guess.
@pytest.mark.parametrize("speculation", [
    SpeculationConfig(num_tokens=4),
    SpeculationConfig(num_tokens=4, free_rows=0, overhead_rows=0.25)], ids=["few", "guesses"])
def test_drafts_are_checked_against_the_guide_and_change_nothing(
        engine: LLMEngine, tokenizer: object, speculation: SpeculationConfig) -> None:
    """Repeated keys give the n-gram drafter drafts; each is cut to what the guide allows and
    masked position by position, so speculation keeps the guided greedy output as it was. A
    guess is checked against the guide without feeding its matcher."""
    prompts = [chat(tokenizer, f"List a team of four ({team}) as JSON.")
               for team in ("web", "data", "mobile")]
    p = dataclasses.replace(params("json_schema", json.dumps(TEAM)), max_tokens=200)
    plain = run(engine, [(q, p) for q in prompts])
    spec = LLMEngine.from_engine_dir(DEFAULT_ENGINE_DIR, num_kv_blocks=256,
                                     speculation=speculation)
    try:
        drafted = run(spec, [(q, p) for q in prompts])
        assert spec.scheduler.num_accepted_tokens > 0
    finally:
        spec.close()
    assert [s.output_ids for s in drafted] == [s.output_ids for s in plain]
    for s in drafted:
        jsonschema.validate(json.loads(text(tokenizer, s)), TEAM)


def test_preempted_guided_sequences_resume_in_their_language(
        engine: LLMEngine, tokenizer: object) -> None:
    """A KV pool too small for all of them: sequences are preempted and recomputed, their
    matchers untouched (they hold the tokens so far), and the outputs are as unpreempted."""
    prompts = [chat(tokenizer, f"Describe person number {i} as JSON.") for i in range(6)]
    p = params("json_schema", json.dumps(PERSON))
    roomy = run(engine, [(q, p) for q in prompts])
    tight = LLMEngine.from_engine_dir(DEFAULT_ENGINE_DIR, num_kv_blocks=12,
                                      enable_prefix_caching=False)
    try:
        squeezed = run(tight, [(q, p) for q in prompts])
        assert tight.scheduler.num_preemptions > 0
    finally:
        tight.close()
    assert [s.output_ids for s in squeezed] == [s.output_ids for s in roomy]
