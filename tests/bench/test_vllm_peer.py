"""vLLM for CPU as the benchmark peer: its checkpoint's place, its environment, its command.
(Installing and serving it for real is what `scripts/bench_sweep.py --peer vllm` does.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from python_backends.bench import vllm_peer as peer
from tests.conftest import TinyModel


def test_the_checkpoint_is_named_after_the_source_and_reused(tiny_llama: TinyModel,
                                                            tmp_path: Path) -> None:
    engine = tmp_path / "engines" / "tiny"
    engine.mkdir(parents=True)
    (engine / "config.json").write_text((tiny_llama.engine_dir / "config.json").read_text())
    done = tmp_path / "engines" / "peer-random"  # the tiny engine's source is "random"
    done.mkdir()
    (done / "config.json").write_text("{}")
    assert peer.export_checkpoint(engine) == done  # already exported: nothing is loaded


def test_server_env_preloads_what_vllms_guide_asks_for_when_present(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.write_bytes(b"")
    monkeypatch.setattr(peer, "TCMALLOC", tcmalloc)
    monkeypatch.setattr(peer, "VENV", tmp_path / "no-venv")
    env = peer.server_env()
    assert env["LD_PRELOAD"] == str(tcmalloc)
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"]
    monkeypatch.setattr(peer, "TCMALLOC", tmp_path / "missing.so")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert "LD_PRELOAD" not in peer.server_env()


def test_the_server_runs_as_a_module_in_float32_on_loopback(tmp_path: Path) -> None:
    server = peer.VllmServer(Path("/venv/bin/python"), tmp_path / "ckpt", "m", 8123,
                             tmp_path / "vllm.log")
    cmd = server.cmd
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and server.url == "http://127.0.0.1:8123"


def test_stale_omp_files_of_gone_processes_are_removed(tmp_path: Path) -> None:
    alive = tmp_path / f"__KMP_REGISTERED_LIB_{os.getpid()}_0"
    gone = tmp_path / "__KMP_REGISTERED_LIB_999999999_0"
    other = tmp_path / "triton_llm_kv_999999999_x"
    for f in (alive, gone, other):
        f.write_text("")
    peer.remove_stale_omp_files(tmp_path)
    assert alive.exists() and not gone.exists() and other.exists()


def test_the_peer_can_draft_by_prompt_lookup_as_our_engines_do(tmp_path: Path) -> None:
    plain = peer.VllmServer(Path("/p"), tmp_path, "m", 8123, tmp_path / "log")
    assert "--speculative-config" not in plain.cmd
    cmd = peer.VllmServer(Path("/p"), tmp_path, "m", 8123, tmp_path / "log", 4).cmd
    config = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert config == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                      "prompt_lookup_min": 2}
