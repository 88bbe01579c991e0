"""Django settings for Flowstate.

Everything deployment-specific comes from environment variables read through ``webapp.env``
helpers, which refuse bad values. With no variables set, the embedded defaults apply: SQLite in
``var/``, the embedded Redis that ``make run`` starts on a unix socket, the local sandbox backend
and a local Ray instance. ``FLOWSTATE_PROFILE=production`` switches on the hardened profile that
passes ``manage.py check --deploy``.
"""

from __future__ import annotations

import os
from pathlib import Path

import environ
from kombu import Exchange, Queue

from sandboxes.paths import default_sandbox_root
from webapp.env import (
    ConfigurationError,
    env_bool,
    env_choice,
    env_int,
    env_list,
    env_optional,
    env_runtime_list,
    env_str,
)

BASE_DIR = Path(__file__).resolve().parent.parent
STATE_DIR = Path(env_str("FLOWSTATE_STATE_DIR", str(BASE_DIR / "var")))

PROFILE = env_choice("FLOWSTATE_PROFILE", "development", ["development", "production", "test"])
PRODUCTION = PROFILE == "production"

DEBUG = env_bool("DEBUG", default=not PRODUCTION)
if PRODUCTION and DEBUG:
    raise ConfigurationError("DEBUG must be off when FLOWSTATE_PROFILE=production")

_DEV_SECRET = "flowstate-development-key-not-for-production-use-0123456789abcdefghij"
SECRET_KEY = env_str("SECRET_KEY", None if PRODUCTION else _DEV_SECRET)
if PRODUCTION and (SECRET_KEY == _DEV_SECRET or len(SECRET_KEY) < 50):
    raise ConfigurationError("SECRET_KEY must be a random string of at least 50 characters in production")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", [] if PRODUCTION else ["127.0.0.1", "localhost", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI / Redoc assets served from here, never a CDN
    "django_celery_results",
    "channels",
    "webapp.accounts",
    "webapp.core",
    "webapp.agents",
    "webapp.fleet",
    "webapp.experiments",
    "webapp.mining",
    "webapp.registry",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "webapp.urls"
ASGI_APPLICATION = "webapp.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -----------------------------------------------------------------------------
DATABASE_URL = env_str("DATABASE_URL", f"sqlite:///{STATE_DIR / 'flowstate.sqlite3'}")
try:
    _db = environ.Env.db_url_config(DATABASE_URL)
except Exception as exc:  # django-environ raises several types for malformed URLs
    raise ConfigurationError(f"DATABASE_URL={DATABASE_URL!r} cannot be parsed: {exc}") from exc
if _db["ENGINE"] not in ("django.db.backends.sqlite3", "django.db.backends.postgresql"):
    raise ConfigurationError("DATABASE_URL must be a sqlite:// or postgres:// URL")
if _db["ENGINE"] == "django.db.backends.sqlite3":
    # The ASGI server, the Celery worker and its pool, the fleet and experiment drivers write at
    # once. WAL lets readers run beside the one writer; IMMEDIATE takes the write lock when a
    # transaction begins, so a reader never has to upgrade to a writer mid-transaction (that
    # upgrade fails at once with "database is locked", busy timeout or not); the busy timeout
    # (the `timeout` Django passes to sqlite3, and the pragma for connections made elsewhere)
    # makes a writer wait its turn instead of failing.
    SQLITE_BUSY_TIMEOUT_S = env_int("SQLITE_BUSY_TIMEOUT_S", 30, minimum=1)
    _db.setdefault("OPTIONS", {}).update({
        "timeout": SQLITE_BUSY_TIMEOUT_S,
        "transaction_mode": "IMMEDIATE",
        "init_command": (f"PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; "
                         f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_S * 1000};"),
    })
    # A file (not :memory:) so worker and server child processes in tests share the test
    # database; the pid keeps concurrent test runs on one machine apart.
    _db["TEST"] = {"NAME": str(STATE_DIR / f"test-flowstate-{os.getpid()}.sqlite3")}
