"""Follow-ups: a user sends another message to a running or finished task and the agent continues.

One conversation, one workspace:

* **running** task: the message waits (``pending``) until the agent next answers without tool calls;
  the loop then takes it (``next_message_for``) as the next user message instead of finishing.
* **finished** task: the task goes back to ``queued`` and continues its conversation (the stored
  ``messages``) in its workspace. The worker that ran it keeps the sandbox **warm** for
  ``AGENT_FOLLOWUP_WARM_S`` after it finishes (``after_run``): it waits on a Redis list for a wake-up
  and claims the task itself. Otherwise a Celery message runs ``continuation_run``, which rebuilds the
  workspace from a fresh snapshot of the repository plus the task's patch (``git apply`` in the
  sandbox).

Each delivered message is a ``user_message`` event, so the live view and the trace show every user
turn in order; the repository's tests run again after every continuation (``verify.task_verify``).

Handing a follow-up over without losing it: the warm worker holds a Redis key while it waits. The
sender commits the ``queued`` row, then wakes the warm worker if the key exists, else enqueues. The
warm worker deletes its key before its last look at the row, so a sender that saw the key is always
served by it; a sender that did not see it has enqueued, and the claim lets only one of the two run.
If anything is lost the sweeper (``services.tasks_recover_stale``) re-sends queued tasks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.utils import timezone

from training.agent.config import AgentLimits
from webapp.accounts.limits import active_tasks_check, pending_followups_check, user_lock
from webapp.agents.models import AgentTask, TaskFollowUp
from webapp.core.validation import CONFLICT, text_check

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 20_000
PATCH_FILE = ".flowstate-followup.patch"
_WARM_KEY = "flowstate:followup-warm:{task_id}"
_shutting_down = threading.Event()
_WAKE_KEY = "flowstate:followup-wake:{task_id}"


def _redis():
    """A Redis client on the broker (the Celery connection's own client: same URL, unix socket too)."""
    from webapp.celery import app

    return app.connection_for_write()


# --- sending ---------------------------------------------------------------------------------

def _task_reopen(task: AgentTask) -> None:
    """A finished task becomes queued again: a new run of the same conversation, verified anew."""
    from webapp.agents import services

    task.status, task.status_reason = AgentTask.Status.QUEUED, "follow-up queued"
    task.finished_at, task.claim_token, task.cancel_requested, task.attempt = None, None, False, 0
    task.outcome, task.test_command, task.test_summary, task.test_output = "", "", "", ""
    task.save(update_fields=["status", "status_reason", "finished_at", "claim_token", "cancel_requested", "attempt",
                             "outcome", "test_command", "test_summary", "test_output"])
    services.task_status_publish_on_commit(task)


@transaction.atomic
def followup_send(*, task: AgentTask, user, message: str) -> TaskFollowUp:
    """Queue ``message`` for the task's agent. Only the owner may send (views fetch with
    ``owned_get_for_change``; this checks again); training rollouts cannot be continued."""
    # The sender's row first, then the task's: a follow-up to a finished task queues it again, which counts
    # towards the owner's active tasks exactly as task_create (which locks the same user row) counts them.
    user_lock(user)
    task = AgentTask.objects.select_for_update().get(pk=task.pk)
    if task.owner_id != user.pk:
        raise ValidationError({"message": "only the task's owner can send follow-ups"})
    if task.source != AgentTask.Source.PRODUCT:
        raise ValidationError({"message": ValidationError("a training rollout cannot be continued", code=CONFLICT)})
    try:
        message = text_check("message", (message or "").strip(), max_chars=MAX_MESSAGE_CHARS)
    except ValueError as exc:
        raise ValidationError({"message": str(exc)}) from None
    if not message:
        raise ValidationError({"message": "write the message to send to the agent"})
    if task.is_finished:
        active_tasks_check(user=user)
    if task.status == AgentTask.Status.CANCELLED:  # messages the user cancelled with the task stay unsent
        task.followups.filter(status=TaskFollowUp.Status.PENDING).update(
            status=TaskFollowUp.Status.DROPPED, status_reason="the task was cancelled before the agent took it")
    pending_followups_check(task=task)
    followup = TaskFollowUp.objects.create(task=task, author=user, message=message)
    if task.is_finished:
        _task_reopen(task)
        transaction.on_commit(lambda: _wake_or_enqueue(task_id=task.pk))
    return followup


def _wake_or_enqueue(*, task_id: int) -> None:
    from webapp.agents.services import task_enqueue

    try:
        with _redis() as conn:
            client = conn.default_channel.client
            if client.exists(_WARM_KEY.format(task_id=task_id)):
                key = _WAKE_KEY.format(task_id=task_id)
                client.rpush(key, "1")
                client.expire(key, 600)
                return
    except Exception:
        logger.exception("could not wake the warm worker of task %s; enqueueing", task_id)
    task_enqueue(task_id=task_id)


# --- taking messages -------------------------------------------------------------------------

def _take_pending(*, task_id: int, workspace: str) -> TaskFollowUp | None:
    with transaction.atomic():
        followup = (TaskFollowUp.objects.select_for_update().select_related("author")
                    .filter(task_id=task_id, status=TaskFollowUp.Status.PENDING).order_by("created_at", "id").first())
        if followup is not None:
            followup.status, followup.delivered_at, followup.workspace = (
                TaskFollowUp.Status.DELIVERED, timezone.now(), workspace)
            followup.save(update_fields=["status", "delivered_at", "workspace"])
    return followup


def _user_meta(followup: TaskFollowUp) -> dict:
    return {"followup_id": followup.pk, "author": followup.author.get_username(), "workspace": followup.workspace,
            "sent_at": followup.created_at.timestamp()}


def next_message_for(*, task_id: int, workspace: str = "same run"):
    """The loop's ``next_message``: the oldest pending follow-up, taken (delivered) when asked."""

    def take() -> tuple[str, dict] | None:
        followup = _take_pending(task_id=task_id, workspace=workspace)
        return None if followup is None else (followup.message, _user_meta(followup))

    return take


def is_continuation(*, task_id: int) -> bool:
    """Whether the task's next run continues a finished conversation (rather than starting it)."""
    task = AgentTask.objects.filter(pk=task_id).only("messages").first()
    return bool(task and task.messages and TaskFollowUp.objects.filter(task_id=task_id).exists())


@transaction.atomic
def _reopen_if_pending(*, task_id: int) -> bool:
    """A run ended (failed, say) while follow-ups waited: queue the task again so they are answered."""
    task = AgentTask.objects.select_for_update().filter(pk=task_id).first()
    if task is None or not task.is_finished:
        return False
    if task.status == AgentTask.Status.CANCELLED:  # the user stopped the task: its queued messages go too
        task.followups.filter(status=TaskFollowUp.Status.PENDING).update(
            status=TaskFollowUp.Status.DROPPED, status_reason="the task was cancelled before the agent took it")
        return False
    if not task.followups.filter(status=TaskFollowUp.Status.PENDING).exists():
        return False
    _task_reopen(task)
    return True


# --- running a continuation ------------------------------------------------------------------

def _history(task: AgentTask) -> list[dict]:
    """The stored conversation, without a trailing assistant turn whose tool calls got no results."""
    from training.agent.loop import SYSTEM_PROMPT

    history = [dict(message) for message in (task.messages or [])]
    while history and history[-1].get("role") == "assistant" and history[-1].get("tool_calls"):
        history.pop()
    return history or [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}]


