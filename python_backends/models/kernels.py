"""Native CPU kernels of the engine (`csrc/`), compiled for the machine they run on.

Each kernel is a torch operator (`torch.ops.llm_kernels.*`) with a pure-torch equivalent that
the model uses where the kernel is unavailable: no C++ compiler, a build that failed, or
`LLM_NATIVE_KERNELS=0` in the environment. The library is compiled for one instruction-set path
(models.cpu_isa: the CPU's best, or the one `LLM_CPU_ISA` caps it to) and built once per machine,
path, source and torch version into `build/kernels/<key>/` (about 10 s with g++ and ninja, at
set-up or on first use; concurrent builders wait for the first), loaded from there afterwards.

    python -m python_backends.models.kernels     # build now, print the path and where
    python -m python_backends.models.kernels --all-paths   # every path this CPU can run
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from python_backends.config import PROJECT_ROOT
from python_backends.models import cpu_isa, weight_blocks

log = logging.getLogger(__name__)

SWITCH_ENV = "LLM_NATIVE_KERNELS"  # "0", "off", "false" or "no": torch ops only
BLOCKS_ENV = "LLM_WEIGHT_BLOCKS"  # "0": projections read float32 panels only (NativeLinear.blocks)
STACK_ENV = "LLM_NATIVE_STACK"  # "0": a step runs its layers one by one from Python (DecoderStack)
NAME = "llm_kernels"
CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
BUILD_ROOT = PROJECT_ROOT / "build" / "kernels"
# -march=native: the library is specific to the CPU it was built on, hence the CPU in its key;
# then the path's -mno-* flags (cpu_isa) leave out what is above it. avoid-fma-max-bits=0: GCC's
# tuning for AMD Zen splits multiply-adds of 256-bit vectors in loops into a multiply and an add
# (rounded twice), where the same expression unrolled stays one fused operation; so kernels that
# promise the same results bit for bit in two summation layouts (paged_attention.cpp) differed
# on Zen's AVX2 path. Fused everywhere, every CPU rounds as the Intel ones do.
CFLAGS = ("-O3", "-march=native", "--param=avoid-fma-max-bits=0", "-fopenmp")


def cflags() -> tuple[str, ...]:
    chosen = cpu_isa.path()
    return CFLAGS + (chosen.cflags if chosen is not None else ())


def switched_on(variable: str) -> bool:
    """Whether an on/off environment switch is on: anything but "0", "off", "false" or "no"
    (unset: on)."""
    return os.environ.get(variable, "1").strip().lower() not in ("0", "off", "false", "no")


def enabled() -> bool:
    return switched_on(SWITCH_ENV)


def _cpu_signature() -> str:
    """The CPU's model name and instruction set flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith("flags")), "")
    return f"{model}\n{flags}"


def build_dir() -> Path:
    """Where this machine's build of the current sources lives."""
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.name.encode())
        h.update(src.read_bytes())
    for part in (torch.__version__, " ".join(cflags()), _cpu_signature()):
        h.update(part.encode())
    return BUILD_ROOT / h.hexdigest()[:16]


def _build_and_load(directory: Path) -> None:
    """Build the library into `directory` unless there, then load it into this process. One
    process builds at a time (a lock the OS releases if the builder dies); the others wait and
    load its build."""
    library = directory / f"{NAME}.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # built while this process waited
            torch.ops.load_library(str(library))
            return
        from torch.utils import cpp_extension

        try:  # the `ninja` wheel: its binary is not on PATH inside a Triton stub
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        except ImportError:
            pass
        # torch's own lock file outlives a builder that was killed, and would stall every later
        # build; under ours no other build runs.
        (directory / "lock").unlink(missing_ok=True)
        start = time.monotonic()
        log.warning("compiling the engine's CPU kernels for the %s path into %s (once per "
                    "machine and path, about 10 s)", cpu_isa.describe(), directory)
        cpp_extension.load(NAME, [str(s) for s in SOURCES], extra_cflags=list(cflags()),
                           build_directory=str(directory), is_python_module=False,
                           verbose=False)  # loads the library it builds
        log.warning("kernels compiled in %.0f s", time.monotonic() - start)


@functools.cache
def load() -> bool:
    """Load (building first if needed) the kernels into this process; False, with one logged
    reason, when they are off or cannot be built."""
    if not enabled():
        return False
    try:
        if cpu_isa.path() is None:
            raise RuntimeError("this CPU has no AVX2 and FMA, the least the kernels need")
        _build_and_load(build_dir())
    except Exception as e:  # no compiler, no headers, a failed build: the torch ops remain
        log.warning("engine CPU kernels unavailable, using torch ops: %s", str(e).strip()[-500:])
        return False
    log.warning("engine CPU kernels: %s path", cpu_isa.describe())
    return True


