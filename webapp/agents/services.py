"""Writes of the agents app: repositories, task submission, the run itself, events, cancellation.

Side effects (enqueueing the Celery task, publishing to the Channels group) happen only in
``transaction.on_commit`` so nobody is told about rows that were rolled back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import tarfile
import threading
import time
import uuid
import zipfile
from datetime import timedelta
from pathlib import Path
from typing import Any

from channels.layers import get_channel_layer
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import UploadedFile
from django.db import connection, transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from training.agent.config import AgentLimits
from webapp.agents.models import AgentTask, Repository, TaskEvent
from webapp.agents.selectors import LIVE_CHANNEL_LAYER, event_to_wire, event_wire, task_group_name
from webapp.agents.validation import agent_limits_check, policy_options_check
from webapp.core.validation import CONFLICT

logger = logging.getLogger(__name__)

GIT_URL_PATTERN = re.compile(r"^(https?://|git://)[^\s]+$")
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
MAX_ARCHIVE_MEMBERS = 20_000
MAX_ARCHIVE_UNPACKED_BYTES = 512 * 1024 * 1024
DISPLAY_CHARS = 4000
TASK_MESSAGE_PREFIX = "agent-task-"


class ClaimLost(Exception):
    """Another worker took the task over (or it finished); this worker must stop writing."""


# --- Channels publishing ---------------------------------------------------------------------

class _GroupPublisher:
    """Sends group messages from one long-lived event loop thread, in submission order.

    ``async_to_sync(group_send)`` per event would build a new event loop and Redis connection each
    time (milliseconds) and block the agent; here the agent only enqueues. Order is kept because one
    coroutine sends the messages one after another. A lost message costs a viewer nothing: the
    consumer fills gaps from the database.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._pid = 0

    def _ensure_started(self) -> None:
        with self._lock:
            # After a fork (prefork Celery pool) the parent's thread does not exist in the child.
            if self._loop is not None and self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._loop = asyncio.new_event_loop()
            self._queue = asyncio.Queue()
            ready = threading.Event()
            threading.Thread(target=self._serve, args=(ready,), name="channels-publisher", daemon=True).start()
            ready.wait(5)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(ready.set)
        self._loop.run_until_complete(self._drain())

    async def _drain(self) -> None:
        layer = get_channel_layer(LIVE_CHANNEL_LAYER)
        while True:
            batch = [await self._queue.get()]
            # A turn's events are committed a few milliseconds apart; waiting a moment lets them
            # leave as one message, which matters when hundreds of viewers each get every message.
            await asyncio.sleep(COALESCE_WINDOW_S)
            while not self._queue.empty() and len(batch) < MAX_EVENTS_PER_MESSAGE:
                batch.append(self._queue.get_nowait())
            for group, message in _coalesce_events([(group, message) for group, message, _ in batch]):
                try:
                    if layer is not None:
                        await layer.group_send(group, message)
                except Exception:  # a broken channel layer must not fail the run; viewers resume from the DB
                    logger.exception("could not publish to %s", group)
            for _, _, done in batch:
                self._queue.task_done()
                if done is not None:
                    done.set()

    def submit(self, group: str, message: dict, *, wait_s: float = 0.0) -> None:
        self._ensure_started()
        done = threading.Event() if wait_s else None
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (group, message, done))
        if done is not None:
            done.wait(wait_s)


_publisher = _GroupPublisher()
MAX_EVENTS_PER_MESSAGE = 64
COALESCE_WINDOW_S = 0.01


