"""The Ray actors of an asynchronous RL run, as plain classes (the driver wraps them with ``ray.remote``).

- ``InferenceServer``: the generation engine (training.serving.ChatModel) with versioned weights; after every
  policy update the driver pushes the new weights (one ``ray.put``, then ``set_weights`` on every actor)
  before the new version is used for dispatch.
- ``RolloutServer``: an environment server. It creates the task's sandbox, runs the product's agent loop
  (training.agent.loop.run_agent) with a ``RemoteInferencePolicy`` that calls an inference actor, scores the
  result with the hidden tests, and returns the tokens/logprobs the learner needs.

torch, Ray and the sandboxes are imported inside the methods, in the actor processes.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from training.rollout.config import AsyncRLConfig

logger = logging.getLogger(__name__)


def task_for_group(config: AsyncRLConfig, group_index: int):
    from training.tasks.toy import generate_toy_task, toy_task_seeds

    pool = toy_task_seeds(split="train", count=config.tasks, start=config.task_seed_start)
    return generate_toy_task(pool[group_index % len(pool)])


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
