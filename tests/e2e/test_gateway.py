"""The gateway in front of the session's Triton server, driven by the official `openai` client
and by Triton's own generate-endpoint clients: OpenAI's API with greedy output equal to Hugging
Face's, every error status with OpenAI's body, stop strings, usage, a client that goes away
cancelling its request on the server, and the KServe generate endpoints proxied."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from python_backends.bench.client import as_list
from python_backends.metrics_text import metric_sum
from python_backends.ops.launcher import free_port
from tests.e2e.conftest import (
    ENGINE_DIR,
    GATEWAY_KEY,
    MAX_TOKENS,
    PROMPTS,
    Gateway,
    Reference,
    Server,
    start_gateway,
    stop_gateway,
)

pytestmark = pytest.mark.e2e
KEY, LIMITED_KEY = GATEWAY_KEY, "sk-limited"
MODEL = "smollm2"


@pytest.fixture(scope="module")
def gateway(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    o = server.options
    gw = start_gateway(tmp_path_factory.mktemp("gateway"), {
        "model": MODEL, "engine_dir": str(ENGINE_DIR),
        "backends": [{"name": "local", "grpc": f"127.0.0.1:{o.grpc_port}",
                      "metrics": o.metrics_url},
                     {"name": "down", "grpc": f"127.0.0.1:{free_port()}",
                      "metrics": f"http://127.0.0.1:{free_port()}/metrics"}],
        "api_keys": {KEY: "gateway-tests", LIMITED_KEY: "limited"},
        "rate_limits": {"limited": {"requests_per_s": 0.01, "burst_requests": 1}},
    })
    yield gw
    stop_gateway(gw)


def test_completions_equal_hugging_face(gateway: Gateway, reference: Reference) -> None:
    client = gateway.openai()
    for prompt in PROMPTS[:3]:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0)
        assert out.choices[0].text == reference.text(prompt)
        assert out.usage is not None and out.usage.completion_tokens == MAX_TOKENS
        assert out.choices[0].finish_reason == "length"


def test_streamed_completion_equals_the_whole_one(gateway: Gateway,
                                                  reference: Reference) -> None:
    prompt = PROMPTS[1]
    events = list(gateway.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(e.choices[0].text for e in events if e.choices)
    assert text == reference.text(prompt)
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == MAX_TOKENS
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"


def test_chat_equals_the_ensemble_on_the_templated_prompt(gateway: Gateway,
                                                          server: Server) -> None:
    from transformers import AutoTokenizer

    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    templated = str(AutoTokenizer.from_pretrained(str(ENGINE_DIR)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True))
    want = server.client.generate(templated, max_tokens=16, exclude_input_in_output=True)
    client = gateway.openai()
    whole = client.chat.completions.create(model=MODEL, messages=messages,
                                           max_completion_tokens=16, temperature=0)
    assert whole.choices[0].message.content == want["text_output"]
    streamed = client.chat.completions.create(model=MODEL, messages=messages,
                                              max_tokens=16, temperature=0, stream=True)
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want["text_output"]


def test_stop_strings_cut_the_text(gateway: Gateway, reference: Reference) -> None:
    prompt = PROMPTS[0]
    full = reference.text(prompt)
    stop = full[5:8]
    client = gateway.openai()
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                      temperature=0, stop=[stop])
    events = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                            temperature=0, stop=[stop], stream=True))
    for answer in ([whole], events):
        assert "".join(e.choices[0].text for e in answer) == full[:full.index(stop)]
        assert answer[-1].choices[0].finish_reason == "stop"


def test_vllms_extra_fields_as_vllm_means_them(gateway: Gateway, reference: Reference) -> None:
    """What vLLM's benchmark client and clients written for vLLM send is served with vLLM's
    meanings: ignore_eos runs to max_tokens past the end token, include_stop_str_in_output
    keeps the stop string, and the neutral values change nothing."""
    client = gateway.openai()
    question: Any = [{"role": "user", "content": "What is the capital of France?"}]
    ends = client.chat.completions.create(model=MODEL, messages=question, max_tokens=48,
                                          temperature=0)
    assert ends.choices[0].finish_reason == "stop"  # the end token, well before 48
    assert ends.usage is not None and ends.usage.completion_tokens < 48
    runs_on = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=48, temperature=0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.0, "top_k": -1, "min_p": 0,
                    "skip_special_tokens": True, "spaces_between_special_tokens": True})
    assert runs_on.choices[0].finish_reason == "length"
    assert runs_on.usage is not None and runs_on.usage.completion_tokens == 48
    prompt = PROMPTS[0]
    full = reference.text(prompt)
    stop = full[5:8]
    for stream in (False, True):
        answer = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
            stream=stream, extra_body={"include_stop_str_in_output": True})
        events: list[Any] = list(answer) if stream else [answer]
        assert "".join(e.choices[0].text for e in events) == full[:full.index(stop) + 3]


def test_logprobs_as_far_as_the_engine_gives_them(gateway: Gateway) -> None:
    out = gateway.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(t.logprob <= 0 for t in content)


@pytest.mark.parametrize(("key", "body", "status"), [
    ("wrong", {"prompt": "x"}, 401),
    (KEY, {"prompt": "x", "model": "gpt-9"}, 404),
    (KEY, {"prompt": "x", "suffix": "y"}, 400),
    (KEY, {"prompt": "x", "priority": 3}, 400),
    (KEY, {"prompt": "x", "logit_bias": {"1": 101}}, 400),
    (KEY, {"prompt": "x", "top_p": 1.5}, 400),  # the server's own check, passed through
])
def test_error_statuses_with_openai_bodies(gateway: Gateway, key: str, body: dict[str, Any],
                                           status: int) -> None:
    r = requests.post(f"{gateway.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "max_tokens": 4, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["code"] == status and "type" in error


def test_a_rate_limited_tenant_gets_429(gateway: Gateway) -> None:
    client = gateway.openai(LIMITED_KEY)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    # the server serves others afterwards
    assert gateway.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2)


def test_no_healthy_server_is_503(tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, {"engine_dir": str(ENGINE_DIR), "backends": [
        {"name": "down", "grpc": f"127.0.0.1:{free_port()}",
         "metrics": f"http://127.0.0.1:{free_port()}/metrics"}]}, healthy=False)
    try:
        with pytest.raises(openai.InternalServerError) as e:
            gw.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503
    finally:
        stop_gateway(gw)


def _cancelled_by_gateway(gateway: Gateway) -> float:
    return metric_sum(gateway.metrics(), "gateway_requests_total", status="499")


def test_a_client_that_goes_away_cancels_its_request(gateway: Gateway, server: Server) -> None:
    """Non-streaming requests (OpenAI's and the proxied KServe /generate: Triton's own
    /generate cannot do this) and a stream: each ends on the server, counted as 499."""
    before = _cancelled_by_gateway(gateway)
    body: dict[str, Any] = {"model": MODEL, "prompt": "Count from 1 to 1000: 1, 2, 3,",
                            "max_tokens": 400, "temperature": 0}
    _goes_away(gateway, server, f"{gateway.url}/v1/completions", body,
               {"Authorization": f"Bearer {KEY}"})
    _goes_away(gateway, server, f"{gateway.url}/v2/models/ensemble/generate",
               {"text_input": body["prompt"], "max_tokens": 400}, {"x-api-key": KEY})
    with requests.post(f"{gateway.url}/v1/completions", json={**body, "stream": True},
                       headers={"Authorization": f"Bearer {KEY}"}, stream=True,
                       timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith(b"data:"))
    assert server.wait_idle(timeout=5) == 0  # the dropped stream freed its KV too
    deadline = time.monotonic() + 5
    while _cancelled_by_gateway(gateway) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _cancelled_by_gateway(gateway) == before + 3  # and it was counted as such


def _goes_away(gateway: Gateway, server: Server, url: str, body: dict[str, Any],
               headers: dict[str, str]) -> None:
    """A non-streaming request whose client times out: 499 at the gateway, nothing left
    running on the server."""
    before = _cancelled_by_gateway(gateway)
    with pytest.raises(requests.Timeout):
        requests.post(url, json=body, timeout=1.5, headers=headers)
    deadline = time.monotonic() + 5
    while _cancelled_by_gateway(gateway) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _cancelled_by_gateway(gateway) == before + 1
    assert server.wait_idle(timeout=5) == 0
    assert metric_sum(server.metrics(), "llm_num_requests_running") == 0


def test_kserve_generate_endpoints_are_proxied(gateway: Gateway, server: Server) -> None:
    headers = {"x-api-key": KEY}
    body: dict[str, Any] = {"text_input": PROMPTS[0], "max_tokens": 8}
    want = server.client.generate(PROMPTS[0], max_tokens=8)
    got = requests.post(f"{gateway.url}/v2/models/ensemble/generate", json=body,
                        headers=headers, timeout=60).json()
    assert got["text_output"] == want["text_output"]
    assert as_list(got["output_ids"]) == as_list(want["output_ids"])
    with requests.post(f"{gateway.url}/v2/models/ensemble/generate_stream", headers=headers,
                       json={**body, "stream": True}, stream=True, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith(b"data:")]
    assert "".join(e["text_output"] for e in events) == want["text_output"].removeprefix(
        PROMPTS[0])
    bad = requests.post(f"{gateway.url}/v2/models/ensemble/generate", headers=headers,
                        json={**body, "top_p": 7.0}, timeout=60)
    assert bad.status_code == 400 and "top_p" in bad.json()["error"]
    limited = {"x-api-key": LIMITED_KEY}
    statuses = [requests.post(f"{gateway.url}/v2/models/ensemble/generate", json=body,
                              headers=limited, timeout=60).status_code for _ in range(2)]
    assert 429 in statuses  # Triton's own endpoint can only say 400


def test_aiperf_profiles_the_gateway_as_an_openai_chat_server(gateway: Gateway,
                                                              tmp_path: Path) -> None:
    """aiperf's own `chat` endpoint type, no adapter: every request succeeds."""
    from python_backends.bench.aiperf import Target, find_aiperf, profile

    aiperf = find_aiperf()
    if aiperf is None:
        if os.environ.get("CI"):
            pytest.fail("aiperf missing in CI: scripts/test.sh installs it in .venv-aiperf")
        pytest.skip("aiperf not installed: scripts/test.sh installs it in .venv-aiperf")
    target = Target.openai(gateway.url, MODEL, endpoint="chat", name="gateway",
                           ignore_eos=False)
    target = dataclasses.replace(target, endpoint_args=(
        *target.endpoint_args, "--api-key", KEY))
    result = profile(aiperf, target, concurrency=2, requests=8, prompt_tokens=64,
                     output_tokens=16, tokenizer=ENGINE_DIR, artifacts=tmp_path / "artifacts",
                     timeout_s=600)
    assert result["request_count"]["avg"] == 8
    assert result["time_to_first_token"]["avg"] > 0
    assert result["output_sequence_length"]["avg"] > 0


def test_dashboard_gateway_panels_use_what_the_gateway_exports(gateway: Gateway) -> None:
    from tests.deploy.test_dashboard import GATEWAY_PREFIX, dashboard_uses

    used, missing = dashboard_uses(gateway.metrics(), prefixes=(GATEWAY_PREFIX,))
    assert used and not missing, missing
