"""Reads of the agents app. Every query starts from what the user may see (owned or team-shared)."""

from __future__ import annotations

from datetime import date

from django.db.models import Exists, OuterRef, Q, QuerySet

from webapp.agents.models import AgentTask, Repository, TaskEvent
from webapp.core.publish import LIVE_CHANNEL_LAYER  # noqa: F401  (the consumers import it from here)
from webapp.core.selectors import owned_get_visible, owned_visible_to

TASK_GROUP_PREFIX = "agent-task-"


def task_group_name(*, task_id: int) -> str:
    """Channels group that receives a task's events and status changes."""
    return f"{TASK_GROUP_PREFIX}{task_id}"


def event_wire(*, seq: int, kind: str, turn: int, ts: float, attempt: int, payload: dict, has_full_output: bool) -> dict:
    """What a viewer receives for one event: the payload with tool output already truncated."""
    return {"seq": seq, "kind": kind, "turn": turn, "ts": ts, "attempt": attempt, "payload": payload,
            "has_full_output": has_full_output}


def event_to_wire(*, event: TaskEvent) -> dict:
    return event_wire(seq=event.seq, kind=event.kind, turn=event.turn, ts=event.ts, attempt=event.attempt,
                      payload=event.payload, has_full_output=bool(event.full_output))


def repository_list(*, user) -> QuerySet[Repository]:
    return owned_visible_to(queryset=Repository.objects.all(), user=user)


def repository_get(*, user, pk) -> Repository:
    return owned_get_visible(queryset=Repository.objects.all(), user=user, pk=pk)


def task_get(*, user, pk) -> AgentTask:
    return owned_get_visible(queryset=AgentTask.objects.select_related("owner", "team", "repository"), user=user, pk=pk)


def task_list(
    *,
    user,
    status: str | None = None,
    outcome: str | None = None,
    source: str | None = None,
    model: str | None = None,
    repository: str | None = None,
    experiment: str | None = None,
    tool: str | None = None,
    reward_min: float | None = None,
    reward_max: float | None = None,
    date_from: date | None = None,
    date_to: date | None = None,
    search: str | None = None,
) -> QuerySet[AgentTask]:
    """Tasks and rollouts the user may see, filtered. ``search`` matches prompts, final messages
    and the full text of tool results (case-insensitive substring)."""
    tasks = owned_visible_to(queryset=AgentTask.objects.all(), user=user).select_related("owner")
    if status:
        tasks = tasks.filter(status=status)
    if outcome:
        tasks = tasks.filter(outcome=outcome)
    if source:
        tasks = tasks.filter(source=source)
    if model:
        tasks = tasks.filter(model_name__icontains=model)
    if repository:
        tasks = tasks.filter(repo_label__icontains=repository)
    if experiment:
        tasks = tasks.filter(experiment_name__icontains=experiment)
    if tool:
        tasks = tasks.filter(Exists(TaskEvent.objects.filter(task=OuterRef("pk"), kind="tool_call", tool_name=tool)))
    if reward_min is not None:
        tasks = tasks.filter(reward__gte=reward_min)
    if reward_max is not None:
        tasks = tasks.filter(reward__lte=reward_max)
    if date_from:
        tasks = tasks.filter(created_at__date__gte=date_from)
    if date_to:
        tasks = tasks.filter(created_at__date__lte=date_to)
    if search:
        in_results = TaskEvent.objects.filter(task=OuterRef("pk"), kind="tool_result", full_output__icontains=search)
        tasks = tasks.filter(Q(prompt__icontains=search) | Q(final_message__icontains=search) | Exists(in_results))
    return tasks


def task_events_after(*, task: AgentTask, after: int = -1, limit: int = 500) -> list[TaskEvent]:
    """Events with ``seq > after`` in order (the resume cursor of the live view)."""
    return list(task.events.filter(seq__gt=after).order_by("seq")[:limit])


def task_event_get(*, task: AgentTask, seq: int) -> TaskEvent:
    return task.events.get(seq=seq)


def task_tools_used(*, task: AgentTask) -> list[str]:
    return sorted(set(task.events.filter(kind="tool_call").values_list("tool_name", flat=True)))


