"""The task page follows the semantic index build of the task's snapshot (issue 53).

A run records its snapshot on the task and starts its index build at once; the page and its JSON
endpoint read the build's progress file (the same one ``/metrics`` sums) and go from "queued" through
"building" to "ready" when the build ends.
"""

from __future__ import annotations

import time
import uuid

import pytest
from django.test import Client

from sandboxes.semantic import progress
from sandboxes.semantic.progress import IndexProgressWriter
from webapp.agents import services

pytestmark = pytest.mark.django_db


def _browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def shared_task(owner, team, demo_repository):
    return services.task_create(owner=owner, team=team, prompt="Fix the median bug", repository=demo_repository,
                                backend="scripted", enqueue=False)


def test_a_run_records_the_snapshot_it_works_on(shared_task):
    assert shared_task.snapshot_id == ""
    services.task_run(task_id=shared_task.pk)
    shared_task.refresh_from_db()
    assert shared_task.status == "succeeded" and shared_task.snapshot_id


def test_a_run_starts_the_index_build_when_its_sandbox_is_ready_not_at_the_first_search(
    shared_task, settings, tmp_path
):
    """The build starts as soon as the run's start event is stored (the attempt is on record first), before
    any of the agent's steps, so the page shows it from the start and long before the first search."""
    from sandboxes.semantic.progress import index_progress_list
    from webapp.agents.models import TaskEvent

    settings.SEMANTIC_INDEX_ROOT = str(tmp_path / "index")
    services.task_run(task_id=shared_task.pk)
    shared_task.refresh_from_db()
    deadline = time.monotonic() + 120
    while True:  # the build thread may still be loading the encoder when the run is over
        (row,) = index_progress_list(index_root=tmp_path / "index", snapshot_id=shared_task.snapshot_id)
        if row.state not in ("queued", "building") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    events = TaskEvent.objects.filter(task=shared_task).order_by("seq")
    start, first_step = events[0], events[1]
    assert start.kind == "start"
    first_search = events.filter(tool_name="semantic_search").first().ts
    assert start.ts <= row.started_at < first_step.ts <= first_search, (start.ts, row.started_at, first_step.ts,
                                                                         first_search)
    # The scripted agent searched once; its run ended with the build ready, or stopped with the run.
    assert row.state in ("ready", "cancelled"), row


def test_snapshot_is_recorded_only_under_the_current_claim(shared_task):
    assert not services.task_snapshot_record(task_id=shared_task.pk, claim_token=uuid.uuid4(), snapshot_id="snap-x")
    shared_task.refresh_from_db()
    assert shared_task.snapshot_id == ""


def test_task_page_shows_the_build_and_switches_when_ready(
    shared_task, owner, teammate, outsider, settings, tmp_path, monkeypatch
):
    settings.SEMANTIC_INDEX_ROOT = str(tmp_path / "index")
    shared_task.snapshot_id = "snap-53"
    shared_task.save(update_fields=["snapshot_id"])
    url, api = f"/tasks/{shared_task.pk}/", f"/tasks/{shared_task.pk}/index-progress/"
    owner_client = _browser(owner)
    assert owner_client.get(api).json() == {"progress": None}  # nothing built for this snapshot yet
    assert 'data-state="none"' in owner_client.get(url).content.decode()

    monkeypatch.setattr(progress, "_WRITE_EVERY_S", 0.0)  # every advance() is written at once
    for name in ("other", "snap-53"):
        (tmp_path / "index" / name).mkdir(parents=True)
    other = IndexProgressWriter(directory=tmp_path / "index" / "other" / "tag", snapshot_id="other-snapshot",
                                encoder="tag", chunks_total=5)
    writer = IndexProgressWriter(directory=tmp_path / "index" / "snap-53" / "tag", snapshot_id="snap-53",
                                 encoder="tag", chunks_total=10)
    writer.advance(3)
    for user in (owner, teammate):
        body = _browser(user).get(api).json()["progress"]
        assert body["state"] == "building" and (body["chunks_done"], body["chunks_total"]) == (3, 10)
        page = _browser(user).get(url).content.decode()
        assert 'data-state="building"' in page and "3 of 10 chunks encoded" in page and "BM25" in page
    assert _browser(outsider).get(api).status_code == 404
    assert _browser(outsider).get(url).status_code == 404

    queued = IndexProgressWriter(directory=tmp_path / "index" / "snap-53" / "tag2", snapshot_id="snap-53",
                                 encoder="tag2", chunks_total=0, state="queued")  # the newest build is shown
    assert "chunking the snapshot" in owner_client.get(api).json()["progress"]["label"]
    queued.queued(chunks_total=10)
    body = owner_client.get(api).json()["progress"]
    assert body["state"] == "queued" and "10 chunks wait for an encoding slot" in body["label"]
    assert 'data-state="queued"' in owner_client.get(url).content.decode()
    (tmp_path / "index" / "snap-53" / "tag2.progress.json").unlink()

    writer.finish()
    other.advance(1)  # another snapshot's build does not leak into this task's page
    body = owner_client.get(api).json()["progress"]
    assert body["state"] == "ready" and body["chunks_done"] == 10
    page = owner_client.get(url).content.decode()
    assert 'data-state="ready"' in page and "10 chunks, semantic_search answers from the embedding index" in page
