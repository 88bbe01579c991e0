"""A task's event rows and its channel messages: every write of an event and every publish of it.

Events are committed first and published after commit (``webapp.core.publish``) to the task's group;
a viewer that misses a message reads the stored events after its cursor.
"""

from __future__ import annotations

import json
import uuid

from django.db import connection, transaction
from django.utils import timezone

from webapp.agents.models import AgentTask, TaskEvent
from webapp.agents.selectors import event_to_wire, event_wire, task_group_name
from webapp.agents.storable import DISPLAY_CHARS, storable_text
from webapp.core.publish import publish


class ClaimLost(Exception):
    """Another worker took the task over (or it finished); this worker must stop writing."""


def task_publish(*, task_id: int, message: dict) -> None:
    # The final status waits briefly so a process that exits right after (demo seeding) still sends it.
    final = message.get("type") == "task.status" and message.get("status") in AgentTask.FINISHED
    publish(group=task_group_name(task_id=task_id), message=message, wait_s=2.0 if final else 0.0)


def task_status_publish_on_commit(task: AgentTask) -> None:
    message = {"type": "task.status", "status": task.status, "reason": task.status_reason, "last_seq": task.last_seq}
    transaction.on_commit(lambda: task_publish(task_id=task.pk, message=message))


def event_fields(kind: str, payload: dict) -> tuple[dict, str, str]:
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


def event_publish_on_commit(*, task_id: int, wire: dict) -> None:
    # Serialised once here instead of once per viewer: a task may have hundreds of viewers.
    message = {"type": "task.event", "seq": wire["seq"], "ts": wire["ts"], "event_json": json.dumps(wire)}
    transaction.on_commit(lambda: task_publish(task_id=task_id, message=message))


def event_insert(task: AgentTask, *, kind: str, turn: int, payload: dict, ts: float | None = None) -> TaskEvent:
    """Insert the next event of a locked task row and publish it after commit."""
    payload, full_output, tool_name = event_fields(kind, payload)
    task.last_seq += 1
    event = TaskEvent.objects.create(
        task=task, seq=task.last_seq, kind=kind, turn=turn, attempt=max(task.attempt, 1), tool_name=tool_name,
        payload=payload, full_output=full_output, ts=ts if ts is not None else timezone.now().timestamp(),
    )
    event_publish_on_commit(task_id=task.pk, wire=event_to_wire(event=event))
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
    payload, full_output, tool_name = event_fields(kind, event.get("payload", {}))
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
    event_publish_on_commit(task_id=task_id, wire=event_wire(seq=seq, kind=kind, turn=turn, ts=ts, attempt=attempt,
                                                              payload=payload, has_full_output=bool(full_output)))
    return seq
