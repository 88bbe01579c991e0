"""Per-user limits, attacked as a flooding user would: past each limit the flooder gets 429 with Retry-After
and the limit's name while another user is unaffected; concurrent submissions cannot pass a cap together;
what was accepted before the refusal is kept. Real database, real Redis."""

from __future__ import annotations

import io
import threading
import zipfile

import pytest
from django.db import connection

from webapp.agents import services
from webapp.agents.models import AgentTask, TaskFollowUp

pytestmark = pytest.mark.usefixtures("fresh_limit_keys")


def _task_body(repository) -> dict:
    return {"prompt": "Fix it", "backend": "scripted", "repository_id": repository.pk}


def _assert_refused(response, limit: str) -> None:
    assert response.status_code == 429, response.content
    assert int(response["Retry-After"]) >= 1
    assert response.json()["limit"] == limit and response.json()["detail"], response.json()


@pytest.mark.django_db
def test_a_flooder_gets_429_at_the_active_task_cap_and_others_still_submit(owner, outsider, demo_repository, team,
                                                                           api_client_for, settings):
    settings.USER_MAX_ACTIVE_TASKS = 3
    flooder = api_client_for(owner)
    accepted = [flooder.post("/api/tasks/", _task_body(demo_repository), format="json") for _ in range(3)]
    assert [r.status_code for r in accepted] == [201, 201, 201]
    refused = flooder.post("/api/tasks/", _task_body(demo_repository), format="json")
    _assert_refused(refused, "active_tasks")
    assert int(refused["Retry-After"]) == settings.LIMIT_RETRY_AFTER_S
    # Nothing already queued is lost, and the refusal created nothing.
    queued = AgentTask.objects.filter(owner=owner, status="queued")
    assert sorted(queued.values_list("pk", flat=True)) == sorted(r.json()["id"] for r in accepted)
    # Another user is unaffected.
    other_repo = services.repository_create(owner=outsider, name="r", kind="path", location=demo_repository.location,
                                            allow_server_path=True)
    assert api_client_for(outsider).post("/api/tasks/", _task_body(other_repo), format="json").status_code == 201
    # A finished task frees a place.
    AgentTask.objects.filter(pk=accepted[0].json()["id"]).update(status="succeeded")
    assert flooder.post("/api/tasks/", _task_body(demo_repository), format="json").status_code == 201


