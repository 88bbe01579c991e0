"""RL with GRPO: rollouts of the policy in real sandboxes, test-based rewards, clipped policy update.

Launch:

    .venv/bin/python manage.py rl --run-dir var/runs/rl --init-checkpoint var/runs/sft/checkpoints/step-00000100 \\
        --tasks 64 --tasks-per-step 4 --group-size 8 --steps 200

Each step, readable top to bottom in `rl()` (the learner is training.train.learner.Learner, the same one the
asynchronous driver training.rollout.driver uses; both write the same metrics and rollouts.jsonl rows):
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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from training.agent.config import AgentLimits
from training.engine import EngineConfig
from training.rollout.run_dir import METRICS_FILE, ROLLOUTS_FILE, RolloutRow, append_jsonl, truncate_jsonl
from training.serving import ChatModel
from training.tasks.reward import RewardConfig
from training.train.grpo import GRPOConfig
from training.train.learner import (
    Learner,
    UpdateResult,
    policy_updates,
    reference_model_load,
    rollout_advantages,
    rollout_metrics,
    update_metrics,
)
from training.train.loop import OptimizerConfig, TrainConfigError
from training.train.rollouts import RolloutRecord, rollouts_collect, tool_statistics
from training.train.segments import (
    SHARED_PREFIX_MIN_TOKENS,
    TrainingSegments,
    segment_logprobs,
    segment_logprobs_and_entropy,
    segments_to_batches,
    shared_prefix_groups,
    suffix_batch,
)

__all__ = [
    "SHARED_PREFIX_MIN_TOKENS",
    "RLConfig",
    "TrainingSegments",
    "policy_updates",
    "reference_model_load",
    "rl",
    "rollout_advantages",
    "rollout_rows",
    "segment_logprobs",
    "segment_logprobs_and_entropy",
    "segments_to_batches",
    "shared_prefix_groups",
    "suffix_batch",
    "tasks_for_step",
]


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

    precision: str | None = None
    """Numerics of the policy's expert matmuls ("fp32", "bf16", "mxfp8"); None keeps the checkpoint's."""

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


def tasks_for_step(config: RLConfig, step: int) -> list:
    from training.tasks.toy import generate_toy_task, toy_task_seeds

    pool = toy_task_seeds(split="train", count=config.tasks, start=config.task_seed_start)
    return [generate_toy_task(pool[(step * config.tasks_per_step + i) % len(pool)]) for i in range(config.tasks_per_step)]


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

    # 1. The policy (trained copy, with its optimizer) and the serving copy that generates rollouts.
    learner = Learner(config)
    restored = learner.restore(run_dir)
    start_step = int(restored["step"]) if restored is not None else 0
    for name in (METRICS_FILE, ROLLOUTS_FILE):
        truncate_jsonl(run_dir / name, max_step=start_step)
    rollouts_per_step = config.tasks_per_step * config.group_size
    # An imported model's tokenizer gets its own chat template and tool-call syntax (training.hf.serving).
    chat_model = ChatModel.for_policy(
        copy.deepcopy(learner.model), learner.tokenizer, name="rl-policy",
        engine_config=EngineConfig(max_batch_size=rollouts_per_step),
    )
    limits = _agent_limits(config, context_tokens=learner.model.config.max_seq_len)
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

            # 4-5. Advantages, clipped policy-gradient updates, the lr schedule; then the serving copy follows.
            result = learner.update(records)
            with torch.no_grad():
                chat_model.model.load_state_dict(learner.model.state_dict())

            # 6. Log and checkpoint (logs first: a resumed run truncates lines past its checkpoint).
            metrics = {
                "step": step + 1,
                **rollout_metrics(records),
                **update_metrics(result),
                "stage_seconds": {"rollouts": rollout_seconds, "update": result.seconds},
            }
            history.append(metrics)
            for row in rollout_rows(step=step + 1, records=records, result=result):
                append_jsonl(run_dir / ROLLOUTS_FILE, row.as_dict())
            append_jsonl(run_dir / METRICS_FILE, metrics)
            if on_rollouts is not None:
                on_rollouts(step + 1, records, result.advantages)
            if on_step is not None:
                on_step(metrics)
            if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
                learner.save(
                    run_dir=run_dir, step=step + 1, data_position={"step": step + 1},
                    run_config={"stage": "rl", **asdict(config)}, metrics=metrics, keep_last=config.keep_checkpoints,
                )
    finally:
        chat_model.close()
    return history


def _agent_limits(config: RLConfig, *, context_tokens: int) -> AgentLimits:
    return AgentLimits(
        max_turns=config.max_turns,
        max_tokens=config.max_turns * config.max_tokens_per_turn * 2,
        max_tokens_per_turn=config.max_tokens_per_turn,
        wall_time_s=config.rollout_wall_time_s,
        context_tokens=context_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
    )


def rollout_rows(*, step: int, records: list[RolloutRecord], result: UpdateResult) -> list[RolloutRow]:
    """The rollouts.jsonl rows of one synchronous step (the schema the driver writes, staleness 0)."""
    rows = []
    sample_of_group: dict[int, int] = {}
    for record, advantage in zip(records, result.advantages, strict=True):
        sample_index = sample_of_group.get(record.group, 0)
        sample_of_group[record.group] = sample_index + 1
        group_id = f"step-{step:06d}-group-{record.group}"
        stats = tool_statistics(record.agent_result.events if record.agent_result is not None else [])
        rows.append(
            RolloutRow(
                step=step, rollout_id=f"{group_id}-sample-{sample_index}", group_id=group_id, task_id=record.task_id,
                sample_index=sample_index, group_position=record.group, valid=record.valid, reward=record.reward,
                passed=record.passed, tests_total=record.tests_total, status=record.status, advantage=float(advantage),
                completion_tokens=record.completion_tokens, turns=record.turns, policy_version=step - 1,
                tool_calls=stats["tool_calls"], tools_used=stats["tools_used"],
            )
        )
    return rows
