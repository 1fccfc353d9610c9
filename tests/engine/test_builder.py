"""Engine directories from Hugging Face checkpoints: layout, validation, refusal to overwrite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from python_backends.config import EngineConfig, EngineConfigError, EngineLimits
from python_backends.engine.builder import build_engine
from python_backends.engine.llm_engine import LLMEngine
from python_backends.models.attention import AttentionMetadata
from python_backends.parallel.layers import Linear, int8_supported, packable
from python_backends.params import SamplingParams
from tests.conftest import TinyModel, load_script

build_script = load_script("build_engine")


def test_build_from_checkpoint_directory(tiny_llama: TinyModel, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    tiny_llama.hf.save_pretrained(ckpt)
    out = tmp_path / "engine"
    limits = EngineLimits(max_seq_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                          block_size=8)
    logs: list[str] = []
    build_engine(ckpt, out, limits, log=logs.append)
    assert any("engine ready" in m for m in logs)
    cfg = EngineConfig.load(out)
    assert cfg.limits == limits and cfg.model.num_kv_heads == 2 and cfg.weight_files() == [
        "rank0.safetensors"
    ]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.safetensors"]
    assert cfg.model_name == "engine"  # the directory's name, unless given one
    with pytest.raises(EngineConfigError, match="--force"):
        build_engine(ckpt, out, limits, log=logs.append)
    build_engine(ckpt, out, limits, force=True, log=logs.append, model_name="tiny-llama")
    assert EngineConfig.load(out).model_name == "tiny-llama"


def test_bad_sources_and_layouts(tmp_path: Path) -> None:
    with pytest.raises(EngineConfigError, match="neither"):
        build_engine(tmp_path, tmp_path / "out", EngineLimits())
    with pytest.raises(EngineConfigError, match="not found"):
        build_engine(tmp_path / "x.gguf", tmp_path / "out", EngineLimits())
    with pytest.raises(EngineConfigError, match="positive"):
        EngineLimits(block_size=0)


def test_load_refuses_missing_or_stale_engines(tiny_llama: TinyModel, tmp_path: Path) -> None:
    with pytest.raises(EngineConfigError, match="build_engine"):
        EngineConfig.load(tmp_path)
    d = json.loads((tiny_llama.engine_dir / "config.json").read_text())
    d["format_version"] = 0
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(EngineConfigError, match="rebuild"):
        EngineConfig.load(tmp_path)


@pytest.mark.skipif(not packable(torch.bfloat16), reason="this CPU has no bf16 instructions")
def test_a_bfloat16_engine_packs_its_projections_and_serves(tiny_llama: TinyModel,
                                                           tmp_path: Path) -> None:
    """bfloat16 computes on oneDNN's packed weights, attention in float32 (models.attention),
    and its greedy output stays close to float32's: the tiny model's first tokens agree."""
    ckpt = tmp_path / "ckpt"
    tiny_llama.hf.save_pretrained(ckpt)
    out = tmp_path / "engine-bf16"
    build_engine(ckpt, out, EngineLimits(max_seq_len=128, max_num_seqs=4,
                                         max_num_batched_tokens=64, block_size=8), "bfloat16")
    engine = LLMEngine.from_engine_dir(out, num_kv_blocks=32)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.packed.dtype == torch.bfloat16
                           for m in linears)
    prompt = [5, 9, 2, 7, 11, 3]
    seq = engine.add_request("a", prompt, SamplingParams(max_tokens=4, end_ids=()))
    while engine.has_unfinished:
        engine.step()
    assert seq.output_ids[:2] == tiny_llama.greedy(prompt, 2)


def test_build_refuses_a_cpu_dtype_the_cpu_cannot_compute(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(build_script, "packable", lambda dtype: dtype == torch.float32)
    assert build_script.main(["--dtype", "bfloat16", "--output", str(tmp_path / "e")]) == 2
    assert "no bfloat16 instructions" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def _logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """The engine's logits at every position of one uncached prompt."""
    with torch.inference_mode():
        return engine.runner.model(torch.tensor(ids), AttentionMetadata.one_prompt(len(ids)))


@pytest.mark.skipif(int8_supported() is not None, reason=str(int8_supported()))
def test_int8_weights_quantize_every_projection_and_stay_close(tiny_llama: TinyModel,
                                                              tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    tiny_llama.hf.save_pretrained(ckpt)
    out = tmp_path / "engine-int8"
    build_engine(ckpt, out, EngineLimits(max_seq_len=128, max_num_seqs=4,
                                         max_num_batched_tokens=64, block_size=8),
                 weights="int8")
    assert EngineConfig.load(out).weights == "int8"
    engine = LLMEngine.from_engine_dir(out, num_kv_blocks=32)
    linears = {name.rsplit(".", 1)[-1]: m for name, m in engine.runner.model.named_modules()
               if isinstance(m, Linear)}
    for name, m in linears.items():
        if name in ("down_proj", "lm_head"):  # kept float (LlamaForCausalLM.FLOAT_IN_INT8)
            assert m.quantized is None and m.packed is not None, name
        else:
            assert m.quantized is not None and m.packed is None, name
    assert {"qkv_proj", "o_proj", "gate_up_proj"} <= linears.keys(), linears.keys()
    ids = [5, 9, 2, 7, 11, 3, 8, 1]
    got, want = _logits(engine, ids), _logits(tiny_llama.engine(num_kv_blocks=32), ids)
    assert float((got - want).norm() / want.norm()) < 0.1  # a bug: ~1; rounding: a few %
    seq = engine.add_request("a", ids, SamplingParams(max_tokens=4, end_ids=()))
    while engine.has_unfinished:
        engine.step()
    assert len(seq.output_ids) == 4


def test_int8_weights_need_a_float32_engine() -> None:
    with pytest.raises(EngineConfigError, match="int8 weights need a float32 engine"):
        EngineConfig(architecture="llama", dtype="bfloat16", model=None,  # type: ignore[arg-type]
                     limits=EngineLimits(), tokenizer=None, weights="int8")  # type: ignore[arg-type]


def test_build_refuses_int8_weights_where_they_would_be_slow(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(build_script, "int8_supported", lambda: "this CPU has no VNNI")
    assert build_script.main(["--weights", "int8", "--output", str(tmp_path / "e")]) == 2
    assert "this CPU has no VNNI" in capsys.readouterr().err
    assert build_script.main(["--weights", "int8", "--target", "gpu",
                              "--output", str(tmp_path / "e")]) == 2
    assert "CPU only" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
