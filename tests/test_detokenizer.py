"""Streaming detokenization with the real SmolLM2 tokenizer (byte-level BPE)."""

from pathlib import Path

import pytest

from python_backends.detokenizer import STREAM_CONTEXT_TOKENS, incremental_text, safe_text
from python_backends.front.stream import RequestStream

ENGINE = Path(__file__).resolve().parents[1] / "engines" / "smollm2"
TEXTS = [
    "Bonjour, ça va très bien à Paris.",
    "中国的首都是北京，上海是最大的城市。",
    "I love 🍕🍕 and 👩‍👩‍👧 families 🎉!",
    "def f(x):\n    return x ** 2  # ✓",
]


@pytest.fixture(scope="module")
def tokenizer():
    if not (ENGINE / "tokenizer.json").is_file():
        pytest.skip("default engine not built (scripts/setup_env.sh builds it)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ENGINE))


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_chunks_concatenate_to_full_text(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = RequestStream([], stream=True, exclude_input_in_output=True, return_log_probs=False)
    pieces = []
    for i, t in enumerate(ids):
        chunk = stream.add([t], [0.0], "length" if i == len(ids) - 1 else "")
        assert chunk is not None and len(chunk.tokens) <= STREAM_CONTEXT_TOKENS + 1
        piece = incremental_text(tokenizer, chunk.tokens, chunk.prefix_len)
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) == text == safe_text(tokenizer, ids)
    assert any(p == "" for p in pieces) == any(ord(c) > 0x7FF for c in text)
