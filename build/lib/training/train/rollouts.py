"""RL rollouts: the policy under training, driven by the product's agent loop in real sandboxes.

`LocalModelPolicy` adapts an in-process ChatModel (the same serving class behind the project's
/v1/chat/completions) to the agent loop's Policy protocol and keeps, per model call, the exact
prompt tokens, sampled tokens, their behaviour logprobs and the experts every token was routed to.
Each model call of a rollout becomes one training segment; summary calls included, so the
self-summarised pieces of a long rollout all share its final reward.

A rollout whose sandbox, policy server or scoring failed for infrastructure reasons is returned
with valid=False and reward None: it is masked out of GRPO, never scored as zero.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from sandboxes.base import SandboxBackend, SandboxError, SandboxLimits
from training.agent.config import AgentLimits
from training.agent.loop import AgentResult, run_agent
from training.agent.policy import PolicyError, PolicyToolCall, PolicyTurn
from training.engine import SamplingMasks
from training.serving import ChatModel, ServingError
from training.tasks.base import CodingTask
from training.tasks.reward import RewardConfig, RewardInfrastructureError, score_rollout
from training.tasks.sandboxing import DEFAULT_TASK_LIMITS, task_sandboxes_create

logger = logging.getLogger(__name__)


@dataclass
class Segment:
    """One model call of a rollout: what the behaviour policy saw and sampled."""

    prompt_token_ids: list[int]
    """The rendered conversation fed to the model."""

    token_ids: list[int]
    """Sampled completion tokens (stop token included): the tokens trained on."""

    logprobs: list[float]
    """Behaviour-policy log-probability of each sampled token (temperature-scaled)."""

    routed_experts: torch.Tensor | None
    """int [len(prompt) + len(tokens) - 1, n_layers, top_k]: routing of every input position."""

    sampling_masks: SamplingMasks | None = None
    """Masks the copy constraint applied to token_ids (positions index token_ids); the learner applies them
    again so that its logprobs are those of the distribution the tokens were drawn from."""


@dataclass
class RolloutRecord:
    """A finished rollout of one task, ready for GRPO."""

    task_id: str
    """Task the rollout solved (or not)."""

    group: int
    """Index of the task's group within the step (rollouts of one group share a baseline)."""

    valid: bool
    """False when infrastructure failed: masked, never scored."""

    reward: float | None
    """Hidden-test reward; None for invalid rollouts."""

    passed: bool = False
    """All hidden tests passed."""

    tests_total: int = 0
    """Hidden tests that ran when scoring (0 for invalid rollouts)."""

    segments: list[Segment] = field(default_factory=list)
    """Model calls in order."""

    status: str = ""
    """Agent loop status and reason, or the infrastructure failure."""

    turns: int = 0
    """Tool-calling turns the agent took."""

    duration_s: float = 0.0
    """Wall-clock seconds of run + scoring."""

    prompt: str = ""
    """The task prompt the agent was given."""

    agent_result: AgentResult | None = None
    """The agent loop's full result (messages, events) for recording in the trace browser."""

    @property
    def completion_tokens(self) -> int:
        return sum(len(segment.token_ids) for segment in self.segments)


class LocalModelPolicy:
    """Policy protocol over an in-process ChatModel, recording the RL data of every call."""

    def __init__(self, chat_model: ChatModel, *, seed: int) -> None:
        self.chat_model = chat_model
        self.name = f"local:{chat_model.name}"
        self.seed = seed
        self.segments: list[Segment] = []

    def complete(
        self, *, messages: list[dict], tools: list[dict], max_tokens: int, temperature: float, top_p: float,
        timeout_s: float,
    ) -> PolicyTurn:
        started = time.monotonic()
        try:
            completion = self.chat_model.complete(
                messages=messages, tools=tools or None, max_tokens=max_tokens, temperature=temperature,
                top_p=top_p, seed=self.seed + len(self.segments), timeout_s=timeout_s,
            )
        except ValueError as error:  # the conversation no longer fits the context: the agent's doing
            raise PolicyError(str(error), infrastructure=False) from error
        except (ServingError, TimeoutError) as error:
            raise PolicyError(f"local model failed: {error}", infrastructure=True) from error
        self.segments.append(
            Segment(
                prompt_token_ids=list(completion.prompt_token_ids),
                token_ids=list(completion.token_ids),
                logprobs=list(completion.logprobs),
                routed_experts=completion.routed_experts,
                sampling_masks=completion.sampling_masks,
            )
        )
        calls = [
            PolicyToolCall(id=call["id"], name=call["function"]["name"], arguments_json=call["function"]["arguments"])
            for call in completion.tool_calls
        ]
        return PolicyTurn(
            content=completion.content, tool_calls=calls, prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens, finish_reason=completion.finish_reason,
            token_ids=completion.token_ids, logprobs=completion.logprobs, duration_s=time.monotonic() - started,
        )


