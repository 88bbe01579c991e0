#!/usr/bin/env bash
# Bring compose.yaml up from the application image and check it end to end:
#   * migrations ran against PostgreSQL (the one-shot `migrate` service exited 0; showmigrations
#     lists no unapplied migration; django_migrations rows read in the `db` service);
#   * web answers GET /healthz (database, Redis, Celery workers, Ray) through the published port;
#   * a Celery worker consumes: a core.worker_probe task sent to the maintenance queue writes its
#     row in PostgreSQL (read back from the database).
#
# Usage: scripts/compose_smoke.sh [up|check|down]      (default: up, then check)
# Environment: COMPOSE (default: `docker compose` if the plugin answers, else `docker-compose`),
#   PROJECT (flowstate), WEB_PORT (8000), SERVICES (which services to start; default all of them),
#   SECRET_KEY / POSTGRES_PASSWORD (generated into var/compose-smoke.env on first use, kept there).
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=${PROJECT:-flowstate}
export WEB_PORT=${WEB_PORT:-8000}
if [ -z "${COMPOSE:-}" ]; then
  if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"; else COMPOSE="docker-compose"; fi
fi
ENV_FILE=var/compose-smoke.env
mkdir -p var
if [ ! -f "$ENV_FILE" ]; then
  umask 077
  {
    echo "SECRET_KEY=$(head -c 48 /dev/urandom | base64 | tr -d '/+=' | head -c 60)"
    echo "POSTGRES_PASSWORD=$(head -c 24 /dev/urandom | base64 | tr -d '/+=' | head -c 30)"
  } > "$ENV_FILE"
fi
set -a; . "$ENV_FILE"; set +a
compose() { $COMPOSE -p "$PROJECT" -f compose.yaml "$@"; }

up() {
  # shellcheck disable=SC2086
  compose up -d ${SERVICES:-}
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then echo "timed out waiting for $what" >&2; return 1; fi
    sleep 2
  done
}

check() {
  echo "== migrate (one-shot) =="
  local migrate
  migrate=$(compose ps -q migrate)
  docker inspect -f 'state={{.State.Status}} exit={{.State.ExitCode}}' "$migrate"
  [ "$(docker inspect -f '{{.State.ExitCode}}' "$migrate")" = 0 ]
  wait_for 300 "the web service" compose exec -T web true
  echo "unapplied migrations: $(compose exec -T web python manage.py showmigrations --plan | grep -c '^\[ \]' || true)"
  compose exec -T db psql -h /tmp -U postgres -d flowstate -Atc \
    "SELECT 'django_migrations rows: ' || count(*) FROM django_migrations"

  echo "== web /healthz =="
  wait_for 300 "web /healthz" curl -fsS "http://127.0.0.1:${WEB_PORT}/healthz"
  curl -sS "http://127.0.0.1:${WEB_PORT}/healthz" | python3 -m json.tool

  echo "== a Celery worker consumes (maintenance queue) =="
  local nonce="smoke-$(date +%s)-$$"
  compose exec -T web python manage.py shell -c \
    "from webapp.core.tasks import worker_probe; print('sent', worker_probe.delay('$nonce').id)"
  wait_for 120 "the probe's row" sh -c "$COMPOSE -p $PROJECT -f compose.yaml exec -T db psql -h /tmp -U postgres \
    -d flowstate -Atc \"SELECT 1 FROM core_workerprobe WHERE nonce = '$nonce'\" | grep -q 1"
  compose exec -T db psql -h /tmp -U postgres -d flowstate -Atc \
    "SELECT 'probe row: ' || nonce || ' by ' || worker_hostname || ' pid ' || worker_pid FROM core_workerprobe WHERE nonce = '$nonce'"
  echo "== services =="
  compose ps
}

case "${1:-all}" in
  up) up ;;
  check) check ;;
  down) compose down -v ;;
  all) up; check ;;
  *) echo "usage: $0 [up|check|down]" >&2; exit 2 ;;
esac