def screen_path() -> str:
    """What the greedy LM head's screen computes on ("amx" tiles, "avx512_vnni" int8 products),
    "" where it does not (then greedy rows compute every logit)."""
    return (screen_paths() or ("",))[0]


def screen_paths() -> tuple[str, ...]:
    """Every path the screen can compute on here, screen_path's first (on AMX tiles, int8
    products too where the CPU has AVX-512 VNNI, as every CPU with tiles does)."""
    return tuple(str(p) for p in torch.ops.llm_kernels.screen_paths()) if load() else ()


def fma_peak_flops() -> float | None:
    """Float32 FLOP/s (two a multiply-add) that one thread's FMA units sustain with the
    kernels' vectors, measured now (about 0.1 s); None without the native kernels. What the
    projections' rate is read against (bench.roofline)."""
    if not load():
        return None
    ops = torch.ops.llm_kernels
    ops.fma_peak(1_000_000)  # the core up to its clock first
    return 2.0 * max(ops.fma_peak(5_000_000) for _ in range(3))


@dataclass(frozen=True)
class HelperStats:
    """Since the process started: chunks of native-kernel work, those the idle-CPU helper
    computed, those the calling thread took back from it, and the heavy jobs (prompts'
    projections) the helper worked on at normal priority (csrc/idle_helper.h)."""

    chunks: int = 0
    helped: int = 0
    taken_back: int = 0
    boosted: int = 0


def helper_stats() -> HelperStats:
    """This process's figures; zeros where the kernels were never loaded (this never loads
    them: a GPU engine's stats must not compile CPU kernels)."""
    if load.cache_info().currsize == 0 or not load():
        return HelperStats()
    return HelperStats(*torch.ops.llm_kernels.idle_helper_stats())


def paged_decode_attention() -> Any | None:
    """torch.ops.llm_kernels.paged_decode_attention, or None (see `load`)."""
    return torch.ops.llm_kernels.paged_decode_attention if load() else None


def prompt_attention() -> Any | None:
    """torch.ops.llm_kernels.prompt_attention (csrc/prompt_attention.cpp: prompts' attention on
    AMX tiles), or None where the kernels are not loaded or the CPU has no tiles."""
    if not load() or not torch.ops.llm_kernels.prompt_attention_amx():
        return None
    return torch.ops.llm_kernels.prompt_attention


def layer_ops(x: torch.Tensor) -> Any | None:
    """torch.ops.llm_kernels, whose rms_norm, add_rms_norm, rope_write_kv and silu_mul compute
    the float32 work between a layer's projections (csrc/layer_ops.cpp), where `x` is a float32
    CPU tensor and the kernels load; the same four in Triton on a GPU (models.gpu_layer_ops);
    else None."""
    if x.is_cuda:
        from python_backends.models import gpu_layer_ops

        return gpu_layer_ops.ops(x)
    if x.dtype != torch.float32 or x.device.type != "cpu" or not load():
        return None
    return torch.ops.llm_kernels


@dataclass(frozen=True)
class Narrow:
    """A weight's exact narrower form, packed for the kernel: `kind` is its layout (csrc/
    linear.cpp: "q4", "u8g32", "u8g16", "q8" from GGUF blocks, "bf16", "f16")."""

    packed: torch.Tensor
    kind: str


