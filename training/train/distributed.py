"""torch.distributed helpers: process-group setup, data parallel, and expert parallel MoE layers.

Data parallel (DP): every rank holds the full model, takes a disjoint slice of the global batch,
and DistributedDataParallel averages gradients. Expert parallel (EP, over the same ranks as DP):
each rank holds n_experts / world_size experts of every MoE layer; after routing, tokens travel to
the rank owning their expert with an all-to-all, are processed there, and travel back with a
second all-to-all. Router, attention and embeddings stay replicated and DDP-synchronised; expert
weights are excluded from DDP because each exists on one rank only and already receives the
gradient of every rank's tokens through the all-to-all's backward.

Launch: `torchrun --nproc-per-node 2 manage.py pretrain ... [--expert-parallel]` (env:// rendezvous,
gloo; the loops run on the CPU). Unlike Megatron/DeepSpeed-MoE there is no capacity factor (dropless),
no separate EP group smaller than DP, and no overlap of communication with compute.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kernels.moe_experts import grouped_swiglu
from training.model.moe import MoEFeedForward, RouterOutput, route_tokens


@dataclass
class DistributedContext:
    """Where this process sits in the job."""

    rank: int = 0
    """Index of this process (0 when not distributed)."""

    world_size: int = 1
    """Number of processes (1 when not distributed)."""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(*, backend: str | None = None) -> DistributedContext:
    """Join the process group described by torchrun's env vars (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    Without WORLD_SIZE (or with WORLD_SIZE=1) the run is single-process and nothing is initialised.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistributedContext()
    rank = int(os.environ["RANK"])
    if not dist.is_initialized():
        # The training loops keep tensors on the CPU, which only gloo can reduce.
        dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size)
    return DistributedContext(rank=rank, world_size=world_size)


def shutdown_distributed(context: DistributedContext, *, wait_for_peers: bool) -> None:
    """Leave the process group; wait_for_peers=True (after a successful run) first meets every rank.

    Rank 0 hosts the rendezvous store, so leaving before the others finish (e.g. while rank 0 still
    writes the final checkpoint) tears gloo down under them. After a failure there is no barrier:
    the other ranks may be blocked in a collective, and torchrun stops them when this rank exits.
    """
    if context.enabled and dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(value: float, context: DistributedContext) -> float:
    if not context.enabled:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return float(tensor.item())


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward sends gradients back along the reversed splits."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        ctx.output_splits, ctx.input_splits = output_splits, input_splits
        output = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        dist.all_to_all_single(output, tensor.contiguous(), output_splits, input_splits)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_input = grad_output.new_empty((sum(ctx.input_splits), *grad_output.shape[1:]))
        dist.all_to_all_single(grad_input, grad_output.contiguous(), ctx.input_splits, ctx.output_splits)
        return grad_input, None, None


