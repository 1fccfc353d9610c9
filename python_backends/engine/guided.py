"""Structured outputs in the engine: a grammar matcher per guided sequence (llguidance, over the
engine's own tokenizer) and one token bitmask per step for the batch's guided rows.

A sequence's matcher is made when it joins the engine, after the tokens it already has (a
prefill instance's first token, or a migrated request's tokens so far) are fed to it, so a
guided request continues in its language wherever it resumes. The sampler masks the guided rows
of a step's logits at once (`mask_logits`), with masks filled on a worker thread while the
step's forward pass computes (`start_masks`); every token appended is fed to the matcher
(Scheduler._append), and a matcher that reaches the end of its language ends the sequence.
Unguided rows pay nothing. Guided rows get no speculative drafts (they need their logits).
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from python_backends import guides
from python_backends.engine.sequence import Sequence

if TYPE_CHECKING:
    from python_backends.engine.scheduler import ScheduledSequence


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


# A mask is filled on this thread while the forward pass computes (llguidance computes it with
# the GIL released); one thread: the engine's own forward pass keeps the other cores busy.
_FILLER = ThreadPoolExecutor(1, thread_name_prefix="guide-masks")
Masks = dict[str, torch.Tensor]  # seq_id -> the tokens its matcher allows now, bool [V]


def start_masks(scheduled: list[ScheduledSequence], vocab: int) -> Future[Masks] | None:
    """Begin filling the token masks of the step's guided rows that will be sampled (each
    matcher's state is final until the step's tokens are fed to it, after sampling)."""
    seqs = [item.seq for item in scheduled if item.samples and item.seq.matcher is not None]
    return _FILLER.submit(allowed_tokens, seqs, vocab) if seqs else None


def allowed_tokens(seqs: list[Sequence], vocab: int) -> Masks:
    """The tokens each sequence's matcher allows next: one bitmask for all, unpacked. (llguidance's
    numpy helpers fill it; its torch ones would torch.compile the unpacking, which needs a
    compiler toolchain and a UTF-8 locale the Triton stub does not have.)"""
    import llguidance.numpy as lln

    bitmask = lln.allocate_token_bitmask(len(seqs), vocab)
    for j, seq in enumerate(seqs):
        lln.fill_next_token_bitmask(seq.matcher, bitmask, j)
    words = torch.from_numpy(bitmask)  # [R, W]: bit b of word w allows token 32 w + b
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(len(seqs), -1)[:, :vocab].bool()
    return {seq.seq_id: allowed[j] for j, seq in enumerate(seqs)}


def mask_logits(seqs: list[Sequence], logits: torch.Tensor, masks: Masks | None = None) -> None:
    """Set the logits of every token a guided row's matcher forbids to -inf, in place, for all
    of the step's guided rows at once. logits: [N, V] on the CPU, row i of seqs[i]. `masks`:
    those filled while the step computed (start_masks); a row without one is filled now."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return
    vocab = logits.shape[-1]
    masks = {k: m for k, m in (masks or {}).items() if m.shape[-1] == vocab}
    missing = [seqs[i] for i in rows if seqs[i].seq_id not in masks]
    if missing:
        masks.update(allowed_tokens(missing, vocab))
    allowed = torch.stack([masks[seqs[i].seq_id] for i in rows])
    index = torch.tensor(rows)
    guided = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, guided)