def rollout_run(
    *,
    task: CodingTask,
    group: int,
    sandbox,
    chat_model: ChatModel,
    limits: AgentLimits,
    seed: int,
    reward_config: RewardConfig | None = None,
) -> RolloutRecord:
    """One agent run on `task` in `sandbox`, scored by the hidden tests; the sandbox is destroyed after."""
    started = time.monotonic()
    policy = LocalModelPolicy(chat_model, seed=seed)
    try:
        try:
            result = run_agent(sandbox=sandbox, policy=policy, prompt=task.prompt, limits=limits)
        except (SandboxError, OSError, RuntimeError) as error:  # agent failures are reported by the loop
            return RolloutRecord(task_id=task.task_id, group=group, valid=False, reward=None,
                                 segments=policy.segments, status=f"infrastructure: {type(error).__name__}: {error}",
                                 duration_s=time.monotonic() - started)
        if result.infrastructure_error:
            return RolloutRecord(task_id=task.task_id, group=group, valid=False, reward=None,
                                 segments=policy.segments, status=f"infrastructure: {result.reason}",
                                 turns=result.turns, duration_s=time.monotonic() - started,
                                 prompt=task.prompt, agent_result=result)
        try:
            reward = score_rollout(sandbox=sandbox, task=task, config=reward_config)
        except RewardInfrastructureError as error:
            return RolloutRecord(task_id=task.task_id, group=group, valid=False, reward=None,
                                 segments=policy.segments, status=f"infrastructure: {error}",
                                 turns=result.turns, duration_s=time.monotonic() - started,
                                 prompt=task.prompt, agent_result=result)
        return RolloutRecord(
            task_id=task.task_id, group=group, valid=True, reward=reward.value, passed=reward.passed,
            tests_total=reward.tests_total, segments=policy.segments, status=f"{result.status}: {result.reason}",
            turns=result.turns, duration_s=time.monotonic() - started, prompt=task.prompt, agent_result=result,
        )
    finally:
        try:
            sandbox.destroy()
        except SandboxError as error:  # reaped later by the backend's reap_orphans
            logger.warning("could not destroy sandbox of %s: %s", task.task_id, error)


def rollouts_collect(
    *,
    tasks: list[CodingTask],
    group_size: int,
    backend: SandboxBackend,
    chat_model: ChatModel,
    limits: AgentLimits,
    seed: int,
    sandbox_limits: SandboxLimits = DEFAULT_TASK_LIMITS,
    reward_config: RewardConfig | None = None,
    max_workers: int = 8,
) -> list[RolloutRecord]:
    """group_size rollouts of every task, run concurrently (the ChatModel batches their decoding).

    Results are ordered by (task, sample). A task whose sandboxes cannot even be created yields
    group_size invalid rollouts.
    """
    jobs: list[tuple[CodingTask, int, int, object | None, str]] = []
    for group, task in enumerate(tasks):
        try:
            sandboxes = task_sandboxes_create(backend=backend, task=task, count=group_size, limits=sandbox_limits)
            problem = ""
        except (SandboxError, OSError) as error:
            sandboxes, problem = [None] * group_size, f"infrastructure: sandbox creation failed: {error}"
        for sample, sandbox in enumerate(sandboxes):
            jobs.append((task, group, sample, sandbox, problem))

    lock = threading.Lock()
    records: dict[tuple[int, int], RolloutRecord] = {}

    def run(job: tuple[CodingTask, int, int, object | None, str]) -> None:
        task, group, sample, sandbox, problem = job
        if sandbox is None:
            record = RolloutRecord(task_id=task.task_id, group=group, valid=False, reward=None, status=problem)
        else:
            record = rollout_run(
                task=task, group=group, sandbox=sandbox, chat_model=chat_model, limits=limits,
                seed=seed + 1000 * group + 100_000 * sample, reward_config=reward_config,
            )
        with lock:
            records[(group, sample)] = record

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(jobs)))) as pool:
        list(pool.map(run, jobs))
    return [records[key] for key in sorted(records)]
