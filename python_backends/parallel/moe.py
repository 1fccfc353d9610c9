"""Mixture-of-experts MLP (Mixtral-style) with the experts placed across expert-parallel ranks.

Router (float32), as Hugging Face computes it: softmax over all experts, top-k, the weights
renormalized to sum to 1 where the family does (`ModelConfig.norm_topk_prob`: Mixtral always,
Qwen3-MoE as its config says); or DeepSeek-V3's: sigmoid scores, the choice made on the scores
plus a per-expert bias among the experts of the best `topk_group` of `n_group` groups (a
group's score: its two best), the weights the chosen unbiased scores, renormalized, times
`routed_scaling_factor`. DeepSeek's shared experts (one MLP) add to every token's output.

Each rank holds experts [ep_rank * E/ep, (ep_rank + 1) * E/ep).
The stage's ranks all see the whole step (attention is replicated or tensor-parallel before this
layer), so each takes its own contiguous share of the tokens, and then:

1. dispatch: every (token, chosen expert) pair goes to the rank holding that expert, one
   all-to-all (counts first, then the rows);
2. the rank runs each of its experts on the rows it received;
3. combine: results go back to the token's rank by the reverse all-to-all, are weighted and
   summed (in expert order, as Hugging Face adds them);
4. the ranks' token shares are all-gathered so every rank again holds the whole step.

With ep = 1 the same code runs locally without communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from python_backends.config import ModelConfig
from python_backends.parallel.context import ParallelContext


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.num_local = cfg.num_experts // ctx.ep_size
        self.first_expert = ctx.ep_rank * self.num_local
        self.gate = Router(cfg)
        self.experts = Experts(self.num_local, cfg.hidden_size, cfg.expert_intermediate_size)
        # Shared experts, built by the decoder (an MLP of its own kind; None: none).
        self.shared_experts: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        weights, chosen = self.gate.choose(x, self.top_k, self.renormalize)  # [T, k]
        weights = weights.to(x.dtype)
        sizes = [len(part) for part in torch.arange(len(x)).tensor_split(ctx.ep_size)]
        start = sum(sizes[: ctx.ep_rank])
        mine = slice(start, start + sizes[ctx.ep_rank])
        out = self._route(x[mine], chosen[mine], weights[mine])
        if ctx.ep_size > 1:
            out = ctx.all_gather_rows(out, sizes)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _route(self, x: torch.Tensor, chosen: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
        """Outputs of the tokens `x` [t, E] this rank is responsible for."""
        ctx = self.ctx
        t = len(x)
        experts = chosen.reshape(-1)  # [t * k], token-major
        tokens = torch.arange(t, device=x.device).repeat_interleave(self.top_k)
        owner = experts // self.num_local
        order = torch.argsort(owner, stable=True)  # grouped by destination rank
        experts, tokens = experts[order], tokens[order]
        rows = x[tokens]
        if ctx.ep_size > 1:
            send = torch.bincount(owner, minlength=ctx.ep_size)
            recv = ctx.exchange_counts(send)
            send_counts, recv_counts = send.tolist(), recv.tolist()
            rows_in = ctx.all_to_all(rows, send_counts, recv_counts)
            experts_in = ctx.all_to_all(experts, send_counts, recv_counts)
            y = self.experts(rows_in, experts_in - self.first_expert)
            y = ctx.all_to_all(y, recv_counts, send_counts)  # back, in `order`
        else:
            y = self.experts(rows, experts)
        y = y * weights.reshape(-1)[order].unsqueeze(-1)
        by_expert = torch.argsort(experts, stable=True)
        out = torch.zeros_like(x)
        out.index_add_(0, tokens[by_expert], y[by_expert])
        return out


class Router(nn.Module):
    """The router's weight [E, H] (Hugging Face's `mlp.gate.weight`) and, for sigmoid routing,
    the per-expert selection bias (`mlp.gate.e_score_correction_bias`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.sigmoid = cfg.router_scoring == "sigmoid"
        self.e_score_correction_bias: torch.Tensor | None
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(cfg.num_experts) if self.sigmoid else None)
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.scaling = cfg.routed_scaling_factor

    def choose(self, x: torch.Tensor, k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, experts [T, k]) of each token."""
        logits = F.linear(x.float(), self.weight.float())
        if not self.sigmoid:
            weights, chosen = torch.topk(F.softmax(logits, dim=-1), k, dim=-1)
            if renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights * self.scaling, chosen
        scores = logits.sigmoid()
        biased = scores + self.e_score_correction_bias if (
            self.e_score_correction_bias is not None) else scores
        if self.n_group > 1:
            t, e = biased.shape
            grouped = biased.view(t, self.n_group, e // self.n_group)
            best = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
            groups = best.topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(best).scatter_(1, groups, 1).bool()
            biased = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
        chosen = torch.topk(biased, k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen


class Experts(nn.Module):
    """This rank's experts, stored as Hugging Face's Mixtral and Qwen3-MoE store all of them:
    gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""

    def __init__(self, num: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num, hidden_size, intermediate_size))

    def forward(self, rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        """rows [n, H], each for expert `local_expert[i]` (an index into this rank's experts)."""
        out = torch.empty_like(rows)
        for e in torch.unique(local_expert).tolist():
            idx = (local_expert == e).nonzero().squeeze(1)
            gate, up = F.linear(rows[idx], self.gate_up_proj[e]).chunk(2, dim=-1)
            out[idx] = F.linear(F.silu(gate) * up, self.down_proj[e])
        return out
