"""The models on a GPU through the running server: `worker`, `prefill` and `decode` reloaded as
KIND_GPU instances on GPU 0 (model-repository API), greedy output equal to Hugging Face's, and
the KV cache crossing from the prefill stub's GPU pool to the decode stub's over CUDA IPC.

Needs CUDA (the `gpu` marker skips it elsewhere); `scripts/gpu_check.sh` runs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest

from python_backends.bench.client import as_list
from python_backends.metrics_text import metric_sum
from tests.e2e.conftest import MAX_TOKENS, PROMPTS, Reference, Server

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]
GREEDY = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True}


def on_gpu0(config: dict[str, Any]) -> None:
    config["instance_group"] = [{"count": 1, "kind": "KIND_GPU", "gpus": [0]}]


@contextmanager
def on_gpu(server: Server, *models: str) -> Iterator[None]:
    """`models` reloaded as one KIND_GPU instance each on GPU 0; their configs restored after."""
    repo = server.options.repository()
    with ExitStack() as stack:
        for model in models:
            stack.enter_context(repo.variant(model, on_gpu0, "on GPU 0"))
        yield


def test_worker_on_gpu_matches_hf(server: Server, reference: Reference) -> None:
    with on_gpu(server, "worker"):
        ranks = server.metrics()["llm_engine_ranks"]
        devices = {dict(k)["device"]: v for k, v in ranks.items()
                   if dict(k)["model"] == "worker" and v}
        assert devices == {"cuda:0": 1}
        for prompt in PROMPTS:
            out = server.client.generate(prompt, route="aggregated", **GREEDY)
            assert as_list(out["output_ids"]) == reference.outputs[prompt], prompt
        streamed = server.client.stream_collect(PROMPTS[1], route="aggregated", **GREEDY)
        assert streamed.output_ids == reference.outputs[PROMPTS[1]]


@pytest.mark.parametrize("transport", ["cuda_ipc", "nixl"])
def test_disaggregated_on_gpu_matches_hf(server: Server, reference: Reference,
                                         transport: str) -> None:
    with on_gpu(server, "prefill", "decode"):
        before = server.metrics()
        for prompt in PROMPTS:
            out = server.client.generate(prompt, route="disaggregated", kv_transport=transport,
                                         **GREEDY)
            assert as_list(out["output_ids"]) == reference.outputs[prompt], prompt
        after = server.metrics()

        def delta(name: str, **labels: str) -> float:
            return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

        assert delta("llm_kv_transfer_duration_seconds_count", transport=transport) == len(PROMPTS)
        assert delta("llm_prompt_tokens_computed_total", model="decode") == 0
        assert delta("llm_kv_transfer_failures_total") == 0
        assert server.wait_idle() == 0
