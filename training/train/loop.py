"""The supervised training loop shared by continued pretraining and SFT.

Readable top to bottom: build optimizer and schedule, resume from the newest checkpoint if any,
then for each step cut this rank's share of the global batch into micro-batches, take the
token-level next-token loss (plus router aux losses), step, log, checkpoint.

Loss normalisation is global: the cross-entropy of a step is summed over every target token of
the global batch and divided by the global token count (all ranks, all micro-batches), so DP over
N ranks computes the same update as one process accumulating N micro-batches.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from training.model.config import ModelConfig
from training.model.transformer import MoETransformer
from training.tokenizer import BPETokenizer
from training.train.data import IGNORE_INDEX, Batch
from training.train.distributed import (
    DistributedContext,
    all_reduce_sum,
    clip_grad_norm,
    expert_parameters,
    gather_expert_state,
    shard_experts,
    wrap_data_parallel,
)
from training.train.state import (
    latest_checkpoint,
    load_train_checkpoint,
    read_trainer_state,
    save_train_checkpoint,
)

METRICS_FILE = "metrics.jsonl"


class TrainConfigError(ValueError):
    """A training config whose fields contradict each other; the message says how to fix it."""


class DataSource(Protocol):
    n_examples: int

    def batch(self, *, start: int, size: int) -> Batch: ...


@dataclass
class OptimizerConfig:
    """AdamW with linear warmup, then lr held, then cosine decay to min_lr_ratio * lr."""

    lr: float = 1e-3
    """Peak learning rate."""

    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""

    warmup_steps: int = 10
    """Steps of linear warmup from 0 to lr."""

    decay_fraction: float = 1.0
    """Share of the steps after the warmup over which the lr decays (cosine) to min_lr_ratio * lr; the
    steps before the decay hold lr (a warmup-stable-decay schedule). 1 decays over the whole run."""

    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (norm gains and embeddings are not decayed)."""

    beta1: float = 0.9
    """AdamW first-moment decay."""

    beta2: float = 0.95
    """AdamW second-moment decay."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""

    gain_lr_scale: float = 1.0
    """Learning-rate multiplier for 1-D parameters (normalisation gains). Adam moves every parameter by
    about lr per step whatever its scale: a weight-matrix entry (std ~0.02) changes by a few percent over
    a few hundred steps, a gain (~1.0) by a fraction of a percent, so a short fine-tune (RL) cannot move
    the gains, which set how sharp attention and the output distribution are. ~50 evens the relative
    step of gains and matrices."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise TrainConfigError(f"lr must be positive, got {self.lr}.")
        if self.gain_lr_scale <= 0:
            raise TrainConfigError(f"gain_lr_scale must be positive (1 keeps gains at lr), got {self.gain_lr_scale}.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise TrainConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.")
        if not 0 < self.decay_fraction <= 1:
            raise TrainConfigError(
                f"decay_fraction must be in (0, 1] (1 decays over every step after the warmup), got {self.decay_fraction}."
            )
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise TrainConfigError("warmup_steps, grad_clip and weight_decay must be >= 0.")