def all_to_all(tensor: torch.Tensor, *, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """Differentiable all-to-all over the default group: rows [input_splits[r]] go to rank r."""
    return _AllToAll.apply(tensor, output_splits, input_splits)


class ExpertParallelFeedForward(nn.Module):
    """An MoEFeedForward whose experts are split across the ranks of the default process group.

    Same routing rule (moe.route_tokens: softmax, or DeepSeek's biased sigmoid with group limits), gate
    weights, shared experts and router losses as MoEFeedForward (computed on this rank's tokens); only the
    routed expert matmuls happen on the rank that owns the expert (shared experts are replicated like the router).
    """

    def __init__(self, dense_layer: MoEFeedForward, *, context: DistributedContext) -> None:
        super().__init__()
        config = dense_layer.config
        if config.n_experts % context.world_size:
            raise ValueError(
                f"Expert parallelism splits n_experts={config.n_experts} over world_size={context.world_size} "
                "ranks; choose a world size that divides n_experts."
            )
        self.config = config
        self.context = context
        self.local_experts = config.n_experts // context.world_size
        first = context.rank * self.local_experts
        local = slice(first, first + self.local_experts)
        self.router = dense_layer.router
        self.register_buffer("score_bias", dense_layer.score_bias)
        self.shared_experts = dense_layer.shared_experts
        self.w_gate = nn.Parameter(dense_layer.w_gate.detach()[local].clone())
        self.w_up = nn.Parameter(dense_layer.w_up.detach()[local].clone())
        self.w_down = nn.Parameter(dense_layer.w_down.detach()[local].clone())
        for parameter in (self.w_gate, self.w_up, self.w_down):
            parameter.expert_parallel = True

    def forward(
        self, x: torch.Tensor, *, routing_override: torch.Tensor | None = None, compute_losses: bool = True
    ) -> tuple[torch.Tensor, RouterOutput]:
        n_tokens = x.shape[0]
        config, world, local_experts = self.config, self.context.world_size, self.local_experts
        n_experts, top_k = config.n_experts, config.top_k
        router_logits = self.router(x).float()
        weights, expert_indices, router_probs = route_tokens(
            config, router_logits, routing_override, score_bias=self.score_bias
        )

        flat_experts = expert_indices.reshape(-1)
        order = flat_experts.argsort(stable=True)
        source_tokens = order // top_k
        tokens_per_expert = torch.bincount(flat_experts, minlength=n_experts)

        # Rows sorted by expert are also grouped by owning rank; exchange the per-expert counts first.
        received_counts = torch.empty_like(tokens_per_expert)
        dist.all_to_all_single(received_counts, tokens_per_expert)
        received_counts = received_counts.view(world, local_experts)
        send_splits = tokens_per_expert.view(world, local_experts).sum(dim=1).tolist()
        receive_splits = received_counts.sum(dim=1).tolist()
        received = all_to_all(x[source_tokens], output_splits=receive_splits, input_splits=send_splits)

        # Received rows are grouped by source rank, then expert; the grouped kernel wants expert-major.
        row_expert = torch.repeat_interleave(
            torch.arange(local_experts, device=x.device).repeat(world), received_counts.reshape(-1)
        )
        expert_major = row_expert.argsort(stable=True)
        offsets = torch.zeros(local_experts + 1, dtype=torch.int32, device=x.device)
        offsets[1:] = received_counts.sum(dim=0).cumsum(0)
        processed = grouped_swiglu(
            received[expert_major], offsets, self.w_gate, self.w_up, self.w_down, precision=config.precision
        )
        back_in_rank_order = torch.empty_like(processed).index_copy_(0, expert_major, processed)
        expert_out = all_to_all(back_in_rank_order, output_splits=send_splits, input_splits=receive_splits)

        gate = weights.reshape(-1)[order].unsqueeze(-1).to(expert_out.dtype)
        out = torch.zeros_like(x).index_add_(0, source_tokens, (expert_out * gate).to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)

        if not compute_losses:
            zero = router_logits.new_zeros(())
            return out, RouterOutput(expert_indices, zero, zero)
        assignment_fraction = tokens_per_expert.float() / max(n_tokens * top_k, 1)
        mean_probability = router_probs.mean(dim=0) if n_tokens else router_probs.new_zeros(n_experts)
        load_balancing_loss = n_experts * (assignment_fraction * mean_probability).sum()
        router_z_loss = (
            torch.logsumexp(router_logits, dim=-1).square().mean() if n_tokens else router_logits.new_zeros(())
        )
        return out, RouterOutput(expert_indices, load_balancing_loss, router_z_loss)


def shard_experts(model: nn.Module, *, context: DistributedContext) -> nn.Module:
    """Replace every MoEFeedForward in `model` by its expert-parallel shard for this rank (in place)."""
    if not context.enabled:
        return model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, MoEFeedForward):
                setattr(module, name, ExpertParallelFeedForward(child, context=context))
    return model


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters that live on one rank only (sharded experts)."""
    return [(name, p) for name, p in model.named_parameters() if getattr(p, "expert_parallel", False)]


def wrap_data_parallel(model: nn.Module, *, context: DistributedContext) -> nn.Module:
    """DistributedDataParallel over the replicated parameters; sharded experts are left out."""
    if not context.enabled:
        return model
    ignored = [name for name, _ in expert_parameters(model)]
    if ignored:
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return nn.parallel.DistributedDataParallel(model)


def gather_expert_state(model: nn.Module, *, context: DistributedContext) -> dict[str, torch.Tensor]:
    """Full (unsharded) expert weights from every rank, keyed like the unsharded model's parameters."""
    gathered: dict[str, torch.Tensor] = {}
    for name, parameter in expert_parameters(model):
        pieces = [torch.empty_like(parameter) for _ in range(context.world_size)]
        dist.all_gather(pieces, parameter.detach().contiguous())
        gathered[name] = torch.cat(pieces)
    return gathered


def clip_grad_norm(model: nn.Module, *, max_norm: float, context: DistributedContext) -> float:
    """Clip by the global gradient norm, counting each sharded expert once across ranks."""
    replicated, sharded = [], []
    for parameter in model.parameters():
        if parameter.grad is None:
            continue
        (sharded if getattr(parameter, "expert_parallel", False) else replicated).append(parameter.grad)
    squares = sum((grad.float().square().sum() for grad in replicated), torch.zeros(()))
    sharded_squares = sum((grad.float().square().sum() for grad in sharded), torch.zeros(()))
    if context.enabled and sharded:
        dist.all_reduce(sharded_squares)
    total = (squares + sharded_squares).sqrt()
    if max_norm > 0:
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grad in replicated + sharded:
            grad.mul_(scale.to(grad.dtype))
    return float(total)
