"""/metrics: Prometheus text format computed from the real database and broker, for staff or a token."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.django_db


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _task(owner, status, seconds=None, **extra):
    from webapp.agents.models import AgentTask

    now = timezone.now()
    return AgentTask.objects.create(
        owner=owner, repo_kind="path", repo_location="/srv/demo", repo_label="demo", prompt="p", backend="scripted",
        model_name="scripted", status=status, started_at=None if seconds is None else now - timedelta(seconds=seconds),
        finished_at=None if seconds is None else now, **extra,
    )


@pytest.fixture
def staff(db):
    from webapp.accounts.services import user_create

    return user_create(username="operator", password="operator-pass-123", is_staff=True)


def test_metrics_refuse_anonymous_users_non_staff_and_wrong_tokens(owner, settings):
    settings.METRICS_TOKEN = "scrape-secret-0123456789"
    anonymous = Client().get("/metrics")
    assert anonymous.status_code == 401 and anonymous["WWW-Authenticate"].startswith("Bearer")
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret-012345678").status_code == 401
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Token scrape-secret-0123456789").status_code == 401
    member = Client()
    member.force_login(owner)
    assert member.get("/metrics").status_code == 403
    scraper = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret-0123456789")
    assert scraper.status_code == 200 and scraper["Content-Type"].startswith("text/plain; version=")
    settings.METRICS_TOKEN = None
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401  # no token set: none works


def test_metrics_report_tasks_sandboxes_queues_and_experiments(owner, staff):
    from webapp.celery import app
    from webapp.core.metrics import EVENT_LATENCY, observe_live_message
    from webapp.experiments.models import Experiment, ExperimentStep
    from webapp.fleet.models import SandboxHost, SandboxRecord

    _task(owner, "succeeded", seconds=3)
    _task(owner, "succeeded", seconds=100)
    _task(owner, "failed", seconds=700)
    _task(owner, "queued")
    _task(owner, "running", source="training")
    host = SandboxHost.objects.create(name="node-a", last_heartbeat_at=timezone.now(), queue_product=2, queue_training=5)
    SandboxHost.objects.create(name="node-gone", state="lost", last_heartbeat_at=timezone.now(), queue_product=9)
    for index, state in enumerate(("busy", "busy", "idle", "destroyed")):
        SandboxRecord.objects.create(sandbox_id=f"sb-{index}", host=host, state=state)
    experiment = Experiment.objects.create(owner=owner, name="grpo", config={}, status="running")
    ExperimentStep.objects.create(experiment=experiment, step=1, metrics={"rollouts_per_s": 1.0})
    ExperimentStep.objects.create(experiment=experiment, step=2,
                                  metrics={"rollouts_per_s": 2.5, "stage_seconds": {"update": 0.75}})
    app.control.purge()
    for _ in range(3):  # nothing consumes these: a task name no worker has
        app.send_task("flowstate.metrics_probe_never_registered")
    before = {(s.name, s.labels.get("le")): s.value for s in EVENT_LATENCY.collect()[0].samples}
    observe_live_message({"type": "task.event", "seq": 0, "last_seq": 0, "ts": time.time() - 0.3, "text": "{}"})

    client = Client()
    client.force_login(staff)
    response = client.get("/metrics")
    app.control.purge()
    assert response.status_code == 200
    samples = _samples(response.content.decode())

    assert samples[("flowstate_tasks", (("source", "product"), ("status", "succeeded")))] == 2
    assert samples[("flowstate_tasks", (("source", "product"), ("status", "queued")))] == 1
    assert samples[("flowstate_tasks", (("source", "training"), ("status", "running")))] == 1
    assert samples[("flowstate_tasks", (("source", "product"), ("status", "cancelled")))] == 0
    ok = ("status", "succeeded")
    assert samples[("flowstate_task_duration_seconds_bucket", (("le", "1.0"), ok))] == 0
    assert samples[("flowstate_task_duration_seconds_bucket", (("le", "5.0"), ok))] == 1
    assert samples[("flowstate_task_duration_seconds_bucket", (("le", "120.0"), ok))] == 2
    assert samples[("flowstate_task_duration_seconds_count", (ok,))] == 2
    assert samples[("flowstate_task_duration_seconds_sum", (ok,))] == pytest.approx(103, abs=0.5)
    assert samples[("flowstate_task_duration_seconds_bucket", (("le", "600.0"), ("status", "failed")))] == 0
    assert samples[("flowstate_task_duration_seconds_bucket", (("le", "+Inf"), ("status", "failed")))] == 1

    assert samples[("flowstate_sandboxes", (("host", "node-a"), ("state", "busy")))] == 2
    assert samples[("flowstate_sandboxes", (("host", "node-a"), ("state", "idle")))] == 1
    assert samples[("flowstate_admission_queue_length", (("host", "node-a"), ("purpose", "training")))] == 5
    assert ("flowstate_admission_queue_length", (("host", "node-gone"), ("purpose", "product"))) not in samples
    # Unrouted tasks go to the maintenance queue (settings.CELERY_TASK_ROUTES); every named queue is reported.
    assert samples[("flowstate_celery_queue_depth", (("queue", "maintenance"),))] == 3
    assert samples[("flowstate_celery_queue_depth", (("queue", "agents"),))] == 0
    label = (("experiment", str(experiment.pk)),)
    assert samples[("flowstate_experiment_rollouts_per_second", label)] == 2.5
    assert samples[("flowstate_experiment_update_seconds", label)] == 0.75
    latency = "flowstate_event_delivery_latency_seconds"
    assert samples[(f"{latency}_count", ())] == before[(f"{latency}_count", None)] + 1
    # Observed 0.3 s: in the 0.5 s bucket, not in the 0.25 s one.
    assert samples[(f"{latency}_bucket", (("le", "0.5"),))] == before[(f"{latency}_bucket", "0.5")] + 1
    assert samples[(f"{latency}_bucket", (("le", "0.25"),))] == before[(f"{latency}_bucket", "0.25")]


def test_metrics_report_semantic_index_builds_from_their_progress_files(staff, settings, tmp_path):
    from sandboxes.semantic.progress import IndexProgressWriter

    settings.SEMANTIC_INDEX_ROOT = str(tmp_path)
    for snapshot in ("snap-a", "snap-b", "snap-c", "snap-d", "snap-e", "snap-f"):
        (tmp_path / snapshot).mkdir()  # the builder writes its progress file beside the index directory
    building = IndexProgressWriter(directory=tmp_path / "snap-a" / "minilm", snapshot_id="snap-a", encoder="minilm",
                                   chunks_total=10)
    building.advance(3)
    building._write(force=True)  # advance writes at most every half second
    finished = IndexProgressWriter(directory=tmp_path / "snap-b" / "minilm", snapshot_id="snap-b", encoder="minilm",
                                   chunks_total=4)
    finished.finish()
    failed = IndexProgressWriter(directory=tmp_path / "snap-c" / "minilm", snapshot_id="snap-c", encoder="minilm",
                                 chunks_total=5)
    failed.finish(error="encoder crashed")
    (tmp_path / "snap-d" / "minilm.progress.json").write_text("{not json")  # ignored, not an error
    queued = IndexProgressWriter(directory=tmp_path / "snap-e" / "minilm", snapshot_id="snap-e", encoder="minilm",
                                 chunks_total=0, state="queued")  # started with its task, waits for a slot
    queued.queued(chunks_total=7)
    cancelled = IndexProgressWriter(directory=tmp_path / "snap-f" / "minilm", snapshot_id="snap-f",
                                    encoder="minilm", chunks_total=2)
    cancelled.finish(error="its task ended", cancelled=True)

    client = Client()
    client.force_login(staff)
    samples = _samples(client.get("/metrics").content.decode())

    builds = "flowstate_semantic_index_builds"
    assert samples[(builds, (("state", "building"),))] == 1
    assert samples[(builds, (("state", "ready"),))] == 1
    assert samples[(builds, (("state", "failed"),))] == 1
    assert samples[(builds, (("state", "stalled"),))] == 0
    assert samples[(builds, (("state", "queued"),))] == 1
    assert samples[(builds, (("state", "cancelled"),))] == 1
    assert samples[("flowstate_semantic_index_chunks", (("kind", "done"),))] == 3
    assert samples[("flowstate_semantic_index_chunks", (("kind", "total"),))] == 10 + 7  # building + queued