def agent_callbacks(*, task_id: int, token, lost: threading.Event,
                    after_first_event: Callable[[], None] | None = None):
    """(on_event, should_stop) of a claimed run: events stored under the claim, the run stopped when the
    claim is lost or the user cancels (task_run and follow-ups alike). ``after_first_event`` runs once, when
    the run's first event (its ``start``) is stored: work that may compete with the agent for the process
    (the semantic index build) starts only once the attempt is on record."""
    from training.agent.loop import AgentStopped
    from webapp.agents.events import ClaimLost, task_event_append

    pending = [after_first_event] if after_first_event is not None else []

    def on_event(event: dict) -> None:
        try:
            task_event_append(task_id=task_id, claim_token=token, event=event)
        except ClaimLost as exc:
            raise AgentStopped(str(exc)) from exc
        while pending:
            pending.pop()()

    def should_stop() -> str | None:
        if lost.is_set():
            return "another worker took the task over"
        current = AgentTask.objects.filter(pk=task_id).values_list("cancel_requested", "claim_token").first()
        if current is None or current[1] != token:
            lost.set()
            return "another worker took the task over"
        return "cancelled by the user" if current[0] else None

    return on_event, should_stop


def _continue(*, task: AgentTask, token, sandbox, lost: threading.Event, workspace: str) -> str:
    """Run the agent on the oldest pending follow-up in ``sandbox`` (the task's workspace), verify,
    store the outcome. The caller holds the claim and the heartbeat."""
    from training.agent.loop import run_agent
    from webapp.agents import services, verify

    followup = _take_pending(task_id=task.pk, workspace=workspace)
    if followup is None:  # a retried continuation: its message was taken by the attempt that died
        followup = task.followups.select_related("author").filter(
            status=TaskFollowUp.Status.DELIVERED).order_by("-delivered_at", "-id").first()
    if followup is None:
        services.task_fail(task_id=task.pk, claim_token=token, reason="no follow-up message to continue with")
        return "failed: nothing to continue"
    on_event, should_stop = agent_callbacks(task_id=task.pk, token=token, lost=lost)
    result = run_agent(
        sandbox=sandbox, policy=services._policy_for(task), prompt=followup.message,
        limits=AgentLimits.from_dict(task.limits), on_event=on_event, should_stop=should_stop,
        first_seq=task.last_seq + 1, history=_history(task), first_turn=task.turns,
        next_message=next_message_for(task_id=task.pk, workspace=workspace), user_meta=_user_meta(followup),
    )
    if result.status == AgentTask.Status.SUCCEEDED:
        verify.task_verify(task=task, claim_token=token, sandbox=sandbox, diff=result.diff, turn=result.turns,
                           on_event=on_event)
    # The task's totals cover the whole conversation.
    result = dataclasses.replace(result, prompt_tokens=task.prompt_tokens + result.prompt_tokens,
                                 completion_tokens=task.completion_tokens + result.completion_tokens)
    finished = services._db_retry(lambda: services.task_finish(task_id=task.pk, claim_token=token, result=result),
                                  what=f"storing the outcome of task {task.pk}")
    return f"{result.status}: {result.reason}" if finished else "claim lost to another worker"