@dataclass(frozen=True)
class NativeLinear:
    """The float32 projection kernel: `op(x [T, k], packed, n, blocks, kind)` computes x W^T on
    the calling thread and an idle-CPU helper (csrc/idle_helper.h), from a weight W [n, k] that
    `pack` has laid out in panels of `panel` output features (`packed_shape(n, k)`); calls of
    few rows read W's narrower form `blocks` (of layout `kind`) instead where it has one."""

    panel: int
    op: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None, str], torch.Tensor]

    @staticmethod
    def blocks(weight: torch.Tensor) -> Narrow | None:
        """W's exact narrower form, or None: W has none, or `LLM_WEIGHT_BLOCKS=0`. The same
        float32 values, from GGUF blocks (models.weight_blocks: 4-bit from Q4_1, Q4_0 or Q4_K;
        5-bit from Q5_0, Q5_1, Q5_K; Q6_K; Q8_0), else as 16-bit floats (a checkpoint stored in
        bfloat16 or float16, widened to float32 by the engine build)."""
        if not switched_on(BLOCKS_ENV):
            return None
        ops = torch.ops.llm_kernels
        for kind in weight_blocks.KINDS:
            found = weight_blocks.find(weight, kind)
            if found is not None:
                packed = ops.pack_blocks(weight, found.q, found.d, found.m, kind)
                if packed.numel():  # else the kernel's own check refused them: next kind
                    return Narrow(packed, kind)
        halves = ops.pack_halves(weight.detach().cpu())
        if not halves.numel():
            return None
        return Narrow(halves, "bf16" if halves.dtype == torch.bfloat16 else "f16")

    def packed_shape(self, n: int, k: int) -> tuple[int, int, int]:
        return (-(-n // self.panel), k, self.panel)

    def pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The packed weight; in `out` (any float32 tensor of as many elements) if given."""
        packed = torch.ops.llm_kernels.pack_linear_weight(weight)
        return packed if out is None else out.view(packed.shape).copy_(packed)


def native_linear() -> NativeLinear | None:
    """The float32 projection kernel, or None (see `load`)."""
    if not load():
        return None
    panel = torch.ops.llm_kernels.pack_linear_weight(torch.zeros(1, 1)).shape[-1]
    return NativeLinear(panel, torch.ops.llm_kernels.linear)


@contextlib.contextmanager
def helper_off() -> Iterator[None]:
    """Native kernels compute on the calling thread alone inside (one core's rates)."""
    if not load():
        yield
        return
    before = torch.ops.llm_kernels.set_idle_helper(False)
    try:
        yield
    finally:
        torch.ops.llm_kernels.set_idle_helper(before)


def stack_enabled() -> bool:
    return switched_on(STACK_ENV)


class StackProjection(Protocol):
    """What DecoderStack reads of a projection (parallel.layers.Linear after pack_native)."""

    native: torch.Tensor | None
    native_blocks: torch.Tensor | None
    native_kind: str


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer as DecoderStack computes it: its norms' weights (Qwen3's q and k norms
    None elsewhere), Qwen2's q/k/v bias (None elsewhere), and its q/k/v, output, gate/up and
    down projections, packed for the native kernel."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv_bias: torch.Tensor | None
    projections: tuple[StackProjection, StackProjection, StackProjection, StackProjection]


_EMPTY = torch.empty(0)


class DecoderStack:
    """Every layer of a step in one native call (csrc/decoder_stack.cpp): the kernels the
    layers' own forward calls, in the same order, called from C++, so the same results without
    a dozen Python calls and dispatches a layer (at one sequence a third of a decode step)."""

    def __init__(self, stack: Any) -> None:
        self._stack = stack

    @classmethod
    def build(cls, layers: Sequence[StackLayer], *, heads: int, kv_heads: int, head_dim: int,
              intermediate: int, eps: float, scale: float) -> DecoderStack | None:
        """The stack of `layers`, or None where the kernels did not load."""
        if not layers or not load():
            return None
        weights: list[torch.Tensor] = []
        kinds: list[str] = []
        for layer in layers:  # in the order csrc/decoder_stack.cpp's constructor reads
            weights += [t.detach() if t is not None else _EMPTY for t in (
                layer.input_norm, layer.post_attention_norm, layer.q_norm, layer.k_norm,
                layer.qkv_bias)]
            for p in layer.projections:
                if p.native is None:
                    raise ValueError("DecoderStack: a projection without its native packing")
                weights += [p.native, p.native_blocks if p.native_blocks is not None else _EMPTY]
                kinds.append(p.native_kind)
        hidden = layers[0].input_norm.shape[0]
        return cls(torch.classes.llm_kernels.DecoderStack(
            weights, kinds, [heads, kv_heads, head_dim, hidden, intermediate], eps, scale))

    def __call__(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                 caches: list[torch.Tensor], meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream, what the last layer adds to it) after every layer, for x
        [T, E] over `caches` (one [2, S, K, D] a layer) by `meta` (models.attention's
        AttentionMetadata, without a per-layer window or block tables)."""
        d, spans = meta.decode, meta.prefills
        return self._stack.forward(
            x.contiguous(), rotary[0], rotary[1], meta.slot_mapping, caches,
            d.token_index if d is not None else _EMPTY, d.slots if d is not None else _EMPTY,
            d.lens if d is not None else _EMPTY, [i for s in spans for i in (s.start, s.end)],
            [s.context_slots for s in spans],
            [s.mask if s.mask is not None else _EMPTY for s in spans])


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[kernels] %(message)s")
    if not enabled():
        print(f"[kernels] off ({SWITCH_ENV}={os.environ[SWITCH_ENV]})")
        return 0
    if "--all-paths" in sys.argv[1:]:  # one process per path: each loads its own library
        failed = 0
        for name in cpu_isa.available():
            env = {**os.environ, cpu_isa.CAP_ENV: name}
            build = [sys.executable, "-m", "python_backends.models.kernels"]
            failed |= subprocess.run(build, env=env).returncode
        return failed
    if not load():
        return 1
    print(f"[kernels] {cpu_isa.describe()} path: ready in {build_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
