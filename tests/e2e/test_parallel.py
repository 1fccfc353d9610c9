"""Engines split over ranks, served through the running Triton server: the `worker` model is
reloaded (model-repository API) onto a tensor- or pipeline-parallel engine directory; rank 0
runs in the stub and starts the other ranks; greedy output equals Hugging Face's."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from python_backends import procfs
from python_backends.bench.client import as_list
from python_backends.config import RANK_MODULE, EngineConfig, ParallelLayout
from python_backends.engine.builder import reshard_engine, write_engine
from tests.e2e.conftest import (
    ENGINE_DIR,
    KILLED_BY_TESTS,
    KILLS_STUBS,
    MAX_TOKENS,
    PROMPTS,
    Reference,
    Server,
    wait_restarted,
)

pytestmark = pytest.mark.e2e
GREEDY = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, "route": "aggregated"}


def rank_pids() -> set[int]:
    return {p.pid for p in procfs.processes() if p.running and RANK_MODULE in (p.cmdline() or [])}


@contextmanager
def serving(server: Server, engines: dict[str, Path]) -> Iterator[None]:
    """Models (worker, prefill, decode) reloaded onto engine directories, restored after."""
    repo = server.options.repository()
    with ExitStack() as stack:
        for model, engine_dir in engines.items():
            stack.enter_context(repo.reloaded(model, engine_dir=str(engine_dir)))
        yield


def worker_serving(server: Server, engine_dir: Path) -> Any:
    return serving(server, {"worker": engine_dir})


def expect_ranks(n: int, timeout_s: float = 30.0) -> set[int]:
    """Rank processes settle to `n` (old ones go as the old model version unloads)."""
    import time

    deadline = time.monotonic() + timeout_s
    while len(pids := rank_pids()) != n and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(pids) == n, pids
    return pids


@pytest.mark.parametrize("layout", [ParallelLayout(tp=3), ParallelLayout(pp=2)],
                         ids=["tp3", "pp2"])
def test_smollm2_split_matches_hf(server: Server, reference: Reference, layout: ParallelLayout,
                                  tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    reshard_engine(ENGINE_DIR, engine, layout, log=lambda _m: None)
    assert expect_ranks(0) == set()
    with worker_serving(server, engine):
        expect_ranks(layout.world_size - 1)
        for prompt in PROMPTS:
            out = server.client.generate(prompt, **GREEDY)
            assert as_list(out["output_ids"]) == reference.outputs[prompt], prompt
        streamed = server.client.stream_collect(PROMPTS[2], **GREEDY)
        assert streamed.output_ids == reference.outputs[PROMPTS[2]]
    expect_ranks(0)  # the split engine's ranks stopped with it: no orphans
    out = server.client.generate(PROMPTS[0], **GREEDY)
    assert as_list(out["output_ids"]) == reference.outputs[PROMPTS[0]]


def random_model(kind: str, out: Path, layout: ParallelLayout) -> Any:
    """SmolLM2 has 3 KV heads and dense MLPs, so TP=2 and EP=2 are served on random-weight
    models with SmolLM2's vocabulary and tokenizer (the ensemble's preprocessing tokenizes for
    every model): a Llama and a Mixtral."""
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    torch.manual_seed(31)
    shape: dict[str, Any] = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.3, tie_word_embeddings=True)
    if kind == "mixtral":
        hf = MixtralForCausalLM(MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2,
                                              sliding_window=None)).eval()
    else:
        hf = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    limits = EngineConfig.load(ENGINE_DIR).limits
    write_engine(hf, AutoTokenizer.from_pretrained(str(ENGINE_DIR)), out, limits, "float32",
                 "random", log=lambda _m: None, parallel=layout)
    return hf


@KILLS_STUBS  # a rank (the llama case)
@pytest.mark.parametrize("kind,layout", [("llama", ParallelLayout(tp=2)),
                                         ("mixtral", ParallelLayout(ep=2))], ids=["tp2", "ep2"])
def test_random_model_split_matches_hf(server: Server, reference: Reference, tmp_path: Path,
                                       kind: str, layout: ParallelLayout) -> None:
    hf = random_model(kind, tmp_path / "engine", layout)
    n = 16
    with worker_serving(server, tmp_path / "engine"):
        expect_ranks(1)
        for prompt in PROMPTS[:4]:
            ids = reference.tokenizer(prompt)["input_ids"]
            want = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
            out = server.client.generate(prompt, max_tokens=n, end_id=-1, route="aggregated")
            assert as_list(out["output_ids"]) == want, prompt
        if kind == "llama":
            dead_rank_fails_clearly(server)
    expect_ranks(0)


def dead_rank_fails_clearly(server: Server) -> None:
    """A rank killed under the served engine: the instance's health gauge drops to 0, the
    failure is logged naming the rank, a request meant for it is served by another engine
    group (front.migration), and the broken instance exits so that the watchdog restarts it."""
    import signal
    import time

    from python_backends.metrics_text import metric_sum

    def healthy() -> float:
        return metric_sum(server.metrics(), "llm_engine_healthy", instance="worker_0_0")

    assert healthy() == 1
    (pid,) = rank_pids()
    rank = procfs.process(pid)
    assert rank is not None
    stub_pid = rank.ppid  # the worker stub running rank 0 (an old version's may linger)
    KILLED_BY_TESTS.add("worker_0_0")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while healthy() != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert healthy() == 0
    out = server.client.generate(PROMPTS[0], max_tokens=4, route="aggregated")
    assert len(as_list(out["output_ids"])) == 4
    wait_restarted(server, "worker", stub_pid)
    log = server.log_file.read_text()
    assert re.search(r"engine rank 1 \(pid \d+\) exited with status -9", log)
    assert "a rank of the engine died; exiting" in log
    assert requests_ok(server)


def requests_ok(server: Server) -> bool:
    import requests

    return requests.get(f"{server.options.http_url}/v2/health/live", timeout=5).status_code == 200


@pytest.mark.parametrize("prefill_tp,decode_tp,transport", [(2, 1, "nixl"), (1, 2, "host_shm")],
                         ids=["prefill-tp2-decode-tp1", "prefill-tp1-decode-tp2"])
def test_disaggregated_across_layouts_matches_hf(
    server: Server, reference: Reference, tmp_path: Path, prefill_tp: int, decode_tp: int,
    transport: str,
) -> None:
    """Prefill and decode groups on different TP layouts of one model: the KV handle carries
    the whole-model layout, the multi-rank side gathers or scatters heads across its ranks."""
    from python_backends.metrics_text import metric_sum

    hf = random_model("llama", tmp_path / "tp2", ParallelLayout(tp=2))
    random_model("llama", tmp_path / "tp1", ParallelLayout())
    n = 12
    engines = {"prefill": tmp_path / f"tp{prefill_tp}", "decode": tmp_path / f"tp{decode_tp}"}
    with serving(server, engines):
        expect_ranks(1)
        before = server.metrics()
        for prompt in PROMPTS[:4]:
            ids = reference.tokenizer(prompt)["input_ids"]
            want = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
            out = server.client.generate(prompt, max_tokens=n, end_id=-1,
                                         route="disaggregated", kv_transport=transport)
            assert as_list(out["output_ids"]) == want, prompt
        after = server.metrics()
        computed = "llm_prompt_tokens_computed_total"
        assert metric_sum(after, computed, model="decode") == metric_sum(before, computed,
                                                                         model="decode")
        fallbacks = "llm_kv_transfer_fallbacks_total"
        assert metric_sum(after, fallbacks) == metric_sum(before, fallbacks)
    expect_ranks(0)