def _claimed_run(*, task_id: int, sandbox_for, workspace: str) -> str | None:
    """Claim the task and continue it in ``sandbox_for(task)``'s sandbox; None if not claimed."""
    from webapp.agents import services

    claimed = services._db_retry(lambda: services.task_claim(task_id=task_id), what=f"claiming task {task_id}")
    if claimed is None:
        return None
    task, token = claimed
    lost = threading.Event()
    stop_heartbeat = services.heartbeat_start(task_id=task_id, token=token, lost=lost)
    try:
        sandbox = sandbox_for(task, token)
        if sandbox is None:
            return "failed: workspace"
        return _continue(task=task, token=token, sandbox=sandbox, lost=lost, workspace=workspace)
    except Exception as exc:
        logger.exception("follow-up of task %s crashed", task_id)
        reason = f"internal error: {type(exc).__name__}: {exc}"
        services._db_retry(lambda: services.task_fail(task_id=task_id, claim_token=token, reason=reason),
                           what=f"failing task {task_id}")
        return "failed: internal error"
    finally:
        stop_heartbeat.set()


def _task_state(task_id: int) -> str | None:
    return AgentTask.objects.filter(pk=task_id).values_list("status", flat=True).first()


def _others_waiting(task_id: int) -> bool:
    """Other agent tasks wait for a worker: give the slot back rather than hold it for a maybe."""
    return AgentTask.objects.filter(status=AgentTask.Status.QUEUED, source=AgentTask.Source.PRODUCT).exclude(
        pk=task_id).exists()


def after_run(*, task_id: int, sandbox, keep_warm: bool, started: float | None = None) -> int:
    """Called when a run of the task ended with ``sandbox`` still alive. Queues the task again if
    follow-ups wait; with ``keep_warm`` serves follow-ups in this sandbox until it was idle for
    ``AGENT_FOLLOWUP_WARM_S``. Returns how many continuations ran here. Never raises: the run it
    follows is stored already; a queued follow-up it could not serve is re-sent by the sweeper."""
    try:
        return _after_run(task_id=task_id, sandbox=sandbox, keep_warm=keep_warm, started=started)
    except Exception:
        logger.exception("serving follow-ups of task %s in its sandbox failed", task_id)
        return 0


def stop_warm_waits() -> None:
    """The worker is shutting down: warm waits end at once (a graceful stop must not wait for them)."""
    _shutting_down.set()


