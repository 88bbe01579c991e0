"""Asynchronous GRPO with a Ray single controller: this process owns the control flow.

    .venv/bin/python -m training.rollout.driver --config run.json      (a JSON AsyncRLConfig)

Actors:
- `InferenceActor`: the generation engine (training.serving.ChatModel) with versioned weights;
  after every policy update the driver pushes the new weights (one `ray.put`, then `set_weights`
  on every actor) before the new version is used for dispatch.
- `RolloutWorker`: an environment server. It creates the task's sandbox, runs the product's agent
  loop (training.agent.loop.run_agent) with a policy that calls an inference actor, scores the
  result with the hidden tests, and returns the tokens/logprobs the learner needs.

The driver feeds the continuous `RolloutScheduler` (bounded staleness, a slow rollout never holds
the others back), trains in a learner thread with the trainer's GRPO update
(training.train.rl.policy_updates) while generation continues, and checkpoints after every update.
The checkpoint records which groups were trained on; a restarted driver (killed driver, lost
worker, redelivered Celery task) resumes from it, re-runs only groups that were never trained on,
and truncates the logs to the checkpoint, so no rollout is counted twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import queue
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.rollout.scheduler import (
    RolloutRequest,
    RolloutSample,
    RolloutScheduler,
    SchedulerConfig,
    SchedulerConfigError,
)
from training.train.objective_options import objective_options_problem

if TYPE_CHECKING:  # torch-free at import time: the web process validates launch configs with this module
    from training.tasks.reward import RewardConfig
    from training.train.rl import RLConfig

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
ROLLOUTS_FILE = "rollouts.jsonl"
STATUS_FILE = "driver_status.json"
TRACES_DIR = "traces"


def trace_path(run_dir: str | Path, rollout_id: str) -> Path:
    """Where the full agent trace (events, messages, diff) of a trained rollout is stored."""
    return Path(run_dir) / TRACES_DIR / (rollout_id.replace("/", "__").replace("~", "_") + ".json")


def checkpointed_version(run_dir: str | Path) -> int:
    """Policy version of the newest complete checkpoint of the run (0 when there is none)."""
    from training.train.state import latest_checkpoint

    path = latest_checkpoint(run_dir)
    return int(path.name.rsplit("-", 1)[-1]) if path is not None else 0


def run_finished(run_dir: str | Path) -> bool:
    """True when the run's driver last reported it finished: all its steps done, or its time budget spent."""
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text()).get("state") == "finished"
    except (OSError, ValueError):
        return False


class AsyncRLConfigError(ValueError):
    """Contradictory settings of an asynchronous RL run; the message says how to fix them."""