else:
    _db["CONN_MAX_AGE"] = env_int("DATABASE_CONN_MAX_AGE", 0, minimum=0)
    _db["TEST"] = {"NAME": f"test_{_db['NAME']}_{os.getpid()}"}
DATABASES = {"default": _db}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis: Celery broker and Channels layer --------------------------------------------------
EMBEDDED_REDIS_SOCKET = STATE_DIR / "redis.sock"
REDIS_URL = env_str("REDIS_URL", f"unix://{EMBEDDED_REDIS_SOCKET}")
if not REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
    raise ConfigurationError("REDIS_URL must start with redis://, rediss:// or unix://")


def _celery_broker_url(url: str) -> str:
    # kombu spells a unix socket as redis+socket:///path
    if url.startswith("unix://"):
        return "redis+socket://" + url[len("unix://"):]
    return url


CELERY_BROKER_URL = _celery_broker_url(REDIS_URL)
CELERY_RESULT_BACKEND = "django-db"
CELERY_RESULT_EXTENDED = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SOFT_TIME_LIMIT = env_int("CELERY_TASK_SOFT_TIME_LIMIT", 3600, minimum=1)
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 3900, minimum=1)
if CELERY_TASK_TIME_LIMIT <= CELERY_TASK_SOFT_TIME_LIMIT:
    raise ConfigurationError(
        "CELERY_TASK_TIME_LIMIT must exceed CELERY_TASK_SOFT_TIME_LIMIT so tasks can clean up"
    )
# With acks_late a message stays "unacked" in Redis until its task ends; one whose worker died is
# given out again after the visibility timeout. The agents' sweeper (webapp.agents.tasks) does not
# wait for that: every AGENT_SWEEP_S it re-sends queued tasks that have no message waiting in the
# queue and takes over running ones whose heartbeat is stale. A redelivery of a message whose task
# still runs is harmless (the claim skips a task with a fresh heartbeat), so the timeout only
# bounds how long a message of a dead worker lingers; keep it above the hard time limit.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": CELERY_TASK_TIME_LIMIT + 600}
# A worker that loses the broker cancels its running tasks (their messages are redelivered) rather
# than finishing work nobody can acknowledge; the claim token keeps the redelivery from running twice.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_TRACK_STARTED = True
CELERY_TASK_ALWAYS_EAGER = False
# Named queues (docs/DEPLOY.md): agent tasks, experiment control and maintenance each have their own,
# so a burst on one never starves another when a worker serves it; unrouted tasks go to maintenance.
FLOWSTATE_CELERY_QUEUES = ("agents", "experiments", "maintenance")
CELERY_TASK_DEFAULT_QUEUE = "maintenance"
# Declared, so a worker started without -Q consumes every queue instead of only the default one; each
# with its own exchange and routing key, as Celery creates a missing queue (a bare Queue(name) binds all
# three to the default exchange and key).
CELERY_TASK_QUEUES = tuple(Queue(name, Exchange(name), routing_key=name) for name in FLOWSTATE_CELERY_QUEUES)
CELERY_TASK_ROUTES = {
    "agents.*": {"queue": "agents"},
    "experiments.*": {"queue": "experiments"},
    "core.*": {"queue": "maintenance"},
    "mining.*": {"queue": "maintenance"},
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "capacity": 5000, "expiry": 60},
    },
    # Live agent events: Redis pub/sub delivers each event once per server process, which fans it
    # out to its own viewers in memory (hundreds of viewers of one task cost one Redis message).
    # Nothing is buffered for absent viewers: they resume from the database.
    "agents-live": {
        "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL]},
    },
}

