"""The instruction-set paths (models/cpu_isa.py): which one a CPU and a cap choose, and, on each
path this machine can run below its own, the native kernels' tests and Hugging Face's greedy
output again, each in a process of its own (one build of the kernels per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from python_backends import procfs
from python_backends.config import PROJECT_ROOT
from python_backends.models import cpu_isa

ZEN4 = frozenset(["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"])
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
SKYLAKE_X = ZEN4 - {"avx512_bf16"}
HASWELL = frozenset({"avx2", "fma"})


@pytest.mark.parametrize(("flags", "want"), [(SAPPHIRE_RAPIDS, "amx"), (ZEN4, "avx512_bf16"),
                                             (SKYLAKE_X, "avx512"), (HASWELL, "avx2")])
def test_the_best_path_the_cpu_has(flags, want):
    assert _chosen(flags, None) == want


def _chosen(flags: frozenset[str], cap: str | None) -> str | None:
    chosen = cpu_isa.choose(cpu_isa.available(flags), cap)
    return None if chosen is None else chosen.name


def test_a_cap_takes_the_best_path_at_or_below_it():
    assert [_chosen(SAPPHIRE_RAPIDS, cap) for cap in cpu_isa.NAMES] == list(cpu_isa.NAMES)
    assert _chosen(ZEN4, "amx") == "avx512_bf16"
    assert _chosen(HASWELL, "avx512") == "avx2"
    assert _chosen(frozenset({"sse4_2"}), None) is None


def test_an_unknown_cap_is_refused_naming_the_variable_and_choices(monkeypatch):
    monkeypatch.setenv(cpu_isa.CAP_ENV, "avx1024")
    with pytest.raises(ValueError, match=r"LLM_CPU_ISA='avx1024': expected one of amx, "):
        cpu_isa.cap()
    monkeypatch.setenv(cpu_isa.CAP_ENV, " AVX2 ")
    assert cpu_isa.cap() == "avx2"


def test_a_cap_reaches_torchs_own_kernels_unless_they_are_set(monkeypatch):
    monkeypatch.delenv(cpu_isa.CAP_ENV, raising=False)
    cpu_isa.path.cache_clear()
    try:
        assert cpu_isa.torch_environment({"A": "1"}) == {"A": "1"}
        monkeypatch.setenv(cpu_isa.CAP_ENV, "avx2")
        cpu_isa.path.cache_clear()
        if "avx2" not in cpu_isa.available():
            pytest.skip("this CPU has no AVX2")
        assert cpu_isa.torch_environment({}) == {"ONEDNN_MAX_CPU_ISA": "AVX2",
                                                 "ATEN_CPU_CAPABILITY": "avx2"}
        assert cpu_isa.torch_environment({"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"})[
            "ONEDNN_MAX_CPU_ISA"] == "AVX2_VNNI"
    finally:
        cpu_isa.path.cache_clear()


# The kernels' own tests, and the engine against Hugging Face on each family (the screened LM
# head where the path has one).
PATH_TESTS = ["tests/models/test_linear.py", "tests/models/test_layer_ops.py",
              "tests/models/test_attention.py", "tests/models/test_greedy_head.py",
              "tests/models/test_families.py::test_engine_matches_hf_with_chunks_and_a_prefix_cache"]
SHOWS_PATH = ("from python_backends.models import cpu_isa, kernels; assert kernels.load(); "
              "print(cpu_isa.path().name, kernels.screen_path() or '-')")


def screen(name: str) -> str:
    """The greedy head's screen on path `name`: AMX tiles, else VNNI where the CPU has it."""
    if name == "amx":
        return "amx"
    return "avx512_vnni" if name != "avx2" and "avx512_vnni" in procfs.cpu_flags() else "-"


@pytest.mark.parametrize("name", cpu_isa.NAMES)
def test_every_path_below_this_cpus_best_passes_the_kernel_tests(name):
    have = cpu_isa.available()
    if name not in have:
        pytest.skip(f"this CPU cannot run the {name} path")
    if name == have[0] and not os.environ.get(cpu_isa.CAP_ENV):
        pytest.skip("the rest of the suite runs on this CPU's best path")
    env = {**os.environ, cpu_isa.CAP_ENV: name}
    shown = subprocess.run([sys.executable, "-c", SHOWS_PATH], env=env, cwd=PROJECT_ROOT,
                           capture_output=True, text=True, timeout=600)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert shown.stdout.split() == [name, screen(name)]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *PATH_TESTS], env=env, cwd=PROJECT_ROOT, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-5000:]
