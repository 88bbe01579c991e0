"""Per-user limits, so that one account cannot crowd out the others.

- Counts of rows (a user's tasks queued or running, a task's follow-ups waiting) are checked in the
  transaction that inserts the row, after locking a row every competing insert locks too (the user's, or
  the task's): ``SELECT ... FOR UPDATE`` on PostgreSQL; on SQLite every write transaction begins
  IMMEDIATE (webapp.settings) and so holds the database's write lock. Concurrent submissions therefore
  take turns and never pass a cap together.
- Rates (/v1 tokens per minute, upload bytes per UTC day) and /v1 requests in flight are Redis keys, each
  changed by one Lua script (atomic on the server) and given a TTL, so every web process shares them and
  a crashed process's share expires.

Over a limit a service raises LimitExceeded: a ValidationError (so the forms show its message) that the
REST error handler (webapp.core.api.exception_handler) and the OpenAI endpoint answer with 429, a
Retry-After header and the limit's name. Nothing already accepted is touched.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import uuid
from dataclasses import dataclass, field

import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError

LIMIT_EXCEEDED = "limit_exceeded"
"""Code of a LimitExceeded; the API answers 429."""

ACTIVE_TASKS = "active_tasks"
PENDING_FOLLOWUPS = "pending_followups"
V1_CONCURRENT = "v1_concurrent_requests"
V1_TOKENS_PER_MINUTE = "v1_tokens_per_minute"
UPLOAD_BYTES_PER_DAY = "upload_bytes_per_day"

_KEY = "flowstate:limit:{name}:{user}:{window}"
_DAY_S = 86_400
_MINUTE_S = 60

# Add `cost` to a window's counter unless that passes `limit`: {1, used} or {0, used}.
_CHARGE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local cost = tonumber(ARGV[1])
if used + cost > tonumber(ARGV[2]) then return {0, used} end
used = redis.call('INCRBY', KEYS[1], cost)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {1, used}
"""
# Correct a charge by `delta` (either sign) while its window's counter still exists.
_ADJUST = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('INCRBY', KEYS[1], ARGV[1])
"""
# Take one of `limit` leases (a sorted set scored by expiry, expired ones dropped first): 1 or 0.
_LEASE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[2]), ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class LimitExceeded(ValidationError):
    """A per-user limit refuses the request; `limit` names it, `retry_after` is in whole seconds."""

    def __init__(self, limit: str, message: str, *, retry_after: float) -> None:
        super().__init__(message, code=LIMIT_EXCEEDED)
        self.limit = limit
        self.retry_after = max(1, math.ceil(retry_after))

    def body(self) -> dict:
        return {"detail": self.message, "limit": self.limit, "retry_after": self.retry_after}


@functools.lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def redis_client() -> redis.Redis:
    """The shared Redis (REDIS_URL, the broker's server: unix sockets too); thread-safe, fork-safe pool."""
    return _client(settings.REDIS_URL)


def _key(name: str, user, window: int | str) -> str:
    return _KEY.format(name=name, user=user.pk, window=window)


# --- counts of rows, in the inserting transaction ---------------------------------------------

def user_lock(user) -> None:
    """Lock the user's row until the surrounding transaction ends (call inside transaction.atomic)."""
    list(get_user_model().objects.select_for_update().filter(pk=user.pk).values_list("pk", flat=True))


def active_tasks_check(*, user) -> None:
    """Refuse a new (or reopened) product task while the user has USER_MAX_ACTIVE_TASKS queued or running.
    Locks the user's row first, so two submissions at once cannot both see room for one."""
    from webapp.agents.models import AgentTask

    user_lock(user)
    limit = settings.USER_MAX_ACTIVE_TASKS
    active = AgentTask.objects.filter(owner=user, source=AgentTask.Source.PRODUCT,
                                      status__in=(AgentTask.Status.QUEUED, AgentTask.Status.RUNNING)).count()
    if active >= limit:
        raise LimitExceeded(ACTIVE_TASKS, f"you have {active} tasks queued or running; the limit is {limit}: "
                                          "wait until one finishes or cancel one", retry_after=settings.LIMIT_RETRY_AFTER_S)


def pending_followups_check(*, task) -> None:
    """Refuse a follow-up while TASK_MAX_PENDING_FOLLOWUPS wait for the task's agent (the caller holds the
    task's row lock, which every follow-up sender takes)."""
    from webapp.agents.models import TaskFollowUp

    limit = settings.TASK_MAX_PENDING_FOLLOWUPS
    pending = task.followups.filter(status=TaskFollowUp.Status.PENDING).count()
    if pending >= limit:
        raise LimitExceeded(PENDING_FOLLOWUPS, f"{pending} follow-ups already wait for the agent; the limit is "
                                               f"{limit}: wait until it takes them", retry_after=settings.LIMIT_RETRY_AFTER_S)


# --- rates and leases, in Redis ----------------------------------------------------------------

def _charge(key: str, cost: int, limit: int, ttl_s: int) -> tuple[bool, int]:
    allowed, used = redis_client().eval(_CHARGE, 1, key, cost, limit, ttl_s)
    return bool(allowed), int(used)


def _adjust(key: str, delta: int) -> None:
    if delta:
        redis_client().eval(_ADJUST, 1, key, delta)


@contextlib.contextmanager
def upload_allowance(*, user, size: int):
    """Charge `size` bytes to the user's uploads of this UTC day, refusing past USER_MAX_UPLOAD_BYTES_PER_DAY;
    the charge is given back when the body raises (the upload was refused and not kept)."""
    now = time.time()
    day = int(now // _DAY_S)
    key = _key(UPLOAD_BYTES_PER_DAY, user, day)
    limit = settings.USER_MAX_UPLOAD_BYTES_PER_DAY
    allowed, used = _charge(key, size, limit, _DAY_S + 60)
    if not allowed:
        raise LimitExceeded(UPLOAD_BYTES_PER_DAY, f"you uploaded {used} bytes today (UTC); this upload of {size} "
                                                  f"bytes would pass the daily limit of {limit} bytes",
                            retry_after=(day + 1) * _DAY_S - now)
    try:
        yield
    except BaseException:
        _adjust(key, -size)
        raise


def upload_bytes_today(*, user) -> int:
    value = redis_client().get(_key(UPLOAD_BYTES_PER_DAY, user, int(time.time() // _DAY_S)))
    return int(value or 0)


@dataclass
class V1Usage:
    """One /v1 request's lease among its user's requests in flight and its token reservation; `finish`
    (idempotent) gives the lease back and settles the reservation to the tokens really used."""

    lease_key: str
    lease_id: str
    tokens_key: str
    reserved: int
    finished: bool = field(default=False)

    def finish(self, *, used_tokens: int) -> None:
        if self.finished:
            return
        self.finished = True
        client = redis_client()
        client.zrem(self.lease_key, self.lease_id)
        _adjust(self.tokens_key, used_tokens - self.reserved)


def v1_request_begin(*, user, tokens: int) -> V1Usage:
    """Take one of the user's USER_MAX_V1_CONCURRENT places and reserve `tokens` (capped at the per-minute
    limit, so one large request still fits an empty minute) of this minute's USER_MAX_V1_TOKENS_PER_MINUTE."""
    now = time.time()
    lease_key = _key(V1_CONCURRENT, user, "leases")
    lease_id = uuid.uuid4().hex
    concurrent = settings.USER_MAX_V1_CONCURRENT
    lease_ms = settings.V1_REQUEST_LEASE_S * 1000
    if not redis_client().eval(_LEASE, 1, lease_key, int(now * 1000), lease_ms, concurrent, lease_id):
        raise LimitExceeded(V1_CONCURRENT, f"you have {concurrent} /v1 requests in flight, the limit; wait for "
                                           "one to finish", retry_after=settings.LIMIT_RETRY_AFTER_S)
    minute = int(now // _MINUTE_S)
    tokens_key = _key(V1_TOKENS_PER_MINUTE, user, minute)
    per_minute = settings.USER_MAX_V1_TOKENS_PER_MINUTE
    reserved = max(1, min(int(tokens), per_minute))
    try:
        allowed, used = _charge(tokens_key, reserved, per_minute, _MINUTE_S * 2)
    except BaseException:
        redis_client().zrem(lease_key, lease_id)
        raise
    if not allowed:
        redis_client().zrem(lease_key, lease_id)
        raise LimitExceeded(V1_TOKENS_PER_MINUTE, f"{used} tokens used or reserved this minute; this request may "
                                                  f"use {reserved} more, past the limit of {per_minute} per minute",
                            retry_after=(minute + 1) * _MINUTE_S - now)
    return V1Usage(lease_key, lease_id, tokens_key, reserved)


def limits_of(user) -> list[dict]:
    """The limits that apply to `user`, with what is in use now where that is cheap to know (account page)."""
    from webapp.agents.models import AgentTask

    active = AgentTask.objects.filter(owner=user, source=AgentTask.Source.PRODUCT,
                                      status__in=(AgentTask.Status.QUEUED, AgentTask.Status.RUNNING)).count()
    now = time.time()
    client = redis_client()
    in_flight: int | None = None
    tokens: int | None = None
    uploaded: int | None = None
    try:  # the page still shows the limits when Redis does not answer
        in_flight = int(client.zcount(_key(V1_CONCURRENT, user, "leases"), int(now * 1000), "+inf"))
        tokens = int(client.get(_key(V1_TOKENS_PER_MINUTE, user, int(now // _MINUTE_S))) or 0)
        uploaded = upload_bytes_today(user=user)
    except redis.RedisError:
        pass
    return [
        {"name": ACTIVE_TASKS, "label": "Tasks queued or running", "limit": settings.USER_MAX_ACTIVE_TASKS, "used": active},
        {"name": PENDING_FOLLOWUPS, "label": "Follow-ups waiting, per task", "limit": settings.TASK_MAX_PENDING_FOLLOWUPS,
         "used": None},
        {"name": V1_CONCURRENT, "label": "/v1 requests in flight", "limit": settings.USER_MAX_V1_CONCURRENT,
         "used": in_flight},
        {"name": V1_TOKENS_PER_MINUTE, "label": "/v1 tokens this minute", "limit": settings.USER_MAX_V1_TOKENS_PER_MINUTE,
         "used": tokens},
        {"name": UPLOAD_BYTES_PER_DAY, "label": "Upload bytes today (UTC)", "limit": settings.USER_MAX_UPLOAD_BYTES_PER_DAY,
         "used": uploaded},
    ]
