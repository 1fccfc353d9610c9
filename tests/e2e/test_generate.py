"""Greedy output through the running server equals Hugging Face's, token for token."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from python_backends.bench.client import as_list
from python_backends.metrics_text import metric_sum
from tests.e2e.conftest import MAX_TOKENS, PROMPTS, Reference, Server, hf_greedy

pytestmark = pytest.mark.e2e
GREEDY = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_generate_matches_hf(server: Server, reference: Reference, prompt: str) -> None:
    out = server.client.generate(prompt, **GREEDY)
    assert as_list(out["output_ids"]) == reference.outputs[prompt]
    assert out["text_output"] == reference.text(prompt)
    assert out["num_output_tokens"] == len(reference.outputs[prompt])
    assert out["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_sse_stream_matches_hf(server: Server, reference: Reference, prompt: str) -> None:
    result = server.client.stream_collect(prompt, **GREEDY)
    assert result.output_ids == reference.outputs[prompt]
    assert result.text == reference.text(prompt)
    assert len(result.token_times) == len(reference.outputs[prompt])


def assert_runs_of_three(server: Server, reference: Reference, prompt: str,
                         **request: object) -> None:
    """A stream of `prompt` whose first token comes alone, every later response but the last
    carrying at least three, together HF's output."""
    expected = reference.outputs[prompt]
    assert len(expected) > 4, prompt  # room for a run of three between first and last
    runs = [ids for event in server.client.stream(prompt, **request, **GREEDY)
            if (ids := as_list(event.get("output_ids", [])))]
    assert [t for run in runs for t in run] == expected
    assert len(runs[0]) == 1 and all(len(run) >= 3 for run in runs[1:-1]), runs
    assert len(runs) < len(expected), runs


def test_a_stream_interval_sends_runs_of_tokens_and_keeps_the_hf_output(
        server: Server, reference: Reference) -> None:
    """The worker reloaded with `stream_interval` 3: runs of three, HF's output."""
    with server.options.repository().reloaded("worker", stream_interval="3"):
        for prompt in PROMPTS[:2]:
            assert_runs_of_three(server, reference, prompt, route="aggregated")
    assert server.wait_idle() == 0


@pytest.mark.parametrize("route", ["aggregated", "disaggregated"])
def test_a_request_asks_for_its_own_stream_interval(server: Server, reference: Reference,
                                                    route: str) -> None:
    """`stream_interval` 3 on one request, on either engine group (a prefilled request's first
    token comes from the prefill group, the rest from decode): the same runs, HF's output."""
    assert_runs_of_three(server, reference, PROMPTS[2], route=route, stream_interval=3)
    assert server.wait_idle() == 0


def test_prompt_is_included_unless_excluded(server: Server, reference: Reference) -> None:
    prompt = PROMPTS[0]
    out = server.client.generate(prompt, max_tokens=MAX_TOKENS)
    assert out["text_output"] == prompt + reference.text(prompt)
    assert out["num_input_tokens"] == len(reference.tokenizer(prompt)["input_ids"])


def test_grpc_stream_matches_hf(server: Server, reference: Reference) -> None:
    prompt = PROMPTS[2]
    received: list[grpcclient.InferResult] = []
    errors: list[Exception] = []

    def callback(result: grpcclient.InferResult, error: Exception | None) -> None:
        if error is not None:
            errors.append(error)
        else:
            received.append(result)

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.options.grpc_port}")
    client.start_stream(callback=callback)
    inputs = [
        _grpc_input("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
        _grpc_input("max_tokens", np.array([[MAX_TOKENS]], dtype=np.int32), "INT32"),
        _grpc_input("stream", np.array([[True]]), "BOOL"),
        _grpc_input("exclude_input_in_output", np.array([[True]]), "BOOL"),
    ]
    client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
    client.stop_stream()  # waits for the stream to finish
    client.close()
    assert not errors
    chunks = [r for r in received if r.as_numpy("text_output") is not None]
    text = "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r in chunks)
    ids = [int(i) for r in chunks for i in r.as_numpy("output_ids").reshape(-1)]
    assert ids == reference.outputs[prompt] and text == reference.text(prompt)


def _grpc_input(name: str, value: np.ndarray, dtype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def test_16_in_flight_equal_single_request_outputs(server: Server, reference: Reference) -> None:
    work = [PROMPTS[i % len(PROMPTS)] for i in range(16)]

    def one(i_prompt: tuple[int, str]) -> list[int]:
        i, prompt = i_prompt
        if i % 2:
            return server.client.stream_collect(prompt, **GREEDY).output_ids
        return as_list(server.client.generate(prompt, **GREEDY)["output_ids"])

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, enumerate(work)))
    for prompt, ids in zip(work, results, strict=True):
        assert ids == reference.outputs[prompt]
    assert server.wait_idle() == 0


