"""Incremental detokenization that never splits a multi-byte character.

Postprocessing is stateless per response, so the front sends each streamed step's new token
ids together with a few preceding ones (`STREAM_CONTEXT_TOKENS`). The text of the new tokens is
the growth of the window's decoded text, where an incomplete trailing character (decoded as
U+FFFD) is held back until the token that completes it arrives. Garbage at the start of the
window (a character cut by the window edge) appears identically in both decodings and cancels.
"""

from __future__ import annotations

from typing import Any

# A character is at most 4 UTF-8 bytes and every token carries at least one byte, so 3 held-back
# tokens plus the one that completes them always fit; the rest is margin for merges.
STREAM_CONTEXT_TOKENS = 8
_REPLACEMENT = "\ufffd"


def safe_text(tokenizer: Any, token_ids: list[int]) -> str:
    """Decoded text without a trailing incomplete character."""
    text: str = tokenizer.decode(
        token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    return text.rstrip(_REPLACEMENT)


def incremental_text(tokenizer: Any, token_ids: list[int], prefix_len: int) -> str:
    """Text contributed by `token_ids[prefix_len:]` given the context `token_ids[:prefix_len]`."""
    if prefix_len == 0:
        return safe_text(tokenizer, token_ids)
    before = safe_text(tokenizer, token_ids[:prefix_len])
    after = safe_text(tokenizer, token_ids)
    if after.startswith(before):
        return after[len(before) :]
    # A merge changed earlier text (not possible with byte-level BPE); emit the difference
    # from the first changed character on, never a duplicate of what was already sent.
    common = 0
    for a, b in zip(before, after, strict=False):
        if a != b:
            break
        common += 1
    return after[common:]
