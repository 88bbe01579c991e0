"""Mixture-of-experts feed-forward: top-k router, dropless grouped SwiGLU experts, router losses."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe_experts import grouped_swiglu, swiglu_every_expert
from training.model.config import ModelConfig

# A generation step with few tokens may compute every expert for every token instead of dispatching:
# that skips the sort / gather / per-expert loop / index_add, at the price of n_experts / top_k times
# the expert FLOPs. Measured on the CPU (GenerationEngine with and without it, batch 8): "tiny" (4 experts,
# top-2, 8 x 4 = 32 rows) decodes 1.18x faster this way, "small" (8 experts, top-2) 0.83x as fast, so
# it is used only up to twice the routed FLOPs and 64 (token, expert) rows. Only in generation (no
# autograd, no router losses) and for fp32/bf16; training always dispatches.
DENSE_DECODE_MAX_ROWS = 64
DENSE_DECODE_MAX_FLOPS_FACTOR = 2


@dataclass
class RouterOutput:
    """What one MoE layer decided and what it costs the training objective."""

    expert_indices: torch.Tensor
    """int64 [N, top_k]: experts each token was sent to (replayable via routing_override)."""

    load_balancing_loss: torch.Tensor
    """Scalar: n_experts * sum_e (fraction of assignments to e) * (mean router probability of e)."""

    router_z_loss: torch.Tensor
    """Scalar: mean squared log-sum-exp of the router logits (keeps logits small)."""


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts with dropless dispatch (no capacity factor, no dropped tokens).

    The router scores experts by softmax, or by sigmoid with an optional choice-only bias and
    group-limited top-k (DeepSeek-V3); optional shared experts run on every token beside the routed ones.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d_model, d_ff, n_experts = config.d_model, config.d_ff_expert, config.n_experts
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.w_up = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.register_buffer(
            "expert_boundaries", torch.empty(n_experts + 1, dtype=torch.long), persistent=False
        )
        # persistent: a checkpoint carries it (DeepSeek's e_score_correction_bias)
        self.register_buffer("score_bias", torch.zeros(n_experts) if config.router_score_bias else None)
        self.shared_experts = (
            DenseFeedForward(config, width=config.n_shared_experts * d_ff) if config.n_shared_experts else None
        )
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Fill the non-persistent buffers (also after materialising from the meta device)."""
        if self.expert_boundaries.device.type != "meta":
            self.expert_boundaries.copy_(torch.arange(self.config.n_experts + 1))

    def reset_parameters(self, *, std: float, output_std: float) -> None:
        nn.init.normal_(self.router.weight, std=std)
        nn.init.normal_(self.w_gate, std=std)
        nn.init.normal_(self.w_up, std=std)
        nn.init.normal_(self.w_down, std=output_std)
        if self.score_bias is not None:
            nn.init.zeros_(self.score_bias)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(std=std, output_std=output_std)

    def route(
        self, router_logits: torch.Tensor, routing_override: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """route_tokens with this layer's config and score bias."""
        return route_tokens(self.config, router_logits, routing_override, score_bias=self.score_bias)

    def forward(
        self, x: torch.Tensor, *, routing_override: torch.Tensor | None = None, compute_losses: bool = True
    ) -> tuple[torch.Tensor, RouterOutput]:
        """x: [N, d_model]; routing_override: int [N, top_k] expert ids to use instead of the router's.

        compute_losses=False (generation) skips the router losses, which are then returned as zeros.
        """
        n_tokens = x.shape[0]
        n_experts, top_k = self.config.n_experts, self.config.top_k
        router_logits = self.router(x).float()
        weights, expert_indices, router_probs = self.route(router_logits, routing_override)
        shared = 0 if self.shared_experts is None else self.shared_experts(x)

        if not compute_losses and not torch.is_grad_enabled() and all_experts_pays(self.config, n_tokens):
            zero = router_logits.new_zeros(())
            return self._all_experts(x, weights, expert_indices) + shared, RouterOutput(expert_indices, zero, zero)

        sorted_experts, order = expert_indices.reshape(-1).sort(stable=True)
        source_tokens = order // top_k
        offsets = torch.searchsorted(sorted_experts, self.expert_boundaries, out_int32=True)
        expert_out = grouped_swiglu(
            x[source_tokens], offsets, self.w_gate, self.w_up, self.w_down, precision=self.config.precision
        )
        gated = expert_out * weights.reshape(-1)[order].unsqueeze(-1).to(expert_out.dtype)
        out = torch.zeros_like(x).index_add_(0, source_tokens, gated.to(x.dtype)) + shared

        if not compute_losses:
            zero = router_logits.new_zeros(())
            return out, RouterOutput(expert_indices, zero, zero)
        tokens_per_expert = offsets.diff()
        assignment_fraction = tokens_per_expert.float() / max(n_tokens * top_k, 1)
        mean_probability = router_probs.mean(dim=0) if n_tokens else router_probs.new_zeros(n_experts)
        load_balancing_loss = n_experts * (assignment_fraction * mean_probability).sum()
        router_z_loss = (
            torch.logsumexp(router_logits, dim=-1).square().mean()
            if n_tokens
            else router_logits.new_zeros(())
        )
        return out, RouterOutput(expert_indices, load_balancing_loss, router_z_loss)

    def _all_experts(self, x: torch.Tensor, weights: torch.Tensor, expert_indices: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, combined with the top-k weights (zero for unrouted experts)."""
        expert_out = swiglu_every_expert(x, self.w_gate, self.w_up, self.w_down, precision=self.config.precision)
        dense_weights = torch.zeros(x.shape[0], self.config.n_experts, dtype=x.dtype, device=x.device)
        dense_weights.scatter_(1, expert_indices, weights.to(x.dtype))
        return (expert_out * dense_weights.t().unsqueeze(-1)).sum(dim=0)


def route_tokens(
    config: ModelConfig, router_logits: torch.Tensor, routing_override: torch.Tensor | None,
    *, score_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate weights [N, top_k], expert ids [N, top_k], per-token expert probabilities [N, n_experts] for the
    load-balancing loss) from fp32 router logits; routing_override replaces the choice, not the weights."""
    if config.router_score == "softmax":
        scores = probabilities = router_logits.softmax(dim=-1)
    else:
        scores = router_logits.sigmoid()
        probabilities = scores / scores.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    if routing_override is None:
        choice = scores if score_bias is None else scores + score_bias.float()
        if config.n_expert_groups > 1:
            choice = limit_to_groups(choice, config.n_expert_groups, config.top_k_groups)
        expert_indices = choice.topk(config.top_k, dim=-1).indices
    else:
        if routing_override.shape != (router_logits.shape[0], config.top_k):
            raise ValueError(
                f"routing_override for this layer has shape {tuple(routing_override.shape)}, "
                f"expected ({router_logits.shape[0]}, {config.top_k}) = (tokens, top_k)."
            )
        expert_indices = routing_override.to(device=router_logits.device, dtype=torch.long)
        if expert_indices.numel() and (expert_indices.min() < 0 or expert_indices.max() >= config.n_experts):
            raise ValueError(f"routing_override holds expert ids outside [0, {config.n_experts}).")
    weights = scores.gather(1, expert_indices)
    if config.normalize_top_k_weights:
        total = weights.sum(dim=-1, keepdim=True)
        if config.router_score == "sigmoid":
            total = total + 1e-20  # as DeepSeek-V3's router
        elif routing_override is not None:
            # replayed experts may all have underflowed probabilities; router picks never do
            total = total.clamp_min(torch.finfo(total.dtype).tiny)
        weights = weights / total
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights, expert_indices, probabilities


def limit_to_groups(choice: torch.Tensor, n_groups: int, top_groups: int) -> torch.Tensor:
    """Scores [N, n_experts] with every expert outside each token's top_groups groups (ranked by the sum
    of their two best scores) set to -inf, as DeepSeek-V3's group-limited routing."""
    grouped = choice.view(choice.shape[0], n_groups, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, group_scores.topk(top_groups, dim=-1).indices, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(choice)


def all_experts_possible(config: ModelConfig) -> bool:
    """Whether this model's MoE layers ever compute every expert (its FLOPs are within the bound)."""
    return (
        config.precision in ("fp32", "bf16")
        and config.n_experts <= DENSE_DECODE_MAX_FLOPS_FACTOR * config.top_k
    )


def all_experts_pays(config: ModelConfig, n_tokens: int) -> bool:
    """Whether computing every expert for these tokens beats dispatching them (see DENSE_DECODE_*).

    Callers must also be outside autograd and not need router losses; reads the bounds at call time so a
    benchmark can move them.
    """
    return all_experts_possible(config) and 0 < n_tokens * config.n_experts <= DENSE_DECODE_MAX_ROWS


class DenseFeedForward(nn.Module):
    """One SwiGLU MLP: the dense baseline with the same active parameters as an MoE layer, a dense layer of
    an MoE model (first_dense_layers), or an MoE layer's shared experts (`width` given)."""

    def __init__(self, config: ModelConfig, *, width: int | None = None) -> None:
        super().__init__()
        width = width or config.d_ff_dense
        self.w_gate = nn.Linear(config.d_model, width, bias=False)
        self.w_up = nn.Linear(config.d_model, width, bias=False)
        self.w_down = nn.Linear(width, config.d_model, bias=False)

    def reset_parameters(self, *, std: float, output_std: float) -> None:
        nn.init.normal_(self.w_gate.weight, std=std)
        nn.init.normal_(self.w_up.weight, std=std)
        nn.init.normal_(self.w_down.weight, std=output_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


def output_init_std(config: ModelConfig) -> float:
    """Residual-branch output projections shrink with depth so the residual stream stays O(1)."""
    return config.init_std / math.sqrt(2 * config.n_layers)
