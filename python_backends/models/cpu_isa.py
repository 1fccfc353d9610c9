"""Which instruction set the engine's CPU paths use: the best this CPU has, or less on request.

Four paths, from most to least:

    amx          AMX tiles: float32-exact split products for prompt-sized calls, the screened
                 LM head on tiles (Intel Xeon from Sapphire Rapids on)
    avx512_bf16  AVX-512 with bfloat16 dot products (torch's 16-bit engines use them); the
                 screened LM head on int8 VNNI products (AMD Zen 4 and 5, Intel Cooper Lake)
    avx512       AVX-512 float32 kernels; the LM head screened on VNNI where the CPU has it
                 (Cascade Lake, Ice Lake), in full where not (Skylake-SP)
    avx2         AVX2 + FMA float32 kernels (8 lanes), the LM head in full

`LLM_CPU_ISA` (one of those names) caps the path, so each can be tested and benchmarked on any
machine that has it; a cap above what the CPU has is the CPU's best. The cap reaches the native
kernels (compiled for the path: models.kernels) and torch's own: oneDNN's
`ONEDNN_MAX_CPU_ISA` and ATen's `ATEN_CPU_CAPABILITY`, which `torch_environment` fills in for
processes started after it (they are read once, when torch first uses them).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from python_backends import procfs

CAP_ENV = "LLM_CPU_ISA"


@dataclass(frozen=True)
class IsaPath:
    name: str
    needs: tuple[str, ...]  # /proc/cpuinfo flags
    cflags: tuple[str, ...]  # after -march=native: what the native kernels must not use
    onednn: str  # ONEDNN_MAX_CPU_ISA
    aten: str  # ATEN_CPU_CAPABILITY
    describes: str


_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
# Most to least: the first whose flags the CPU has (and the cap allows) is the path.
PATHS = (
    IsaPath("amx", ("amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512bw", "avx512vl"), (),
          "AVX512_CORE_AMX", "avx512", "AMX tiles"),
    IsaPath("avx512_bf16", ("avx512_bf16", "avx512f", "avx512bw", "avx512vl"), _NO_AMX,
          "AVX512_CORE_BF16", "avx512", "AVX-512 with bfloat16 dot products"),
    IsaPath("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
          (*_NO_AMX, "-mno-avx512bf16"), "AVX512_CORE", "avx512", "AVX-512 without bfloat16"),
    IsaPath("avx2", ("avx2", "fma"), (*_NO_AMX, "-mno-avx512f"), "AVX2", "avx2", "AVX2"),
)
NAMES = tuple(p.name for p in PATHS)


def available(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The paths this CPU can run, most first (none on a CPU without AVX2)."""
    flags = procfs.cpu_flags() if flags is None else flags
    return tuple(p.name for p in PATHS if set(p.needs) <= flags)


def cap() -> str | None:
    """The cap `LLM_CPU_ISA` asks for, None when unset; ValueError naming the variable and the
    choices for anything else."""
    value = os.environ.get(CAP_ENV, "").strip().lower()
    if not value:
        return None
    if value not in NAMES:
        raise ValueError(f"{CAP_ENV}={value!r}: expected one of {', '.join(NAMES)}")
    return value


def choose(have: tuple[str, ...], limit: str | None) -> IsaPath | None:
    """The best of `have` at or below `limit`."""
    allowed = NAMES if limit is None else NAMES[NAMES.index(limit):]
    return next((p for p in PATHS if p.name in have and p.name in allowed), None)


@functools.cache
def path() -> IsaPath | None:
    """This process's path: the CPU's best under the cap; None on a CPU without AVX2."""
    return choose(available(), cap())


def torch_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` with oneDNN's and ATen's caps set to the path's where a cap is asked for and they
    are not set already (for the processes a launcher starts)."""
    chosen = path() if cap() is not None else None
    if chosen is None:
        return env
    return {"ONEDNN_MAX_CPU_ISA": chosen.onednn, "ATEN_CPU_CAPABILITY": chosen.aten, **env}


def describe() -> str:
    """The path in words, and the cap if one is set, for logs and banners."""
    chosen, limit = path(), cap()
    if chosen is None:
        return "no path (the CPU has no AVX2)"
    capped = f", capped by {CAP_ENV}={limit}" if limit is not None else ""
    return f"{chosen.name} ({chosen.describes}{capped})"
