"""RL rollouts recorded as finished tasks, so they appear in the trace browser next to product tasks."""

from __future__ import annotations

from datetime import timedelta

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from webapp.agents.models import AgentTask, Repository, TaskEvent
from webapp.agents.storable import DISPLAY_CHARS, storable_text


@transaction.atomic
def rollout_record(
    *,
    owner,
    result,
    prompt: str,
    experiment_name: str,
    repo_label: str,
    model_name: str,
    training_step: int | None = None,
    reward: float | None = None,
    advantage: float | None = None,
    team=None,
) -> AgentTask:
    """Store a finished RL rollout so it appears in the trace browser next to product tasks.

    How to record one (training side)::

        result = run_agent(sandbox=sandbox, policy=policy, prompt=task.prompt, limits=limits)
        reward = score_rollout(sandbox=sandbox, task=task)
        rollout_record(owner=experiment.owner, team=experiment.team, result=result, prompt=task.prompt,
                       experiment_name=experiment.name, repo_label=f"toy-{seed}", model_name=checkpoint_name,
                       training_step=step, reward=reward.value, advantage=advantage)

    ``result.events`` (the loop's events, full tool outputs included) are stored as ``TaskEvent``
    rows exactly like a live task's. Rollouts that stopped on an infrastructure error should be
    recorded with ``reward=None``, never as a zero reward.
    """
    if not experiment_name:
        raise ValidationError({"experiment_name": "a rollout must name its experiment"})
    status = result.status if result.status in AgentTask.Status.values else AgentTask.Status.FAILED
    now = timezone.now()
    task = AgentTask.objects.create(
        owner=owner, team=team, source=AgentTask.Source.TRAINING, repo_kind=Repository.Kind.PATH,
        repo_location="", repo_label=repo_label[:200], prompt=storable_text(prompt), backend=AgentTask.Backend.BUILTIN,
        model_name=model_name[:200], status=status, status_reason=storable_text(result.reason), attempt=1,
        started_at=now - timedelta(seconds=result.duration_s), finished_at=now,
        final_message=storable_text(result.final_message), diff=storable_text(result.diff),
        messages=storable_text(result.messages), turns=result.turns, prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens, experiment_name=experiment_name[:200],
        training_step=training_step, reward=reward, advantage=advantage,
    )
    rows = []
    for seq, event in enumerate(result.events):
        payload = storable_text(dict(event.get("payload", {})))
        full_output = payload.pop("output", "") if event["kind"] == "tool_result" else ""
        if full_output and len(payload.get("display") or "") > DISPLAY_CHARS:
            payload["display"] = payload["display"][:DISPLAY_CHARS]
        if event["kind"] == "tool_result":
            payload["output_chars"] = len(full_output)
        rows.append(TaskEvent(
            task=task, seq=seq, kind=event["kind"], turn=event.get("turn", 0), attempt=1,
            tool_name=(payload.get("name") or "")[:50] if event["kind"] in ("tool_call", "tool_result") else "",
            payload=payload, full_output=full_output or "", ts=event.get("ts") or now.timestamp(),
        ))
    TaskEvent.objects.bulk_create(rows, batch_size=500)
    task.last_seq = len(rows) - 1
    task.save(update_fields=["last_seq"])
    return task