def _after_run(*, task_id: int, sandbox, keep_warm: bool, started: float | None) -> int:
    warm_s = settings.AGENT_FOLLOWUP_WARM_S if keep_warm else 0
    reopened = _reopen_if_pending(task_id=task_id)
    if warm_s <= 0:
        if reopened:
            transaction.on_commit(lambda: _wake_or_enqueue(task_id=task_id))
        return 0
    started = started or time.monotonic()
    budget_s = settings.CELERY_TASK_SOFT_TIME_LIMIT / 2  # leave the Celery task time to finish a continuation
    served, last_look = 0, False
    warm_key, wake_key = _WARM_KEY.format(task_id=task_id), _WAKE_KEY.format(task_id=task_id)
    with _redis() as conn:
        client = conn.default_channel.client
        client.set(warm_key, str(os.getpid()), ex=warm_s + 60)
        deadline = time.monotonic() + warm_s
        try:
            while True:
                if _task_state(task_id) == AgentTask.Status.QUEUED:
                    note = _claimed_run(task_id=task_id, sandbox_for=lambda task, token: sandbox, workspace="warm")
                    connection.close()
                    if note is not None:
                        served += 1
                        logger.info("follow-up of task %s in the warm sandbox: %s", task_id, note)
                        if _reopen_if_pending(task_id=task_id):
                            continue
                        deadline = time.monotonic() + warm_s
                        client.set(warm_key, str(os.getpid()), ex=warm_s + 60)
                if last_look:
                    break
                if (time.monotonic() >= deadline or time.monotonic() - started > budget_s or _shutting_down.is_set()
                        or _task_state(task_id) is None or _others_waiting(task_id)):
                    client.delete(warm_key)  # from here on senders enqueue; one last look at the row
                    last_look = True
                    continue
                client.blpop([wake_key], timeout=1)
        finally:
            client.delete(warm_key)
    return served


def _workspace_rebuild(*, task: AgentTask, token, sandbox) -> bool:
    """Apply the task's patch in a fresh sandbox of its repository; on failure fail the task, say why."""
    from sandboxes.base import SandboxError
    from webapp.agents.services import task_fail

    if not task.diff:
        return True
    reason = ""
    try:
        sandbox.write_bytes(PATCH_FILE, task.diff.encode("utf-8"))
        applied = sandbox.exec(f"git apply --whitespace=nowarn -- {PATCH_FILE}; status=$?; rm -f -- {PATCH_FILE}; "
                               "exit $status", timeout_s=120)
        if applied.exit_code != 0:
            reason = ("could not rebuild the workspace for the follow-up: the task's patch no longer applies to "
                      f"the repository ({(applied.stderr or applied.stdout).strip()[-300:]})")
    except SandboxError as exc:
        reason = f"could not rebuild the workspace for the follow-up: {type(exc).__name__}: {exc}"
    if reason:
        task_fail(task_id=task.pk, claim_token=token, reason=reason)
        return False
    return True


def continuation_run(*, task_id: int, keep_warm: bool = True) -> str:
    """Celery's entry for a follow-up no warm worker took: a fresh sandbox of the repository, the
    task's patch applied, the conversation continued; then, like a first run, it stays warm."""
    from sandboxes.base import SandboxError
    from webapp.agents import services

    started = time.monotonic()
    held: dict = {}

    def sandbox_for(task: AgentTask, token):
        try:
            held["backend"], held["snapshot"], held["sandbox"] = services._sandbox_prepare(
                task, AgentLimits.from_dict(task.limits))
        except (SandboxError, ValueError, OSError) as exc:
            services.task_fail(task_id=task_id, claim_token=token,
                               reason=f"could not prepare the sandbox: {type(exc).__name__}: {exc}")
            return None
        if not _workspace_rebuild(task=task, token=token, sandbox=held["sandbox"]):
            return None
        services.task_snapshot_record(task_id=task_id, claim_token=token, snapshot_id=held["snapshot"].id)
        services._semantic_index_start(held["sandbox"], task_id)  # the page follows this snapshot's build
        return held["sandbox"]

    try:
        note = _claimed_run(task_id=task_id, sandbox_for=sandbox_for, workspace="rebuilt")
        if note is None:
            return "skipped: finished, cancelled or running elsewhere"
        if "sandbox" in held and not note.startswith("failed: workspace"):
            after_run(task_id=task_id, sandbox=held["sandbox"], keep_warm=keep_warm, started=started)
        return note
    finally:
        if "sandbox" in held:
            try:
                held["sandbox"].destroy()
            except Exception:
                logger.exception("could not destroy the sandbox of task %s", task_id)
        if "snapshot" in held:
            services._snapshot_discard(held["backend"], held["snapshot"], task_id)  # cancels its index build too
