"""Expert dispatch for the fused inference forward's decode steps: the same function as MoEFeedForward with
far fewer operators, for a few tokens on the CPU.

At a decode step of batch 8 with top-2 routing each expert gets 0-4 rows, so MoEFeedForward's dispatch
(sort, searchsorted, a gather, three ``torch._grouped_mm`` calls that each loop over the experts in C++,
index_add) spends more time in small operators and in reading the expert weights than in arithmetic.
Here the (token, expert) assignments are read back once (one 2 x top_k x tokens list: free on the CPU),
sorted in Python, and each routed expert runs as plain matmuls written straight into shared buffers
(``out=``), with no validation, config objects or dtype casts per call. The experts' outputs come back in
(token, choice) order, so the weighted sum over a token's experts is one multiply and one sum.

Numerics equal MoEFeedForward's for softmax routing without score bias: the same router product, the
same top-k weights (topk of the softmax, renormalised as ``route_tokens`` does), the same expert matmuls
(``x @ w_gate[e]``, ``x @ w_up[e]``, ``silu(gate) * up @ w_down[e]`` per expert), then the weighted
sum, whose two terms for top-2 are added in either order with the same result. Only fp32 models with fp32
expert weights on the CPU take it (bf16 and MXFP8 keep the model's own layer, which casts or quantizes the
weights; on a GPU the routing read-back would be a synchronisation per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu_small_mm import small_mm
from training.model.config import ModelConfig
from training.model.moe import MoEFeedForward, route_tokens

DISPATCH_MAX_TOKENS = 64
"""Most tokens dispatched here (decode steps and short prefills); more go through MoEFeedForward, whose
grouped matmuls do better once every expert has many rows."""


@dataclass
class ExpertViews:
    """Per-expert views of one MoE layer's weights (no copies), taken once per weight version."""

    router: torch.Tensor
    """[d_model, n_experts]: the router's weight transposed (a view, as F.linear uses it)."""
    gate: tuple[torch.Tensor, ...]
    """Per expert [d_model, d_ff]."""
    up: tuple[torch.Tensor, ...]
    down: tuple[torch.Tensor, ...]
    """Per expert [d_ff, d_model]."""


def expert_views(feed_forward: MoEFeedForward) -> ExpertViews | None:
    """Views for fused_experts, or None when the layer must run itself: not fp32, not on the CPU (reading
    the routing back would wait for a GPU at every layer), or sigmoid scores, score bias, groups, shared
    experts or scaled weights (options fused_experts does not compute)."""
    config = feed_forward.config
    plain = (
        config.precision == "fp32"
        and feed_forward.w_gate.dtype == torch.float32
        and feed_forward.w_gate.device.type == "cpu"
        and config.router_score == "softmax"
        and feed_forward.score_bias is None
        and config.n_expert_groups == 1
        and feed_forward.shared_experts is None
        and config.routed_scaling_factor == 1.0
    )
    if not plain:
        return None
    return ExpertViews(
        router=feed_forward.router.weight.t(),
        gate=tuple(feed_forward.w_gate.unbind(0)),
        up=tuple(feed_forward.w_up.unbind(0)),
        down=tuple(feed_forward.w_down.unbind(0)),
    )


def fused_experts(
    x: torch.Tensor, views: ExpertViews, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over each token's top_k experts of weight * expert(x) [N, d_model], expert ids int64 [N, top_k])
    for normalized inputs x [N, d_model] (the feed-forward norm applied); routed by ``route_tokens``."""
    n_tokens, top_k = x.shape[0], config.top_k
    weights, expert_indices, _ = route_tokens(config, torch.mm(x, views.router).float(), None)
    choices = expert_indices.view(-1).tolist()
    # assignments sorted by expert (stable, as MoEFeedForward's sort), and where each one lands in that order
    order = sorted(range(len(choices)), key=choices.__getitem__)
    inverse = [0] * len(order)
    for position, assignment in enumerate(order):
        inverse[assignment] = position
    indices = torch.tensor([assignment // top_k for assignment in order] + inverse, device=x.device)
    rows = x.index_select(0, indices[: len(order)])
    d_ff = views.gate[0].shape[1]
    gate, up = x.new_empty(len(order), d_ff), x.new_empty(len(order), d_ff)
    bounds = _expert_bounds(choices, len(views.gate))
    for expert, start, end in bounds:
        piece = rows[start:end]
        small_mm(piece, views.gate[expert], gate[start:end])
        small_mm(piece, views.up[expert], up[start:end])
    hidden = F.silu(gate).mul_(up)
    down = x.new_empty(len(order), x.shape[1])
    for expert, start, end in bounds:
        small_mm(hidden[start:end], views.down[expert], down[start:end])
    per_choice = down.index_select(0, indices[len(order) :]).view(n_tokens, top_k, -1)
    return (per_choice * weights.unsqueeze(-1).to(per_choice.dtype)).sum(dim=1), expert_indices


def _expert_bounds(choices: list[int], n_experts: int) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows, in the expert-sorted order."""
    counts = [0] * n_experts
    for expert in choices:
        counts[expert] += 1
    bounds, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            bounds.append((expert, start, start + count))
            start += count
    return bounds