def trajectories_for_sft(*, user=None, limit: int) -> list[list[dict]]:
    """OpenAI message lists of succeeded tasks and rollouts, newest first, for supervised fine-tuning.

    With ``user`` only what they may see; without, every stored trajectory (trainer use). Rollouts
    with a recorded reward are included only when it is positive.
    """
    if limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    tasks = AgentTask.objects.all() if user is None else owned_visible_to(queryset=AgentTask.objects.all(), user=user)
    tasks = tasks.filter(status=AgentTask.Status.SUCCEEDED).exclude(messages=[]).filter(Q(reward__isnull=True) | Q(reward__gt=0))
    return [task.messages for task in tasks.order_by("-created_at", "-id")[:limit]]


def broker_waiting_task_ids() -> set[int]:
    """Ids of agent tasks whose run message waits in the broker's queue (not yet given to a worker).

    Messages are sent by ``services.task_enqueue`` with a Celery id ``agent-task-<id>-<nonce>``;
    the Redis transport keeps a queue as one list per priority step. A message a worker took
    (prefetched or running, "unacked") is not counted: if that worker died, the message is stuck
    until the visibility timeout, which is what the sweeper must not wait for.
    """
    import json

    from django.conf import settings

    from webapp.agents.services import TASK_MESSAGE_PREFIX
    from webapp.celery import app

    found: set[int] = set()
    # The agents' queue by its route (settings.CELERY_TASK_ROUTES), and every other named queue in
    # case a deployment routes agent tasks elsewhere.
    queues = dict.fromkeys((*settings.FLOWSTATE_CELERY_QUEUES, app.conf.task_default_queue))
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        client = channel.client
        keys = [channel._q_for_pri(queue, priority) for queue in queues for priority in channel.priority_steps]
        for key in keys:
            for raw in client.lrange(key, 0, -1):
                try:
                    message_id = json.loads(raw)["headers"]["id"]
                except (ValueError, KeyError, TypeError):
                    continue
                if isinstance(message_id, str) and message_id.startswith(TASK_MESSAGE_PREFIX):
                    task_id = message_id[len(TASK_MESSAGE_PREFIX):].split("-", 1)[0]
                    if task_id.isdigit():
                        found.add(int(task_id))
    return found


def task_index_progress(*, task: AgentTask) -> dict | None:
    """The semantic index build of the task's snapshot as the task page shows it, or None.

    ``None`` when the task has no snapshot yet or nothing was built for it (the build starts when the
    task's sandbox is ready). Read from the progress files of the deployment's index root.
    """
    from sandboxes.semantic.config import SemanticSearchConfig, SemanticSearchError
    from sandboxes.semantic.progress import index_progress_list

    if not task.snapshot_id:
        return None
    try:
        index_root = SemanticSearchConfig.from_environment().index_root
    except SemanticSearchError:
        return None
    rows = index_progress_list(index_root=index_root, snapshot_id=task.snapshot_id)
    if not rows:
        return None
    row = rows[0]
    labels = {
        "queued": (f"queued: {row.chunks_total} chunks wait for an encoding slot; semantic_search answers from "
                   "BM25 until the index is ready" if row.chunks_total else
                   "queued: chunking the snapshot; semantic_search answers from BM25 until the index is ready"),
        "building": f"building: {row.chunks_done} of {row.chunks_total} chunks encoded "
                    f"({row.fraction:.0%}); semantic_search answers from BM25 until it is ready",
        "ready": f"ready: {row.chunks_total} chunks, semantic_search answers from the embedding index",
        "failed": f"build failed ({row.error[:300]}); the next semantic_search starts it again",
        "cancelled": f"build stopped at {row.chunks_done} of {row.chunks_total} chunks (the run ended first)",
        "stalled": f"build stalled at {row.chunks_done} of {row.chunks_total} chunks (its process stopped writing)",
    }
    return {"state": row.state, "chunks_done": row.chunks_done, "chunks_total": row.chunks_total,
            "fraction": round(row.fraction, 4), "label": labels.get(row.state, row.state)}
