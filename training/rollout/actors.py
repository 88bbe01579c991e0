"""The Ray actors of an asynchronous RL run, as plain classes (the driver wraps them with ``ray.remote``).

- ``InferenceServer``: the generation engine (training.serving.ChatModel) with versioned weights; after every
  policy update the driver pushes the new weights (one ``ray.put``, then ``set_weights`` on every actor)
  before the new version is used for dispatch.
- ``RolloutServer``: an environment server. It creates the task's sandbox, runs the product's agent loop
  (training.agent.loop.run_agent) with a ``RemoteInferencePolicy`` that calls an inference actor, scores the
  result with the hidden tests, and returns the tokens/logprobs the learner needs.

- ``ActorPool``: the driver's handle on all of them: it starts the actors and drives them through a few coarse
  methods (``submit`` a rollout, ask for an ``expert`` trajectory, ``push_weights``, ``shutdown``).

Actors answer with dataclasses (``InferenceCompletion``, ``RolloutResult``, ``ExpertResult``). torch, Ray and
the sandboxes are imported inside the methods, in the actor processes.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.rollout.config import AsyncRLConfig

logger = logging.getLogger(__name__)


@dataclass
class InferenceCompletion:
    """One model call served by an inference actor, with what the learner needs to train on it."""

    content: str | None
    """Assistant text of the turn."""
    tool_calls: list[dict]
    """OpenAI-style tool calls of the turn."""
    prompt_tokens: int
    """Tokens of the rendered conversation."""
    completion_tokens: int
    """Sampled tokens."""
    finish_reason: str
    """Why sampling stopped."""
    prompt_token_ids: list[int]
    """The rendered conversation's tokens."""
    token_ids: list[int]
    """The sampled tokens."""
    logprobs: list[float]
    """Behaviour logprob of each sampled token."""
    routed_experts: Any
    """Recorded routing of every input position (None for dense models)."""
    sampling_masks: Any
    """The copy constraint's masks over token_ids (None when nothing was constrained)."""
    version: int
    """Policy version of the weights that sampled the call."""


@dataclass
class RolloutResult:
    """A finished rollout as a rollout worker returns it to the driver."""

    record: Any
    """The training record (training.train.rollouts.RolloutRecord): tokens, logprobs, reward."""
    task_id: str
    """The task worked on."""
    rollout_id: str
    """The scheduler's id of the rollout."""
    trace: dict
    """The full agent trace (prompt, events, messages, diff) the web app shows."""
    stats: dict = field(default_factory=lambda: {"tool_calls": 0, "tool_turns": 0, "parallel_turns": 0, "tools_used": {}})
    """Tool statistics (training.train.rollouts.tool_statistics)."""
    timings: dict = field(default_factory=lambda: {"sandbox_s": 0.0, "agent_s": 0.0, "reward_s": 0.0})
    """Seconds spent creating the sandbox, in the agent loop and scoring."""
    versions: list[int] = field(default_factory=list)
    """Policy version of every model call."""


@dataclass
class ExpertResult:
    """The scripted expert's verified trajectory for a group's task, or why there is none."""

    task_id: str = ""
    """The task solved."""
    messages: list[dict] = field(default_factory=list)
    """The trajectory as chat messages."""
    reward: float = 0.0
    """Its hidden-test reward."""
    error: str | None = None
    """Why the expert could not solve it (the group then trains without guidance)."""


_task_file_cache: dict[str, list] = {}


def task_for_group(config: AsyncRLConfig, group_index: int):
    """The group's task: from the run's mined task set (``task_set``: tasks.jsonl in the run directory,
    written at launch) or a generated toy task."""
    if config.task_set is not None:
        from training.rollout.run_dir import TASKS_FILE
        from training.tasks.base import CodingTask

        path = str(Path(config.run_dir) / TASKS_FILE)
        if path not in _task_file_cache:
            lines = Path(path).read_text().splitlines()
            _task_file_cache[path] = [CodingTask.from_json(line) for line in lines if line.strip()]
        pool = _task_file_cache[path][: config.tasks]
        return pool[group_index % len(pool)]
    from training.tasks.toy import generate_toy_task, toy_task_seeds

    pool = toy_task_seeds(split="train", count=config.tasks, start=config.task_seed_start)
    return generate_toy_task(pool[group_index % len(pool)])


