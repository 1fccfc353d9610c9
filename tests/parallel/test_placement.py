"""Where an instance's ranks compute, and a step that touches only its model's device.

The step test runs the engine's model on PyTorch's `meta` device (shapes, no data): every
tensor a step creates must be on the model's device, or the first operation mixing the two
fails, as it would on a GPU. It covers the CPU-side packing, the move of the step's metadata,
attention over a cached context (a second prefill chunk) and a decode batch.
"""

from __future__ import annotations

import pytest
import torch

from python_backends.config import EngineConfig, EngineLimits
from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.sampler import SampleResult
from python_backends.models.decoder import CausalLM
from python_backends.parallel.context import ParallelContext
from python_backends.parallel.placement import CPU, Placement, PlacementError, dist_backend
from python_backends.params import SamplingParams
from tests.conftest import TinyModel

META = torch.device("meta")


def test_cpu_instance_puts_every_rank_on_the_cpu() -> None:
    assert Placement().devices(3) == [CPU, CPU, CPU]
    assert Placement("MODEL", 0).devices(1) == [CPU]


def test_gpu_instance_owns_consecutive_gpus() -> None:
    devices = Placement("GPU", 2).devices(2, gpu_count=4)
    assert devices == [torch.device("cuda", 2), torch.device("cuda", 3)]


def test_gpu_instance_refuses_what_is_not_there() -> None:
    with pytest.raises(PlacementError, match=r"needs GPUs 3\.\.4, but 4 are visible"):
        Placement("GPU", 3).devices(2, gpu_count=4)
    with pytest.raises(PlacementError, match="no CUDA device is visible"):
        Placement("GPU", 0).devices(1, gpu_count=0)


def test_placement_from_triton_args() -> None:
    args = {"model_instance_kind": "GPU", "model_instance_device_id": "5"}
    assert Placement.from_triton_args(args) == Placement("GPU", 5)
    assert Placement.from_triton_args({}) == Placement("CPU", 0)
    assert not Placement.from_triton_args({"model_instance_kind": "CPU"}).on_gpu


def test_backend_by_device() -> None:
    assert dist_backend(CPU) == "gloo"
    assert dist_backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"


def test_step_creates_tensors_only_on_the_model_device(tiny_llama: TinyModel) -> None:
    config = EngineConfig.load(tiny_llama.engine_dir)
    with torch.device(META):
        model = CausalLM(config.model, ParallelContext(config.parallel, device=META))
    engine = LLMEngine(config, model, num_kv_blocks=32)
    assert engine.runner.kv_pool.device == META and engine.device == META
    engine.scheduler.limits = EngineLimits(max_seq_len=256, max_num_seqs=4,
                                           max_num_batched_tokens=24, block_size=4)
    engine.add_request("short", list(range(1, 10)), SamplingParams(max_tokens=4))
    engine.add_request("long", list(range(1, 31)), SamplingParams(max_tokens=4))
    kinds = set()
    for _ in range(4):
        out = engine.scheduler.schedule()
        for item in out.scheduled:
            seq = item.seq
            kinds.add("decode" if item.num_new_tokens == 1 else
                      "chunk" if seq.num_computed_tokens else "prefill")
        head, sampling = engine.runner.run(out)
        logits = head.logits
        assert logits is not None and logits.device == META
        assert tuple(logits.shape) == (len(sampling), config.model.vocab_size)
        engine.scheduler.update(out, SampleResult([7] * len(sampling), None))
    assert kinds == {"prefill", "chunk", "decode"}
