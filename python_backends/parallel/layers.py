"""Layers that split their weights across the tensor-parallel ranks of a stage.

Column-parallel projections (q/k/v, gate/up) hold a slice of the output features and need no
communication; row-parallel ones (o_proj, down_proj) hold a slice of the input features and sum
their partial outputs with one all-reduce, so each attention and each MLP block costs exactly one.
The embedding and the LM head hold a slice of the vocabulary (padded to a multiple of tp by the
engine builder). With tp = 1 every layer is its plain single-device counterpart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from python_backends.parallel.context import ParallelContext

# (x [T, in], packed, out, blocks, the blocks' layout) -> [T, out]
NativeOp = Callable[[torch.Tensor, Any, int, torch.Tensor | None, str], torch.Tensor]


def int8_supported() -> str | None:
    """Why int8 weights cannot compute fast on this CPU, None if they can: fbgemm (torch's x86
    quantized kernels) and integer dot-product instructions (VNNI) are needed."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no fbgemm quantized kernels"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cannot read /proc/cpuinfo to look for VNNI"
    if not any(f in flags for f in (" avx512_vnni", " avx_vnni", " amx_int8")):
        return "this CPU has no VNNI (avx512_vnni, avx_vnni or amx_int8) instructions"
    return None


def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN computes CPU projections of `dtype` from packed weights: float32 always,
    bfloat16 and float16 where the CPU has instructions for them (avx512_bf16 or AMX;
    avx512_fp16 or AMX-FP16). Elsewhere oneDNN would emulate them, slower than float32."""
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


class Linear(nn.Linear):
    """nn.Linear that can pre-pack its weight for oneDNN on the CPU (`pack`), or keep it as int8
    for fbgemm (`quantize_int8`).

    A batch-16 decode step streams every weight once; oneDNN's blocked layout about halves the
    time of those small-M GEMMs against the default sgemm path (docs/platform.md). Packing
    happens once after loading; results differ from F.linear only in rounding (~1e-4 in
    float32), and float32 greedy output is checked against Hugging Face in the tests.

    A packed projection may also keep its plain weight (`plain`) for one-token calls: on some
    CPUs MKL's matrix-vector product reads float32 weights faster than oneDNN's packed kernel, on
    others slower (docs/platform.md). `plain_reads_faster` measures which, once, at load.
    """

    packed: torch.Tensor | None = None
    plain: torch.Tensor | None = None  # the float weight, kept beside `packed` for one token
    quantized: Any = None  # int8 weights packed for fbgemm (quantize_int8)
    native: torch.Tensor | None = None  # the weight as `native_op` reads it (pack_native)
    native_op: NativeOp | None = None
    native_blocks: torch.Tensor | None = None  # the weight's exact narrower form (pack_native)
    native_kind = ""  # its layout (kernels.Narrow.kind)

    def quantize_int8(self) -> None:
        """Keep the weight as int8, one scale per output feature (symmetric), packed for
        fbgemm; activations are quantized per call (dynamic quantization). A quarter of the
        float32 weight's bytes to read per step, integer dot products (VNNI) to compute."""
        w = self.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
        self.quantized = torch.ops.quantized.linear_prepack(qweight, None)
        self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)

    def pack(self, keep_plain: bool = False) -> bool:
        """Pack the weight for oneDNN; `keep_plain`: keep the plain weight too, for one-token
        calls (twice the memory, unless a tied embedding holds it anyway)."""
        if self.weight.device.type != "cpu" or not packable(self.weight.dtype):
            return False
        weight = self.weight.detach()
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        except (RuntimeError, AttributeError):  # no oneDNN in this build: keep F.linear
            return False
        self.plain = weight if keep_plain else None
        # The parameter itself is no longer read: `plain`, if kept, and a tied embedding hold it.
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        return True

    def pack_native(self, pack: Callable[[torch.Tensor], torch.Tensor], op: NativeOp,
                    blocks: Callable[[torch.Tensor], Any] | None = None) -> bool:
        """Compute with a native kernel from now on (the engine's float32 CPU projection,
        python_backends.models.kernels): `pack` lays the weight out for `op(x, packed,
        out_features, blocks, kind)`, and `blocks`, if given, finds the weight's exact narrower
        form (kernels.Narrow: `packed` and `kind`; None where it has none). float32 CPU weights
        without bias only; False, and nothing changed, for others."""
        weight = self.weight.detach()
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return False
        narrow = blocks(weight) if blocks is not None else None
        if narrow is not None:
            self.native_blocks, self.native_kind = narrow.packed, narrow.kind
        self.native, self.native_op = pack(weight), op
        self.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        return True

    @property
    def input_dtype(self) -> torch.dtype:
        """What it computes on: float32 for int8 weights and native kernels, else its weight's
        dtype."""
        if self.quantized is not None or self.native is not None:
            return torch.float32
        return self.packed.dtype if self.packed is not None else self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return self._product(x)
        if self.packed is not None and not (self.plain is not None and x.shape[0] == 1):
            return _packed_linear(x, self.packed, self.bias)  # oneDNN adds it in the GEMM
        return self._product(x) + self.bias

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T, without the bias."""
        if self.native_op is not None:
            rows = x.reshape(-1, x.shape[-1])
            return self.native_op(rows, self.native, self.out_features,
                                  self.native_blocks, self.native_kind).view(
                *x.shape[:-1], self.out_features)
        if self.plain is not None and x.shape[0] == 1:
            return F.linear(x, self.plain)
        if self.packed is not None:
            return _packed_linear(x, self.packed)
        if self.quantized is not None:
            return torch.ops.quantized.linear_dynamic(x, self.quantized, False)
        return F.linear(x, self.weight)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pass_seconds(linears: Sequence[Linear], rows: int, repeats: int = 3,
                 call: Callable[[Linear, torch.Tensor], torch.Tensor] | None = None) -> float:
    """Best time of `rows` tokens through every projection in `linears` (`call(m, x)`, default
    the projection's own forward), over `repeats` passes after one that warms up."""
    call = call or Linear.__call__
    inputs = {(m.in_features, m.input_dtype): torch.randn(rows, m.in_features,
                                                          dtype=m.input_dtype)
              for m in linears}
    best = float("inf")
    with torch.inference_mode():
        for i in range(repeats + 1):
            start = time.perf_counter()
            for m in linears:
                call(m, inputs[m.in_features, m.input_dtype])
            if i:
                best = min(best, time.perf_counter() - start)
    return best


def _by_plain(m: Linear, x: torch.Tensor) -> torch.Tensor:
    assert m.plain is not None
    return F.linear(x, m.plain)


def _by_packed(m: Linear, x: torch.Tensor) -> torch.Tensor:
    assert m.packed is not None
    return _packed_linear(x, m.packed)


def one_token_seconds(linears: list[Linear], plain: bool, repeats: int = 3) -> float:
    """Best time of one token through every projection in `linears` (packed, with `plain`
    kept), by the plain weights or by the packed ones."""
    return pass_seconds(linears, 1, repeats, _by_plain if plain else _by_packed)


def best_in_turn(first: Callable[[], float], second: Callable[[], float],
                 rounds: int) -> tuple[float, float]:
    """The best of `rounds` timings of each of two ways, timed in turn: a server loads its models
    at once, and a burst of another stub's work then slows both ways' best times alike instead
    of one."""
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, timed in enumerate((first, second)):
            best[i] = min(best[i], timed())
    return best[0], best[1]


def plain_reads_faster(linears: list[Linear], margin: float = 0.95,
                       rounds: int = 4) -> tuple[bool, float, float]:
    """Whether one token through `linears` by their plain weights takes at most `margin` of the
    time by their packed ones (worth a second copy), with both best times in seconds, the two
    timed in turn (best_in_turn)."""
    plain, packed = best_in_turn(lambda: one_token_seconds(linears, True, repeats=1),
                                 lambda: one_token_seconds(linears, False, repeats=1), rounds)
    return plain <= margin * packed, plain, packed


def shard_size(full: int, ctx: ParallelContext) -> int:
    if full % ctx.tp_size:
        raise ValueError(f"{full} does not split over tp={ctx.tp_size}")
    return full // ctx.tp_size


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


class ColumnParallelLinear(Linear):
    """y[..., my slice of out_features] = x W_slice^T. Packed projections (qkv, gate_up) are
    sharded part by part by the builder, so the local slice is again [q; k; v] or [gate; up]."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext,
                 bias: bool = False) -> None:
        super().__init__(in_features, shard_size(out_features, ctx), bias=bias)


class RowParallelLinear(Linear):
    """y = sum over ranks of x[..., my slice] W[:, my slice]^T: one all-reduce."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext) -> None:
        super().__init__(shard_size(in_features, ctx), out_features, bias=False)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [tp_rank * V/tp, (tp_rank + 1) * V/tp) of the (padded) table; tokens outside the
    slice embed to zero here and come from their owner through one all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.num_local = padded_vocab(vocab_size, ctx.tp_size) // ctx.tp_size
        self.start = ctx.tp_rank * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.ctx.all_reduce(x)


class ParallelLMHead(Linear):
    """Logits of this rank's vocabulary slice, gathered into the full vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int, ctx: ParallelContext) -> None:
        super().__init__(hidden_size, padded_vocab(vocab_size, ctx.tp_size) // ctx.tp_size,
                         bias=False)
        self.ctx = ctx
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.ctx.all_gather_last_dim(super().forward(x))
        return logits[..., : self.vocab_size]