class InferenceServer:
    """Body of the inference actor: a ChatModel whose weights carry a version number."""

    def __init__(self, checkpoint_dir: str, run_dir: str, max_batch_size: int, copy_constraint: bool = True,
                 precision: str | None = None, gpus: float = 0.0) -> None:
        import torch

        from training.devices import actor_device, policy_precision
        from training.engine import EngineConfig
        from training.serving import ChatModel
        from training.train.state import latest_checkpoint, load_train_checkpoint

        torch.set_num_threads(1)
        # With GPUs from Ray (AsyncRLConfig.inference_gpus) the engine runs on the first visible one.
        device = actor_device(gpus=gpus, role="inference actor")
        # An imported model (its directory, or a checkpoint carrying its tokenizer) is served with its own chat
        # template and tool-call parser (training.hf.serving.HFChatModel), so rollouts render as it was trained.
        chat_model = ChatModel.load(
            checkpoint_dir, engine_config=EngineConfig(max_batch_size=max_batch_size), copy_constraint=copy_constraint,
            precision=policy_precision(device, precision), device=device,
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

    def complete(self, **kwargs) -> InferenceCompletion:
        version = self.version
        completion = self.chat_model.complete(**kwargs)
        return InferenceCompletion(
            content=completion.content,
            tool_calls=completion.tool_calls,
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
            finish_reason=completion.finish_reason,
            prompt_token_ids=list(completion.prompt_token_ids),
            token_ids=list(completion.token_ids),
            logprobs=list(completion.logprobs),
            routed_experts=completion.routed_experts,
            sampling_masks=completion.sampling_masks,
            version=version,
        )


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
                prompt_token_ids=result.prompt_token_ids,
                token_ids=result.token_ids,
                logprobs=result.logprobs,
                routed_experts=result.routed_experts,
                sampling_masks=result.sampling_masks,
            )
        )
        self.versions.append(result.version)
        calls = [
            PolicyToolCall(
                id=call["id"], name=call["function"]["name"], arguments_json=call["function"]["arguments"]
            )
            for call in result.tool_calls
        ]
        return PolicyTurn(
            content=result.content,
            tool_calls=calls,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            finish_reason=result.finish_reason,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            duration_s=time.monotonic() - started,
        )


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
            backend = get_backend(self.config.sandbox_backend, runtime=self.config.sandbox_runtime)
            (sandbox,) = task_sandboxes_create(backend=backend, task=task)
            return sandbox
        from sandboxes.base import RepoSource
        from training.tasks.sandboxing import task_setup_limits

        snapshot = self._fleet_snapshots.get(task.task_id)
        if snapshot is None:
            with tempfile.TemporaryDirectory(prefix=f"flowstate-task-{task.task_id}-") as directory:
                task.materialize(Path(directory))
                snapshot = fleet.snapshot_create(source=RepoSource(kind="path", location=directory),
                                                 setup_commands=task.setup_commands,
                                                 setup_limits=task_setup_limits(task))
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

    def expert(self, *, group_index: int, fleet=None) -> ExpertResult:
        """The scripted expert's verified solution of the group's task, run like a rollout in a sandbox; its
        ``error`` says why there is none (the expert could not solve it, or a sandbox failed)."""
        from sandboxes.base import SandboxError
        from training.tasks.reward import RewardInfrastructureError
        from training.train.scripted_expert import ExpertTrajectoryError, expert_trajectory_run

        task = task_for_group(self.config, group_index)
        try:
            trajectory = expert_trajectory_run(task=task, sandbox=self._sandbox(task, fleet), limits=self._limits())
        except (ExpertTrajectoryError, RewardInfrastructureError, SandboxError, OSError) as error:
            return ExpertResult(error=f"{type(error).__name__}: {error}")
        return ExpertResult(messages=trajectory.messages, reward=trajectory.reward, task_id=trajectory.task_id)

    def run(
        self, *, group_index: int, sample_index: int, rollout_id: str, inference, seed: int, fleet=None
    ) -> RolloutResult:
        """One rollout of the group's task: a sandbox, the agent loop against `inference`, the hidden tests."""
        from sandboxes.base import SandboxError

        task = task_for_group(self.config, group_index)
        started = time.monotonic()
        policy = RemoteInferencePolicy(inference, seed=seed)
        result = RolloutResult(
            record=None, task_id=task.task_id, rollout_id=rollout_id, trace={"prompt": task.prompt, "events": []},
            versions=policy.versions,
        )
        try:
            sandbox = self._sandbox(task, fleet)
        except (SandboxError, OSError) as error:
            result.record = _invalid_record(task, group_index, policy, started, f"sandbox creation failed: {error}")
            return result
        result.timings["sandbox_s"] = time.monotonic() - started
        try:
            result.record = self._agent_and_score(
                task=task, group_index=group_index, sandbox=sandbox, policy=policy, result=result, started=started
            )
            return result
        finally:
            try:
                sandbox.destroy()
            except SandboxError as error:
                logger.warning("could not destroy sandbox of %s: %s", rollout_id, error)

    def _agent_and_score(self, *, task, group_index: int, sandbox, policy, result: RolloutResult, started: float):
        """The rollout's RolloutRecord: the agent loop in `sandbox`, then its reward; fills result's trace,
        statistics and timings on the way."""
        from sandboxes.base import SandboxError
        from training.agent.loop import run_agent
        from training.tasks.reward import RewardInfrastructureError, score_rollout
        from training.train.rollouts import RolloutRecord, tool_statistics

        agent_started = time.monotonic()
        try:
            outcome = run_agent(sandbox=sandbox, policy=policy, prompt=task.prompt, limits=self._limits())
        except (SandboxError, OSError, RuntimeError) as error:
            return _invalid_record(task, group_index, policy, started, f"{type(error).__name__}: {error}")
        result.timings["agent_s"] = time.monotonic() - agent_started
        result.trace.update(
            events=outcome.events,
            status=outcome.status,
            reason=outcome.reason,
            final_message=outcome.final_message,
            diff=outcome.diff,
            messages=outcome.messages,
            turns=outcome.turns,
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            duration_s=outcome.duration_s,
        )
        result.stats = tool_statistics(outcome.events)
        if outcome.infrastructure_error:
            return _invalid_record(task, group_index, policy, started, outcome.reason, outcome.turns)
        reward_started = time.monotonic()
        try:
            reward = score_rollout(
                sandbox=sandbox,
                task=task,
                config=self.config.reward_config,
                edit_arguments=_edit_file_arguments(outcome.events),
            )
        except RewardInfrastructureError as error:
            return _invalid_record(task, group_index, policy, started, str(error), outcome.turns)
        result.timings["reward_s"] = time.monotonic() - reward_started
        return RolloutRecord(
            task_id=task.task_id,
            group=group_index,
            valid=True,
            reward=reward.value,
            passed=reward.passed,
            tests_total=reward.tests_total,
            segments=policy.segments,
            status=f"{outcome.status}: {outcome.reason}",
            turns=outcome.turns,
            duration_s=time.monotonic() - started,
        )