def _coalesce_events(items: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Merge consecutive events of one task into one group message (one websocket frame per viewer).

    A turn publishes several events within milliseconds (model output, its tool calls, then their
    results); with hundreds of viewers each extra message costs hundreds of deliveries. Order is
    kept: only neighbours merge, and a status message ends a run of events.
    """
    merged: list[tuple[str, dict]] = []
    pending: list[str] = []
    pending_group, first_seq, last_seq, first_ts = "", 0, 0, None

    def flush() -> None:
        if pending:
            text = '{"type": "events", "events": [' + ", ".join(pending) + "]}"
            merged.append((pending_group, {"type": "task.event", "seq": first_seq, "last_seq": last_seq, "ts": first_ts,
                                           "text": text}))
            pending.clear()

    for group, message in items:
        if message.get("type") != "task.event":
            flush()
            merged.append((group, message))
            continue
        if pending and (group != pending_group or message["seq"] != last_seq + 1):
            flush()
        if not pending:
            pending_group, first_seq, first_ts = group, message["seq"], message.get("ts")
        pending.append(message["event_json"])
        last_seq = message["seq"]
    flush()
    return merged


def _publish(*, task_id: int, message: dict) -> None:
    # The final status waits briefly so a process that exits right after (demo seeding) still sends it.
    final = message.get("type") == "task.status" and message.get("status") in AgentTask.FINISHED
    _publisher.submit(task_group_name(task_id=task_id), message, wait_s=2.0 if final else 0.0)


def _publish_status_on_commit(task: AgentTask) -> None:
    message = {"type": "task.status", "status": task.status, "reason": task.status_reason, "last_seq": task.last_seq}
    transaction.on_commit(lambda: _publish(task_id=task.pk, message=message))


# --- Repositories ----------------------------------------------------------------------------

def archive_store(*, upload: UploadedFile) -> Path:
    """Validate an uploaded archive and keep it under the state dir; refuse anything unsafe."""
    name = upload.name or ""
    if not name.lower().endswith(ARCHIVE_SUFFIXES):
        raise ValidationError({"archive": f"'{name}' is not a supported archive; upload a .tar.gz, .tgz, .tar or .zip file"})
    if upload.size > settings.MAX_UPLOAD_BYTES:
        raise ValidationError({"archive": f"the archive is {upload.size} bytes; the limit is {settings.MAX_UPLOAD_BYTES} bytes"})
    target_dir = Path(settings.STATE_DIR) / "uploads"
    target_dir.mkdir(parents=True, exist_ok=True)
    suffix = next(s for s in ARCHIVE_SUFFIXES if name.lower().endswith(s))
    target = target_dir / f"{uuid.uuid4().hex}{suffix}"
    with target.open("wb") as out:
        for chunk in upload.chunks():
            out.write(chunk)
    try:
        _archive_check(target)
    except ValidationError:
        target.unlink(missing_ok=True)
        raise
    return target


def _member_problem(member_name: str) -> str | None:
    if member_name.startswith("/") or re.match(r"^[A-Za-z]:", member_name):
        return f"member '{member_name}' has an absolute path"
    if ".." in Path(member_name).parts:
        return f"member '{member_name}' escapes the archive with '..'"
    return None


def _archive_check(path: Path) -> None:
    total = 0
    try:
        if path.name.endswith(".zip"):
            with zipfile.ZipFile(path) as archive:
                members = archive.infolist()
                if len(members) > MAX_ARCHIVE_MEMBERS:
                    raise ValidationError({"archive": f"the archive has {len(members)} members; the limit is {MAX_ARCHIVE_MEMBERS}"})
                for info in members:
                    if problem := _member_problem(info.filename):
                        raise ValidationError({"archive": problem})
                    total += info.file_size
        else:
            with tarfile.open(path) as archive:
                for count, member in enumerate(archive, start=1):
                    if count > MAX_ARCHIVE_MEMBERS:
                        raise ValidationError({"archive": f"the archive has more than {MAX_ARCHIVE_MEMBERS} members"})
                    if problem := _member_problem(member.name):
                        raise ValidationError({"archive": problem})
                    if member.issym() or member.islnk():
                        target = member.linkname
                        if target.startswith("/") or ".." in Path(target).parts:
                            raise ValidationError({"archive": f"link '{member.name}' points outside the archive ({target})"})
                    elif not (member.isfile() or member.isdir()):
                        raise ValidationError({"archive": f"member '{member.name}' is a device or fifo, which is not allowed"})
                    total += member.size
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
        raise ValidationError({"archive": f"the archive is malformed or truncated and cannot be read ({exc})"}) from exc
    if total > MAX_ARCHIVE_UNPACKED_BYTES:
        raise ValidationError({"archive": f"the archive unpacks to {total} bytes; the limit is {MAX_ARCHIVE_UNPACKED_BYTES} bytes"})


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
    policy_options = policy_options_check(backend=backend, options=policy_options)

    if backend == AgentTask.Backend.OPENAI:
        base_url = (base_url or settings.OPENAI_BASE_URL or "").strip()
        model_name = (model_name or settings.OPENAI_MODEL or "").strip()
        if not base_url.startswith(("http://", "https://")):
            raise ValidationError({"base_url": "give the http(s) base URL of the OpenAI-compatible server (or set OPENAI_BASE_URL)"})
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

    if repository is not None:
        kind, location, ref, label = repository.kind, repository.location, repository.ref, repository.name
    elif git_url:
        kind, location, ref = Repository.Kind.GIT, git_url_check(url=git_url), git_ref_check(ref=git_ref)
        label = location.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git") or location
    else:
        kind, location, ref, label = Repository.Kind.ARCHIVE, str(archive_store(upload=archive)), "", archive.name

    task = AgentTask.objects.create(
        owner=owner, team=team, repository=repository, repo_kind=kind, repo_location=location, repo_ref=ref,
        repo_label=label[:200], prompt=prompt, backend=backend, model_name=model_name, base_url=base_url,
        api_key=api_key, limits=limits, policy_options=policy_options,
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
    _publish_status_on_commit(task)
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
    _publish_status_on_commit(task)
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
    _event_insert(task, kind="retry", turn=0, payload={
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


def storable_text(value):
    """`value` with NUL characters replaced by U+FFFD, through dicts and lists.

    PostgreSQL text and jsonb cannot hold NUL, and model output (a random or early checkpoint emits
    any byte) or a tool's output (a binary file) may contain it; storing it raw would fail the whole
    rollout or event write and lose it.
    """
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, dict):
        return {storable_text(key): storable_text(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable_text(item) for item in value]
    return value


def _event_fields(kind: str, payload: dict) -> tuple[dict, str, str]:
    """Split a loop event payload into (stored payload with truncated display, full output, tool name)."""
    payload = storable_text(dict(payload))
    full_output = ""
    if kind == "tool_result":
        full_output = payload.pop("output", "") or ""
        display = payload.get("display") or full_output
        if len(display) > DISPLAY_CHARS:
            display = display[:DISPLAY_CHARS] + f"\n[... {len(full_output) - DISPLAY_CHARS} more characters; open the full result]"
        payload["display"] = display
        payload["output_chars"] = len(full_output)
    tool_name = (payload.get("name") or "")[:50] if kind in ("tool_call", "tool_result") else ""
    return payload, full_output, tool_name


def _publish_event_on_commit(*, task_id: int, wire: dict) -> None:
    # Serialised once here instead of once per viewer: a task may have hundreds of viewers.
    message = {"type": "task.event", "seq": wire["seq"], "ts": wire["ts"], "event_json": json.dumps(wire)}
    transaction.on_commit(lambda: _publish(task_id=task_id, message=message))


def _event_insert(task: AgentTask, *, kind: str, turn: int, payload: dict, ts: float | None = None) -> TaskEvent:
    """Insert the next event of a locked task row and publish it after commit."""
    payload, full_output, tool_name = _event_fields(kind, payload)
    task.last_seq += 1
    event = TaskEvent.objects.create(
        task=task, seq=task.last_seq, kind=kind, turn=turn, attempt=max(task.attempt, 1), tool_name=tool_name,
        payload=payload, full_output=full_output, ts=ts if ts is not None else timezone.now().timestamp(),
    )
    _publish_event_on_commit(task_id=task.pk, wire=event_to_wire(event=event))
    return event


# One statement = one round trip and its own transaction: claim check, sequence number, heartbeat
# and the event row together. The live view's latency is mostly this write.
_APPEND_SQL = """
WITH claimed AS (
    UPDATE {task_table} SET last_seq = last_seq + 1, heartbeat_at = %(now)s
    WHERE id = %(task_id)s AND claim_token = %(token)s AND status = 'running'
    RETURNING id, last_seq, attempt
)
INSERT INTO {event_table} (task_id, seq, kind, turn, tool_name, attempt, payload, full_output, ts)
SELECT id, last_seq, %(kind)s, %(turn)s, %(tool_name)s, GREATEST(attempt, 1), %(payload)s::jsonb, %(full_output)s, %(ts)s
FROM claimed
RETURNING seq, attempt
"""


def task_event_append(*, task_id: int, claim_token: uuid.UUID, event: dict) -> int:
    """Persist one loop event for the worker holding the claim and publish it after commit; return
    its sequence number. Raise ``ClaimLost`` when another worker holds the task (or it finished)."""
    kind, turn = event["kind"], event.get("turn", 0)
    ts = event.get("ts") or timezone.now().timestamp()
    payload, full_output, tool_name = _event_fields(kind, event.get("payload", {}))
    if connection.vendor == "postgresql":
        sql = _APPEND_SQL.format(task_table=AgentTask._meta.db_table, event_table=TaskEvent._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(sql, {"now": timezone.now(), "task_id": task_id, "token": claim_token, "kind": kind,
                                 "turn": turn, "tool_name": tool_name, "payload": json.dumps(payload),
                                 "full_output": full_output, "ts": ts})
            row = cursor.fetchone()
        if row is None:
            raise ClaimLost(f"task {task_id} is no longer claimed by this worker")
        seq, attempt = row
    else:
        with transaction.atomic():
            task = AgentTask.objects.select_for_update().filter(pk=task_id, claim_token=claim_token,
                                                                status=AgentTask.Status.RUNNING).first()
            if task is None:
                raise ClaimLost(f"task {task_id} is no longer claimed by this worker")
            task.last_seq += 1
            task.heartbeat_at = timezone.now()
            task.save(update_fields=["last_seq", "heartbeat_at"])
            seq, attempt = task.last_seq, max(task.attempt, 1)
            TaskEvent.objects.create(task=task, seq=seq, kind=kind, turn=turn, attempt=attempt, tool_name=tool_name,
                                     payload=payload, full_output=full_output, ts=ts)
    _publish_event_on_commit(task_id=task_id, wire=event_wire(seq=seq, kind=kind, turn=turn, ts=ts, attempt=attempt,
                                                              payload=payload, has_full_output=bool(full_output)))
    return seq


def task_heartbeat(*, task_id: int, claim_token: uuid.UUID) -> bool:
    return bool(AgentTask.objects.filter(pk=task_id, claim_token=claim_token, status=AgentTask.Status.RUNNING)
                .update(heartbeat_at=timezone.now()))


def _task_finish_row(task: AgentTask, *, status: str, reason: str) -> None:
    task.status = status
    task.status_reason = reason
    task.finished_at = timezone.now()
    task.claim_token = None
    task.save(update_fields=["status", "status_reason", "finished_at", "claim_token"])
    _publish_status_on_commit(task)


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
    _event_insert(task, kind="error", turn=0, payload={"message": reason, "infrastructure": True})
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
    return OpenAIChatPolicy(task.base_url, task.model_name, task.api_key or settings.OPENAI_API_KEY or "",
                            seed=task.policy_options.get("seed"))


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


def _heartbeat_start(*, task_id: int, token: uuid.UUID, lost: threading.Event) -> threading.Event:
    """Refresh the heartbeat until the returned event is set; set ``lost`` when the claim is gone."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(settings.AGENT_HEARTBEAT_S):
            try:
                if not task_heartbeat(task_id=task_id, claim_token=token):
                    lost.set()  # another worker took over (or the task ended): the agent must stop
                    return
            except Exception:
                logger.exception("heartbeat of task %s failed", task_id)
            finally:
                connection.close()

    threading.Thread(target=beat, name=f"heartbeat-task-{task_id}", daemon=True).start()
    return stop


def _snapshot_discard(backend, snapshot, task_id: int) -> None:
    try:
        backend.snapshot_delete(snapshot=snapshot)
    except Exception:
        logger.exception("could not delete the snapshot of task %s", task_id)


def _sandbox_prepare(task: AgentTask, limits: AgentLimits):
    """(backend, snapshot, sandbox) for one attempt; the snapshot is deleted again if no sandbox comes of it."""
    from sandboxes import get_backend
    from sandboxes.base import RepoSource, SandboxLimits

    backend = get_backend(settings.SANDBOX_BACKEND)
    if task.attempt > 1:
        # The previous attempt's worker is gone; its sandbox must not live on beside this one.
        try:
            backend.reap_orphans()
        except Exception:
            logger.exception("could not reap the sandboxes of dead workers before retrying task %s", task.pk)
    snapshot = backend.snapshot_create(source=RepoSource(kind=task.repo_kind, location=task.repo_location,
                                                         ref=task.repo_ref or None))
    try:
        sandbox = backend.sandbox_create(snapshot=snapshot, limits=SandboxLimits(
            lifetime_s=limits.wall_time_s + 300, command_timeout_s=min(120.0, limits.wall_time_s)))
    except BaseException:
        _snapshot_discard(backend, snapshot, task.pk)
        raise
    return backend, snapshot, sandbox


def task_run(*, task_id: int) -> str:
    """Claim the task, run the agent in a fresh sandbox, store every event and the outcome.

    Returns a short note for the Celery result. Errors of the sandbox or policy server end the
    task as ``failed`` with the reason; nothing is left ``running`` unless this process dies, in
    which case the sweeper (``tasks_recover_stale``) hands it to a new claim once the heartbeat
    goes stale. The agent stops at its next step once the claim is lost.
    """
    from sandboxes.base import SandboxError
    from training.agent.loop import AgentStopped, run_agent
    from webapp.agents import verify

    claimed = _db_retry(lambda: task_claim(task_id=task_id), what=f"claiming task {task_id}")
    if claimed is None:
        return "skipped: finished, cancelled or running elsewhere"
    task, token = claimed
    limits = AgentLimits.from_dict(task.limits)
    lost = threading.Event()
    stop_heartbeat = _heartbeat_start(task_id=task_id, token=token, lost=lost)

    def fail(reason: str) -> None:
        _db_retry(lambda: task_fail(task_id=task_id, claim_token=token, reason=reason), what=f"failing task {task_id}")

    backend = snapshot = sandbox = None
    try:
        try:
            policy = _policy_for(task)
            backend, snapshot, sandbox = _sandbox_prepare(task, limits)
        except (SandboxError, ValueError, OSError) as exc:
            fail(f"could not prepare the sandbox: {type(exc).__name__}: {exc}")
            return "failed: sandbox"

        def on_event(event: dict) -> None:
            try:
                task_event_append(task_id=task_id, claim_token=token, event=event)
            except ClaimLost as exc:
                raise AgentStopped(str(exc)) from exc

        def should_stop() -> str | None:
            if lost.is_set():
                return "another worker took the task over"
            current = AgentTask.objects.filter(pk=task_id).values_list("cancel_requested", "claim_token").first()
            if current is None or current[1] != token:
                lost.set()
                return "another worker took the task over"
            return "cancelled by the user" if current[0] else None

        result = run_agent(sandbox=sandbox, policy=policy, prompt=task.prompt, limits=limits, on_event=on_event,
                           should_stop=should_stop, first_seq=task.last_seq + 1)
        if result.status == AgentTask.Status.SUCCEEDED:  # the loop stopped: do the tests pass?
            verify.task_verify(task=task, claim_token=token, sandbox=sandbox, diff=result.diff, turn=result.turns,
                               on_event=on_event)
        finished = _db_retry(lambda: task_finish(task_id=task_id, claim_token=token, result=result),
                             what=f"storing the outcome of task {task_id}")
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


# --- RL rollouts ---------------------------------------------------------------------------

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
