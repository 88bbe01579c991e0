"""The GRPO learner: the policy under training, its optimizer and lr schedule, and one update step.

Both RL loops drive this one class: ``training.train.rl.rl`` (synchronous, rollouts in-process) and
``training.rollout.driver`` (asynchronous, rollouts on Ray actors). A step is

    learner.update(records)      advantages -> training rows -> clipped policy-gradient steps -> lr schedule
    rollout_metrics(records) | update_metrics(result)       the step's metrics, one vocabulary for both loops
    learner.save(...)            the exactly-resumable checkpoint

The lr schedule follows the policy version: it steps after every update, also one that trained nothing
(every group's rollouts agreed), so `steps` counts versions and the decay ends with the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from training.checkpoint import load_checkpoint
from training.devices import policy_precision
from training.model.transformer import MoETransformer
from training.train.grpo import GRPOConfig, group_advantages, policy_loss, shaped_rewards
from training.train.loop import build_optimizer, build_scheduler
from training.train.rollouts import RolloutRecord
from training.train.segments import (
    TrainingSegments,
    segment_logprobs,
    segment_logprobs_and_entropy,
    segments_to_batches,
    segments_to_device,
    shared_prefix_groups,
    suffix_batch,
)
from training.train.state import latest_checkpoint, load_train_checkpoint, save_train_checkpoint

if TYPE_CHECKING:
    from training.train.rl import RLConfig


@dataclass
class UpdateResult:
    """What one policy update did (Learner.update's answer to the loop that drives it)."""

    advantages: list[float]
    """Advantage of every member passed to update(), in order (0 for masked rollouts)."""
    stats: dict[str, Any]
    """policy_updates' statistics: loss, clip_fraction, mean_ratio, approx_kl, entropy, kl_to_reference,
    logprob_mismatch, grad_norm, trained_tokens, shared_prefix_tokens."""
    lr: float
    """Learning rate the update used (the schedule's value before it stepped)."""
    segments: int
    """Training rows the update ran (merged turns count once)."""
    seconds: float
    """Wall time of the update."""


class Learner:
    """The policy under training, loaded from config.init_checkpoint (a checkpoint, or an imported Hugging Face
    model's directory: its tokenizer is then a training.hf.policy.HFTokenizer), with its optimizer and lr schedule.

    time_fraction: share of a wall-clock budget spent, for a schedule whose decay follows the clock too
    (training.train.loop.build_scheduler).
    device: where the policy (fp32 master weights) and its optimizer live; on CUDA the expert matmuls run in
    config.precision or bf16 (training.devices.policy_precision). Training rows are moved there per update,
    weights() hands back CPU copies.
    """

    def __init__(
        self, config: RLConfig, *, time_fraction: Callable[[], float] | None = None, device: str | torch.device = "cpu"
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.precision = policy_precision(self.device, config.precision)
        self.model, self.tokenizer, _ = load_checkpoint(
            config.init_checkpoint, device=self.device, precision=self.precision
        )
        self.model.train()
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.lr_schedule = build_scheduler(
            self.optimizer, config.optimizer, total_steps=config.steps, time_fraction=time_fraction
        )
        self.reference_model = reference_model_load(config, device=self.device, precision=self.precision)

    @property
    def uses_hf_tokenizer(self) -> bool:
        """Whether the policy is an imported model with its own tokenizer (training.hf.policy.HFTokenizer)."""
        from training.hf.policy import is_hf_tokenizer

        return is_hf_tokenizer(self.tokenizer)

    def restore(self, run_dir: str | Path) -> dict[str, Any] | None:
        """Load the run's newest checkpoint (weights, optimizer, schedule, RNG); returns its data_position,
        or None for a fresh run (the torch RNG is then seeded with config.seed)."""
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            torch.manual_seed(self.config.seed)
            return None
        restored = load_train_checkpoint(
            path=checkpoint, model=self.model, optimizer=self.optimizer, scheduler=self.lr_schedule
        )
        return restored.data_position

    def update(self, records: list[RolloutRecord]) -> UpdateResult:
        """Group-relative advantages of `records` (record.group says the group), then updates_per_step clipped
        policy-gradient steps on their training rows, then one step of the lr schedule."""
        started = time.monotonic()
        advantages = rollout_advantages(records, self.config.grpo)
        batches = segments_to_batches(
            records=records,
            advantages=advantages,
            micro_batch_size=self.config.micro_batch_size,
            pad_id=self.tokenizer.pad_id,
            with_routing=self.config.routing_replay and self.model.config.is_moe,
            merge_turns=self.config.grpo.normalization == "token",
        )
        if self.device.type != "cpu":
            batches = [segments_to_device(batch, self.device) for batch in batches]
        lr = self.lr_schedule.get_last_lr()[0]
        stats = policy_updates(
            model=self.model,
            optimizer=self.optimizer,
            batches=batches,
            config=self.config,
            reference_model=self.reference_model,
        )
        # One schedule rule: it follows the policy version, also when this update trained nothing (a group
        # that all passed or all failed has no advantage). A schedule that waited for trained updates would
        # still be short of its decay when the run ends (40 % of a run's updates can train nothing). If the
        # first update trained nothing, torch warns once that a schedule value was skipped; none was.
        self.lr_schedule.step()
        return UpdateResult(
            advantages=advantages.tolist(),
            stats=stats,
            lr=lr,
            segments=sum(batch.input_ids.shape[0] for batch in batches),
            seconds=time.monotonic() - started,
        )

    def weights(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the current weights (for the serving copy or the inference actors)."""
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.model.state_dict().items()}

    def expert_record(self, *, task_id: str, group: int, messages: list[dict], reward: float) -> RolloutRecord:
        """The scripted expert's trajectory as a member of the coming update's group, scored by this policy
        (training.train.guidance.expert_record_create)."""
        from training.train.guidance import expert_record_create

        return expert_record_create(
            task_id=task_id, group=group, messages=messages, reward=reward, tokenizer=self.tokenizer,
            model=self.model, temperature=self.config.temperature,
        )

    def save(
        self,
        *,
        run_dir: str | Path,
        step: int,
        data_position: dict[str, Any],
        run_config: dict[str, Any],
        metrics: dict[str, Any],
        keep_last: int,
    ) -> float:
        """Checkpoint the learner (exactly resumable); returns the seconds it took."""
        started = time.monotonic()
        save_train_checkpoint(
            run_dir=run_dir,
            step=step,
            model=self.model,
            tokenizer=self.tokenizer,
            optimizer=self.optimizer,
            scheduler=self.lr_schedule,
            data_position=data_position,
            run_config=run_config,
            metrics=metrics,
            keep_last=keep_last,
        )
        return time.monotonic() - started


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def rollout_metrics(records: list[RolloutRecord]) -> dict[str, Any]:
    """The rollout half of a step's metrics (the same names in both RL loops and on the web app's charts)."""
    valid = [record for record in records if record.valid]
    return {
        "rollouts": len(records),
        "valid_rollouts": len(valid),
        "masked_rollouts": len(records) - len(valid),
        "mean_reward": _mean([record.reward for record in valid]),
        "pass_rate": _mean([float(record.passed) for record in valid]),
        "mean_completion_tokens": _mean([float(record.completion_tokens) for record in records]),
        "mean_turns": _mean([float(record.turns) for record in records]),
    }


def update_metrics(result: UpdateResult) -> dict[str, Any]:
    """The update half of a step's metrics: the learning rate used, the training rows and the loss statistics."""
    return {"lr": result.lr, "segments": result.segments, **result.stats}
def rollout_advantages(records: list[RolloutRecord], config: GRPOConfig) -> torch.Tensor:
    """Length-shaped, group-relative advantage per rollout (0 for masked ones)."""
    valid = torch.tensor([record.valid for record in records], dtype=torch.bool)
    rewards = torch.tensor([record.reward if record.valid else float("nan") for record in records])
    groups = torch.tensor([record.group for record in records])
    lengths = torch.tensor([float(record.completion_tokens) for record in records])
    shaped = shaped_rewards(rewards=rewards, valid=valid, group_ids=groups, lengths=lengths, config=config.length_penalty)
    advantages = group_advantages(
        rewards=shaped, valid=valid, group_ids=groups,
        normalize_std=config.normalize_advantage_std, eps=config.advantage_eps,
    )
    # "+ 0.0" turns the -0.0 of a zero weight into 0.0 for the rollout logs.
    return torch.where(advantages < 0, advantages * config.negative_advantage_weight, advantages) + 0.0


def reference_model_load(
    config: RLConfig, *, device: str | torch.device = "cpu", precision: str | None = None
) -> MoETransformer | None:
    """The frozen starting policy the KL penalty pulls towards, or None when config.grpo.kl_coef is 0.

    Loaded from init_checkpoint, never from the run's latest checkpoint, so a resumed run keeps the same
    reference; on the learner's device with its precision (None: config.precision).
    """
    if config.grpo.kl_coef == 0:
        return None
    reference, _, _ = load_checkpoint(config.init_checkpoint, device=device, precision=precision or config.precision)
    reference.eval()
    reference.requires_grad_(False)
    return reference




def policy_updates(
    *,
    model: MoETransformer,
    optimizer: torch.optim.Optimizer,
    batches: list[TrainingSegments],
    config: RLConfig,
    reference_model: MoETransformer | None = None,
    share_prefixes: bool = True,
) -> dict[str, Any]:
    """updates_per_step clipped policy-gradient steps on the batch; returns the logged statistics.

    reference_model (from reference_model_load) is required when config.grpo.kl_coef is not 0.
    share_prefixes: one-row batches that begin with the same tokens (a group's rollouts) run that prefix
    once per update (shared_prefix_groups); the gradient is the same as running every row in full.
    """
    if config.grpo.kl_coef != 0 and reference_model is None:
        raise ValueError("config.grpo.kl_coef is not 0: pass reference_model=reference_model_load(config).")
    total_tokens = float(sum(batch.loss_mask.sum() for batch in batches))
    stats: dict[str, Any] = {"loss": 0.0, "clip_fraction": 0.0, "mean_ratio": 1.0, "approx_kl": 0.0, "entropy": None,
                             "kl_to_reference": None, "logprob_mismatch": None, "grad_norm": 0.0,
                             "trained_tokens": int(total_tokens), "shared_prefix_tokens": 0}
    if total_tokens == 0:
        # No rollout carries signal (all masked, or every group scored uniformly). Taking an Adam
        # step on a zero gradient would still move the weights along the stale momentum, so skip it.
        return stats
    reference_logprobs: list[torch.Tensor | None] = [None] * len(batches)
    if reference_model is not None:
        with torch.no_grad():
            # The reference routes tokens itself: the recorded routing is the behaviour policy's, not its own.
            reference_logprobs = [
                segment_logprobs(reference_model, batch, temperature=config.temperature, routing_replay=False)
                for batch in batches
            ]
    groups = (
        shared_prefix_groups(batches, routing_replay=config.routing_replay)
        if share_prefixes
        else [(0, [index]) for index in range(len(batches))]
    )
    # Each member as the learner runs it: its rows after the group's prefix, and the reference's logprobs there.
    members = {
        index: (
            suffix_batch(batches[index], length) if length else batches[index],
            None if reference_logprobs[index] is None else reference_logprobs[index][:, length:],
        )
        for length, indices in groups
        for index in indices
    }
    # Prefix tokens each update does not recompute: the measure of what sharing saved in a real run.
    stats["shared_prefix_tokens"] = sum(length * (len(indices) - 1) for length, indices in groups if length)
    for update in range(config.updates_per_step):
        weighted = _accumulate_gradients(
            model=model, batches=batches, groups=groups, members=members, config=config, total_tokens=total_tokens
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if update == 0:
            # Before the first update the weights equal the behaviour policy's: any logprob gap is the
            # train/rollout numerical mismatch (what routing replay reduces).
            stats["logprob_mismatch"] = weighted["mismatch"]
        stats.update(loss=weighted["loss"], clip_fraction=weighted["clip_fraction"],
                     mean_ratio=weighted["mean_ratio"], approx_kl=weighted["approx_kl"],
                     entropy=weighted["entropy"], grad_norm=float(grad_norm),
                     kl_to_reference=weighted["kl_to_reference"] if reference_model is not None else None)
    return stats


def _accumulate_gradients(
    *,
    model: MoETransformer,
    batches: list[TrainingSegments],
    groups: list[tuple[int, list[int]]],
    members: dict[int, tuple[TrainingSegments, torch.Tensor | None]],
    config: RLConfig,
    total_tokens: float,
) -> dict[str, float]:
    """One backward pass over every batch (a shared prefix once per group); returns the token-weighted stats."""
    weighted = {"loss": 0.0, "clip_fraction": 0.0, "mean_ratio": 0.0, "approx_kl": 0.0, "entropy": 0.0,
                "kl_to_reference": 0.0, "mismatch": 0.0}
    for length, indices in groups:
        prefix = leaves = None
        if length:
            lead = batches[indices[0]]
            replayed = lead.routed_experts if config.routing_replay else None
            prefix = model.prefix_forward(
                lead.input_ids[:, :length], routing_override=None if replayed is None else replayed[:, :length]
            )
            leaves = prefix.detached()
        for index in indices:
            batch, batch_reference_logprobs = members[index]
            logprobs, entropies = segment_logprobs_and_entropy(
                model, batch, temperature=config.temperature, routing_replay=config.routing_replay, prefix=leaves
            )
            out = policy_loss(
                logprobs=logprobs, behaviour_logprobs=batch.behaviour_logprobs, advantages=batch.advantages,
                loss_mask=batch.loss_mask, config=config.grpo, token_normalizer=total_tokens, entropies=entropies,
                reference_logprobs=batch_reference_logprobs,
            )
            out.loss.backward()
            share = out.n_tokens / total_tokens
            weighted["loss"] += float(out.loss.detach())
            weighted["clip_fraction"] += out.clip_fraction * share
            weighted["mean_ratio"] += out.mean_ratio * share
            weighted["approx_kl"] += out.approx_kl * share
            weighted["entropy"] += out.entropy * share
            if out.kl_to_reference is not None:
                weighted["kl_to_reference"] += out.kl_to_reference * share
            mask = batch.loss_mask.bool()
            weighted["mismatch"] += float((logprobs.detach() - batch.behaviour_logprobs)[mask].abs().sum()) / total_tokens
        if prefix is not None:
            # The members' gradients with respect to the prefix's keys and values, through its graph once.
            pairs = [(tensor, leaf.grad) for tensor, leaf in zip(prefix.tensors(), leaves.tensors(), strict=True)
                     if leaf.grad is not None]
            if pairs:
                torch.autograd.backward([tensor for tensor, _ in pairs], grad_tensors=[grad for _, grad in pairs])
    return weighted