@pytest.mark.django_db(transaction=True)
def test_concurrent_submissions_cannot_pass_the_active_task_cap(owner, demo_repository, settings):
    settings.USER_MAX_ACTIVE_TASKS = 4
    start = threading.Barrier(12)
    outcomes: list[str] = []

    def submit():
        try:
            start.wait()
            services.task_create(owner=owner, prompt="p", backend="scripted", repository=demo_repository, enqueue=False)
            outcomes.append("created")
        except services.ValidationError as exc:
            outcomes.append(getattr(exc, "limit", repr(exc)))
        finally:
            connection.close()

    threads = [threading.Thread(target=submit) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(outcomes) == ["active_tasks"] * 8 + ["created"] * 4, outcomes
    assert AgentTask.objects.filter(owner=owner, status="queued").count() == 4


@pytest.mark.django_db
def test_follow_ups_past_the_cap_get_429_and_the_waiting_ones_stay(owner, outsider, demo_repository, api_client_for,
                                                                  settings):
    settings.TASK_MAX_PENDING_FOLLOWUPS = 3
    task = services.task_create(owner=owner, prompt="Fix it", backend="scripted", repository=demo_repository,
                                enqueue=False)
    AgentTask.objects.filter(pk=task.pk).update(status="running")
    url = f"/api/tasks/{task.pk}/followups/"
    flooder = api_client_for(owner)
    sent = [flooder.post(url, {"message": f"also {i}"}, format="json").status_code for i in range(3)]
    assert sent == [202, 202, 202]
    _assert_refused(flooder.post(url, {"message": "one more"}, format="json"), "pending_followups")
    assert list(task.followups.order_by("id").values_list("message", "status")) == [
        (f"also {i}", TaskFollowUp.Status.PENDING) for i in range(3)]
    # The cap is per task: the other user's task takes follow-ups.
    other_repo = services.repository_create(owner=outsider, name="r", kind="path", location=demo_repository.location,
                                            allow_server_path=True)
    other = services.task_create(owner=outsider, prompt="p", backend="scripted", repository=other_repo, enqueue=False)
    AgentTask.objects.filter(pk=other.pk).update(status="running")
    assert api_client_for(outsider).post(f"/api/tasks/{other.pk}/followups/", {"message": "hi"},
                                         format="json").status_code == 202


@pytest.mark.django_db
def test_a_follow_up_cannot_reopen_a_task_past_the_active_task_cap(owner, demo_repository, api_client_for, settings):
    settings.USER_MAX_ACTIVE_TASKS = 1
    finished = services.task_create(owner=owner, prompt="p", backend="scripted", repository=demo_repository,
                                    enqueue=False)
    AgentTask.objects.filter(pk=finished.pk).update(status="succeeded")
    services.task_create(owner=owner, prompt="q", backend="scripted", repository=demo_repository, enqueue=False)
    response = api_client_for(owner).post(f"/api/tasks/{finished.pk}/followups/", {"message": "more"}, format="json")
    _assert_refused(response, "active_tasks")
    finished.refresh_from_db()
    assert finished.status == "succeeded" and not finished.followups.exists()


def _zip_upload(name: str = "repo.zip") -> io.BytesIO:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("a.py", "x = 1\n" * 20)
    upload = io.BytesIO(buffer.getvalue())
    upload.name = name
    return upload


@pytest.mark.django_db
def test_upload_bytes_per_day_past_the_cap_get_429_and_others_still_upload(owner, outsider, api_client_for, settings,
                                                                         tmp_path):
    settings.STATE_DIR = tmp_path
    size = len(_zip_upload().getvalue())
    settings.USER_MAX_UPLOAD_BYTES_PER_DAY = int(size * 2.5)
    flooder = api_client_for(owner)
    body = {"prompt": "x", "backend": "scripted"}
    garbage = io.BytesIO(b"garbage" * 40)
    garbage.name = "junk.zip"
    assert flooder.post("/api/tasks/", {**body, "archive": garbage}, format="multipart").status_code == 400
    # The refused archive was not kept, so it is not charged: two good ones still fit.
    for _ in range(2):
        assert flooder.post("/api/tasks/", {**body, "archive": _zip_upload()}, format="multipart").status_code == 201
    refused = flooder.post("/api/tasks/", {**body, "archive": _zip_upload()}, format="multipart")
    _assert_refused(refused, "upload_bytes_per_day")
    assert 1 <= int(refused["Retry-After"]) <= 86_400
    repo = flooder.post("/api/repositories/", {"name": "r", "kind": "archive", "archive": _zip_upload()},
                        format="multipart")
    _assert_refused(repo, "upload_bytes_per_day")
    assert AgentTask.objects.filter(owner=owner).count() == 2
    assert len(list((tmp_path / "uploads").iterdir())) == 2
    other = api_client_for(outsider).post("/api/tasks/", {**body, "archive": _zip_upload()}, format="multipart")
    assert other.status_code == 201, other.content


@pytest.mark.django_db
def test_the_account_page_shows_the_limits(owner, settings):
    from django.test import Client

    settings.USER_MAX_ACTIVE_TASKS = 7
    client = Client()
    client.force_login(owner)
    page = client.get("/account/").content.decode()
    for name in ("active_tasks", "pending_followups", "v1_concurrent_requests", "v1_tokens_per_minute",
                 "upload_bytes_per_day"):
        assert name in page
    assert "<td>7</td>" in page