# --- Compute backends ---------------------------------------------------------------------
SANDBOX_BACKEND = env_choice("SANDBOX_BACKEND", "local", ["local", "docker"])
SANDBOX_IMAGE = env_str("SANDBOX_IMAGE", "flowstate-sandbox:latest")
# OCI runtime of the Docker backend's containers: runc, or runsc (gVisor) once registered with the
# engine (docs/SECURITY.md); the backend and /healthz refuse a runtime the engine lacks.
SANDBOX_DOCKER_RUNTIME = env_str("SANDBOX_DOCKER_RUNTIME", "runc")
# The isolation tiers a task may choose (the task form's and API's sandbox_runtime), e.g. "runc,runsc";
# each must be registered with the engine. Default: SANDBOX_DOCKER_RUNTIME alone.
SANDBOX_RUNTIMES_ALLOWED = env_runtime_list("SANDBOX_RUNTIMES_ALLOWED", [SANDBOX_DOCKER_RUNTIME])
# Default: var/sandboxes, or /var/lib/flowstate/sandboxes-<hash> when root runs a checkout that
# other users cannot traverse (sandboxes.paths explains why).
SANDBOX_ROOT = Path(env_str("SANDBOX_ROOT", str(default_sandbox_root(STATE_DIR))))
RAY_ADDRESS = env_optional("RAY_ADDRESS")
# Where cloud-agent (product) tasks get their sandbox: on the Celery worker's machine with
# SANDBOX_BACKEND, or `fleet`: from the Ray sandbox fleet (fleet_serve's hosts, needs RAY_ADDRESS).
# Unset: SANDBOX_BACKEND (read when a task starts).
AGENT_SANDBOX_BACKEND = env_choice("AGENT_SANDBOX_BACKEND", "", ["", "local", "docker", "fleet"]) or None
MODEL_CHECKPOINT = env_optional("FLOWSTATE_MODEL_CHECKPOINT")
MODELS_ROOT = Path(env_str("FLOWSTATE_MODELS_ROOT", str(STATE_DIR / "models")))
# Context (prompt + completion tokens) a registered model is served with: sizes each of its KV cache's slots,
# capped by the model's own max_position_embeddings.
MODELS_SERVING_CONTEXT = env_int("FLOWSTATE_MODELS_SERVING_CONTEXT", 4096, minimum=256, maximum=1_048_576)
# /metrics: staff sessions, or a scraper sending `Authorization: Bearer <METRICS_TOKEN>` (unset: staff only).
METRICS_TOKEN = env_optional("METRICS_TOKEN")
OPENAI_BASE_URL = env_optional("OPENAI_BASE_URL")
OPENAI_API_KEY = env_optional("OPENAI_API_KEY")
OPENAI_MODEL = env_optional("OPENAI_MODEL")
# Cloud agents: a running task refreshes its heartbeat every AGENT_HEARTBEAT_S; a worker that finds
# one silent for AGENT_STALE_AFTER_S treats its worker as dead and retries it (up to AGENT_MAX_ATTEMPTS).
AGENT_HEARTBEAT_S = env_int("AGENT_HEARTBEAT_S", 5, minimum=1)
AGENT_STALE_AFTER_S = env_int("AGENT_STALE_AFTER_S", 60, minimum=2)
if AGENT_STALE_AFTER_S <= AGENT_HEARTBEAT_S:
    raise ConfigurationError("AGENT_STALE_AFTER_S must exceed AGENT_HEARTBEAT_S, or live tasks look dead")
