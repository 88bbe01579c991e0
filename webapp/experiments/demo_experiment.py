"""A small finished experiment for `make run`, so the dashboard, group view and traces have data.

It is **seeded, not trained**, and says so in its name and status: a real RL run needs minutes of a
model, Ray and sandboxes, not the seconds a first start may take. What is real: every rollout is a
run of the agent loop in a sandbox on a train-split toy task, scored by the task's hidden tests —
half of each group by the scripted reference fix (`toy_expert_policy`), half by a policy that gives up
at once — so rewards, pass rates, token and tool-call counts and traces are measured, and the group
advantages are the GRPO ones. No policy update happens: the curves are flat, not a learning curve.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from webapp.experiments.models import Experiment, ExperimentStep

if TYPE_CHECKING:
    from training.agent.loop import AgentResult
    from training.tasks.reward import Reward

DEMO_EXPERIMENT_NAME = "demo: scripted rollouts (seeded, not trained)"
STEPS = 3
GROUP_SIZE = 2
SEEDED_REASON = (
    "Seeded by make run, not trained: each step is one group of real rollouts on a toy task (the scripted "
    "reference fix and a policy that gives up), scored by the task's tests; no policy update ran, so the "
    "curves are flat. Launch an experiment to see learning."
)


def _rollout(*, backend, task, policy) -> tuple[AgentResult, Reward]:
    from training.agent.config import AgentLimits
    from training.agent.loop import run_agent
    from training.tasks.reward import score_rollout
    from training.tasks.sandboxing import task_sandboxes_create

    (sandbox,) = task_sandboxes_create(backend=backend, task=task)
    try:
        result = run_agent(sandbox=sandbox, policy=policy, prompt=task.prompt,
                           limits=AgentLimits(max_turns=6, max_tokens=20_000, wall_time_s=120))
        return result, score_rollout(sandbox=sandbox, task=task)
    finally:
        sandbox.destroy()


def _group(*, backend, task, step: int) -> tuple[list[tuple[dict, dict]], float]:
    """(rollout rows with traces, seconds) of one group on ``task``."""
    from training.agent.scripted import ScriptedExpertPolicy
    from training.train.scripted_expert import toy_expert_policy

    started = time.monotonic()
    runs = []
    for index in range(GROUP_SIZE):
        policy = toy_expert_policy(task) if index % 2 == 0 else ScriptedExpertPolicy(
            turns=[], final_message="I could not find the bug.", name="gives-up")
        runs.append(_rollout(backend=backend, task=task, policy=policy))
    rewards = [reward.value for _, reward in runs]
    mean, spread = statistics.fmean(rewards), statistics.pstdev(rewards)
    rows = []
    for index, (result, reward) in enumerate(runs):
        calls = [event["payload"]["name"] for event in result.events if event["kind"] == "tool_call"]
        rows.append(({
            "step": step, "rollout_id": f"seeded-{step}-{index}", "group_id": f"seeded-{step}", "task_id": task.task_id,
            "sample_index": index, "valid": True, "reward": reward.value, "passed": reward.passed,
            "advantage": (reward.value - mean) / spread if spread else 0.0, "completion_tokens": result.completion_tokens,
            "turns": result.turns, "tool_calls": len(calls), "tools_used": {name: calls.count(name) for name in set(calls)},
            "policy_version": 0, "staleness": 0, "status": f"{result.status}: {result.reason}",
        }, {"status": result.status, "reason": result.reason, "final_message": result.final_message,
            "diff": result.diff, "messages": result.messages, "turns": result.turns, "prompt": task.prompt,
            "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "duration_s": result.duration_s, "events": result.events}))
    return rows, time.monotonic() - started


def _metrics(step: int, rows: list[dict], seconds: float) -> dict:
    turns = sum(row["turns"] for row in rows) or 1
    return {
        "step": step, "seeded": True, "mean_reward": statistics.fmean(row["reward"] for row in rows),
        "pass_rate": statistics.fmean(float(row["passed"]) for row in rows),
        "sampled_pass_rate": statistics.fmean(float(row["passed"]) for row in rows),
        "abandoned_groups": 0, "mean_completion_tokens": statistics.fmean(row["completion_tokens"] for row in rows),
        "tool_calls_per_turn": sum(row["tool_calls"] for row in rows) / turns, "staleness_mean": 0.0,
        "rollouts_per_s": len(rows) / seconds if seconds else None, "policy_version": 0,
    }


def demo_experiment_seed(*, user) -> str:
    """Idempotent: the seeded experiment of ``user`` (a few seconds of real rollouts the first time)."""
    from sandboxes import get_backend
    from training.tasks.toy import generate_toy_task, toy_task_seeds
    from webapp.experiments.services import _rollout_row_create

    existing = Experiment.objects.filter(owner=user, name=DEMO_EXPERIMENT_NAME).first()
    if existing is not None:
        return f"seeded experiment {existing.pk} already present"
    backend = get_backend(settings.SANDBOX_BACKEND)
    started = timezone.now()
    groups = []
    for step, seed in enumerate(toy_task_seeds(split="train", count=STEPS), start=1):
        groups.append((step, *_group(backend=backend, task=generate_toy_task(seed), step=step)))
    with transaction.atomic():
        experiment = Experiment.objects.create(
            owner=user, team=user.teams.first(), name=DEMO_EXPERIMENT_NAME, status=Experiment.Status.FINISHED,
            status_reason=SEEDED_REASON, current_step=STEPS, started_at=started, finished_at=timezone.now(),
            config={"steps": STEPS, "tasks": STEPS, "group_size": GROUP_SIZE, "groups_per_step": 1, "seeded": True,
                    "init_checkpoint": "scripted policies (no model)"},
        )
        for step, rows, seconds in groups:
            ExperimentStep.objects.create(experiment=experiment, step=step,
                                          metrics=_metrics(step, [row for row, _ in rows], seconds))
            for row, trace in rows:
                _rollout_row_create(experiment=experiment, row=row, trace=trace)
    passed = sum(row["passed"] for _, rows, _ in groups for row, _ in rows)
    return f"seeded experiment {experiment.pk} ({STEPS} steps, {STEPS * GROUP_SIZE} real rollouts, {passed} passed; not trained)"
