"""Float32 weights found to be exact GGUF blocks, 4-bit (Q4_1, Q4_0, Q4_K) and Q8_0
(models/weight_blocks.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    quants,
)

from python_backends.config import EngineLimits
from python_backends.engine.builder import default_source, load_hf, write_engine
from python_backends.engine.llm_engine import LLMEngine
from python_backends.models import kernels
from python_backends.models.decoder import NarrowerBudget
from python_backends.models.weight_blocks import KINDS, Blocks, find
from python_backends.parallel.layers import Linear
from python_backends.params import SamplingParams
from tests.conftest import make_tiny_llama, prompts


@pytest.fixture(autouse=True, scope="module")
def native_search() -> None:
    assert kernels.load(), "the native kernels did not build here (see the warning logged)"


def gguf_weight(rows: int, cols: int, kind: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """A float32 weight as transformers gets it from a GGUF of `kind`: quantized and dequantized
    by the gguf package (llama.cpp's reference quantizers and dequantization)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) / 10
    w[0, :32] = 0.25  # a constant block (Q4_1: d = 0)
    return torch.from_numpy(quants.dequantize(quants.quantize(w, kind), kind).copy())


def gguf_q4_1(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return gguf_weight(rows, cols, GGMLQuantizationType.Q4_1, seed)


def gguf_q8_0(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return gguf_weight(rows, cols, GGMLQuantizationType.Q8_0, seed)


def gguf_q4_0(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return gguf_weight(rows, cols, GGMLQuantizationType.Q4_0, seed)


# The float16 fields of a K-quant super-block (d, and dmin where it has one), by byte offset.
K_QUANT_HALVES = {GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2),
                  GGMLQuantizationType.Q6_K: (208,)}


def gguf_k_quant(rows: int, cols: int, kind: GGMLQuantizationType, seed: int = 0,
                 scale: float = 0.01) -> torch.Tensor:
    """A float32 weight dequantized by the gguf package from `kind` (Q4_K, Q5_K, Q6_K)
    super-blocks of random bytes (the gguf package quantizes to none of them): float16 d (and
    dmin) below `scale`, random scales (and mins; 0 among them: sub-blocks of one value) and
    levels. Every such byte string is a valid tensor of that type, far-from-zero offsets and
    negative scales (Q6_K) included."""
    block, size = GGML_QUANT_SIZES[kind]
    assert cols % block == 0, f"{kind.name} super-blocks are {block} inputs"
    rng = np.random.default_rng(seed)
    n = rows * cols // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in K_QUANT_HALVES[kind]:
        raw[:, at:at + 2] = (rng.random(n) * scale).astype(np.float16).view(np.uint8).reshape(n, 2)
    w = quants.dequantize(raw.reshape(rows, -1), kind)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def gguf_q4_k(rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> torch.Tensor:
    return gguf_k_quant(rows, cols, GGMLQuantizationType.Q4_K, seed, scale)


# A weight of each GGUF type, and the kind of blocks (weight_blocks.KINDS) it is read as.
def gguf_of(name: str, rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> torch.Tensor:
    kind = GGMLQuantizationType[name]
    if kind in K_QUANT_HALVES:
        return gguf_k_quant(rows, -(-cols // 256) * 256, kind, seed, scale)
    return gguf_weight(rows, cols, kind, seed)


READ_AS = {"Q4_0": "q4", "Q4_1": "q4", "Q4_K": "q4", "Q5_0": "u8g32", "Q5_1": "u8g32",
           "Q5_K": "u8g32", "Q6_K": "u8g16", "Q8_0": "q8"}


def first_found(w: torch.Tensor) -> Blocks | None:
    """The blocks the engine reads `w` as: the first kind, in KINDS' order, that fits."""
    return next((b for kind in KINDS if (b := find(w, kind)) is not None), None)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("shape", [(1, 32), (96, 576), (7, 1536)])
def test_q4_1_blocks_give_back_every_weight_bit_for_bit(shape: tuple[int, int]) -> None:
    w = gguf_q4_1(*shape)
    found = find(w, "q4")
    assert found is not None and found.m is not None
    assert found.q.dtype == torch.uint8 and int(found.q.max()) <= 15
    assert found.d.shape == found.m.shape == (shape[0], shape[1] // 32)
    assert torch.equal(bits(found.dequantize()), bits(w))
    assert torch.equal(found.d.half().float(), found.d)  # float16 scales: d q exact


@pytest.mark.parametrize("scale", [0.01, 1.0, 1e-4])
@pytest.mark.parametrize("name", list(READ_AS))
def test_every_gguf_type_is_found_as_its_blocks(name: str, scale: float) -> None:
    """Each type as the kind it is read as, and none of fewer bytes a weight first: Q4_K's
    sub-blocks (d = float16 x 6-bit scale, m = -(float16 x 6-bit min): no float16 scales, not
    always a weight on level 0), Q4_0's and Q5_0's (d (q - 8), d (q - 16), d of either sign:
    zeros of either sign), Q6_K's (16-input groups, int8 scales of either sign)."""
    w = gguf_of(name, 64, 512, seed=int(1 / scale), scale=scale)
    found = first_found(w)
    assert found is not None and found.kind == READ_AS[name]
    assert torch.equal(found.dequantize(), w)  # the values; a zero's sign aside
    levels = {"q4": (0, 15), "u8g32": (0, 31), "u8g16": (0, 63), "q8": (-128, 127)}[found.kind]
    assert levels[0] <= int(found.q.min()) and int(found.q.max()) <= levels[1]


def test_weights_that_are_not_blocks_are_refused() -> None:
    for kind in KINDS:
        assert find(torch.randn(8, 64), kind) is None  # a float32 checkpoint
        assert find(torch.randn(8, 64).bfloat16().float(), kind) is None  # a bfloat16 one
        assert find(torch.empty(0, 64), kind) is None
    w = gguf_q4_1(8, 64)
    assert find(w[:, :48].contiguous(), "q4") is None  # inputs not in whole blocks
    assert find(w.double(), "q4") is None
    one_off = w.clone()
    one_off[3, 40] = torch.nextafter(one_off[3, 40], torch.tensor(1.0))  # one ulp
    assert find(one_off, "q4") is None
    with pytest.raises(ValueError, match="unknown kind"):
        find(w, "q3")


@pytest.mark.parametrize("shape", [(1, 32), (96, 576), (7, 1536)])
def test_q8_0_blocks_give_back_every_weight_bit_for_bit(shape: tuple[int, int]) -> None:
    w = gguf_q8_0(*shape)
    found = find(w, "q8")
    assert found is not None and found.q.dtype == torch.int8 and found.m is None
    assert torch.equal(bits(found.dequantize()), bits(w))
    assert torch.equal(found.d.half().float(), found.d)


def test_weights_that_are_not_q8_0_blocks_are_refused() -> None:
    assert find(gguf_q8_0(8, 64)[:, :40].contiguous(), "q8") is None
    one_off = gguf_q8_0(8, 64)
    one_off[2, 7] = torch.nextafter(one_off[2, 7], torch.tensor(1.0))
    assert find(one_off, "q8") is None


NARROWER = {  # a checkpoint's weights as the engine build gets them, by what they are stored as
    "q4_k": lambda w, seed: gguf_q4_k(w.shape[0], w.shape[1], seed=seed, scale=0.0005),
    "q6_k": lambda w, seed: gguf_of("Q6_K", w.shape[0], w.shape[1], seed=seed, scale=0.0005),
    "bfloat16": lambda w, _seed: w.bfloat16().float(),  # most Hugging Face checkpoints
    "float16": lambda w, _seed: w.half().float(),
}


@pytest.mark.parametrize("stored", list(NARROWER))
def test_an_engine_reads_weights_in_their_narrower_form_and_matches_hf(
        tmp_path: Path, stored: str) -> None:
    """A float32 engine of a checkpoint whose projections are Q4_K blocks, bfloat16 or float16
    values: it finds every projection's narrower form (the LM head's too), and greedy output
    equals Hugging Face's on those weights, one sequence (steps that read the narrower form)
    and several (those and larger steps by turns), larger steps read from the float32 panels
    and from the narrower forms unpacked."""
    def narrower(hf: torch.nn.Module) -> None:
        with torch.no_grad():
            for i, m in enumerate(hf.modules()):
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(NARROWER[stored](m.weight, i))

    tiny = make_tiny_llama(tmp_path / "engine", hidden_size=256, intermediate_size=512,
                           weights=narrower)
    threads = torch.get_num_threads()
    try:
        engine = LLMEngine.from_engine_dir(tiny.engine_dir, num_kv_blocks=128, cpu_threads=1)
    finally:
        torch.set_num_threads(threads)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.native_blocks is not None for m in linears)
    ops = torch.ops.llm_kernels
    # Steps past a tile's rows: the float32 panels, the narrower forms unpacked, and (the
    # default; on AMX, for the GGUF blocks) their levels on tiles.
    measured, levels = ops.set_unpack_rows(0), ops.set_amx_levels(False)
    try:
        for unpack, on_tiles in ((0, False), (1 << 30, False), (0, True)):
            ops.set_unpack_rows(unpack)
            ops.set_amx_levels(on_tiles)
            for batch in (prompts(1), prompts(4, seed=2)):
                seqs = [engine.add_request(f"s{i}-{len(batch)}-{unpack}-{on_tiles}", p,
                                           SamplingParams(max_tokens=6))
                        for i, p in enumerate(batch)]
                while engine.has_unfinished:
                    engine.step()
                assert [s.output_ids for s in seqs] == [tiny.greedy(p, 6) for p in batch]
    finally:
        ops.set_unpack_rows(measured)
        ops.set_amx_levels(levels)


def test_narrower_forms_stop_at_a_quarter_of_the_memory_available() -> None:
    found: list[int] = []

    def find_form(w: torch.Tensor) -> kernels.Narrow:
        found.append(w.numel())
        return kernels.Narrow(torch.empty(w.numel(), dtype=torch.bfloat16), "bf16")  # 2 B each

    budget = NarrowerBudget(4 * 2000)  # 2000 bytes for narrower forms
    weights = [torch.zeros(300) for _ in range(5)]  # 600 bytes each
    kept = [budget.blocks(find_form, w) for w in weights]
    assert [k is not None for k in kept] == [True, True, True, True, False]  # 2400 > 2000
    assert found == [300] * 4 and budget.refused == 1  # past it, none is even searched
    unknown = NarrowerBudget(None)  # no /proc/meminfo: no limit
    assert all(unknown.blocks(find_form, w) is not None for w in weights)
    assert not unknown.refused


def requantized(src: Path, dst: Path, kind: GGMLQuantizationType) -> Path:
    """`src` (a GGUF file) with its Q4_1 tensors quantized anew as `kind` by the gguf package,
    every other tensor and all metadata as they were: a model file as a user may bring."""
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer's own
        value_type = field.types[0]
        writer.add_key_value(field.name, field.contents(), value_type,
                             sub_type=field.types[-1] if value_type == GGUFValueType.ARRAY
                             else None)
    for t in reader.tensors:
        data, qtype = t.data, t.tensor_type
        if qtype == GGMLQuantizationType.Q4_1:
            data, qtype = quants.quantize(quants.dequantize(data, qtype), kind), kind
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# A prompt of more than 128 tokens: its rows compute on AMX tiles from two pieces of each weight
# (csrc/linear.cpp, LevelPieces) where the CPU has them.
LONG_TEXT = (
    "The river town had grown up around a mill that ground grain for farms across the valley. When "
    "the railway arrived, the mill closed, and the town turned to making furniture from the oak "
    "forests on the hills. For a century the workshops prospered, shipping chairs and tables to "
    "cities along the coast. Then the forests thinned, the workshops shut one by one, and young "
    "people left for jobs elsewhere. Today the old mill is a museum, the workshops are studios for "
    "painters and potters, and visitors come on weekends to walk the river path, buy pottery and "
    "eat at the cafes that line the square where the market once stood. On the first Saturday of "
    "every month, the square fills again with stalls selling")


@pytest.mark.parametrize("requantize", [None, GGMLQuantizationType.Q5_1], ids=["Q4_1", "Q5_1"])
def test_an_engine_of_a_gguf_reads_its_blocks_and_matches_hf(
        tmp_path: Path, requantize: GGMLQuantizationType | None) -> None:
    """The shipped model (Q4_1), and quantized anew to Q5_1, through the engine build as a user's
    GGUF goes (transformers dequantizes it): every projection reads 4- or 5-bit blocks, and greedy
    output is Hugging Face's on the same file, from prompts of every size."""
    gguf = default_source()
    if requantize is not None:
        gguf = requantized(gguf, tmp_path / f"model.{requantize.name}.gguf", requantize)
    hf, tokenizer = load_hf(gguf)
    write_engine(hf, tokenizer, tmp_path / "engine", EngineLimits(max_seq_len=256), "float32",
                 str(gguf), log=lambda _m: None)
    threads = torch.get_num_threads()
    try:
        engine = LLMEngine.from_engine_dir(tmp_path / "engine", num_kv_blocks=64, cpu_threads=1)
    finally:
        torch.set_num_threads(threads)
    layers = [m for m in engine.runner.model.model.layers.modules() if isinstance(m, Linear)]
    assert layers and {m.native_kind for m in layers} == {"u8g32" if requantize else "q4"}
    for text in ("The capital of France is", "def fibonacci(n):",  # the next, prompt rows on
                 "The old lighthouse keeper found a message in a bottle on the rocks below "
                 "his tower one morning, and when he opened it he read",  # AMX from the levels
                 LONG_TEXT):
        ids = tokenizer(text)["input_ids"]
        assert (len(ids) > 128) is (text == LONG_TEXT)
        seq = engine.add_request(text, ids, SamplingParams(max_tokens=12))
        while engine.has_unfinished:
            engine.step()
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False)[0, len(ids):].tolist()
        assert seq.output_ids == want, text
