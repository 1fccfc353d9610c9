"""Engine directories from Hugging Face checkpoints: layout, validation, refusal to overwrite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from python_backends.config import EngineConfig, EngineConfigError, EngineLimits
from python_backends.engine.builder import build_engine
from tests.conftest import TinyModel


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
    with pytest.raises(EngineConfigError, match="--force"):
        build_engine(ckpt, out, limits, log=logs.append)
    build_engine(ckpt, out, limits, force=True, log=logs.append)


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
