"""Structured outputs in the engine: a grammar matcher per guided sequence (llguidance, over the
engine's own tokenizer) and one token bitmask per step for the batch's guided rows.

A sequence's matcher is made when it joins the engine, after the tokens it already has (a
prefill instance's first token, or a migrated request's tokens so far) are fed to it, so a
guided request continues in its language wherever it resumes. The sampler masks the guided rows
of a step's logits at once (`mask_logits`); every token appended is fed to the matcher
(Scheduler._append), and a matcher that reaches the end of its language ends the sequence.
Unguided rows pay nothing. Guided rows get no speculative drafts (they need their logits).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from python_backends import guides
from python_backends.engine.sequence import Sequence


class GuideMatchers:
    """Matchers over the tokenizer of the engine in `engine_dir`, loaded on first use (engines
    that never see a guided request never load it)."""

    def __init__(self, engine_dir: Path | None, vocab_size: int, eos_ids: tuple[int, ...]):
        self.engine_dir = engine_dir
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    @functools.cached_property
    def tokenizer(self) -> Any:
        import llguidance.hf
        from transformers import AutoTokenizer

        files = ("tokenizer.json", "tokenizer_config.json")
        if self.engine_dir is None or not any((self.engine_dir / f).is_file() for f in files):
            raise ValueError("this engine has no tokenizer, so it cannot follow a "
                             "guided_decoding_guide")
        hf: Any = AutoTokenizer.from_pretrained(str(self.engine_dir))
        return llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                            eos_token=list(self.eos_ids) or None)

    def attach(self, seq: Sequence) -> None:
        """Give a guided sequence its matcher, fed the output tokens it already has; a
        ValueError if the guide cannot be followed here."""
        p = seq.params
        if not p.guided or seq.matcher is not None:
            return
        import llguidance

        try:
            grammar = guides.grammar(p.guide_type, p.guide)
        except guides.InvalidGuide as e:
            raise ValueError(f"guided_decoding_guide: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if seq.output_ids and not matcher.consume_tokens(seq.output_ids):
            raise ValueError(f"the tokens so far do not follow the guide: "
                             f"{matcher.get_error()}")
        if matcher.is_error():
            raise ValueError(f"guided_decoding_guide: {matcher.get_error()}")
        seq.matcher = matcher


def mask_logits(seqs: list[Sequence], logits: torch.Tensor) -> None:
    """Set the logits of every token a guided row's matcher forbids to -inf, in place, for all
    of the step's guided rows with one bitmask. logits: [N, V] on the CPU, row i of seqs[i].
    (llguidance's numpy helpers fill the mask; its torch ones would torch.compile the unpacking,
    which needs a compiler toolchain and a UTF-8 locale the Triton stub does not have.)"""
    import llguidance.numpy as lln

    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return
    vocab = logits.shape[-1]
    bitmask = lln.allocate_token_bitmask(len(rows), vocab)
    for j, i in enumerate(rows):
        lln.fill_next_token_bitmask(seqs[i].matcher, bitmask, j)
    words = torch.from_numpy(bitmask)  # [R, W]: bit b of word w allows token 32 w + b
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows)
    guided = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, guided)
