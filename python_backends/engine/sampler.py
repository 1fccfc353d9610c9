"""Token selection: penalties, biases and bans, then greedy or temperature/top-k/min-p/top-p
sampling.

Log-probabilities are those of the distribution the token was drawn from (after penalties and
temperature, before top-k/top-p truncation), as the TensorRT-LLM backend reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from python_backends.engine.guided import Masks, mask_logits
from python_backends.engine.sequence import Sequence, Top
from python_backends.params import SamplingParams


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # one per token; None when no sequence asked for them
    # one per token (empty where its sequence asked for none); None when none asked
    top: list[Top] | None = None


@dataclass(frozen=True)
class HeadOutput:
    """The LM head's output for a step's sampled rows, in order: their logits [N, V] float32,
    or, when every row needs only its argmax (AttentionMetadata.argmax_only), the token ids [N]
    the model chose itself (models.greedy_head)."""

    logits: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None

    @classmethod
    def of(cls, out: torch.Tensor) -> HeadOutput:
        """The model's forward output: token ids where it chose them (int64), else logits."""
        return cls(token_ids=out) if out.dtype == torch.long else cls(logits=out)


def argmax_only(p: SamplingParams) -> bool:
    """Whether a row of `p` needs only its logits' argmax (so the model may screen them)."""
    return (p.greedy and not p.needs_logits_processing and not p.return_log_probs
            and not p.guided)


def sample(seqs: list[Sequence], head: HeadOutput, masks: Masks | None = None) -> SampleResult:
    """Pick the next token of each sequence (one row of `head` per sequence). `masks`: the
    guided rows' token masks, filled while the step computed (guided.start_masks)."""
    if head.token_ids is not None:
        if not all(argmax_only(s.params) for s in seqs):
            raise ValueError("sample: tokens given for rows that need their logits")
        return SampleResult(head.token_ids.tolist(), None)
    logits = head.logits
    assert logits is not None
    if any(s.matcher is not None for s in seqs):  # guided rows: their grammar's tokens only
        logits = logits.cpu().clone()  # the head's own output is left as it was
        mask_logits(seqs, logits, masks)
    if all(s.params.greedy and not s.params.needs_logits_processing for s in seqs):
        # max's indices, not argmax: the same first index of the largest value (NaN first), in
        # a fraction of argmax's time on the CPU.
        tokens = logits.max(dim=-1).indices
        logprobs, top = None, None
        if any(s.params.return_log_probs for s in seqs):
            all_logprobs = torch.log_softmax(logits, dim=-1)
            logprobs = all_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
            if any(s.params.top_log_probs for s in seqs):
                top = _top(all_logprobs, [s.params.top_log_probs for s in seqs])
        return SampleResult(tokens.tolist(), logprobs, top)
    token_ids: list[int] = []
    logprobs_out: list[float] = []
    top_out: list[Top] = []
    logits = logits.cpu()  # row by row from here, with each sequence's (CPU) generator
    for i, seq in enumerate(seqs):
        token, row_logprobs = _sample_one(seq, logits[i])
        token_ids.append(token)
        logprobs_out.append(float(row_logprobs[token]))
        if seq.params.top_log_probs:
            top_out += _top(row_logprobs.unsqueeze(0), [seq.params.top_log_probs])
        else:
            top_out.append(())
    wanted = any(s.params.top_log_probs for s in seqs)
    return SampleResult(token_ids, logprobs_out, top_out if wanted else None)


def _top(logprobs: torch.Tensor, counts: list[int]) -> list[Top]:
    """Each row's `counts[i]` likeliest tokens and their log-probabilities. logprobs: [N, V]."""
    values, ids = logprobs.topk(max(counts), dim=-1)
    return [tuple(zip(ids[i, :k].tolist(), values[i, :k].tolist(), strict=True))
            for i, k in enumerate(counts)]


def _sample_one(seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The token, and the log-probabilities of the distribution it was drawn from."""
    p = seq.params
    if p.needs_logits_processing:
        logits = process_logits(seq, logits.clone())
    if p.greedy:
        return int(logits.argmax()), torch.log_softmax(logits, dim=-1)
    logits = logits / p.temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    probs = _truncated_probs(logits, p)
    return int(torch.multinomial(probs, 1, generator=seq.generator)), logprobs


def process_logits(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """Apply penalties and bans to one row in place. logits: [V]."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids())), dtype=torch.long)
        scores = logits[seen]
        logits[seen] = torch.where(
            scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty
        )
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and seq.output_ids:
        counts = torch.bincount(
            torch.tensor(seq.output_ids, dtype=torch.long), minlength=logits.shape[0]
        ).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.logit_bias:
        ids, biases = zip(*p.logit_bias, strict=True)
        logits[torch.tensor(ids, dtype=torch.long)] += torch.tensor(biases, dtype=logits.dtype)
    banned = _banned_tokens(seq, p)
    if banned:
        logits[torch.tensor(banned, dtype=torch.long)] = float("-inf")
    return logits


def _banned_tokens(seq: Sequence, p: SamplingParams) -> list[int]:
    banned: list[int] = []
    if seq.num_output_tokens < p.min_tokens:
        banned.extend(p.end_ids)
    if p.bad_sequences:
        ids = seq.token_ids()
        for bad in p.bad_sequences:
            prefix = list(bad[:-1])
            if not prefix or ids[len(ids) - len(prefix) :] == prefix:
                banned.append(bad[-1])
    return banned


def _truncated_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.top_k > 0 and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        probs /= probs.sum()
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        drop = cumulative - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs /= probs.sum()
    return probs