@dataclass
class AsyncRLConfig:
    """One asynchronous GRPO run on toy bug-fixing tasks."""

    run_dir: str
    """Checkpoints, metrics.jsonl and rollouts.jsonl go here; starting again on it resumes the run."""
    init_checkpoint: str
    """Policy checkpoint to start from (normally the SFT result)."""
    steps: int = 10
    """Policy updates to run in total (a resumed run continues up to this number)."""
    tasks: int = 16
    """Size of the pool of train-split toy tasks, cycled through in order."""
    task_seed_start: int = 0
    """First train-split toy task index of the pool."""
    group_size: int = 4
    """Rollouts per task; GRPO advantages are relative to the group."""
    groups_per_step: int = 2
    """Complete groups consumed by one policy update."""
    max_staleness: int = 1
    """Largest policy-version lag between generating a sample and training on it (0 = synchronous)."""
    probe_size: int = 0
    """Rollouts of each group run first; when they all earn the same reward the group is abandoned
    (logged, not trained on) instead of finishing it for a zero gradient. 0 runs every group in full."""
    rollout_workers: int = 4
    """Environment servers (Ray actors), each running one rollout at a time."""
    inference_actors: int = 1
    """Generation-engine actors; rollout workers are spread over them round-robin."""
    max_turns: int = 4
    """Tool-calling turns per rollout."""
    max_tokens_per_turn: int = 256
    """Completion tokens per model call. The toy tier's fixing edit takes up to ~200 tokens of the default
    tokenizer as an edit_file call (99 median) and up to 114 as the expert's replace_lines call (87
    median), so a lower cap makes tasks unsolvable."""
    context_tokens: int = 4096
    """Context the agent loop may fill; must fit the model's max_seq_len."""
    temperature: float = 1.0
    """Sampling temperature of rollouts and of the training logprobs."""
    rollout_wall_time_s: float = 300.0
    """Wall-clock limit of one rollout's agent loop."""
    lr: float = 1e-5
    """Peak learning rate of the policy update (constant after the warmup unless min_lr_ratio < 1)."""
    warmup_steps: int = 0
    """Updates of linear warmup from ~0 to lr. A fresh Adam's first steps move every parameter by ~lr
    whatever the gradient's size (its second-moment estimate is still one sample); a ramp lets that
    estimate settle before the steps reach full size."""
    min_lr_ratio: float = 1.0
    """Learning rate at the last of `steps` updates as a fraction of lr, reached by a cosine decay over the
    last lr_decay_fraction of the updates after the warmup; 1 keeps lr constant. The schedule counts
    updates (policy versions, trained or not: a group whose rollouts agree still takes one), so a run
    stopped by a clock should set steps to the updates its budget allows."""
    lr_decay_fraction: float = 1.0
    """Share of the updates after the warmup over which lr decays to min_lr_ratio * lr (the ones before
    hold lr); 0.25 anneals over the last quarter."""
    time_budget_minutes: float | None = None
    """Training wall-clock budget: the run stops when it is spent (after the update in progress), and the
    lr decay follows the clock as well as the update count (whichever is further along; on the clock it
    covers the last lr_decay_fraction of the budget), so a clock-bound run ends its decay at the clock
    whatever rate the machine reaches. Time spent before a pause counts: it is kept in checkpoints. None
    runs until `steps` updates exist."""
    gain_lr_scale: float = 1.0
    """Learning-rate multiplier for normalisation gains (training.train.loop.OptimizerConfig): at an RL
    learning rate Adam barely moves a gain of ~1.0, and the gains set how sharp the policy samples."""
    negative_advantage_weight: float = 1.0
    """Weight of below-group-mean rollouts in the update: 1 is GRPO, 0 reinforces only rollouts that
    beat their group (RAFT-style, training.train.grpo.GRPOConfig.negative_advantage_weight)."""
    entropy_coef: float = 0.0
    """Weight of the policy's mean token entropy in the update (training.train.grpo.GRPOConfig.entropy_coef):
    0 leaves it out, > 0 is an exploration bonus, < 0 sharpens the policy towards its modes. It acts on the
    tokens the update trains: the rollouts of groups whose rewards differ."""
    entropy_scope: str = "all"
    """Rollouts the entropy term covers: "all" trained ones, or "positive" (only those that beat their
    group, so sharpening does not lock in wrong choices; training.train.grpo.GRPOConfig.entropy_scope)."""
    normalize_advantage_std: bool = False
    """Divide each group's centred rewards by the group's reward standard deviation, as the GRPO paper does
    (training.train.grpo.GRPOConfig.normalize_advantage_std): a rare success in a group of 16 then weighs ~4
    times a success in an even group instead of ~2 times, so hard tasks' rare wins count for more."""
    expert_guidance: bool = False
    """When none of a group's valid rollouts passed, the scripted expert solves the task in a sandbox and its
    trajectory joins the group as one more member, scored by the learner's own logprobs (importance ratio 1):
    the group then carries a gradient towards the fix instead of none (training.train.guidance)."""
    kl_coef: float = 0.0
    """Weight of the per-token KL penalty to init_checkpoint's policy (training.train.grpo.GRPOConfig.kl_coef):
    0 leaves it out; > 0 keeps the policy near where it started, at the cost of a second model in the learner
    and one more forward pass per update."""
    updates_per_step: int = 1
    """Optimizer steps on each batch (later ones are off-policy, handled by the clipped ratio)."""
    partial_credit: bool = False
    """Reward the fraction of passing hidden tests instead of 0/1."""
    reference_similarity_weight: float = 0.0
    """A failed rollout scores this weight times its closest edit_file call's similarity to the task's
    reference fix (SWE-RL-style shaping, training.tasks.reward.RewardConfig.reference_similarity_weight):
    groups where every rollout failed then still train, towards the near-misses. 0 keeps rewards test-only;
    must be below 1 so a pass always scores highest. Held-out evaluation never uses it. On the toy tier's
    1.1M-parameter policy 0.3 cost 6 points of held-out pass@1 (docs/notebook/rl-learning-stops-28-42.md,
    stop 35): the all-fail groups it trains sharpen failing edits."""
    copy_constraint: bool = True
    """The inference actors let edit_file's old_str be only text of the conversation's tool results
    (training.copy_constraint), exactly as the product serves the model; False samples it freely."""
    sandbox_backend: str | None = None
    """Sandbox backend the rollout workers use (None: the configured default)."""
    ray_address: str | None = None
    """Ray cluster to join; None starts a private local instance."""
    ray_num_cpus: int = 2
    """CPUs of the private local Ray instance (ignored when joining a cluster)."""
    sandbox_hosts: bool = False
    """Run rollout sandboxes on the fleet's sandbox-host actors (sandboxes.fleet) instead of in each
    rollout worker; a private local Ray offers rollout_workers sandbox slots for them."""
    fleet_heartbeats: bool = True
    """With sandbox_hosts, hosts report heartbeats to the fleet dashboard (webapp.fleet)."""
    seed: int = 0
    """Seeds rollout sampling and the torch RNG."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk."""

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "tasks",
            "groups_per_step",
            "rollout_workers",
            "inference_actors",
            "max_turns",
            "max_tokens_per_turn",
            "updates_per_step",
            "keep_checkpoints",
            "ray_num_cpus",
        ):
            if getattr(self, name) < 1:
                raise AsyncRLConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise AsyncRLConfigError("group_size must be >= 2: the GRPO baseline is the mean of the group")
        if self.max_staleness < 0:
            raise AsyncRLConfigError("max_staleness must be >= 0 (0 runs synchronous batches)")
        if self.temperature <= 0:
            raise AsyncRLConfigError("temperature must be > 0: greedy rollouts of one task are identical")
        if self.lr <= 0:
            raise AsyncRLConfigError("lr must be > 0")
        if self.warmup_steps < 0:
            raise AsyncRLConfigError(f"warmup_steps must be >= 0 (0 starts at the full lr), got {self.warmup_steps}")
        if self.gain_lr_scale <= 0:
            raise AsyncRLConfigError(f"gain_lr_scale must be > 0 (1 trains gains at lr), got {self.gain_lr_scale}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise AsyncRLConfigError(f"min_lr_ratio must be in [0, 1] (1 keeps lr constant), got {self.min_lr_ratio}")
        if not 0 < self.lr_decay_fraction <= 1:
            raise AsyncRLConfigError(
                f"lr_decay_fraction must be in (0, 1] (1 decays over every update after the warmup), "
                f"got {self.lr_decay_fraction}"
            )
        if self.time_budget_minutes is not None and not self.time_budget_minutes > 0:
            raise AsyncRLConfigError(
                f"time_budget_minutes must be > 0 (leave it empty to run until `steps` updates), "
                f"got {self.time_budget_minutes}"
            )
        problem = objective_options_problem(
            negative_advantage_weight=self.negative_advantage_weight,
            entropy_coef=self.entropy_coef,
            entropy_scope=self.entropy_scope,
            kl_coef=self.kl_coef,
        )
        if problem:
            raise AsyncRLConfigError(problem.removesuffix("."))
        from training.tasks.base import TaskError

        try:
            self.reward_config  # noqa: B018 - its checks (the shaping weight's range) are the reward's own
        except TaskError as error:
            raise AsyncRLConfigError(str(error).removeprefix("RewardConfig.")) from error
        try:
            self.scheduler_config  # noqa: B018 - its checks (probe_size) are the scheduler's own
        except SchedulerConfigError as error:
            # Without the class prefix the message starts with the field, which the launch form keys on.
            raise AsyncRLConfigError(str(error).removeprefix("SchedulerConfig.")) from error
        if self.inference_actors > self.rollout_workers:
            raise AsyncRLConfigError(
                f"inference_actors={self.inference_actors} exceeds rollout_workers={self.rollout_workers}; "
                "extra inference actors would never get a request, lower inference_actors"
            )
        if not Path(self.init_checkpoint).is_dir():
            raise AsyncRLConfigError(
                f"init_checkpoint {self.init_checkpoint!r} is not a checkpoint directory; point it at a "
                "directory written by training.checkpoint.save_checkpoint (e.g. the SFT result)"
            )

    @property
    def reward_config(self) -> RewardConfig:
        """The RewardConfig every rollout of this run is scored with."""
        from training.tasks.reward import RewardConfig

        return RewardConfig(
            partial_credit=self.partial_credit, reference_similarity_weight=self.reference_similarity_weight
        )

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_in_flight=self.rollout_workers,
            group_size=self.group_size,
            groups_per_step=self.groups_per_step,
            max_staleness=self.max_staleness,
            probe_size=self.probe_size,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AsyncRLConfig:
        known = {item.name for item in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise AsyncRLConfigError(f"unknown AsyncRLConfig fields {unknown}; known fields: {sorted(known)}")
        return cls(**data)


def task_for_group(config: AsyncRLConfig, group_index: int):
    from training.tasks.toy import generate_toy_task, toy_task_seeds

    pool = toy_task_seeds(split="train", count=config.tasks, start=config.task_seed_start)
    return generate_toy_task(pool[group_index % len(pool)])


# --------------------------------------------------------------------------------------- actors
class InferenceServer:
    """Body of the inference actor: a ChatModel whose weights carry a version number."""

    def __init__(self, checkpoint_dir: str, run_dir: str, max_batch_size: int, copy_constraint: bool = True) -> None:
        import torch

        from training.engine import EngineConfig
        from training.serving import ChatModel
        from training.train.state import latest_checkpoint, load_train_checkpoint

        torch.set_num_threads(1)
        chat_model = ChatModel.load(
            checkpoint_dir, engine_config=EngineConfig(max_batch_size=max_batch_size), copy_constraint=copy_constraint
        )
        self.chat_model = chat_model
        self.version = 0
        self._weights_lock = threading.Lock()
        # A restarted actor (its process died) comes back with the newest checkpointed weights,
        # which are never older than what the driver last pushed.
        latest = latest_checkpoint(run_dir)
        if latest is not None:
            restored = load_train_checkpoint(path=latest, model=chat_model.model, restore_rng=False)
            self.version = int(restored.data_position["version"])

    def pid(self) -> int:
        return os.getpid()

    def set_weights(self, version: int, state_dict: dict) -> int:
        import torch

        # Decoding may run between two calls of a rollout; the clipped importance ratio against the
        # recorded logprobs accounts for samples that straddle a weight update.
        with self._weights_lock, torch.no_grad():
            self.chat_model.model.load_state_dict(state_dict)
            self.version = version
        return version

    def complete(self, **kwargs) -> dict:
        version = self.version
        completion = self.chat_model.complete(**kwargs)
        return {
            "content": completion.content,
            "tool_calls": completion.tool_calls,
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "finish_reason": completion.finish_reason,
            "prompt_token_ids": list(completion.prompt_token_ids),
            "token_ids": list(completion.token_ids),
            "logprobs": list(completion.logprobs),
            "routed_experts": completion.routed_experts,
            "sampling_masks": completion.sampling_masks,
            "version": version,
        }


class RemoteInferencePolicy:
    """The agent-loop Policy over an inference actor, recording what the learner needs."""

    def __init__(self, inference, *, seed: int) -> None:
        self.inference = inference
        self.name = "ray-inference"
        self.seed = seed
        self.segments: list = []
        self.versions: list[int] = []

    def complete(self, *, messages, tools, max_tokens, temperature, top_p, timeout_s):
        import ray

        from training.agent.policy import PolicyError, PolicyToolCall, PolicyTurn
        from training.train.rollouts import Segment

        started = time.monotonic()
        try:
            result = ray.get(
                self.inference.complete.remote(
                    messages=messages,
                    tools=tools or None,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    seed=self.seed + len(self.segments),
                    timeout_s=timeout_s,
                ),
                timeout=timeout_s + 30,
            )
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, ValueError):  # the conversation outgrew the context: the agent's doing
                raise PolicyError(str(error.cause), infrastructure=False) from error
            raise PolicyError(f"inference actor failed: {error}", infrastructure=True) from error
        except (ray.exceptions.RayError, TimeoutError) as error:
            raise PolicyError(f"inference actor unreachable: {error}", infrastructure=True) from error
        self.segments.append(
            Segment(
                prompt_token_ids=result["prompt_token_ids"],
                token_ids=result["token_ids"],
                logprobs=result["logprobs"],
                routed_experts=result["routed_experts"],
                sampling_masks=result["sampling_masks"],
            )
        )
        self.versions.append(result["version"])
        calls = [
            PolicyToolCall(
                id=call["id"], name=call["function"]["name"], arguments_json=call["function"]["arguments"]
            )
            for call in result["tool_calls"]
        ]
        return PolicyTurn(
            content=result["content"],
            tool_calls=calls,
            prompt_tokens=result["prompt_tokens"],
            completion_tokens=result["completion_tokens"],
            finish_reason=result["finish_reason"],
            token_ids=result["token_ids"],
            logprobs=result["logprobs"],
            duration_s=time.monotonic() - started,
        )


def _tool_statistics(events: list[dict]) -> dict:
    """Tool calls, tool-calling turns, turns with parallel calls, and the tool names used."""
    per_turn: dict[int, int] = {}
    names: dict[str, int] = {}
    for event in events:
        if event.get("kind") == "tool_call":
            per_turn[event["turn"]] = per_turn.get(event["turn"], 0) + 1
            name = event["payload"].get("name", "?")
            names[name] = names.get(name, 0) + 1
    return {
        "tool_calls": sum(per_turn.values()),
        "tool_turns": len(per_turn),
        "parallel_turns": sum(1 for count in per_turn.values() if count > 1),
        "tools_used": names,
    }


class RolloutServer:
    """Body of the rollout worker actor: one sandboxed agent run per call, scored by hidden tests."""

    def __init__(self, config_data: dict) -> None:
        import torch

        torch.set_num_threads(1)
        self.config = AsyncRLConfig.from_dict(config_data)
        self._fleet_snapshots: dict = {}

    def pid(self) -> int:
        return os.getpid()

    def _sandbox(self, task, fleet):
        from sandboxes import get_backend
        from training.tasks.sandboxing import DEFAULT_TASK_LIMITS, task_sandboxes_create

        if fleet is None:
            (sandbox,) = task_sandboxes_create(backend=get_backend(self.config.sandbox_backend), task=task)
            return sandbox
        from sandboxes.base import RepoSource

        snapshot = self._fleet_snapshots.get(task.task_id)
        if snapshot is None:
            with tempfile.TemporaryDirectory(prefix=f"flowstate-task-{task.task_id}-") as directory:
                task.materialize(Path(directory))
                snapshot = fleet.snapshot_create(source=RepoSource(kind="path", location=directory))
            self._fleet_snapshots[task.task_id] = snapshot
        return fleet.sandbox_create(snapshot=snapshot, limits=DEFAULT_TASK_LIMITS)

    def _limits(self):
        from training.agent.config import AgentLimits

        config = self.config
        return AgentLimits(
            max_turns=config.max_turns,
            max_tokens=config.max_turns * config.max_tokens_per_turn * 2,
            max_tokens_per_turn=config.max_tokens_per_turn,
            wall_time_s=config.rollout_wall_time_s,
            context_tokens=config.context_tokens,
            temperature=config.temperature,
            top_p=1.0,
        )

    def expert(self, *, group_index: int, fleet=None) -> dict:
        """The scripted expert's verified solution of the group's task, run like a rollout in a sandbox.

        Returns {"messages", "reward"}, or {"error"} when the expert could not solve it or a sandbox failed
        (the group is then trained without guidance, as before).
        """
        from sandboxes.base import SandboxError
        from training.tasks.reward import RewardInfrastructureError
        from training.train.scripted_expert import ExpertTrajectoryError, expert_trajectory_run

        task = task_for_group(self.config, group_index)
        try:
            trajectory = expert_trajectory_run(task=task, sandbox=self._sandbox(task, fleet), limits=self._limits())
        except (ExpertTrajectoryError, RewardInfrastructureError, SandboxError, OSError) as error:
            return {"error": f"{type(error).__name__}: {error}"}
        return {"messages": trajectory.messages, "reward": trajectory.reward, "task_id": trajectory.task_id}

    def run(
        self, *, group_index: int, sample_index: int, rollout_id: str, inference, seed: int, fleet=None
    ) -> dict:
        from sandboxes.base import SandboxError
        from training.agent.loop import run_agent
        from training.tasks.reward import RewardInfrastructureError, score_rollout
        from training.train.rollouts import RolloutRecord

        config = self.config
        task = task_for_group(config, group_index)
        started = time.monotonic()
        limits = self._limits()
        policy = RemoteInferencePolicy(inference, seed=seed)
        stats: dict = {"tool_calls": 0, "tool_turns": 0, "parallel_turns": 0, "tools_used": {}}
        timings = {"sandbox_s": 0.0, "agent_s": 0.0, "reward_s": 0.0}
        events: list[dict] = []

        trace: dict = {}

        def finish(record) -> dict:
            return {
                "record": record,
                "stats": stats,
                "timings": timings,
                "versions": policy.versions,
                "trace": {"prompt": task.prompt, "events": events, **trace},
                "task_id": task.task_id,
                "rollout_id": rollout_id,
            }

        def invalid(reason: str, turns: int = 0) -> dict:
            return finish(
                RolloutRecord(
                    task_id=task.task_id,
                    group=group_index,
                    valid=False,
                    reward=None,
                    segments=policy.segments,
                    status=f"infrastructure: {reason}",
                    turns=turns,
                    duration_s=time.monotonic() - started,
                )
            )

        try:
            sandbox = self._sandbox(task, fleet)
        except (SandboxError, OSError) as error:
            return invalid(f"sandbox creation failed: {error}")
        timings["sandbox_s"] = time.monotonic() - started
        try:
            agent_started = time.monotonic()
            try:
                result = run_agent(sandbox=sandbox, policy=policy, prompt=task.prompt, limits=limits)
            except (SandboxError, OSError, RuntimeError) as error:
                return invalid(f"{type(error).__name__}: {error}")
            timings["agent_s"] = time.monotonic() - agent_started
            events = result.events
            trace.update(
                status=result.status,
                reason=result.reason,
                final_message=result.final_message,
                diff=result.diff,
                messages=result.messages,
                turns=result.turns,
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                duration_s=result.duration_s,
            )
            stats = _tool_statistics(result.events)
            if result.infrastructure_error:
                return invalid(result.reason, result.turns)
            reward_started = time.monotonic()
            try:
                reward = score_rollout(
                    sandbox=sandbox,
                    task=task,
                    config=config.reward_config,
                    edit_arguments=_edit_file_arguments(result.events),
                )
            except RewardInfrastructureError as error:
                return invalid(str(error), result.turns)
            timings["reward_s"] = time.monotonic() - reward_started
            return finish(
                RolloutRecord(
                    task_id=task.task_id,
                    group=group_index,
                    valid=True,
                    reward=reward.value,
                    passed=reward.passed,
                    tests_total=reward.tests_total,
                    segments=policy.segments,
                    status=f"{result.status}: {result.reason}",
                    turns=result.turns,
                    duration_s=time.monotonic() - started,
                )
            )
        finally:
            try:
                sandbox.destroy()
            except SandboxError as error:
                logger.warning("could not destroy sandbox of %s: %s", rollout_id, error)


def _edit_file_arguments(events: list[dict]) -> list[dict]:
    """The parsed arguments of a rollout's edit_file calls, applied or rejected (unparseable ones skipped)."""
    return [
        event["payload"]["arguments"]
        for event in events
        if event["kind"] == "tool_call"
        and event["payload"]["name"] == "edit_file"
        and isinstance(event["payload"]["arguments"], dict)
    ]


# --------------------------------------------------------------------------------------- driver
@dataclass
class _RunState:
    version: int = 0
    counted_groups: set[str] = field(default_factory=set)
    started_at: float = field(default_factory=time.monotonic)
    earlier_training_seconds: float = 0.0
    """Training time of the run's earlier starts (restored from the checkpoint), for the time budget."""
    generated_samples: int = 0
    abandoned_lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned_groups: list = field(default_factory=list)
    """Groups the scheduler abandoned after their probe, logged with the next update."""


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _truncate_jsonl(path: Path, *, max_step: int) -> None:
    """Drop log lines of steps after the checkpoint we resume from (they will be redone)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= max_step
    ]
    temporary = path.with_suffix(".tmp")
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def update_config_for(config: AsyncRLConfig) -> RLConfig:
    """The RLConfig the trainer's update and optimizer read their settings from, matching this run's."""
    from training.train.grpo import GRPOConfig
    from training.train.loop import OptimizerConfig
    from training.train.rl import RLConfig

    return RLConfig(
        run_dir=config.run_dir,
        init_checkpoint=config.init_checkpoint,
        tasks=config.tasks,
        tasks_per_step=min(config.groups_per_step, config.tasks),
        group_size=config.group_size,
        steps=config.steps,
        updates_per_step=config.updates_per_step,
        temperature=config.temperature,
        routing_replay=True,
        grpo=GRPOConfig(
            negative_advantage_weight=config.negative_advantage_weight,
            entropy_coef=config.entropy_coef,
            entropy_scope=config.entropy_scope,
            kl_coef=config.kl_coef,
            normalize_advantage_std=config.normalize_advantage_std,
        ),
        max_turns=config.max_turns,
        max_tokens_per_turn=config.max_tokens_per_turn,
        optimizer=OptimizerConfig(
            lr=config.lr,
            warmup_steps=config.warmup_steps,
            weight_decay=0.0,
            min_lr_ratio=config.min_lr_ratio,
            decay_fraction=config.lr_decay_fraction,
            gain_lr_scale=config.gain_lr_scale,
        ),
    )


def run_async_rl(
    config: AsyncRLConfig,
    *,
    on_step: Callable[[dict], None] | None = None,
    on_rollout: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
) -> list[dict]:
    """Run (or resume) the experiment until `config.steps` updates exist; returns this call's metrics."""
    import ray
    import torch

    from training.checkpoint import load_checkpoint
    from training.train.guidance import expert_record_create
    from training.train.loop import build_optimizer, build_scheduler
    from training.train.rl import (
        policy_updates,
        reference_model_load,
        rollout_advantages,
        segments_to_batches,
    )
    from training.train.state import latest_checkpoint, load_train_checkpoint, save_train_checkpoint

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer, _ = load_checkpoint(config.init_checkpoint)
    model.train()
    update_config = update_config_for(config)
    optimizer = build_optimizer(model, update_config.optimizer)
    state = _RunState()

    def training_seconds() -> float:
        return state.earlier_training_seconds + time.monotonic() - state.started_at

    budget_seconds = None if config.time_budget_minutes is None else config.time_budget_minutes * 60
    lr_schedule = build_scheduler(
        optimizer,
        update_config.optimizer,
        total_steps=config.steps,
        time_fraction=None if budget_seconds is None else lambda: training_seconds() / budget_seconds,
    )
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        restored = load_train_checkpoint(
            path=checkpoint, model=model, optimizer=optimizer, scheduler=lr_schedule
        )
        state.version = int(restored.data_position["version"])
        state.counted_groups = set(restored.data_position["counted_groups"])
        state.earlier_training_seconds = float(restored.data_position.get("training_seconds", 0.0))
    else:
        torch.manual_seed(config.seed)
    for name in (METRICS_FILE, ROLLOUTS_FILE):
        _truncate_jsonl(run_dir / name, max_step=state.version)

    def budget_spent() -> bool:
        return budget_seconds is not None and training_seconds() >= budget_seconds

    if state.version >= config.steps or budget_spent():
        # Started again after the end (a resume, a relaunch): say so, so the monitor stops relaunching it.
        _write_status(run_dir, {"state": "finished", "pid": os.getpid(), "version": state.version})
        return []
    reference_model = reference_model_load(update_config)

    owns_ray = not ray.is_initialized()
    if owns_ray:
        if config.ray_address:
            ray.init(address=config.ray_address, ignore_reinit_error=True, log_to_driver=False)
        else:
            ray.init(
                num_cpus=config.ray_num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
                resources={"sandbox_slots": config.rollout_workers} if config.sandbox_hosts else None,
            )
    fleet, fleet_started = _fleet_start(config) if config.sandbox_hosts else (None, False)
    # A dead actor process is restarted by Ray; the call it was running fails, and the scheduler
    # re-dispatches that slot under a new rollout id instead of scoring it.
    inference_cls = ray.remote(InferenceServer).options(
        num_cpus=0, max_concurrency=config.rollout_workers + 2, max_restarts=-1, max_task_retries=0
    )
    worker_cls = ray.remote(RolloutServer).options(
        num_cpus=0, max_concurrency=1, max_restarts=-1, max_task_retries=0
    )
    config_data = asdict(config)
    inference_actors = [
        inference_cls.remote(config.init_checkpoint, str(run_dir), config.rollout_workers, config.copy_constraint)
        for _ in range(config.inference_actors)
    ]
    workers = [worker_cls.remote(config_data) for _ in range(config.rollout_workers)]
    idle_workers: queue.Queue = queue.Queue()
    for index, worker in enumerate(workers):
        idle_workers.put((worker, inference_actors[index % len(inference_actors)]))

    def push_weights(version: int) -> float:
        started = time.monotonic()
        weights = ray.put({name: tensor.detach().clone() for name, tensor in model.state_dict().items()})
        ray.get([actor.set_weights.remote(version, weights) for actor in inference_actors])
        return time.monotonic() - started

    if state.version > 0:
        push_weights(state.version)

    def group_stream():
        index = 0
        while True:
            yield f"group-{index:06d}", str(index)
            index += 1

    def submit_rollout(request: RolloutRequest, version: int) -> Future:
        worker, inference = idle_workers.get()
        seed = (
            config.seed * 1_000_003 + int(request.task_key) * 7919 + request.sample_index * 104_729 + version
        )
        future = worker.run.remote(
            group_index=int(request.task_key),
            sample_index=request.sample_index,
            rollout_id=request.rollout_id,
            inference=inference,
            seed=seed,
            fleet=fleet,
        ).future()
        future.add_done_callback(lambda _done: idle_workers.put((worker, inference)))
        return future

    history: list[dict] = []

    def train(groups: list[list[RolloutSample]], version: int) -> int:
        update_started = time.monotonic()
        samples = [sample for group in groups for sample in group]
        with state.abandoned_lock:
            abandoned, state.abandoned_groups = state.abandoned_groups, []
        abandoned_samples = [sample for group in abandoned for sample in group]
        records = []
        for group_position, group in enumerate(groups):
            for sample in group:
                sample.result["record"].group = group_position
                records.append(sample.result["record"])
        guides, guide_failures = expert_guides(groups) if config.expert_guidance else ([], [])
        # Expert members come after the rollouts, so advantages[i] is still records[i]'s for the logs below.
        advantages = rollout_advantages([*records, *guides], update_config.grpo)
        batches = segments_to_batches(
            records=[*records, *guides],
            advantages=advantages,
            micro_batch_size=1,
            pad_id=tokenizer.pad_id,
            with_routing=model.config.is_moe,
            merge_turns=update_config.grpo.normalization == "token",
        )
        lr_used = lr_schedule.get_last_lr()[0]
        update_stats = policy_updates(
            model=model, optimizer=optimizer, batches=batches, config=update_config, reference_model=reference_model
        )
        # The schedule follows the policy version even when this update trained nothing (a group that
        # all passed or all failed has no advantage): `steps` counts versions, and a schedule that
        # waited for trained updates would still be short of its decay when the run ends (40 % of a
        # run's updates can train nothing). If the first update trained nothing, torch warns once that
        # a schedule value was skipped; none was.
        lr_schedule.step()
        update_seconds = time.monotonic() - update_started
        new_version = version + 1
        state.counted_groups.update(group[0].request.group_id for group in [*groups, *abandoned])

        valid = [record for record in records if record.valid]
        results = [sample.result for sample in samples]
        tool_calls = sum(result["stats"]["tool_calls"] for result in results)
        tool_turns = sum(result["stats"]["tool_turns"] for result in results)
        wall = time.monotonic() - state.started_at
        state.generated_samples += len(samples) + len(abandoned_samples)
        # The first probe_size rollouts of every group, trained or abandoned: a sample of the policy on
        # fresh tasks that probing does not tilt (finished groups are the ones whose probe disagreed).
        probe_size = config.probe_size or config.group_size
        sampled = [
            sample.result["record"]
            for sample in [*samples, *abandoned_samples]
            if sample.request.sample_index < probe_size and sample.result["record"].valid
        ]
        metrics = {
            "step": new_version,
            "rollouts": len(samples),
            "valid_rollouts": len(valid),
            "masked_rollouts": len(records) - len(valid),
            "mean_reward": _mean([record.reward for record in valid]),
            "pass_rate": _mean([float(record.passed) for record in valid]),
            "mean_completion_tokens": _mean([float(record.completion_tokens) for record in records]),
            "mean_turns": _mean([float(record.turns) for record in records]),
            "tool_calls_per_turn": tool_calls / tool_turns if tool_turns else 0.0,
            "parallel_call_share": (
                sum(result["stats"]["parallel_turns"] for result in results) / tool_turns
                if tool_turns
                else 0.0
            ),
            "staleness_mean": _mean([float(sample.staleness) for sample in samples]),
            "staleness_max": max(sample.staleness for sample in samples),
            # Every finished rollout, abandoned probes included: what the fleet produced.
            "rollouts_per_s": state.generated_samples / wall if wall > 0 else 0.0,
            "abandoned_groups": len(abandoned),
            "guided_groups": len(guides),
            "guide_failures": len(guide_failures),
            "abandoned_rollouts": len(abandoned_samples),
            # pass_rate covers the trained groups only, which probing tilts towards tasks that are neither
            # always solved nor never; this one is the policy's pass rate on the tasks it was given.
            "sampled_pass_rate": _mean([float(record.passed) for record in sampled]),
            "worker_utilization": min(1.0, scheduler.stats.busy_seconds / (config.rollout_workers * wall)),
            "dropped_stale_total": scheduler.stats.dropped_stale,
            "lr": lr_used,
            "failed_rollouts_total": scheduler.stats.failed,
            "stage_seconds": {
                "sandbox": _mean([result["timings"]["sandbox_s"] for result in results]),
                "agent": _mean([result["timings"]["agent_s"] for result in results]),
                "reward": _mean([result["timings"]["reward_s"] for result in results]),
                "update": update_seconds,
            },
            **{
                key: value
                for key, value in update_stats.items()
                if key
                in ("loss", "clip_fraction", "approx_kl", "entropy", "kl_to_reference", "trained_tokens",
                    "shared_prefix_tokens")
            },
        }
        rollout_rows = []
        guided_positions = {guide.group for guide in guides}
        labelled = [(group, False) for group in groups] + [(group, True) for group in abandoned]
        for group_position, (group, was_abandoned) in enumerate(labelled):
            for sample in group:
                record = sample.result["record"]
                rollout_rows.append(
                    {
                        "step": new_version,
                        "abandoned": was_abandoned,
                        "rollout_id": sample.request.rollout_id,
                        "group_id": sample.request.group_id,
                        "task_id": record.task_id,
                        "sample_index": sample.request.sample_index,
                        "valid": record.valid,
                        "reward": record.reward,
                        "passed": record.passed,
                        "status": record.status,
                        # records follow the groups in this order; list.index would compare records
                        # field by field and fail on their tensors once two agree up to those.
                        "advantage": 0.0 if was_abandoned else float(advantages[len(rollout_rows)]),
                        "completion_tokens": record.completion_tokens,
                        "turns": record.turns,
                        "policy_version": sample.policy_version,
                        "staleness": sample.staleness,
                        "tools_used": sample.result["stats"]["tools_used"],
                        "tool_calls": sample.result["stats"]["tool_calls"],
                        "group_position": group_position,
                        "guided": group_position in guided_positions,
                    }
                )
        # Logs first, checkpoint second: a crash in between leaves log lines past the checkpoint,
        # which the resumed run truncates and then redoes, so no step or rollout is logged twice.
        (run_dir / TRACES_DIR).mkdir(exist_ok=True)
        for sample, row in zip([*samples, *abandoned_samples], rollout_rows, strict=True):
            _write_json(trace_path(run_dir, row["rollout_id"]), sample.result["trace"])
        for row in rollout_rows:
            _append_jsonl(run_dir / ROLLOUTS_FILE, row)
        _append_jsonl(run_dir / METRICS_FILE, metrics)
        checkpoint_started = time.monotonic()
        save_train_checkpoint(
            run_dir=run_dir,
            step=new_version,
            model=model,
            tokenizer=tokenizer,
            optimizer=optimizer,
            scheduler=lr_schedule,
            data_position={
                "version": new_version,
                "counted_groups": sorted(state.counted_groups),
                "training_seconds": training_seconds(),
            },
            run_config={"stage": "async-rl", **config_data},
            metrics=metrics,
            keep_last=config.keep_checkpoints,
        )
        checkpoint_seconds = time.monotonic() - checkpoint_started
        weight_push_seconds = push_weights(new_version)
        metrics["stage_seconds"].update(checkpoint=checkpoint_seconds, weight_push=weight_push_seconds)
        history.append(metrics)
        if on_rollout is not None:
            for sample, row in zip([*samples, *abandoned_samples], rollout_rows, strict=True):
                on_rollout({**row, "trace": sample.result["trace"]})
        if on_step is not None:
            on_step(metrics)
        state.version = new_version
        return new_version

    def expert_guides(groups: list[list[RolloutSample]]) -> tuple[list, list[str]]:
        """Expert members for the groups none of whose valid rollouts passed, and why any could not be made.

        The expert runs on a rollout worker (an environment server, in the rollouts' kind of sandbox) that
        it borrows from the dispatch queue; the learner scores its tokens with the weights this update
        starts from.
        """
        guides, failures = [], []
        for group_position, group in enumerate(groups):
            valid = [sample.result["record"] for sample in group if sample.result["record"].valid]
            if not valid or any(record.passed for record in valid):
                continue
            worker, inference = idle_workers.get()
            try:
                result = ray.get(worker.expert.remote(group_index=int(group[0].request.task_key), fleet=fleet))
            except ray.exceptions.RayError as error:  # a dead worker: Ray restarts it, the group goes unguided
                result = {"error": f"rollout worker failed: {error}"}
            finally:
                idle_workers.put((worker, inference))
            if "error" in result:
                logger.warning("no expert guidance for %s: %s", group[0].request.group_id, result["error"])
                failures.append(result["error"])
                continue
            guides.append(
                expert_record_create(
                    task_id=result["task_id"], group=group_position, messages=result["messages"],
                    reward=result["reward"], tokenizer=tokenizer, model=model, temperature=update_config.temperature,
                )
            )
        return guides, failures

    def abandon_group(group: list[RolloutSample]) -> None:
        with state.abandoned_lock:
            state.abandoned_groups.append(group)

    stop = stop or threading.Event()
    # The budget's stop works like a pause: dispatching ends, the update in progress is checkpointed.
    budget_timer = (
        None if budget_seconds is None else threading.Timer(max(0.0, budget_seconds - training_seconds()), stop.set)
    )
    learner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
    scheduler = RolloutScheduler(
        config=config.scheduler_config,
        submit_rollout=submit_rollout,
        submit_update=lambda groups, version: learner.submit(train, groups, version),
        groups=group_stream(),
        start_version=state.version,
        is_counted=lambda group_id: group_id in state.counted_groups,
        reward_of=lambda result: result["record"].reward,
        on_group_abandoned=abandon_group,
        stop=stop,
    )
    _write_status(
        run_dir,
        {
            "state": "running",
            "pid": os.getpid(),
            "version": state.version,
            "rollout_worker_pids": ray.get([worker.pid.remote() for worker in workers]),
            "inference_pids": ray.get([actor.pid.remote() for actor in inference_actors]),
        },
    )
    if budget_timer is not None:
        budget_timer.daemon = True
        budget_timer.start()
    try:
        scheduler.run(steps=config.steps - state.version)
    finally:
        if budget_timer is not None:
            budget_timer.cancel()
        learner.shutdown(wait=True)
        for actor in [*workers, *inference_actors]:
            ray.kill(actor)
        if fleet is not None and fleet_started:
            fleet.shutdown()
        if owns_ray:
            ray.shutdown()
    # A stop can come while an update is in flight: the scheduler no longer waits for it, the learner's
    # shutdown above does, and that update is checkpointed, so the run's version is the learner's.
    version = max(scheduler.version, state.version)
    finished = version >= config.steps or budget_spent()
    _write_status(
        run_dir, {"state": "finished" if finished else "stopped", "pid": os.getpid(), "version": version}
    )
    return history


def _fleet_start(config: AsyncRLConfig):
    """(fleet, started_here): attach to running sandbox-host actors, or start one per node with slots."""
    from sandboxes.base import SandboxError
    from sandboxes.fleet.client import Fleet, FleetConfig

    fleet_config = FleetConfig(backend=config.sandbox_backend or "local")
    if not config.fleet_heartbeats:
        fleet_config = dataclasses.replace(fleet_config, heartbeat_sink=None)
    try:
        return Fleet.connect(fleet_config), False
    except SandboxError:
        return Fleet.start(fleet_config), True


def _write_json(path: Path, data: dict) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, default=str))
    os.replace(temporary, path)


def read_status(run_dir: str | Path) -> dict:
    path = Path(run_dir) / STATUS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _write_status(run_dir: Path, status: dict) -> None:
    temporary = run_dir / (STATUS_FILE + ".tmp")
    temporary.write_text(json.dumps({**status, "updated_at": time.time()}))
    os.replace(temporary, run_dir / STATUS_FILE)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Asynchronous GRPO driver (Ray single controller).")
    parser.add_argument("--config", required=True, help="JSON file with AsyncRLConfig fields")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = AsyncRLConfig.from_dict(json.loads(Path(args.config).read_text()))
    stop = threading.Event()
    # SIGTERM (pause, cancel, shutdown) stops dispatching; the update in progress still finishes and
    # is checkpointed, so a later start resumes exactly there.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for metrics in run_async_rl(config, stop=stop):
        logger.info("step %s: reward %s", metrics["step"], metrics["mean_reward"])


if __name__ == "__main__":
    main()
