"""Writes of the agents app: repositories, task submission, the run itself, events, cancellation.

Side effects (enqueueing the Celery task, publishing to the Channels group through
``webapp.core.publish``) happen only in ``transaction.on_commit`` so nobody is told about rows that
were rolled back. Uploaded archives are checked in ``webapp.agents.archives``, the heartbeat thread
is ``webapp.agents.heartbeat`` and RL rollouts are recorded by ``webapp.agents.rollouts``; their
names are importable from here too.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import UploadedFile
from django.db import transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from training.agent.config import AgentLimits
from webapp.accounts.limits import active_tasks_check, upload_allowance
from webapp.agents.archives import (  # noqa: F401  (importable from here, as before the split)
    ARCHIVE_SUFFIXES,
    MAX_ARCHIVE_MEMBERS,
    MAX_ARCHIVE_UNPACKED_BYTES,
    archive_store,
)
from webapp.agents.events import (  # noqa: F401  (importable from here, as before the split)
    ClaimLost,
    event_insert,
    task_event_append,
    task_status_publish_on_commit,
)
from webapp.agents.heartbeat import heartbeat_start, task_heartbeat  # noqa: F401
from webapp.agents.models import AgentTask, Repository
from webapp.agents.rollouts import rollout_record  # noqa: F401
from webapp.agents.storable import storable_text
from webapp.agents.validation import (
    agent_limits_check,
    base_url_check,
    is_operator_openai_url,
    policy_options_check,
    sandbox_runtime_check,
)
from webapp.core.publish import coalesce_events
from webapp.core.validation import CONFLICT

logger = logging.getLogger(__name__)

GIT_URL_PATTERN = re.compile(r"^(https?://|git://)[^\s]+$")
TASK_MESSAGE_PREFIX = "agent-task-"
_coalesce_events = coalesce_events  # the name tests and older callers use


# --- Repositories ----------------------------------------------------------------------------

def git_url_check(*, url: str) -> str:
    """Syntax, scheme and (for address literals and names that resolve now) the outbound address guard.

    The worker checks the resolved address again right before it clones and pins git to it.
    """
    from sandboxes.git_fetch import GitSourceRejected, check_url

    url = (url or "").strip()
    if not GIT_URL_PATTERN.match(url):
        raise ValidationError({"git_url": f"'{url[:200]}' is not a git URL; use https:// or git://"})
    try:
        check_url(url, resolve_required=False)
    except GitSourceRejected as exc:
        raise ValidationError({"git_url": str(exc)}) from None
    return url


def git_ref_check(*, ref: str) -> str:
    from sandboxes.git_fetch import GitSourceRejected, check_ref

    try:
        return check_ref(ref)
    except GitSourceRejected as exc:
        raise ValidationError({"git_ref": str(exc)}) from None


@transaction.atomic
def repository_create(
    *, owner, name: str, kind: str, location: str = "", ref: str = "", description: str = "",
    archive: UploadedFile | None = None, team=None, allow_server_path: bool = False,
) -> Repository:
    """Register a repository. Server directories (``kind="path"``) are for staff and the demo only."""
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "give the repository a name"})
    if Repository.objects.filter(owner=owner, name=name).exists():
        raise ValidationError({"name": f"you already have a repository named '{name}'"})
    if kind == Repository.Kind.GIT:
        location = git_url_check(url=location)
    elif kind == Repository.Kind.ARCHIVE:
        if archive is None:
            raise ValidationError({"archive": "upload an archive for an archive repository"})
        with upload_allowance(user=owner, size=archive.size):
            location = str(archive_store(upload=archive))
    elif kind == Repository.Kind.PATH:
        if not (allow_server_path or owner.is_staff):
            raise ValidationError({"kind": "only staff may register directories on the server"})
        if not Path(location).is_dir():
            raise ValidationError({"location": f"'{location}' is not a directory on the server"})
    else:
        raise ValidationError({"kind": f"unknown repository kind '{kind}'; use git, path or archive"})
    if ref and kind != Repository.Kind.GIT:
        raise ValidationError({"ref": "a ref only applies to git repositories"})
    if ref:
        try:
            ref = git_ref_check(ref=ref)
        except ValidationError as exc:
            raise ValidationError({"ref": exc.message_dict["git_ref"]}) from None
    return Repository.objects.create(owner=owner, team=team, name=name, kind=kind, location=location, ref=ref,
                                     description=description)


# --- Task submission -------------------------------------------------------------------------

def _limits_check(limits: dict[str, Any] | None) -> dict[str, Any]:
    try:
        return agent_limits_check(limits)
    except ValidationError as exc:
        raise ValidationError({"limits": exc.messages}) from exc


@transaction.atomic
def _policy_fields_check(
    *, owner, backend: str, model_name: str, base_url: str, api_key: str, builtin_base_url: str
) -> tuple[str, str, str]:
    """(model_name, base_url, api_key) of the chosen policy backend, checked."""
    if backend == AgentTask.Backend.OPENAI:
        base_url = (base_url or settings.OPENAI_BASE_URL or "").strip()
        model_name = (model_name or settings.OPENAI_MODEL or "").strip()
        if not base_url.startswith(("http://", "https://")):
            raise ValidationError({"base_url": "give the http(s) base URL of the OpenAI-compatible server (or set OPENAI_BASE_URL)"})
        base_url = base_url_check(url=base_url, builtin_base_url=settings.AGENT_BUILTIN_BASE_URL or builtin_base_url)
        if not model_name:
            raise ValidationError({"model_name": "name the model to call (or set OPENAI_MODEL)"})
    elif backend == AgentTask.Backend.BUILTIN:
        model_name = _builtin_model_check(owner=owner, model_name=model_name)
        base_url = settings.AGENT_BUILTIN_BASE_URL or builtin_base_url
        if not base_url:
            raise ValidationError({"backend": "set AGENT_BUILTIN_BASE_URL so workers can reach this server's /v1 endpoint"})
        api_key = ""
    else:
        from training.agent.scripted import SCRIPTED_MODEL_NAME

        model_name, base_url, api_key = SCRIPTED_MODEL_NAME, "", ""
    return model_name, base_url, api_key


def task_create(
    *,
    owner,
    prompt: str,
    backend: str,
    repository: Repository | None = None,
    git_url: str = "",
    git_ref: str = "",
    archive: UploadedFile | None = None,
    model_name: str = "",
    base_url: str = "",
    api_key: str = "",
    limits: dict[str, Any] | None = None,
    policy_options: dict[str, Any] | None = None,
    team=None,
    builtin_base_url: str = "",
    enqueue: bool = True,
    sandbox_runtime: str = "",
) -> AgentTask:
    """Validate a submission, store the task as ``queued`` and enqueue its run after commit.

    Exactly one of ``repository`` (already checked visible to ``owner``), ``git_url`` or
    ``archive`` names the code. ``builtin_base_url`` is this server's ``/v1`` as seen by the
    submitting request, used for the built-in model unless ``AGENT_BUILTIN_BASE_URL`` is set.
    """
    errors: dict[str, str] = {}
    prompt = (prompt or "").strip()
    if not prompt:
        errors["prompt"] = "describe the task for the agent"
    elif len(prompt) > 20_000:
        errors["prompt"] = f"the prompt is {len(prompt)} characters; the limit is 20000"
    sources = [name for name, given in (("repository", repository), ("git_url", git_url), ("archive", archive)) if given]
    if len(sources) != 1:
        errors["repository"] = ("choose a registered repository, a git URL or an archive"
                                if not sources else f"give only one of repository, git URL or archive (got {', '.join(sources)})")
    if backend not in AgentTask.Backend.values:
        errors["backend"] = f"unknown backend '{backend}'; choose one of {', '.join(AgentTask.Backend.values)}"
    if errors:
        raise ValidationError(errors)

    limits = _limits_check(limits)
    sandbox_runtime = sandbox_runtime_check(sandbox_runtime)
    policy_options = policy_options_check(backend=backend, options=policy_options)

    model_name, base_url, api_key = _policy_fields_check(
        owner=owner, backend=backend, model_name=model_name, base_url=base_url, api_key=api_key,
        builtin_base_url=builtin_base_url,
    )

    # One transaction: the owner's row stays locked from the count of active tasks to the insert, so
    # concurrent submissions take turns at the cap (select_for_update needs the transaction).
    with transaction.atomic():
        active_tasks_check(user=owner)  # locks the owner's row: concurrent submissions take turns at the cap
        if repository is not None:
            kind, location, ref, label = repository.kind, repository.location, repository.ref, repository.name
        elif git_url:
            kind, location, ref = Repository.Kind.GIT, git_url_check(url=git_url), git_ref_check(ref=git_ref)
            label = location.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git") or location
        elif archive is not None:
            with upload_allowance(user=owner, size=archive.size):
                kind, location, ref, label = Repository.Kind.ARCHIVE, str(archive_store(upload=archive)), "", archive.name
        else:
            raise ValidationError({"repository": "give a repository, a git URL or an archive"})

        task = AgentTask.objects.create(
            owner=owner, team=team, repository=repository, repo_kind=kind, repo_location=location, repo_ref=ref,
            repo_label=label[:200], prompt=prompt, backend=backend, model_name=model_name, base_url=base_url,
            api_key=api_key, limits=limits, policy_options=policy_options, sandbox_runtime=sandbox_runtime,
        )
        if enqueue:
            transaction.on_commit(lambda: task_enqueue(task_id=task.pk))
    return task


def _builtin_model_check(*, owner, model_name: str) -> str:
    """The model a built-in task runs: the configured checkpoint (no name, or its name) or a registered model
    the owner may use (webapp.registry), served by this server's /v1 under the owner's token."""
    from webapp.registry.selectors import registered_models_visible_to

    requested = (model_name or "").strip()
    if requested and requested != settings.AGENT_BUILTIN_MODEL_NAME:
        visible = registered_models_visible_to(user=owner)
        if not visible.filter(name=requested).exists():
            names = ", ".join(visible.values_list("name", flat=True)[:20]) or "none"
            raise ValidationError({"model_name": f"'{requested[:100]}' is not a registered model you may use "
                                                 f"(yours: {names}; see the Models page)"})
        return requested
    if not settings.MODEL_CHECKPOINT:
        raise ValidationError({"backend": "the built-in model is not configured: set FLOWSTATE_MODEL_CHECKPOINT to a "
                                          "checkpoint directory, or choose a registered model"})
    return settings.AGENT_BUILTIN_MODEL_NAME


@transaction.atomic
def task_cancel(*, task: AgentTask, user) -> AgentTask:
    """Cancel a queued task at once; ask a running one to stop at its next step."""
    task = AgentTask.objects.select_for_update().get(pk=task.pk)
    if task.is_finished:
        raise ValidationError({"status": ValidationError(
            f"the task already {task.status}; only queued or running tasks can be cancelled", code=CONFLICT)})
    task.cancel_requested = True
    if task.status == AgentTask.Status.QUEUED:
        task.status = AgentTask.Status.CANCELLED
        task.status_reason = f"cancelled by {user.get_username()} before it started"
        task.finished_at = timezone.now()
    task.save(update_fields=["cancel_requested", "status", "status_reason", "finished_at"])
    task_status_publish_on_commit(task)
    return task


# --- Running -------------------------------------------------------------------------------

def _claim_token_won(*, task_id: int, query, updates: dict) -> AgentTask | None:
    """Apply ``updates`` with a fresh claim token if ``query`` still matches the row; the one
    conditional UPDATE is what makes a claim exclusive on every backend (a second claimer's WHERE no
    longer matches, with or without row locks)."""
    token = uuid.uuid4()
    if not query.filter(pk=task_id).update(claim_token=token, attempt=F("attempt") + 1, **updates):
        return None
    return AgentTask.objects.get(pk=task_id)


def _task_running_mark(task: AgentTask) -> tuple[AgentTask, uuid.UUID]:
    task.status_reason = f"attempt {task.attempt} running"
    task.save(update_fields=["status_reason"])
    task_status_publish_on_commit(task)
    return task, task.claim_token


@transaction.atomic
def task_claim(*, task_id: int) -> tuple[AgentTask, uuid.UUID] | None:
    """Take the task for this worker, or return None when it must not run here.

    ``queued`` becomes ``running`` under a new claim token in one conditional UPDATE, so of two
    deliveries of one message exactly one claims it. A running task whose heartbeat is fresh
    belongs to a live worker (duplicate delivery): skipped. A running task with a stale heartbeat
    lost its worker: retried in a fresh sandbox, or failed with the reason once
    ``AGENT_MAX_ATTEMPTS`` is used up. The new claim token makes any surviving writer of the old
    attempt fail with ``ClaimLost``, so two agents never write to one task.
    """
    now = timezone.now()
    queued = AgentTask.objects.filter(status=AgentTask.Status.QUEUED, cancel_requested=False)
    task = _claim_token_won(task_id=task_id, query=queued, updates={
        "status": AgentTask.Status.RUNNING, "started_at": Coalesce("started_at", Value(now)), "heartbeat_at": now})
    if task is not None:
        return _task_running_mark(task)
    task = AgentTask.objects.select_for_update().filter(pk=task_id).first()
    if task is None or task.is_finished:
        return None
    if task.cancel_requested:
        _task_finish_row(task, status=AgentTask.Status.CANCELLED, reason="cancelled before it started")
        return None
    stale_before = now - timedelta(seconds=settings.AGENT_STALE_AFTER_S)
    if task.status != AgentTask.Status.RUNNING or (task.heartbeat_at and task.heartbeat_at > stale_before):
        return None
    if task.attempt >= settings.AGENT_MAX_ATTEMPTS:
        _task_finish_row(task, status=AgentTask.Status.FAILED, reason=(
            f"the worker running attempt {task.attempt} stopped responding and no attempts are left "
            f"(AGENT_MAX_ATTEMPTS={settings.AGENT_MAX_ATTEMPTS})"))
        return None
    event_insert(task, kind="retry", turn=0, payload={
        "reason": f"the worker running attempt {task.attempt} stopped responding; restarting in a fresh sandbox",
        "previous_attempt": task.attempt,
    })
    # Only the holder of the old token at its old heartbeat may take over: a late heartbeat of the
    # old attempt, or another sweeper's claim, makes this UPDATE match nothing.
    stale = AgentTask.objects.filter(claim_token=task.claim_token, heartbeat_at=task.heartbeat_at,
                                     status=AgentTask.Status.RUNNING)
    claimed = _claim_token_won(task_id=task_id, query=stale, updates={"heartbeat_at": now, "last_seq": task.last_seq})
    if claimed is None:
        transaction.set_rollback(True)
        return None
    return _task_running_mark(claimed)


def _task_finish_row(task: AgentTask, *, status: str, reason: str) -> None:
    task.status = status
    task.status_reason = reason
    task.finished_at = timezone.now()
    task.claim_token = None
    task.save(update_fields=["status", "status_reason", "finished_at", "claim_token"])
    task_status_publish_on_commit(task)


@transaction.atomic
def task_finish(*, task_id: int, claim_token: uuid.UUID, result) -> AgentTask | None:
    """Store the outcome of a run (an ``AgentResult``) if this worker still holds the claim."""
    task = AgentTask.objects.select_for_update().filter(pk=task_id, claim_token=claim_token).first()
    if task is None:
        return None
    task.final_message = storable_text(result.final_message)
    task.diff = storable_text(result.diff)
    task.messages = storable_text(result.messages)
    task.turns = result.turns
    task.prompt_tokens = result.prompt_tokens
    task.completion_tokens = result.completion_tokens
    task.save(update_fields=["final_message", "diff", "messages", "turns", "prompt_tokens", "completion_tokens"])
    _task_finish_row(task, status=result.status, reason=result.reason)
    return task


@transaction.atomic
def task_fail(*, task_id: int, claim_token: uuid.UUID | None, reason: str) -> None:
    """Mark a task failed with ``reason`` (infrastructure failure before or around the agent)."""
    query = AgentTask.objects.select_for_update().filter(pk=task_id)
    if claim_token is not None:
        query = query.filter(claim_token=claim_token)
    task = query.first()
    if task is None or task.is_finished:
        return
    event_insert(task, kind="error", turn=0, payload={"message": reason, "infrastructure": True})
    task.save(update_fields=["last_seq"])
    _task_finish_row(task, status=AgentTask.Status.FAILED, reason=reason)


def _policy_for(task: AgentTask):
    from training.agent.demo_repo import demo_expert_policy
    from training.agent.policy import OpenAIChatPolicy
    from webapp.accounts.services import api_token_get_or_create

    if task.backend == AgentTask.Backend.SCRIPTED:
        return demo_expert_policy(step_delay_s=float(task.policy_options.get("step_delay_s", 0)))
    if task.backend == AgentTask.Backend.BUILTIN:
        return OpenAIChatPolicy(task.base_url, task.model_name, api_token_get_or_create(user=task.owner),
                                seed=task.policy_options.get("seed"))
    # The operator's key goes only to the operator's server. A URL a user chose gets the user's key or
    # none, and is checked by the outbound address guard again now (DNS may have changed since it was
    # submitted, or the row was edited) with the connection pinned to the address checked.
    operators = is_operator_openai_url(task.base_url)
    key = task.api_key or (settings.OPENAI_API_KEY if operators else "") or ""
    return OpenAIChatPolicy(task.base_url, task.model_name, key, seed=task.policy_options.get("seed"),
                            user_url=not operators)


def _db_retry(call, *, what: str, attempts: int = 5):
    """Run a short write again when the database refuses it for a moment (a lock, a dropped
    connection), so a task is not left ``running`` by one transient error in marking its outcome."""
    from django.db import OperationalError, close_old_connections

    for attempt in range(1, attempts + 1):
        try:
            return call()
        except OperationalError:
            if attempt == attempts:
                raise
            logger.warning("%s failed (attempt %d of %d); trying again", what, attempt, attempts, exc_info=True)
            close_old_connections()
            time.sleep(0.5 * attempt)
    return None


def _snapshot_discard(backend, snapshot, task_id: int) -> None:
    from webapp.mining.services import snapshot_is_kept

    try:
        if snapshot_is_kept(snapshot_id=snapshot.id):
            return  # a repository's prepared snapshot, shared by its tasks (and so is its index)
        _semantic_index_cancel(snapshot, task_id)  # its index is of no use once the snapshot is gone
        backend.snapshot_delete(snapshot=snapshot)
    except Exception:
        logger.exception("could not delete the snapshot of task %s", task_id)


def _sandbox_prepare(task: AgentTask, limits: AgentLimits):
    """(backend, snapshot, sandbox) for one attempt; the snapshot is deleted again if no sandbox comes of it."""
    from sandboxes import get_backend
    from sandboxes.base import RepoSource, SandboxLimits

    backend = get_backend(settings.AGENT_SANDBOX_BACKEND or settings.SANDBOX_BACKEND, runtime=task.sandbox_runtime or None)
    if task.attempt > 1:
        # The previous attempt's worker is gone; its sandbox must not live on beside this one.
        try:
            backend.reap_orphans()
        except Exception:
            logger.exception("could not reap the sandboxes of dead workers before retrying task %s", task.pk)
    from webapp.mining.services import prepared_snapshot_get, recipe_snapshot_setup

    source = RepoSource(kind=task.repo_kind, location=task.repo_location, ref=task.repo_ref or None)
    # The repository's prepared snapshot (its setup's installed environment), while its recipe is unchanged;
    # else a snapshot of its own, built with the ready recipe's networked setup when there is one.
    snapshot = prepared_snapshot_get(repository_id=task.repository_id, backend=backend, source=source)
    if snapshot is None:
        setup_commands, setup_limits = recipe_snapshot_setup(repository_id=task.repository_id)
        snapshot = backend.snapshot_create(source=source, setup_commands=setup_commands, setup_limits=setup_limits)
    try:
        sandbox = backend.sandbox_create(snapshot=snapshot, limits=SandboxLimits(
            lifetime_s=limits.wall_time_s + 300, command_timeout_s=min(120.0, limits.wall_time_s)))
    except BaseException:
        _snapshot_discard(backend, snapshot, task.pk)
        raise
    return backend, snapshot, sandbox


def _semantic_index_start(sandbox, task_id: int) -> None:
    """Start the snapshot's semantic index build now (background, bounded): the agent is not held up,
    its searches answer from BM25 until the index is ready, and the task page follows the build."""
    from sandboxes.semantic import index_build_start

    try:
        index_build_start(sandbox=sandbox)
    except Exception:  # the agent's first semantic_search tries again and reports what went wrong
        logger.exception("could not start the semantic index build of task %s", task_id)


def _semantic_index_cancel(snapshot, task_id: int) -> None:
    from sandboxes.semantic import index_build_cancel

    try:
        index_build_cancel(snapshot_id=snapshot.id)
    except Exception:
        logger.exception("could not cancel the semantic index build of task %s", task_id)


def task_snapshot_record(*, task_id: int, claim_token, snapshot_id: str) -> bool:
    """Store the snapshot this attempt works on (the task page follows its semantic index build)."""
    return bool(AgentTask.objects.filter(pk=task_id, claim_token=claim_token).update(snapshot_id=snapshot_id))


def task_run(*, task_id: int, keep_warm: bool = False) -> str:
    """Claim the task, run the agent in a fresh sandbox, store every event and the outcome.

    Returns a short note for the Celery result. Errors of the sandbox or policy server end the
    task as ``failed`` with the reason; nothing is left ``running`` unless this process dies, in
    which case the sweeper (``tasks_recover_stale``) hands it to a new claim once the heartbeat
    goes stale. The agent stops at its next step once the claim is lost. Follow-ups sent meanwhile
    are taken when the agent stops; ``keep_warm`` (Celery runs) then keeps the sandbox for more
    (webapp.agents.followups).
    """
    from sandboxes.base import SandboxError
    from sandboxes.git_fetch import OutboundRefused
    from training.agent.loop import run_agent
    from webapp.agents import followups, verify

    claimed = _db_retry(lambda: task_claim(task_id=task_id), what=f"claiming task {task_id}")
    if claimed is None:
        return "skipped: finished, cancelled or running elsewhere"
    task, token = claimed
    limits = AgentLimits.from_dict(task.limits)
    lost = threading.Event()
    stop_heartbeat = heartbeat_start(task_id=task_id, token=token, lost=lost)

    def fail(reason: str) -> None:
        _db_retry(lambda: task_fail(task_id=task_id, claim_token=token, reason=reason), what=f"failing task {task_id}")

    backend = snapshot = sandbox = None
    try:
        try:
            policy = _policy_for(task)
        except OutboundRefused as exc:
            fail(f"the policy server was not contacted: {exc}")
            return "failed: base_url refused"
        try:
            backend, snapshot, sandbox = _sandbox_prepare(task, limits)
        except (SandboxError, ValueError, OSError) as exc:
            fail(f"could not prepare the sandbox: {type(exc).__name__}: {exc}")
            return "failed: sandbox"
        # The sandbox's own snapshot: the one its semantic index is keyed by (for the fleet, the copy on its host).
        _db_retry(lambda: task_snapshot_record(task_id=task_id, claim_token=token, snapshot_id=sandbox.snapshot.id),
                  what=f"recording the snapshot of task {task_id}")
        task.snapshot_id = snapshot.id  # verification skips setup already in a repository's prepared snapshot

        on_event, should_stop = followups.agent_callbacks(
            task_id=task_id, token=token, lost=lost,
            after_first_event=lambda: _semantic_index_start(sandbox, task_id))
        result = run_agent(sandbox=sandbox, policy=policy, prompt=task.prompt, limits=limits, on_event=on_event,
                           should_stop=should_stop, first_seq=task.last_seq + 1,
                           next_message=followups.next_message_for(task_id=task_id))
        if result.status == AgentTask.Status.SUCCEEDED:  # the loop stopped: do the tests pass?
            verify.task_verify(task=task, claim_token=token, sandbox=sandbox, diff=result.diff, turn=result.turns,
                               on_event=on_event)
        finished = _db_retry(lambda: task_finish(task_id=task_id, claim_token=token, result=result),
                             what=f"storing the outcome of task {task_id}")
        if finished:
            stop_heartbeat.set()
            followups.after_run(task_id=task_id, sandbox=sandbox, keep_warm=keep_warm)
        return f"{result.status}: {result.reason}" if finished else "claim lost to another worker"
    except Exception as exc:
        logger.exception("task %s crashed", task_id)
        fail(f"internal error: {type(exc).__name__}: {exc}")
        return "failed: internal error"
    finally:
        stop_heartbeat.set()
        if sandbox is not None:
            try:
                sandbox.destroy()
            except Exception:
                logger.exception("could not destroy the sandbox of task %s", task_id)
        if snapshot is not None:
            _snapshot_discard(backend, snapshot, task_id)


def task_enqueue(*, task_id: int) -> None:
    """Send the run message of a task. Its Celery id names the task, so the sweeper can tell which
    queued tasks have a message waiting in the broker (``broker_waiting_task_ids``)."""
    from webapp.agents.tasks import agent_task_run

    agent_task_run.apply_async((task_id,), task_id=f"{TASK_MESSAGE_PREFIX}{task_id}-{uuid.uuid4().hex[:12]}")


def tasks_recover_stale() -> int:
    """Re-enqueue what a dead worker or a lost message left behind; return how many were sent.

    * ``running`` tasks whose heartbeat is older than ``AGENT_STALE_AFTER_S``: ``task_claim``
      retries or fails them (and skips any whose heartbeat came back meanwhile);
    * ``queued`` tasks older than ``AGENT_QUEUED_GRACE_S`` with no message waiting in the broker's
      queue: the message was lost (a broker restart), or a killed worker had prefetched it and it
      sits unacknowledged until the visibility timeout.

    Every worker calls it at start and then every ``AGENT_SWEEP_S``. An extra message never starts
    a second agent: the claim is one conditional UPDATE. Neither kind is sent again while a message
    for it waits in the queue.
    """
    from webapp.agents.selectors import broker_waiting_task_ids

    now = timezone.now()
    stale = AgentTask.objects.filter(status=AgentTask.Status.RUNNING,
                                     heartbeat_at__lt=now - timedelta(seconds=settings.AGENT_STALE_AFTER_S))
    waiting = set(AgentTask.objects.filter(
        status=AgentTask.Status.QUEUED, created_at__lt=now - timedelta(seconds=settings.AGENT_QUEUED_GRACE_S),
    ).values_list("pk", flat=True))
    candidates = waiting | set(stale.values_list("pk", flat=True))
    # A task whose message still waits in the queue gets no second one: a busy pool would otherwise
    # collect a copy per sweep.
    ids = sorted(candidates - broker_waiting_task_ids()) if candidates else []
    for task_id in ids:
        task_enqueue(task_id=task_id)
    return len(ids)


