"""RL with GRPO: rollouts of the policy in real sandboxes, test-based rewards, clipped policy update.

Launch:

    .venv/bin/python manage.py rl --run-dir var/runs/rl --init-checkpoint var/runs/sft/checkpoints/step-00000100 \\
        --tasks 64 --tasks-per-step 4 --group-size 8 --steps 200

Each step, readable top to bottom in `rl()`:
 1. pick tasks_per_step toy tasks (a pure function of the step, so resume needs only the step);
 2. run group_size rollouts per task through the product's agent loop (training.agent.loop.run_agent)
    in real sandboxes, with the current policy served in-process by training.serving.ChatModel;
 3. score every rollout with the task's hidden tests (training.tasks.reward.score_rollout);
    infrastructure failures are masked, never scored as zero;
 4. shape rewards with the length penalty, compute group-relative advantages (training.train.grpo);
 5. every model call of a rollout is a training segment with the rollout's advantage; recompute
    the sampled tokens' logprobs (optionally replaying the experts recorded at rollout time) and
    take updates_per_step clipped-ratio steps against the recorded behaviour logprobs;
 6. copy the new weights into the serving model, log, checkpoint (exactly resumable).

How this differs from the GRPO paper and large-scale agent RL (DeepSeek-R1, Kimi k1.5, SWE-RL):
synchronous generate-then-train on one process (no separate inference fleet, weights are copied in
memory), no reference-model KL, DAPO-style clip-higher and token-level normalisation, toy bug-fix
tasks instead of real repositories, and a scalar test-pass reward (optionally partial credit).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from training.agent.config import AgentLimits
from training.checkpoint import load_checkpoint
from training.engine import EngineConfig, SamplingMasks
from training.model.transformer import MoETransformer, SharedPrefix
from training.serving import ChatModel
from training.tasks.reward import RewardConfig
from training.train.grpo import GRPOConfig, group_advantages, policy_loss, shaped_rewards
from training.train.loop import (
    METRICS_FILE,
    OptimizerConfig,
    TrainConfigError,
    build_optimizer,
    build_scheduler,
)
from training.train.rollouts import RolloutRecord, rollouts_collect
from training.train.state import latest_checkpoint, load_train_checkpoint, save_train_checkpoint


@dataclass
class RLConfig:
    """A GRPO run on toy bug-fixing tasks."""

    run_dir: str
    """Directory for checkpoints/, metrics.jsonl and rollouts.jsonl; re-running resumes."""

    init_checkpoint: str
    """Policy to start from (normally the SFT result)."""

    tasks: int = 8
    """Toy training tasks in the pool (cycled through in order)."""

    task_seed_start: int = 0
    """First train-split toy task index of the pool."""

    tasks_per_step: int = 2
    """Tasks (groups) per step."""

    group_size: int = 4
    """Rollouts per task; advantages are relative to the group."""

    steps: int = 10
    """Rollout-and-update rounds."""

    updates_per_step: int = 1
    """Optimizer steps on each batch of rollouts; later ones are off-policy and rely on the clipped ratio."""

    micro_batch_size: int = 1
    """Segments per forward/backward."""

    temperature: float = 1.0
    """Sampling temperature of rollouts (training logprobs use the same temperature)."""

    top_p: float = 1.0
    """Nucleus mass of rollouts; must be 1.0 so behaviour logprobs are those of the full distribution."""

    max_turns: int = 6
    """Tool-calling turns per rollout."""

    max_tokens_per_turn: int = 256
    """Completion tokens per model call (the toy tier's fixing edit takes up to ~200 tokens)."""

    rollout_wall_time_s: float = 600.0
    """Wall-clock limit of one rollout."""

    routing_replay: bool = True
    """Feed the experts recorded at rollout time to the training forward (routing replay)."""

    partial_credit: bool = False
    """Reward the fraction of passing hidden tests instead of 0/1."""

    sandbox_backend: str | None = None
    """Sandbox backend name (None: the configured default)."""

    seed: int = 0
    """Seeds rollout sampling (offset by step) and the torch RNG."""

    checkpoint_every: int = 1
    """Checkpoint every this many steps (and at the end)."""

    keep_checkpoints: int = 2
    """Newest checkpoints kept."""

    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """Loss: clipping, normalisation, advantage and length-penalty settings."""

    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=1e-5, warmup_steps=0, weight_decay=0.0, min_lr_ratio=1.0)
    )
    """Optimizer and schedule (constant LR by default, as is usual for RL)."""

    def __post_init__(self) -> None:
        if isinstance(self.grpo, dict):
            self.grpo = GRPOConfig(**self.grpo)
        if isinstance(self.optimizer, dict):
            self.optimizer = OptimizerConfig(**self.optimizer)
        for name in ("tasks", "tasks_per_step", "group_size", "steps", "updates_per_step", "micro_batch_size",
                     "max_turns", "max_tokens_per_turn", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise TrainConfigError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.group_size < 2:
            raise TrainConfigError(
                "group_size must be >= 2: GRPO's baseline is the mean of the other rollouts of the task."
            )
        if self.tasks_per_step > self.tasks:
            raise TrainConfigError(f"tasks_per_step={self.tasks_per_step} exceeds the pool of tasks={self.tasks}.")
        if self.temperature <= 0:
            raise TrainConfigError("temperature must be > 0: greedy rollouts of one task are identical (no signal).")
        if self.top_p != 1.0:
            raise TrainConfigError(
                "top_p must be 1.0: the engine's logprobs are those before nucleus truncation, so the "
                "importance ratio would be wrong for truncated sampling."
            )


@dataclass
class TrainingSegments:
    """Padded tensors of the segments of one micro-batch."""

    input_ids: torch.Tensor
    """int64 [B, T]."""

    targets: torch.Tensor
    """int64 [B, T] next tokens (pad where no loss)."""

    loss_mask: torch.Tensor
    """float [B, T]: 1 on sampled completion tokens of valid rollouts."""

    behaviour_logprobs: torch.Tensor
    """float [B, T] logprobs recorded at rollout time (0 where masked)."""

    advantages: torch.Tensor
    """float [B] the advantage of each segment's rollout."""

    routed_experts: torch.Tensor | None
    """int64 [B, T, n_layers, top_k] recorded routing (None without replay or for dense models)."""

    masked_positions: torch.Tensor | None = None
    """int64 [M, 2] (row, position) of the loss positions whose token was drawn under a constraint's mask;
    None when no token of the micro-batch was."""

    masked_allowed: torch.Tensor | None = None
    """bool [M, vocab]: the tokens each of those positions could draw; the learner's logprobs there are
    taken over these tokens only, as the behaviour policy's were."""


def tasks_for_step(config: RLConfig, step: int) -> list:
    from training.tasks.toy import generate_toy_task, toy_task_seeds

    pool = toy_task_seeds(split="train", count=config.tasks, start=config.task_seed_start)
    return [generate_toy_task(pool[(step * config.tasks_per_step + i) % len(pool)]) for i in range(config.tasks_per_step)]


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


def segments_to_batches(
    *,
    records: list[RolloutRecord],
    advantages: torch.Tensor,
    micro_batch_size: int,
    pad_id: int,
    with_routing: bool,
    merge_turns: bool = True,
) -> list[TrainingSegments]:
    """Every model call of every valid rollout with a nonzero advantage as a training row.

    Invalid rollouts contribute nothing. Rollouts with zero advantage (a group whose rollouts all
    scored the same) carry no gradient; leaving them out keeps them from diluting the token-level
    normaliser, as DAPO's dynamic sampling does (without its over-sampling to refill the batch).

    merge_turns: a call whose prompt begins with an earlier call's prompt and completion (the next turn
    of the conversation, when the history re-renders to the same tokens) shares one row with it, with
    both completions in the loss. Causal attention gives every token the same logprob as in its own
    row, so the loss is unchanged under token-level normalisation, and the common prefix is computed
    once instead of once per turn (it is most of each row). Leave it off for per-sequence normalisation.
    """
    rows: list[tuple[_Row, float]] = []
    for record, advantage in zip(records, advantages.tolist(), strict=True):
        if not record.valid or advantage == 0.0:
            continue
        segments = [segment for segment in record.segments if segment.token_ids]
        rows.extend((row, advantage) for row in _segment_rows(segments, merge=merge_turns))
    batches = []
    for start in range(0, len(rows), micro_batch_size):
        chunk = rows[start : start + micro_batch_size]
        length = max(len(row.tokens) - 1 for row, _ in chunk)
        size = len(chunk)
        input_ids = torch.full((size, length), pad_id, dtype=torch.long)
        targets = torch.full((size, length), pad_id, dtype=torch.long)
        loss_mask = torch.zeros(size, length)
        behaviour = torch.zeros(size, length)
        routing = None
        masked_positions: list[tuple[int, int]] = []
        masked_allowed: list[torch.Tensor] = []
        for index, (row, _) in enumerate(chunk):
            sequence = torch.tensor(row.tokens, dtype=torch.long)
            n = sequence.shape[0] - 1
            input_ids[index, :n] = sequence[:-1]
            targets[index, :n] = sequence[1:]
            for first, logprobs, masks in row.completions:
                loss_mask[index, first : first + len(logprobs)] = 1.0
                behaviour[index, first : first + len(logprobs)] = torch.tensor(logprobs, dtype=torch.float32)
                if masks is not None:
                    masked_positions.extend((index, first + position) for position in masks.positions)
                    masked_allowed.append(masks.allowed)
            if with_routing and row.routing:
                for recorded in row.routing:
                    recorded = recorded.to(torch.long)
                    if routing is None:
                        routing = torch.zeros((size, length, *recorded.shape[1:]), dtype=torch.long)
                    routing[index, : recorded.shape[0]] = recorded
        batches.append(
            TrainingSegments(
                input_ids=input_ids, targets=targets, loss_mask=loss_mask, behaviour_logprobs=behaviour,
                advantages=torch.tensor([advantage for _, advantage in chunk], dtype=torch.float32),
                routed_experts=routing,
                masked_positions=torch.tensor(masked_positions, dtype=torch.long) if masked_positions else None,
                masked_allowed=torch.cat(masked_allowed) if masked_allowed else None,
            )
        )
    return batches


@dataclass
class _Row:
    tokens: list[int]
    """Prompt and completion of the row's last call."""
    completions: list[tuple[int, list[float], SamplingMasks | None]]
    """(input position of the first sampled token's prediction, behaviour logprobs, the constraint's masks)
    per merged call."""
    routing: list[torch.Tensor]
    """Recorded routing of the calls, the last call's first: written in this order, each earlier call's
    own rows overwrite the later call's copy of its span."""


def _segment_rows(segments: list, *, merge: bool) -> list[_Row]:
    rows: list[_Row] = []
    for segment in segments:
        tokens = segment.prompt_token_ids + segment.token_ids
        completion = (len(segment.prompt_token_ids) - 1, list(segment.logprobs), segment.sampling_masks)
        routing = [segment.routed_experts] if segment.routed_experts is not None else []
        previous = rows[-1] if rows else None
        if merge and previous is not None and segment.prompt_token_ids[: len(previous.tokens)] == previous.tokens:
            # the later call's routing first, then the earlier calls' own rows over their span
            rows[-1] = _Row(tokens, [*previous.completions, completion], routing + previous.routing)
        else:
            rows.append(_Row(tokens, [completion], routing))
    return rows


def segment_logprobs(
    model: MoETransformer, batch: TrainingSegments, *, temperature: float, routing_replay: bool
) -> torch.Tensor:
    """Logprobs of the batch's targets under `model`, at the rollout temperature.

    Only the loss positions (the sampled tokens) get logits; the rest of the [B, T] result is 0 and
    carries no gradient. The loss reads nothing else, and a rollout's row is mostly prompt and tool output.
    """
    return segment_logprobs_and_entropy(model, batch, temperature=temperature, routing_replay=routing_replay)[0]


def segment_logprobs_and_entropy(
    model: MoETransformer,
    batch: TrainingSegments,
    *,
    temperature: float,
    routing_replay: bool,
    prefix: SharedPrefix | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """segment_logprobs plus the policy's next-token entropy at the same positions ([B, T] each, 0 elsewhere).

    Both come from one log-softmax over the loss positions' logits, so the entropy costs a product and a
    sum over the vocabulary. prefix: the batch holds the rows after this shared prefix (suffix_batch).
    """
    mask = batch.loss_mask.bool()
    output = model(
        batch.input_ids,
        routing_override=batch.routed_experts if routing_replay else None,
        compute_router_losses=False,
        logits_mask=mask,
        prefix=prefix,
    )
    logits = output.logits.float() / temperature
    disallowed = None
    if batch.masked_positions is not None:
        # Tokens drawn under the copy constraint's mask: their logprobs (and entropies) are those of the masked
        # distribution, as the behaviour policy recorded them; a forced token (one allowed) carries no gradient.
        rows, positions = batch.masked_positions.unbind(1)
        if not bool(mask[rows, positions].all()):
            raise ValueError("masked_positions must be loss positions (sampled tokens).")
        loss_index = (mask.view(-1).long().cumsum(0) - 1).view(mask.shape)  # row of each loss position's logits
        disallowed = torch.zeros(logits.shape[-2:], dtype=torch.bool, device=logits.device)
        disallowed[loss_index[rows, positions]] = ~batch.masked_allowed.to(logits.device)
        disallowed = disallowed.view(logits.shape)
        logits = logits.masked_fill(disallowed, float("-inf"))
    log_probs = torch.log_softmax(logits, dim=-1)
    sampled = log_probs.gather(-1, batch.targets[mask].long().view(1, -1, 1)).view(-1)
    # a masked token's p log p is 0 * -inf: count it as 0 (and keep NaN out of the backward pass)
    finite = log_probs if disallowed is None else log_probs.masked_fill(disallowed, 0.0)
    entropy = -(log_probs.exp() * finite).sum(-1).view(-1)
    zeros = torch.zeros(mask.shape, dtype=sampled.dtype, device=sampled.device)
    return zeros.masked_scatter(mask, sampled), zeros.masked_scatter(mask, entropy)


def rl(
    config: RLConfig,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_rollouts: Callable[[int, list[RolloutRecord], list[float]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run (or resume) GRPO; returns the metrics of the steps run by this call.

    on_rollouts(step, records, advantages) receives every step's rollouts (e.g. to store them for
    the trace browser with webapp.agents.services.rollout_record).
    """
    from sandboxes import get_backend

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    # 1. The policy (trained copy), its optimizer, and the serving copy that generates rollouts.
    model, tokenizer, _ = load_checkpoint(config.init_checkpoint)
    model.train()
    reference_model = reference_model_load(config)
    optimizer = build_optimizer(model, config.optimizer)
    scheduler = build_scheduler(optimizer, config.optimizer, total_steps=config.steps)
    start_step = 0
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        restored = load_train_checkpoint(path=checkpoint, model=model, optimizer=optimizer, scheduler=scheduler)
        start_step = int(restored.data_position["step"])
    else:
        torch.manual_seed(config.seed)
    rollouts_per_step = config.tasks_per_step * config.group_size
    chat_model = ChatModel(
        copy.deepcopy(model), tokenizer, name="rl-policy",
        engine_config=EngineConfig(max_batch_size=rollouts_per_step),
    )
    limits = AgentLimits(
        max_turns=config.max_turns,
        max_tokens=config.max_turns * config.max_tokens_per_turn * 2,
        max_tokens_per_turn=config.max_tokens_per_turn,
        wall_time_s=config.rollout_wall_time_s,
        context_tokens=model.config.max_seq_len,
        temperature=config.temperature,
        top_p=config.top_p,
    )
    backend = get_backend(config.sandbox_backend)
    reward_config = RewardConfig(partial_credit=config.partial_credit)
    history: list[dict[str, Any]] = []
    try:
        for step in range(start_step, config.steps):
            # 2-3. Rollouts in sandboxes, scored by hidden tests.
            rollout_started = time.perf_counter()
            records = rollouts_collect(
                tasks=tasks_for_step(config, step), group_size=config.group_size, backend=backend,
                chat_model=chat_model, limits=limits, seed=config.seed * 1_000_003 + step * 7919,
                reward_config=reward_config, max_workers=rollouts_per_step,
            )
            rollout_seconds = time.perf_counter() - rollout_started

            # 4. Rewards -> advantages (masked rollouts get none).
            advantages = rollout_advantages(records, config.grpo)
            batches = segments_to_batches(
                records=records, advantages=advantages, micro_batch_size=config.micro_batch_size,
                pad_id=tokenizer.pad_id, with_routing=config.routing_replay and model.config.is_moe,
                merge_turns=config.grpo.normalization == "token",
            )

            # 5. Clipped policy-gradient updates against the behaviour logprobs.
            train_started = time.perf_counter()
            lr = scheduler.get_last_lr()[0]
            update_stats = policy_updates(
                model=model, optimizer=optimizer, batches=batches, config=config, reference_model=reference_model
            )
            if update_stats["trained_tokens"]:
                scheduler.step()  # the schedule counts steps that updated the weights
            with torch.no_grad():
                chat_model.model.load_state_dict(model.state_dict())
            train_seconds = time.perf_counter() - train_started

            # 6. Log and checkpoint.
            valid = [r for r in records if r.valid]
            metrics = {
                "step": step + 1,
                "rollouts": len(records),
                "valid_rollouts": len(valid),
                "masked_rollouts": len(records) - len(valid),
                "mean_reward": sum(r.reward for r in valid) / len(valid) if valid else None,
                "success_rate": sum(r.passed for r in valid) / len(valid) if valid else None,
                "mean_completion_tokens": sum(r.completion_tokens for r in records) / max(len(records), 1),
                "mean_turns": sum(r.turns for r in records) / max(len(records), 1),
                "segments": sum(b.input_ids.shape[0] for b in batches),
                "rollout_seconds": rollout_seconds,
                "train_seconds": train_seconds,
                "lr": lr,
                **update_stats,
            }
            history.append(metrics)
            _append_jsonl(run_dir / METRICS_FILE, metrics)
            _append_jsonl(run_dir / "rollouts.jsonl", {"step": step + 1, "rollouts": [
                {"task_id": r.task_id, "group": r.group, "valid": r.valid, "reward": r.reward, "passed": r.passed,
                 "tests_total": r.tests_total,
                 "status": r.status, "turns": r.turns, "completion_tokens": r.completion_tokens,
                 "advantage": float(a)}
                for r, a in zip(records, advantages.tolist(), strict=True)
            ]})
            if on_rollouts is not None:
                on_rollouts(step + 1, records, advantages.tolist())
            if on_step is not None:
                on_step(metrics)
            if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
                save_train_checkpoint(
                    run_dir=run_dir, step=step + 1, model=model, tokenizer=tokenizer, optimizer=optimizer,
                    scheduler=scheduler, data_position={"step": step + 1},
                    run_config={"stage": "rl", **asdict(config)}, metrics=metrics,
                    keep_last=config.keep_checkpoints,
                )
    finally:
        chat_model.close()
    return history


def reference_model_load(config: RLConfig) -> MoETransformer | None:
    """The frozen starting policy the KL penalty pulls towards, or None when config.grpo.kl_coef is 0.

    Loaded from init_checkpoint, never from the run's latest checkpoint, so a resumed run keeps the same
    reference.
    """
    if config.grpo.kl_coef == 0:
        return None
    reference, _, _ = load_checkpoint(config.init_checkpoint)
    reference.eval()
    reference.requires_grad_(False)
    return reference


SHARED_PREFIX_MIN_TOKENS = 64
"""Rows share a prefix in the learner only when it is at least this long: below it the saving is noise."""


def shared_prefix_groups(
    batches: list[TrainingSegments], *, routing_replay: bool, min_tokens: int = SHARED_PREFIX_MIN_TOKENS
) -> list[tuple[int, list[int]]]:
    """(prefix length, batch indices) of one-row batches that begin with the same tokens; length 0: the
    batch runs on its own. Groups come in the order of their first batch.

    A group's rollouts share the system prompt, the tool schemas and the task. The prefix ends before the
    first loss position of every member (its outputs are all keys, never logits), and with routing replay
    the members' recorded routing over it must agree too. Rollouts sampled by different policy versions
    route the prompt differently (one update of the toy policy moves some token's experts within the
    first ~60 positions) and finish in any order, so a batch joins the group it agrees with longest, not
    just the one before it; it starts a group of its own rather than cut an existing group's prefix short.
    """
    clusters: list[list] = []  # [shared length (the lead's first loss position while alone), members]
    singles: list[int] = []
    for index, batch in enumerate(batches):
        if batch.input_ids.shape[0] != 1 or not bool(batch.loss_mask.any()):
            singles.append(index)
            continue
        first_loss = int(batch.loss_mask[0].nonzero()[0, 0])
        best, best_common = None, 0
        for cluster in clusters:
            length, members = cluster
            lead = batches[members[0]]
            limit = min(first_loss, length)
            common = _common_prefix_length(lead.input_ids[0, :limit], batch.input_ids[0, :limit])
            if routing_replay and (lead.routed_experts is None) != (batch.routed_experts is None):
                common = 0
            elif routing_replay and lead.routed_experts is not None and common:
                common = _common_prefix_length(lead.routed_experts[0, :common], batch.routed_experts[0, :common])
            # A lone lead's length is only its first loss position; a formed group keeps most of its prefix.
            keeps_prefix = len(members) == 1 or common >= 0.9 * length
            if common >= min_tokens and keeps_prefix and common > best_common:
                best, best_common = cluster, common
        if best is None:
            clusters.append([first_loss, [index]])
        else:
            best[0] = best_common
            best[1].append(index)
    groups = [(length, members) if len(members) > 1 else (0, members) for length, members in clusters]
    groups += [(0, [index]) for index in singles]
    return sorted(groups, key=lambda group: group[1][0])


def _common_prefix_length(first: torch.Tensor, second: torch.Tensor) -> int:
    length = min(first.shape[0], second.shape[0])
    if length == 0:
        return 0
    differs = (first[:length] != second[:length]).reshape(length, -1).any(dim=1).nonzero()
    return int(differs[0, 0]) if differs.numel() else length


def suffix_batch(batch: TrainingSegments, prefix_length: int) -> TrainingSegments:
    """The batch's rows after their first prefix_length positions, for segment_logprobs_and_entropy(prefix=)."""
    masked_positions = batch.masked_positions
    if masked_positions is not None:
        masked_positions = masked_positions - torch.tensor([0, prefix_length], dtype=masked_positions.dtype)
    return TrainingSegments(
        input_ids=batch.input_ids[:, prefix_length:],
        targets=batch.targets[:, prefix_length:],
        loss_mask=batch.loss_mask[:, prefix_length:],
        behaviour_logprobs=batch.behaviour_logprobs[:, prefix_length:],
        advantages=batch.advantages,
        routed_experts=None if batch.routed_experts is None else batch.routed_experts[:, prefix_length:],
        masked_positions=masked_positions,
        masked_allowed=batch.masked_allowed,
    )


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


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