def test_priority_and_tenant_do_not_change_greedy_output(
    server: Server, reference: Reference
) -> None:
    prompt = PROMPTS[0]
    out = server.client.generate(prompt, priority=9, tenant="acme", **GREEDY)
    assert as_list(out["output_ids"]) == reference.outputs[prompt]


def test_sampling_parameters_are_applied(server: Server) -> None:
    prompt = "Once upon a time"
    a = server.client.generate(prompt, max_tokens=16, temperature=1.0, top_k=50, seed=7,
                               exclude_input_in_output=True, return_log_probs=True)
    b = server.client.generate(prompt, max_tokens=16, temperature=1.0, top_k=50, seed=7,
                               exclude_input_in_output=True, return_log_probs=True)
    assert as_list(a["output_ids"]) == as_list(b["output_ids"])  # same seed, same draw
    assert len(a["output_log_probs"]) == 16
    assert abs(a["cum_log_probs"] - sum(a["output_log_probs"])) < 1e-3
    greedy = server.client.generate(prompt, max_tokens=16, exclude_input_in_output=True)
    greedy_ids = as_list(greedy["output_ids"])
    stop = greedy_ids[5]
    stopped = server.client.generate(prompt, max_tokens=16, exclude_input_in_output=True,
                                     end_id=stop)
    assert as_list(stopped["output_ids"]) == greedy_ids[: greedy_ids.index(stop) + 1]
    assert stopped["finish_reason"] == "stop"
    words = server.client.generate(prompt, max_tokens=16, exclude_input_in_output=True,
                                   stop_words=[greedy["text_output"].split()[2]])
    assert words["finish_reason"] == "stop" and words["num_output_tokens"] < 16
    penalised = server.client.generate(prompt, max_tokens=16, exclude_input_in_output=True,
                                       repetition_penalty=1.5, min_tokens=16)
    assert penalised["num_output_tokens"] == 16
    assert as_list(penalised["output_ids"]) != greedy_ids


REPEAT_PROMPT = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the "
                 "lazy dog. The quick brown")  # the model repeats itself after it


@pytest.mark.parametrize(("route", "model"), [("aggregated", "worker"),
                                              ("disaggregated", "decode")])
def test_speculative_drafts_keep_the_hf_output(server: Server, route: str, model: str) -> None:
    """The engine models draft by prompt lookup (num_speculative_tokens in their config): a
    prompt the model repeats has drafts kept, and the output is still Hugging Face's."""
    want = hf_greedy([REPEAT_PROMPT], 48).outputs[REPEAT_PROMPT]
    before = server.metrics()
    result = server.client.stream_collect(REPEAT_PROMPT, max_tokens=48, route=route,
                                          exclude_input_in_output=True)
    after = server.metrics()
    assert result.output_ids == want
    assert len(set(result.token_times)) < len(want)  # kept drafts arrive with their step's token
    drafted, kept = (metric_sum(after, name, model=model) - metric_sum(before, name, model=model)
                     for name in ("llm_spec_draft_tokens_total", "llm_spec_accepted_tokens_total"))
    assert 0 < kept <= drafted