def _invalid_record(task, group_index: int, policy: RemoteInferencePolicy, started: float, reason: str, turns: int = 0):
    """A rollout masked out of training: infrastructure failed, so it is not scored."""
    from training.train.rollouts import RolloutRecord

    return RolloutRecord(
        task_id=task.task_id,
        group=group_index,
        valid=False,
        reward=None,
        segments=policy.segments,
        status=f"infrastructure: {reason}",
        turns=turns,
        duration_s=time.monotonic() - started,
    )


def _edit_file_arguments(events: list[dict]) -> list[dict]:
    """The parsed arguments of a rollout's edit_file calls, applied or rejected (unparseable ones skipped)."""
    return [
        event["payload"]["arguments"]
        for event in events
        if event["kind"] == "tool_call"
        and event["payload"]["name"] == "edit_file"
        and isinstance(event["payload"]["arguments"], dict)
    ]


class ActorPool:
    """The driver's handle on the run's Ray actors: inference servers and rollout workers (environment servers).

    Each worker is paired with an inference actor (round-robin); a pair serves one rollout or one expert
    trajectory at a time, handed out through an idle queue. A dead actor process is restarted by Ray; the
    call it was running fails, and the scheduler re-dispatches that slot under a new rollout id.
    """

    def __init__(self, config: AsyncRLConfig, *, run_dir: Path, fleet=None) -> None:
        import dataclasses

        import ray

        self.config = config
        self.fleet = fleet
        # SPREAD: on a cluster of several nodes the actors go round the nodes (one node's loss takes a
        # share of them, which Ray restarts on the others), not all onto the driver's node.
        inference_cls = ray.remote(InferenceServer).options(
            num_cpus=0, num_gpus=config.inference_gpus, max_concurrency=config.rollout_workers + 2, max_restarts=-1,
            max_task_retries=0, scheduling_strategy="SPREAD",
        )
        worker_cls = ray.remote(RolloutServer).options(
            num_cpus=0, max_concurrency=1, max_restarts=-1, max_task_retries=0, scheduling_strategy="SPREAD"
        )
        self.inference_actors = [
            inference_cls.remote(config.init_checkpoint, str(run_dir), config.rollout_workers, config.copy_constraint,
                                 config.precision, config.inference_gpus)
            for _ in range(config.inference_actors)
        ]
        config_data = dataclasses.asdict(config)
        self.workers = [worker_cls.remote(config_data) for _ in range(config.rollout_workers)]
        self._idle: queue.Queue = queue.Queue()
        for index, worker in enumerate(self.workers):
            self._idle.put((worker, self.inference_actors[index % len(self.inference_actors)]))

    def submit(self, *, group_index: int, sample_index: int, rollout_id: str, version: int) -> Future:
        """Run one rollout on the next idle worker (blocks until one is free); the future's result is a
        RolloutResult."""
        worker, inference = self._idle.get()
        seed = self.config.seed * 1_000_003 + group_index * 7919 + sample_index * 104_729 + version
        future = worker.run.remote(
            group_index=group_index,
            sample_index=sample_index,
            rollout_id=rollout_id,
            inference=inference,
            seed=seed,
            fleet=self.fleet,
        ).future()
        future.add_done_callback(lambda _done: self._idle.put((worker, inference)))
        return future

    def expert(self, *, group_index: int) -> ExpertResult:
        """The scripted expert's trajectory for the group's task, run on a borrowed idle worker."""
        import ray

        worker, inference = self._idle.get()
        try:
            return ray.get(worker.expert.remote(group_index=group_index, fleet=self.fleet))
        except ray.exceptions.RayError as error:  # a dead worker: Ray restarts it, the group goes unguided
            return ExpertResult(error=f"rollout worker failed: {error}")
        finally:
            self._idle.put((worker, inference))

    def push_weights(self, version: int, weights: dict) -> float:
        """Put the learner's weights on every inference actor as `version`; returns the seconds it took."""
        import ray

        started = time.monotonic()
        reference = ray.put(weights)
        for ref in [actor.set_weights.remote(version, reference) for actor in self.inference_actors]:
            try:
                ray.get(ref)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError) as error:
                # Its node left and Ray restarts it elsewhere: a restarted server loads the newest
                # checkpoint (saved just before this push), so it comes back with these weights.
                logger.warning("inference actor restarting, it reloads the checkpoint: %s", error)
        return time.monotonic() - started

    def pids(self) -> dict[str, list[int]]:
        """Process ids of the actors, for the run's status file."""
        import ray

        return {
            "rollout_worker_pids": ray.get([worker.pid.remote() for worker in self.workers]),
            "inference_pids": ray.get([actor.pid.remote() for actor in self.inference_actors]),
        }

    def shutdown(self) -> None:
        import ray

        for actor in [*self.workers, *self.inference_actors]:
            ray.kill(actor)