@dataclass
class LoopConfig:
    """How many steps, how big, and how often to log and checkpoint."""

    steps: int = 100
    """Optimizer steps of the whole run (a resumed run continues up to this number)."""

    batch_size: int = 8
    """Sequences per optimizer step, summed over all data-parallel ranks."""

    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank; batch_size / world_size must be a multiple of it."""

    seed: int = 0
    """Seeds model init and data order; a resumed run restores the RNG state instead."""

    load_balancing_coef: float = 0.01
    """Weight of the router load-balancing loss (MoE only)."""

    router_z_coef: float = 0.001
    """Weight of the router z-loss (MoE only)."""

    checkpoint_every: int = 50
    """Save a resumable checkpoint every this many steps (and at the end); 0 saves only at the end."""

    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk."""

    expert_parallel: bool = False
    """Split each MoE layer's experts across the data-parallel ranks (all-to-all token exchange)."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""

    time_budget_s: float | None = None
    """Stop (with a checkpoint) once this invocation has trained this many wall-clock seconds, even
    before `steps`; None runs to `steps`. The lr schedule still counts `steps` (equal-compute
    comparisons, benchmarks/bench_rl_vs_sft.py, give a constant lr and a large `steps`)."""

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, dict):
            self.optimizer = OptimizerConfig(**self.optimizer)
        if self.steps < 1 or self.batch_size < 1 or self.micro_batch_size < 1:
            raise TrainConfigError("steps, batch_size and micro_batch_size must be positive.")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise TrainConfigError("checkpoint_every must be >= 0 and keep_checkpoints >= 1.")
        if self.time_budget_s is not None and not (math.isfinite(self.time_budget_s) and self.time_budget_s > 0):
            raise TrainConfigError(f"time_budget_s must be a positive number of seconds, got {self.time_budget_s}.")

    def validate_for(self, context: DistributedContext) -> None:
        per_rank, remainder = divmod(self.batch_size, context.world_size)
        if remainder or per_rank % self.micro_batch_size:
            raise TrainConfigError(
                f"batch_size={self.batch_size} must split evenly into world_size={context.world_size} ranks "
                f"of whole micro-batches of {self.micro_batch_size}; make batch_size a multiple of "
                f"{context.world_size * self.micro_batch_size}."
            )


@dataclass
class TrainResult:
    """What a finished (or resumed-and-finished) run reports."""

    run_dir: Path
    """Directory with checkpoints/ and metrics.jsonl."""

    final_checkpoint: Path | None
    """The checkpoint written at the end (None on non-main ranks)."""

    history: list[dict[str, Any]]
    """Metrics of the steps this invocation ran (not those of an earlier, interrupted invocation)."""

    resumed_from_step: int
    """0 for a fresh run."""


def build_model(model_config: ModelConfig, *, seed: int) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(model_config)


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    # Gains get a group of their own only when their lr is scaled: optimizer states saved with the two
    # default groups (matrices, and everything not decayed) must still load when a run resumes.
    separate_gains = config.gain_lr_scale != 1.0
    decay, no_decay, gains = [], [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if parameter.dim() >= 2 and "embed" not in name:
            decay.append(parameter)
        elif separate_gains and parameter.dim() < 2:
            gains.append(parameter)
        else:
            no_decay.append(parameter)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if gains:
        groups.append({"params": gains, "weight_decay": 0.0, "lr": config.lr * config.gain_lr_scale})
    return torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        foreach=False,
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    config: OptimizerConfig,
    *,
    total_steps: int,
    time_fraction: Callable[[], float] | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The lr multiplier per step: warmup, hold, then the decay over the last decay_fraction.

    With `time_fraction` (the share of a wall-clock budget spent, read when the schedule steps), the decay's
    position is the further along of the steps' and the clock's: a run that a clock stops then ends its
    decay at the clock however many steps the machine managed, where a step count guessed too high would
    stop it mid-decay and one guessed too low would end it early and idle the rest of the budget. On the
    clock the decay covers the last decay_fraction of the whole budget (warmup steps included).
    """

    def multiplier(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / (config.warmup_steps + 1)
        decay_steps = config.decay_fraction * (total_steps - config.warmup_steps)
        decay_start = total_steps - decay_steps
        progress = max(0.0, step - decay_start) / max(1.0, decay_steps)
        if time_fraction is not None:
            clock_progress = (time_fraction() - (1 - config.decay_fraction)) / config.decay_fraction
            progress = max(progress, clock_progress)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def train_supervised(
    *,
    model_config: ModelConfig,
    data: DataSource,
    config: LoopConfig,
    run_dir: str | Path,
    run_config: dict[str, Any],
    context: DistributedContext | None = None,
    initial_weights: Callable[[MoETransformer], None] | None = None,
    tokenizer: BPETokenizer,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train next-token prediction on `data` until config.steps, resuming from run_dir if possible."""
    context = context or DistributedContext()
    config.validate_for(context)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    model, optimizer, scheduler, resumed_from, samples_seen = _model_resume(
        model_config=model_config, config=config, run_dir=run_dir, context=context, initial_weights=initial_weights
    )
    trained = wrap_data_parallel(model, context=context)
    experts = [parameter for _, parameter in expert_parameters(model)]
    per_rank = config.batch_size // context.world_size
    history: list[dict[str, Any]] = []
    final_checkpoint, deadline = None, _deadline(config)
    for step in range(resumed_from, config.steps):
        started = time.perf_counter()
        model.train()
        rank_start = samples_seen + context.rank * per_rank
        micro_batches = [
            data.batch(start=rank_start + offset, size=config.micro_batch_size)
            for offset in range(0, per_rank, config.micro_batch_size)
        ]
        global_tokens, totals = _accumulate_gradients(
            trained=trained, micro_batches=micro_batches, experts=experts, config=config, context=context
        )
        grad_norm = clip_grad_norm(model, max_norm=config.optimizer.grad_clip, context=context)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        samples_seen += config.batch_size

        metrics = {
            "step": step + 1,
            "loss": all_reduce_sum(totals["ce_sum"], context) / max(global_tokens, 1.0),
            "load_balancing_loss": all_reduce_sum(totals["load_balancing"], context),
            "router_z_loss": all_reduce_sum(totals["router_z"], context),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": int(global_tokens),
            "step_seconds": time.perf_counter() - started,
        }
        history.append(metrics)
        if context.is_main:
            _append_metrics(run_dir, metrics)
        if on_step is not None:
            on_step(metrics)
        is_last = step + 1 == config.steps or _out_of_time(deadline, context)
        if is_last or (config.checkpoint_every and (step + 1) % config.checkpoint_every == 0):
            final_checkpoint = _save(
                model=model,
                model_config=model_config,
                optimizer=optimizer,
                scheduler=scheduler,
                run_dir=run_dir,
                step=step + 1,
                samples_seen=samples_seen,
                run_config=run_config,
                metrics=metrics,
                tokenizer=tokenizer,
                config=config,
                context=context,
            )
        if is_last:
            break
    if final_checkpoint is None and context.is_main:
        final_checkpoint = latest_checkpoint(run_dir)
    return TrainResult(run_dir=run_dir, final_checkpoint=final_checkpoint, history=history, resumed_from_step=resumed_from)


def _model_resume(
    *,
    model_config: ModelConfig,
    config: LoopConfig,
    run_dir: Path,
    context: DistributedContext,
    initial_weights: Callable[[MoETransformer], None] | None,
) -> tuple[MoETransformer, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, int, int]:
    """(model, optimizer, lr schedule, step resumed from, samples seen): built fresh, then restored from the
    run's newest checkpoint when there is one."""
    model = build_model(model_config, seed=config.seed)
    if initial_weights is not None:
        initial_weights(model)
    resumed_from = 0
    samples_seen = 0
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None and (
        config.expert_parallel or read_trainer_state(checkpoint)["run_config"].get("loop", {}).get("expert_parallel")
    ):
        raise TrainConfigError(
            f"{run_dir} holds a checkpoint of an expert-parallel run (or this run is expert-parallel): its "
            "optimizer state is sharded per rank, so it cannot be resumed exactly. Its weights are complete: "
            f"start a new run_dir with --init-checkpoint {checkpoint}."
        )
    if config.expert_parallel:
        shard_experts(model, context=context)
    optimizer = build_optimizer(model, config.optimizer)
    scheduler = build_scheduler(optimizer, config.optimizer, total_steps=config.steps)
    if checkpoint is not None:
        restored = load_train_checkpoint(path=checkpoint, model=model, optimizer=optimizer, scheduler=scheduler)
        resumed_from, samples_seen = restored.step, int(restored.data_position["samples_seen"])
    return model, optimizer, scheduler, resumed_from, samples_seen


def _accumulate_gradients(
    *,
    trained: torch.nn.Module,
    micro_batches: list,
    experts: list[torch.nn.Parameter],
    config: LoopConfig,
    context: DistributedContext,
) -> tuple[float, dict[str, float]]:
    """Forward and backward every micro-batch of this rank's share of the step; returns (target tokens of the
    whole step over all ranks, this rank's loss sums: ce_sum, load_balancing, router_z)."""
    global_tokens = all_reduce_sum(float(sum(b.n_target_tokens for b in micro_batches)), context)
    global_micro_batches = len(micro_batches) * context.world_size
    # DDP averages gradients over ranks; scaling by world_size turns that average into the sum
    # that one process accumulating every micro-batch would compute.
    scale = float(context.world_size)
    totals = {"ce_sum": 0.0, "load_balancing": 0.0, "router_z": 0.0}
    for index, micro in enumerate(micro_batches):
        sync = index == len(micro_batches) - 1
        with _maybe_no_sync(trained, sync):
            output = trained(micro.input_ids)
            ce_sum = F.cross_entropy(
                output.logits.flatten(0, 1), micro.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            aux = (
                config.load_balancing_coef * output.load_balancing_loss
                + config.router_z_coef * output.router_z_loss
            ) / global_micro_batches
            loss = (ce_sum / max(global_tokens, 1.0) + aux) * scale
            loss.backward()
        totals["ce_sum"] += float(ce_sum.detach())
        totals["load_balancing"] += float(output.load_balancing_loss.detach()) / global_micro_batches
        totals["router_z"] += float(output.router_z_loss.detach()) / global_micro_batches
    for parameter in experts:
        if parameter.grad is not None:
            parameter.grad.div_(scale)
    return global_tokens, totals


def _save(
    *,
    model: MoETransformer,
    model_config: ModelConfig,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    run_dir: Path,
    step: int,
    samples_seen: int,
    run_config: dict[str, Any],
    metrics: dict[str, Any],
    tokenizer: BPETokenizer,
    config: LoopConfig,
    context: DistributedContext,
) -> Path | None:
    to_save = model
    if config.expert_parallel and context.enabled:
        # Reassemble an ordinary (unsharded) model so the checkpoint serves and fine-tunes anywhere.
        full_experts = gather_expert_state(model, context=context)
        if not context.is_main:
            return None
        to_save = MoETransformer(model_config)
        state = {name: tensor for name, tensor in model.state_dict().items() if name not in full_experts}
        to_save.load_state_dict({**state, **full_experts})
    if not context.is_main:
        return None
    return save_train_checkpoint(
        run_dir=run_dir,
        step=step,
        model=to_save,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        data_position={"samples_seen": samples_seen},
        run_config=run_config,
        metrics=metrics,
        keep_last=config.keep_checkpoints,
    )


def _deadline(config: LoopConfig) -> float | None:
    """When this invocation's time budget ends (time.monotonic), or None without one."""
    return None if config.time_budget_s is None else time.monotonic() + config.time_budget_s


def _out_of_time(deadline: float | None, context: DistributedContext) -> bool:
    """True on every rank once any rank's clock passed the deadline, so that all ranks stop at the same step."""
    if deadline is None:
        return False
    return all_reduce_sum(1.0 if time.monotonic() >= deadline else 0.0, context) > 0


def _maybe_no_sync(model: torch.nn.Module, sync: bool):
    if not sync and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def _append_metrics(run_dir: Path, metrics: dict[str, Any]) -> None:
    with open(run_dir / METRICS_FILE, "a") as handle:
        handle.write(json.dumps(metrics) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def config_to_dict(config: Any) -> dict[str, Any]:
    return asdict(config)
