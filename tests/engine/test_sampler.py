import math

import pytest
import torch

from python_backends.engine.sampler import HeadOutput, argmax_only, process_logits, sample
from python_backends.engine.sequence import Sequence
from python_backends.params import SamplingParams


def seq(params: SamplingParams, prompt: list[int] | None = None,
        output: list[int] | None = None) -> Sequence:
    s = Sequence("s", prompt or [1, 2], params)
    s.output_ids = list(output or [])
    return s


def test_greedy_batch_and_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    seqs = [seq(SamplingParams(max_tokens=4, return_log_probs=True)) for _ in range(2)]
    r = sample(seqs, HeadOutput(logits=logits))
    assert r.token_ids == [1, 0]
    assert r.logprobs is not None
    assert math.isclose(r.logprobs[0], float(torch.log_softmax(logits[0], -1)[1]), rel_tol=1e-6)


def test_greedy_batch_picks_argmax_first_index_on_ties() -> None:
    """The batched greedy pick is torch.argmax's (Hugging Face's): first index among equal
    maxima, NaN and infinities as argmax ranks them."""
    logits = torch.randint(0, 4, (16, 1000)).float()
    logits[2, 10] = float("nan")
    logits[3, 5] = logits[3, 7] = float("inf")
    seqs = [seq(SamplingParams(max_tokens=4)) for _ in range(16)]
    assert sample(seqs, HeadOutput(logits=logits)).token_ids == logits.argmax(-1).tolist()


def test_tokens_the_model_chose_are_taken_as_they_are() -> None:
    seqs = [seq(SamplingParams(max_tokens=4)) for _ in range(3)]
    r = sample(seqs, HeadOutput(token_ids=torch.tensor([7, 0, 49151])))
    assert r.token_ids == [7, 0, 49151] and r.logprobs is None


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=4, return_log_probs=True),
    SamplingParams(max_tokens=4, temperature=0.7),
    SamplingParams(max_tokens=4, repetition_penalty=1.2),
])
def test_rows_that_need_logits_are_not_argmax_only(params: SamplingParams) -> None:
    assert argmax_only(SamplingParams(max_tokens=4))
    assert not argmax_only(params)
    with pytest.raises(ValueError, match="need their logits"):
        sample([seq(SamplingParams(max_tokens=4)), seq(params)],
               HeadOutput(token_ids=torch.tensor([1, 2])))


def test_top_k_one_is_greedy_even_with_temperature() -> None:
    logits = torch.randn(4, 50)
    seqs = [seq(SamplingParams(max_tokens=4, temperature=1.5, top_k=1)) for _ in range(4)]
    assert sample(seqs, HeadOutput(logits=logits)).token_ids == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_top_p_restricts() -> None:
    logits = torch.randn(1, 100)
    p = SamplingParams(max_tokens=4, temperature=1.0, seed=123)
    s1, s2 = seq(p), seq(p)
    draws1 = [sample([s1], HeadOutput(logits=logits)).token_ids[0] for _ in range(20)]
    draws2 = [sample([s2], HeadOutput(logits=logits)).token_ids[0] for _ in range(20)]
    assert draws1 == draws2 and len(set(draws1)) > 1
    tiny_p = seq(SamplingParams(max_tokens=4, temperature=1.0, top_p=1e-6, seed=1))
    draws = {sample([tiny_p], HeadOutput(logits=logits)).token_ids[0] for _ in range(10)}
    assert draws == {int(logits.argmax())}
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    k3 = seq(SamplingParams(max_tokens=4, temperature=2.0, top_k=3, seed=2))
    assert {sample([k3], HeadOutput(logits=logits)).token_ids[0] for _ in range(30)} <= top3


def test_penalties() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = process_logits(seq(SamplingParams(max_tokens=4, repetition_penalty=2.0), [0, 1]),
                         logits.clone())
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    pf = SamplingParams(max_tokens=4, presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(seq(pf, [3], [2, 2]), logits.clone())
    assert out.tolist() == [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5]


def test_bans_bad_words_and_end_id_before_min_tokens() -> None:
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0])
    p = SamplingParams(max_tokens=4, end_ids=(0,), min_tokens=2, bad_sequences=((9, 1), (2,)))
    s = seq(p, [7, 9])
    out = process_logits(s, logits.clone())
    assert out[0] == float("-inf") and out[1] == float("-inf") and out[2] == float("-inf")
    assert sample([s], HeadOutput(logits=logits.unsqueeze(0))).token_ids == [3]
    s.output_ids = [3, 3]
    out = process_logits(s, logits.clone())
    assert out[0] == 5.0  # min_tokens reached: the end id is allowed again


def test_logit_bias_moves_the_greedy_choice_and_bans() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    forced = seq(SamplingParams(max_tokens=4, logit_bias=((3, 100.0),)))
    assert sample([forced], HeadOutput(logits=logits)).token_ids == [3]
    banned = seq(SamplingParams(max_tokens=4, logit_bias=((0, -100.0), (1, -100.0))))
    assert sample([banned], HeadOutput(logits=logits)).token_ids == [2]
    assert not argmax_only(banned.params)


def test_min_p_drops_tokens_below_its_share_of_the_likeliest() -> None:
    # probabilities ~ 0.64, 0.24, 0.09, 0.03: min_p 0.2 keeps tokens 0 and 1 only
    logits = torch.tensor([[3.0, 2.0, 1.0, -0.2]])
    p = seq(SamplingParams(max_tokens=4, temperature=1.0, min_p=0.2, seed=5))
    draws = {sample([p], HeadOutput(logits=logits)).token_ids[0] for _ in range(60)}
    assert draws == {0, 1}


def test_top_alternatives_come_with_the_sampled_tokens_distribution() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [2.0, 0.0, 1.0, -1.0]])
    top2 = SamplingParams(max_tokens=4, return_log_probs=True, top_log_probs=2)
    plain = SamplingParams(max_tokens=4, return_log_probs=True)
    r = sample([seq(top2), seq(plain)], HeadOutput(logits=logits))  # the batched greedy path
    assert r.top is not None and r.top[1] == ()
    lp = torch.log_softmax(logits[0], -1)
    assert [t for t, _ in r.top[0]] == [1, 3]
    assert [v for _, v in r.top[0]] == pytest.approx([float(lp[1]), float(lp[3])])
    assert r.top[0][0][1] == pytest.approx(r.logprobs[0])  # type: ignore[index]
    hot = SamplingParams(max_tokens=4, temperature=2.0, seed=1, top_log_probs=3,
                         return_log_probs=True)
    r = sample([seq(hot)], HeadOutput(logits=logits[:1]))  # the row path: temperature 2
    assert r.top is not None
    tempered = torch.log_softmax(logits[0] / 2.0, -1)
    assert [t for t, _ in r.top[0]] == [1, 3, 2]
    assert [v for _, v in r.top[0]] == pytest.approx(tempered[[1, 3, 2]].tolist())
    assert sample([seq(plain)], HeadOutput(logits=logits[:1])).top is None