AGENT_MAX_ATTEMPTS = env_int("AGENT_MAX_ATTEMPTS", 2, minimum=1)
# Verified results: the repository's tests run after the agent stops, for at most this long.
AGENT_VERIFY_TIMEOUT_S = env_int("AGENT_VERIFY_TIMEOUT_S", 300, minimum=10)
# Environment setup of registered repositories (webapp.mining, training.tasks.environment): the setup phase
# may reach the package index; test runs never have network.
REPO_SETUP_NETWORK = env_bool("REPO_SETUP_NETWORK", default=True)
REPO_SETUP_TIMEOUT_S = env_int("REPO_SETUP_TIMEOUT_S", 600, minimum=10, maximum=7200)
REPO_SETUP_DISK_MB = env_int("REPO_SETUP_DISK_MB", 2048, minimum=64, maximum=65536)
REPO_TEST_TIMEOUT_S = env_int("REPO_TEST_TIMEOUT_S", 600, minimum=5, maximum=7200)
MINING_MAX_CANDIDATES = env_int("MINING_MAX_CANDIDATES", 2000, minimum=1, maximum=100_000)
# Follow-ups: after a task finishes, its worker keeps the sandbox warm this long for a follow-up
# message (0: never; a follow-up then rebuilds the workspace from snapshot + patch). The worker's slot
# is held meanwhile, and it lets go early when other agent tasks wait.
AGENT_FOLLOWUP_WARM_S = env_int("AGENT_FOLLOWUP_WARM_S", 120, minimum=0, maximum=3600)
# Fernet key (urlsafe base64 of 32 bytes) encrypting repository push credentials; in development it
# is derived from SECRET_KEY, in production it must be set before credentials can be stored.
CREDENTIALS_KEY = env_optional("FLOWSTATE_CREDENTIALS_KEY")
# How often each worker's sweeper looks for queued tasks without a message and stale running ones,
# and how long a queued task may lack a message before it is sent again (covers the commit->send gap).
AGENT_SWEEP_S = env_int("AGENT_SWEEP_S", max(2, AGENT_STALE_AFTER_S // 2), minimum=1)
AGENT_QUEUED_GRACE_S = env_int("AGENT_QUEUED_GRACE_S", 30, minimum=1)
# Where workers reach this server's /v1 endpoint for the built-in model; empty: the submitting request's host.
AGENT_BUILTIN_BASE_URL = env_optional("AGENT_BUILTIN_BASE_URL")
AGENT_BUILTIN_MODEL_NAME = env_str("AGENT_BUILTIN_MODEL_NAME", "flowstate")
# Upper bounds of user input (webapp.core.validation): forms, API and services refuse more, naming the field.
AGENT_MAX_TURNS = env_int("AGENT_MAX_TURNS", 500, minimum=1)
AGENT_MAX_TOKENS = env_int("AGENT_MAX_TOKENS", 10_000_000, minimum=16)
AGENT_MAX_CONTEXT_TOKENS = env_int("AGENT_MAX_CONTEXT_TOKENS", 1_048_576, minimum=256)
AGENT_MAX_WALL_TIME_S = env_int("AGENT_MAX_WALL_TIME_S", 86_400, minimum=10)
EXPERIMENT_MAX_STEPS = env_int("EXPERIMENT_MAX_STEPS", 1_000_000, minimum=1, maximum=2**31 - 1)
EXPERIMENT_MAX_WORKERS = env_int("EXPERIMENT_MAX_WORKERS", 1024, minimum=1)
API_MAX_PAGE_SIZE = env_int("API_MAX_PAGE_SIZE", 500, minimum=1)
API_MAX_OFFSET = env_int("API_MAX_OFFSET", 1_000_000_000, minimum=0, maximum=2**62)
# Per-user limits (webapp.accounts.limits), so one account cannot crowd out the others: over one, the
# request is refused with 429, a Retry-After header and the limit's name; nothing already queued is lost.
USER_MAX_ACTIVE_TASKS = env_int("FLOWSTATE_USER_MAX_ACTIVE_TASKS", 8, minimum=1)
TASK_MAX_PENDING_FOLLOWUPS = env_int("FLOWSTATE_TASK_MAX_PENDING_FOLLOWUPS", 5, minimum=1)
USER_MAX_V1_CONCURRENT = env_int("FLOWSTATE_USER_MAX_V1_CONCURRENT", 8, minimum=1)
USER_MAX_V1_TOKENS_PER_MINUTE = env_int("FLOWSTATE_USER_MAX_V1_TOKENS_PER_MINUTE", 200_000, minimum=256)
USER_MAX_UPLOAD_BYTES_PER_DAY = env_int("FLOWSTATE_USER_MAX_UPLOAD_BYTES_PER_DAY", 1024 * 1024 * 1024, minimum=1024)
# Retry-After of a refused count (tasks, follow-ups, /v1 requests in flight): when one ends is unknown.
LIMIT_RETRY_AFTER_S = env_int("FLOWSTATE_LIMIT_RETRY_AFTER_S", 10, minimum=1, maximum=3600)
# A /v1 request's place among its user's requests in flight expires after this long even if the process
# serving it died without giving it back.
V1_REQUEST_LEASE_S = env_int("FLOWSTATE_V1_REQUEST_LEASE_S", 3600, minimum=10)
# Batch slots of the shared model kept for users holding none, so a newcomer never waits for another
# user's long generations to finish (training.serving_scheduler).
SERVING_RESERVED_SLOTS = env_int("FLOWSTATE_SERVING_RESERVED_SLOTS", 1, minimum=0)
HEALTHZ_PROBE_TIMEOUT_S = 1.5
"""/healthz waits this long for each dependency (all at once), so it answers within 2 s when one stalls."""
MAX_UPLOAD_BYTES = env_int("FLOWSTATE_MAX_UPLOAD_BYTES", 50 * 1024 * 1024, minimum=1024)
# Most path components in a member of an uploaded archive (a/b/c.py has 3): refused at submission
# with a 400 on the archive field, and again by the extractor (sandboxes.settings.archive_max_depth).
ARCHIVE_MAX_DEPTH = env_int("FLOWSTATE_ARCHIVE_MAX_DEPTH", 64, minimum=1, maximum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_UPLOAD_BYTES
FILE_UPLOAD_MAX_MEMORY_SIZE = 5 * 1024 * 1024
# Request bodies (webapp.core.body_limit, around the whole ASGI app): a longer one is refused with 413
# before it is read, declared or streamed, signed in or not. The archive upload endpoints take an archive
# of up to MAX_UPLOAD_BYTES plus FLOWSTATE_UPLOAD_FORM_BYTES for the form's other fields and multipart framing.
MAX_REQUEST_BYTES = env_int("FLOWSTATE_MAX_REQUEST_BYTES", 10 * 1024 * 1024, minimum=1024)
MAX_UPLOAD_REQUEST_BYTES = MAX_UPLOAD_BYTES + env_int("FLOWSTATE_UPLOAD_FORM_BYTES", 1024 * 1024, minimum=1024)
# Snapshots, uploads and dead sandboxes older than this are deleted by manage.py gc_sandboxes (which
# every agent worker also runs every SANDBOX_GC_INTERVAL_S); anything a live task or sandbox uses is kept.
SANDBOX_RETENTION_S = env_int("FLOWSTATE_SANDBOX_RETENTION_S", 3 * 24 * 3600, minimum=60)
SANDBOX_GC_INTERVAL_S = env_int("FLOWSTATE_SANDBOX_GC_INTERVAL_S", 3600, minimum=10)
# Git hosts whose internal (loopback/private) addresses may be cloned from; all others must be public.
GIT_ALLOWED_HOSTS = [host.lower() for host in env_list("FLOWSTATE_GIT_ALLOWED_HOSTS", [])]

# --- Auth ------------------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "webapp.core.api.BoundedLimitOffsetPagination",
    "DEFAULT_PARSER_CLASSES": [
        "webapp.core.api.FiniteJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "EXCEPTION_HANDLER": "webapp.core.api.exception_handler",
    "PAGE_SIZE": 50,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Flowstate API",
    "DESCRIPTION": "Cloud coding agents, rollout traces, RL experiments and the sandbox fleet.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # One schema name per choice set, so `check --deploy` stays free of naming warnings.
    "ENUM_NAME_OVERRIDES": {
        "RepositoryKindEnum": "webapp.agents.models.Repository.Kind",
    },
}

# --- Static files ----------------------------------------------------------------------------
STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
SERVE_STATIC = env_bool("SERVE_STATIC", not PRODUCTION)
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(STATE_DIR / "staticfiles")))

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# --- Production hardening ------------------------------------------------------------------
if PRODUCTION:
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_CONTENT_TYPE_NOSNIFF = True
    if not ALLOWED_HOSTS:
        raise ConfigurationError("ALLOWED_HOSTS must list the public host names in production")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_choice("LOG_LEVEL", "INFO", ["DEBUG", "INFO", "WARNING", "ERROR"])},
}
