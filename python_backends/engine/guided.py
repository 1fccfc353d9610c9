"""Structured outputs in the engine: a grammar matcher per guided sequence (llguidance, over the
engine's own tokenizer) and one token bitmask per step for the batch's guided rows.

A sequence's matcher is made when it joins the engine, after the tokens it already has (a
prefill instance's first token, or a migrated request's tokens so far) are fed to it, so a
guided request continues in its language wherever it resumes. The sampler masks the guided rows
of a step's logits at once (`mask_logits`), with masks filled on a worker thread while the
step's forward pass computes (`start_masks`); every token appended is fed to the matcher
(Scheduler._append), and a matcher that reaches the end of its language ends the sequence.
Unguided rows pay nothing. A guided row's speculative draft is cut to what its guide allows
(`grammar_draft`), and each draft position is masked by the matcher's state after the draft
tokens before it, so a draft is confirmed exactly where guided decoding would choose it.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
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


# A mask is filled on this thread while the forward pass computes (llguidance computes it with
# the GIL released); one thread: the engine's own forward pass keeps the other cores busy.
_FILLER = ThreadPoolExecutor(1, thread_name_prefix="guide-masks")
# (seq_id, k) -> the tokens a sequence's matcher allows at its k-th sampled row of a step (k > 0:
# after its draft's first k tokens), bool [V]
Masks = dict[tuple[str, int], torch.Tensor]


def start_masks(sampled: list[tuple[Sequence, tuple[int, ...]]],
                vocab: int) -> Future[Masks] | None:
    """Begin filling the token masks of the guided ones of a step's sampled sequences (each
    with its draft): each matcher's state is final until the step's tokens are fed to it,
    after sampling."""
    rows = [(seq, draft) for seq, draft in sampled if seq.matcher is not None]
    return _FILLER.submit(allowed_tokens, rows, vocab) if rows else None


def allowed_tokens(rows: list[tuple[Sequence, tuple[int, ...]]], vocab: int) -> Masks:
    """The tokens each sequence's matcher allows next, and after each token of its draft (the
    matcher is walked through the draft and rolled back): one bitmask for all, unpacked.
    (llguidance's numpy helpers fill it; its torch ones would torch.compile the unpacking,
    which needs a compiler toolchain and a UTF-8 locale the Triton stub does not have.)"""
    import llguidance.numpy as lln

    keys = [(seq.seq_id, k) for seq, draft in rows for k in range(len(draft) + 1)]
    bitmask = lln.allocate_token_bitmask(len(keys), vocab)
    j = 0
    for seq, draft in rows:
        matcher = seq.matcher
        for k in range(len(draft) + 1):
            lln.fill_next_token_bitmask(matcher, bitmask, j)
            j += 1
            if k < len(draft) and not matcher.consume_token(draft[k]):
                raise ValueError(f"{seq.seq_id}: its draft leaves the guide's language")
        if draft:
            matcher.rollback(len(draft))
    words = torch.from_numpy(bitmask)  # [R, W]: bit b of word w allows token 32 w + b
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(len(keys), -1)[:, :vocab].bool()
    return {key: allowed[j] for j, key in enumerate(keys)}


def grammar_draft(seq: Sequence, draft: tuple[int, ...]) -> tuple[int, ...]:
    """The longest start of a guided sequence's draft that its guide allows (the rest could
    never be confirmed: the model's choices there are masked to the guide)."""
    if seq.matcher is None or not draft:
        return draft
    return draft[:seq.matcher.validate_tokens(list(draft))]


def mask_logits(seqs: list[Sequence], logits: torch.Tensor, masks: Masks | None = None) -> None:
    """Set the logits of every token a guided row's matcher forbids to -inf, in place, for all
    of the step's guided rows at once. logits: [N, V] on the CPU, row i of seqs[i] (a sequence
    with a draft has a row per draft position, in order). `masks`: those filled while the step
    computed (start_masks); a sequence's first row without one is filled now."""
    keys: dict[int, tuple[str, int]] = {}
    for i, s in enumerate(seqs):
        if s.matcher is not None:
            k = keys[i - 1][1] + 1 if i and seqs[i - 1] is s else 0
            keys[i] = (s.seq_id, k)
    if not keys:
        return
    vocab = logits.shape[-1]
    masks = {k: m for k, m in (masks or {}).items() if m.shape[-1] == vocab}
    missing: list[tuple[Sequence, tuple[int, ...]]] = [
        (seqs[i], ()) for i, key in keys.items() if key not in masks and key[1] == 0]
    if missing:
        masks.update(allowed_tokens(missing, vocab))
    if any(key not in masks for key in keys.values()):
        raise ValueError("mask_logits: a guided draft row has no mask (start_masks fills them)")
    rows = list(keys)
    allowed = torch.stack([masks[keys[i]] for i in rows])
    index = torch.tensor(rows)
    guided = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, guided)
